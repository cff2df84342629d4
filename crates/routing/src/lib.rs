//! Label routing: which scaler label set a job lands on, and why.
//!
//! This crate owns the matching rules of DESIGN.md (upstream-core.md §3 with
//! our deviations):
//!
//! * every configured label set is *enriched* with the auto labels
//!   `kici:os:*`, `kici:arch:*`, `kici:agent:<type>`, `kici:scaler:<name>`
//!   and the scaler's role labels, so jobs may name them in `runsOn` and in
//!   their excluded labels;
//! * a label set is a candidate when its scaler is not cordoned, the job
//!   carries every mandatory label of the scaler (the gate), the job's labels
//!   are a subset of the enriched set, and no excluded label is in it;
//! * the winner has the fewest *user* labels (auto labels do not count,
//!   upstream defect #16), ties go to config order;
//! * an empty `runsOn` is not special-cased (upstream defect #17).
//!
//! [`Router`] is built once per configuration snapshot and answers
//! [`Router::route`] (hot path, allocation-free for ordinary jobs) and
//! [`Router::explain`] (one [`Reason`] per scaler × label set).
//! [`label_set_overlaps`] is the boot/reload check for label sets shared by
//! two scalers.

mod cordon;
mod explain;
mod overlap;
mod platform;
mod router;
mod vocabulary;

pub use cordon::CordonSet;
pub use explain::{Candidate, Explanation, Reason};
pub use overlap::{label_set_overlaps, LabelSetOverlap};
pub use platform::HostPlatform;
pub use router::{Route, Router};
