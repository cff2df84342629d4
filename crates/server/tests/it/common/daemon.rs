//! The real `kici-scaler serve` process for integration tests: a private
//! directory (config, state dir, ledger) and the running daemon, read
//! through its JSON log lines and its API over plain HTTP/1.0.
//!
//! One harness for every test that runs the daemon (`daemon.rs`,
//! `recovery.rs`, `postgres.rs`, `durable.rs`, `reconcile.rs`).

use serde_json::Value;
use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");

/// Longest any single expected log line, answer or state may take; only a
/// safety net against a hung daemon (nothing waits for it on success).
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Where this host's cgroup v2 hierarchy is mounted (the bare-metal
/// backend's agents live under `kici-scaler/<instance>/<scaler>/<agent>`).
pub const CGROUP_V2: &str = "/sys/fs/cgroup/unified";

/// A bare-metal agent that never registers: it stays `booted` until
/// destroyed (the registration timeout is far away), like a slow guest.
pub const SLEEPING_AGENT: &str = "#!/bin/sh\nexec sleep 1000\n";

/// The API token every test daemon serves with (any TCP listener requires
/// one) and every test client sends unless a test says otherwise.
pub const TEST_API_TOKEN: &str = "kici-test-api-token-0123456789abcdef";

/// A test's directory: `scalers.yaml`, `state/`, `ledger/`.
pub struct Dir(pub tempfile::TempDir);

/// Bare-metal agents outlive a killed daemon by design; when a test ends
/// (or fails) with agents still up, they must not outlive the test.
impl Drop for Dir {
    fn drop(&mut self) {
        let Ok(id) = std::fs::read_to_string(self.0.path().join("state/instance-id")) else {
            return;
        };
        kill_instance_cgroups(id.trim());
    }
}

/// Kills every process in the instance's agent cgroups and removes them.
pub fn kill_instance_cgroups(instance: &str) {
    let root = Path::new(CGROUP_V2).join("kici-scaler").join(instance);
    if !root.exists() {
        return;
    }
    let _ = std::fs::write(root.join("cgroup.kill"), "1");
    let mut dirs: Vec<PathBuf> = Vec::new();
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        if let Ok(entries) = std::fs::read_dir(&d) {
            stack.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
        }
        dirs.push(d);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for d in dirs.iter().rev() {
        while std::fs::remove_dir(d).is_err() && d.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Dir {
    /// A directory whose `scalers.yaml` is `config`.
    pub fn with_config(config: &str) -> Self {
        let d = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        std::fs::write(d.path().join("scalers.yaml"), config).unwrap();
        Dir(d)
    }

    /// One bare-metal scaler `local` (label `local`) of at most
    /// `max_agents` agents running [`SLEEPING_AGENT`].
    pub fn bare_metal(max_agents: u32) -> Self {
        let dir = Self::with_config("");
        let script = dir.write_script("agent.sh", SLEEPING_AGENT);
        std::fs::write(
            dir.path("scalers.yaml"),
            format!(
                "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: {max_agents}\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
                script.display()
            ),
        )
        .unwrap();
        dir
    }

    /// An executable file in the directory.
    pub fn write_script(&self, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.path(name);
        std::fs::write(&path, body).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    /// The daemon's instance id (once a daemon started here).
    pub fn instance(&self) -> String {
        std::fs::read_to_string(self.path("state/instance-id"))
            .unwrap()
            .trim()
            .to_owned()
    }

    /// `kici-scaler <args>` with no inherited `KICI_*` variable but the
    /// test API token ([`TEST_API_TOKEN`]; a test's own `env` overrides it).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(args);
        for (k, _) in std::env::vars() {
            if k.starts_with("KICI_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("KICI_SCALER_API_TOKEN", TEST_API_TOKEN);
        cmd
    }

    /// `serve` with this dir's config, state dir and ledger; the gateway
    /// on a kernel-chosen port (tests run side by side) unless `args` name
    /// one, then `args`.
    pub fn serve_command(&self, args: &[&str]) -> Command {
        let mut cmd = self.command(&["serve"]);
        cmd.arg("--config")
            .arg(self.path("scalers.yaml"))
            .arg("--state-dir")
            .arg(self.path("state"))
            .arg("--machine-ledger-dir")
            .arg(self.path("ledger"));
        if !args.contains(&"--gateway-listen") {
            cmd.args(["--gateway-listen", "127.0.0.1:0"]);
        }
        cmd.args(args);
        cmd
    }

    /// The store's URL for this dir's default SQLite file.
    pub fn sqlite_url(&self) -> String {
        format!("sqlite:{}", self.path("state/state.db").display())
    }
}

/// Reconcile every second with no age threshold, API on a free port: the
/// arguments the recovery tests run the daemon with.
pub const FAST_RECONCILE: &[&str] = &[
    "--listen",
    "127.0.0.1:0",
    "--reconcile-age-seconds",
    "0",
    "--reconcile-interval-seconds",
    "1",
];

/// A running daemon; killed if the test ends early.
pub struct Daemon {
    pub child: Child,
    /// The control API address as logged (`127.0.0.1:PORT`, `unix:/…`).
    pub addr: String,
    /// The agent gateway's address as logged (`127.0.0.1:PORT`); backend
    /// networks' gateway addresses listen on the same port.
    pub gateway: String,
    lines: mpsc::Receiver<String>,
    /// The last lines read (for failure messages).
    pub seen: VecDeque<String>,
    /// The fields of its `recovery done` line (`Null` if not logged).
    pub recovery: Value,
    /// The fields of its `recorded pending requests restored` line.
    pub pending_restored: Value,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A log line's message and fields.
pub fn log_message(line: &str) -> Option<(String, Value)> {
    let v: Value = serde_json::from_str(line).ok()?;
    let fields = v["fields"].clone();
    Some((fields["message"].as_str()?.to_owned(), fields))
}

impl Daemon {
    /// Starts `serve` (see [`Dir::serve_command`]) with `env`; returns once
    /// the API listens. Panics if it dies first.
    pub fn start(dir: &Dir, args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Self::try_start(dir, args, env)
            .unwrap_or_else(|status| panic!("the daemon died at start: {status:?}"))
    }

    /// [`Daemon::start`], or how the process ended if it died before the
    /// API listened (a crash failpoint hit during start-up).
    pub fn try_start(dir: &Dir, args: &[&str], env: &[(&str, &str)]) -> Result<Daemon, ExitStatus> {
        let mut cmd = dir.serve_command(args);
        cmd.envs(env.iter().copied());
        Self::spawn(cmd)
    }

    /// Starts `cmd` (a [`Dir::serve_command`], possibly wrapped) and waits
    /// until the API listens; `Err` if it died first.
    pub fn spawn(mut cmd: Command) -> Result<Daemon, ExitStatus> {
        if !cmd.get_envs().any(|(k, _)| k == "KICI_SCALER_LOG") {
            cmd.env("KICI_SCALER_LOG", "info");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
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
            gateway: String::new(),
            lines,
            seen: VecDeque::new(),
            recovery: Value::Null,
            pending_restored: Value::Null,
        };
        match d.wait_for_log("control API listening") {
            Some(fields) => {
                d.addr = fields["addr"].as_str().unwrap().to_owned();
                d.gateway = fields["gateway"].as_str().unwrap_or_default().to_owned();
                Ok(d)
            }
            None => {
                let status = d.child.wait().unwrap();
                if status.signal() != Some(9) {
                    eprintln!(
                        "daemon start failed ({status:?}); its last lines: {:?}",
                        d.seen
                    );
                }
                Err(status)
            }
        }
    }

    /// Keeps `line` among the last 16 read (for failure messages).
    fn remember(&mut self, line: &str) {
        if self.seen.len() == 16 {
            self.seen.pop_front();
        }
        self.seen.push_back(line.to_owned());
    }

    /// The fields of the next log line with `message`, or `None` once the
    /// daemon's stderr closed (it died).
    pub fn wait_for_log(&mut self, message: &str) -> Option<Value> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.remember(&line);
                    if let Some((m, fields)) = log_message(&line) {
                        match m.as_str() {
                            "recovery done" => self.recovery = fields.clone(),
                            "recorded pending requests restored" => {
                                self.pending_restored = fields.clone()
                            }
                            _ => {}
                        }
                        if m == message {
                            return Some(fields);
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!(
                        "the daemon never logged {message:?}; last lines: {:?}",
                        self.seen
                    )
                }
            }
        }
    }

    /// The next log line (any shape) for which `found` holds, parsed.
    pub fn expect_line(&mut self, what: &str, found: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.remember(&line);
                    let Ok(v) = serde_json::from_str::<Value>(&line) else {
                        panic!("a log line that is not JSON: {line}");
                    };
                    if found(&v) {
                        return v;
                    }
                }
                Err(_) => panic!(
                    "the daemon never logged {what}; last lines: {:?}",
                    self.seen
                ),
            }
        }
    }

    /// [`Daemon::wait_for_log`] that must find it.
    pub fn expect_log(&mut self, message: &str) -> Value {
        self.wait_for_log(message)
            .unwrap_or_else(|| panic!("the daemon died before logging {message:?}"))
    }

    /// The log lines written since the last read, without waiting.
    pub fn lines_so_far(&mut self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    /// Every log line not read yet, up to the end of the log (the process
    /// must have exited, or be about to).
    pub fn rest_of_log(&mut self) -> Vec<String> {
        self.lines.iter().collect()
    }

    /// `--server` for the CLI.
    pub fn server(&self) -> String {
        if self.addr.starts_with("unix:") {
            self.addr.clone()
        } else {
            format!("http://{}", self.addr)
        }
    }

    pub fn signal(&self, sig: rustix::process::Signal) {
        rustix::process::kill_process(rustix::process::Pid::from_child(&self.child), sig).unwrap();
    }

    /// Waits for the process to end; its status.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the daemon did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM; it must exit 0.
    pub fn terminate(mut self) {
        self.signal(rustix::process::Signal::TERM);
        assert_eq!(self.wait_exit().code(), Some(0), "exit after SIGTERM");
    }

    /// One request (no extra headers); `(0, "")` if the daemon is gone.
    pub fn http(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        http(&self.addr, method, path, &[], body)
    }

    /// `POST /v1/scale` for `job` with `labels`.
    pub fn scale(&self, job: &str, labels: &[&str]) -> (u16, Value) {
        let body = serde_json::json!({"jobId": job, "labels": labels}).to_string();
        let (status, answer) = self.http("POST", "/v1/scale", Some(&body));
        (status, serde_json::from_str(&answer).unwrap_or_default())
    }

    /// Waits for three reconcile passes, then until no agent is still in
    /// transition (requested, provisioning, destroying): the state a crash
    /// test compares with the host.
    pub fn settle(&mut self, context: &str) {
        for _ in 0..3 {
            self.expect_log("reconcile pass");
        }
        wait_until(&format!("{context}: agents settle"), || {
            let (_, body) = self.http("GET", "/v1/agents", None);
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            v["agents"].as_array().is_some_and(|a| {
                a.iter().all(|a| {
                    !matches!(
                        a["state"].as_str(),
                        Some("requested" | "provisioning" | "destroying")
                    )
                })
            })
        });
    }

    /// Every live agent's id.
    pub fn agents(&self) -> BTreeSet<String> {
        let (status, body) = self.http("GET", "/v1/agents", None);
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["agents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["agentId"].as_str().unwrap().to_owned())
            .collect()
    }

    /// An agent's state (`""` if unknown).
    pub fn state_of(&self, agent: &str) -> String {
        let (_, body) = self.http("GET", &format!("/v1/agents/{agent}"), None);
        serde_json::from_str::<Value>(&body).unwrap_or_default()["state"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    pub fn wait_state(&self, agent: &str, state: &str) {
        wait_until(&format!("{agent} reaches {state}"), || {
            self.state_of(agent) == state
        });
    }

    /// `GET /metrics` as text.
    pub fn metrics(&self) -> String {
        let (status, body) = self.http("GET", "/metrics", None);
        assert_eq!(status, 200, "{body}");
        body
    }
}

/// One HTTP/1.0 request over TCP (the answer ends with the connection);
/// `(0, "")` when the daemon cannot be reached or hangs up. It carries the
/// test API token unless `headers` name an `Authorization` of their own (an
/// empty one: no `Authorization` header at all).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("authorization"))
    {
        req.push_str(&format!("Authorization: Bearer {TEST_API_TOKEN}\r\n"));
    }
    for (k, v) in headers {
        if !v.is_empty() {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body.unwrap_or(""));
    if s.write_all(req.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut answer = String::new();
    if s.read_to_string(&mut answer).is_err() {
        return (0, String::new());
    }
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        return (0, String::new());
    };
    let status = head.split(' ').nth(1).unwrap_or("0").parse().unwrap_or(0);
    (status, body.to_owned())
}

/// Polls `f` until it holds (bounded by [`PATIENCE`]).
pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of a Prometheus sample `name{labels}` (labels as written in
/// the exposition, e.g. `kind="cgroup"`), or 0 if absent.
pub fn metric(text: &str, name: &str, labels: &str) -> f64 {
    let key = if labels.is_empty() {
        name.to_owned()
    } else {
        format!("{name}{{{labels}}}")
    };
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            (k == key).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

// ----- PostgreSQL (scripts/postgres.sh) -----------------------------------

fn pg_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/postgres.sh")
}

/// `scripts/postgres.sh <cmd>` on `port`; its stdout.
pub fn pg(cmd: &str, port: u16) -> String {
    pg_with(cmd, port, &[])
}

/// [`pg`] with more of the script's settings (`KICI_PG_LISTEN`, …).
pub fn pg_with(cmd: &str, port: u16, env: &[(&str, &str)]) -> String {
    let out = Command::new("bash")
        .arg(pg_script())
        .arg(cmd)
        .env("KICI_PG_PORT", port.to_string())
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "postgres.sh {cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// A fresh database on the server at `port` (started if needed); its URL.
pub fn fresh_database(port: u16) -> String {
    pg("start", port);
    let admin = pg("url", port);
    let name = format!("kici_daemon_{:08x}", rand::random::<u32>());
    let out = Command::new("psql")
        .arg(&admin)
        .args([
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            &format!("CREATE DATABASE {name}"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (base, _) = admin.rsplit_once('/').unwrap();
    format!("{base}/{name}")
}

/// An instance's rows in the store at `url`, read through the store
/// itself: SQLite allows a reader beside the daemon; on PostgreSQL the
/// daemon holds the instance's advisory lock, so only once it is gone (or
/// use [`psql`]).
#[derive(Debug)]
pub struct Rows {
    pub agents: Vec<kici_store::AgentRecord>,
    pub pending: Vec<kici_store::PendingRecord>,
    pub events: Vec<kici_store::EventRecord>,
    pub leases: Vec<kici_store::Lease>,
}

pub fn rows(url: &str, owner: &str) -> Rows {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url: kici_store::StoreUrl = url.parse().unwrap();
        let owner = owner.parse().unwrap();
        let store = kici_store::open(&url, owner, kici_store::StoreOptions::default())
            .await
            .unwrap();
        let rows = Rows {
            agents: store.agents().await.unwrap(),
            pending: store.pending().await.unwrap(),
            events: store.events_after(0, u32::MAX).await.unwrap(),
            leases: store.leases().await.unwrap(),
        };
        store.close().await;
        rows
    })
}

/// `psql -At -c sql` against `url`; its rows.
pub fn psql(url: &str, sql: &str) -> Vec<String> {
    let out = Command::new("psql")
        .arg(url)
        .args(["-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A host tool's stdout and stderr, whatever its exit status.
pub fn tool(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Removes every egress rule of `instance` on `subnet`: its agents' chains
/// and the subnet's own drops (and `DOCKER-USER` accepts under
/// `AcceptSubnet`). A daemon leaves its subnet rules for its successor; no
/// successor comes for a test's instance. On a thread and runtime of its
/// own, so it works from `Drop` inside a test's runtime too.
pub fn remove_instance_rules(
    instance: kici_model::InstanceId,
    subnet: &str,
    bridge: &str,
    docker_user: kici_netpolicy::DockerUserMode,
) {
    let (subnet, bridge) = (subnet.parse().unwrap(), bridge.to_owned());
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let table = kici_netpolicy::EgressTable::ensure(
                    instance,
                    subnet,
                    kici_netpolicy::TableOptions {
                        agent_bridge: Some(bridge),
                        docker_user,
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

/// Agents with an nftables rule of `instance` (`nft -j list ruleset`,
/// comments `kici-scaler:<instance>:<agent>`; subnet and bridge rules
/// carry other words there).
pub fn agents_with_rules(instance: kici_model::InstanceId) -> BTreeSet<String> {
    let json = tool("nft", &["-j", "list", "ruleset"]);
    let tag = format!("kici-scaler:{instance}:");
    json.match_indices(&tag)
        .filter_map(|(at, _)| {
            let rest = &json[at + tag.len()..];
            let end = rest.find(|c: char| c == '"' || c.is_whitespace())?;
            rest[..end]
                .parse::<kici_model::AgentId>()
                .ok()
                .map(|a| a.to_string())
        })
        .collect()
}

/// The directory holding `kici-agent-lite`: beside `kici-scaler` after a
/// workspace build, else built once into a target dir of its own (the
/// build's own lock may be held by the test run).
pub fn agent_lite_dir() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let beside = Path::new(BIN).parent().unwrap().to_path_buf();
        if beside.join("kici-agent-lite").is_file() {
            return beside;
        }
        let target = beside.parent().unwrap().join("kici-agent-lite-for-tests");
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "kici-agent-lite"])
            .env("CARGO_TARGET_DIR", &target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(status.success(), "cannot build kici-agent-lite");
        target.join("debug")
    })
}
