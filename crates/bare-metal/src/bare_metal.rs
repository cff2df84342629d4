//! The bare-metal backend: agents as host processes.
//!
//! Each agent is the label set's `binaryPath`, exec'd with exactly the
//! environment of [`kici_host::env::agent_env`] (nothing inherited; the token
//! only in the environment, never in argv), in its own session and process
//! group, stdin from `/dev/null`, stdout and stderr appended to
//! `<state dir>/agents/<agent id>/{stdout,stderr}.log`, working directory
//! `<work root>/<instance>/<agent id>` (outside the state dir, mode 0700,
//! owned by the agent's user). A scaler naming `x-kici-scaler.user` runs its
//! agents as that user ([`user`]): the child drops the daemon's user after
//! entering its cgroups and before exec. The child is created inside its
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
//!
//! This module holds the options, the shared state and the [`Backend`]
//! implementation; the steps live in submodules: `spawn` (directory, cgroup,
//! limits, process), `exit_watch`, `teardown` (destroy and an aborted
//! spawn), `adopt` (after a restart; resource handles), [`user`] (the
//! agent's user) and `errors` ([`BareMetalError`], [`BareMetalProblem`] and
//! the step errors).

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
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::watch;

mod adopt;
mod errors;
mod exit_watch;
mod spawn;
mod teardown;
pub mod user;

use adopt::{handle_for, read_marker};
pub use errors::{AdoptError, BareMetalError, BareMetalProblem, DestroyError, SpawnError};
use exit_watch::{watch_adopted, watch_exit, ExitWatch};
use spawn::{AgentChild, AgentContext, Spawned};
use teardown::{kill_cgroup, remove_cgroups, StartedLeader};
use user::{Credentials, Switch, UserError};

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
    /// Agents' working directories go under `<work_root>/<instance>/`:
    /// outside the state dir, which agents running as another user must not
    /// enter. Default: [`BareMetalOptions::default_work_root`].
    pub work_root: PathBuf,
    /// Log a warning for each scaler that names no `x-kici-scaler.user`
    /// while this process runs as root (its agents would run as root).
    /// `serve` sets it; `run` runs the invoking user's own command.
    pub warn_root_agents: bool,
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

    /// `<state dir>-work` beside the state dir (`/var/lib/kici-scaler` →
    /// `/var/lib/kici-scaler-work`).
    pub fn default_work_root(state_dir: &Path) -> PathBuf {
        let mut name = state_dir
            .file_name()
            .map_or_else(|| "kici-scaler".into(), |n| n.to_os_string());
        name.push("-work");
        state_dir
            .parent()
            .unwrap_or_else(|| Path::new("/"))
            .join(name)
    }

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
            work_root: Self::default_work_root(&state_dir),
            warn_root_agents: false,
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
    #[error("cannot create the agents' work directory {}: {source}", path.display())]
    WorkDir {
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

struct Inner {
    layout: CgroupLayout,
    /// [`BareMetalOptions::cgroup_refusal`].
    cgroup_refusal: Option<crate::cgroup::discover::DiscoveryError>,
    agents_dir: PathBuf,
    /// `<work root>/<instance>`: the agents' working directories.
    work_dir: PathBuf,
    /// Agent users as last resolved (by `validate`: at start-up and on
    /// reload), so a spawn makes no NSS lookup.
    users: Mutex<HashMap<kici_model::AgentUser, Credentials>>,
    warn_root_agents: bool,
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
        let work_dir = options.work_root.join(options.instance.to_string());
        // Search-only for others: an agent reaches its own directory (mode
        // 0700, its user's) but cannot list the others.
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(&work_dir)
            .and_then(|()| fs::set_permissions(&work_dir, fs::Permissions::from_mode(0o711)))
            .map_err(|source| BareMetalSetupError::WorkDir {
                path: work_dir.clone(),
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
                work_dir,
                users: Mutex::new(HashMap::new()),
                warn_root_agents: options.warn_root_agents,
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

    /// `<work root>/<instance>/<agent id>`: the agent's working directory.
    pub fn work_dir(&self, agent: AgentId) -> PathBuf {
        self.inner.work_dir.join(agent.to_string())
    }

    /// Removes this instance's directory under the work root, and the work
    /// root itself, when they are empty (every agent is gone).
    pub fn remove_empty_work_dirs(&self) {
        let _ = fs::remove_dir(&self.inner.work_dir);
        if let Some(root) = self.inner.work_dir.parent() {
            let _ = fs::remove_dir(root);
        }
    }

    /// `user` resolved: as `validate` last found it, else looked up now.
    fn credentials(&self, user: &kici_model::AgentUser) -> Result<Credentials, UserError> {
        if let Some(c) = self.inner.users.lock().get(user) {
            return Ok(c.clone());
        }
        let c = Credentials::resolve(user)?;
        self.inner.users.lock().insert(user.clone(), c.clone());
        Ok(c)
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
        let credentials = match &scaler.ext.agent_user {
            None => {
                if self.inner.warn_root_agents && rustix::process::geteuid().is_root() {
                    tracing::warn!(
                        scaler = scaler.name.as_str(),
                        "bare-metal agents of this scaler run as root, the daemon's user: they can read the daemon's state and secrets; name an unprivileged user in x-kici-scaler.user (the package creates kici-agent)"
                    );
                }
                None
            }
            Some(user) => match Credentials::resolve(user) {
                Ok(c) => {
                    self.inner.users.lock().insert(user.clone(), c.clone());
                    Some(c)
                }
                Err(e) => {
                    errors.push(BareMetalProblem::User(e).into());
                    None
                }
            },
        };
        if let Some(c) = credentials.as_ref().filter(|c| c.switch) {
            if let Some(denied) = c.denied_on_path(&self.inner.work_dir, 0o1) {
                errors.push(
                    BareMetalProblem::WorkDirUnreachable {
                        user: c.name.clone(),
                        dir: self.inner.work_dir.clone(),
                        denied,
                    }
                    .into(),
                );
            }
        }
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
                    } else if let Some(c) = credentials.as_ref().filter(|c| c.switch) {
                        if let Some(denied) = c.denied_on_path(binary_path, 0o1) {
                            errors.push(
                                BareMetalProblem::BinaryUnreachable {
                                    index,
                                    path,
                                    user: c.name.clone(),
                                    denied,
                                }
                                .into(),
                            );
                        }
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
                let Some(agent) = agent_named(&entry) else {
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
        // Work directories left alone (a crash after the rest went).
        if let Ok(entries) = fs::read_dir(&self.inner.work_dir) {
            for entry in entries.flatten() {
                let Some(agent) = agent_named(&entry) else {
                    continue;
                };
                if owned.iter().any(|o| o.agent == Some(agent)) {
                    continue;
                }
                owned.push(OwnedResource {
                    agent: Some(agent),
                    handle: handle_for(None, agent, &AgentCgroups::default(), None),
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

/// The agent a directory entry is named after (agent and work dirs are).
fn agent_named(entry: &fs::DirEntry) -> Option<AgentId> {
    entry.file_name().to_str()?.parse().ok()
}
