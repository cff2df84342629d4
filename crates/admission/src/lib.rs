//! Atomic admission against count and resource caps, [`Reservation`]
//! guards, and the cross-process machine-pool ledger.
//!
//! This crate owns capacity accounting: how many agents, milli-CPUs and
//! bytes each scaler, the whole daemon and each machine pool have reserved,
//! and the decision whether one more agent fits. It does not decide *which*
//! scaler serves a request (routing) nor *when* to retry a refused one (the
//! engine's pending queue, woken by [`Admission::subscribe_releases`]).
//!
//! - [`Admission::try_reserve`] checks every cap — `global-count`,
//!   `scaler-count`, `scaler-cpu`, `scaler-memory`, `global-cpu`,
//!   `global-memory`, `pool-cpu`, `pool-memory`, in that order, each as
//!   `used + held + requested > limit` — and reserves, in one critical
//!   section. A [`Refusal`], [`TooLarge`] or error leaves nothing reserved.
//! - A [`Reservation`] is released exactly once, when dropped.
//! - [`MachineLedger`] shares pool caps between processes on one host
//!   (`flock`-guarded version 2 JSON files, liveness by owner locks).
//!
//! Checking and reserving in one step is a deliberate difference from
//! upstream KiCI (see docs/deviations.md, D-atomic-admission); so is the
//! ledger's format (D-ledger-v2).
//!
//! ```
//! use kici_admission::{Admission, AdmitError, Cap, Demand, Holds};
//! use kici_model::{AgentId, MemoryBytes, MilliCpu, Resources, ScalerName, ScalerType};
//!
//! let yaml = r#"
//! version: 1
//! scalers:
//!   - name: builds
//!     type: container
//!     maxAgents: 2
//!     resourceCap: { maxCpu: 3, maxMemory: 8g }
//!     labelSets:
//!       - labels: [linux]
//!         image: kici/agent:1
//! "#;
//! let config = kici_config::load_documents(&[("scalers.yaml", yaml)]).unwrap().config;
//! let admission = Admission::new(&config, None).unwrap(); // no machine pools
//! let demand = |cores: f64| Demand {
//!     agent: AgentId::random(ScalerType::Container),
//!     scaler: ScalerName::new("builds"),
//!     requests: Resources::new(MilliCpu::from_cores(cores).unwrap(), "1g".parse().unwrap()),
//!     pool: None,
//! };
//! let mut releases = admission.subscribe_releases();
//!
//! let first = admission.try_reserve(demand(2.0), &Holds::none()).unwrap();
//! // 2 + 2 CPUs do not fit under 3: refused for now, nothing reserved.
//! match admission.try_reserve(demand(2.0), &Holds::none()) {
//!     Err(AdmitError::Refused(refusal)) => {
//!         assert_eq!(refusal.cap, Cap::ScalerCpu);
//!         assert_eq!(refusal.short_by(), 1000); // milli-CPUs
//!     }
//!     other => panic!("expected a refusal, got {other:?}"),
//! }
//! // 4 CPUs never fit: the caller answers `too-large` instead of waiting.
//! assert!(matches!(
//!     admission.try_reserve(demand(4.0), &Holds::none()),
//!     Err(AdmitError::TooLarge(_))
//! ));
//!
//! // Dropping the reservation releases it, once, and wakes whoever waits.
//! assert!(!releases.take_released());
//! drop(first);
//! assert!(releases.take_released());
//! let _second = admission.try_reserve(demand(2.0), &Holds::none()).unwrap();
//! let usage = admission.usage();
//! assert_eq!(usage.scalers[&ScalerName::new("builds")].agents, 1);
//! assert_eq!(usage.global.memory, MemoryBytes::from_bytes(1 << 30));
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod admission;
mod cap;
mod holds;
pub mod ledger;
mod signal;
mod sync;

pub use admission::{
    Admission, AdmissionError, AdmitError, Demand, Reservation, ScopeUsage, UsageSnapshot,
};
pub use cap::{Cap, CapUnit, Caps, Refusal, TooLarge};
pub use holds::Holds;
pub use ledger::{LedgerError, MachineLedger};
pub use signal::{ReleaseSignal, Released};
