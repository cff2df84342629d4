//! Prometheus metrics (`GET /metrics`), all under `kici_orch_scaler_*`.
//!
//! Counters and histograms are driven by the engine's event stream
//! ([`Metrics::observe`]); gauges are recomputed from a status snapshot at
//! every scrape (`Metrics::refresh`), so they can never drift from the
//! engine. Every series exists from start-up at 0: labelled series are
//! pre-created for every label combination the configuration and the enums
//! allow (scalers × states, backends × failure reasons, caps, ...).

use crate::daemon::serving::{ListenerMetrics, ListenerName};
use kici_admission::Cap;
use kici_engine::runtime::SequencedEvent;
use kici_engine::{
    AgentState, AgentView, BreakerState, EngineEvent, FailureReason, PendingEnd, Status, StopCause,
    TransitionCause,
};
use kici_model::{Config, ScalerName, ScalerType};
use parking_lot::Mutex;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
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
    "kici_orch_scaler_warm_period",
    "kici_orch_scaler_pending_requests",
    "kici_orch_scaler_pending_age_seconds",
    "kici_orch_scaler_pending_oldest_seconds",
    "kici_orch_scaler_spawns_in_flight",
    "kici_orch_scaler_spawns_waiting",
    "kici_orch_scaler_provision_seconds",
    "kici_orch_scaler_breaker_open",
    "kici_orch_scaler_orphans_reaped_total",
    "kici_orch_scaler_connections",
    "kici_orch_scaler_connection_limit_reached_total",
    // warm_pool_target, _ready and _in_flight exist per label set of a
    // scaler with a warm pool only (upstream's rows), so not from the start.
    "kici_orch_scaler_warm_pool_spawns_total",
    "kici_orch_scaler_warm_pool_reaped_total",
    "kici_orch_scaler_redispatch_total",
    // The fleet's families are 0 on a host serving alone.
    "kici_orch_scaler_fleet_hosts",
    "kici_orch_scaler_fleet_claims_total",
    "kici_orch_scaler_fleet_failovers_total",
    "kici_orch_scaler_fleet_leader",
    "kici_orch_scaler_agent_messages_ignored_total",
    // External provisioning (`type: event` scalers), upstream's names.
    "kici_orch_scaler_scale_up_emitted_total",
    "kici_orch_scaler_scale_down_emitted_total",
    "kici_orch_scaler_external_provisioning_active",
    "kici_orch_scaler_external_provision_timeout_total",
];

/// `fleet_claims_total{result}`: what became of a claim this host made.
pub const FLEET_CLAIM_RESULTS: [&str; 4] = ["started", "released", "refused", "error"];
/// `fleet_hosts{state}`.
pub const FLEET_HOST_STATES: [&str; 3] = ["up", "leaving", "lost"];

/// `config_reloads_total{result}`.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ReloadResult {
    attempted,
    success,
    failed,
}

/// `provision_seconds{phase}`: `provision` = provisioning → booted (an
/// event agent: provisioning → registered), `registration` = booted →
/// registered.
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

/// Upstream KiCI's usage labels, spelled as its dashboards query them.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
#[allow(non_snake_case)]
struct UsageLabels {
    /// A scaler's name, or [`GLOBAL`] for the daemon-wide total.
    scaler: String,
    /// The scaler's backend type, or [`GLOBAL`] on the total.
    scalerType: &'static str,
}

/// Upstream KiCI's warm-pool labels: one series per scaler label set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
#[allow(non_snake_case)]
struct WarmPoolLabels {
    scaler: String,
    /// The label set's canonical key (`linux,x64`).
    labelSet: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FleetResultLabels {
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FleetStateLabels {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TriggerLabels {
    trigger: &'static str,
}

/// `agent_messages_ignored_total{type}`: one of a fixed list of names, so
/// an agent cannot grow the series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MessageTypeLabels {
    r#type: &'static str,
}

/// The `scaler` and `scalerType` of the daemon-wide usage row.
const GLOBAL: &str = "__global__";

/// `redispatch_total{trigger}`: upstream re-offers waiting requests when
/// capacity frees (`hook`) and from a periodic backstop (`sweep`). Every
/// release here re-runs admission over the waiting queue, so every
/// re-offer is a `hook`; `sweep` stays 0 (kept for upstream's dashboards).
const REDISPATCH_TRIGGERS: [&str; 2] = ["hook", "sweep"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CapLabels {
    cap: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
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
    cpus_used: Family<UsageLabels, FloatGauge>,
    memory_used: Family<UsageLabels, Gauge>,
    refusals: Family<CapLabels, Counter>,
    spawn_failures: Family<FailureLabels, Counter>,
    agents: Family<AgentLabels, Gauge>,
    warm_target: Family<ScalerLabels, Gauge>,
    warm_period: Family<ScalerLabels, Gauge>,
    pending: Family<ScalerLabels, Gauge>,
    pending_age: Histogram,
    pending_oldest: Family<ScalerLabels, FloatGauge>,
    spawns_in_flight: Family<ScalerLabels, Gauge>,
    spawns_waiting: Family<ScalerLabels, Gauge>,
    provision: HistogramFamily<PhaseLabels>,
    breaker_open: Family<BreakerLabels, Gauge>,
    orphans: Family<KindLabels, Counter>,
    connections: Family<ListenerLabels, Gauge>,
    connection_limits: Family<ListenerLabels, Counter>,
    warm_pool_target: Family<WarmPoolLabels, Gauge>,
    warm_pool_ready: Family<WarmPoolLabels, Gauge>,
    warm_pool_in_flight: Family<WarmPoolLabels, Gauge>,
    warm_pool_spawns: Family<ScalerLabels, Counter>,
    warm_pool_reaped: Family<ScalerLabels, Counter>,
    redispatch: Family<TriggerLabels, Counter>,
    fleet_hosts: Family<FleetStateLabels, Gauge>,
    fleet_queue_depth: Family<PoolLabels, Gauge>,
    fleet_claims: Family<FleetResultLabels, Counter>,
    fleet_failovers: Counter,
    fleet_leader: Gauge,
    agent_messages_ignored: Family<MessageTypeLabels, Counter>,
    scale_up_emitted: Counter,
    scale_down_emitted: Family<ReasonLabels, Counter>,
    external_provisioning: Gauge,
    external_timeouts: Counter,
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
            warm_period: Family::default(),
            pending: Family::default(),
            pending_age: seconds_histogram(),
            pending_oldest: Family::default(),
            spawns_in_flight: Family::default(),
            spawns_waiting: Family::default(),
            provision: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
            breaker_open: Family::default(),
            orphans: Family::default(),
            connections: Family::default(),
            connection_limits: Family::default(),
            warm_pool_target: Family::default(),
            warm_pool_ready: Family::default(),
            warm_pool_in_flight: Family::default(),
            warm_pool_spawns: Family::default(),
            warm_pool_reaped: Family::default(),
            redispatch: Family::default(),
            fleet_hosts: Family::default(),
            fleet_queue_depth: Family::default(),
            fleet_claims: Family::default(),
            fleet_failovers: Counter::default(),
            fleet_leader: Gauge::default(),
            agent_messages_ignored: Family::default(),
            scale_up_emitted: Counter::default(),
            scale_down_emitted: Family::default(),
            external_provisioning: Gauge::default(),
            external_timeouts: Counter::default(),
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
            "CPUs (cores) reserved by live agents, per scaler; scaler=\"__global__\" is the daemon-wide total",
            m.cpus_used.clone(),
        );
        registry.register(
            "kici_orch_scaler_memory_bytes_used",
            "Memory (bytes) reserved by live agents, per scaler; scaler=\"__global__\" is the daemon-wide total",
            m.memory_used.clone(),
        );
        registry.register(
            "kici_orch_scaler_scale_up_emitted",
            "Scale-up events emitted by type: event scalers (a redelivery after a restart counts again)",
            m.scale_up_emitted.clone(),
        );
        registry.register(
            "kici_orch_scaler_scale_down_emitted",
            "Scale-down events emitted by type: event scalers, per reason",
            m.scale_down_emitted.clone(),
        );
        for reason in kici_provision::ScaleDownReason::NAMED {
            let _ = m.scale_down_emitted.get_or_create(&ReasonLabels {
                reason: reason.as_str().to_owned(),
            });
        }
        registry.register(
            "kici_orch_scaler_external_provisioning_active",
            "Agents of type: event scalers between their scale-up and their registration",
            m.external_provisioning.clone(),
        );
        registry.register(
            "kici_orch_scaler_external_provision_timeout",
            "Agents of type: event scalers torn down because they never registered in time",
            m.external_timeouts.clone(),
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
            "kici_orch_scaler_warm_period",
            "Index of the x-kici-scaler.warmPool.schedule period in force per scaler (-1: none)",
            m.warm_period.clone(),
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
            "kici_orch_scaler_pending_oldest_seconds",
            "How long the oldest scale request still waiting has waited, per scaler (0: none waits)",
            m.pending_oldest.clone(),
        );
        registry.register(
            "kici_orch_scaler_spawns_in_flight",
            "Backend spawns running now, per scaler (at most its maxConcurrentSpawns)",
            m.spawns_in_flight.clone(),
        );
        registry.register(
            "kici_orch_scaler_spawns_waiting",
            "Admitted agents waiting for a spawn slot of their scaler (maxConcurrentSpawns), per scaler",
            m.spawns_waiting.clone(),
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
        registry.register(
            "kici_orch_scaler_warm_pool_target",
            "Agents a warm pool keeps ready for a label set (warmPool.size)",
            m.warm_pool_target.clone(),
        );
        registry.register(
            "kici_orch_scaler_warm_pool_ready",
            "Warm agents registered and idle, able to take a job of the label set now",
            m.warm_pool_ready.clone(),
        );
        registry.register(
            "kici_orch_scaler_warm_pool_in_flight",
            "Warm-pool spawns started but not yet registered (a deficit they cover is filling, not failing)",
            m.warm_pool_in_flight.clone(),
        );
        registry.register(
            "kici_orch_scaler_warm_pool_spawns",
            "Warm-pool spawns started, per scaler",
            m.warm_pool_spawns.clone(),
        );
        registry.register(
            "kici_orch_scaler_warm_pool_reaped",
            "Warm agents destroyed as surplus (idle past their timeout, or above a lowered target), per scaler",
            m.warm_pool_reaped.clone(),
        );
        registry.register(
            "kici_orch_scaler_redispatch",
            "Waiting scale requests admitted once capacity freed, per trigger (hook: a release; sweep: never here)",
            m.redispatch.clone(),
        );
        registry.register(
            "kici_orch_scaler_agent_messages_ignored",
            "Messages of KiCI's agent protocol that the gateway accepts and does not use (agent.status, agent.log, job.heartbeat, ...), per type",
            m.agent_messages_ignored.clone(),
        );
        for kind in kici_protocol::IGNORED_AGENT_MESSAGES {
            let _ = m
                .agent_messages_ignored
                .get_or_create(&MessageTypeLabels { r#type: kind });
        }
        for trigger in REDISPATCH_TRIGGERS {
            let _ = m.redispatch.get_or_create(&TriggerLabels { trigger });
        }
        registry.register(
            "kici_orch_scaler_fleet_hosts",
            "Hosts of this host's fleet per state (up, leaving, lost), as last read from the database; 0 outside a fleet",
            m.fleet_hosts.clone(),
        );
        registry.register(
            "kici_orch_scaler_fleet_queue_depth",
            "Requests queued in the fleet per pool (scaler name), as last read from the database",
            m.fleet_queue_depth.clone(),
        );
        registry.register(
            "kici_orch_scaler_fleet_claims",
            "Fleet requests this host claimed, by what became of them: started (an agent bound), released (local capacity busy, given back), refused (can never fit here), error",
            m.fleet_claims.clone(),
        );
        registry.register(
            "kici_orch_scaler_fleet_failovers",
            "Hosts this host, as the fleet's leader, declared lost (their unstarted work returned to the queue)",
            m.fleet_failovers.clone(),
        );
        registry.register(
            "kici_orch_scaler_fleet_leader",
            "1 while this host is the fleet's leader, else 0",
            m.fleet_leader.clone(),
        );
        for state in FLEET_HOST_STATES {
            let _ = m.fleet_hosts.get_or_create(&FleetStateLabels { state });
        }
        for result in FLEET_CLAIM_RESULTS {
            let _ = m.fleet_claims.get_or_create(&FleetResultLabels { result });
        }
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
        let global = UsageLabels {
            scaler: GLOBAL.to_owned(),
            scalerType: GLOBAL,
        };
        let _ = self.cpus_used.get_or_create(&global);
        let _ = self.memory_used.get_or_create(&global);
        for s in &config.scalers {
            let scaler = ScalerLabels {
                scaler: s.name.to_string(),
            };
            let usage = UsageLabels {
                scaler: s.name.to_string(),
                scalerType: s.kind.as_str(),
            };
            let _ = self.cpus_used.get_or_create(&usage);
            let _ = self.memory_used.get_or_create(&usage);
            let _ = self.warm_pool_spawns.get_or_create(&scaler);
            let _ = self.warm_pool_reaped.get_or_create(&scaler);
            if let Some(pool) = s.warm_pool.as_ref().filter(|p| p.enabled) {
                for ls in &s.label_sets {
                    let labels = WarmPoolLabels {
                        scaler: s.name.to_string(),
                        labelSet: ls.labels.key(),
                    };
                    self.warm_pool_target
                        .get_or_create(&labels)
                        .set(i64::from(pool.size));
                    let _ = self.warm_pool_ready.get_or_create(&labels);
                    let _ = self.warm_pool_in_flight.get_or_create(&labels);
                }
            }
            let _ = self.warm_target.get_or_create(&scaler);
            self.warm_period.get_or_create(&scaler).set(-1);
            let _ = self.pending.get_or_create(&scaler);
            let _ = self.pending_oldest.get_or_create(&scaler);
            let _ = self.spawns_in_flight.get_or_create(&scaler);
            let _ = self.spawns_waiting.get_or_create(&scaler);
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

    /// The gateway accepted and ignored a message of `kind` (one of
    /// [`kici_protocol::IGNORED_AGENT_MESSAGES`]).
    pub fn agent_message_ignored(&self, kind: &'static str) {
        self.agent_messages_ignored
            .get_or_create(&MessageTypeLabels { r#type: kind })
            .inc();
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
                scaler,
                backend,
                from,
                to,
                job_id,
                failure_reason,
                cause,
                seconds_in_state,
                ..
            } => {
                self.observe_warm_pool(scaler, *from, *to, job_id.is_none(), *cause);
                if *backend == kici_model::ScalerType::Event {
                    self.observe_external(*from, *to, *failure_reason);
                }
                if let Some(reason) = failure_reason {
                    self.spawn_failures
                        .get_or_create(&FailureLabels {
                            backend: backend.as_str(),
                            reason: reason.as_str(),
                        })
                        .inc();
                }
                self.observe_phases(*backend, *from, *to, *seconds_in_state);
            }
            EngineEvent::Refused { cap, .. } => {
                self.refusals
                    .get_or_create(&CapLabels { cap: cap.as_str() })
                    .inc();
            }
            EngineEvent::PendingEnded {
                waited_seconds,
                end,
                ..
            } => {
                self.pending_age.observe(*waited_seconds);
                if *end == PendingEnd::Admitted {
                    self.redispatch
                        .get_or_create(&TriggerLabels { trigger: "hook" })
                        .inc();
                }
            }
            EngineEvent::Provision(kici_engine::ProvisionNotice::ScaleUp { .. }) => {
                self.scale_up_emitted.inc();
            }
            EngineEvent::Provision(kici_engine::ProvisionNotice::ScaleDown { reason, .. }) => {
                self.scale_down_emitted
                    .get_or_create(&ReasonLabels {
                        reason: reason.clone(),
                    })
                    .inc();
            }
            EngineEvent::BreakerChanged { .. }
            | EngineEvent::ScalerCordon { .. }
            | EngineEvent::Reloaded { .. } => {}
        }
    }

    /// An event scaler's agent is "provisioning" externally from its
    /// request until it registers (or fails); a registration deadline
    /// passing is an external provision timeout.
    fn observe_external(&self, from: AgentState, to: AgentState, failure: Option<FailureReason>) {
        // An agent is created `requested` without an event: its way into
        // `provisioning` (the scale-up) is where it starts counting, and
        // leaving the spawning states from there is where it stops.
        if from == AgentState::Requested && to == AgentState::Provisioning {
            self.external_provisioning.inc();
        } else if from.is_spawning() && from != AgentState::Requested && !to.is_spawning() {
            self.external_provisioning.dec();
        }
        if matches!(
            failure,
            Some(FailureReason::RegistrationTimeout | FailureReason::ProvisionTimeout)
        ) {
            self.external_timeouts.inc();
        }
    }

    /// Warm-pool spawns and reaps, as upstream counts them: an agent
    /// spawned for no job is a warm spawn; an idle agent with no job that
    /// leaves because it idled out or the pool shrank is reaped surplus.
    fn observe_warm_pool(
        &self,
        scaler: &ScalerName,
        from: AgentState,
        to: AgentState,
        jobless: bool,
        cause: Option<TransitionCause>,
    ) {
        let labels = || ScalerLabels {
            scaler: scaler.to_string(),
        };
        match (from, to) {
            (AgentState::Requested, AgentState::Provisioning) if jobless => {
                self.warm_pool_spawns.get_or_create(&labels()).inc();
            }
            (AgentState::Idle, AgentState::Draining | AgentState::Destroying)
                if jobless
                    && matches!(
                        cause,
                        Some(TransitionCause::Stop(
                            StopCause::IdleExpired | StopCause::ScaleIn
                        ))
                    ) =>
            {
                self.warm_pool_reaped.get_or_create(&labels()).inc();
            }
            _ => {}
        }
    }

    fn observe_phases(&self, backend: ScalerType, from: AgentState, to: AgentState, seconds: f64) {
        let observe = |phase, v: f64| {
            self.provision
                .get_or_create(&PhaseLabels {
                    backend: backend.as_str(),
                    phase,
                })
                .observe(v);
        };
        // The provision phase is the backend's spawn alone: the time an
        // agent waited in `requested` for a spawn slot (maxConcurrentSpawns)
        // is not start-up time, and `spawns_waiting` shows it.
        match (from, to) {
            // An event agent has no `booted`: its provisioner's whole work
            // ends when the agent registers.
            (AgentState::Provisioning, AgentState::Booted | AgentState::Registered) => {
                observe(Phase::provision, seconds);
            }
            (AgentState::Booted, AgentState::Registered) => {
                observe(Phase::registration, seconds);
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
        self.pending_oldest.clear();
        for family in [
            &self.warm_target,
            &self.pending,
            &self.spawns_in_flight,
            &self.spawns_waiting,
        ] {
            family.clear();
        }
        for family in [
            &self.warm_pool_target,
            &self.warm_pool_ready,
            &self.warm_pool_in_flight,
        ] {
            family.clear();
        }
        self.memory_used.clear();
        self.cpus_used.clear();
        self.agents.clear();
        self.breaker_open.clear();
        self.precreate_gauges(config);
        for s in &status.scalers {
            let scaler = ScalerLabels {
                scaler: s.name.to_string(),
            };
            if let Some(usage) = &s.usage {
                let labels = UsageLabels {
                    scaler: s.name.to_string(),
                    scalerType: s.backend.as_str(),
                };
                self.cpus_used
                    .get_or_create(&labels)
                    .set(usage.cpu.as_cores());
                self.memory_used
                    .get_or_create(&labels)
                    .set(i64::try_from(usage.memory.bytes()).unwrap_or(i64::MAX));
            }
            self.warm_target
                .get_or_create(&scaler)
                .set(i64::from(s.warm_target));
            let period = match &s.warm_source {
                kici_engine::WarmSource::Period { index, .. } => {
                    i64::try_from(*index).unwrap_or(i64::MAX)
                }
                _ => -1,
            };
            self.warm_period.get_or_create(&scaler).set(period);
            self.pending
                .get_or_create(&scaler)
                .set(i64::try_from(s.pending).unwrap_or(i64::MAX));
            self.pending_oldest
                .get_or_create(&scaler)
                .set(s.oldest_pending.map_or(0.0, |d| d.as_secs_f64()));
            self.spawns_in_flight
                .get_or_create(&scaler)
                .set(i64::try_from(s.spawns_in_flight).unwrap_or(i64::MAX));
            self.spawns_waiting
                .get_or_create(&scaler)
                .set(i64::try_from(s.spawns_waiting).unwrap_or(i64::MAX));
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
        let global = UsageLabels {
            scaler: GLOBAL.to_owned(),
            scalerType: GLOBAL,
        };
        self.cpus_used
            .get_or_create(&global)
            .set(status.global.cpu.as_cores());
        self.memory_used
            .get_or_create(&global)
            .set(i64::try_from(status.global.memory.bytes()).unwrap_or(i64::MAX));
        for a in agents.iter().filter(|a| a.warm) {
            let family = match a.state {
                AgentState::Idle => &self.warm_pool_ready,
                AgentState::Requested
                | AgentState::Provisioning
                | AgentState::Booted
                | AgentState::Registered => &self.warm_pool_in_flight,
                _ => continue,
            };
            let Some(ls) = config
                .scalers
                .iter()
                .find(|s| s.name == a.scaler)
                .and_then(|s| s.label_sets.get(a.label_set_index))
            else {
                continue;
            };
            family
                .get_or_create(&WarmPoolLabels {
                    scaler: a.scaler.to_string(),
                    labelSet: ls.labels.key(),
                })
                .inc();
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
    /// One claim's result (one of [`FLEET_CLAIM_RESULTS`]).
    pub fn fleet_claim(&self, result: &'static str) {
        self.fleet_claims
            .get_or_create(&FleetResultLabels { result })
            .inc();
    }

    /// Hosts this leader declared lost.
    pub fn fleet_failovers(&self, n: usize) {
        self.fleet_failovers.inc_by(n as u64);
    }

    pub fn set_fleet_leader(&self, leading: bool) {
        self.fleet_leader.set(i64::from(leading));
    }

    /// The fleet's hosts per state and queue depth per pool, as just read.
    pub fn set_fleet_view(&self, hosts: &[(&'static str, i64)], depths: &[(String, i64)]) {
        for (state, n) in hosts {
            self.fleet_hosts
                .get_or_create(&FleetStateLabels { state })
                .set(*n);
        }
        self.fleet_queue_depth.clear();
        for (pool, n) in depths {
            self.fleet_queue_depth
                .get_or_create(&PoolLabels { pool: pool.clone() })
                .set(*n);
        }
    }

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

    fn transition(
        from: AgentState,
        to: AgentState,
        job: Option<&str>,
        cause: Option<StopCause>,
    ) -> SequencedEvent {
        SequencedEvent {
            id: 1,
            at: std::time::SystemTime::now(),
            event: EngineEvent::AgentTransition {
                agent_id: "scaler-container-0000beef".parse().unwrap(),
                scaler: ScalerName::new("pool"),
                backend: ScalerType::Container,
                from,
                to,
                job_id: job.map(|j| j.parse().unwrap()),
                failure_reason: None,
                cause: cause.map(TransitionCause::Stop),
                detail: None,
                seconds_in_state: 1.0,
            },
        }
    }

    #[test]
    fn upstream_families_have_upstreams_labels_and_count_what_upstream_counts() {
        let yaml = "version: 1\nscalers:\n  - name: pool\n    type: container\n    maxAgents: 4\n    warmPool: { enabled: true, size: 2 }\n    labelSets:\n      - labels: [linux, x64]\n        image: kici/agent:1\n      - labels: [gpu]\n        image: kici/agent:1\n";
        let config = kici_config::load_documents(&[("scalers.yaml", yaml)])
            .unwrap()
            .config;
        let m = Metrics::new(&config);
        let text = m.encode();
        for line in [
            "kici_orch_scaler_cpus_used{scaler=\"__global__\",scalerType=\"__global__\"} 0.0",
            "kici_orch_scaler_cpus_used{scaler=\"pool\",scalerType=\"container\"} 0.0",
            "kici_orch_scaler_memory_bytes_used{scaler=\"__global__\",scalerType=\"__global__\"} 0",
            "kici_orch_scaler_warm_pool_target{scaler=\"pool\",labelSet=\"linux,x64\"} 2",
            "kici_orch_scaler_warm_pool_target{scaler=\"pool\",labelSet=\"gpu\"} 2",
            "kici_orch_scaler_warm_pool_ready{scaler=\"pool\",labelSet=\"gpu\"} 0",
            "kici_orch_scaler_warm_pool_in_flight{scaler=\"pool\",labelSet=\"gpu\"} 0",
            "kici_orch_scaler_redispatch_total{trigger=\"hook\"} 0",
            "kici_orch_scaler_redispatch_total{trigger=\"sweep\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }

        use AgentState::*;
        // A spawn for no job is a warm spawn; one for a job is not.
        m.observe(&transition(Requested, Provisioning, None, None));
        m.observe(&transition(Requested, Provisioning, Some("job-1"), None));
        // An idle jobless agent idling out or scaled in is reaped surplus;
        // one stopped by shutdown or an operator is not.
        m.observe(&transition(
            Idle,
            Draining,
            None,
            Some(StopCause::IdleExpired),
        ));
        m.observe(&transition(
            Idle,
            Destroying,
            None,
            Some(StopCause::ScaleIn),
        ));
        m.observe(&transition(Idle, Draining, None, Some(StopCause::Shutdown)));
        m.observe(&transition(Idle, Draining, None, Some(StopCause::Operator)));
        for end in [
            PendingEnd::Admitted,
            PendingEnd::Expired,
            PendingEnd::Admitted,
        ] {
            m.observe(&SequencedEvent {
                id: 2,
                at: std::time::SystemTime::now(),
                event: EngineEvent::PendingEnded {
                    job_id: "job-2".parse().unwrap(),
                    scaler: ScalerName::new("pool"),
                    end,
                    waited_seconds: 0.5,
                },
            });
        }
        // The fill gauges come from the live agents at each scrape: idle warm
        // agents are ready, warm ones not yet registered are in flight, and an
        // agent taken by a job (no longer warm) is neither.
        let agent = |n: u32, state: AgentState, warm: bool, set: usize| AgentView {
            agent_id: format!("scaler-container-{n:08x}").parse().unwrap(),
            state,
            scaler: ScalerName::new("pool"),
            backend: ScalerType::Container,
            label_set_index: set,
            job_id: None,
            resources: kici_model::Resources::default(),
            warm,
            mode: kici_engine::Mode::Orchestrator,
            failure_reason: None,
            exit_code: None,
            age_seconds: 0.0,
            state_seconds: 0.0,
        };
        let agents = [
            agent(1, Idle, true, 0),
            agent(2, Idle, true, 0),
            agent(3, Booted, true, 0),
            agent(4, Provisioning, true, 1),
            agent(5, Busy, false, 1),
        ];
        let status = Status {
            global: kici_admission::ScopeUsage {
                agents: 5,
                cpu: Default::default(),
                memory: Default::default(),
                caps: Default::default(),
                configured: true,
            },
            global_max_agents: 10,
            pending: 0,
            oldest_pending: None,
            scalers: Vec::new(),
        };
        let text = m.scrape(&config, &status, &agents);
        for line in [
            "kici_orch_scaler_warm_pool_ready{scaler=\"pool\",labelSet=\"linux,x64\"} 2",
            "kici_orch_scaler_warm_pool_in_flight{scaler=\"pool\",labelSet=\"linux,x64\"} 1",
            "kici_orch_scaler_warm_pool_ready{scaler=\"pool\",labelSet=\"gpu\"} 0",
            "kici_orch_scaler_warm_pool_in_flight{scaler=\"pool\",labelSet=\"gpu\"} 1",
            "kici_orch_scaler_warm_pool_spawns_total{scaler=\"pool\"} 1",
            "kici_orch_scaler_warm_pool_reaped_total{scaler=\"pool\"} 2",
            "kici_orch_scaler_redispatch_total{trigger=\"hook\"} 2",
            "kici_orch_scaler_redispatch_total{trigger=\"sweep\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
    }
}
