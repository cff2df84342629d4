//! After a restart: checking a recorded agent's pid + start time and
//! watching it again, and the handles that record what an agent holds.

use super::*;

impl BareMetalBackend {
    /// [`Backend::adopt`]: pid + start time check, then the pidfd watch and
    /// the log tailer again, resumed at the persisted offsets.
    pub(super) async fn adopt_inner(
        &self,
        agent: AgentId,
        handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, AdoptError> {
        if let Some(tracked) = self.inner.tracked.lock().get(&agent) {
            // Already followed by this daemon (spawned or adopted here).
            return Ok(if tracked.exit.exited.borrow().is_none() {
                Adoption::Alive
            } else {
                Adoption::Gone
            });
        }
        let dir = self.agent_dir(agent);
        let Some(identity) = handle
            .id
            .parse::<ProcessIdentity>()
            .ok()
            .or_else(|| read_marker(&dir))
        else {
            // The spawn was cut short before the process was recorded.
            return Ok(Adoption::Gone);
        };
        // The descriptor first, the start time second: if the pid had been
        // reused before the open, the start time now differs; if the agent
        // exits after it, the descriptor still names the agent (and turns
        // readable at once).
        let pidfd = match rustix::process::pidfd_open(identity.pid, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(Errno::SRCH) => return Ok(Adoption::Gone),
            Err(e) => return Err(AdoptError::Pidfd(identity, e.into())),
        };
        if !identity.is_running() {
            // Gone, reused, or dead awaiting its new parent's wait.
            return Ok(Adoption::Gone);
        }
        failpoints::check(failpoints::ADOPT_CHECK, AdoptError::Injected)?;
        let pidfd =
            kici_host::notify::register(pidfd).map_err(|e| AdoptError::Pidfd(identity, e))?;
        let cgroups = self.inner.layout.find_agent(agent);
        let context = AgentContext::read(&dir).unwrap_or_else(|| {
            // Spawned by a version that did not keep it: the sanitised
            // cgroup directory is the best name left.
            let scaler = cgroups
                .tracking
                .as_deref()
                .and_then(Path::parent)
                .and_then(Path::file_name)
                .map_or_else(|| "unknown".into(), |n| n.to_string_lossy().into_owned());
            AgentContext {
                scaler: ScalerName::new(&scaler),
                job: None,
            }
        });
        let exit = ExitWatch::new();
        let tailer = Tailer::start_with_options(
            LogContext {
                agent,
                scaler: context.scaler,
                job: context.job,
                source: LOG_SOURCE,
            },
            &dir,
            self.inner.tailer_options,
        );
        let watch = watch_adopted(pidfd, identity, agent, reports, exit.clone());
        if let Err(e) = failpoints::check(failpoints::ADOPT_WATCH, AdoptError::Injected) {
            // Adopt creates nothing: the watch and the tailer stop again.
            watch.abort();
            tailer.finish().await;
            return Err(e);
        }
        tracing::info!(agent_id = %agent, handle = %identity, "bare-metal agent adopted");
        self.inner.tracked.lock().insert(
            agent,
            Tracked {
                identity,
                cgroups,
                exit,
                tailer,
            },
        );
        Ok(Adoption::Alive)
    }
}

pub(super) fn read_marker(dir: &Path) -> Option<ProcessIdentity> {
    fs::read_to_string(dir.join(PROCESS_MARKER))
        .ok()?
        .parse()
        .ok()
}

pub(super) fn handle_for(
    identity: Option<ProcessIdentity>,
    agent: AgentId,
    cgroups: &AgentCgroups,
    logs: Option<&Path>,
) -> ResourceHandle {
    let mut extra = BTreeMap::new();
    if let Some(tracking) = &cgroups.tracking {
        extra.insert("cgroup".to_owned(), tracking.display().to_string());
    }
    for (controller, dir) in &cgroups.v1 {
        extra.insert(
            format!("cgroup-v1-{}", controller.dir_name()),
            dir.display().to_string(),
        );
    }
    if let Some(logs) = logs {
        extra.insert("logs".to_owned(), logs.display().to_string());
    }
    ResourceHandle {
        id: identity.map_or_else(|| format!("agent:{agent}"), |i| i.to_string()),
        extra,
    }
}
