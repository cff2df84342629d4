//! The real daemon on PostgreSQL: two daemons sharing one database never
//! touch each other's agents, and a store outage answers 503 quickly,
//! loses nothing and heals without a restart. PostgreSQL comes from
//! `scripts/postgres.sh` (never skipped: the script starts it if needed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");
const PATIENCE: Duration = Duration::from_secs(30);

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/postgres.sh")
}

/// `scripts/postgres.sh <cmd>` on `port`; its stdout.
fn pg(cmd: &str, port: u16) -> String {
    let out = Command::new("bash")
        .arg(script())
        .arg(cmd)
        .env("KICI_PG_PORT", port.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "postgres.sh {cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// A fresh database on the server at `port`; its URL.
fn fresh_database(port: u16) -> String {
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

struct Dir(tempfile::TempDir);

/// Bare-metal agents outlive a killed daemon by design; when a test ends
/// (or fails) with agents still up, they must not outlive the test.
impl Drop for Dir {
    fn drop(&mut self) {
        let Ok(id) = std::fs::read_to_string(self.0.path().join("state/instance-id")) else {
            return;
        };
        let root = Path::new("/sys/fs/cgroup/unified/kici-scaler").join(id.trim());
        if root.exists() {
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
    }
}

impl Dir {
    fn new() -> Self {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        let script = d.path().join("agent.sh");
        std::fs::write(&script, "#!/bin/sh\nexec sleep 1000\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(
            d.path().join("scalers.yaml"),
            format!(
                "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 4\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
                script.display()
            ),
        )
        .unwrap();
        Dir(d)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

struct Daemon {
    child: Child,
    addr: String,
    lines: mpsc::Receiver<String>,
    /// The fields of its "recovery done" line.
    recovery: Value,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn start(dir: &Dir, state: &str) -> Daemon {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--config")
            .arg(dir.path("scalers.yaml"))
            .arg("--state-dir")
            .arg(dir.path("state"))
            .arg("--machine-ledger-dir")
            .arg(dir.path("ledger"))
            .args(["--state", state])
            .args(["--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"])
            .args([
                "--reconcile-age-seconds",
                "0",
                "--reconcile-interval-seconds",
                "1",
            ]);
        for (k, _) in std::env::vars() {
            if k.starts_with("KICI_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("KICI_SCALER_LOG", "info")
            .stdin(Stdio::null())
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
            lines,
            recovery: Value::Null,
        };
        d.recovery = d.wait_for_log("recovery done");
        let fields = d.wait_for_log("control API listening");
        d.addr = fields["addr"].as_str().unwrap().to_owned();
        d
    }

    fn wait_for_log(&mut self, message: &str) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("the daemon never logged {message:?}"));
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if v["fields"]["message"] == message {
                return v["fields"].clone();
            }
        }
    }

    fn http(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let mut s = std::net::TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut req = format!("{method} {path} HTTP/1.0\r\nHost: x\r\n");
        if let Some(b) = body {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(body.unwrap_or(""));
        s.write_all(req.as_bytes()).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        (
            head.split(' ').nth(1).unwrap().parse().unwrap(),
            body.to_owned(),
        )
    }

    fn scale(&self, job: &str) -> (u16, String) {
        self.http(
            "POST",
            "/v1/scale",
            Some(&format!(r#"{{"jobId":"{job}","labels":["local"]}}"#)),
        )
    }

    fn spawn(&self, job: &str) -> String {
        let (status, body) = self.scale(job);
        assert_eq!(status, 202, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()["agentId"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    fn state_of(&self, agent: &str) -> String {
        let (_, body) = self.http("GET", &format!("/v1/agents/{agent}"), None);
        serde_json::from_str::<Value>(&body).unwrap_or_default()["state"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    fn agents(&self) -> BTreeSet<String> {
        let (_, body) = self.http("GET", "/v1/agents", None);
        serde_json::from_str::<Value>(&body).unwrap()["agents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["agentId"].as_str().unwrap().to_owned())
            .collect()
    }

    fn terminate(mut self) {
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        )
        .unwrap();
        assert_eq!(self.child.wait().unwrap().code(), Some(0));
    }
}

/// Processes in the agent's tracking cgroup of `instance`.
fn agent_pids(dir: &Dir, agent: &str) -> usize {
    let instance = std::fs::read_to_string(dir.path("state/instance-id")).unwrap();
    let leaf = Path::new("/sys/fs/cgroup/unified/kici-scaler")
        .join(instance.trim())
        .join("local")
        .join(agent)
        .join("cgroup.procs");
    std::fs::read_to_string(leaf)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serial_two_daemons_on_one_postgres_never_touch_each_others_agents() {
    let url = fresh_database(54329);
    let (da, db) = (Dir::new(), Dir::new());
    let mut a = Daemon::start(&da, &url);
    let b = Daemon::start(&db, &url);
    let a1 = a.spawn("a1");
    let a2 = a.spawn("a2");
    let b1 = b.spawn("b1");
    // Booted: the spawn finished (a spawn cut short by the crash would be
    // a failed spawn, destroyed on recovery — another test's subject).
    wait_until("every agent is up", || {
        a.state_of(&a1) == "booted" && a.state_of(&a2) == "booted" && b.state_of(&b1) == "booted"
    });
    assert!(agent_pids(&da, &a1) == 1 && agent_pids(&da, &a2) == 1 && agent_pids(&db, &b1) == 1);
    // A crashes and comes back: it takes back its own two, and B's agent
    // and B's view are untouched through A's recovery and reconcile passes.
    let _ = a.child.kill();
    let _ = a.child.wait();
    let mut a = Daemon::start(&da, &url);
    assert_eq!(a.recovery["adopted"], 2, "{}", a.recovery);
    a.wait_for_log("reconcile pass");
    a.wait_for_log("reconcile pass");
    a.wait_for_log("reconcile pass");
    assert_eq!(a.agents(), BTreeSet::from([a1.clone(), a2.clone()]));
    assert_eq!(b.agents(), BTreeSet::from([b1.clone()]));
    assert_eq!(agent_pids(&db, &b1), 1, "B's agent still runs");
    assert_eq!(agent_pids(&da, &a1), 1);
    // One identity, one daemon: a clone of A's state dir is refused by the
    // advisory lock even though the state-dir lock is another file.
    let clone = Dir::new();
    std::fs::create_dir_all(clone.path("state")).unwrap();
    for f in ["instance-id", "machine-id"] {
        std::fs::copy(
            da.path(&format!("state/{f}")),
            clone.path(&format!("state/{f}")),
        )
        .unwrap();
    }
    let out = Command::new(BIN)
        .arg("serve")
        .arg("--config")
        .arg(clone.path("scalers.yaml"))
        .arg("--state-dir")
        .arg(clone.path("state"))
        .args([
            "--state",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--gateway-listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already in use"), "{err}");
    a.terminate();
    b.terminate();
    assert_eq!(
        agent_pids(&da, &a1) + agent_pids(&da, &a2) + agent_pids(&db, &b1),
        0
    );
}

#[test]
fn serial_a_store_outage_answers_503_loses_nothing_and_heals_without_restart() {
    // A private server, so stopping it disturbs no other test.
    let port = 54339;
    let url = fresh_database(port);
    let dir = Dir::new();
    let d = Daemon::start(&dir, &url);
    let before = d.spawn("before");
    wait_until("the agent runs", || agent_pids(&dir, &before) == 1);

    pg("stop", port);
    let asked = Instant::now();
    let (status, body) = d.scale("during");
    let took = asked.elapsed();
    pg("start", port);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store-unavailable"), "{body}");
    // The pool's acquire bound (1 s) is what answers; generous slack for a
    // loaded machine, but far below a hung request.
    assert!(took < Duration::from_secs(5), "503 took {took:?}");
    assert_eq!(
        d.agents(),
        BTreeSet::from([before.clone()]),
        "nothing started"
    );

    // Back without a restart: new requests spawn, the old agent is intact.
    wait_until("the store answers again", || d.scale("after").0 == 202);
    let after = d.agents();
    assert!(after.contains(&before) && after.len() == 2, "{after:?}");
    d.terminate();
    assert_eq!(agent_pids(&dir, &before), 0);
}
