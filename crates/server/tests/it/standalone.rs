//! Standalone jobs through the real binaries: `kici-scaler run` and
//! `kici-scaler serve` with the real bare-metal backend, running the real
//! `kici-agent-lite`, which connects back to the real agent gateway.
//!
//! The agent binary is the one `cargo build --workspace` (or `cargo
//! nextest run --workspace`) puts next to `kici-scaler`; when only this
//! package was built, it is built once into a target dir of its own.
//!
//! Every wait is on an event (a log line, an SSE event, a process exit, a
//! FIFO); [`PATIENCE`] only turns a hang into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");
const PATIENCE: Duration = Duration::from_secs(60);

fn agent_dir() -> &'static Path {
    common::daemon::agent_lite_dir()
}

fn agent_binary() -> PathBuf {
    agent_dir().join("kici-agent-lite")
}

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Self {
        Dir(tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// A config with one bare-metal scaler running `binary`.
    fn config(&self, binary: &Path, max_agents: u32, ext: &str) -> PathBuf {
        self.write(
            "scalers.yaml",
            &format!(
                "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: {max_agents}\n{ext}    labelSets:\n      - labels: [linux, local]\n        binaryPath: {}\n",
                binary.display()
            ),
        )
    }

    fn tmp(&self) -> PathBuf {
        let t = self.path("tmp");
        std::fs::create_dir_all(&t).unwrap();
        t
    }

    /// Where `run` keeps its state dirs (with `XDG_RUNTIME_DIR` at
    /// [`Dir::tmp`]).
    fn runs(&self) -> PathBuf {
        self.tmp().join("kici-scaler")
    }
}

/// A command with a clean environment: no `KICI_*` but the test API token,
/// `XDG_RUNTIME_DIR` in the test dir (so `run`'s temporary state dir can be
/// checked), the agent on PATH.
fn command(dir: &Dir) -> Command {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.starts_with("KICI_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("XDG_RUNTIME_DIR", dir.tmp())
        .env("PATH", format!("{}:/usr/bin:/bin", agent_dir().display()))
        .env(
            "KICI_SCALER_API_TOKEN",
            crate::common::daemon::TEST_API_TOKEN,
        );
    cmd
}

fn run(dir: &Dir, config: &Path, labels: &str, job: &[&str]) -> Output {
    let mut cmd = command(dir);
    cmd.arg("run")
        .arg("--config")
        .arg(config)
        .arg("--labels")
        .arg(labels)
        .arg("--")
        .args(job)
        .stdin(Stdio::null());
    cmd.output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Nothing of `run` is left where it keeps its state dirs.
fn assert_run_left_nothing(dir: &Dir) {
    let left: Vec<_> = std::fs::read_dir(dir.runs())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

fn process_gone(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    matches!(
        stat.rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next(),
        None | Some("Z")
    )
}

// ------------------------------------------------------------------ run

#[test]
fn run_of_the_quickstart_prints_the_output_and_exits_with_the_jobs_code() {
    let dir = Dir::new();
    let out = run(
        &dir,
        &repo_file("examples/quickstart.yaml"),
        "linux",
        &["sh", "-c", "echo hi; echo oops >&2; exit 3"],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hi\n");
    assert_eq!(text(&out.stderr), "oops\n", "only the job's own stderr");
    assert_run_left_nothing(&dir);
}

#[test]
fn run_of_a_job_killed_by_a_signal_exits_128_plus_the_signal() {
    let dir = Dir::new();
    let config = dir.config(&agent_binary(), 1, "");
    let out = run(&dir, &config, "local", &["sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(137), "{}", text(&out.stderr));
    assert_run_left_nothing(&dir);
}

#[test]
fn run_passes_env_and_kills_at_the_timeout() {
    let dir = Dir::new();
    let config = dir.config(&agent_binary(), 1, "");
    let out = command(&dir)
        .args(["run", "--config"])
        .arg(&config)
        .args([
            "--labels",
            "local",
            "--env",
            "GREETING=hello there",
            "--timeout",
            "1",
            "--",
            "sh",
            "-c",
            "echo \"$GREETING\"; exec sleep 100",
        ])
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "hello there\n");
    assert_eq!(out.status.code(), Some(143), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("timeout"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn run_with_no_backend_exits_125_with_the_reason() {
    let dir = Dir::new();
    let out = run(
        &dir,
        &repo_file("examples/quickstart.yaml"),
        "gpu",
        &["true"],
    );
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(
        err.contains("no-backend") && err.contains("not-superset:gpu"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
    assert_run_left_nothing(&dir);
}

#[test]
fn run_with_a_missing_agent_binary_exits_125_naming_it() {
    let dir = Dir::new();
    let config = dir.write(
        "scalers.yaml",
        "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [local]\n        binaryPath: no-such-agent\n",
    );
    let out = run(&dir, &config, "local", &["true"]);
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(
        err.contains("labelSets[0].binaryPath: no-such-agent: not found on PATH"),
        "{err}"
    );
}

/// An agent that never registers is destroyed at `registrationTimeout`
/// (1 s here) and `run` says so.
#[test]
fn run_fails_125_when_the_agent_never_registers_and_destroys_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = Dir::new();
    let pidfile = dir.path("agent.pid");
    let script = dir.write(
        "silent-agent.sh",
        &format!(
            "#!/bin/sh\necho $$ > {}\nexec sleep 1000\n",
            pidfile.display()
        ),
    );
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.config(
        &script,
        1,
        "    x-kici-scaler:\n      registrationTimeoutSeconds: 1\n",
    );
    let out = run(&dir, &config, "local", &["true"]);
    assert_eq!(out.status.code(), Some(125), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("registration-timeout"), "{err}");
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(process_gone(pid), "the silent agent {pid} still runs");
    assert_run_left_nothing(&dir);
}

/// `run --labels local -- sh -c CMD`, returned once the job printed its
/// first line, `started` (stdout read, stderr piped).
fn run_until_started(dir: &Dir, config: &Path, cmd: &str) -> Child {
    let mut child = command(dir)
        .args(["run", "--config"])
        .arg(config)
        .args(["--labels", "local", "--", "sh", "-c", cmd])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "started\n");
    child
}

/// Ctrl-C (SIGINT) cancels the job, destroys its agent and exits 130.
#[test]
fn run_interrupted_destroys_the_agent_and_exits_130() {
    let dir = Dir::new();
    let pidfile = dir.path("job.pid");
    let config = dir.config(&agent_binary(), 1, "");
    let cmd = format!(
        "echo $$ > {}; echo started; exec sleep 1000",
        pidfile.display()
    );
    let mut child = run_until_started(&dir, &config, &cmd);
    let job_pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(
        process_gone(job_pid),
        "the job's process {job_pid} survived"
    );
    assert_run_left_nothing(&dir);
}

/// A `run` whose job forks a child into a session of its own (as a
/// daemonising job does), started and waited for: the job's pid, the
/// escaped child's pid and the job's cgroup v2 directory.
struct EscapingRun {
    child: Child,
    job: i32,
    escaped: i32,
    cgroup: PathBuf,
}

impl EscapingRun {
    fn start(dir: &Dir) -> Self {
        let config = dir.config(&agent_binary(), 1, "");
        let job_pid = dir.path("job.pid");
        let escaped_pid = dir.path("escaped.pid");
        let cmd = format!(
            "echo $$ > {job}; setsid sh -c 'echo $$ > {esc}; exec sleep 1001' & \
             while [ ! -s {esc} ]; do sleep 0.05; done; echo started; exec sleep 1000",
            job = job_pid.display(),
            esc = escaped_pid.display(),
        );
        let child = run_until_started(dir, &config, &cmd);
        let pid = |p: &Path| -> i32 { std::fs::read_to_string(p).unwrap().trim().parse().unwrap() };
        let job = pid(&job_pid);
        let escaped = pid(&escaped_pid);
        let cgroup = v2_cgroup_of(job).expect("the job runs in a cgroup v2 directory");
        assert_eq!(
            v2_cgroup_of(escaped).as_ref(),
            Some(&cgroup),
            "the escaped child left the agent's cgroup"
        );
        Self {
            child,
            job,
            escaped,
            cgroup,
        }
    }

    fn signal(&self, signal: rustix::process::Signal) {
        rustix::process::kill_process(rustix::process::Pid::from_child(&self.child), signal)
            .unwrap();
    }

    fn wait(mut self) -> (Option<i32>, String) {
        let status = self.child.wait().unwrap();
        let mut err = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (status.code(), err)
    }
}

/// The cgroup v2 directory a process is in (wherever the v2 hierarchy is
/// mounted on this host).
fn v2_cgroup_of(pid: i32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .iter()
        .map(|root| Path::new(root).join(rel.trim_start_matches('/')))
        .find(|d| d.join("cgroup.procs").is_file())
}

fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat.rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

/// SIGHUP (a closed terminal or ssh session) and SIGQUIT cancel the job as
/// SIGINT does: the agent, the job, what the job forked into a session of
/// its own and the agent's cgroup are gone, and so is the state dir.
#[test]
fn run_on_sighup_and_sigquit_destroys_everything_and_exits_128_plus_the_signal() {
    for (signal, code) in [
        (rustix::process::Signal::HUP, 129),
        (rustix::process::Signal::QUIT, 131),
    ] {
        let dir = Dir::new();
        let run = EscapingRun::start(&dir);
        let (job, escaped, cgroup) = (run.job, run.escaped, run.cgroup.clone());
        let agent = parent_of(job);
        run.signal(signal);
        let (status, err) = run.wait();
        assert_eq!(status, Some(code), "{signal:?}: {err}");
        assert!(err.contains("interrupted"), "{signal:?}: {err}");
        for (what, pid) in [("job", job), ("escaped child", escaped), ("agent", agent)] {
            assert!(process_gone(pid), "{signal:?}: the {what} {pid} survived");
        }
        assert!(!cgroup.exists(), "{signal:?}: {} is left", cgroup.display());
        assert_run_left_nothing(&dir);
    }
}

/// SIGKILL cannot be handled: what the killed `run` left (its agent, the
/// job's escaped child, the agent's cgroup, its state dir) is swept by the
/// next `run` on the host.
#[test]
fn what_a_killed_run_left_is_swept_by_the_next_run() {
    let dir = Dir::new();
    let killed = EscapingRun::start(&dir);
    let (job, escaped, cgroup) = (killed.job, killed.escaped, killed.cgroup.clone());
    let agent = parent_of(job);
    killed.signal(rustix::process::Signal::KILL);
    let (status, _) = killed.wait();
    assert_eq!(status, None, "killed by a signal");
    // Without a sweep, all of it outlives the killed `run`.
    assert!(!process_gone(escaped), "the escaped child died with `run`");
    assert!(cgroup.exists(), "the agent's cgroup went with `run`");
    assert_eq!(
        std::fs::read_dir(dir.runs()).unwrap().count(),
        2,
        "its state dir and, beside it, its agents' work dirs"
    );

    let config = dir.config(&agent_binary(), 1, "");
    let out = run(&dir, &config, "local", &["true"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("swept what a killed"),
        "{}",
        text(&out.stderr)
    );
    for (what, pid) in [("job", job), ("escaped child", escaped), ("agent", agent)] {
        assert!(process_gone(pid), "the {what} {pid} survived the sweep");
    }
    assert!(!cgroup.exists(), "{} is left", cgroup.display());
    assert_run_left_nothing(&dir);
}

// ---------------------------------------------------------------- serve

struct Daemon {
    child: Child,
    addr: String,
    lines: mpsc::Receiver<String>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn start(dir: &Dir, config: &Path) -> Daemon {
        let mut child = command(dir)
            .arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--state-dir")
            .arg(dir.path("state"))
            .arg("--machine-ledger-dir")
            .arg(dir.path("ledger"))
            .args(["--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"])
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
            lines,
        };
        loop {
            let line = d
                .lines
                .recv_timeout(PATIENCE)
                .expect("the daemon never said it listens");
            let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            if v["fields"]["message"] == "control API listening" {
                d.addr = v["fields"]["addr"].as_str().unwrap().to_owned();
                return d;
            }
        }
    }

    fn post_job(&self, labels: &[&str], command: &[&str]) -> (u16, Value) {
        let body = serde_json::json!({"labels": labels, "command": command}).to_string();
        let (status, body) = http(&self.addr, "POST", "/v1/jobs", Some(&body));
        (status, serde_json::from_str(&body).unwrap())
    }

    fn job(&self, id: &str) -> Value {
        let (status, body) = http(&self.addr, "GET", &format!("/v1/jobs/{id}"), None);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    fn logs(&self, id: &str) -> Logs {
        Logs::open(&self.addr, id)
    }
}

/// One HTTP/1.0 request with the test API token; panics if the daemon
/// cannot be reached.
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let (status, body) = crate::common::daemon::http(addr, method, path, &[], body);
    assert_ne!(status, 0, "{method} {path}: the daemon did not answer");
    (status, body)
}

/// `GET /v1/jobs/{id}/logs`, read as it comes.
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

    /// Reads until the job's stdout contains `needle`.
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

    /// Reads to the `end` event and the stream's close.
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
            assert!(
                self.raw.starts_with("HTTP/1.1 200") || self.raw.starts_with("HTTP/1.0 200"),
                "{}",
                self.raw
            );
            self.raw.drain(..i + 4);
            self.head_done = true;
        }
        while let Some(end) = self.raw.find("\n\n") {
            let block: String = self.raw.drain(..end + 2).collect();
            let mut event = "";
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = if v.trim() == "output" {
                        "output"
                    } else if v.trim() == "end" {
                        "end"
                    } else {
                        "other"
                    };
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim_start());
                }
            }
            match event {
                "output" => {
                    let v: Value = serde_json::from_str(&data).unwrap();
                    if v["stream"] == "stdout" {
                        self.stdout
                            .push_str(&decode_base64(v["data"].as_str().unwrap()));
                    }
                }
                "end" => self.end = Some(serde_json::from_str(&data).unwrap()),
                _ => {}
            }
        }
        true
    }
}

fn decode_base64(s: &str) -> String {
    let chunk: kici_protocol::ChunkData = serde_json::from_value(Value::String(s.into())).unwrap();
    String::from_utf8(chunk.into_bytes()).unwrap()
}

fn fifo(dir: &Dir, name: &str) -> PathBuf {
    let p = dir.path(name);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &p,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    p
}

#[test]
fn serve_runs_a_posted_job_and_streams_its_logs() {
    let dir = Dir::new();
    let config = dir.config(&agent_binary(), 2, "");
    let d = Daemon::start(&dir, &config);
    let (status, accepted) = d.post_job(&["local"], &["sh", "-c", "echo one; echo two; exit 4"]);
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["jobId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("job-"));
    assert!(
        ["spawning", "pending"].contains(&accepted["state"].as_str().unwrap()),
        "{accepted}"
    );
    let end = d.logs(&id).until_end();
    assert_eq!(end["state"], "failed");
    assert_eq!(end["exitCode"], 4);
    assert_eq!(end["end"], "exited");
    let job = d.job(&id);
    assert_eq!(job["state"], "failed");
    assert_eq!(job["exitCode"], 4);
    assert!(job["agentId"]
        .as_str()
        .unwrap()
        .starts_with("scaler-bare-metal-"));
    assert_eq!(
        job["command"],
        serde_json::json!(["sh", "-c", "echo one; echo two; exit 4"])
    );
    // The whole output is there for a late reader too.
    let mut late = d.logs(&id);
    late.until_end();
    assert_eq!(late.stdout, "one\ntwo\n");

    // `run --server` against the same daemon.
    let out = command(&dir)
        .args([
            "run",
            "--server",
            &format!("http://{}", d.addr),
            "--labels",
            "local",
            "--",
        ])
        .args(["sh", "-c", "echo via-server; exit 5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "via-server\n");
    let none = command(&dir)
        .args([
            "run",
            "--server",
            &format!("http://{}", d.addr),
            "--labels",
            "gpu",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(none.status.code(), Some(125));
    assert!(
        text(&none.stderr).contains("no-backend"),
        "{}",
        text(&none.stderr)
    );
}

/// maxAgents 1: the second job waits (`pending`) and runs once the first
/// has ended and its agent is gone.
#[test]
fn serve_queues_a_job_beyond_the_cap_and_runs_it_after_the_first() {
    let dir = Dir::new();
    let gate = fifo(&dir, "gate");
    let config = dir.config(&agent_binary(), 1, "");
    let d = Daemon::start(&dir, &config);
    let first_cmd = format!("echo started; read x < {}; echo released", gate.display());
    let (status, first) = d.post_job(&["local"], &["sh", "-c", &first_cmd]);
    assert_eq!(status, 202, "{first}");
    let first = first["jobId"].as_str().unwrap().to_owned();
    let mut first_logs = d.logs(&first);
    first_logs.until_stdout("started\n");

    let (status, second) = d.post_job(&["local"], &["sh", "-c", "echo second"]);
    assert_eq!(status, 202, "{second}");
    assert_eq!(second["state"], "pending");
    let second = second["jobId"].as_str().unwrap().to_owned();
    assert_eq!(d.job(&second)["state"], "pending");
    assert!(d.job(&second).get("agentId").is_none());

    // Release the first job.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&gate)
        .unwrap()
        .write_all(b"go\n")
        .unwrap();
    let end = first_logs.until_end();
    assert_eq!(end["state"], "succeeded");
    assert_eq!(first_logs.stdout, "started\nreleased\n");
    let mut second_logs = d.logs(&second);
    let end = second_logs.until_end();
    assert_eq!(end["state"], "succeeded", "{end}");
    assert_eq!(second_logs.stdout, "second\n");
    assert_ne!(d.job(&first)["agentId"], d.job(&second)["agentId"]);
}

/// SIGTERM destroys the agent of a running job (and its command); the job
/// ends `failed` and its log stream ends.
#[test]
fn serve_sigterm_destroys_a_running_jobs_agent() {
    let dir = Dir::new();
    let pidfile = dir.path("job.pid");
    let config = dir.config(&agent_binary(), 1, "");
    let mut d = Daemon::start(&dir, &config);
    let cmd = format!(
        "echo $$ > {}; echo started; exec sleep 1000",
        pidfile.display()
    );
    let (_, accepted) = d.post_job(&["local"], &["sh", "-c", &cmd]);
    let id = accepted["jobId"].as_str().unwrap().to_owned();
    let mut logs = d.logs(&id);
    logs.until_stdout("started\n");
    let job_pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let agent = d.job(&id)["agentId"].as_str().unwrap().to_owned();

    rustix::process::kill_process(
        rustix::process::Pid::from_child(&d.child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let end = logs.until_end();
    assert_eq!(end["state"], "failed");
    assert_eq!(end["end"], "aborted");
    assert!(
        end["reason"].as_str().unwrap().contains("shut down"),
        "{end}"
    );
    assert_eq!(d.child.wait().unwrap().code(), Some(0));
    assert!(
        process_gone(job_pid),
        "the job's process {job_pid} survived"
    );
    let log: Vec<String> = d.lines.iter().collect();
    assert!(
        log.iter()
            .any(|l| l.contains(&agent) && l.contains("\"to\":\"gone\"")),
        "agent {agent} never reached gone"
    );
    assert!(
        !log.iter().any(|l| l.contains("kat_")),
        "a token reached the log"
    );
}

/// The real daemon's gateway, with a real agent token (handed over by a
/// stand-in agent through a FIFO): a wrong token and a registration as an
/// agent id the token is not bound to are refused with 4010, and the
/// agent stays unregistered.
#[test]
fn serve_gateway_refuses_a_wrong_token_and_a_foreign_agent_id() {
    use kici_protocol::{AgentMessage, AuthRequest, GatewayMessage, Register, UnixMillis};
    use std::os::unix::fs::PermissionsExt;
    use tokio_tungstenite::tungstenite::{self, Message};

    let dir = Dir::new();
    let handoff = fifo(&dir, "handoff");
    let script = dir.write(
        "stand-in-agent.sh",
        &format!(
            "#!/bin/sh\nprintf '%s %s %s\\n' \"$KICI_AGENT_ID\" \"$KICI_AGENT_TOKEN\" \"$KICI_ORCHESTRATOR_URL\" > {}\nexec sleep 1000\n",
            handoff.display()
        ),
    );
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.config(&script, 1, "");
    let d = Daemon::start(&dir, &config);
    let (status, accepted) = d.post_job(&["local"], &["true"]);
    assert_eq!(status, 202, "{accepted}");
    let id = accepted["jobId"].as_str().unwrap().to_owned();
    let mut line = String::new();
    BufReader::new(std::fs::File::open(&handoff).unwrap())
        .read_line(&mut line)
        .unwrap();
    let parts: Vec<&str> = line.split_whitespace().collect();
    let (agent, token, url) = (parts[0], parts[1], parts[2]);
    assert!(
        url.starts_with("ws://127.0.0.1:") && url.ends_with("/ws"),
        "{url}"
    );

    let connect = || {
        let addr = url.trim_start_matches("ws://").trim_end_matches("/ws");
        let tcp = std::net::TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(PATIENCE)).unwrap();
        tungstenite::client::client(url, tcp).unwrap().0
    };
    let send = |ws: &mut tungstenite::WebSocket<std::net::TcpStream>, msg: AgentMessage| {
        ws.send(Message::text(msg.to_json())).unwrap();
    };
    let auth = |token: &str| {
        AgentMessage::AuthRequest(AuthRequest {
            token: token.parse().unwrap(),
            protocol_version: kici_protocol::PROTOCOL_VERSION,
        })
    };
    // Reads to the close; returns the auth.failure reason and the code.
    let refused = |ws: &mut tungstenite::WebSocket<std::net::TcpStream>| {
        let mut reason = String::new();
        loop {
            match ws.read() {
                Ok(Message::Text(t)) => match GatewayMessage::from_json(t.as_str()).unwrap() {
                    GatewayMessage::AuthFailure(f) => reason = f.reason,
                    other => panic!("expected auth.failure, got {other:?}"),
                },
                Ok(Message::Close(frame)) => {
                    return (reason, frame.map(|f| u16::from(f.code)));
                }
                Ok(_) => continue,
                Err(e) => panic!("no close frame: {e}"),
            }
        }
    };

    let mut ws = connect();
    send(&mut ws, auth(&format!("kat_{}", "0".repeat(64))));
    assert_eq!(
        refused(&mut ws),
        ("invalid or expired token".to_owned(), Some(4010))
    );

    let mut ws = connect();
    send(&mut ws, auth(token));
    match ws.read().unwrap() {
        Message::Text(t) => assert!(matches!(
            GatewayMessage::from_json(t.as_str()).unwrap(),
            GatewayMessage::AuthSuccess(_)
        )),
        other => panic!("expected auth.success, got {other:?}"),
    }
    let stranger: kici_model::AgentId = "scaler-bare-metal-00000000".parse().unwrap();
    let register = Register::new(
        Register::message_id_for(stranger, UnixMillis::now()),
        stranger,
        kici_model::LabelSet::parse(["local"]).unwrap(),
    );
    send(&mut ws, AgentMessage::Register(Box::new(register)));
    let (reason, code) = refused(&mut ws);
    assert_eq!(code, Some(4010));
    assert!(
        reason.contains("not bound to agent scaler-bare-metal-00000000"),
        "{reason}"
    );

    // Neither attempt registered the real agent.
    let (_, agents) = http(&d.addr, "GET", &format!("/v1/agents/{agent}"), None);
    let agents: Value = serde_json::from_str(&agents).unwrap();
    assert_eq!(agents["state"], "booted");
    assert_eq!(d.job(&id)["state"], "spawning");
    let (status, cancelled) = http(&d.addr, "DELETE", &format!("/v1/jobs/{id}"), None);
    assert_eq!(status, 202, "{cancelled}");
    assert!(cancelled.contains("\"cancelled\""), "{cancelled}");
}
