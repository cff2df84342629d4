//! Crash recovery of the real daemon with real bare-metal agents: kill -9
//! at every named failpoint and at random moments, restart, reconcile, and
//! check the real world — `/proc`, cgroupfs, the agent directories and the
//! store's rows — for leaks and for agents tracked other than exactly once.
//!
//! The binary is the test build (`failpoints` feature): the daemon kills
//! itself with SIGKILL when it reaches the failpoint named in
//! `KICI_SCALER_CRASH_AT`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");
const PATIENCE: Duration = Duration::from_secs(30);
const CGROUP_V2: &str = "/sys/fs/cgroup/unified";

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
    fn new(max_agents: u32) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        let script = d.path().join("agent.sh");
        // Never registers: stays `booted` until destroyed (registration
        // timeout is far away), like a slow guest.
        std::fs::write(&script, "#!/bin/sh\nexec sleep 1000\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(
            d.path().join("scalers.yaml"),
            format!(
                "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: {max_agents}\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
                script.display()
            ),
        )
        .unwrap();
        Dir(d)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    fn instance(&self) -> String {
        std::fs::read_to_string(self.path("state/instance-id"))
            .unwrap()
            .trim()
            .to_owned()
    }
}

struct Daemon {
    child: Child,
    addr: String,
    lines: mpsc::Receiver<String>,
    /// The last lines read (for failure messages).
    seen: std::collections::VecDeque<String>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_message(line: &str) -> Option<(String, Value)> {
    let v: Value = serde_json::from_str(line).ok()?;
    let fields = v["fields"].clone();
    Some((fields["message"].as_str()?.to_owned(), fields))
}

impl Daemon {
    /// Starts `serve`; returns once the API listens, or `None` if the
    /// process died first (a crash failpoint hit during start-up).
    fn start(dir: &Dir, crash_at: Option<&str>) -> Result<Daemon, std::process::ExitStatus> {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--config")
            .arg(dir.path("scalers.yaml"))
            .arg("--state-dir")
            .arg(dir.path("state"))
            .arg("--machine-ledger-dir")
            .arg(dir.path("ledger"))
            .args(["--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"])
            .args([
                "--reconcile-age-seconds",
                "0",
                "--reconcile-interval-seconds",
                "1",
            ])
            .args(["--shutdown-grace-seconds", "20"]);
        for (k, _) in std::env::vars() {
            if k.starts_with("KICI_") {
                cmd.env_remove(k);
            }
        }
        if let Some(fp) = crash_at {
            cmd.env("KICI_SCALER_CRASH_AT", fp);
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
            seen: Default::default(),
        };
        match d.wait_for_log("control API listening") {
            Some(fields) => {
                d.addr = fields["addr"].as_str().unwrap().to_owned();
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

    /// The fields of the next log line with `message`, or `None` once the
    /// daemon's stderr closed (it died).
    fn wait_for_log(&mut self, message: &str) -> Option<Value> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if self.seen.len() == 8 {
                        self.seen.pop_front();
                    }
                    self.seen.push_back(line.clone());
                    if let Some((m, fields)) = log_message(&line) {
                        if m == message {
                            return Some(fields);
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("the daemon never logged {message:?}")
                }
            }
        }
    }

    /// Waits for the process to end; its status.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the daemon did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn http(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        http(&self.addr, method, path, body)
    }

    fn agents(&self) -> BTreeSet<String> {
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

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
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

/// What the host holds for this instance: agent cgroups with their pids,
/// and agent directories.
#[derive(Debug, Default)]
struct Reality {
    cgroups: BTreeSet<String>,
    pids: BTreeSet<(String, i32)>,
    agent_dirs: BTreeSet<String>,
}

fn reality(dir: &Dir) -> Reality {
    let mut r = Reality::default();
    let root = Path::new(CGROUP_V2)
        .join("kici-scaler")
        .join(dir.instance());
    if let Ok(scalers) = std::fs::read_dir(&root) {
        for scaler in scalers.flatten() {
            let Ok(leaves) = std::fs::read_dir(scaler.path()) else {
                continue;
            };
            for leaf in leaves.flatten() {
                if !leaf.path().is_dir() {
                    continue;
                }
                let agent = leaf.file_name().to_string_lossy().into_owned();
                let procs =
                    std::fs::read_to_string(leaf.path().join("cgroup.procs")).unwrap_or_default();
                for pid in procs.lines().filter_map(|l| l.trim().parse().ok()) {
                    r.pids.insert((agent.clone(), pid));
                }
                r.cgroups.insert(agent);
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(dir.path("state/agents")) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() && name != "retired" {
                r.agent_dirs.insert(name);
            }
        }
    }
    r
}

/// The store's rows, read through the store itself (SQLite allows a reader
/// beside the daemon).
fn recorded(dir: &Dir) -> BTreeSet<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let url: kici_store::StoreUrl = format!("sqlite:{}", dir.path("state/state.db").display())
            .parse()
            .unwrap();
        let owner = dir.instance().parse().unwrap();
        let store = kici_store::open(&url, owner, kici_store::StoreOptions::default())
            .await
            .unwrap();
        let rows = store.agents().await.unwrap();
        store.close().await;
        rows.into_iter().map(|r| r.agent_id.to_string()).collect()
    })
}

/// After recovery and two reconcile passes (mark, then reap): every live
/// agent is tracked exactly once — one cgroup, one directory, one row,
/// processes only in tracked cgroups — and nothing else remains.
fn assert_consistent(d: &mut Daemon, dir: &Dir, context: &str) {
    d.wait_for_log("reconcile pass").unwrap();
    d.wait_for_log("reconcile pass").unwrap();
    d.wait_for_log("reconcile pass").unwrap();
    wait_settled(d, context);
    let live = d.agents();
    let r = reality(dir);
    assert_eq!(r.cgroups, live, "{context}: cgroups vs live agents");
    assert_eq!(r.agent_dirs, live, "{context}: agent dirs vs live agents");
    assert_eq!(recorded(dir), live, "{context}: store rows vs live agents");
    for (agent, pid) in &r.pids {
        assert!(
            live.contains(agent),
            "{context}: pid {pid} in untracked cgroup {agent}"
        );
    }
}

/// Waits until no agent is between states (a destroy half done would make
/// the comparison racy).
fn wait_settled(d: &Daemon, context: &str) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, body) = d.http("GET", "/v1/agents", None);
        let v: Value = serde_json::from_str(&body).unwrap_or_default();
        let moving = v["agents"].as_array().is_none_or(|a| {
            a.iter().any(|a| {
                matches!(
                    a["state"].as_str(),
                    Some("requested" | "provisioning" | "destroying")
                )
            })
        });
        if !moving {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{context}: agents never settled: {body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM: every agent destroyed, exit 0, nothing left anywhere.
fn assert_clean_shutdown(mut d: Daemon, dir: &Dir, context: &str) {
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&d.child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    assert_eq!(d.wait_exit().code(), Some(0), "{context}: shutdown exit");
    let r = reality(dir);
    assert!(
        r.cgroups.is_empty(),
        "{context}: cgroups left {:?}",
        r.cgroups
    );
    assert!(r.pids.is_empty(), "{context}: processes left {:?}", r.pids);
    assert!(
        r.agent_dirs.is_empty(),
        "{context}: dirs left {:?}",
        r.agent_dirs
    );
    assert!(recorded(dir).is_empty(), "{context}: rows left");
}

fn scale(d: &Daemon, job: &str) -> Option<String> {
    let (status, body) = d.http(
        "POST",
        "/v1/scale",
        Some(&format!(r#"{{"jobId":"{job}","labels":["local"]}}"#)),
    );
    if status != 202 {
        return None;
    }
    serde_json::from_str::<Value>(&body).ok()?["agentId"]
        .as_str()
        .map(str::to_owned)
}

fn wait_state(d: &Daemon, agent: &str, state: &str) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (_, body) = d.http("GET", &format!("/v1/agents/{agent}"), None);
        if serde_json::from_str::<Value>(&body).is_ok_and(|v| v["state"] == state) {
            return;
        }
        assert!(Instant::now() < deadline, "{agent} never reached {state}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every failpoint the binary has; the crash test below must cover each
/// provisioning and release step of the bare-metal backend and the runtime.
fn failpoints() -> Vec<String> {
    let out = Command::new(BIN).arg("failpoints").output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_step_of_every_backend_has_a_failpoint() {
    let fps = failpoints();
    for step in [
        "kici_engine::spawn::recorded",
        "kici_engine::spawn::backend_done",
        "kici_engine::destroy::backend_done",
        "kici_backends::spawn::dir",
        "kici_backends::spawn::cgroup",
        "kici_backends::spawn::limits",
        "kici_backends::spawn::process",
        "kici_backends::spawn::marker",
        "kici_backends::spawn::watch",
        "kici_backends::destroy::signal",
        "kici_backends::destroy::kill",
        "kici_backends::destroy::cgroup",
        "kici_backends::destroy::files",
        "kici_backends::list::scan",
        "kici_backends::adopt::check",
        "kici_backends::adopt::watch",
        "kici_scaler::reconcile::reaped",
    ] {
        assert!(
            fps.iter().any(|f| f == step),
            "no failpoint for {step}: {fps:?}"
        );
    }
    // And a crash test below for each of those that a request reaches.
    let covered: BTreeSet<&str> = SPAWN_STEPS
        .iter()
        .chain(DESTROY_STEPS)
        .chain(RESTART_STEPS)
        .copied()
        .collect();
    for fp in &fps {
        if fp.starts_with("kici_backends::") || fp.starts_with("kici_engine::") {
            assert!(covered.contains(fp.as_str()), "{fp} has no crash test");
        }
    }
}

const SPAWN_STEPS: &[&str] = &[
    "kici_engine::spawn::recorded",
    "kici_backends::spawn::dir",
    "kici_backends::spawn::cgroup",
    "kici_backends::spawn::limits",
    "kici_backends::spawn::process",
    "kici_backends::spawn::marker",
    "kici_backends::spawn::watch",
    "kici_engine::spawn::backend_done",
];
const DESTROY_STEPS: &[&str] = &[
    "kici_backends::destroy::signal",
    "kici_backends::destroy::kill",
    "kici_backends::destroy::cgroup",
    "kici_backends::destroy::files",
    "kici_engine::destroy::backend_done",
];
/// Reached only when a daemon starts over recorded agents.
const RESTART_STEPS: &[&str] = &[
    "kici_backends::list::scan",
    "kici_backends::adopt::check",
    "kici_backends::adopt::watch",
];

/// Crash at `fp` (the trigger returns the agents that must survive it),
/// then restart, check, and shut down cleanly.
fn crash_then_recover(dir: &Dir, fp: &str, trigger: impl FnOnce(&mut Daemon) -> Vec<String>) {
    let mut d =
        Daemon::start(dir, Some(fp)).unwrap_or_else(|s| panic!("{fp}: died at start: {s:?}"));
    let survivors = trigger(&mut d);
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to kill itself there"
    );
    let mut d = Daemon::start(dir, None).unwrap();
    assert_consistent(&mut d, dir, fp);
    let live = d.agents();
    for s in &survivors {
        assert!(
            live.contains(s),
            "{fp}: {s} survived the crash but was not re-adopted"
        );
        let pids = reality(dir).pids;
        assert!(pids.iter().any(|(a, _)| a == s), "{fp}: {s} has no process");
    }
    assert_clean_shutdown(d, dir, fp);
}

#[test]
fn serial_crash_at_each_spawn_step_leaks_nothing() {
    for fp in SPAWN_STEPS {
        let dir = Dir::new(4);
        // One agent that survives the crash, then the one being spawned.
        let mut first = Daemon::start(&dir, None).unwrap();
        let survivor = scale(&first, "survivor").unwrap();
        wait_state(&first, &survivor, "booted");
        first.kill9();
        crash_then_recover(&dir, fp, |d| {
            scale(d, "crashing");
            vec![survivor]
        });
    }
}

#[test]
fn serial_crash_at_each_destroy_step_leaks_nothing() {
    for fp in DESTROY_STEPS {
        let dir = Dir::new(4);
        crash_then_recover(&dir, fp, |d| {
            let keep = scale(d, "keep").unwrap();
            let agent = scale(d, "victim").unwrap();
            wait_state(d, &keep, "booted");
            wait_state(d, &agent, "booted");
            let (status, body) = d.http("DELETE", &format!("/v1/agents/{agent}"), None);
            assert!(status == 202 || status == 0, "{status} {body}");
            vec![keep]
        });
    }
}

#[test]
fn serial_crash_while_restarting_over_recorded_agents_leaks_nothing() {
    for fp in RESTART_STEPS {
        let dir = Dir::new(4);
        let mut first = Daemon::start(&dir, None).unwrap();
        let a = scale(&first, "a").unwrap();
        wait_state(&first, &a, "booted");
        first.kill9();
        // The crash comes during start-up (recovery or the first pass).
        let status = match Daemon::start(&dir, Some(fp)) {
            Err(status) => status,
            Ok(mut d) => d.wait_exit(),
        };
        assert_eq!(status.signal(), Some(9), "{fp}");
        let mut d = Daemon::start(&dir, None).unwrap();
        assert_consistent(&mut d, &dir, fp);
        assert!(
            d.agents().contains(&a),
            "{fp}: the live agent was re-adopted"
        );
        assert_clean_shutdown(d, &dir, fp);
    }
}

/// 100+ kill -9 at random moments under a stream of requests and
/// deletions; after each restart the world matches the daemon's view.
#[test]
fn serial_random_kills_under_load_leak_nothing() {
    use rand::Rng;
    let dir = Dir::new(6);
    let mut rng = rand::thread_rng();
    let mut job = 0u32;
    let mut seen_alive = 0;
    for round in 0..110 {
        let mut d = Daemon::start(&dir, None).unwrap();
        let addr = d.addr.clone();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let start = job;
        let load = std::thread::spawn(move || {
            let mut n = start;
            let mut agents = Vec::new();
            while stop_rx.try_recv().is_err() {
                n += 1;
                let (status, body) = http(
                    &addr,
                    "POST",
                    "/v1/scale",
                    Some(&format!(r#"{{"jobId":"j{n}","labels":["local"]}}"#)),
                );
                if status == 0 {
                    break;
                }
                if let Ok(v) = serde_json::from_str::<Value>(&body) {
                    if let Some(a) = v["agentId"].as_str() {
                        agents.push(a.to_owned());
                    }
                }
                if n.is_multiple_of(3) {
                    if let Some(a) = agents.pop() {
                        http(&addr, "DELETE", &format!("/v1/agents/{a}"), None);
                    }
                }
            }
            n
        });
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..150)));
        d.kill9();
        let _ = stop_tx.send(());
        job = load.join().unwrap() + 1;
        if round % 25 == 24 {
            // Now and then, a full check mid-way.
            let mut d = Daemon::start(&dir, None).unwrap();
            assert_consistent(&mut d, &dir, &format!("round {round}"));
            seen_alive += d.agents().len();
            d.kill9();
        }
    }
    let mut d = Daemon::start(&dir, None).unwrap();
    assert_consistent(&mut d, &dir, "after the last kill");
    seen_alive += d.agents().len();
    assert!(
        seen_alive > 0,
        "the load never left an agent to recover: the test proved nothing"
    );
    assert!(job > 110, "the load sent too few requests ({job})");
    assert_clean_shutdown(d, &dir, "after the last kill");
}
