//! The bare-metal backend: agents as host processes.
//!
//! Each agent is the label set's `binaryPath`, exec'd with exactly the
//! environment of [`kici_host::env::agent_env`] (nothing inherited; the token
//! only in the environment, never in argv), in its own session and process
//! group, stdin from `/dev/null`, stdout and stderr appended to
//! `<state dir>/agents/<agent id>/{stdout,stderr}.log`, working directory
//! `<state dir>/agents/<agent id>/work`. The child is created inside its
//! tracking cgroup (`clone3(CLONE_INTO_CGROUP)`, [`crate::launch`]; where the
//! kernel refuses that, it writes itself into `cgroup.procs` before exec)
//! and enters its v1 limit cgroups before exec, so nothing it forks can
//! escape ([`crate::cgroup`]). An optional daemon-wide `pids.max`
//! ([`BareMetalOptions::pids_max`]) caps forks.
//!
//! The backend owns, per agent: the tracking cgroup and its limits, the log
//! directory, the exit watch (a pidfd: the exit is reported at once and the
//! child reaped) and the log tailer (resumable offsets, disk use bounded by
//! [`BareMetalOptions::log_keep_bytes`]). Every step has a named failpoint
//! ([`crate::failpoints`]); a spawn failing after its process started kills
//! and removes it again. Destroy verifies the pid's start time
//! before signalling the process group, kills whatever remains in the cgroup
//! after the grace, and removes everything; it works from the agent id alone
//! (after a daemon restart) and when the agent is long gone.
//!
//! After a daemon restart, [`Backend::adopt`] takes a recorded agent back:
//! the pid must still exist with the recorded start time (else `Gone`); a
//! pidfd then reports its exit at once — without reaping, since the agent
//! is no longer our child — and the log tailer resumes at the offsets the
//! previous daemon persisted ([`kici_host::logs`]), so output written while no
//! daemon ran is forwarded too. Scaler and job for log attribution come from
//! the agent directory's `context` file.

use crate::cgroup::{self, AgentCgroups, CgroupLayout, Controllers, LimitPlan};
use crate::failpoints;
use crate::launch;
use async_trait::async_trait;
use kici_engine::backend::ReportSender;
use kici_engine::{
    Adoption, Backend, BackendError, BackendErrorKind, BackendReport, OwnedResource, ProblemKind,
    ResourceHandle, ScalerProblem, ScalerProblems, SpawnSpec,
};
use kici_host::env::{agent_env, ForwardedEnv, ForwardedEnvError, SystemEnv};
use kici_host::logs::{self, LogContext, Tailer, TailerOptions};
use kici_host::notify::FileWatch;
use kici_host::process::ProcessIdentity;
use kici_model::{
    AgentId, BackendSettings, InstanceId, JobId, LabelSetBackend, ScalerEntry, ScalerName,
    ScalerType,
};
use parking_lot::{Mutex, RwLock};
use rustix::fd::AsFd;
use rustix::fs::Access;
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::watch;

/// `logsSource` of forwarded lines (upstream's value for bare-metal).
pub const LOG_SOURCE: &str = "bare-metal";

/// How long destroy waits for the kernel to remove killed processes before
/// it reports failure (a process in uninterruptible sleep can take a while;
/// the reconciler retries).
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often cgroup emptiness is re-checked when no inotify event came.
const EMPTY_POLL: Duration = Duration::from_millis(50);

/// The marker file in an agent's directory: its `pid:<pid>:<start>`.
const PROCESS_MARKER: &str = "process";
/// The file in an agent's directory naming its scaler and job (`scaler=…`,
/// `job=…` lines), so a restarted daemon forwards its logs with the same
/// attribution.
const CONTEXT_FILE: &str = "context";
/// The directory under `agents/` holding retired agents' logs.
const RETIRED: &str = "retired";

/// Names the scaler sets for every bare-metal agent: forwarding them is
/// allowed (the agent knows them) but has no effect.
const ALWAYS_SET: [&str; 3] = ["KICI_ORCHESTRATOR_URL", "KICI_EXECUTION_MODE", "KICI_PORT"];

/// Construction settings.
#[derive(Debug, Clone)]
pub struct BareMetalOptions {
    pub instance: InstanceId,
    /// Per-agent directories go under `<state_dir>/agents/<agent id>/`.
    pub state_dir: PathBuf,
    /// The topmost cgroup v2 directory kici-scaler writes to (tracking, and
    /// limits where it has controllers): the v2 mount, or the daemon's own
    /// delegated cgroup ([`crate::cgroup::discover`]).
    pub cgroup_root: PathBuf,
    /// The directory under `cgroup_root` holding the instances' trees:
    /// [`crate::cgroup::TREE`], or `agents` in a delegated cgroup.
    pub cgroup_tree: String,
    /// Why this host offers no cgroup v2 directory for agents (discovery
    /// refused it: v1 only, or not delegated to an unprivileged user);
    /// `validate` reports it and the backend accepts no scaler.
    pub cgroup_refusal: Option<crate::cgroup::discover::DiscoveryError>,
    /// Where the cgroup v1 hierarchies are mounted (`<root>/memory`,
    /// `<root>/cpu`): limits when v2 lacks the controller.
    pub cgroup_v1_root: PathBuf,
    /// The daemon's `KICI_AGENT_ENV_*` variables (other names are ignored,
    /// so the whole environment may be passed), captured once.
    pub forwarded_env: Vec<(String, String)>,
    /// The daemon's environment; only the allowlist reaches agents.
    pub system_env: Vec<(String, String)>,
    /// How agents enter their tracking cgroup.
    pub spawn_method: SpawnMethod,
    /// `pids.max` of every agent's cgroup (processes and threads), whatever
    /// `enforceCgroups` says: a daemon-wide guard against fork bombs. Spawns
    /// are refused when no pids controller (v2, or the v1 hierarchy) can
    /// enforce it. `None`: no limit.
    pub pids_max: Option<std::num::NonZeroU64>,
    /// Disk use of each agent log file while the agent runs: forwarded
    /// output further back than this is punched out of the file, marked by
    /// a line at its start ([`kici_host::logs`]). `None`: files grow freely.
    pub log_keep_bytes: Option<std::num::NonZeroU64>,
}

/// How a bare-metal agent enters its cgroups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SpawnMethod {
    /// `clone3(CLONE_INTO_CGROUP)` (no migration: ~10 ms faster per spawn
    /// here), falling back to [`SpawnMethod::PreExec`] for good, logged
    /// once, when the kernel refuses it.
    #[default]
    Auto,
    /// Fork, then the child writes itself into `cgroup.procs` before exec.
    PreExec,
}

impl BareMetalOptions {
    /// Where v1 hierarchies are mounted when discovery names none.
    pub const DEFAULT_CGROUP_V1_ROOT: &'static str = "/sys/fs/cgroup";
    /// 16 MiB of each log file stay on disk while an agent runs (everything
    /// is forwarded to the daemon's log anyway).
    pub const DEFAULT_LOG_KEEP_BYTES: u64 = 16 << 20;

    /// The cgroups where this process's discovery puts them
    /// ([`crate::cgroup::discover::host_placement`]); both env lists from
    /// `daemon_env` (usually `std::env::vars()`).
    pub fn new(
        instance: InstanceId,
        state_dir: PathBuf,
        daemon_env: Vec<(String, String)>,
    ) -> Self {
        let mut options = Self {
            instance,
            state_dir,
            cgroup_root: PathBuf::new(),
            cgroup_tree: crate::cgroup::TREE.to_owned(),
            cgroup_refusal: None,
            cgroup_v1_root: PathBuf::from(Self::DEFAULT_CGROUP_V1_ROOT),
            forwarded_env: daemon_env.clone(),
            system_env: daemon_env,
            spawn_method: SpawnMethod::default(),
            pids_max: None,
            log_keep_bytes: std::num::NonZeroU64::new(Self::DEFAULT_LOG_KEEP_BYTES),
        };
        options.place(crate::cgroup::discover::host_placement(None));
        options
    }

    /// Puts the cgroups where `placement` says, or records why there is no
    /// place for them.
    pub fn place(
        &mut self,
        placement: Result<
            crate::cgroup::discover::Placement,
            crate::cgroup::discover::DiscoveryError,
        >,
    ) {
        match placement {
            Ok(p) => {
                self.cgroup_root = p.top;
                self.cgroup_tree = p.tree;
                self.cgroup_v1_root = p.v1_root;
                self.cgroup_refusal = None;
            }
            Err(e) => self.cgroup_refusal = Some(e),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BareMetalSetupError {
    #[error(transparent)]
    ForwardedEnv(#[from] ForwardedEnvError),
    #[error("cannot create the agents directory {}: {source}", path.display())]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What one spawned agent holds while this daemon follows it.
struct Tracked {
    identity: ProcessIdentity,
    cgroups: AgentCgroups,
    exit: Arc<ExitWatch>,
    tailer: Tailer,
}

/// Shared between the exit watcher and destroy.
struct ExitWatch {
    /// Set by destroy before it signals: the exit is then expected and not
    /// reported (the engine is already destroying the agent).
    destroying: AtomicBool,
    /// `Some(detail)` once the leader exited and was reaped (its pid may be
    /// reused from then on).
    exited: watch::Sender<Option<String>>,
}

impl ExitWatch {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            destroying: AtomicBool::new(false),
            exited: watch::Sender::new(None),
        })
    }

    /// Records the leader's exit and reports it, unless destroy caused it.
    fn record(&self, agent: AgentId, detail: String, reports: &ReportSender) {
        tracing::info!(agent_id = %agent, detail = %detail, "bare-metal agent exited");
        self.exited.send_replace(Some(detail.clone()));
        if !self.destroying.load(Ordering::SeqCst) {
            // The engine may be gone (shutdown): nothing to tell then.
            let _ = reports.send(BackendReport::Exited { agent, detail });
        }
    }
}

struct Inner {
    layout: CgroupLayout,
    /// [`BareMetalOptions::cgroup_refusal`].
    cgroup_refusal: Option<crate::cgroup::discover::DiscoveryError>,
    agents_dir: PathBuf,
    system: SystemEnv,
    forwarded: ForwardedEnv,
    tracked: Mutex<HashMap<AgentId, Tracked>>,
    spawn_method: SpawnMethod,
    pids_max: Option<std::num::NonZeroU64>,
    tailer_options: TailerOptions,
    /// Spawns create cgroup parents under a read lock; pruning empty parents
    /// takes the write lock, so it never removes a directory a spawn is about
    /// to use.
    tree: RwLock<()>,
}

/// The bare-metal [`Backend`]. Cheap to clone. `spawn` must run on a tokio
/// runtime with I/O enabled (the exit watch and log tailer register a pidfd
/// and an inotify descriptor with its reactor).
#[derive(Clone)]
pub struct BareMetalBackend {
    inner: Arc<Inner>,
}

impl BareMetalBackend {
    pub fn new(options: BareMetalOptions) -> Result<Self, BareMetalSetupError> {
        let forwarded = ForwardedEnv::from_vars(options.forwarded_env)?;
        for name in forwarded.vars().keys() {
            if ALWAYS_SET.contains(&name.as_str()) {
                tracing::warn!(
                    variable = %format!("{}{name}", kici_model::contract::FORWARD_PREFIX),
                    "forwarded variable never reaches bare-metal agents: kici-scaler sets {name} itself"
                );
            }
        }
        let system = SystemEnv::from_vars(options.system_env);
        let agents_dir = options.state_dir.join("agents");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&agents_dir)
            .map_err(|source| BareMetalSetupError::StateDir {
                path: agents_dir.clone(),
                source,
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                layout: CgroupLayout::new(
                    options.cgroup_root,
                    options.cgroup_v1_root,
                    options.instance,
                )
                .with_tree(options.cgroup_tree),
                cgroup_refusal: options.cgroup_refusal,
                agents_dir,
                system,
                forwarded,
                tracked: Mutex::new(HashMap::new()),
                spawn_method: options.spawn_method,
                pids_max: options.pids_max,
                tailer_options: TailerOptions {
                    resumable: true,
                    keep_bytes: options.log_keep_bytes,
                },
                tree: RwLock::new(()),
            }),
        })
    }

    pub fn layout(&self) -> &CgroupLayout {
        &self.inner.layout
    }

    /// `<state dir>/agents/<agent id>`.
    pub fn agent_dir(&self, agent: AgentId) -> PathBuf {
        self.inner.agents_dir.join(agent.to_string())
    }

    /// Where destroyed agents' logs are kept (bounded, see [`kici_host::logs`]).
    pub fn retired_dir(&self) -> PathBuf {
        self.inner.agents_dir.join(RETIRED)
    }

    /// Removes this instance's empty cgroup directories (scaler and instance
    /// level, v2 and v1). Destroy calls it, so they go with the last agent.
    pub fn prune_empty_cgroups(&self) {
        let _tree = self.inner.tree.write();
        self.inner.layout.prune_empty();
    }

    /// Creates the agent's directory and cgroups and starts its process.
    /// On error nothing of it remains (the process never ran).
    fn start_agent(&self, spec: &SpawnSpec) -> Result<Spawned, SpawnError> {
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
        let env = agent_env(spec, ScalerType::BareMetal, &inner.system, &inner.forwarded);

        let dir = self.agent_dir(spec.agent);
        let context = AgentContext {
            scaler: spec.scaler.name.clone(),
            job: spec.job.clone(),
        };
        let files = AgentFiles::create(&dir, &context)
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
                self.prune_empty_cgroups();
                return Err(e.into());
            }
        };
        match start_process(binary_path, env, &files, &cgroups, inner.spawn_method) {
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
                Err(e)
            }
        }
    }

    /// Undoes a spawn whose process already runs: kills everything in its
    /// cgroup, reaps the leader, removes the cgroups and the agent directory.
    /// A failed spawn leaves nothing behind, its logs included (the process
    /// ran for an instant and its failure is the spawn error).
    async fn abort_started(
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
        match fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(agent_id = %agent, error = %e, "aborted spawn: cannot remove its directory")
            }
        }
    }

    async fn destroy_inner(
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
    async fn stop_and_remove(
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

/// The leader of a spawn being aborted.
enum StartedLeader {
    /// Not yet handed to an exit watch: the abort reaps it.
    Unwatched(AgentChild),
    /// Watched (the watcher reaps it) and tailed.
    Watched {
        exit: Arc<ExitWatch>,
        tailer: Tailer,
    },
}

/// SIGKILLs everything in the tracking cgroup until it is empty.
async fn kill_cgroup(cgroups: &AgentCgroups) -> Result<(), DestroyError> {
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

/// The exit status of an adopted agent is not ours to read: it is no longer
/// our child (its new parent reaps it).
const ADOPTED_EXIT: &str =
    "exited (status unknown: adopted after a daemon restart, reaped by its new parent)";

impl BareMetalBackend {
    /// [`Backend::adopt`]: pid + start time check, then the pidfd watch and
    /// the log tailer again, resumed at the persisted offsets.
    async fn adopt_inner(
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

/// What the bare-metal backend reports to the engine, as the source of a
/// [`BackendError`] ([`BareMetalError::kind`] gives its kind).
#[derive(Debug, thiserror::Error)]
pub enum BareMetalError {
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    #[error("{agent}: {source}")]
    Destroy {
        agent: AgentId,
        #[source]
        source: DestroyError,
    },
    #[error("cannot list {}: {source}", dir.display())]
    List {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{agent}: {source}")]
    Adopt {
        agent: AgentId,
        #[source]
        source: AdoptError,
    },
    /// A failpoint configured to fail ([`crate::failpoints`]).
    #[error("injected failure at {0}")]
    Injected(&'static str),
}

impl BareMetalError {
    pub fn kind(&self) -> BackendErrorKind {
        match self {
            Self::Injected(_)
            | Self::Spawn(SpawnError::Injected(_))
            | Self::Spawn(SpawnError::Cgroup(cgroup::CgroupError::Injected(_)))
            | Self::Destroy {
                source:
                    DestroyError::Injected(_) | DestroyError::Cgroup(cgroup::CgroupError::Injected(_)),
                ..
            }
            | Self::Adopt {
                source: AdoptError::Injected(_),
                ..
            } => BackendErrorKind::Injected,
            Self::Spawn(_) => BackendErrorKind::Provision,
            Self::Destroy { .. } => BackendErrorKind::Destroy,
            Self::List { .. } | Self::Adopt { .. } => BackendErrorKind::Unavailable,
        }
    }
}

impl From<BareMetalError> for BackendError {
    fn from(e: BareMetalError) -> Self {
        BackendError::new(e.kind(), e)
    }
}

/// Why a scaler entry cannot run on this host's bare-metal backend
/// ([`Backend::validate`]).
#[derive(Debug, thiserror::Error)]
pub enum BareMetalProblem {
    #[error("not a bare-metal scaler")]
    NotBareMetal,
    #[error("labelSets[{index}]: no binaryPath")]
    NoBinaryPath { index: usize },
    #[error("labelSets[{index}].binaryPath: {}: {source}", path.display())]
    BinaryUnreadable {
        index: usize,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("labelSets[{index}].binaryPath: {} is not a file", path.display())]
    BinaryNotAFile { index: usize, path: PathBuf },
    #[error("labelSets[{index}].binaryPath: {} is not executable", path.display())]
    BinaryNotExecutable { index: usize, path: PathBuf },
    /// Discovery found no cgroup v2 directory for agents on this host.
    #[error(transparent)]
    NoCgroupPlace(#[from] crate::cgroup::discover::DiscoveryError),
    #[error(
        "{} is not a cgroup v2 mount: bare-metal agents need one to be tracked and killed",
        .0.display()
    )]
    NotCgroupV2(PathBuf),
    #[error("the cgroup v2 root {} is not writable by kici-scaler", .0.display())]
    CgroupRootReadOnly(PathBuf),
    #[error("the agents directory {} is not writable", .0.display())]
    AgentsDirReadOnly(PathBuf),
    #[error(
        "enforceCgroups: no memory controller: not offered by the cgroup v2 root {} and no cgroup v1 memory hierarchy at {}",
        root.display(),
        v1.display()
    )]
    NoMemoryController { root: PathBuf, v1: PathBuf },
    #[error(
        "enforceCgroups: no cpu controller: not offered by the cgroup v2 root {} and no cgroup v1 cpu hierarchy at {}",
        root.display(),
        v1.display()
    )]
    NoCpuController { root: PathBuf, v1: PathBuf },
    #[error(
        "pids limit {max}: no pids controller: not offered by the cgroup v2 root {} and no cgroup v1 pids hierarchy at {}",
        root.display(),
        v1.display()
    )]
    NoPidsController {
        max: std::num::NonZeroU64,
        root: PathBuf,
        v1: PathBuf,
    },
}

impl BareMetalProblem {
    pub fn kind(&self) -> ProblemKind {
        match self {
            Self::NotBareMetal
            | Self::NoBinaryPath { .. }
            | Self::BinaryUnreadable { .. }
            | Self::BinaryNotAFile { .. }
            | Self::BinaryNotExecutable { .. } => ProblemKind::Setting,
            Self::NoCgroupPlace(_)
            | Self::NotCgroupV2(_)
            | Self::CgroupRootReadOnly(_)
            | Self::AgentsDirReadOnly(_)
            | Self::NoMemoryController { .. }
            | Self::NoCpuController { .. }
            | Self::NoPidsController { .. } => ProblemKind::Host,
        }
    }
}

impl From<BareMetalProblem> for ScalerProblem {
    fn from(p: BareMetalProblem) -> Self {
        ScalerProblem::new(p.kind(), p)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("cannot watch {0}: {1}")]
    Pidfd(ProcessIdentity, std::io::Error),
    /// A failpoint configured to fail ([`crate::failpoints`]).
    #[error("injected failure at {0}")]
    Injected(&'static str),
}

/// Reports an adopted agent's exit as soon as its pidfd turns readable.
/// Usually it is not our child: its new parent (init or a subreaper) reaps
/// it, and a `waitpid` on its pid would fail with ECHILD — or worse, reap a
/// child of ours that merely reuses the pid. It is our child only when this
/// daemon is a child subreaper (or the daemon that spawned it lives on);
/// then it must be reaped here. `waitid` on the pidfd does exactly that:
/// it names this one process, reaps it if it is ours, and fails with
/// ECHILD, touching nothing, if it is not.
fn watch_adopted(
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

struct Spawned {
    child: AgentChild,
    identity: ProcessIdentity,
    cgroups: AgentCgroups,
    dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("scaler {0:?} is not a bare-metal scaler (no binaryPath)")]
    NotBareMetal(String),
    #[error(transparent)]
    Limits(#[from] cgroup::LimitError),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("cannot prepare the agent directory {}: {source}", path.display())]
    Files {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start {}: {source}", binary.display())]
    Exec {
        binary: PathBuf,
        source: std::io::Error,
    },
    /// A failpoint configured to fail ([`crate::failpoints`]).
    #[error("injected failure at {0}")]
    Injected(&'static str),
    #[error("the agent process {0} vanished before it could be identified: {1}")]
    Identify(u32, std::io::Error),
}

#[derive(Debug, thiserror::Error)]
pub enum DestroyError {
    #[error("cannot kill the processes of {}: {source}", cgroup.display())]
    Kill {
        cgroup: PathBuf,
        source: std::io::Error,
    },
    #[error("processes of {} survived SIGKILL for {KILL_TIMEOUT:?}", .0.display())]
    Survivors(PathBuf),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("cannot retire the logs in {}: {source}", dir.display())]
    Logs {
        dir: PathBuf,
        source: std::io::Error,
    },
    /// A failpoint configured to fail ([`crate::failpoints`]).
    #[error("injected failure at {0}")]
    Injected(&'static str),
}

/// The agent's directory with fresh, empty log files.
struct AgentFiles {
    stdout: fs::File,
    stderr: fs::File,
    work: PathBuf,
}

impl AgentFiles {
    fn create(dir: &Path, context: &AgentContext) -> std::io::Result<Self> {
        if dir.exists() {
            // A leftover of an agent with the same id: not ours to keep.
            fs::remove_dir_all(dir)?;
        }
        let work = dir.join("work");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&work)?;
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
            work,
        })
    }
}

/// Who an agent's log lines are attributed to, kept in [`CONTEXT_FILE`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct AgentContext {
    scaler: ScalerName,
    job: Option<JobId>,
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
    fn read(dir: &Path) -> Option<Self> {
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
enum AgentChild {
    /// Started by `Command` (the fallback).
    Std(Child),
    /// Started by `clone3(CLONE_INTO_CGROUP)`.
    Cloned(launch::ClonedChild),
}

impl AgentChild {
    fn pid(&self) -> Option<Pid> {
        match self {
            Self::Std(child) => i32::try_from(child.id()).ok().and_then(Pid::from_raw),
            Self::Cloned(child) => Some(child.pid()),
        }
    }

    /// A pidfd of the leader (the clone's own, duplicated, or a new one).
    fn pidfd(&self) -> std::io::Result<rustix::fd::OwnedFd> {
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

    fn kill(&mut self) {
        let _ = match self {
            Self::Std(child) => child.kill(),
            Self::Cloned(child) => child.kill(),
        };
    }

    fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match self {
            Self::Std(child) => child.try_wait(),
            Self::Cloned(child) => child.try_wait(),
        }
    }

    fn wait(&mut self) -> std::io::Result<ExitStatus> {
        match self {
            Self::Std(child) => child.wait(),
            Self::Cloned(child) => child.wait(),
        }
    }
}

/// Forks and execs the agent inside its cgroups: straight into the
/// tracking cgroup with `clone3(CLONE_INTO_CGROUP)` where the kernel allows
/// it, else by writing `cgroup.procs` before exec ([`crate::launch`]).
fn start_process(
    binary: &Path,
    env: Vec<(String, String)>,
    files: &AgentFiles,
    cgroups: &AgentCgroups,
    method: SpawnMethod,
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
            enter_session_and_cgroups(&mut command, procs);
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
/// writing process" — into each cgroup's `cgroup.procs`. The agent is in its
/// cgroups before its first instruction; whatever it forks is too.
#[allow(unsafe_code)]
fn enter_session_and_cgroups(command: &mut Command, procs: Vec<rustix::fd::OwnedFd>) {
    let hook = move || -> std::io::Result<()> {
        rustix::process::setsid()?;
        for fd in &procs {
            rustix::io::write(fd, b"0")?;
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child of a multi-threaded process,
    // where only async-signal-safe calls are allowed. It makes two raw
    // syscalls (setsid, write) through rustix, which neither allocates nor
    // takes locks; `procs` was allocated before the fork and is only
    // borrowed; errors convert into `io::Error::from_raw_os_error`, which
    // does not allocate either.
    unsafe {
        command.pre_exec(hook);
    }
}

fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => format!("ended: {status}"),
    }
}

/// Reaps the leader when it exits and reports the exit, unless destroy
/// caused it. A pidfd makes the exit visible at once; without one (kernels
/// before 5.3) a blocking thread waits.
fn watch_exit(mut child: AgentChild, agent: AgentId, reports: ReportSender, exit: Arc<ExitWatch>) {
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

/// Waits until nothing lives in the cgroup, at most `limit`.
async fn wait_empty(dir: &Path, limit: Duration) -> bool {
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
async fn wait_leader(leader: ProcessIdentity, exit: Option<&ExitWatch>, limit: Duration) -> bool {
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
async fn remove_cgroups(cgroups: &AgentCgroups) -> Result<(), DestroyError> {
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

fn read_marker(dir: &Path) -> Option<ProcessIdentity> {
    fs::read_to_string(dir.join(PROCESS_MARKER))
        .ok()?
        .parse()
        .ok()
}

fn handle_for(
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

#[async_trait]
impl Backend for BareMetalBackend {
    fn kind(&self) -> ScalerType {
        ScalerType::BareMetal
    }

    async fn validate(&self, scaler: &ScalerEntry) -> Result<(), ScalerProblems> {
        let mut errors: Vec<ScalerProblem> = Vec::new();
        let BackendSettings::BareMetal(settings) = &scaler.backend else {
            return Err(ScalerProblem::from(BareMetalProblem::NotBareMetal).into());
        };
        for (index, label_set) in scaler.label_sets.iter().enumerate() {
            let LabelSetBackend::BareMetal { binary_path } = &label_set.backend else {
                errors.push(BareMetalProblem::NoBinaryPath { index }.into());
                continue;
            };
            let path = binary_path.clone();
            match fs::metadata(binary_path) {
                Err(source) => errors.push(
                    BareMetalProblem::BinaryUnreadable {
                        index,
                        path,
                        source,
                    }
                    .into(),
                ),
                Ok(m) if !m.is_file() => {
                    errors.push(BareMetalProblem::BinaryNotAFile { index, path }.into())
                }
                Ok(_) => {
                    if rustix::fs::access(binary_path, Access::EXEC_OK).is_err() {
                        errors.push(BareMetalProblem::BinaryNotExecutable { index, path }.into());
                    }
                }
            }
            if label_set.network_policy.is_some() {
                tracing::warn!(
                    scaler = scaler.name.as_str(),
                    label_set = index,
                    "networkPolicy is not enforced for bare-metal agents"
                );
            }
        }
        let root = self.inner.layout.v2_root();
        if let Some(why) = &self.inner.cgroup_refusal {
            errors.push(BareMetalProblem::NoCgroupPlace(why.clone()).into());
        } else if !root.join("cgroup.procs").is_file() || !root.join("cgroup.controllers").is_file()
        {
            errors.push(BareMetalProblem::NotCgroupV2(root.to_owned()).into());
        } else if rustix::fs::access(root, Access::WRITE_OK).is_err() {
            errors.push(BareMetalProblem::CgroupRootReadOnly(root.to_owned()).into());
        }
        if rustix::fs::access(&self.inner.agents_dir, Access::WRITE_OK).is_err() {
            errors.push(BareMetalProblem::AgentsDirReadOnly(self.inner.agents_dir.clone()).into());
        }
        if settings.enforce_cgroups {
            let controllers = Controllers::detect(&self.inner.layout);
            let v1 = |c| self.inner.layout.v1_dir(c);
            if !controllers.can_limit_memory() {
                errors.push(
                    BareMetalProblem::NoMemoryController {
                        root: root.to_owned(),
                        v1: v1(cgroup::V1Controller::Memory),
                    }
                    .into(),
                );
            }
            if !controllers.can_limit_cpu() {
                errors.push(
                    BareMetalProblem::NoCpuController {
                        root: root.to_owned(),
                        v1: v1(cgroup::V1Controller::Cpu),
                    }
                    .into(),
                );
            }
        }
        if let Some(max) = self.inner.pids_max {
            if !Controllers::detect(&self.inner.layout).can_limit_pids() {
                errors.push(
                    BareMetalProblem::NoPidsController {
                        max,
                        root: root.to_owned(),
                        v1: self.inner.layout.v1_dir(cgroup::V1Controller::Pids),
                    }
                    .into(),
                );
            }
        }
        ScalerProblems::check(errors)
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ResourceHandle, BackendError> {
        let agent = spec.agent;
        let provision = |e: SpawnError| BackendError::from(BareMetalError::Spawn(e));
        let Spawned {
            child,
            identity,
            cgroups,
            dir,
        } = self.start_agent(&spec).map_err(provision)?;
        // The process runs: from here a failure must kill it again.
        let recorded =
            failpoints::check(failpoints::SPAWN_PROCESS, SpawnError::Injected).and_then(|()| {
                // Lets a later daemon (or destroy without handle) verify the
                // pid; the engine's record of the handle does too, so a
                // failure here is not fatal.
                if let Err(e) = fs::write(dir.join(PROCESS_MARKER), identity.to_string()) {
                    tracing::warn!(agent_id = %agent, error = %e, "cannot record the agent's pid");
                }
                failpoints::check(failpoints::SPAWN_MARKER, SpawnError::Injected)
            });
        if let Err(e) = recorded {
            self.abort_started(agent, StartedLeader::Unwatched(child), &cgroups, &dir)
                .await;
            return Err(provision(e));
        }
        let exit = ExitWatch::new();
        let tailer = Tailer::start_with_options(
            LogContext {
                agent,
                scaler: spec.scaler.name.clone(),
                job: spec.job.clone(),
                source: LOG_SOURCE,
            },
            &dir,
            self.inner.tailer_options,
        );
        watch_exit(child, agent, spec.reports.clone(), exit.clone());
        if let Err(e) = failpoints::check(failpoints::SPAWN_WATCH, SpawnError::Injected) {
            self.abort_started(
                agent,
                StartedLeader::Watched { exit, tailer },
                &cgroups,
                &dir,
            )
            .await;
            return Err(provision(e));
        }
        let handle = handle_for(Some(identity), agent, &cgroups, Some(&dir));
        tracing::info!(
            agent_id = %agent,
            scaler = spec.scaler.name.as_str(),
            job_id = spec.job.as_ref().map(|j| j.as_str()),
            handle = %handle.id,
            "bare-metal agent started"
        );
        self.inner.tracked.lock().insert(
            agent,
            Tracked {
                identity,
                cgroups,
                exit,
                tailer,
            },
        );
        Ok(handle)
    }

    async fn destroy(
        &self,
        agent: &AgentId,
        handle: Option<&ResourceHandle>,
        grace: Duration,
    ) -> Result<(), BackendError> {
        self.destroy_inner(*agent, handle, grace)
            .await
            .map_err(|source| {
                BareMetalError::Destroy {
                    agent: *agent,
                    source,
                }
                .into()
            })
    }

    async fn list_owned(&self) -> Result<Vec<OwnedResource>, BackendError> {
        let layout = &self.inner.layout;
        let leaves = layout
            .tracking_leaves()
            .map_err(|source| BareMetalError::List {
                dir: layout.instance_dir(),
                source,
            })?;
        let mut owned = Vec::new();
        let mut seen = Vec::new();
        for leaf in leaves {
            let agent = leaf
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<AgentId>().ok());
            let created_at = fs::metadata(&leaf)
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            let handle = match agent {
                Some(agent) => {
                    seen.push(agent);
                    let dir = self.agent_dir(agent);
                    let cgroups = layout.find_agent(agent);
                    handle_for(
                        read_marker(&dir),
                        agent,
                        &cgroups,
                        dir.exists().then_some(dir.as_path()),
                    )
                }
                None => ResourceHandle {
                    id: format!("cgroup:{}", leaf.display()),
                    extra: BTreeMap::from([("cgroup".to_owned(), leaf.display().to_string())]),
                },
            };
            owned.push(OwnedResource {
                agent,
                handle,
                created_at,
            });
        }
        // Agent directories without a cgroup: a spawn cut short between the
        // two, or a crash mid-destroy. Still ours, still to be removed.
        if let Ok(entries) = fs::read_dir(&self.inner.agents_dir) {
            for entry in entries.flatten() {
                let Some(agent) = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<AgentId>().ok())
                else {
                    continue;
                };
                if seen.contains(&agent) {
                    continue;
                }
                let dir = entry.path();
                owned.push(OwnedResource {
                    agent: Some(agent),
                    handle: handle_for(
                        read_marker(&dir),
                        agent,
                        &AgentCgroups::default(),
                        Some(&dir),
                    ),
                    created_at: entry
                        .metadata()
                        .and_then(|m| m.modified())
                        .unwrap_or(SystemTime::UNIX_EPOCH),
                });
            }
        }
        failpoints::check(failpoints::LIST_SCAN, BareMetalError::Injected)?;
        Ok(owned)
    }

    async fn adopt(
        &self,
        agent: &AgentId,
        handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, BackendError> {
        self.adopt_inner(*agent, handle, reports)
            .await
            .map_err(|source| {
                BareMetalError::Adopt {
                    agent: *agent,
                    source,
                }
                .into()
            })
    }
}
