//! The admission critical section and the [`Reservation`] guard.
//!
//! One mutex guards every in-process counter. [`Admission::try_reserve`]
//! checks every cap and records the reservation inside that one critical
//! section — the machine-pool ledger write included — so no concurrent
//! request can slip between a check and its reservation, and a refusal or
//! an error leaves nothing behind (upstream KiCI did neither; see
//! docs/deviations.md, D-atomic-admission). Count caps count
//! live [`Reservation`]s: an agent counts from admission until its guard
//! drops, whatever the backend does meanwhile.

use crate::cap::{Cap, Caps, Refusal, TooLarge};
use crate::holds::{Held, Holds};
use crate::ledger::{LedgerError, MachineLedger, PoolCap, ReserveOutcome};
use crate::signal::{ReleaseSignal, SignalShared};
use crate::sync::{lock, Arc, Mutex};
use kici_model::{AgentId, Config, MemoryBytes, MilliCpu, Resources, ScalerName};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

/// What one agent needs: the scaler it belongs to, its effective
/// `requests`, and the scaler's machine pool (from the same configuration
/// snapshot the request was routed with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    pub agent: AgentId,
    pub scaler: ScalerName,
    pub requests: Resources,
    pub pool: Option<String>,
}

/// Why [`Admission::try_reserve`] (or [`Admission::adopt`]) did not reserve.
/// Whatever the variant, nothing was reserved.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    /// Not now: wait for a release.
    #[error("refused: {0}")]
    Refused(Refusal),
    /// Never: the request alone exceeds a cap's total.
    #[error("too large: {0}")]
    TooLarge(TooLarge),
    #[error("machine-pool ledger: {0}")]
    Ledger(#[from] LedgerError),
    /// Removed by a reload since the request was routed: route again.
    #[error("scaler {0} is not in the current configuration")]
    UnknownScaler(ScalerName),
    /// The demand's pool is not the scaler's pool in the current
    /// configuration: the demand was built from another snapshot.
    #[error("the demand for scaler {scaler} names machine pool {demand:?} but the current configuration says {configured:?}")]
    PoolMismatch {
        scaler: ScalerName,
        demand: Option<String>,
        configured: Option<String>,
    },
    /// The agent id already holds a reservation (ids have 32 random bits:
    /// the engine draws another one).
    #[error("agent {0} already holds a reservation")]
    DuplicateAgent(AgentId),
}

/// Why [`Admission::new`] or [`Admission::reconfigure`] failed; on a
/// reconfigure, nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("scaler {scaler} names machine pool {pool:?}, which machinePools does not define")]
    UnknownPool { scaler: ScalerName, pool: String },
    #[error("machine-pool ledger: {0}")]
    Ledger(#[from] LedgerError),
}

/// Limits of one scope, in agents / milli-CPU / bytes; `None` = uncapped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Limits {
    agents: Option<u64>,
    cpu: Option<u64>,
    memory: Option<u64>,
}

impl Limits {
    fn caps(&self) -> Caps {
        Caps {
            max_agents: self.agents,
            max_cpu: self.cpu.map(MilliCpu::from_millis),
            max_memory: self.memory.map(MemoryBytes::from_bytes),
        }
    }
}

#[derive(Debug, Clone)]
struct ScalerLimits {
    limits: Limits,
    pool: Option<String>,
    max_lifetime: Duration,
}

/// Every limit of one configuration.
#[derive(Debug, Clone)]
struct ConfigLimits {
    global: Limits,
    scalers: HashMap<ScalerName, ScalerLimits>,
    pools: HashMap<String, Limits>,
}

impl ConfigLimits {
    fn from_config(config: &Config) -> Result<Self, AdmissionError> {
        let global_cap = config.global_resource_cap.unwrap_or_default();
        let pools: HashMap<String, Limits> = config
            .machine_pools
            .iter()
            .map(|p| {
                let cap = PoolCap::from(p.cap);
                let limits = Limits {
                    agents: None,
                    cpu: cap.max_cpu_millis,
                    memory: cap.max_memory_bytes,
                };
                (p.name.clone(), limits)
            })
            .collect();
        let mut scalers = HashMap::new();
        for s in &config.scalers {
            if let Some(pool) = &s.machine_pool {
                if !pools.contains_key(pool) {
                    return Err(AdmissionError::UnknownPool {
                        scaler: s.name.clone(),
                        pool: pool.clone(),
                    });
                }
            }
            let cap = s.resource_cap.unwrap_or_default();
            scalers.insert(
                s.name.clone(),
                ScalerLimits {
                    limits: Limits {
                        agents: Some(u64::from(s.max_agents)),
                        cpu: cap.max_cpu.map(MilliCpu::millis),
                        memory: cap.max_memory.map(MemoryBytes::bytes),
                    },
                    pool: s.machine_pool.clone(),
                    max_lifetime: s.ext.deadlines.max_lifetime,
                },
            );
        }
        Ok(Self {
            global: Limits {
                agents: Some(u64::from(config.global_max_agents)),
                cpu: global_cap.max_cpu.map(MilliCpu::millis),
                memory: global_cap.max_memory.map(MemoryBytes::bytes),
            },
            scalers,
            pools,
        })
    }

    fn pool_caps(&self) -> impl Iterator<Item = (&str, PoolCap)> {
        self.pools.iter().map(|(name, l)| {
            let cap = PoolCap {
                max_cpu_millis: l.cpu,
                max_memory_bytes: l.memory,
            };
            (name.as_str(), cap)
        })
    }

    /// The first cap (in check order) whose total the request alone exceeds.
    fn too_large(&self, scaler: &str, requests: Resources, pool: Option<&str>) -> Option<TooLarge> {
        let Some(s) = self.scalers.get(scaler) else {
            return Some(TooLarge {
                cap: Cap::ScalerCount,
                detail: format!("scaler {scaler} is not in the current configuration"),
            });
        };
        let cpu = requests.cpu.millis();
        let mem = requests.memory.bytes();
        let pool_limits = match pool {
            Some(p) => match self.pools.get(p) {
                Some(l) => *l,
                None => {
                    return Some(TooLarge {
                        cap: Cap::PoolCpu,
                        detail: format!("machine pool {p} is not in the current configuration"),
                    })
                }
            },
            None => Limits::default(),
        };
        let pool_name = pool.unwrap_or_default();
        let checks = [
            (Cap::GlobalCount, self.global.agents, 1),
            (Cap::ScalerCount, s.limits.agents, 1),
            (Cap::ScalerCpu, s.limits.cpu, cpu),
            (Cap::ScalerMemory, s.limits.memory, mem),
            (Cap::GlobalCpu, self.global.cpu, cpu),
            (Cap::GlobalMemory, self.global.memory, mem),
            (Cap::PoolCpu, pool_limits.cpu, cpu),
            (Cap::PoolMemory, pool_limits.memory, mem),
        ];
        let (cap, limit, requested) = checks
            .into_iter()
            .find(|&(_, limit, requested)| limit.is_some_and(|l| requested > l))?;
        // Only now, on the rare path, build the message.
        let what = match cap {
            Cap::GlobalCount => "globalMaxAgents".to_owned(),
            Cap::ScalerCount => format!("scaler {scaler} maxAgents"),
            Cap::ScalerCpu => format!("scaler {scaler} resourceCap.maxCpu"),
            Cap::ScalerMemory => format!("scaler {scaler} resourceCap.maxMemory"),
            Cap::GlobalCpu => "globalResourceCap.maxCpu".to_owned(),
            Cap::GlobalMemory => "globalResourceCap.maxMemory".to_owned(),
            Cap::PoolCpu => format!("machine pool {pool_name} cap.maxCpu"),
            Cap::PoolMemory => format!("machine pool {pool_name} cap.maxMemory"),
        };
        let u = cap.unit();
        Some(TooLarge {
            cap,
            detail: format!(
                "requests {} but {what} is {}",
                u.format(requested),
                u.format(limit.unwrap_or_default())
            ),
        })
    }
}

/// Amounts reserved in one scope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Used {
    agents: u64,
    cpu: u64,
    memory: u64,
}

impl Used {
    fn add(&mut self, r: Resources) {
        // Cannot overflow in practice (each addend was checked against a
        // u64 limit or is bounded by the request schema); saturate anyway.
        self.agents = self.agents.saturating_add(1);
        self.cpu = self.cpu.saturating_add(r.cpu.millis());
        self.memory = self.memory.saturating_add(r.memory.bytes());
    }

    fn sub(&mut self, r: Resources) {
        self.agents = self.agents.saturating_sub(1);
        self.cpu = self.cpu.saturating_sub(r.cpu.millis());
        self.memory = self.memory.saturating_sub(r.memory.bytes());
    }

    fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// `used + held + requested > limit` ⇒ refused; an unset limit never refuses.
fn check(
    cap: Cap,
    limit: Option<u64>,
    used: u64,
    held: u64,
    requested: u64,
) -> Result<(), Refusal> {
    let Some(limit) = limit else { return Ok(()) };
    if u128::from(used) + u128::from(held) + u128::from(requested) > u128::from(limit) {
        return Err(Refusal {
            cap,
            requested,
            used,
            held,
            limit,
        });
    }
    Ok(())
}

/// Everything the admission mutex guards.
#[derive(Debug)]
struct State {
    limits: ConfigLimits,
    global: Used,
    /// Keyed by name, not by configuration: a reservation subtracts from the
    /// counters it was added to even after a reload removed its scaler.
    scalers: HashMap<ScalerName, Used>,
    /// This process's share of each machine pool.
    pools: HashMap<String, Used>,
    live: HashSet<AgentId>,
}

impl State {
    /// The checks every admission shares: the scaler is configured, the
    /// demand names the scaler's current pool, the agent id is not live.
    /// Returns the scaler's max lifetime (the ledger row's expiry).
    fn precheck(&self, demand: &Demand) -> Result<Duration, AdmitError> {
        let Some(scaler) = self.limits.scalers.get(&demand.scaler) else {
            return Err(AdmitError::UnknownScaler(demand.scaler.clone()));
        };
        if scaler.pool != demand.pool {
            return Err(AdmitError::PoolMismatch {
                configured: scaler.pool.clone(),
                scaler: demand.scaler.clone(),
                demand: demand.pool.clone(),
            });
        }
        if self.live.contains(&demand.agent) {
            return Err(AdmitError::DuplicateAgent(demand.agent));
        }
        Ok(scaler.max_lifetime)
    }

    /// The in-memory checks, in order: counts, scaler resources, global
    /// resources, then (without a ledger) the pool.
    fn check(&self, d: &Demand, holds: &Holds, check_pool: bool) -> Result<(), Refusal> {
        let limits = &self.limits;
        let (cpu, mem) = (d.requests.cpu.millis(), d.requests.memory.bytes());
        let scaler_limits = limits
            .scalers
            .get(&d.scaler)
            .map(|s| s.limits)
            .unwrap_or_default();
        let scaler = self.scalers.get(&d.scaler).copied().unwrap_or_default();
        let (g, hg, hs) = (self.global, holds.global(), holds.scaler(d.scaler.as_str()));
        check(
            Cap::GlobalCount,
            limits.global.agents,
            g.agents,
            hg.agents,
            1,
        )?;
        check(
            Cap::ScalerCount,
            scaler_limits.agents,
            scaler.agents,
            hs.agents,
            1,
        )?;
        check(Cap::ScalerCpu, scaler_limits.cpu, scaler.cpu, hs.cpu, cpu)?;
        check(
            Cap::ScalerMemory,
            scaler_limits.memory,
            scaler.memory,
            hs.memory,
            mem,
        )?;
        check(Cap::GlobalCpu, limits.global.cpu, g.cpu, hg.cpu, cpu)?;
        check(
            Cap::GlobalMemory,
            limits.global.memory,
            g.memory,
            hg.memory,
            mem,
        )?;
        if let (true, Some(pool)) = (check_pool, d.pool.as_deref()) {
            let pool_limits = limits.pools.get(pool).copied().unwrap_or_default();
            let used = self.pools.get(pool).copied().unwrap_or_default();
            let hp: Held = holds.pool(pool);
            check(Cap::PoolCpu, pool_limits.cpu, used.cpu, hp.cpu, cpu)?;
            check(
                Cap::PoolMemory,
                pool_limits.memory,
                used.memory,
                hp.memory,
                mem,
            )?;
        }
        Ok(())
    }

    fn add(&mut self, agent: AgentId, scaler: &ScalerName, r: Resources, pool: Option<&str>) {
        self.global.add(r);
        self.scalers.entry(scaler.clone()).or_default().add(r);
        if let Some(pool) = pool {
            self.pools.entry(pool.to_owned()).or_default().add(r);
        }
        self.live.insert(agent);
    }

    fn sub(&mut self, agent: AgentId, scaler: &ScalerName, r: Resources, pool: Option<&str>) {
        self.global.sub(r);
        if let Some(u) = self.scalers.get_mut(scaler) {
            u.sub(r);
            if u.is_zero() && !self.limits.scalers.contains_key(scaler) {
                self.scalers.remove(scaler);
            }
        }
        if let Some(pool) = pool {
            if let Some(u) = self.pools.get_mut(pool) {
                u.sub(r);
                if u.is_zero() && !self.limits.pools.contains_key(pool) {
                    self.pools.remove(pool);
                }
            }
        }
        self.live.remove(&agent);
    }

    /// Drops the counters of scalers and pools that a reload removed once
    /// their last reservation is gone.
    fn forget_idle_removed(&mut self) {
        let limits = &self.limits;
        self.scalers
            .retain(|name, u| !u.is_zero() || limits.scalers.contains_key(name));
        self.pools
            .retain(|name, u| !u.is_zero() || limits.pools.contains_key(name));
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    ledger: Option<MachineLedger>,
    signal: Arc<SignalShared>,
}

/// The admission controller. Clones share one state.
#[derive(Debug, Clone)]
pub struct Admission {
    shared: Arc<Shared>,
}

impl Admission {
    /// Builds the limits of `config`. With a ledger, its pools are
    /// registered (each pool file must agree on the cap); without one, pool
    /// caps are enforced for this process only.
    pub fn new(
        config: &Config,
        ledger: Option<MachineLedger>,
    ) -> Result<Admission, AdmissionError> {
        let limits = ConfigLimits::from_config(config)?;
        if let Some(ledger) = &ledger {
            ledger.register_pools(limits.pool_caps())?;
        }
        Ok(Admission {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    limits,
                    global: Used::default(),
                    scalers: HashMap::new(),
                    pools: HashMap::new(),
                    live: HashSet::new(),
                }),
                ledger,
                signal: Arc::new(SignalShared::new()),
            }),
        })
    }

    /// Checks every cap and reserves, atomically. On `Err`, nothing changed.
    ///
    /// With a machine pool and a ledger, the ledger's read-modify-write
    /// (a `flock` and an fsync) happens inside the critical section, so this
    /// blocks for milliseconds; without a pool it is a few hundred
    /// nanoseconds.
    pub fn try_reserve(&self, demand: Demand, holds: &Holds) -> Result<Reservation, AdmitError> {
        #[cfg_attr(not(feature = "check-then-act-mutant"), allow(unused_mut))]
        let mut state = lock(&self.shared.state);
        let max_lifetime = state.precheck(&demand)?;
        if let Some(t) = state.limits.too_large(
            demand.scaler.as_str(),
            demand.requests,
            demand.pool.as_deref(),
        ) {
            return Err(AdmitError::TooLarge(t));
        }
        let ledger = self.shared.ledger.as_ref();
        state
            .check(&demand, holds, ledger.is_none())
            .map_err(AdmitError::Refused)?;

        #[cfg(feature = "check-then-act-mutant")]
        {
            // Upstream's defect, on purpose: the check's lock is released
            // before the reservation is recorded.
            drop(state);
            crate::sync::yield_now();
            state = lock(&self.shared.state);
        }

        if let (Some(ledger), Some(pool)) = (ledger, demand.pool.as_deref()) {
            let held = holds.pool(pool);
            let held = Resources::new(
                MilliCpu::from_millis(held.cpu),
                MemoryBytes::from_bytes(held.memory),
            );
            // Under the admission lock: the pool check and every other
            // check form one step, and the in-memory counters are only
            // touched once the row is durably written.
            match ledger.try_reserve(pool, demand.agent, demand.requests, held, max_lifetime)? {
                ReserveOutcome::Reserved => {}
                ReserveOutcome::Refused(r) => return Err(AdmitError::Refused(r)),
            }
        }
        state.add(
            demand.agent,
            &demand.scaler,
            demand.requests,
            demand.pool.as_deref(),
        );
        drop(state);
        Ok(Reservation {
            shared: self.shared.clone(),
            agent: demand.agent,
            scaler: demand.scaler,
            requests: demand.requests,
            pool: demand.pool,
        })
    }

    /// Counts an agent that already exists (recovered after a restart)
    /// without checking caps: it runs whether or not it fits, so it must
    /// count. With a ledger, this instance's row for it is kept or restored.
    pub fn adopt(&self, demand: Demand) -> Result<Reservation, AdmitError> {
        let mut state = lock(&self.shared.state);
        let max_lifetime = state.precheck(&demand)?;
        if let (Some(ledger), Some(pool)) = (&self.shared.ledger, demand.pool.as_deref()) {
            ledger.adopt(pool, demand.agent, demand.requests, max_lifetime)?;
        }
        state.add(
            demand.agent,
            &demand.scaler,
            demand.requests,
            demand.pool.as_deref(),
        );
        drop(state);
        Ok(Reservation {
            shared: self.shared.clone(),
            agent: demand.agent,
            scaler: demand.scaler,
            requests: demand.requests,
            pool: demand.pool,
        })
    }

    /// Would `requests` on `scaler` (in `pool`) exceed a cap's total even
    /// with nothing else running? `Some` means it can never be admitted
    /// under the current configuration (an unknown scaler or pool counts as
    /// a cap of zero).
    pub fn too_large(
        &self,
        scaler: &str,
        requests: Resources,
        pool: Option<&str>,
    ) -> Option<TooLarge> {
        lock(&self.shared.state)
            .limits
            .too_large(scaler, requests, pool)
    }

    /// Applies a reloaded configuration's limits. Usage is kept; live
    /// reservations of removed scalers and pools stay counted until they
    /// drop. On `Err` nothing changed.
    pub fn reconfigure(&self, config: &Config) -> Result<(), AdmissionError> {
        let limits = ConfigLimits::from_config(config)?;
        {
            // Registration is inside the lock so that no reservation sees
            // new pool caps in the ledger but old ones here, or vice versa.
            let mut state = lock(&self.shared.state);
            if let Some(ledger) = &self.shared.ledger {
                ledger.register_pools(limits.pool_caps())?;
            }
            state.limits = limits;
            state.forget_idle_removed();
        }
        // Caps may have grown: pending requests should look again.
        self.shared.signal.bump();
        Ok(())
    }

    /// Usage and caps of every scope (for a pool: this process's share; ask
    /// [`MachineLedger::usage`] for every process's).
    pub fn usage(&self) -> UsageSnapshot {
        let state = lock(&self.shared.state);
        let l = &state.limits;
        let scope = |u: Used, limits: Option<Limits>| ScopeUsage {
            agents: u.agents,
            cpu: MilliCpu::from_millis(u.cpu),
            memory: MemoryBytes::from_bytes(u.memory),
            caps: limits.unwrap_or_default().caps(),
            configured: limits.is_some(),
        };
        let mut scalers: BTreeMap<ScalerName, ScopeUsage> = l
            .scalers
            .iter()
            .map(|(n, s)| (n.clone(), scope(Used::default(), Some(s.limits))))
            .collect();
        for (name, used) in &state.scalers {
            let limits = l.scalers.get(name).map(|s| s.limits);
            scalers.insert(name.clone(), scope(*used, limits));
        }
        let mut pools: BTreeMap<String, ScopeUsage> = l
            .pools
            .iter()
            .map(|(n, p)| (n.clone(), scope(Used::default(), Some(*p))))
            .collect();
        for (name, used) in &state.pools {
            pools.insert(name.clone(), scope(*used, l.pools.get(name).copied()));
        }
        UsageSnapshot {
            global: scope(state.global, Some(l.global)),
            scalers,
            pools,
        }
    }

    /// A subscription to "capacity was released" (or caps were raised).
    pub fn subscribe_releases(&self) -> ReleaseSignal {
        ReleaseSignal::new(self.shared.signal.clone())
    }

    /// The ledger this admission reserves machine pools in, if any.
    pub fn ledger(&self) -> Option<&MachineLedger> {
        self.shared.ledger.as_ref()
    }
}

/// Reserved capacity for one agent. Not `Clone`: it is released exactly
/// once, when dropped (or by [`Reservation::release`], which consumes it) —
/// counts, CPU, memory and the ledger row together.
///
/// With a machine pool and a ledger, dropping does file I/O (one `flock`ed,
/// fsynced write, milliseconds): drop it where blocking is acceptable (a
/// blocking task). If that write fails, the in-memory counters are released
/// anyway and the row removal is queued ([`MachineLedger::maintain`]).
pub struct Reservation {
    shared: Arc<Shared>,
    agent: AgentId,
    scaler: ScalerName,
    requests: Resources,
    pool: Option<String>,
}

impl Reservation {
    pub fn agent(&self) -> AgentId {
        self.agent
    }

    pub fn scaler(&self) -> &ScalerName {
        &self.scaler
    }

    pub fn requests(&self) -> Resources {
        self.requests
    }

    pub fn pool(&self) -> Option<&str> {
        self.pool.as_deref()
    }

    /// Releases now (the same as dropping; reads better at call sites).
    pub fn release(self) {
        drop(self);
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("agent", &self.agent)
            .field("scaler", &self.scaler)
            .field("requests", &self.requests)
            .field("pool", &self.pool)
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // The ledger row first, the in-memory counters second, the signal
        // last: whoever the signal wakes finds the capacity free everywhere.
        if let (Some(ledger), Some(pool)) = (&self.shared.ledger, self.pool.as_deref()) {
            if let Err(e) = ledger.release(pool, self.agent) {
                tracing::warn!(
                    agent_id = %self.agent, scaler = %self.scaler, pool,
                    error = %e,
                    "machine-pool ledger release failed; queued for retry"
                );
            }
        }
        lock(&self.shared.state).sub(
            self.agent,
            &self.scaler,
            self.requests,
            self.pool.as_deref(),
        );
        self.shared.signal.bump();
    }
}

/// Usage and caps of one scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScopeUsage {
    /// Live reservations.
    pub agents: u64,
    pub cpu: MilliCpu,
    pub memory: MemoryBytes,
    pub caps: Caps,
    /// False for a scaler or pool a reload removed while reservations in it
    /// are still live.
    pub configured: bool,
}

/// [`Admission::usage`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageSnapshot {
    pub global: ScopeUsage,
    pub scalers: BTreeMap<ScalerName, ScopeUsage>,
    pub pools: BTreeMap<String, ScopeUsage>,
}
