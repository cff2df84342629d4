//! Watching an agent's exit (its pidfd, or `waitid` on an adopted one) and
//! reporting it to the engine once.

use super::*;

/// Shared between the exit watcher and destroy.
pub(super) struct ExitWatch {
    /// Set by destroy before it signals: the exit is then expected and not
    /// reported (the engine is already destroying the agent).
    pub(super) destroying: AtomicBool,
    /// `Some(detail)` once the leader exited and was reaped (its pid may be
    /// reused from then on).
    pub(super) exited: watch::Sender<Option<String>>,
}

impl ExitWatch {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            destroying: AtomicBool::new(false),
            exited: watch::Sender::new(None),
        })
    }

    /// Records the leader's exit and reports it, unless destroy caused it.
    pub(super) fn record(&self, agent: AgentId, detail: String, reports: &ReportSender) {
        tracing::info!(agent_id = %agent, detail = %detail, "bare-metal agent exited");
        self.exited.send_replace(Some(detail.clone()));
        if !self.destroying.load(Ordering::SeqCst) {
            // The engine may be gone (shutdown): nothing to tell then.
            let _ = reports.send(BackendReport::Exited { agent, detail });
        }
    }
}

pub(super) fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => format!("ended: {status}"),
    }
}

/// Reaps the leader when it exits and reports the exit, unless destroy
/// caused it. A pidfd makes the exit visible at once; without one (kernels
/// before 5.3) a blocking thread waits.
pub(super) fn watch_exit(
    mut child: AgentChild,
    agent: AgentId,
    reports: ReportSender,
    exit: Arc<ExitWatch>,
) {
    let finish = move |status: std::io::Result<ExitStatus>, exit: Arc<ExitWatch>| {
        let detail = match status {
            Ok(status) => describe_exit(status),
            Err(e) => format!("exit status unknown: {e}"),
        };
        exit.record(agent, detail, &reports);
    };
    match child.pidfd().and_then(kici_host::notify::register) {
        Ok(pidfd) => {
            tokio::spawn(async move {
                // Readable = exited; an error here still ends in a blocking wait.
                let _ = pidfd.readable().await;
                let status = match child.try_wait() {
                    Ok(Some(status)) => Ok(status),
                    _ => tokio::task::spawn_blocking(move || child.wait())
                        .await
                        .unwrap_or_else(|e| Err(std::io::Error::other(e))),
                };
                finish(status, exit);
            });
        }
        Err(_) => {
            tokio::task::spawn_blocking(move || {
                let status = child.wait();
                finish(status, exit);
            });
        }
    }
}

/// The exit status of an adopted agent is not ours to read: it is no longer
/// our child (its new parent reaps it).
pub(super) const ADOPTED_EXIT: &str =
    "exited (status unknown: adopted after a daemon restart, reaped by its new parent)";

/// Reports an adopted agent's exit as soon as its pidfd turns readable.
/// Usually it is not our child: its new parent (init or a subreaper) reaps
/// it, and a `waitpid` on its pid would fail with ECHILD — or worse, reap a
/// child of ours that merely reuses the pid. It is our child only when this
/// daemon is a child subreaper (or the daemon that spawned it lives on);
/// then it must be reaped here. `waitid` on the pidfd does exactly that:
/// it names this one process, reaps it if it is ours, and fails with
/// ECHILD, touching nothing, if it is not.
pub(super) fn watch_adopted(
    pidfd: tokio::io::unix::AsyncFd<rustix::fd::OwnedFd>,
    identity: ProcessIdentity,
    agent: AgentId,
    reports: ReportSender,
    exit: Arc<ExitWatch>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if pidfd.readable().await.is_err() {
            // The reactor refused the descriptor: fall back to polling.
            while identity.is_running() {
                tokio::time::sleep(EMPTY_POLL).await;
            }
        }
        let reaped = rustix::process::waitid(
            rustix::process::WaitId::PidFd(pidfd.get_ref().as_fd()),
            rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOHANG,
        );
        let detail = match reaped {
            Ok(Some(status)) => match (status.exit_status(), status.terminating_signal()) {
                (Some(code), _) if status.exited() => format!("exit status {code}"),
                (_, Some(signal)) => format!("killed by signal {signal}"),
                _ => ADOPTED_EXIT.to_owned(),
            },
            _ => ADOPTED_EXIT.to_owned(),
        };
        exit.record(agent, detail, &reports);
    })
}
