//! What the container backend reports: [`ContainerError`] to the engine
//! (with its kind), [`ContainerProblem`] from validation, and the
//! [`StepError`] of each spawn or destroy step.

use super::*;

/// What the container backend reports to the engine, as the source of a
/// [`BackendError`] ([`ContainerError::kind`] gives its kind).
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error(transparent)]
    Spawn(StepError),
    /// The spawn failed and removing what it had made failed too (the
    /// reconciler retries that).
    #[error("{source} (cleanup incomplete: {})", join_errors(cleanup))]
    SpawnCleanupIncomplete {
        #[source]
        source: StepError,
        cleanup: Vec<StepError>,
    },
    #[error("{agent}: {}", join_errors(steps))]
    Destroy {
        agent: AgentId,
        steps: Vec<StepError>,
    },
    /// Listing, adopting or sweeping could not reach a runtime or the rules.
    #[error(transparent)]
    Unavailable(StepError),
    #[error("{agent}: container {container} has no scaler label")]
    NoScalerLabel { agent: AgentId, container: String },
}

impl ContainerError {
    pub fn kind(&self) -> BackendErrorKind {
        let injected = |e: &StepError| matches!(e, StepError::Failpoint(_));
        match self {
            Self::Spawn(e) | Self::SpawnCleanupIncomplete { source: e, .. } if injected(e) => {
                BackendErrorKind::Injected
            }
            Self::Destroy { steps, .. } if steps.iter().any(injected) => BackendErrorKind::Injected,
            Self::Unavailable(e) if injected(e) => BackendErrorKind::Injected,
            Self::Spawn(_) | Self::SpawnCleanupIncomplete { .. } => BackendErrorKind::Provision,
            Self::Destroy { .. } => BackendErrorKind::Destroy,
            Self::Unavailable(_) | Self::NoScalerLabel { .. } => BackendErrorKind::Unavailable,
        }
    }
}

impl From<ContainerError> for BackendError {
    fn from(e: ContainerError) -> Self {
        BackendError::new(e.kind(), e)
    }
}

/// Why a scaler entry cannot run on the container backend
/// ([`Backend::validate`], [`ContainerBackend::check_host`]).
#[derive(Debug, thiserror::Error)]
pub enum ContainerProblem {
    #[error("labelSets[{index}].image: {source}")]
    Image {
        index: usize,
        #[source]
        source: crate::reference::ReferenceError,
    },
    #[error("labelSets[{index}]: not a container label set")]
    NotContainerLabelSet { index: usize },
    #[error(
        "networkIsolation is on but the runtime {endpoint} is remote: egress rules \
         are installed on this host and would not apply there; set \
         networkIsolation: false for this scaler (and isolate that host yourself)"
    )]
    RemoteIsolation { endpoint: crate::runtime::Endpoint },
    /// The scaler's settings, the runtime or its network as found.
    #[error(transparent)]
    Runtime(StepError),
    #[error(
        "labelSets[{index}].resources: memory limit {bytes} bytes exceeds \
         the host's {host_bytes} bytes ({endpoint})"
    )]
    MemoryExceedsHost {
        index: usize,
        bytes: i64,
        host_bytes: i64,
        endpoint: crate::runtime::Endpoint,
    },
    #[error(
        "labelSets[{index}].resources: {cores} CPUs exceed the host's {host_cpus} ({endpoint})"
    )]
    CpusExceedHost {
        index: usize,
        cores: String,
        host_cpus: i64,
        endpoint: crate::runtime::Endpoint,
    },
    #[error("maxAgents {max_agents} exceeds the {capacity} addresses of {network} ({pool})")]
    PoolTooSmall {
        max_agents: u32,
        capacity: u32,
        network: String,
        pool: String,
    },
}

impl ContainerProblem {
    pub fn kind(&self) -> ProblemKind {
        match self {
            Self::Runtime(StepError::NotContainer(_) | StepError::Reference(_))
            | Self::Image { .. }
            | Self::NotContainerLabelSet { .. }
            | Self::RemoteIsolation { .. }
            | Self::PoolTooSmall { .. } => ProblemKind::Setting,
            Self::Runtime(_) | Self::MemoryExceedsHost { .. } | Self::CpusExceedHost { .. } => {
                ProblemKind::Host
            }
        }
    }
}

impl From<ContainerProblem> for ScalerProblem {
    fn from(p: ContainerProblem) -> Self {
        ScalerProblem::new(p.kind(), p)
    }
}

/// What a spawn or destroy step failed at.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("scaler {0:?} is not a container scaler")]
    NotContainer(String),
    #[error(transparent)]
    Reference(#[from] crate::reference::ReferenceError),
    #[error(transparent)]
    Connect(#[from] crate::runtime::ConnectError),
    #[error(transparent)]
    Network(#[from] network::NetworkError),
    #[error("no address for the agent on {network}: {source}")]
    Lease {
        network: String,
        source: kici_store::AllocError,
    },
    #[error(transparent)]
    Auth(#[from] auth::AuthError),
    #[error("image {image} is not present and imagePullPolicy is Never")]
    ImageAbsent { image: String },
    #[error("pull {image}: {reason}")]
    Pull { image: String, reason: String },
    #[error("{call} on {endpoint}: {reason}")]
    Api {
        call: String,
        endpoint: String,
        reason: String,
    },
    #[error("{call} on {endpoint}: no answer within {deadline:?}")]
    Timeout {
        call: String,
        endpoint: String,
        deadline: Duration,
    },
    #[error("egress rules: {0}")]
    Egress(#[from] kici_netpolicy::NetPolicyError),
    #[error("failpoint {0}")]
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    Failpoint(String),
    #[error("release lease: {0}")]
    Release(kici_store::AllocError),
}

pub(super) fn join_errors<E: Display>(errors: &[E]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}
