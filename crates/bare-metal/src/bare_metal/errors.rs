//! What the bare-metal backend reports: [`BareMetalError`] to the engine
//! (with its kind), [`BareMetalProblem`] from validation, and the step
//! errors of spawn, destroy and adoption.

use super::*;

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
    /// `x-kici-scaler.user` / `.group` cannot be used here.
    #[error(transparent)]
    User(#[from] UserError),
    #[error("x-kici-scaler.user: {user:?} cannot reach its work directories under {}: {denied}", dir.display())]
    WorkDirUnreachable {
        user: String,
        dir: PathBuf,
        denied: user::Denied,
    },
    #[error("labelSets[{index}].binaryPath: {} cannot be run by x-kici-scaler.user {user:?}: {denied}", path.display())]
    BinaryUnreachable {
        index: usize,
        path: PathBuf,
        user: String,
        denied: user::Denied,
    },
}

impl BareMetalProblem {
    pub fn kind(&self) -> ProblemKind {
        match self {
            Self::NotBareMetal
            | Self::NoBinaryPath { .. }
            | Self::BinaryUnreadable { .. }
            | Self::BinaryNotAFile { .. }
            | Self::BinaryNotExecutable { .. }
            | Self::User(_)
            | Self::BinaryUnreachable { .. } => ProblemKind::Setting,
            Self::NoCgroupPlace(_)
            | Self::NotCgroupV2(_)
            | Self::CgroupRootReadOnly(_)
            | Self::AgentsDirReadOnly(_)
            | Self::NoMemoryController { .. }
            | Self::NoCpuController { .. }
            | Self::NoPidsController { .. }
            | Self::WorkDirUnreachable { .. } => ProblemKind::Host,
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
    #[error(transparent)]
    User(UserError),
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
    #[error("cannot remove the work directory {}: {source}", dir.display())]
    WorkDir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot retire the logs in {}: {source}", dir.display())]
    Logs {
        dir: PathBuf,
        source: std::io::Error,
    },
    /// A failpoint configured to fail ([`crate::failpoints`]).
    #[error("injected failure at {0}")]
    Injected(&'static str),
}
