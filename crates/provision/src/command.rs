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
//! - The environment is the daemon's, minus every `KICI_SCALER_*` variable
//!   (the daemon's own settings, which include its API token) and the
//!   webhook's secret variable, plus
//!   `KICI_PROVISION_EVENT` (`scale-up`/`scale-down`), `KICI_PROVISION_REQUEST_ID`
//!   and `KICI_PROVISION_AGENT_ID`, so a script can branch without parsing
//!   JSON first.
//! - Exit status 0 is delivered; anything else (non-zero, a signal, the
//!   timeout, a command that cannot start) is a failed attempt.

use parking_lot::Mutex;
use rustix::process::{kill_process_group, Pid, Signal};
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
/// Variables removed from the command's environment (by prefix).
pub const STRIPPED_ENV_PREFIX: &str = "KICI_SCALER_";
pub const ENV_EVENT: &str = "KICI_PROVISION_EVENT";
pub const ENV_REQUEST_ID: &str = "KICI_PROVISION_REQUEST_ID";
pub const ENV_AGENT_ID: &str = "KICI_PROVISION_AGENT_ID";

/// What the command is told about the event besides its JSON.
#[derive(Debug, Clone, Copy)]
pub struct EventEnv<'a> {
    pub event: &'a str,
    pub request_id: &'a str,
    pub agent_id: &'a str,
    /// Further variables left out of its environment (the webhook's
    /// `secretEnv`: the command has no business with the signing key).
    pub remove: &'a [String],
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
        .kill_on_drop(true);
    for (name, _) in std::env::vars_os() {
        if name
            .to_str()
            .is_some_and(|n| n.starts_with(STRIPPED_ENV_PREFIX))
        {
            cmd.env_remove(name);
        }
    }
    for name in env.remove {
        cmd.env_remove(name);
    }
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
