//! The vocabulary every kici-scaler layer shares.
//!
//! This crate owns the *parsed* forms of everything the operator or a caller
//! can write: labels ([`LabelSet`]), resource amounts ([`MilliCpu`],
//! [`MemoryBytes`]), identifiers ([`AgentId`], [`JobId`], [`InstanceId`]) and
//! the immutable configuration snapshot ([`Config`]). Values of these types
//! are valid by construction, so the layers above (routing, admission,
//! lifecycle) never re-validate strings or floats.
//!
//! It does no I/O. Parsing YAML into a [`Config`] belongs to `kici-config`.

pub mod config;
pub mod contract;
pub mod ids;
pub mod labels;
pub mod origin;
pub mod resources;
pub mod secret;

pub use config::{
    BackendSettings, BackoffPolicy, BackpressureMode, BareMetalSettings, Config, ContainerRuntime,
    ContainerSettings, Deadlines, EnvName, FirecrackerLabelSet, FirecrackerNetwork,
    FirecrackerSettings, HostAccess, HostAccessError, ImagePullPolicy, LabelSetBackend,
    LabelSetConfig, LabelSetExtension, MachinePool, NetworkPolicy, PlatformArch, PlatformOs, Role,
    Roles, ScalerEntry, ScalerExtension, ScalerPlatform, UlimitName, UlimitValue, WarmPoolConfig,
    LEGACY_PLATFORM_TAINT_LABELS,
};
pub use ids::{AgentId, IdError, InstanceId, JobId, ScalerName, ScalerType};
pub use labels::{Label, LabelError, LabelSet};
pub use origin::Origin;
pub use resources::{
    EffectiveResources, MemoryBytes, MilliCpu, ResourceCap, ResourceError, ResourceRequest,
    ResourceSpec, Resources,
};
pub use secret::Secret;
