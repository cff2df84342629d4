//! The reconciler: the state store and the host's reality, compared both
//! ways, for this instance's owner only.
//!
//! Recovery at start-up (the engine's) takes back every *recorded* agent.
//! What is left for the reconciler is everything else:
//!
//! - **orphans**: resources carrying our owner marker that no live or
//!   recorded agent owns (a spawn cut short by a crash before its record,
//!   a destroy that half-finished). Resources younger than the age
//!   threshold are never touched — they may belong to a spawn in flight.
//!   The periodic pass *marks* an orphan and reaps it on the next pass if
//!   it is still an orphan; a one-shot `kici-scaler sweep` (no daemon
//!   running, so nothing is in flight) reaps at once;
//! - **leases** held by agents that are neither live nor recorded;
//! - **stale rows**: records of agents the engine no longer has (a
//!   `Forget` lost to a crash), once older than the age threshold;
//! - **stale egress rules**: rules of agents that have no resource any
//!   more ([`StaleRuleSweep`]), so a reused address never inherits them.
//!
//! Each pass returns a [`SweepReport`]; reaped orphans are counted in
//! `kici_orch_scaler_orphans_reaped_total{kind}`.

use crate::daemon::backends::StaleRuleSweep;
use crate::events::metrics::{Metrics, OrphanKind};
use kici_engine::runtime::Runtime;
use kici_engine::{Adoption, Backend, OwnedResource, ResourceHandle};
use kici_model::{AgentId, ScalerType};
use kici_store::StateStore;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// An orphan was destroyed; it is not yet counted or reported.
pub const FP_REAPED: &str = "kici_scaler::reconcile::reaped";
/// A lease of an unknown agent was released; not yet counted.
pub const FP_LEASE_RELEASED: &str = "kici_scaler::reconcile::lease_released";
/// A recorded agent whose resource was gone was destroyed; its row remains.
pub const FP_SETTLED: &str = "kici_scaler::reconcile::settled";
/// Every failpoint of the reconciler.
pub const FAILPOINTS: &[&str] = &[FP_REAPED, FP_LEASE_RELEASED, FP_SETTLED];

#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
fn hit(name: &'static str) {
    fail::fail_point!(name);
}

/// The grace a reaped orphan gets before it is killed.
const ORPHAN_GRACE: Duration = Duration::from_secs(5);

/// How a pass treats an orphan it finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaping {
    /// The daemon's periodic pass: mark now, reap if still an orphan next time.
    MarkThenReap,
    /// `kici-scaler sweep` with no daemon running: reap now.
    Now,
    /// `--dry-run`: report only.
    DryRun,
}

/// One resource the pass found without an owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Orphan {
    pub kind: &'static str,
    pub backend: ScalerType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<AgentId>,
    pub id: String,
    pub age_seconds: u64,
}

/// What one pass found and did.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SweepReport {
    pub dry_run: bool,
    /// Orphans old enough to act on.
    pub orphans: Vec<Orphan>,
    /// Of those, marked this pass (reaped on the next one).
    pub marked: Vec<String>,
    /// Of those, removed.
    pub reaped: Vec<String>,
    /// Resources without an owner but younger than the age threshold.
    pub young: usize,
    /// Owned resources that are live or recorded (left alone).
    pub tracked: usize,
    /// Leases released (`network ip`).
    pub leases_released: Vec<String>,
    /// Store rows deleted because no live agent matches them.
    pub stale_rows_deleted: Vec<AgentId>,
    /// Agents whose egress rules were removed: they have no resource.
    pub stale_rules_removed: Vec<AgentId>,
    /// Offline sweep: recorded agents whose resource was gone (destroyed
    /// and forgotten unless a dry run).
    pub gone_recorded: Vec<AgentId>,
    pub errors: Vec<String>,
}

/// Compares the store, the engine and the backends.
pub struct Reconciler {
    store: Arc<dyn StateStore>,
    backends: Vec<Arc<dyn Backend>>,
    /// The running engine (`None` for the offline `sweep`).
    runtime: Option<Runtime>,
    metrics: Option<Arc<Metrics>>,
    age_threshold: Duration,
    /// Orphans marked by the previous pass (backend, resource id).
    marked: Mutex<HashSet<(ScalerType, String)>>,
    rule_sweeps: Vec<Arc<dyn StaleRuleSweep>>,
}

impl Reconciler {
    pub fn new(
        store: Arc<dyn StateStore>,
        backends: Vec<Arc<dyn Backend>>,
        runtime: Option<Runtime>,
        metrics: Option<Arc<Metrics>>,
        age_threshold: Duration,
    ) -> Self {
        Self {
            store,
            backends,
            runtime,
            metrics,
            age_threshold,
            marked: Mutex::new(HashSet::new()),
            rule_sweeps: Vec::new(),
        }
    }

    /// Each pass (but a dry run) also sweeps these backends' stale rules.
    pub fn with_rule_sweeps(mut self, sweeps: Vec<Arc<dyn StaleRuleSweep>>) -> Self {
        self.rule_sweeps = sweeps;
        self
    }

    /// One pass. Never touches a resource of a live or recorded agent, a
    /// young resource, or anything without our owner marker (the backends
    /// list only ours).
    pub async fn pass(&self, reaping: Reaping) -> SweepReport {
        let mut report = SweepReport {
            dry_run: reaping == Reaping::DryRun,
            ..SweepReport::default()
        };
        let now = SystemTime::now();
        let records = match self.store.agents().await {
            Ok(r) => r,
            Err(e) => {
                // Without the records every resource would look orphaned.
                report
                    .errors
                    .push(format!("cannot read recorded agents: {e}"));
                return report;
            }
        };
        let mut recorded: BTreeSet<AgentId> = records.iter().map(|r| r.agent_id).collect();
        if self.runtime.is_none() {
            // No daemon runs: nobody else will settle the recorded agents
            // whose resource is gone.
            for agent in self.settle_recorded(&records, reaping, &mut report).await {
                recorded.remove(&agent);
            }
        }
        let live: BTreeSet<AgentId> = self
            .runtime
            .as_ref()
            .map(Runtime::live_agent_ids)
            .unwrap_or_default();
        let known = |a: &AgentId| live.contains(a) || recorded.contains(a);
        // Agents with a resource too young to judge: a spawn may be under
        // way; their leases stay too.
        let mut young_agents: HashSet<AgentId> = HashSet::new();

        let mut still_marked = HashSet::new();
        let previously = std::mem::take(&mut *self.marked.lock());
        for backend in &self.backends {
            let owned = match backend.list_owned().await {
                Ok(o) => o,
                Err(e) => {
                    report.errors.push(format!(
                        "{}: cannot list owned resources: {e}",
                        backend.kind()
                    ));
                    continue;
                }
            };
            for resource in owned {
                if resource.agent.as_ref().is_some_and(known) {
                    report.tracked += 1;
                    continue;
                }
                let age = now.duration_since(resource.created_at).unwrap_or_default();
                if age < self.age_threshold {
                    report.young += 1;
                    young_agents.extend(resource.agent);
                    continue;
                }
                let orphan = orphan_of(backend.kind(), &resource, age);
                let key = (backend.kind(), resource.handle.id.clone());
                let reap = match reaping {
                    Reaping::DryRun => false,
                    Reaping::Now => true,
                    Reaping::MarkThenReap => previously.contains(&key),
                };
                if reap {
                    self.reap(backend.as_ref(), &resource, &orphan, &mut report)
                        .await;
                } else if reaping == Reaping::MarkThenReap {
                    report.marked.push(orphan.id.clone());
                    still_marked.insert(key);
                }
                report.orphans.push(orphan);
            }
        }
        *self.marked.lock() = still_marked;

        let spared = |a: &AgentId| known(a) || young_agents.contains(a);
        self.release_leases(&spared, reaping, &mut report).await;
        if reaping != Reaping::DryRun {
            for sweep in &self.rule_sweeps {
                match sweep.sweep_stale_rules().await {
                    Ok(swept) => {
                        if let Some(m) = &self.metrics {
                            for _ in &swept {
                                m.orphan_reaped(OrphanKind::NftablesRule);
                            }
                        }
                        report.stale_rules_removed.extend(swept)
                    }
                    Err(e) => report.errors.push(e),
                }
            }
        }
        if self.runtime.is_some() {
            self.delete_stale_rows(&records, &live, now, reaping, &mut report)
                .await;
        }
        report
    }

    /// Offline only: each recorded agent whose resource no longer runs is
    /// destroyed (removing what remains) and forgotten; live ones are left
    /// for the daemon to re-adopt. Returns the agents settled.
    async fn settle_recorded(
        &self,
        records: &[kici_store::AgentRecord],
        reaping: Reaping,
        report: &mut SweepReport,
    ) -> Vec<AgentId> {
        let mut settled = Vec::new();
        for r in records {
            let Some(backend) = self.backends.iter().find(|b| b.kind() == r.backend) else {
                continue;
            };
            let handle = ResourceHandle {
                id: r.resource_id.clone().unwrap_or_default(),
                extra: r.resources.clone(),
            };
            // Reports of an adopted agent have nowhere to go in a one-shot
            // pass; the channel is dropped with the pass.
            let (reports, _rx) = tokio::sync::mpsc::unbounded_channel();
            match backend.adopt(&r.agent_id, &handle, reports).await {
                Ok(Adoption::Alive) => continue,
                Ok(Adoption::Gone) => {}
                Err(e) => {
                    report
                        .errors
                        .push(format!("{}: cannot tell whether it runs: {e}", r.agent_id));
                    continue;
                }
            }
            report.gone_recorded.push(r.agent_id);
            if reaping == Reaping::DryRun {
                continue;
            }
            if let Err(e) = backend
                .destroy(&r.agent_id, Some(&handle), ORPHAN_GRACE)
                .await
            {
                report
                    .errors
                    .push(format!("{}: removing what remains: {e}", r.agent_id));
                continue;
            }
            hit(FP_SETTLED);
            match self.store.delete_agent(&r.agent_id).await {
                Ok(_) => settled.push(r.agent_id),
                Err(e) => report
                    .errors
                    .push(format!("{}: forgetting its row: {e}", r.agent_id)),
            }
        }
        settled
    }

    async fn reap(
        &self,
        backend: &dyn Backend,
        resource: &OwnedResource,
        orphan: &Orphan,
        report: &mut SweepReport,
    ) {
        let Some(agent) = resource.agent else {
            // Every backend names what it creates after the agent id; a
            // resource without one was not made by this version. Reported,
            // left for an operator.
            report.errors.push(format!(
                "{}: {} carries our owner marker but no agent id; not removed",
                orphan.backend, orphan.id
            ));
            return;
        };
        match backend
            .destroy(&agent, Some(&resource.handle), ORPHAN_GRACE)
            .await
        {
            Ok(()) => {
                hit(FP_REAPED);
                tracing::info!(agent = %agent, backend = %orphan.backend, resource = %orphan.id, kind = orphan.kind, "orphan reaped");
                if let Some(m) = &self.metrics {
                    m.orphan_reaped(kind_of(orphan.backend, &resource.handle));
                }
                report.reaped.push(orphan.id.clone());
            }
            Err(e) => report
                .errors
                .push(format!("{}: reaping {}: {e}", orphan.backend, orphan.id)),
        }
    }

    async fn release_leases(
        &self,
        known: &(dyn Fn(&AgentId) -> bool + Sync),
        reaping: Reaping,
        report: &mut SweepReport,
    ) {
        let leases = match self.store.leases().await {
            Ok(l) => l,
            Err(e) => {
                report.errors.push(format!("cannot list IP leases: {e}"));
                return;
            }
        };
        // Taken after the leases: an agent admitted since the pass began
        // (whose spawn may have leased an address) is live by now. A lease
        // listed whose agent is not live then is no spawn's.
        let live_now = self
            .runtime
            .as_ref()
            .map(Runtime::live_agent_ids)
            .unwrap_or_default();
        for lease in leases {
            if known(&lease.agent) || live_now.contains(&lease.agent) {
                continue;
            }
            let name = format!("{} {}", lease.network, lease.ip);
            if reaping == Reaping::DryRun {
                report.leases_released.push(name);
                continue;
            }
            // By agent, not by address: had the address been released
            // meanwhile (a destroy) and leased again, it would be another
            // agent's now.
            match self.store.release_agent(&lease.agent).await {
                Ok(0) => {}
                Ok(_) => {
                    hit(FP_LEASE_RELEASED);
                    if let Some(m) = &self.metrics {
                        m.orphan_reaped(OrphanKind::IpLease);
                    }
                    report.leases_released.push(name);
                }
                Err(e) => report.errors.push(format!("releasing lease {name}: {e}")),
            }
        }
    }

    async fn delete_stale_rows(
        &self,
        records: &[kici_store::AgentRecord],
        live: &BTreeSet<AgentId>,
        now: SystemTime,
        reaping: Reaping,
        report: &mut SweepReport,
    ) {
        for r in records {
            if live.contains(&r.agent_id) {
                continue;
            }
            let age = now
                .duration_since(r.updated_at.to_system_time())
                .unwrap_or_default();
            if age < self.age_threshold {
                continue;
            }
            if reaping == Reaping::DryRun {
                report.stale_rows_deleted.push(r.agent_id);
                continue;
            }
            match self.store.delete_agent(&r.agent_id).await {
                Ok(_) => report.stale_rows_deleted.push(r.agent_id),
                Err(e) => report
                    .errors
                    .push(format!("deleting the stale row of {}: {e}", r.agent_id)),
            }
        }
    }
}

fn orphan_of(backend: ScalerType, resource: &OwnedResource, age: Duration) -> Orphan {
    Orphan {
        kind: kind_of(backend, &resource.handle).as_str(),
        backend,
        agent_id: resource.agent,
        id: resource.handle.id.clone(),
        age_seconds: age.as_secs(),
    }
}

/// The metric kind of an owned resource: what its primary handle is.
fn kind_of(backend: ScalerType, handle: &ResourceHandle) -> OrphanKind {
    match backend {
        ScalerType::Container => OrphanKind::Container,
        // A VM directory that recorded its Firecracker process, one that
        // did not get that far, or a TAP left on its own (the handles
        // kici-firecracker's `list_owned` gives).
        ScalerType::Firecracker => {
            if handle
                .extra
                .contains_key(kici_firecracker::backend::EXTRA_VMM)
            {
                OrphanKind::Vm
            } else if handle
                .extra
                .contains_key(kici_firecracker::backend::EXTRA_VM_DIR)
            {
                OrphanKind::Chroot
            } else {
                OrphanKind::Tap
            }
        }
        _ => {
            if handle.id.starts_with("pid:") {
                OrphanKind::Process
            } else {
                OrphanKind::Cgroup
            }
        }
    }
}
