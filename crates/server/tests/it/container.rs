//! The container backend through the real daemon binary, on the real
//! dockerd (`scripts/dockerd.sh start`) with kici-scaler's real nftables
//! rules: `kici-scaler run` and `kici-scaler serve` run jobs in containers
//! of the FROM scratch test image (the static `kici-agent-lite` plus
//! busybox, `scripts/build-test-image.sh`), and stale egress rules are swept
//! at start-up and by the reconciler.
//!
//! Every test names what it creates after a random tag and removes it on
//! drop, failure included: its image, the containers of its daemon's
//! instance, that instance's nftables and `DOCKER-USER` rules. Waits are
//! on events (log lines, SSE events, process exits); [`PATIENCE`] only turns
//! a hang into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_model::{AgentId, InstanceId};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");
const PATIENCE: Duration = Duration::from_secs(90);
/// The daemon's agent network (its default).
const SUBNET: &str = "172.29.0.0/16";
const BRIDGE: &str = "kici-scaler0";
const OWNER_LABEL: &str = "dev.kici.scaler.instance";

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tool(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    format!("{}{}", text(&out.stdout), text(&out.stderr))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One test's world: a temp dir, its own test image, and on drop the
/// removal of everything carrying the instances it was told about.
struct World {
    dir: tempfile::TempDir,
    image: String,
    instances: Vec<InstanceId>,
}

impl World {
    fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        let tag: u32 = rand::random();
        let image = format!("kici-scaler-test-agent:{tag:08x}");
        let out = Command::new(repo_file("scripts/build-test-image.sh"))
            .arg(&image)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "build-test-image.sh: {}",
            text(&out.stderr)
        );
        std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
        World {
            dir,
            image,
            instances: Vec::new(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// One container scaler with the test image.
    fn config(&self, name: &str) -> PathBuf {
        let path = self.path("scalers.yaml");
        std::fs::write(
            &path,
            format!(
                "version: 1\nscalers:\n  - name: {name}\n    type: container\n    maxAgents: 2\n    runtime: docker\n    labelSets:\n      - labels: [linux, box]\n        image: \"{}\"\n        imagePullPolicy: IfNotPresent\n",
                self.image
            ),
        )
        .unwrap();
        path
    }

    /// The binary with a clean environment (no `KICI_*` but the test API
    /// token) and `XDG_RUNTIME_DIR` in the test dir (where `run` keeps its
    /// state dir).
    fn command(&self) -> Command {
        let mut cmd = Command::new(BIN);
        for (k, _) in std::env::vars() {
            if k.starts_with("KICI_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("XDG_RUNTIME_DIR", self.path("tmp")).env(
            "KICI_SCALER_API_TOKEN",
            crate::common::daemon::TEST_API_TOKEN,
        );
        cmd
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for instance in &self.instances {
            for name in containers_of(*instance) {
                let _ = tool("docker", &["rm", "-f", "-v", &name]);
            }
            // Agent rules first, then the instance's subnet rules (and its
            // DOCKER-USER accepts: ensure in that mode, then tear down).
            let instance = *instance;
            let _ = std::thread::spawn(move || {
                runtime().block_on(async {
                    if let Ok(table) = egress_table(instance).await {
                        let _ = table.sweep_stale(&[]).await;
                        let _ = table.teardown().await;
                    }
                })
            })
            .join();
        }
        let _ = tool("docker", &["rmi", "-f", &self.image]);
    }
}

/// The daemon's egress table as the test sees it (same instance, subnet
/// and bridge; `DOCKER-USER` handled as the daemon does).
async fn egress_table(
    instance: InstanceId,
) -> Result<kici_netpolicy::EgressTable, kici_netpolicy::NetPolicyError> {
    kici_netpolicy::EgressTable::ensure(
        instance,
        SUBNET.parse().unwrap(),
        kici_netpolicy::TableOptions {
            agent_bridge: Some(BRIDGE.to_owned()),
            docker_user: kici_netpolicy::DockerUserMode::AcceptSubnet,
            ..kici_netpolicy::TableOptions::default()
        },
    )
    .await
}

/// Installs default-policy rules for an agent that has no container.
fn plant_rule(instance: InstanceId, ip: &str) -> AgentId {
    let agent = AgentId::random(kici_model::ScalerType::Container);
    let ip: std::net::Ipv4Addr = ip.parse().unwrap();
    let [a, b, c, d] = ip.octets();
    runtime().block_on(async {
        egress_table(instance)
            .await
            .unwrap()
            .install(
                &agent,
                &kici_netpolicy::AgentMatch {
                    ip,
                    mac: [0x02, 0x42, a, b, c, d],
                    port: None,
                },
                &kici_netpolicy::EgressPolicy::from_config(None),
            )
            .await
            .unwrap();
    });
    agent
}

/// Agents of `instance` with rules in kici-scaler's tables.
fn agents_with_rules(instance: InstanceId) -> Vec<String> {
    runtime().block_on(async {
        egress_table(instance)
            .await
            .unwrap()
            .owned()
            .await
            .unwrap()
            .into_iter()
            .map(|o| o.agent.to_string())
            .collect()
    })
}

/// Names of the containers carrying `instance`'s owner label, any state.
fn containers_of(instance: InstanceId) -> Vec<String> {
    tool(
        "docker",
        &[
            "ps",
            "-a",
            "--filter",
            &format!("label={OWNER_LABEL}={instance}"),
            "--format",
            "{{.Names}}",
        ],
    )
    .lines()
    .filter(|l| !l.is_empty())
    .map(str::to_owned)
    .collect()
}

/// Every nftables and `DOCKER-USER` rule mentioning `instance`.
fn rules_of(instance: InstanceId) -> Vec<String> {
    let tag = format!("kici-scaler:{instance}");
    let mut all = tool("nft", &["list", "ruleset"]);
    all.push_str(&tool("iptables", &["-S", "DOCKER-USER"]));
    all.lines()
        .filter(|l| l.contains(&tag))
        .map(str::to_owned)
        .collect()
}

/// Leases and agent rows of `instance` in its SQLite store.
fn store_rows(state_dir: &Path, instance: InstanceId) -> (usize, usize) {
    runtime().block_on(async {
        let url: kici_store::StoreUrl = format!("sqlite:{}", state_dir.join("state.db").display())
            .parse()
            .unwrap();
        let store = kici_store::open(&url, instance, kici_store::StoreOptions::default())
            .await
            .unwrap();
        let leases = store.leases().await.unwrap().len();
        let agents = store.agents().await.unwrap().len();
        store.close().await;
        (leases, agents)
    })
}

// ------------------------------------------------------------------ run

#[test]
fn serial_run_runs_a_job_in_a_container_and_leaves_nothing() {
    let mut world = World::new();
    let config = world.config("boxes");
    let out = world
        .command()
        // The in-process daemon's instance id, for the checks below.
        .env("KICI_SCALER_LOG", "error,kici_scaler::cli::run=info")
        .args(["run", "--config"])
        .arg(&config)
        .args(["--labels", "box", "--", "sh", "-c", "echo hi; exit 3"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    let instance: InstanceId = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["fields"]["message"] == "run: in-process daemon")
        .and_then(|v| v["fields"]["instance"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("no instance in {stderr}"))
        .parse()
        .unwrap();
    world.instances.push(instance);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(text(&out.stdout), "hi\n");
    // Nothing of the run is left: containers, rules (the agent's and the
    // instance's own), its temporary state dir (store, leases).
    assert_eq!(containers_of(instance), Vec::<String>::new());
    assert_eq!(rules_of(instance), Vec::<String>::new());
    let left: Vec<_> = std::fs::read_dir(world.path("tmp").join("kici-scaler"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

// ---------------------------------------------------------------- serve

struct Daemon {
    child: Child,
    addr: String,
    instance: InstanceId,
    lines: mpsc::Receiver<String>,
    /// Every line read so far.
    seen: Vec<String>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn start(world: &mut World, config: &Path, extra: &[&str]) -> Daemon {
        let mut child = world
            .command()
            .arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--state-dir")
            .arg(world.path("state"))
            .arg("--machine-ledger-dir")
            .arg(world.path("ledger"))
            .args(["--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut d = Daemon {
            child,
            addr: String::new(),
            instance: InstanceId::random(),
            lines,
            seen: Vec::new(),
        };
        let listening = d.wait_for(|v| v["fields"]["message"] == "control API listening");
        d.addr = listening["fields"]["addr"].as_str().unwrap().to_owned();
        d.instance = listening["fields"]["instance"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        if !world.instances.contains(&d.instance) {
            world.instances.push(d.instance);
        }
        d
    }

    /// The first log line (JSON) from now on that `matches`.
    fn wait_for(&mut self, matches: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "no such log line; the daemon said:\n{}",
                    self.seen.join("\n")
                )
            });
            self.seen.push(line.clone());
            let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            if matches(&v) {
                return v;
            }
        }
    }

    /// SIGTERM, and the exit code.
    fn stop(&mut self) -> Option<i32> {
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        )
        .unwrap();
        let code = self.child.wait().unwrap().code();
        self.seen.extend(self.lines.try_iter());
        code
    }

    fn post_job(&self, labels: &[&str], command: &[&str]) -> Value {
        let body = serde_json::json!({"labels": labels, "command": command}).to_string();
        let (status, body) = http(&self.addr, "POST", "/v1/jobs", Some(&body));
        assert_eq!(status, 202, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    fn job(&self, id: &str) -> Value {
        let (status, body) = http(&self.addr, "GET", &format!("/v1/jobs/{id}"), None);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

/// One HTTP/1.0 request with the test API token; panics if the daemon
/// cannot be reached.
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let (status, body) = crate::common::daemon::http(addr, method, path, &[], body);
    assert_ne!(status, 0, "{method} {path}: the daemon did not answer");
    (status, body)
}

/// `GET /v1/jobs/{id}/logs` (SSE), read as it comes.
struct Logs {
    stream: std::net::TcpStream,
    raw: String,
    head_done: bool,
    stdout: String,
    end: Option<Value>,
}

impl Logs {
    fn open(addr: &str, id: &str) -> Self {
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        write!(
            stream,
            "GET /v1/jobs/{id}/logs HTTP/1.0\r\nAuthorization: Bearer {}\r\n\r\n",
            crate::common::daemon::TEST_API_TOKEN
        )
        .unwrap();
        Self {
            stream,
            raw: String::new(),
            head_done: false,
            stdout: String::new(),
            end: None,
        }
    }

    fn until_stdout(&mut self, needle: &str) {
        while !self.stdout.contains(needle) {
            assert!(
                self.end.is_none(),
                "ended without {needle:?}: {:?}",
                self.end
            );
            assert!(self.read_more(), "stream ended without {needle:?}");
        }
    }

    fn until_end(&mut self) -> Value {
        while self.read_more() {}
        self.end.clone().expect("no end event")
    }

    fn read_more(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        let n = self.stream.read(&mut buf).unwrap();
        if n == 0 {
            return false;
        }
        self.raw.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        if !self.head_done {
            let Some(i) = self.raw.find("\r\n\r\n") else {
                return true;
            };
            assert!(self.raw.contains(" 200 "), "{}", self.raw);
            self.raw.drain(..i + 4);
            self.head_done = true;
        }
        while let Some(end) = self.raw.find("\n\n") {
            let block: String = self.raw.drain(..end + 2).collect();
            let mut event = String::new();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim_start());
                }
            }
            match event.as_str() {
                "output" => {
                    let v: Value = serde_json::from_str(&data).unwrap();
                    if v["stream"] == "stdout" {
                        let chunk: kici_protocol::ChunkData =
                            serde_json::from_value(v["data"].clone()).unwrap();
                        self.stdout
                            .push_str(&String::from_utf8(chunk.into_bytes()).unwrap());
                    }
                }
                "end" => self.end = Some(serde_json::from_str(&data).unwrap()),
                _ => {}
            }
        }
        true
    }
}

fn is_gone(v: &Value, agent: &str) -> bool {
    let line = v.to_string();
    line.contains(agent) && line.contains("\"to\":\"gone\"")
}

#[test]
fn serial_serve_runs_a_posted_job_in_a_container_and_leaves_nothing() {
    let mut world = World::new();
    let config = world.config("boxes");
    let mut d = Daemon::start(&mut world, &config, &[]);
    let accepted = d.post_job(&["box"], &["sh", "-c", "echo hi; exit 3"]);
    let id = accepted["jobId"].as_str().unwrap().to_owned();
    let mut logs = Logs::open(&d.addr, &id);
    let end = logs.until_end();
    assert_eq!(end["state"], "failed", "{end}");
    assert_eq!(end["exitCode"], 3, "{end}");
    assert_eq!(end["end"], "exited", "{end}");
    assert_eq!(logs.stdout, "hi\n");
    let job = d.job(&id);
    assert_eq!(job["exitCode"], 3);
    let agent = job["agentId"].as_str().unwrap().to_owned();
    assert!(agent.starts_with("scaler-container-"), "{job}");
    d.wait_for(|v| is_gone(v, &agent));
    // The agent left nothing: container, rules, lease.
    assert_eq!(containers_of(d.instance), Vec::<String>::new());
    assert!(!agents_with_rules(d.instance).contains(&agent));
    assert_eq!(d.stop(), Some(0), "{}", d.seen.join("\n"));
    assert_eq!(store_rows(&world.path("state"), d.instance), (0, 0));
}

#[test]
fn serial_stale_rules_are_swept_at_start_up_and_by_the_reconciler() {
    let mut world = World::new();
    let config = world.config("boxes");
    // A first run mints the instance id (the rules below are its own).
    let mut first = Daemon::start(&mut world, &config, &[]);
    let instance = first.instance;
    assert_eq!(first.stop(), Some(0));

    // A crash left rules behind for an agent whose container is gone.
    let dead = plant_rule(instance, "172.29.250.250").to_string();
    assert!(agents_with_rules(instance).contains(&dead));
    let mut d = Daemon::start(&mut world, &config, &["--reconcile-interval-seconds", "1"]);
    assert_eq!(d.instance, instance);
    // Swept before the daemon listens (before any spawn).
    assert!(!agents_with_rules(instance).contains(&dead));
    assert!(
        d.seen
            .iter()
            .any(|l| l.contains("start-up: egress rules") && l.contains(&dead)),
        "{}",
        d.seen.join("\n")
    );

    // A live agent keeps its rules through the reconciler's sweep.
    let accepted = d.post_job(&["box"], &["sh", "-c", "echo started; exec sleep 1000"]);
    let id = accepted["jobId"].as_str().unwrap().to_owned();
    let mut logs = Logs::open(&d.addr, &id);
    logs.until_stdout("started\n");
    let live = d.job(&id)["agentId"].as_str().unwrap().to_owned();
    assert!(agents_with_rules(instance).contains(&live));
    let stale = plant_rule(instance, "172.29.250.251").to_string();
    d.wait_for(|v| {
        v["fields"]["message"] == "reconcile: egress rules of an agent without a resource removed"
            && v["fields"]["agent_id"] == stale.as_str()
    });
    let with_rules = agents_with_rules(instance);
    assert!(!with_rules.contains(&stale), "{with_rules:?}");
    assert!(with_rules.contains(&live), "{with_rules:?}");

    // Shutdown destroys the agent: its rules and container go with it.
    assert_eq!(d.stop(), Some(0), "{}", d.seen.join("\n"));
    assert!(!agents_with_rules(instance).contains(&live));
    assert_eq!(containers_of(instance), Vec::<String>::new());
    assert_eq!(store_rows(&world.path("state"), instance), (0, 0));
}

// --------------------------------------------------------------- doctor

/// `kici-scaler doctor` runs serve's start-up check of each container
/// scaler: the runtime and its API version, the network; a runtime that
/// does not answer fails its row.
#[test]
fn serial_doctor_checks_each_container_scalers_runtime() {
    let world = World::new();
    let good = world.config("boxes");
    let dead = world.path("dead.yaml");
    std::fs::write(
        &dead,
        std::fs::read_to_string(&good).unwrap().replace(
            "    runtime: docker\n",
            &format!(
                "    runtime: docker\n    socketPath: {}\n",
                world.path("no-engine.sock").display()
            ),
        ),
    )
    .unwrap();
    let doctor = |config: &Path| {
        let out = world
            .command()
            .args(["doctor", "--json", "--config"])
            .arg(config)
            .arg("--state-dir")
            .arg(world.path("state"))
            .output()
            .unwrap();
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}{}", text(&out.stdout), text(&out.stderr)));
        let row = report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["check"] == "container[boxes]")
            .cloned()
            .unwrap_or_else(|| panic!("no container row: {report}"));
        (out.status.code(), row)
    };
    // (Other rows depend on the host: only this one is judged.)
    let (_, row) = doctor(&good);
    assert_eq!(row["status"], "ok", "{row}");
    let detail = row["detail"].as_str().unwrap();
    assert!(detail.starts_with("docker "), "{detail}");
    assert!(
        detail.contains("(API 1.41) at unix:///var/run/docker.sock"),
        "{detail}"
    );
    assert!(detail.contains("network "), "{detail}");
    let (code, row) = doctor(&dead);
    assert_eq!(row["status"], "fail", "{row}");
    assert_ne!(code, Some(0));
    let detail = row["detail"].as_str().unwrap();
    assert!(
        detail.contains("no-engine.sock") && detail.contains("does not answer"),
        "{detail}"
    );
}

// --------------------------------------------------------------- podman

const PODMAN_SOCKET: &str = "/run/podman/podman.sock";

fn podman_answers() -> bool {
    Command::new("curl")
        .args(["-fsS", "--unix-socket", PODMAN_SOCKET, "http://d/_ping"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Rootful `podman system service` on its standard socket, started in its
/// own session (it outlives the test, as kici-container's Podman tests
/// leave it) unless it answers already.
fn ensure_podman_service() {
    if podman_answers() {
        return;
    }
    std::fs::create_dir_all("/run/podman").unwrap();
    let started = Command::new("setsid")
        .args(["-f", "podman", "system", "service", "--time=0"])
        .arg(format!("unix://{PODMAN_SOCKET}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(started.success(), "cannot start podman system service");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !podman_answers() {
        assert!(Instant::now() < deadline, "podman does not answer");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `kici-scaler run` on Podman with the daemon's backend settings from the
/// environment: the ulimits these hosts need and a network of its own
/// (name, subnet, bridge), so it can sit next to dockerd's.
///
/// The agent exits on its own after the job while `run` destroys it: on
/// Podman 4.3 its inspect then answers the state `stopped` (Podman's own,
/// until its cleanup ran), which bollard cannot read; destroy failed there
/// and left the container and its rules behind (kici_container::states).
/// Nothing may be left: no container, no rule.
#[test]
fn serial_run_on_podman_with_ulimits_and_its_own_network_from_settings() {
    ensure_podman_service();
    let world = World::new();
    let tag: u32 = rand::random();
    let image = format!("localhost/kici-scaler-test-podman:{tag:08x}");
    let network = format!("kici-tpr-{tag:08x}");
    let bridge = format!("kr{tag:08x}");
    let subnet = format!("10.{}.{}.0/24", 100 + tag % 150, (tag >> 8) % 256);
    struct PodmanLeftovers {
        image: String,
        network: String,
        subnet: String,
        bridge: String,
        instance: Option<InstanceId>,
    }
    impl Drop for PodmanLeftovers {
        fn drop(&mut self) {
            if let Some(instance) = self.instance {
                let names = tool(
                    "podman",
                    &[
                        "ps",
                        "-a",
                        "--filter",
                        &format!("label={OWNER_LABEL}={instance}"),
                        "--format",
                        "{{.Names}}",
                    ],
                );
                for name in names.lines().filter(|l| !l.is_empty()) {
                    let _ = tool("podman", &["rm", "-f", "-v", name]);
                }
                // The instance's rules, had destroy left them.
                let (subnet, bridge) = (self.subnet.clone(), self.bridge.clone());
                let _ = std::thread::spawn(move || {
                    runtime().block_on(async {
                        let table = kici_netpolicy::EgressTable::ensure(
                            instance,
                            subnet.parse().unwrap(),
                            kici_netpolicy::TableOptions {
                                agent_bridge: Some(bridge),
                                docker_user: kici_netpolicy::DockerUserMode::AcceptSubnet,
                                ..kici_netpolicy::TableOptions::default()
                            },
                        )
                        .await;
                        if let Ok(table) = table {
                            let _ = table.sweep_stale(&[]).await;
                            let _ = table.teardown().await;
                        }
                    })
                })
                .join();
            }
            let _ = tool("podman", &["network", "rm", "-f", &self.network]);
            let _ = tool("podman", &["rmi", "-f", &self.image]);
        }
    }
    let mut leftovers = PodmanLeftovers {
        image: image.clone(),
        network: network.clone(),
        subnet: subnet.clone(),
        bridge: bridge.clone(),
        instance: None,
    };
    let out = Command::new(repo_file("scripts/build-test-image.sh"))
        .arg(&image)
        .env("KICI_IMAGE_CLI", "podman")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let config = world.path("podman.yaml");
    std::fs::write(
        &config,
        format!(
            "version: 1\nscalers:\n  - name: pods\n    type: container\n    maxAgents: 1\n    runtime: podman\n    labelSets:\n      - labels: [linux, pod]\n        image: \"{image}\"\n        imagePullPolicy: IfNotPresent\n"
        ),
    )
    .unwrap();
    let out = world
        .command()
        .env(
            "KICI_SCALER_LOG",
            "warn,kici_scaler::cli::run=info,kici_container=debug",
        )
        .env(
            "KICI_SCALER_CONTAINER_ULIMITS",
            "nofile=20000:20000,nproc=4096:4096",
        )
        .env("KICI_SCALER_CONTAINER_NETWORK", &network)
        .env("KICI_SCALER_CONTAINER_SUBNET", &subnet)
        .env("KICI_SCALER_CONTAINER_BRIDGE", &bridge)
        .args(["run", "--config"])
        .arg(&config)
        .args([
            "--labels",
            "pod",
            "--",
            "sh",
            "-c",
            "echo hi; ulimit -n; exit 3",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    let instance: Option<InstanceId> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["fields"]["message"] == "run: in-process daemon")
        .and_then(|v| {
            v["fields"]["instance"]
                .as_str()
                .and_then(|i| i.parse().ok())
        });
    leftovers.instance = instance;
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(text(&out.stdout), "hi\n20000\n");
    let net: Value =
        serde_json::from_str(&tool("podman", &["network", "inspect", &network])).unwrap();
    assert_eq!(net[0]["subnets"][0]["subnet"], subnet.as_str(), "{net}");
    assert_eq!(net[0]["network_interface"], bridge.as_str(), "{net}");
    let instance = instance.unwrap();
    let left = tool(
        "podman",
        &[
            "ps",
            "-a",
            "--filter",
            &format!("label={OWNER_LABEL}={instance}"),
            "-q",
        ],
    );
    assert!(left.trim().is_empty(), "{left}\n{stderr}");
    assert_eq!(rules_of(instance), Vec::<String>::new());
}
