//! Destroy, step by step and from the agent id alone if need be: signal
//! the group and the cgroup, wait until it is empty, remove the cgroups,
//! retire the logs.

use super::*;

/// The leader of a spawn being aborted.
pub(super) enum StartedLeader {
    /// Not yet handed to an exit watch: the abort reaps it.
    Unwatched(AgentChild),
    /// Watched (the watcher reaps it) and tailed.
    Watched {
        exit: Arc<ExitWatch>,
        tailer: Tailer,
    },
}

/// SIGKILLs everything in the tracking cgroup until it is empty.
pub(super) async fn kill_cgroup(cgroups: &AgentCgroups) -> Result<(), DestroyError> {
    let Some(tracking) = &cgroups.tracking else {
        return Ok(());
    };
    let deadline = Instant::now() + KILL_TIMEOUT;
    loop {
        cgroup::kill_all(tracking).map_err(|source| DestroyError::Kill {
            cgroup: tracking.clone(),
            source,
        })?;
        if wait_empty(tracking, EMPTY_POLL).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(DestroyError::Survivors(tracking.clone()));
        }
    }
}

/// Waits until nothing lives in the cgroup, at most `limit`.
pub(super) async fn wait_empty(dir: &Path, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    let watch = FileWatch::new([dir.join("cgroup.events").as_path()]).ok();
    loop {
        // Gone counts as empty; an unreadable cgroup as still populated.
        if !cgroup::populated(dir).unwrap_or(true) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        let next = (tokio::time::Instant::now() + EMPTY_POLL).min(deadline);
        match &watch {
            Some(w) => {
                let _ = tokio::time::timeout_at(next, w.changed()).await;
            }
            None => tokio::time::sleep_until(next).await,
        }
    }
}

/// Waits for the leader's exit, at most `limit` (no cgroup to watch).
pub(super) async fn wait_leader(
    leader: ProcessIdentity,
    exit: Option<&ExitWatch>,
    limit: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    if let Some(exit) = exit {
        let mut rx = exit.exited.subscribe();
        return tokio::time::timeout_at(deadline, rx.wait_for(Option::is_some))
            .await
            .is_ok();
    }
    while leader.is_running() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(EMPTY_POLL).await;
    }
    true
}

/// `rmdir` may briefly fail with EBUSY right after the last process left.
pub(super) async fn remove_cgroups(cgroups: &AgentCgroups) -> Result<(), DestroyError> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match cgroups.remove() {
            Ok(()) => return Ok(()),
            Err(cgroup::CgroupError::Io { source, .. })
                if source.raw_os_error() == Some(Errno::BUSY.raw_os_error())
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(EMPTY_POLL).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

impl BareMetalBackend {
    pub(super) async fn destroy_inner(
        &self,
        agent: AgentId,
        handle: Option<&ResourceHandle>,
        grace: Duration,
    ) -> Result<(), DestroyError> {
        let tracked = self.inner.tracked.lock().remove(&agent);
        let dir = self.agent_dir(agent);
        let stopped = match &tracked {
            Some(t) => {
                t.exit.destroying.store(true, Ordering::SeqCst);
                // Until the watcher reaps it, the pid cannot be reused.
                let leader = t.exit.exited.borrow().is_none().then_some(t.identity);
                self.stop_and_remove(agent, leader, &t.cgroups, Some(&t.exit), grace)
                    .await
            }
            None => {
                let recorded = handle
                    .and_then(|h| h.id.parse::<ProcessIdentity>().ok())
                    .or_else(|| read_marker(&dir));
                let cgroups = self.inner.layout.find_agent(agent);
                self.stop_and_remove(agent, recorded, &cgroups, None, grace)
                    .await
            }
        };
        if let Err(e) = stopped {
            // Still ours to destroy: a retry finds the watch and the tailer.
            if let Some(t) = tracked {
                self.inner.tracked.lock().entry(agent).or_insert(t);
            }
            return Err(e);
        }
        if let Some(t) = tracked {
            t.tailer.finish().await;
        }
        // Copying the log tails and removing directories can take
        // milliseconds on a busy disk: not on a tokio worker, where it would
        // stall every task queued behind it.
        let work = self.work_dir(agent);
        let removed_work = work.clone();
        tokio::task::spawn_blocking(move || match fs::remove_dir_all(&removed_work) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        .map_err(|source| DestroyError::WorkDir { dir: work, source })?;
        let (from, retired) = (dir.clone(), self.retired_dir());
        tokio::task::spawn_blocking(move || logs::retire(&from, &retired))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
            .map_err(|source| DestroyError::Logs {
                dir: dir.clone(),
                source,
            })?;
        failpoints::check(failpoints::DESTROY_FILES, DestroyError::Injected)?;
        tracing::info!(agent_id = %agent, "bare-metal agent destroyed");
        Ok(())
    }

    /// SIGTERM, the grace, SIGKILL through the cgroup, then the cgroups go.
    pub(super) async fn stop_and_remove(
        &self,
        agent: AgentId,
        leader: Option<ProcessIdentity>,
        cgroups: &AgentCgroups,
        exit: Option<&ExitWatch>,
        grace: Duration,
    ) -> Result<(), DestroyError> {
        // Only a pid whose start time still matches is ours to signal.
        let leader = leader.filter(ProcessIdentity::is_current);
        if let Some(leader) = leader {
            match rustix::process::kill_process_group(leader.pid, Signal::TERM) {
                Ok(()) | Err(Errno::SRCH) => {}
                Err(e) => {
                    tracing::warn!(agent_id = %agent, error = %e, "cannot signal the agent's process group")
                }
            }
        }
        if let Some(tracking) = &cgroups.tracking {
            // Members that left the process group (setsid) get the same
            // chance to stop cleanly; membership is the ownership proof.
            let _ = cgroup::signal_all(tracking, Signal::TERM);
            failpoints::check(failpoints::DESTROY_SIGNAL, DestroyError::Injected)?;
            if !wait_empty(tracking, grace).await {
                kill_cgroup(cgroups).await?;
            }
        } else if let Some(leader) = leader {
            failpoints::check(failpoints::DESTROY_SIGNAL, DestroyError::Injected)?;
            // No tracking cgroup (it was never created): the group is all
            // there is to stop.
            if !wait_leader(leader, exit, grace).await {
                let _ = rustix::process::kill_process_group(leader.pid, Signal::KILL);
            }
        }
        failpoints::check(failpoints::DESTROY_KILL, DestroyError::Injected)?;
        remove_cgroups(cgroups).await?;
        // The scaler and instance directories go with their last agent.
        self.prune_empty_cgroups();
        failpoints::check(failpoints::DESTROY_CGROUP, DestroyError::Injected)
    }
}
