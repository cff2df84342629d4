//! Starting an agent: its directory and log files, the tracking cgroup and
//! limits, the process started straight into them; and undoing a start
//! cut short.

use super::*;

pub(super) struct Spawned {
    pub(super) child: AgentChild,
    pub(super) identity: ProcessIdentity,
    pub(super) cgroups: AgentCgroups,
    pub(super) dir: PathBuf,
}

/// The agent's directory with fresh, empty log files, and its working
/// directory (outside the state dir, owned by the agent's user).
pub(super) struct AgentFiles {
    pub(super) stdout: fs::File,
    pub(super) stderr: fs::File,
    pub(super) work: PathBuf,
}

impl AgentFiles {
    pub(super) fn create(
        dir: &Path,
        work: &Path,
        owner: Option<&Credentials>,
        context: &AgentContext,
    ) -> std::io::Result<Self> {
        for d in [dir, work] {
            if d.exists() {
                // A leftover of an agent with the same id: not ours to keep.
                fs::remove_dir_all(d)?;
            }
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        // Mode 0700 even under a permissive umask: only its user enters.
        fs::DirBuilder::new().mode(0o700).create(work)?;
        fs::set_permissions(work, fs::Permissions::from_mode(0o700))?;
        if let Some(owner) = owner.filter(|o| o.switch) {
            rustix::fs::chown(
                work,
                Some(rustix::fs::Uid::from_raw(owner.uid)),
                Some(rustix::fs::Gid::from_raw(owner.gid)),
            )?;
        }
        let open = |name: &str| {
            OpenOptions::new()
                .create_new(true)
                .append(true)
                .mode(0o600)
                .open(dir.join(name))
        };
        fs::write(dir.join(CONTEXT_FILE), context.to_string())?;
        Ok(Self {
            stdout: open(logs::Stream::Stdout.file_name())?,
            stderr: open(logs::Stream::Stderr.file_name())?,
            work: work.to_owned(),
        })
    }
}

/// Who an agent's log lines are attributed to, kept in [`CONTEXT_FILE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct AgentContext {
    pub(super) scaler: ScalerName,
    pub(super) job: Option<JobId>,
}

impl std::fmt::Display for AgentContext {
    /// One `key=value` line each; scaler names and job ids hold no line
    /// breaks (the config and [`JobId`] refuse whitespace and controls).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "scaler={}", self.scaler)?;
        if let Some(job) = &self.job {
            writeln!(f, "job={job}")?;
        }
        Ok(())
    }
}

impl AgentContext {
    pub(super) fn read(dir: &Path) -> Option<Self> {
        let text = fs::read_to_string(dir.join(CONTEXT_FILE)).ok()?;
        let mut scaler = None;
        let mut job = None;
        for line in text.lines() {
            match line.split_once('=') {
                Some(("scaler", name)) => scaler = Some(ScalerName::new(name)),
                Some(("job", id)) => job = id.parse().ok(),
                _ => {}
            }
        }
        Some(Self {
            scaler: scaler?,
            job,
        })
    }
}

/// A started agent leader, unreaped until its exit is seen (so its pid
/// stays its own).
pub(super) enum AgentChild {
    /// Started by `Command` (the fallback).
    Std(Child),
    /// Started by `clone3(CLONE_INTO_CGROUP)`.
    Cloned(launch::ClonedChild),
}

impl AgentChild {
    pub(super) fn pid(&self) -> Option<Pid> {
        match self {
            Self::Std(child) => i32::try_from(child.id()).ok().and_then(Pid::from_raw),
            Self::Cloned(child) => Some(child.pid()),
        }
    }

    /// A pidfd of the leader (the clone's own, duplicated, or a new one).
    pub(super) fn pidfd(&self) -> std::io::Result<rustix::fd::OwnedFd> {
        match self {
            Self::Std(child) => {
                let pid = i32::try_from(child.id())
                    .ok()
                    .and_then(Pid::from_raw)
                    .ok_or_else(|| std::io::Error::other("pid out of range"))?;
                Ok(rustix::process::pidfd_open(pid, PidfdFlags::empty())?)
            }
            Self::Cloned(child) => Ok(rustix::io::fcntl_dupfd_cloexec(child.pidfd(), 0)?),
        }
    }

    pub(super) fn kill(&mut self) {
        let _ = match self {
            Self::Std(child) => child.kill(),
            Self::Cloned(child) => child.kill(),
        };
    }

    pub(super) fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match self {
            Self::Std(child) => child.try_wait(),
            Self::Cloned(child) => child.try_wait(),
        }
    }

    pub(super) fn wait(&mut self) -> std::io::Result<ExitStatus> {
        match self {
            Self::Std(child) => child.wait(),
            Self::Cloned(child) => child.wait(),
        }
    }
}

/// Forks and execs the agent inside its cgroups: straight into the
/// tracking cgroup with `clone3(CLONE_INTO_CGROUP)` where the kernel allows
/// it, else by writing `cgroup.procs` before exec ([`crate::launch`]).
pub(super) fn start_process(
    binary: &Path,
    env: Vec<(String, String)>,
    files: &AgentFiles,
    cgroups: &AgentCgroups,
    method: SpawnMethod,
    switch: Option<Switch>,
) -> Result<(AgentChild, ProcessIdentity), SpawnError> {
    let exec_err = |source| SpawnError::Exec {
        binary: binary.to_owned(),
        source,
    };
    let mut child = None;
    if method == SpawnMethod::Auto && launch::worth_trying() {
        if let Some(tracking) = cgroups.open_tracking()? {
            let v1_procs = cgroups.open_v1_procs()?;
            let launched = launch::launch(&launch::Launch {
                binary,
                env: &env,
                stdout: &files.stdout,
                stderr: &files.stderr,
                work: &files.work,
                cgroup: &tracking,
                v1_procs: &v1_procs,
                switch: switch.as_ref(),
            });
            match launched {
                Ok(cloned) => child = Some(AgentChild::Cloned(cloned)),
                Err(launch::LaunchError::Refused(refused)) => launch::record_refusal(&refused),
                Err(launch::LaunchError::Io(e)) => return Err(exec_err(e)),
            }
        }
    }
    let child = match child {
        Some(child) => child,
        None => {
            let procs = cgroups.open_procs()?;
            let stdout = files.stdout.try_clone().map_err(exec_err)?;
            let stderr = files.stderr.try_clone().map_err(exec_err)?;
            let mut command = Command::new(binary);
            command
                .env_clear()
                .envs(env)
                .stdin(Stdio::null())
                .stdout(stdout)
                .stderr(stderr)
                .current_dir(&files.work);
            enter_session_and_cgroups(&mut command, procs, switch);
            let child = command.spawn().map_err(exec_err)?;
            // `command` holds the cgroup.procs descriptors; they close with it.
            drop(command);
            AgentChild::Std(child)
        }
    };
    let identity = child
        .pid()
        .ok_or_else(|| std::io::Error::other("pid out of range"))
        .and_then(ProcessIdentity::of);
    match identity {
        Ok(identity) => Ok((child, identity)),
        Err(e) => {
            // Unreachable in practice: an unreaped child keeps its /proc entry.
            let pid = child.pid().map_or(0, |p| p.as_raw_nonzero().get());
            let mut child = child;
            child.kill();
            let _ = child.wait();
            Err(SpawnError::Identify(pid as u32, e))
        }
    }
}

/// In the child, between fork and exec: a new session (so a new process
/// group, detached from the daemon's terminal and signals), then `0` — "the
/// writing process" — into each cgroup's `cgroup.procs`, then the agent's
/// user ([`Switch::apply`]: the cgroup files are the daemon user's, so the
/// switch comes after them). The agent is in its cgroups before its first
/// instruction; whatever it forks is too.
#[allow(unsafe_code)]
pub(super) fn enter_session_and_cgroups(
    command: &mut Command,
    procs: Vec<rustix::fd::OwnedFd>,
    switch: Option<Switch>,
) {
    let hook = move || -> std::io::Result<()> {
        rustix::process::setsid()?;
        for fd in &procs {
            rustix::io::write(fd, b"0")?;
        }
        if let Some(switch) = &switch {
            switch.apply()?;
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child of a multi-threaded process,
    // where only async-signal-safe calls are allowed. It makes raw syscalls
    // (setsid, write, setgroups, setresgid, setresuid) through rustix, which
    // neither allocates nor takes locks; `procs` and `switch` were
    // allocated before the fork and are only borrowed; errors convert into
    // `io::Error::from_raw_os_error`, which does not allocate either. (The
    // `Command` sets no uid of its own: std would switch before this hook,
    // and the cgroup writes need the daemon's user.)
    unsafe {
        command.pre_exec(hook);
    }
}

impl BareMetalBackend {
    /// Creates the agent's directory and cgroups and starts its process.
    /// On error nothing of it remains (the process never ran).
    pub(super) fn start_agent(&self, spec: &SpawnSpec) -> Result<Spawned, SpawnError> {
        let inner = &self.inner;
        let BackendSettings::BareMetal(settings) = &spec.scaler.backend else {
            return Err(SpawnError::NotBareMetal(spec.scaler.name.to_string()));
        };
        let LabelSetBackend::BareMetal { binary_path } = &spec.label_set.backend else {
            return Err(SpawnError::NotBareMetal(spec.scaler.name.to_string()));
        };
        let controllers = if settings.enforce_cgroups || inner.pids_max.is_some() {
            Controllers::detect(&inner.layout)
        } else {
            Controllers::default()
        };
        let mut plan = if settings.enforce_cgroups {
            LimitPlan::for_limits(spec.resources.limits, &controllers, &inner.layout)?
        } else {
            LimitPlan::default()
        };
        if let Some(max) = inner.pids_max {
            plan = plan.with_pids(max, &controllers, &inner.layout)?;
        }
        let credentials = match &spec.scaler.ext.agent_user {
            Some(user) => Some(self.credentials(user).map_err(SpawnError::User)?),
            None => None,
        };
        let dir = self.agent_dir(spec.agent);
        let work = self.work_dir(spec.agent);
        let mut env = agent_env(spec, ScalerType::BareMetal, &inner.system, &inner.forwarded);
        if let Some(c) = credentials.as_ref().filter(|c| c.switch) {
            user_env(&mut env, c, &work, spec);
        }
        let context = AgentContext {
            scaler: spec.scaler.name.clone(),
            job: spec.job.clone(),
        };
        let files = AgentFiles::create(&dir, &work, credentials.as_ref(), &context)
            .map_err(|source| SpawnError::Files {
                path: dir.clone(),
                source,
            })
            .and_then(|files| {
                failpoints::check(failpoints::SPAWN_DIR, SpawnError::Injected)?;
                Ok(files)
            });
        let files = match files {
            Ok(files) => files,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                let _ = fs::remove_dir_all(&work);
                return Err(e);
            }
        };
        // Removes what it created on error (spawn::cgroup, spawn::limits).
        let cgroups = {
            let _tree = inner.tree.read();
            AgentCgroups::create(&inner.layout, spec.scaler.name.as_str(), spec.agent, &plan)
        };
        let cgroups = match cgroups {
            Ok(c) => c,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                let _ = fs::remove_dir_all(&work);
                self.prune_empty_cgroups();
                return Err(e.into());
            }
        };
        let switch = credentials.as_ref().and_then(Credentials::switch);
        match start_process(
            binary_path,
            env,
            &files,
            &cgroups,
            inner.spawn_method,
            switch,
        ) {
            Ok((child, identity)) => Ok(Spawned {
                child,
                identity,
                cgroups,
                dir,
            }),
            Err(e) => {
                let _ = cgroups.remove();
                self.prune_empty_cgroups();
                let _ = fs::remove_dir_all(&dir);
                let _ = fs::remove_dir_all(&work);
                Err(e)
            }
        }
    }

    /// Undoes a spawn whose process already runs: kills everything in its
    /// cgroup, reaps the leader, removes the cgroups and the agent directory.
    /// A failed spawn leaves nothing behind, its logs included (the process
    /// ran for an instant and its failure is the spawn error).
    pub(super) async fn abort_started(
        &self,
        agent: AgentId,
        leader: StartedLeader,
        cgroups: &AgentCgroups,
        dir: &Path,
    ) {
        let exit = match leader {
            StartedLeader::Unwatched(mut child) => {
                // Unreaped: the pid is still the child's, safe to signal.
                child.kill();
                kill_cgroup(cgroups).await.unwrap_or_else(
                    |e| tracing::warn!(agent_id = %agent, error = %e, "aborted spawn: cannot kill"),
                );
                let _ = tokio::task::spawn_blocking(move || child.wait()).await;
                None
            }
            StartedLeader::Watched { exit, tailer } => {
                exit.destroying.store(true, Ordering::SeqCst);
                kill_cgroup(cgroups).await.unwrap_or_else(
                    |e| tracing::warn!(agent_id = %agent, error = %e, "aborted spawn: cannot kill"),
                );
                tailer.finish().await;
                Some(exit)
            }
        };
        if let Some(exit) = exit {
            // The watcher reaps the leader; wait for it, bounded.
            let mut rx = exit.exited.subscribe();
            let _ = tokio::time::timeout(KILL_TIMEOUT, rx.wait_for(Option::is_some)).await;
        }
        if let Err(e) = remove_cgroups(cgroups).await {
            tracing::warn!(agent_id = %agent, error = %e, "aborted spawn: cannot remove its cgroups");
        }
        self.prune_empty_cgroups();
        for d in [dir, &self.work_dir(agent)] {
            match fs::remove_dir_all(d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(agent_id = %agent, error = %e, dir = %d.display(), "aborted spawn: cannot remove its directory")
                }
            }
        }
    }
}

/// The login variables of an agent that runs as another user: its own
/// name, and a home it may write (its passwd home when that exists, else
/// its work dir) — never the daemon's. A label set's `env:` still wins.
fn user_env(env: &mut Vec<(String, String)>, user: &Credentials, work: &Path, spec: &SpawnSpec) {
    let home = if user.home.is_dir() {
        user.home.as_path()
    } else {
        work
    };
    for (name, value) in [
        ("HOME", home.display().to_string()),
        ("USER", user.name.clone()),
        ("LOGNAME", user.name.clone()),
    ] {
        if spec.label_set.env.keys().any(|k| k.as_str() == name) {
            continue;
        }
        match env.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => slot.1 = value,
            None => env.push((name.to_owned(), value)),
        }
    }
}
