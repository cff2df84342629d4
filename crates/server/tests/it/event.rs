//! `type: event` scalers end to end on a real `kici-scaler serve`: a
//! provisioner command that boots each instance as a network namespace
//! (`examples/provisioners/netns.sh`) where `kici-agent-lite --claim …`
//! runs and reaches the daemon only over its veth link; claims redeemed
//! over HTTP (single use, concurrent, expired, voided by a destroy, rate
//! limited); provisioners that fail, and one that boots nothing.
//!
//! The daemon's gateway and claims listener bind an address added to the
//! host's loopback link (`10.<x>.255.1`, random per test) that every
//! namespace reaches through its own link; guards remove the address and
//! any namespace a test left.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::daemon::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn sh(cmd: &str) -> (bool, String) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn netns_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/provisioners/netns.sh")
}

/// The daemon's address for the namespaces, on the host's loopback link
/// (a local address is reachable through any link that routes to the
/// host), removed when the test ends.
struct HostNet {
    /// `10.<x>`: the instances' /30 links are under it.
    prefix: String,
    /// `10.<x>.255.1`: where the daemon listens for them.
    daemon_ip: String,
}

impl HostNet {
    fn new() -> Self {
        let r: u32 = rand_u32();
        let x = 200 + r % 50;
        let prefix = format!("10.{x}");
        let daemon_ip = format!("{prefix}.255.1");
        let (ok, out) = sh(&format!("ip addr add {daemon_ip}/32 dev lo"));
        assert!(ok, "cannot add the daemon's address: {out}");
        Self { prefix, daemon_ip }
    }

    /// A free port on the daemon address.
    fn port(&self) -> u16 {
        std::net::TcpListener::bind((self.daemon_ip.as_str(), 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
}

impl Drop for HostNet {
    fn drop(&mut self) {
        let _ = sh(&format!("ip addr del {}/32 dev lo", self.daemon_ip));
    }
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    u32::from_ne_bytes(b)
}

/// Namespaces named after agent ids of `events` (what netns.sh creates).
fn namespaces_of(agents: &BTreeSet<String>) -> Vec<String> {
    let (_, list) = sh("ip netns list");
    agents
        .iter()
        .filter_map(|a| a.rsplit('-').next().map(|hex| format!("kici-{hex}")))
        .filter(|ns| list.split_whitespace().any(|w| w == ns))
        .collect()
}

/// Removes what netns.sh made for `agents`, whatever a test did.
struct Instances(BTreeSet<String>);

impl Drop for Instances {
    fn drop(&mut self) {
        for ns in namespaces_of(&self.0) {
            let _ = sh(&format!(
                "for p in $(ip netns pids {ns}); do kill -9 $p; done; ip netns del {ns}"
            ));
        }
        for a in &self.0 {
            if let Some(hex) = a.rsplit('-').next() {
                let _ = sh(&format!("ip link del kh{hex} 2>/dev/null"));
            }
        }
    }
}

/// A loopback address with a port free now (for a claims listener).
fn free_loopback_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// The events a recording provisioner appended to `events.jsonl`.
fn events(dir: &Dir) -> Vec<Value> {
    events_in(dir, "events.jsonl")
}

/// The events appended to `file` in `dir`, one JSON object a line.
fn events_in(dir: &Dir, file: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.path(file))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn wait_event(dir: &Dir, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(e) = events(dir).into_iter().find(|e| f(e)) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "never: {what}; events: {:?}",
            events(dir)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn redeem(claims: &str, code: &str) -> (u16, Value) {
    let body = serde_json::json!({ "claimCode": code }).to_string();
    let (status, answer) = http(claims, "POST", "/v1/claims", &[], Some(&body));
    (status, serde_json::from_str(&answer).unwrap_or_default())
}

/// The stdout of a finished job's log stream (SSE `output` events, their
/// data base64).
fn stdout_of(stream: &str) -> String {
    let mut out = Vec::new();
    for block in stream.split("\n\n") {
        if !block.lines().any(|l| l.trim() == "event: output") {
            continue;
        }
        let data: String = block
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect();
        let v: Value = serde_json::from_str(&data).unwrap();
        if v["stream"] == "stdout" {
            let chunk: kici_protocol::ChunkData =
                serde_json::from_value(v["data"].clone()).unwrap();
            out.extend(chunk.into_bytes());
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A provisioner that only records what it is told (no instance boots).
/// One `printf` per event: concurrent deliveries append whole lines.
const RECORDER: &str =
    "#!/bin/sh\nbody=$(cat)\nprintf '%s\\n' \"$body\" >>\"$(dirname \"$0\")/events.jsonl\"\n";

#[test]
fn a_netns_instance_boots_on_a_scale_up_runs_a_standalone_job_and_goes_on_scale_down() {
    let net = HostNet::new();
    let (gw_port, claims_port) = (net.port(), net.port());
    let dir = Dir::with_config("");
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 2\n    orchestratorUrl: ws://{ip}:{gw_port}/ws\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      registrationTimeoutSeconds: 30\n      provisioner:\n        command: [\"{script}\"]\n        passEnv: [NETNS_PREFIX, NETNS_AGENT, NETNS_LOG_DIR]\n        timeoutSeconds: 20\n",
            ip = net.daemon_ip,
            script = netns_script().display()
        ),
    )
    .unwrap();
    let agent_lite = agent_lite_dir().join("kici-agent-lite");
    let log_dir = dir.0.path().to_str().unwrap().to_owned();
    let d = Daemon::start(
        &dir,
        &[
            "--listen",
            "127.0.0.1:0",
            "--gateway-listen",
            &format!("{}:{gw_port}", net.daemon_ip),
            "--claims-listen",
            &format!("{}:{claims_port}", net.daemon_ip),
        ],
        &[
            ("NETNS_PREFIX", net.prefix.as_str()),
            ("NETNS_AGENT", agent_lite.to_str().unwrap()),
            ("NETNS_LOG_DIR", log_dir.as_str()),
        ],
    );
    let mut instances = Instances(BTreeSet::new());

    let body = serde_json::json!({
        "labels": ["cloud"],
        "command": ["sh", "-c", "ip -4 -o addr show; echo from-the-namespace"],
    })
    .to_string();
    let id = post_job(&d, &body);

    let up = wait_event(&dir, "a scale-up", |e| e["event"] == "scale-up");
    let agent = up["agentId"].as_str().unwrap().to_owned();
    instances.0.insert(agent.clone());
    assert_eq!(up["scaler"], "cloud");
    assert_eq!(up["jobId"], id.as_str());
    assert_eq!(
        up["claimUrl"],
        format!("http://{}:{claims_port}/v1/claims", net.daemon_ip)
    );
    assert!(up["claimCode"].as_str().unwrap().starts_with("kcc_"));
    assert!(up["labels"]
        .as_array()
        .unwrap()
        .iter()
        .any(|l| l == "cloud"));

    // The job ends in the namespace: its output shows the instance's own
    // address, which only exists there.
    let deadline = Instant::now() + Duration::from_secs(60);
    let end = loop {
        let (_, body) = http(&d.addr, "GET", &format!("/v1/jobs/{id}"), &[], None);
        let v: Value = serde_json::from_str(&body).unwrap_or_default();
        if matches!(
            v["state"].as_str(),
            Some("succeeded" | "failed" | "aborted")
        ) {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "the job never ended: {v}; agent log: {}",
            std::fs::read_to_string(dir.path(&format!("kici-{}.log", &agent[agent.len() - 8..])))
                .unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        end["state"],
        "succeeded",
        "{end}; agent log: {}; events: {:?}",
        std::fs::read_to_string(dir.path(&format!("kici-{}.log", &agent[agent.len() - 8..])))
            .unwrap_or_default(),
        events(&dir)
    );
    let (_, stream) = http(&d.addr, "GET", &format!("/v1/jobs/{id}/logs"), &[], None);
    let logs = stdout_of(&stream);
    assert!(logs.contains("from-the-namespace"), "{logs}");
    let hex = &agent[agent.len() - 8..];
    let a = u8::from_str_radix(&hex[0..2], 16).unwrap();
    let b = u8::from_str_radix(&hex[2..4], 16).unwrap() & 252;
    let guest_ip = format!("{}.{a}.{}", net.prefix, b + 2);
    assert!(logs.contains(&guest_ip), "the job ran elsewhere: {logs}");

    // Its agent is destroyed at the job's end: a scale-down, and the
    // namespace is gone.
    let down = wait_event(&dir, "a scale-down", |e| e["event"] == "scale-down");
    assert_eq!(down["agentId"], agent.as_str());
    assert_eq!(down["reason"], "job-end", "{down}");
    assert_eq!(
        down["requestId"].as_str().unwrap(),
        up["requestId"]
            .as_str()
            .unwrap()
            .replace(".scale-up", ".scale-down")
    );
    wait_until("the namespace is deleted", || {
        namespaces_of(&instances.0).is_empty()
    });
    wait_until("no agent is left", || d.agents().is_empty());
    let m = d.metrics();
    assert_eq!(
        metric(&m, "kici_orch_scaler_scale_up_emitted_total", ""),
        1.0
    );
    // The provisioner's work (delivery to registration) is its start-up.
    assert_eq!(
        metric(
            &m,
            "kici_orch_scaler_provision_seconds_count",
            "backend=\"event\",phase=\"provision\""
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "kici_orch_scaler_scale_down_emitted_total",
            "reason=\"job-end\""
        ),
        1.0
    );
    assert_eq!(
        metric(&m, "kici_orch_scaler_external_provisioning_active", ""),
        0.0
    );
    // The code was consumed by the agent: a replay is refused.
    let (status, refusal) = redeem(
        &format!("{}:{claims_port}", net.daemon_ip),
        up["claimCode"].as_str().unwrap(),
    );
    assert_eq!(status, 403, "{refusal}");
    assert!(
        ["consumed", "unknown"].contains(&refusal["error"]["reason"].as_str().unwrap()),
        "{refusal}"
    );

    // Orchestrator mode: a scale request boots another instance whose
    // agent registers over its link; an operator's delete tears it down.
    let (status, answer) = d.scale("orch-1", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    let up2 = wait_event(&dir, "the second scale-up", |e| {
        e["event"] == "scale-up" && e["jobId"] == "orch-1"
    });
    let agent2 = up2["agentId"].as_str().unwrap().to_owned();
    instances.0.insert(agent2.clone());
    wait_until("the second agent registers", || {
        matches!(d.state_of(&agent2).as_str(), "registered" | "idle" | "busy")
    });
    assert_eq!(namespaces_of(&BTreeSet::from([agent2.clone()])).len(), 1);
    let (status, body) = d.http("DELETE", &format!("/v1/agents/{agent2}"), None);
    assert!(status < 300, "{status} {body}");
    let down2 = wait_event(&dir, "the second scale-down", |e| {
        e["event"] == "scale-down" && e["agentId"] == agent2.as_str()
    });
    assert_eq!(down2["reason"], "operator");
    wait_until("the second namespace is deleted", || {
        namespaces_of(&instances.0).is_empty()
    });
    d.terminate();
    drop(instances);
}

/// The provisioner a new user writes first: it starts `kici-agent-lite`
/// with the claim in `KICI_CLAIM_CODE`/`KICI_CLAIM_URL` and lets it inherit
/// its own environment as it is (no variable removed). The agent refuses
/// `KICI_*` variables it does not know, so this works only when nothing
/// the command is given is one.
const NATURAL_PROVISIONER: &str = r#"#!/bin/sh
set -eu
dir=DIR
event=$(cat)
agent=$(printf '%s' "$event" | jq -r .agentId)
case $(printf '%s' "$event" | jq -r .event) in
scale-up)
    KICI_CLAIM_CODE=$(printf '%s' "$event" | jq -r .claimCode) \
    KICI_CLAIM_URL=$(printf '%s' "$event" | jq -r .claimUrl) \
        setsid AGENT </dev/null >"$dir/$agent.log" 2>&1 &
    echo $! >"$dir/$agent.pid"
    ;;
scale-down)
    if [ -f "$dir/$agent.pid" ]; then kill "$(cat "$dir/$agent.pid")" 2>/dev/null || true; fi
    ;;
esac
"#;

/// Kills the agents a [`NATURAL_PROVISIONER`] started, whatever a test did.
struct StartedAgents<'a>(&'a Dir);

impl Drop for StartedAgents<'_> {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(self.0 .0.path()) else {
            return;
        };
        for e in entries.flatten() {
            if e.path().extension().is_some_and(|x| x == "pid") {
                if let Ok(pid) = std::fs::read_to_string(e.path()) {
                    let _ = sh(&format!("kill -9 {} 2>/dev/null", pid.trim()));
                }
            }
        }
    }
}

#[test]
fn a_provisioner_that_starts_the_agent_with_its_own_environment_runs_a_standalone_job() {
    let dir = Dir::with_config("");
    let agent_lite = agent_lite_dir().join("kici-agent-lite");
    let script = dir.write_script(
        "provision.sh",
        &NATURAL_PROVISIONER
            .replace("DIR", dir.0.path().to_str().unwrap())
            .replace("AGENT", agent_lite.to_str().unwrap()),
    );
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 1\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      registrationTimeoutSeconds: 30\n      provisioner:\n        command: [\"{}\"]\n",
            script.display()
        ),
    )
    .unwrap();
    let claims = free_loopback_addr();
    // The daemon's environment holds a KICI_* name of the operator's (the
    // webhook secret variable of the documentation's example): it must not
    // reach the agent either.
    let d = Daemon::start(
        &dir,
        &["--listen", "127.0.0.1:0", "--claims-listen", &claims],
        &[("KICI_PROVISIONER_SECRET", "not-for-the-agent")],
    );
    let _agents = StartedAgents(&dir);

    let body = serde_json::json!({
        "labels": ["cloud"],
        "command": ["sh", "-c", "echo ran-on-the-provisioned-agent"],
    })
    .to_string();
    let id = post_job(&d, &body);
    let agent_logs = || {
        std::fs::read_dir(dir.0.path())
            .unwrap()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let end = loop {
        let (_, body) = http(&d.addr, "GET", &format!("/v1/jobs/{id}"), &[], None);
        let v: Value = serde_json::from_str(&body).unwrap_or_default();
        if matches!(
            v["state"].as_str(),
            Some("succeeded" | "failed" | "aborted")
        ) {
            break v;
        }
        let logs = agent_logs();
        assert!(
            Instant::now() < deadline && !logs.contains("not connecting"),
            "the job never ended: {v}; agent log: {logs}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        end["state"],
        "succeeded",
        "{end}; agent log: {}",
        agent_logs()
    );
    let (_, stream) = http(&d.addr, "GET", &format!("/v1/jobs/{id}/logs"), &[], None);
    let logs = stdout_of(&stream);
    assert!(logs.contains("ran-on-the-provisioned-agent"), "{logs}");
    wait_until("no agent is left", || d.agents().is_empty());
    d.terminate();
}

/// A daemon whose scalers.yaml is `config` with `RECORD` replaced by the
/// path of a [`RECORDER`] script; a claims listener on loopback.
fn recording_daemon(config: &str) -> (Dir, Daemon, String) {
    let dir = Dir::with_config("");
    let record = dir.write_script("record.sh", RECORDER);
    std::fs::write(
        dir.path("scalers.yaml"),
        config.replace("RECORD", record.to_str().unwrap()),
    )
    .unwrap();
    let claims = free_loopback_addr();
    let d = Daemon::start(
        &dir,
        &["--listen", "127.0.0.1:0", "--claims-listen", &claims],
        &[],
    );
    (dir, d, claims)
}

/// Failed redemptions are capped across every source address together:
/// fifteen loopback addresses, each within its own limit of ten, send 150
/// codes that do not exist; past the daemon-wide budget of failures they
/// are refused 429 with Retry-After, however many addresses send them.
#[test]
fn failed_redemptions_are_capped_across_source_addresses() {
    let (_dir, _d, claims) = recording_daemon(
        "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 1\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      provisioner:\n        command: [\"RECORD\"]\n",
    );
    let target: std::net::SocketAddr = claims.parse().unwrap();
    let mut refused = 0;
    let mut unknown = 0;
    for source in 10..25u8 {
        for _ in 0..10 {
            let from = std::net::SocketAddr::from(([127, 0, 0, source], 0));
            let (status, head) = redeem_from(from, target, &format!("kcc_{}", "1".repeat(64)));
            match status {
                429 => {
                    assert!(head.to_ascii_lowercase().contains("retry-after:"), "{head}");
                    refused += 1;
                }
                403 => unknown += 1,
                other => panic!("{other}: {head}"),
            }
        }
    }
    assert!(
        unknown <= 110,
        "at most the budget (and what refilled) was answered: {unknown}"
    );
    assert!(refused >= 40, "the rest was refused: {refused} of 150");
}

/// `POST /v1/claims` with `code` from the local address `from`; the status
/// and the response head.
fn redeem_from(from: std::net::SocketAddr, to: std::net::SocketAddr, code: &str) -> (u16, String) {
    use rustix::net::{bind, connect, socket, AddressFamily, SocketType};
    use std::io::{Read, Write};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&fd, &from).unwrap();
    connect(&fd, &to).unwrap();
    let mut s = std::net::TcpStream::from(fd);
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let body = serde_json::json!({ "claimCode": code }).to_string();
    write!(
        s,
        "POST /v1/claims HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let head = answer
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head)
}

#[test]
fn claims_are_single_use_expire_die_with_their_agent_and_are_rate_limited() {
    let (dir, d, claims) = recording_daemon(
        "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 4\n    claimTtlSeconds: 2\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      registrationTimeoutSeconds: 60\n      provisioner:\n        command: [\"RECORD\"]\n",
    );

    let code_of = |job: &str| -> (String, String) {
        let e = wait_event(&dir, job, |e| e["event"] == "scale-up" && e["jobId"] == job);
        (
            e["agentId"].as_str().unwrap().to_owned(),
            e["claimCode"].as_str().unwrap().to_owned(),
        )
    };

    // Six concurrent redemptions of one code: one token.
    let (status, answer) = d.scale("j1", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    let (agent1, code1) = code_of("j1");
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..6)
            .map(|_| s.spawn(|| redeem(&claims, &code1)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let granted: Vec<&Value> = answers
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(granted.len(), 1, "{answers:?}");
    let creds = granted[0];
    assert_eq!(creds["agentId"], agent1.as_str());
    assert!(creds["agentToken"].as_str().unwrap().starts_with("kat_"));
    assert!(creds["gatewayUrl"].as_str().unwrap().starts_with("ws://"));
    assert!(creds["labels"]
        .as_array()
        .unwrap()
        .iter()
        .any(|l| l == "cloud"));
    for (s, v) in answers.iter().filter(|(s, _)| *s != 200) {
        assert_eq!(*s, 403, "{v}");
        assert_eq!(v["error"]["reason"], "consumed", "{v}");
    }
    // A replay later: still consumed.
    let (s, v) = redeem(&claims, &code1);
    assert_eq!((s, v["error"]["reason"].as_str()), (403, Some("consumed")));

    // A code whose agent was destroyed: unknown, and a scale-down went out.
    d.scale("j2", &["cloud"]);
    let (agent2, code2) = code_of("j2");
    let (status, body) = d.http("DELETE", &format!("/v1/agents/{agent2}"), None);
    assert!(status < 300, "{status} {body}");
    let down = wait_event(&dir, "j2's scale-down", |e| {
        e["event"] == "scale-down" && e["agentId"] == agent2.as_str()
    });
    assert_eq!(down["reason"], "operator");
    let (s, v) = redeem(&claims, &code2);
    assert_eq!((s, v["error"]["reason"].as_str()), (403, Some("unknown")));

    // Expired after claimTtlSeconds.
    d.scale("j3", &["cloud"]);
    let (_, code3) = code_of("j3");
    std::thread::sleep(Duration::from_millis(2_200));
    let (s, v) = redeem(&claims, &code3);
    assert_eq!((s, v["error"]["reason"].as_str()), (403, Some("expired")));

    // Never issued: unknown; a malformed body: 400.
    let (s, v) = redeem(&claims, &format!("kcc_{}", "0".repeat(64)));
    assert_eq!((s, v["error"]["reason"].as_str()), (403, Some("unknown")));

    // Ten attempts from one address were allowed at once; the next waits.
    let (s, v) = redeem(&claims, "kcc_nope");
    assert_eq!(s, 429, "{v}");

    // The listener serves claims only.
    let (s, _) = http(&claims, "GET", "/v1/agents", &[], None);
    assert_eq!(s, 404);

    // Shutdown tears down what is left (j1's and j3's instances), and the
    // scale-downs go out before the daemon exits.
    let live = d.agents();
    assert_eq!(live.len(), 2, "{live:?}");
    d.terminate();
    for agent in &live {
        let down = events(&dir)
            .into_iter()
            .find(|e| e["event"] == "scale-down" && e["agentId"] == agent.as_str())
            .unwrap_or_else(|| panic!("no scale-down for {agent}: {:?}", events(&dir)));
        assert_eq!(down["reason"], "shutdown", "{down}");
    }
}

/// A reload changes where later events go: scale-ups and scale-downs after
/// it reach the new provisioner (a scale-down too, for an agent whose
/// scale-up went to the old one); a reload the loader refuses changes
/// nothing.
#[test]
fn a_reload_sends_later_events_to_the_new_provisioner() {
    const CONFIG: &str = "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 4\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      registrationTimeoutSeconds: 60\n      provisioner:\n        command: [\"RECORD\"]\n";
    let (dir, d, _claims) = recording_daemon(CONFIG);
    let other = dir.write_script("other.sh", &RECORDER.replace("events.jsonl", "other.jsonl"));
    let other_events = || events_in(&dir, "other.jsonl");
    let (status, answer) = d.scale("before", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    let up = wait_event(&dir, "before's scale-up", |e| {
        e["event"] == "scale-up" && e["jobId"] == "before"
    });
    let before_agent = up["agentId"].as_str().unwrap().to_owned();

    std::fs::write(
        dir.path("scalers.yaml"),
        CONFIG.replace("RECORD", other.to_str().unwrap()),
    )
    .unwrap();
    let (status, body) = d.http("POST", "/v1/reload", None);
    assert_eq!(status, 200, "{body}");
    let (status, answer) = d.scale("after", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    wait_until("after's scale-up reaches the new provisioner", || {
        other_events()
            .iter()
            .any(|e| e["event"] == "scale-up" && e["jobId"] == "after")
    });
    let (status, body) = d.http("DELETE", &format!("/v1/agents/{before_agent}"), None);
    assert!(status < 300, "{status} {body}");
    wait_until("before's scale-down reaches the new provisioner", || {
        other_events()
            .iter()
            .any(|e| e["event"] == "scale-down" && e["agentId"] == before_agent.as_str())
    });
    assert!(
        !events(&dir)
            .iter()
            .any(|e| e["jobId"] == "after" || e["event"] == "scale-down"),
        "the old provisioner got events after the reload: {:?}",
        events(&dir)
    );

    // A provisioner the loader refuses: the reload is refused, nothing changes.
    std::fs::write(
        dir.path("scalers.yaml"),
        CONFIG.replace("[\"RECORD\"]", "[]"),
    )
    .unwrap();
    let (status, body) = d.http("POST", "/v1/reload", None);
    assert!(status >= 400, "{status} {body}");
    let (status, answer) = d.scale("refused-reload", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    wait_until(
        "the next scale-up still reaches the new provisioner",
        || {
            other_events()
                .iter()
                .any(|e| e["event"] == "scale-up" && e["jobId"] == "refused-reload")
        },
    );
    d.terminate();
}

#[test]
fn a_failing_provisioner_is_a_spawn_failure_and_one_that_boots_nothing_times_out() {
    let dir = Dir::with_config("");
    let record = dir.write_script("record.sh", RECORDER);
    let failing = dir.write_script(
        "failing.sh",
        &format!(
            "#!/bin/sh\n# Records every attempt, refuses every scale-up.\n{} <&0\n[ \"$PROVISION_EVENT\" = scale-down ] || exit 3\n",
            record.display()
        ),
    );
    // Hangs on a scale-up (past its 1 s timeout): its whole process group
    // is killed, the `sleep` included.
    let hanging = dir.write_script(
        "hanging.sh",
        &format!(
            "#!/bin/sh\n{} <&0\n[ \"$PROVISION_EVENT\" = scale-down ] && exit 0\nsleep 977 &\necho $! >\"$(dirname \"$0\")/sleep.pid\"\nwait\n",
            record.display()
        ),
    );
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: broken\n    type: event\n    maxAgents: 1\n    labelSets:\n      - labels: [broken]\n    x-kici-scaler:\n      backoff: {{initialSeconds: 30, maxSeconds: 60}}\n      provisioner:\n        command: [\"{failing}\"]\n        maxAttempts: 2\n  - name: silent\n    type: event\n    maxAgents: 1\n    labelSets:\n      - labels: [silent]\n    x-kici-scaler:\n      backoff: {{initialSeconds: 30, maxSeconds: 60}}\n      registrationTimeoutSeconds: 2\n      provisioner:\n        command: [\"{record}\"]\n  - name: hung\n    type: event\n    maxAgents: 1\n    labelSets:\n      - labels: [hung]\n    x-kici-scaler:\n      backoff: {{initialSeconds: 30, maxSeconds: 60}}\n      provisioner:\n        command: [\"{hanging}\"]\n        timeoutSeconds: 1\n        maxAttempts: 1\n",
            failing = failing.display(),
            record = record.display(),
            hanging = hanging.display()
        ),
    )
    .unwrap();
    let claims = free_loopback_addr();
    let d = Daemon::start(
        &dir,
        &["--listen", "127.0.0.1:0", "--claims-listen", &claims],
        &[],
    );

    // Exits 3: retried (2 attempts), then a spawn failure; the scale-down
    // follows anyway (the provisioner may have acted on an attempt).
    d.scale("b1", &["broken"]);
    let down = wait_event(&dir, "broken's scale-down", |e| {
        e["event"] == "scale-down" && e["scaler"] == "broken"
    });
    assert_eq!(down["reason"], "spawn-failed", "{down}");
    let ups = events(&dir)
        .into_iter()
        .filter(|e| e["event"] == "scale-up" && e["scaler"] == "broken")
        .count();
    assert_eq!(ups, 2, "two attempts of the one scale-up");

    // Exits 0 and boots nothing: the registration deadline tears it down.
    d.scale("s1", &["silent"]);
    let up = wait_event(&dir, "silent's scale-up", |e| {
        e["event"] == "scale-up" && e["scaler"] == "silent"
    });
    let down = wait_event(&dir, "silent's scale-down", |e| {
        e["event"] == "scale-down" && e["scaler"] == "silent"
    });
    assert_eq!(down["reason"], "spawn-timeout", "{down}");
    assert_eq!(down["agentId"], up["agentId"]);
    let (s, v) = redeem(&claims, up["claimCode"].as_str().unwrap());
    assert_eq!((s, v["error"]["reason"].as_str()), (403, Some("unknown")));

    // Hangs: killed at its timeout, a spawn failure, and its scale-down.
    d.scale("h1", &["hung"]);
    let down = wait_event(&dir, "hung's scale-down", |e| {
        e["event"] == "scale-down" && e["scaler"] == "hung"
    });
    assert_eq!(down["reason"], "spawn-failed", "{down}");
    let pid = std::fs::read_to_string(dir.path("sleep.pid")).unwrap();
    wait_until("the hung provisioner's child is killed", || {
        !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists()
            || std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
                .is_ok_and(|s| s.contains(") Z "))
    });

    // Orchestrator requests go back to the queue after a failed agent
    // (and wait out the 30 s backoff): withdraw them.
    for job in ["b1", "s1", "h1"] {
        d.http("DELETE", &format!("/v1/scale/{job}"), None);
    }
    wait_until("no agent is left", || d.agents().is_empty());
    let m = d.metrics();
    assert_eq!(
        metric(&m, "kici_orch_scaler_external_provision_timeout_total", ""),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "kici_orch_scaler_scale_down_emitted_total",
            "reason=\"spawn-timeout\""
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "kici_orch_scaler_scale_down_emitted_total",
            "reason=\"spawn-failed\""
        ),
        2.0
    );
    d.terminate();
    // Nothing of either is left in the outbox.
    let (_, rows) = sh(&format!(
        "sqlite3 {} 'SELECT count(*) FROM provision_outbox' 2>&1",
        dir.path("state/state.db").display()
    ));
    assert_eq!(rows.trim(), "0", "{rows}");
}

/// Records every event; hangs (once) on the first scale-up when
/// `hang-up` exists, on the first scale-down when `hang-down` exists,
/// leaving its pid in `hung.pid`.
const HANGING_RECORDER: &str = r#"#!/bin/sh
d=$(dirname "$0")
body=$(cat)
printf '%s\n' "$body" >>"$d/events.jsonl"
case "$PROVISION_EVENT" in
scale-up) marker=hang-up ;;
*) marker=hang-down ;;
esac
if [ -e "$d/$marker" ] && [ ! -e "$d/$marker.done" ]; then
    touch "$d/$marker.done"
    echo $$ >"$d/hung.pid"
    exec sleep 600
fi
"#;

fn kill_hung(dir: &Dir) {
    wait_until("the provisioner hangs", || dir.path("hung.pid").exists());
    let pid = std::fs::read_to_string(dir.path("hung.pid")).unwrap();
    let _ = sh(&format!("kill -9 {}", pid.trim()));
    std::fs::remove_file(dir.path("hung.pid")).unwrap();
}

fn outbox_rows(dir: &Dir) -> Vec<String> {
    let (_, rows) = sh(&format!(
        "sqlite3 {} 'SELECT kind || \":\" || (delivered_at IS NOT NULL) FROM provision_outbox ORDER BY created_at'",
        dir.path("state/state.db").display()
    ));
    rows.lines().map(str::to_owned).collect()
}

fn hanging_daemon(registration_timeout: u32) -> (Dir, Daemon, String, Vec<String>) {
    let dir = Dir::with_config("");
    let script = dir.write_script("record.sh", HANGING_RECORDER);
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 2\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      registrationTimeoutSeconds: {registration_timeout}\n      provisioner:\n        command: [\"{}\"]\n        timeoutSeconds: 120\n",
            script.display()
        ),
    )
    .unwrap();
    let claims = free_loopback_addr();
    let args: Vec<String> = ["--listen", "127.0.0.1:0", "--claims-listen", &claims]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let d = Daemon::start(&dir, &argv, &[]);
    (dir, d, claims, args)
}

#[test]
fn a_scale_up_cut_by_kill_9_is_delivered_again_after_the_restart_with_the_same_code() {
    let (dir, mut d, claims, args) = hanging_daemon(5);
    std::fs::write(dir.path("hang-up"), "").unwrap();
    let (status, answer) = d.scale("j1", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    let first = wait_event(&dir, "the scale-up", |e| e["event"] == "scale-up");
    wait_until("the provisioner hangs", || dir.path("hung.pid").exists());
    d.kill9();
    kill_hung(&dir);
    assert_eq!(
        outbox_rows(&dir),
        ["scale-up:0"],
        "recorded, never confirmed"
    );

    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let d = Daemon::start(&dir, &argv, &[]);
    wait_until("the scale-up is delivered again", || {
        events(&dir)
            .iter()
            .filter(|e| e["event"] == "scale-up")
            .count()
            == 2
    });
    let again = events(&dir)
        .into_iter()
        .filter(|e| e["event"] == "scale-up")
        .nth(1)
        .unwrap();
    assert_eq!(again["requestId"], first["requestId"]);
    assert_eq!(again["agentId"], first["agentId"]);
    assert_eq!(
        again["claimCode"], first["claimCode"],
        "the code is derived again, not stored"
    );
    // The redelivered code works (the adopted agent still waits for its
    // instance) — once.
    let (s, creds) = redeem(&claims, again["claimCode"].as_str().unwrap());
    assert_eq!(s, 200, "{creds}");
    assert_eq!(creds["agentId"], first["agentId"]);
    // Nothing registers: the deadline tears it down, and nothing is left.
    let down = wait_event(&dir, "the scale-down", |e| e["event"] == "scale-down");
    assert_eq!(down["agentId"], first["agentId"]);
    assert_eq!(down["reason"], "spawn-timeout", "{down}");
    wait_until("no agent is left", || d.agents().is_empty());
    wait_until("the outbox is empty", || outbox_rows(&dir).is_empty());
    d.terminate();
}

#[test]
fn a_scale_down_cut_by_kill_9_is_sent_after_the_restart_with_its_first_reason() {
    let (dir, mut d, _claims, args) = hanging_daemon(60);
    let (status, answer) = d.scale("j1", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    let up = wait_event(&dir, "the scale-up", |e| e["event"] == "scale-up");
    let agent = up["agentId"].as_str().unwrap().to_owned();
    wait_until("the scale-up is confirmed", || {
        outbox_rows(&dir) == ["scale-up:1"]
    });
    std::fs::write(dir.path("hang-down"), "").unwrap();
    let (status, body) = d.http("DELETE", &format!("/v1/agents/{agent}"), None);
    assert!(status < 300, "{status} {body}");
    let first = wait_event(&dir, "the scale-down", |e| e["event"] == "scale-down");
    assert_eq!(first["reason"], "operator");
    wait_until("the provisioner hangs", || dir.path("hung.pid").exists());
    d.kill9();
    kill_hung(&dir);
    assert_eq!(outbox_rows(&dir), ["scale-up:1", "scale-down:0"]);

    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let d = Daemon::start(&dir, &argv, &[]);
    wait_until("the scale-down is sent again", || {
        events(&dir)
            .iter()
            .filter(|e| e["event"] == "scale-down")
            .count()
            >= 2
    });
    for down in events(&dir).iter().filter(|e| e["event"] == "scale-down") {
        assert_eq!(down["requestId"], first["requestId"]);
        assert_eq!(down["reason"], "operator", "the first reason is kept");
    }
    wait_until("no agent is left", || d.agents().is_empty());
    wait_until("the outbox is empty", || outbox_rows(&dir).is_empty());
    assert!(
        events(&dir)
            .iter()
            .filter(|e| e["event"] == "scale-up")
            .count()
            == 1,
        "no scale-up again for an instance being torn down"
    );
    d.terminate();
}

/// Upstream's pre-auth `scaler.claim-credentials` on the agent gateway:
/// answered before `auth.request`, once per code, and the token it hands
/// out authenticates on the same connection.
#[test]
fn the_gateway_redeems_a_code_before_auth_and_the_token_authenticates() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;

    let (dir, d, _claims) = recording_daemon(
        "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 2\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      registrationTimeoutSeconds: 60\n      provisioner:\n        command: [\"RECORD\"]\n",
    );
    let (status, answer) = d.scale("g1", &["cloud"]);
    assert!(status < 300, "{status} {answer}");
    let up = wait_event(&dir, "the scale-up", |e| e["event"] == "scale-up");
    let code = up["claimCode"].as_str().unwrap().to_owned();
    let url = format!("ws://{}/ws", d.gateway);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str()).await.unwrap();
        let next = async |ws: &mut tokio_tungstenite::WebSocketStream<_>| -> Value {
            loop {
                match tokio::time::timeout(PATIENCE, ws.next()).await.unwrap() {
                    Some(Ok(Message::Text(t))) => return serde_json::from_str(t.as_str()).unwrap(),
                    Some(Ok(_)) => continue,
                    other => panic!("the gateway closed: {other:?}"),
                }
            }
        };
        let claim = |id: &str| {
            Message::text(
                serde_json::json!({"type": "scaler.claim-credentials", "requestId": id, "claimCode": code})
                    .to_string(),
            )
        };
        ws.send(claim("r1")).await.unwrap();
        let first = next(&mut ws).await;
        assert_eq!(first["type"], "scaler.claim-credentials.response");
        assert_eq!(first["requestId"], "r1");
        let creds = &first["credentials"];
        assert_eq!(creds["agentId"], up["agentId"], "{first}");
        assert!(creds["orchestratorUrl"].as_str().unwrap().starts_with("ws://"));
        let token = creds["agentToken"].as_str().unwrap().to_owned();

        // Single use over the gateway too.
        ws.send(claim("r2")).await.unwrap();
        let second = next(&mut ws).await;
        assert_eq!(second["requestId"], "r2");
        assert_eq!(second["error"], "consumed", "{second}");
        assert!(second.get("credentials").is_none());

        // The connection is still waiting for auth.request: the minted
        // token passes it.
        ws.send(Message::text(
            serde_json::json!({"type": "auth.request", "token": token, "protocolVersion": 1})
                .to_string(),
        ))
        .await
        .unwrap();
        let auth = next(&mut ws).await;
        assert_eq!(auth["type"], "auth.success", "{auth}");
    });
    d.terminate();
}

/// One request a [`Receiver`] took: its body and whether its signature
/// verified with the right secret and with a wrong one.
struct Received {
    body: Value,
    right: bool,
    wrong: bool,
}

/// A webhook receiver on loopback: answers 200 when the signature verifies
/// with the shared secret, 401 otherwise.
fn receiver(secret: &'static str) -> (String, std::sync::mpsc::Receiver<Received>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut headers = std::collections::HashMap::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                let line = line.trim_end();
                if line.is_empty() {
                    break;
                }
                if let Some((k, v)) = line.split_once(':') {
                    headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
                }
            }
            let len: usize = headers
                .get("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut body = vec![0u8; len];
            reader.read_exact(&mut body).unwrap();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let check = |key: &str| {
                kici_provision::signature::verify_signature(
                    key.as_bytes(),
                    headers.get("x-kici-timestamp").map_or("", String::as_str),
                    headers.get("x-kici-signature").map_or("", String::as_str),
                    &body,
                    now,
                    kici_provision::signature::REPLAY_WINDOW,
                )
                .is_ok()
            };
            let (right, wrong) = (check(secret), check("not-the-secret"));
            let status = if right { "200 OK" } else { "401 Unauthorized" };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            let _ = tx.send(Received {
                body: serde_json::from_slice(&body).unwrap_or_default(),
                right,
                wrong,
            });
        }
    });
    (url, rx)
}

#[test]
fn a_webhook_gets_signed_events_and_the_event_stream_carries_them_too() {
    let (url, received) = receiver("s3cret-for-the-hook");
    let dir = Dir::with_config(&format!(
        "version: 1\nscalers:\n  - name: hooked\n    type: event\n    maxAgents: 1\n    labelSets:\n      - labels: [hooked]\n    x-kici-scaler:\n      registrationTimeoutSeconds: 60\n      provisioner:\n        webhook: {{url: \"{url}\", secretEnv: HOOK_SECRET}}\n"
    ));
    let claims = free_loopback_addr();
    let d = Daemon::start(
        &dir,
        &["--listen", "127.0.0.1:0", "--claims-listen", &claims],
        &[("HOOK_SECRET", "s3cret-for-the-hook")],
    );
    // A reader following before the scale-up happens.
    let mut live = events_stream(&d.addr, None);
    let (status, answer) = d.scale("w1", &["hooked"]);
    assert!(status < 300, "{status} {answer}");
    let up = received.recv_timeout(PATIENCE).unwrap();
    assert!(up.right, "signed with the configured secret");
    assert!(!up.wrong, "and only with it");
    assert_eq!(up.body["event"], "scale-up");
    let agent = up.body["agentId"].as_str().unwrap().to_owned();
    // Delivered (its spawn is over: no spawn in flight) and still
    // provisioning until it registers.
    wait_until(
        "the agent is provisioning (delivered, not registered)",
        || {
            let (_, status) = d.http("GET", "/v1/status", None);
            let status: Value = serde_json::from_str(&status).unwrap_or_default();
            status["scalers"][0]["spawns"]["inFlight"] == 0 && d.state_of(&agent) == "provisioning"
        },
    );

    // The same event on /v1/events, with its code, for the reader that was
    // following when it happened.
    let sse = next_event(&mut live, "scale-up");
    assert_eq!(sse.data["requestId"], up.body["requestId"]);
    assert_eq!(sse.data["claimCode"], up.body["claimCode"]);
    assert_eq!(sse.data["claimUrl"], format!("http://{claims}/v1/claims"));
    drop(live);
    // A replay from the buffer (Last-Event-ID: 0) has the event, not the
    // code: a code is for whoever follows the stream as it happens.
    let mut replay = events_stream(&d.addr, Some(0));
    let replayed = next_event(&mut replay, "scale-up");
    assert_eq!(replayed.data["requestId"], up.body["requestId"]);
    assert!(
        replayed.data.get("claimCode").is_none(),
        "{:?}",
        replayed.data
    );
    assert!(!replayed.data.to_string().contains("kcc_"));
    drop(replay);
    // The store's copy of the stream never holds the code.
    let (_, stored) = sh(&format!(
        "sqlite3 {} \"SELECT body FROM events WHERE body LIKE '%scale-up%'\"",
        dir.path("state/state.db").display()
    ));
    assert!(
        stored.contains(up.body["requestId"].as_str().unwrap()),
        "{stored}"
    );
    assert!(!stored.contains("kcc_"), "{stored}");

    let (status, body) = d.http("DELETE", &format!("/v1/agents/{agent}"), None);
    assert!(status < 300, "{status} {body}");
    let down = received.recv_timeout(PATIENCE).unwrap();
    assert!(down.right && !down.wrong);
    assert_eq!(down.body["event"], "scale-down");
    assert_eq!(down.body["reason"], "operator");
    d.terminate();
}

#[test]
fn the_reconciler_tears_down_an_instance_no_recorded_agent_owns() {
    let dir = Dir::with_config("");
    let record = dir.write_script("record.sh", RECORDER);
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: cloud\n    type: event\n    maxAgents: 1\n    labelSets:\n      - labels: [cloud]\n    x-kici-scaler:\n      registrationTimeoutSeconds: 60\n      provisioner:\n        command: [\"{}\"]\n",
            record.display()
        ),
    )
    .unwrap();
    let claims = free_loopback_addr();
    let mut args: Vec<&str> = FAST_RECONCILE.to_vec();
    args.extend(["--claims-listen", claims.as_str()]);
    let mut d = Daemon::start(&dir, &args, &[]);
    d.scale("r1", &["cloud"]);
    let up = wait_event(&dir, "the scale-up", |e| e["event"] == "scale-up");
    wait_until("the scale-up is confirmed", || {
        outbox_rows(&dir) == ["scale-up:1"]
    });
    d.kill9();
    // The agent's record is lost (the instance is not): nothing owns it.
    let (ok, out) = sh(&format!(
        "sqlite3 {} 'DELETE FROM agents; DELETE FROM pending_requests;'",
        dir.path("state/state.db").display()
    ));
    assert!(ok, "{out}");

    let d = Daemon::start(&dir, &args, &[]);
    let down = wait_event(&dir, "the orphan's scale-down", |e| {
        e["event"] == "scale-down"
    });
    assert_eq!(down["agentId"], up["agentId"]);
    assert_eq!(down["reason"], "orphaned", "{down}");
    wait_until("the outbox is empty", || outbox_rows(&dir).is_empty());
    let m = d.metrics();
    assert_eq!(
        metric(
            &m,
            "kici_orch_scaler_scale_down_emitted_total",
            "reason=\"orphaned\""
        ),
        1.0
    );
    d.terminate();
}

/// `GET /v1/events` (resuming after `last_event_id` if given), its head read.
struct EventsStream {
    stream: std::net::TcpStream,
    raw: String,
}

fn events_stream(addr: &str, last_event_id: Option<u64>) -> EventsStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let resume = last_event_id.map_or(String::new(), |id| format!("Last-Event-ID: {id}\r\n"));
    write!(
        stream,
        "GET /v1/events HTTP/1.0\r\nAuthorization: Bearer {}\r\n{resume}\r\n",
        crate::common::daemon::TEST_API_TOKEN
    )
    .unwrap();
    let mut s = EventsStream {
        stream,
        raw: String::new(),
    };
    // The head first: once it is read, the reader is following.
    while !s.raw.contains("\r\n\r\n") {
        s.read_some();
    }
    let i = s.raw.find("\r\n\r\n").unwrap();
    assert!(
        s.raw.starts_with("HTTP/1.0 200") || s.raw.starts_with("HTTP/1.1 200"),
        "{}",
        s.raw
    );
    s.raw.drain(..i + 4);
    s
}

impl EventsStream {
    fn read_some(&mut self) {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        let n = self.stream.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        self.raw.push_str(std::str::from_utf8(&buf[..n]).unwrap());
    }
}

/// The next SSE event named `name`.
fn next_event(s: &mut EventsStream, name: &str) -> crate::common::SseEvent {
    loop {
        if let Some(e) = crate::common::take_sse_events(&mut s.raw)
            .into_iter()
            .find(|e| e.event == name)
        {
            return e;
        }
        s.read_some();
    }
}

/// `POST /v1/jobs` with `body`, accepted: the job's id.
fn post_job(d: &Daemon, body: &str) -> String {
    let (status, answer) = http(&d.addr, "POST", "/v1/jobs", &[], Some(body));
    assert!(
        status == 200 || status == 201 || status == 202,
        "{status} {answer}"
    );
    let job: Value = serde_json::from_str(&answer).unwrap();
    job["jobId"]
        .as_str()
        .or(job["id"].as_str())
        .unwrap()
        .to_owned()
}
