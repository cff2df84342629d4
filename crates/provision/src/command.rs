//! One attempt of a `command` delivery: run the provisioner's argv with the
//! event JSON on stdin, bounded in time and in captured output.
//!
//! - The command runs in its own process group. When the attempt's timeout
//!   passes (or the attempt is dropped, e.g. at shutdown), the whole group
//!   is killed with SIGKILL, so a hung provisioner leaves no process behind.
//!   A command that exits on its own is not chased: whatever it started and
//!   detached (with `setsid`, its output redirected) is its business — that
//!   is how a provisioner may start a long-lived local instance.
//! - stdout and stderr are captured up to a bound each (the rest is read and
//!   dropped, so the command never blocks on a full pipe) and reported as a
//!   tracing event per stream, cut with a `…[N bytes truncated]` marker.
//!   After the command exits, its pipes are read for at most
//!   [`PIPE_DRAIN_GRACE`]: a detached grandchild still holding them does not
//!   hold up the delivery.
//! - The environment starts empty: nothing of the daemon's reaches the
//!   command unless named (another scaler's webhook secret, a database
//!   password, the daemon's `KICI_SCALER_*` settings stay out). It holds
//!   [`CommandEnv`] — `PATH` (the daemon's, else [`DEFAULT_PATH`]),
//!   `HOME`, `LANG` and `LC_ALL` when the daemon has them, the
//!   scaler's `passEnv` and `env` — plus `PROVISION_EVENT`
//!   (`scale-up`/`scale-down`), `PROVISION_REQUEST_ID` and
//!   `PROVISION_AGENT_ID`, so a script can branch without parsing JSON
//!   first. None of it is a `KICI_*` name, so a script may start the agent
//!   with its own environment plus `KICI_CLAIM_CODE`/`KICI_CLAIM_URL`.
//! - Exit status 0 is delivered; anything else (non-zero, a signal, the
//!   timeout, a command that cannot start) is a failed attempt.

use crate::config::ProvisionerConfig;
pub use crate::config::{ENV_AGENT_ID, ENV_EVENT, ENV_REQUEST_ID};
use parking_lot::Mutex;
use rustix::process::{kill_process_group, Pid, Signal};
use std::collections::BTreeMap;
use std::fmt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tokio::task::JoinHandle;

/// Captured bytes per stream unless configured otherwise.
pub const DEFAULT_CAPTURE_LIMIT: usize = 64 * 1024;
/// How long the pipes are still read after the command exited.
pub const PIPE_DRAIN_GRACE: Duration = Duration::from_millis(500);
/// `PATH` when the daemon has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The daemon's variables every command gets when they are set: where
/// programs are, whose home, which locale.
pub const INHERITED_ENV: [&str; 4] = ["PATH", "HOME", "LANG", "LC_ALL"];

/// The environment a provisioner command starts with (the event
/// variables aside): [`INHERITED_ENV`], then `passEnv`, then `env`, each
/// over the one before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandEnv(BTreeMap<String, String>);

impl CommandEnv {
    /// Reads the daemon's side through `lookup_env` (the daemon passes the
    /// process environment; tests a map). A `passEnv` name that is unset
    /// is left out, like an unset inherited one; `PATH` falls back to
    /// [`DEFAULT_PATH`].
    pub fn resolve(
        config: &ProvisionerConfig,
        lookup_env: impl Fn(&str) -> Option<String>,
    ) -> Self {
        let mut vars = BTreeMap::new();
        for name in INHERITED_ENV
            .iter()
            .copied()
            .chain(config.pass_env.iter().map(String::as_str))
        {
            if let Some(value) = lookup_env(name) {
                vars.insert(name.to_owned(), value);
            }
        }
        vars.entry("PATH".to_owned())
            .or_insert_with(|| DEFAULT_PATH.to_owned());
        vars.extend(config.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        Self(vars)
    }

    /// The variables, by name.
    pub fn vars(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }
}

/// What the command is told: its environment and the event (besides its
/// JSON on stdin).
#[derive(Debug, Clone, Copy)]
pub struct EventEnv<'a> {
    pub event: &'a str,
    pub request_id: &'a str,
    pub agent_id: &'a str,
    /// Everything else it gets.
    pub base: &'a CommandEnv,
}

/// Up to a bound of a stream's bytes, and how many more there were.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapturedOutput {
    pub bytes: Vec<u8>,
    /// Bytes read past the bound and dropped.
    pub truncated: u64,
    /// The pipe was still open [`PIPE_DRAIN_GRACE`] after the command
    /// exited (something it started holds it); reading stopped there.
    pub still_open: bool,
}

impl CapturedOutput {
    /// The captured text (lossy UTF-8), with a marker when cut.
    pub fn text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.bytes).into_owned();
        if self.truncated > 0 {
            s.push_str(&format!("…[{} bytes truncated]", self.truncated));
        }
        if self.still_open {
            s.push_str("…[still open after the command exited; not read further]");
        }
        s
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty() && self.truncated == 0 && !self.still_open
    }
}

/// How the attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandEnd {
    /// Exited with this status (0 = delivered).
    Exited(i32),
    /// Killed by this signal (not by us).
    Signaled(i32),
    /// The timeout passed; its process group was killed.
    TimedOut,
    /// It could not be started.
    SpawnFailed(String),
}

impl fmt::Display for CommandEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exited(c) => write!(f, "exited with status {c}"),
            Self::Signaled(s) => write!(f, "killed by signal {s}"),
            Self::TimedOut => f.write_str("timed out; its process group was killed"),
            Self::SpawnFailed(e) => write!(f, "could not start: {e}"),
        }
    }
}

/// One attempt's result.
#[derive(Debug, Clone)]
pub struct CommandAttempt {
    pub end: CommandEnd,
    pub stdout: CapturedOutput,
    pub stderr: CapturedOutput,
    pub elapsed: Duration,
}

impl CommandAttempt {
    pub fn delivered(&self) -> bool {
        self.end == CommandEnd::Exited(0)
    }
}

/// Kills a process group when dropped while armed: a timed-out or
/// abandoned attempt leaves nothing behind.
struct GroupGuard(Option<Pid>);

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pgid) = self.0.take() {
            // ESRCH (already gone) is the outcome we want anyway.
            let _ = kill_process_group(pgid, Signal::KILL);
        }
    }

    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `argv` once with `stdin_body` on its stdin.
pub async fn run_once(
    argv: &[String],
    stdin_body: &[u8],
    env: EventEnv<'_>,
    timeout: Duration,
    capture_limit: usize,
) -> CommandAttempt {
    let started = tokio::time::Instant::now();
    let failed = |e: String| CommandAttempt {
        end: CommandEnd::SpawnFailed(e),
        stdout: CapturedOutput::default(),
        stderr: CapturedOutput::default(),
        elapsed: started.elapsed(),
    };
    let Some((program, args)) = argv.split_first() else {
        return failed("empty argv".into());
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        // Nothing of the daemon's environment but what `base` names.
        .env_clear()
        .envs(env.base.vars());
    cmd.env(ENV_EVENT, env.event)
        .env(ENV_REQUEST_ID, env.request_id)
        .env(ENV_AGENT_ID, env.agent_id);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return failed(format!("{program}: {e}")),
    };
    // The child leads its own group (process_group(0)): pgid = pid.
    let mut group = GroupGuard(child.id().and_then(|id| Pid::from_raw(id as i32)));

    let stdin = child.stdin.take().map(|mut pipe| {
        let body = stdin_body.to_vec();
        tokio::spawn(async move {
            // A provisioner that does not read its stdin closes the pipe
            // (EPIPE): not a failure of the delivery.
            let _ = pipe.write_all(&body).await;
            let _ = pipe.shutdown().await;
        })
    });
    let stdout = child.stdout.take().map(|p| spawn_capture(p, capture_limit));
    let stderr = child.stderr.take().map(|p| spawn_capture(p, capture_limit));

    let end = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => {
            group.disarm();
            use std::os::unix::process::ExitStatusExt;
            match (status.code(), status.signal()) {
                (Some(c), _) => CommandEnd::Exited(c),
                (None, Some(s)) => CommandEnd::Signaled(s),
                (None, None) => CommandEnd::SpawnFailed("no exit status".into()),
            }
        }
        Ok(Err(e)) => {
            group.kill();
            let _ = child.wait().await;
            CommandEnd::SpawnFailed(format!("waiting for {program}: {e}"))
        }
        Err(_) => {
            group.kill();
            // Reap it: the group is dead, this returns at once.
            let _ = child.wait().await;
            CommandEnd::TimedOut
        }
    };
    if let Some(t) = stdin {
        t.abort();
    }
    let stdout = drained(stdout).await;
    let stderr = drained(stderr).await;
    CommandAttempt {
        end,
        stdout,
        stderr,
        elapsed: started.elapsed(),
    }
}

/// A pipe's capture so far, shared with its reader task.
type Shared = Arc<Mutex<CapturedOutput>>;

fn spawn_capture(
    pipe: impl AsyncRead + Unpin + Send + 'static,
    limit: usize,
) -> (Shared, JoinHandle<()>) {
    let shared = Shared::default();
    let task = tokio::spawn(capture(pipe, limit, shared.clone()));
    (shared, task)
}

/// The capture of a pipe, its reader waited for at most
/// [`PIPE_DRAIN_GRACE`] (what it read until then is kept).
async fn drained(reader: Option<(Shared, JoinHandle<()>)>) -> CapturedOutput {
    let Some((shared, mut task)) = reader else {
        return CapturedOutput::default();
    };
    let finished = tokio::time::timeout(PIPE_DRAIN_GRACE, &mut task)
        .await
        .is_ok();
    if !finished {
        task.abort();
    }
    let mut out = std::mem::take(&mut *shared.lock());
    out.still_open = !finished;
    out
}

/// Reads `pipe` to its end, keeping the first `limit` bytes.
async fn capture(mut pipe: impl AsyncRead + Unpin, limit: usize, out: Shared) {
    let mut buf = vec![0u8; 8192];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut out = out.lock();
                let keep = n.min(limit.saturating_sub(out.bytes.len()));
                out.bytes.extend_from_slice(&buf[..keep]);
                out.truncated += (n - keep) as u64;
            }
        }
    }
}
