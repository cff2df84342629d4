//! Prometheus metrics (`GET /metrics`), all under `kici_orch_scaler_*`.
//!
//! Counters and histograms are driven by the engine's event stream
//! ([`Metrics::observe`]); gauges are recomputed from a status snapshot at
//! every scrape (`Metrics::refresh`), so they can never drift from the
//! engine. Every series exists from start-up at 0: labelled series are
//! pre-created for every label combination the configuration and the enums
//! allow (scalers × states, backends × failure reasons, caps, ...).

use crate::serving::{ListenerMetrics, ListenerName};
use kici_admission::Cap;
use kici_engine::runtime::SequencedEvent;
use kici_engine::{AgentState, AgentView, BreakerState, EngineEvent, FailureReason, Status};
use kici_model::{AgentId, Config, ScalerType};
use parking_lot::Mutex;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

/// Every series name, for documentation and the start-up test. Counters are
/// exposed with the `_total` suffix.
pub const SERIES: &[&str] = &[
    "kici_orch_scaler_config_reloads_total",
    "kici_orch_scaler_cpus_used",
    "kici_orch_scaler_memory_bytes_used",
    "kici_orch_scaler_spawn_refusals_total",
    "kici_orch_scaler_spawn_failures_total",
    "kici_orch_scaler_agents",
    "kici_orch_scaler_warm_target",
    "kici_orch_scaler_pending_requests",
    "kici_orch_scaler_pending_age_seconds",
    "kici_orch_scaler_provision_seconds",
    "kici_orch_scaler_breaker_open",
    "kici_orch_scaler_orphans_reaped_total",
    "kici_orch_scaler_connections",
    "kici_orch_scaler_connection_limit_reached_total",
];

/// `config_reloads_total{result}`.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ReloadResult {
    attempted,
    success,
    failed,
}

/// `provision_seconds{phase}`: `provision` = requested → booted,
/// `registration` = booted → registered.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Phase {
    provision,
    registration,
}

/// `orphans_reaped_total{kind}`: what the reconciler (or a backend's own
/// sweep) removed that no live agent owned.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum OrphanKind {
    Container,
    Process,
    Vm,
    Tap,
    Chroot,
    Cgroup,
    NftablesRule,
    IpLease,
    LedgerRow,
}

impl OrphanKind {
    pub const ALL: [OrphanKind; 9] = [
        Self::Container,
        Self::Process,
        Self::Vm,
        Self::Tap,
        Self::Chroot,
        Self::Cgroup,
        Self::NftablesRule,
        Self::IpLease,
        Self::LedgerRow,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Container => "container",
            Self::Process => "process",
            Self::Vm => "vm",
            Self::Tap => "tap",
            Self::Chroot => "chroot",
            Self::Cgroup => "cgroup",
            Self::NftablesRule => "nftables-rule",
            Self::IpLease => "ip-lease",
            Self::LedgerRow => "ledger-row",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: ReloadResult,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScalerLabels {
    scaler: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CapLabels {
    cap: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    backend: &'static str,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentLabels {
    scaler: String,
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    backend: &'static str,
    phase: Phase,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BreakerLabels {
    scaler: String,
    label_set: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;
type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Seconds: 0.05 s .. ~1.8 h.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 2.0, 18))
}

/// States an agent is counted in (`gone` agents are not live).
const LIVE_STATES: [AgentState; 8] = [
    AgentState::Requested,
    AgentState::Provisioning,
    AgentState::Booted,
    AgentState::Registered,
    AgentState::Idle,
    AgentState::Busy,
    AgentState::Draining,
    AgentState::Destroying,
];

/// The daemon's metrics registry.
pub struct Metrics {
    registry: Registry,
    reloads: Family<ResultLabels, Counter>,
    cpus_used: Family<ScalerLabels, FloatGauge>,
    memory_used: Family<ScalerLabels, Gauge>,
    refusals: Family<CapLabels, Counter>,
    spawn_failures: Family<FailureLabels, Counter>,
    agents: Family<AgentLabels, Gauge>,
    warm_target: Family<ScalerLabels, Gauge>,
    pending: Family<ScalerLabels, Gauge>,
    pending_age: Histogram,
    provision: HistogramFamily<PhaseLabels>,
    breaker_open: Family<BreakerLabels, Gauge>,
    orphans: Family<KindLabels, Counter>,
    connections: Family<ListenerLabels, Gauge>,
    connection_limits: Family<ListenerLabels, Counter>,
    /// Seconds an agent spent in `requested`, until it boots (the provision
    /// phase spans requested + provisioning).
    requested_seconds: Mutex<HashMap<AgentId, f64>>,
    /// Scrapes recompute the gauges: one at a time, so none sees another's
    /// half-filled families.
    scrape: Mutex<()>,
}

impl Metrics {
    /// Registers every series, pre-created at 0 for `config`.
    pub fn new(config: &Config) -> Self {
        let mut registry = Registry::default();
        let m = Self {
            reloads: Family::default(),
            cpus_used: Family::default(),
            memory_used: Family::default(),
            refusals: Family::default(),
            spawn_failures: Family::default(),
            agents: Family::default(),
            warm_target: Family::default(),
            pending: Family::default(),
            pending_age: seconds_histogram(),
            provision: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
            breaker_open: Family::default(),
            orphans: Family::default(),
            connections: Family::default(),
            connection_limits: Family::default(),
            requested_seconds: Mutex::new(HashMap::new()),
            scrape: Mutex::new(()),
            registry: Registry::default(),
        };
        registry.register(
            "kici_orch_scaler_config_reloads",
            "Configuration reloads (SIGHUP or POST /v1/reload) by result: every attempt, then success or failed",
            m.reloads.clone(),
        );
        registry.register(
            "kici_orch_scaler_cpus_used",
            "CPUs (cores) reserved by live agents, per scaler",
            m.cpus_used.clone(),
        );
        registry.register(
            "kici_orch_scaler_memory_bytes_used",
            "Memory (bytes) reserved by live agents, per scaler",
            m.memory_used.clone(),
        );
        registry.register(
            "kici_orch_scaler_spawn_refusals",
            "Scale requests refused for now by a cap (kept pending), per cap",
            m.refusals.clone(),
        );
        registry.register(
            "kici_orch_scaler_spawn_failures",
            "Agents that failed to come up or ended early, per backend and failure reason",
            m.spawn_failures.clone(),
        );
        registry.register(
            "kici_orch_scaler_agents",
            "Live agents per scaler and lifecycle state",
            m.agents.clone(),
        );
        registry.register(
            "kici_orch_scaler_warm_target",
            "Idle warm agents each scaler keeps (pool size x label sets)",
            m.warm_target.clone(),
        );
        registry.register(
            "kici_orch_scaler_pending_requests",
            "Scale requests waiting for capacity, per scaler",
            m.pending.clone(),
        );
        registry.register(
            "kici_orch_scaler_pending_age_seconds",
            "How long scale requests waited in the pending queue before leaving it",
            m.pending_age.clone(),
        );
        registry.register(
            "kici_orch_scaler_provision_seconds",
            "Agent start-up time per backend: provision = requested to booted, registration = booted to registered",
            m.provision.clone(),
        );
        registry.register(
            "kici_orch_scaler_breaker_open",
            "1 while a label set's spawn circuit breaker is open, else 0",
            m.breaker_open.clone(),
        );
        registry.register(
            "kici_orch_scaler_orphans_reaped",
            "Resources the reconciler removed because no live agent owned them, per kind",
            m.orphans.clone(),
        );
        registry.register(
            "kici_orch_scaler_connections",
            "Connections being served, per listener (api, gateway)",
            m.connections.clone(),
        );
        registry.register(
            "kici_orch_scaler_connection_limit_reached",
            "Times a listener reached its connection cap (new connections then wait in the backlog until one ends), per listener",
            m.connection_limits.clone(),
        );
        for name in ListenerName::ALL {
            let labels = ListenerLabels {
                listener: name.as_str(),
            };
            let _ = m.connections.get_or_create(&labels);
            let _ = m.connection_limits.get_or_create(&labels);
        }
        for result in [
            ReloadResult::attempted,
            ReloadResult::success,
            ReloadResult::failed,
        ] {
            let _ = m.reloads.get_or_create(&ResultLabels { result });
        }
        for cap in Cap::ALL {
            let _ = m.refusals.get_or_create(&CapLabels { cap: cap.as_str() });
        }
        for backend in ScalerType::ALL {
            for reason in FailureReason::ALL {
                let _ = m.spawn_failures.get_or_create(&FailureLabels {
                    backend: backend.as_str(),
                    reason: reason.as_str(),
                });
            }
            for phase in [Phase::provision, Phase::registration] {
                let _ = m.provision.get_or_create(&PhaseLabels {
                    backend: backend.as_str(),
                    phase,
                });
            }
        }
        for kind in OrphanKind::ALL {
            let _ = m.orphans.get_or_create(&KindLabels {
                kind: kind.as_str(),
            });
        }
        m.precreate_gauges(config);
        Self { registry, ..m }
    }

    /// Every per-scaler gauge at 0 for the scalers of `config`.
    fn precreate_gauges(&self, config: &Config) {
        for s in &config.scalers {
            let scaler = ScalerLabels {
                scaler: s.name.to_string(),
            };
            let _ = self.cpus_used.get_or_create(&scaler);
            let _ = self.memory_used.get_or_create(&scaler);
            let _ = self.warm_target.get_or_create(&scaler);
            let _ = self.pending.get_or_create(&scaler);
            for state in LIVE_STATES {
                let _ = self.agents.get_or_create(&AgentLabels {
                    scaler: s.name.to_string(),
                    state: state.as_str(),
                });
            }
            for index in 0..s.label_sets.len() {
                let _ = self.breaker_open.get_or_create(&BreakerLabels {
                    scaler: s.name.to_string(),
                    label_set: index.to_string(),
                });
            }
        }
    }

    pub fn reload_attempted(&self) {
        self.count_reload(ReloadResult::attempted);
    }

    pub fn reload_succeeded(&self) {
        self.count_reload(ReloadResult::success);
    }

    pub fn reload_failed(&self) {
        self.count_reload(ReloadResult::failed);
    }

    fn count_reload(&self, result: ReloadResult) {
        self.reloads.get_or_create(&ResultLabels { result }).inc();
    }

    /// The series a listener reports its connections to.
    pub fn listener(&self, name: ListenerName) -> ListenerMetrics {
        let labels = ListenerLabels {
            listener: name.as_str(),
        };
        ListenerMetrics {
            open: self.connections.get_or_create(&labels).clone(),
            limit_reached: self.connection_limits.get_or_create(&labels).clone(),
        }
    }

    /// For the reconciler.
    pub fn orphan_reaped(&self, kind: OrphanKind) {
        self.orphans
            .get_or_create(&KindLabels {
                kind: kind.as_str(),
            })
            .inc();
    }

    /// Counts what one engine event says.
    pub fn observe(&self, event: &SequencedEvent) {
        match &event.event {
            EngineEvent::AgentTransition {
                agent_id,
                backend,
                from,
                to,
                failure_reason,
                seconds_in_state,
                ..
            } => {
                if let Some(reason) = failure_reason {
                    self.spawn_failures
                        .get_or_create(&FailureLabels {
                            backend: backend.as_str(),
                            reason: reason.as_str(),
                        })
                        .inc();
                }
                self.observe_phases(*agent_id, *backend, *from, *to, *seconds_in_state);
            }
            EngineEvent::Refused { cap, .. } => {
                self.refusals
                    .get_or_create(&CapLabels { cap: cap.as_str() })
                    .inc();
            }
            EngineEvent::PendingEnded { waited_seconds, .. } => {
                self.pending_age.observe(*waited_seconds);
            }
            EngineEvent::BreakerChanged { .. }
            | EngineEvent::ScalerCordon { .. }
            | EngineEvent::Reloaded { .. } => {}
        }
    }

    fn observe_phases(
        &self,
        agent: AgentId,
        backend: ScalerType,
        from: AgentState,
        to: AgentState,
        seconds: f64,
    ) {
        let observe = |phase, v: f64| {
            self.provision
                .get_or_create(&PhaseLabels {
                    backend: backend.as_str(),
                    phase,
                })
                .observe(v);
        };
        match (from, to) {
            (AgentState::Requested, AgentState::Provisioning) => {
                self.requested_seconds.lock().insert(agent, seconds);
            }
            (AgentState::Provisioning, AgentState::Booted) => {
                let before = self.requested_seconds.lock().remove(&agent).unwrap_or(0.0);
                observe(Phase::provision, before + seconds);
            }
            (AgentState::Booted, AgentState::Registered) => {
                observe(Phase::registration, seconds);
            }
            (_, AgentState::Gone) | (_, AgentState::Destroying) => {
                self.requested_seconds.lock().remove(&agent);
            }
            _ => {}
        }
    }

    /// Recomputes the gauges from a snapshot and encodes every series.
    pub fn scrape(&self, config: &Config, status: &Status, agents: &[AgentView]) -> String {
        let _one = self.scrape.lock();
        self.refresh(config, status, agents);
        self.encode()
    }

    /// Recomputes every gauge from a snapshot. Scalers a reload removed
    /// disappear once they have no agent left.
    fn refresh(&self, config: &Config, status: &Status, agents: &[AgentView]) {
        for family in [&self.memory_used, &self.warm_target, &self.pending] {
            family.clear();
        }
        self.cpus_used.clear();
        self.agents.clear();
        self.breaker_open.clear();
        self.precreate_gauges(config);
        for s in &status.scalers {
            let scaler = ScalerLabels {
                scaler: s.name.to_string(),
            };
            if let Some(usage) = &s.usage {
                self.cpus_used
                    .get_or_create(&scaler)
                    .set(usage.cpu.as_cores());
                self.memory_used
                    .get_or_create(&scaler)
                    .set(i64::try_from(usage.memory.bytes()).unwrap_or(i64::MAX));
            }
            self.warm_target
                .get_or_create(&scaler)
                .set(i64::from(s.warm_target));
            self.pending
                .get_or_create(&scaler)
                .set(i64::try_from(s.pending).unwrap_or(i64::MAX));
            for ls in &s.label_sets {
                let open = i64::from(ls.breaker == BreakerState::Open);
                self.breaker_open
                    .get_or_create(&BreakerLabels {
                        scaler: s.name.to_string(),
                        label_set: ls.index.to_string(),
                    })
                    .set(open);
            }
        }
        for a in agents.iter().filter(|a| a.state != AgentState::Gone) {
            self.agents
                .get_or_create(&AgentLabels {
                    scaler: a.scaler.to_string(),
                    state: a.state.as_str(),
                })
                .inc();
        }
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const YAML: &str = "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 2\n    labelSets:\n      - labels: [linux]\n        binaryPath: /bin/true\n";

    #[test]
    fn every_series_is_exposed_at_zero_from_the_start() {
        let config = kici_config::load_documents(&[("scalers.yaml", YAML)])
            .unwrap()
            .config;
        let text = Metrics::new(&config).encode();
        for name in SERIES {
            assert!(
                text.lines().any(|l| l.starts_with(name)),
                "{name} missing:\n{text}"
            );
        }
        assert!(text.contains("kici_orch_scaler_agents{scaler=\"local\",state=\"busy\"} 0"));
        assert!(text.contains("kici_orch_scaler_spawn_refusals_total{cap=\"pool-memory\"} 0"));
        assert!(text.contains("kici_orch_scaler_breaker_open{scaler=\"local\",label_set=\"0\"} 0"));
        assert!(text.contains("kici_orch_scaler_config_reloads_total{result=\"attempted\"} 0"));
    }
}
