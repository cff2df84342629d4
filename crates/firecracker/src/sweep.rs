//! The orphan sweep: whatever carries this instance's owner tag but belongs
//! to no live agent.
//!
//! Passes, in order:
//! 1. VM directories (`.kici-owner` = ours) of agents not known, or known
//!    but whose recorded Firecracker is gone and that no spawn or adoption
//!    follows: torn down whole (VMM, rules, TAP, lease, cgroups, directory);
//! 2. TAPs named `kici-<8 hex>` whose ifalias is our tag for the agent the
//!    name derives from (never a protected interface, never another
//!    instance's), with no VM directory left and no live agent;
//! 3. leases of this instance in the Firecracker pool held by no live agent
//!    and no directory;
//! 4. egress rules of agents no longer live.
//!
//! Ages: a spawn creates the VM directory (with its marker) before it takes
//! anything else, and destroy removes it last, so the marker's mtime dates
//! every TAP, lease and rule of that agent; anything younger than
//! `sweep_min_age` is left alone. Spawns and VMs this daemon follows are
//! never touched whatever their age: that is checked again right before
//! each removal, since a spawn may begin while the sweep runs (everything a
//! spawn takes is taken after it is marked in flight, and it is followed
//! before that mark goes, so a resource listed earlier whose agent is
//! neither in flight nor followed at that moment is no spawn's).

use crate::backend::{read_vmm_marker, FirecrackerBackend, Teardown};
use crate::names::{self, JailLayout};
use crate::tap::{Link, Netlink};
use kici_host::process::ProcessIdentity;
use kici_model::{AgentId, InstanceId};
use std::collections::HashSet;
use std::time::SystemTime;

/// How often the daemon sweeps (upstream's period).
pub const DEFAULT_SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// What one sweep removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Agents whose VM directory (and everything with it) was removed.
    pub vms: Vec<AgentId>,
    /// TAPs deleted on their own (no directory left).
    pub taps: Vec<String>,
    pub leases: usize,
    /// Agents whose stale egress rules went.
    pub rules: usize,
    /// Steps that failed (the next sweep retries).
    pub errors: Vec<String>,
}

impl SweepReport {
    pub fn total(&self) -> usize {
        self.vms.len() + self.taps.len() + self.leases + self.rules
    }
}

/// `(agent, marker mtime)` of every VM directory under `layout` whose owner
/// marker names this instance and the directory's own agent.
pub fn owned_vm_dirs(layout: &JailLayout, instance: InstanceId) -> Vec<(AgentId, SystemTime)> {
    let Ok(entries) = std::fs::read_dir(layout.exec_dir()) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let agent: AgentId = entry.file_name().to_str()?.parse().ok()?;
            let marker = layout.owner_marker(&agent);
            let tag = std::fs::read_to_string(&marker).ok()?;
            let (owner, tagged) = names::parse_owner_tag(&tag)?;
            if owner != instance || tagged != agent {
                return None;
            }
            let mtime = std::fs::metadata(&marker).ok()?.modified().ok()?;
            Some((agent, mtime))
        })
        .collect()
}

/// `(agent, name)` of every link that is one of this instance's TAPs: the
/// name has our shape, is not protected, and is exactly the name derived
/// from the agent its ifalias names.
pub fn owned_taps(
    links: &[Link],
    instance: InstanceId,
    protected: &[String],
) -> Vec<(AgentId, String)> {
    links
        .iter()
        .filter(|l| names::is_tap_shaped(&l.name) && !protected.contains(&l.name))
        .filter_map(|l| {
            let (owner, agent) = names::parse_owner_tag(l.alias.as_deref()?)?;
            (owner == instance && names::tap_name(&agent) == l.name)
                .then(|| (agent, l.name.clone()))
        })
        .collect()
}

impl FirecrackerBackend {
    /// Removes this instance's orphans. `known`: every agent the store
    /// records for this instance (live or being destroyed).
    pub async fn sweep(&self, known: &HashSet<AgentId>) -> SweepReport {
        let inner = &self.inner;
        let mut report = SweepReport::default();
        let mut live: HashSet<AgentId> = self.tracked().into_iter().collect();
        live.extend(inner.in_flight.lock().iter().copied());
        // Asked again right before each removal (see the module doc).
        let busy = |agent: &AgentId| {
            inner.in_flight.lock().contains(agent) || inner.tracked_contains(agent)
        };
        let now = SystemTime::now();
        let young = |t: SystemTime| {
            now.duration_since(t)
                .map_or(true, |age| age < inner.sweep_min_age)
        };

        // 1. VM directories.
        let layouts = inner.layouts.lock().clone();
        let mut remaining: HashSet<AgentId> = HashSet::new();
        let mut protected_agents: HashSet<AgentId> = live.clone();
        for layout in &layouts {
            for (agent, created) in owned_vm_dirs(layout, inner.instance) {
                remaining.insert(agent);
                if live.contains(&agent) || young(created) {
                    protected_agents.insert(agent);
                    continue;
                }
                let recorded = read_vmm_marker(layout, &agent);
                if known.contains(&agent) {
                    // Recorded: only once its Firecracker is gone (the engine
                    // adopts running ones).
                    let gone = recorded.is_some_and(|id| !id.is_running());
                    if !gone {
                        protected_agents.insert(agent);
                        continue;
                    }
                }
                if busy(&agent) {
                    protected_agents.insert(agent);
                    continue;
                }
                let parts = Teardown {
                    layout: Some(layout.clone()),
                    identity: recorded.filter(ProcessIdentity::is_current),
                    api: None,
                    watch: None,
                    grace: std::time::Duration::ZERO,
                    tap_created: false,
                };
                match self.teardown(&agent, parts).await {
                    Ok(()) => {
                        tracing::info!(agent_id = %agent, "sweep: removed an orphaned microVM");
                        remaining.remove(&agent);
                        report.vms.push(agent);
                    }
                    Err(e) => report.errors.push(format!("{agent}: {e}")),
                }
            }
        }
        protected_agents.extend(known.iter().copied());

        // 2. TAPs left without a directory.
        match Netlink::connect() {
            Ok(netlink) => match netlink.list().await {
                Ok(links) => {
                    for (agent, tap) in owned_taps(&links, inner.instance, &self.protected()) {
                        if protected_agents.contains(&agent)
                            || remaining.contains(&agent)
                            || busy(&agent)
                        {
                            continue;
                        }
                        match netlink.delete(&tap).await {
                            Ok(_) => {
                                tracing::info!(agent_id = %agent, tap = %tap, "sweep: removed an orphaned TAP");
                                if let Err(e) = inner.egress.remove(&agent).await {
                                    report.errors.push(format!("{agent} rules: {e}"));
                                }
                                match inner.allocator.release_agent(&agent).await {
                                    Ok(n) => {
                                        report.leases += usize::try_from(n).unwrap_or(usize::MAX)
                                    }
                                    Err(e) => report.errors.push(format!("{agent} lease: {e}")),
                                }
                                report.taps.push(tap);
                                if let Err(e) = sweep_step(crate::fp::SWEEP_TAP) {
                                    report.errors.push(e);
                                    return report;
                                }
                            }
                            Err(e) => report.errors.push(format!("{tap}: {e}")),
                        }
                    }
                }
                Err(e) => report.errors.push(e.to_string()),
            },
            Err(e) => report.errors.push(e.to_string()),
        }

        // 3. Leases.
        match inner.allocator.leases().await {
            Ok(leases) => {
                for lease in leases {
                    if lease.network != inner.pool.network()
                        || protected_agents.contains(&lease.agent)
                        || remaining.contains(&lease.agent)
                        || busy(&lease.agent)
                    {
                        continue;
                    }
                    // By agent, not by address: should the address have
                    // been released meanwhile (a destroy, the reconciler)
                    // and leased again, it is another agent's now.
                    match inner.allocator.release_agent(&lease.agent).await {
                        Ok(0) => {}
                        Ok(n) => {
                            tracing::info!(agent_id = %lease.agent, ip = %lease.ip, "sweep: released an orphaned IP lease");
                            report.leases += usize::try_from(n).unwrap_or(usize::MAX);
                            if let Err(e) = sweep_step(crate::fp::SWEEP_LEASES) {
                                report.errors.push(e);
                                return report;
                            }
                        }
                        Err(e) => report.errors.push(format!("{}: {e}", lease.ip)),
                    }
                }
            }
            Err(e) => report.errors.push(e.to_string()),
        }

        // 4. Rules.
        let mut keep = protected_agents;
        keep.extend(remaining);
        let keep: Vec<AgentId> = keep.into_iter().collect();
        match inner.egress.sweep_stale(&keep).await {
            Ok(gone) => report.rules = gone.len(),
            Err(e) => report.errors.push(e.to_string()),
        }
        // Every pass, even an empty one: that it ran is worth knowing.
        tracing::info!(
            vms = report.vms.len(),
            taps = report.taps.len(),
            leases = report.leases,
            rules = report.rules,
            errors = report.errors.len(),
            "Firecracker orphan sweep"
        );
        for e in &report.errors {
            tracing::warn!(error = %e, "Firecracker orphan sweep");
        }
        report
    }
}

impl FirecrackerBackend {
    /// Sweeps every `interval` (not at once: the daemon sweeps at startup
    /// itself, after recovery) until the returned task is aborted. `known`
    /// is asked for the store's agents at each tick; `None` (the store
    /// cannot say) skips that tick rather than sweep what it may record. A
    /// tick never overlaps the previous one.
    pub fn spawn_periodic_sweep<F, Fut>(
        &self,
        interval: std::time::Duration,
        known: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Option<HashSet<AgentId>>> + Send,
    {
        self.spawn_periodic_sweep_reporting(interval, known, |_| {})
    }

    /// [`FirecrackerBackend::spawn_periodic_sweep`], handing each pass's
    /// report to `on_report` (the daemon counts what was removed).
    pub fn spawn_periodic_sweep_reporting<F, Fut, R>(
        &self,
        interval: std::time::Duration,
        known: F,
        on_report: R,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Option<HashSet<AgentId>>> + Send,
        R: Fn(&SweepReport) + Send + 'static,
    {
        let backend = self.clone();
        tokio::spawn(async move {
            let mut ticks =
                tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                match known().await {
                    Some(known) => {
                        let report = backend.sweep(&known).await;
                        on_report(&report);
                    }
                    None => tracing::warn!(
                        "periodic Firecracker sweep skipped: the state store cannot list its agents"
                    ),
                }
            }
        })
    }
}

fn sweep_step(name: &'static str) -> Result<(), String> {
    fail::fail_point!(name, |_| Err(format!("injected failure at {name}")));
    let _ = name;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_model::ScalerType;

    fn link(name: &str, alias: Option<&str>) -> Link {
        Link {
            index: 1,
            name: name.into(),
            alias: alias.map(Into::into),
            up: true,
            controller: None,
            isolated: None,
        }
    }

    #[test]
    fn firecracker_owned_taps_match_name_alias_and_instance_exactly() {
        let ours: InstanceId = "0a0b0c0d".parse().unwrap();
        let other: InstanceId = "01010101".parse().unwrap();
        let a = AgentId::new(ScalerType::Firecracker, [0xde, 0xad, 0xbe, 0xef]);
        let b = AgentId::new(ScalerType::Firecracker, [0xca, 0xfe, 0xba, 0xbe]);
        let links = [
            link("kici-deadbeef", Some(&names::owner_tag(ours, &a))),
            // Another instance's.
            link("kici-cafebabe", Some(&names::owner_tag(other, &b))),
            // Our tag, but the name does not derive from the agent.
            link("kici-00000001", Some(&names::owner_tag(ours, &b))),
            // Right shape, no alias (not ours).
            link("kici-aaaaaaaa", None),
            link("kici-br0", Some(&names::owner_tag(ours, &a))),
            link("eth0", None),
        ];
        let found = owned_taps(&links, ours, &["kici-br0".into()]);
        assert_eq!(found, [(a, "kici-deadbeef".to_owned())]);
        // A protected name is never returned, even when it has our shape.
        let found = owned_taps(&links, ours, &["kici-deadbeef".into()]);
        assert!(found.is_empty());
    }

    #[test]
    fn firecracker_owned_vm_dirs_need_our_marker_for_that_agent() {
        let dir = tempfile::tempdir().unwrap();
        let layout = JailLayout::new(dir.path(), "firecracker".into()).unwrap();
        let ours: InstanceId = "0a0b0c0d".parse().unwrap();
        let a = AgentId::new(ScalerType::Firecracker, [1, 1, 1, 1]);
        let b = AgentId::new(ScalerType::Firecracker, [2, 2, 2, 2]);
        let c = AgentId::new(ScalerType::Firecracker, [3, 3, 3, 3]);
        for agent in [a, b, c] {
            std::fs::create_dir_all(layout.vm_dir(&agent)).unwrap();
        }
        std::fs::write(layout.owner_marker(&a), names::owner_tag(ours, &a)).unwrap();
        // b's marker names another agent; c has none.
        std::fs::write(layout.owner_marker(&b), names::owner_tag(ours, &a)).unwrap();
        std::fs::create_dir_all(layout.exec_dir().join("not-an-agent")).unwrap();
        let found: Vec<AgentId> = owned_vm_dirs(&layout, ours)
            .into_iter()
            .map(|(a, _)| a)
            .collect();
        assert_eq!(found, [a]);
    }
}
