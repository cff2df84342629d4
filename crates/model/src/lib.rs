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
//!
//! ```
//! use kici_model::{AgentId, LabelSet, MemoryBytes, MilliCpu, ScalerType};
//!
//! // Labels are normalised once, on the way in: lower-cased, deduplicated.
//! let job = LabelSet::parse(["Linux", "x64", "linux"]).unwrap();
//! assert_eq!(job.len(), 2);
//! let offered = LabelSet::parse(["linux", "x64", "docker"]).unwrap();
//! assert!(job.is_subset_of(&offered));
//!
//! // Resource amounts are integers: milli-CPUs and bytes.
//! assert_eq!(MilliCpu::from_cores(0.5).unwrap().millis(), 500);
//! let memory: MemoryBytes = "1.5g".parse().unwrap();
//! assert_eq!(memory.mib_floor(), 1536);
//! assert!("1.5 gigabytes".parse::<MemoryBytes>().is_err());
//!
//! // Agent ids have KiCI's format, `scaler-<type>-<8 hex>`.
//! let id = AgentId::random(ScalerType::BareMetal);
//! assert!(id.to_string().starts_with("scaler-bare-metal-"));
//! assert_eq!(id.to_string().parse::<AgentId>().unwrap(), id);
//! ```

pub mod config;
pub mod contract;
pub mod ids;
pub mod labels;
pub mod origin;
pub mod resources;
pub mod secret;
pub mod time;
pub mod warm;

pub use config::{
    AgentUser, BackendSettings, BackoffPolicy, BackpressureMode, BareMetalSettings, Config,
    ContainerRuntime, ContainerSettings, Deadlines, EnvName, EventSettings, FirecrackerLabelSet,
    FirecrackerNetwork, FirecrackerSettings, HostAccess, HostAccessError, ImagePullPolicy,
    LabelSetBackend, LabelSetConfig, LabelSetExtension, MachinePool, NetworkPolicy, PlatformArch,
    PlatformOs, ProvisionerSettings, ProvisionerTarget, ProvisionerWebhook, Role, Roles,
    ScalerEntry, ScalerExtension, ScalerPlatform, UlimitName, UlimitValue, WarmPoolConfig,
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
pub use time::UnixMillis;
pub use warm::{TimeOfDay, Timezone, WarmForecast, WarmPeriod, WarmPolicy, Weekday};
