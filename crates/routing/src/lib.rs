//! Label routing: which scaler label set a job lands on, and why.
//!
//! This crate owns the matching rules (upstream KiCI's, with the deviations
//! named in docs/deviations.md):
//!
//! * every configured label set is *enriched* with the auto labels
//!   `kici:os:*`, `kici:arch:*`, `kici:agent:<type>`, `kici:scaler:<name>`
//!   and the scaler's role labels, so jobs may name them in `runsOn` and in
//!   their excluded labels;
//! * a label set is a candidate when its scaler is not cordoned, the job
//!   carries every label of the scaler's gate (its mandatory labels, and the
//!   taints of a non-default platform), the job's labels are a subset of the
//!   enriched set, and no excluded label is in it;
//! * the winner has the fewest labels counting the user's and the role
//!   labels, never the host-derived `kici:os:*` / `kici:arch:*` (see
//!   docs/deviations.md, D-tie-break); ties go to config order;
//! * an empty `runsOn` is not special-cased (see docs/deviations.md,
//!   D-empty-runs-on).
//!
//! [`Router`] is built once per configuration snapshot and answers
//! [`Router::route`] (hot path, allocation-free for ordinary jobs) and
//! [`Router::explain`] (one [`Reason`] per scaler × label set).
//! [`label_set_overlaps`] is the boot/reload check for label sets shared by
//! two scalers. It does no I/O and keeps no state between calls: cordons
//! are the caller's ([`CordonSet`]).
//!
//! ```
//! use kici_model::LabelSet;
//! use kici_routing::{CordonSet, HostPlatform, Router};
//!
//! let yaml = r#"
//! version: 1
//! scalers:
//!   - name: metal
//!     type: bare-metal
//!     maxAgents: 2
//!     labelSets:
//!       - labels: [linux, gpu]
//!         binaryPath: /usr/local/bin/kici-agent
//!   - name: docker
//!     type: container
//!     maxAgents: 8
//!     labelSets:
//!       - labels: [linux]
//!         image: kici/agent:1
//!       - labels: [linux, big]
//!         image: kici/agent:1
//! "#;
//! let config = kici_config::load_documents(&[("scalers.yaml", yaml)]).unwrap().config;
//! let router = Router::new(&config, &HostPlatform::new("linux", "x86_64"));
//! let labels = |raw: &[&str]| LabelSet::parse(raw).unwrap();
//! let nothing = LabelSet::default();
//! let scaler_of = |r: kici_routing::Route| config.scalers[r.scaler].name.as_str();
//!
//! // Three label sets match `linux`; the one with the fewest labels wins.
//! let route = router.route(&labels(&["linux"]), &nothing, &CordonSet::none()).unwrap();
//! assert_eq!((scaler_of(route), route.label_set), ("docker", 0));
//!
//! // Auto labels can be asked for, and excluded.
//! let route = router
//!     .route(&labels(&["linux"]), &labels(&["kici:agent:container"]), &CordonSet::none())
//!     .unwrap();
//! assert_eq!(scaler_of(route), "metal");
//!
//! // A cordoned scaler gets nothing new.
//! let docker_cordoned = CordonSet::from_indices([1]);
//! let route = router.route(&labels(&["linux"]), &nothing, &docker_cordoned).unwrap();
//! assert_eq!(scaler_of(route), "metal");
//!
//! // No match: the explanation says why, per label set.
//! let job = labels(&["windows"]);
//! assert!(router.route(&job, &nothing, &CordonSet::none()).is_none());
//! let why = router.explain(&job, &nothing, &CordonSet::none());
//! assert_eq!(why.reason(0, 0).unwrap().to_string(), "not-superset:windows");
//! ```

mod cordon;
mod explain;
mod overlap;
mod platform;
mod request;
mod router;
mod vocabulary;

pub use cordon::CordonSet;
pub use explain::{Candidate, Explanation, Reason};
pub use overlap::{label_set_overlaps, LabelSetOverlap};
pub use platform::{HostPlatform, TaintSource};
pub use router::{Route, Router};

pub use request::request_labels;
