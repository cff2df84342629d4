//! Membership: a host's row in `fleet_hosts`, its lease and fencing epoch,
//! the pools it serves (`fleet_host_pools`, `fleet_pools`), and the
//! fleet-wide caps (`fleet_fleets`).
//!
//! Joining takes the fleet row's lock (`fleet_fleets … FOR UPDATE`), so
//! joins of one fleet are serialised and the pool-definition check sees
//! every other host's committed definition: a pool whose fingerprint differs
//! from the one a live host (`up`, lease not expired) advertises is refused
//! with [`FleetError::PoolMismatch`], naming the pool, the hosts and what
//! differs. With no live host serving a pool, the joining host's definition
//! becomes the pool's.
//!
//! The lease is timed on the database's clock (`lease_expires_at`), the
//! only clock every host and the leader share. Each join (first or again)
//! increments the host's epoch; renewals keep it and fail once the host is
//! no longer `up` under that epoch ([`FleetError::LeaseLost`]).
//!
//! Fencing is local as well: a [`LeaseGuard`] holds the instant up to which
//! this host may claim and start, on its own monotonic clock: the send time
//! of the last successful renewal + lease − margin. The database expires the
//! lease no earlier than lease after it *received* that renewal, so the host
//! stops before the leader can declare it lost, even if PostgreSQL becomes
//! unreachable right after.

use crate::error::{FleetError, PoolMismatch};
use crate::{non_negative, to_db, Fleet};
use kici_model::{InstanceId, MemoryBytes, MilliCpu};
use sha2::{Digest, Sha256};
use sqlx::Row;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Caps on summed usage; `None` is uncapped. Used for a pool's fleet caps
/// (`fleetMaxAgents`, `fleetResourceCap`) and the fleet-wide global caps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Caps {
    /// Most agents (claimed requests + live agents).
    pub max_agents: Option<u32>,
    /// Most summed CPU requests.
    pub max_cpu: Option<MilliCpu>,
    /// Most summed memory requests.
    pub max_memory: Option<MemoryBytes>,
}

impl Caps {
    /// Whether any dimension is capped.
    pub fn any(&self) -> bool {
        self.max_agents.is_some() || self.max_cpu.is_some() || self.max_memory.is_some()
    }

    fn db(&self) -> (Option<i64>, Option<i64>, Option<i64>) {
        (
            self.max_agents.map(i64::from),
            self.max_cpu.map(|c| to_db(c.millis())),
            self.max_memory.map(|m| to_db(m.bytes())),
        )
    }

    pub(crate) fn from_db(
        table: &'static str,
        agents: Option<i64>,
        cpu: Option<i64>,
        memory: Option<i64>,
    ) -> Result<Self, FleetError> {
        let agents = agents
            .map(|v| {
                non_negative(table, "max_agents", v).map(|v| u32::try_from(v).unwrap_or(u32::MAX))
            })
            .transpose()?;
        Ok(Self {
            max_agents: agents,
            max_cpu: cpu
                .map(|v| non_negative(table, "max_cpu", v).map(MilliCpu::from_millis))
                .transpose()?,
            max_memory: memory
                .map(|v| non_negative(table, "max_memory", v).map(MemoryBytes::from_bytes))
                .transpose()?,
        })
    }

    fn describe(&self) -> String {
        let one = |name: &str, v: Option<String>| format!("{name} {}", v.unwrap_or("none".into()));
        [
            one("max agents", self.max_agents.map(|v| v.to_string())),
            one("max cpu", self.max_cpu.map(|v| format!("{}m", v.millis()))),
            one(
                "max memory",
                self.max_memory.map(|v| format!("{} bytes", v.bytes())),
            ),
        ]
        .join(", ")
    }

    fn to_json(self) -> serde_json::Value {
        serde_json::json!({
            "maxAgents": self.max_agents,
            "maxCpuMillis": self.max_cpu.map(|c| c.millis()),
            "maxMemoryBytes": self.max_memory.map(|m| m.bytes()),
        })
    }
}

/// A pool (scaler name) as this host serves it. `label_sets` and
/// `fleet_caps` form the definition every host serving the pool must share;
/// `host_max_agents` is this host's own capacity in it (may differ).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolDefinition {
    /// The scaler name.
    pub name: String,
    /// The label sets as the daemon renders them (JSON; object key order
    /// does not matter, array order does: it is the routing order).
    pub label_sets: serde_json::Value,
    /// The pool's fleet-wide caps.
    pub fleet_caps: Caps,
    /// This host's own agent capacity in the pool (for placement).
    pub host_max_agents: Option<u32>,
}

impl PoolDefinition {
    /// The definition as stored: canonical JSON (object keys sorted).
    pub fn definition_json(&self) -> String {
        let v = serde_json::json!({
            "labelSets": self.label_sets,
            "fleetCaps": self.fleet_caps.to_json(),
        });
        canonical(&v)
    }

    /// SHA-256 of [`Self::definition_json`], hex: equal fingerprints mean
    /// equal definitions.
    pub fn fingerprint(&self) -> String {
        hex::encode(Sha256::digest(self.definition_json().as_bytes()))
    }
}

/// Canonical JSON text: object keys sorted at every level, no whitespace.
/// (serde_json's map order depends on a feature another crate in the build
/// may switch on, so the order is made explicit here.)
pub(crate) fn canonical(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            let sorted: BTreeMap<&String, &Value> = map.iter().collect();
            let fields: Vec<String> = sorted
                .into_iter()
                .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), canonical(v)))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(canonical).collect();
            format!("[{}]", items.join(","))
        }
        other => other.to_string(),
    }
}

/// What a host tells the fleet when it joins.
#[derive(Debug, Clone)]
pub struct HostSpec {
    /// The daemon's instance id.
    pub instance_id: InstanceId,
    /// Its hostname (for people).
    pub hostname: String,
    /// Its control API as peers reach it.
    pub url: Option<String>,
    /// Its kici-scaler version.
    pub version: String,
    /// The pools it serves.
    pub pools: Vec<PoolDefinition>,
    /// The fleet-wide caps it was configured with (must match the live hosts').
    pub global_caps: Caps,
    /// Its own caps, as JSON for status (its per-host capacity).
    pub host_caps: serde_json::Value,
    /// Lease length (default 15 s).
    pub lease: Duration,
    /// How long before the lease's end (on this host's clock) it stops
    /// claiming and starting; covers clock-rate differences and the time a
    /// claim takes. Default: a third of the lease.
    pub margin: Duration,
}

impl HostSpec {
    /// A spec with the default lease (15 s) and margin (5 s), no pools, no caps.
    pub fn new(instance_id: InstanceId, hostname: &str, version: &str) -> Self {
        Self {
            instance_id,
            hostname: hostname.to_owned(),
            url: None,
            version: version.to_owned(),
            pools: Vec::new(),
            global_caps: Caps::default(),
            host_caps: serde_json::Value::Object(Default::default()),
            lease: Duration::from_secs(15),
            margin: Duration::from_secs(5),
        }
    }
}

#[derive(Debug)]
struct GuardState {
    epoch: i64,
    /// Up to when (this host's monotonic clock) claiming and starting are
    /// allowed; `None` once the lease is known lost or handed back.
    valid_until: Option<Instant>,
    /// Handed back: renewals keep the lease (agents still run) but do not
    /// reopen the fence; only a rejoin does.
    closed: bool,
}

/// This host's local fence: whether its lease is still known to be valid,
/// by its own monotonic clock, and under which epoch. Cheap to clone; every
/// clone sees renewals.
#[derive(Debug, Clone)]
pub struct LeaseGuard {
    instance: Arc<str>,
    state: Arc<Mutex<GuardState>>,
}

impl LeaseGuard {
    fn new(instance: &str, epoch: i64, valid_until: Instant) -> Self {
        Self {
            instance: instance.into(),
            state: Arc::new(Mutex::new(GuardState {
                epoch,
                valid_until: Some(valid_until),
                closed: false,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GuardState> {
        // The state is two plain fields written whole: a panic elsewhere
        // cannot leave it half-updated, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The host's instance id (text).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The epoch of the current (or last) lease.
    pub fn epoch(&self) -> i64 {
        self.lock().epoch
    }

    /// Whether the lease is known valid now.
    pub fn is_valid(&self) -> bool {
        self.valid_for().is_some()
    }

    /// How much longer the lease is known valid (None: not valid).
    pub fn valid_for(&self) -> Option<Duration> {
        let st = self.lock();
        st.valid_until
            .and_then(|t| t.checked_duration_since(Instant::now()))
            .filter(|d| !d.is_zero())
    }

    /// The epoch, if the lease is known valid now; else
    /// [`FleetError::LeaseLapsed`]. Call before claiming or starting.
    pub fn check(&self) -> Result<i64, FleetError> {
        let st = self.lock();
        match st.valid_until {
            Some(t) if Instant::now() < t => Ok(st.epoch),
            _ => Err(FleetError::LeaseLapsed {
                instance: self.instance.to_string(),
                epoch: st.epoch,
            }),
        }
    }

    fn renewed(&self, epoch: i64, valid_until: Instant) {
        let mut st = self.lock();
        // A slow renewal answered after a newer one must not shorten it.
        if st.epoch == epoch && !st.closed {
            st.valid_until = Some(match st.valid_until {
                Some(t) if t > valid_until => t,
                _ => valid_until,
            });
        }
    }

    fn rejoined(&self, epoch: i64, valid_until: Instant) {
        let mut st = self.lock();
        st.epoch = epoch;
        st.valid_until = Some(valid_until);
        st.closed = false;
    }

    fn invalidate(&self) {
        self.lock().valid_until = None;
    }

    fn close(&self) {
        let mut st = self.lock();
        st.valid_until = None;
        st.closed = true;
    }
}

/// One host as the fleet records it (for status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostStatus {
    /// Instance id.
    pub instance_id: String,
    /// Hostname.
    pub hostname: String,
    /// Advertised control URL.
    pub url: Option<String>,
    /// Version.
    pub version: String,
    /// `up`, `leaving`, `left` or `lost`.
    pub state: String,
    /// Current epoch.
    pub epoch: i64,
    /// Milliseconds since the last renewal (database clock).
    pub lease_age_ms: i64,
    /// Whether this host was the last to record itself leader.
    pub leader: bool,
    /// The pools it serves.
    pub pools: Vec<String>,
}

/// This host's membership: its lease, epoch and fence. Renew it every
/// lease/3 or so ([`Membership::renew`]); on [`FleetError::LeaseLost`],
/// [`Membership::rejoin`].
#[derive(Debug)]
pub struct Membership {
    fleet: Fleet,
    spec: HostSpec,
    instance: String,
    guard: LeaseGuard,
}

fn lease_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Membership {
    /// Joins (or rejoins) the fleet and takes the lease under a new epoch:
    /// checks the pool definitions and global caps against the live hosts'
    /// (refusing on a difference), records the host, its pools and the
    /// pools' definitions, and returns to the queue any request this host
    /// had claimed under an older epoch and not started (it rejoined: those
    /// claims are void).
    pub async fn join(fleet: Fleet, spec: HostSpec) -> Result<Self, FleetError> {
        let instance = spec.instance_id.to_string();
        let (epoch, valid_until) = take_lease(&fleet, &spec, &instance).await?;
        let guard = LeaseGuard::new(&instance, epoch, valid_until);
        Ok(Self {
            fleet,
            spec,
            instance,
            guard,
        })
    }

    /// Takes the lease anew (after [`FleetError::LeaseLost`], or after a
    /// hand-back): a new epoch, the same checks as [`Membership::join`].
    pub async fn rejoin(&mut self) -> Result<i64, FleetError> {
        let (epoch, valid_until) = take_lease(&self.fleet, &self.spec, &self.instance).await?;
        self.guard.rejoined(epoch, valid_until);
        Ok(epoch)
    }

    /// The fence to check before claiming or starting (shared by clones).
    pub fn guard(&self) -> &LeaseGuard {
        &self.guard
    }

    /// The current epoch.
    pub fn epoch(&self) -> i64 {
        self.guard.epoch()
    }

    /// The instance id as text.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The fleet handle.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// The spec this host joined with.
    pub fn spec(&self) -> &HostSpec {
        &self.spec
    }

    /// Extends the lease by its length from now (database clock); keep
    /// renewing after [`Membership::hand_back`] while agents still run, so
    /// they are not declared lost. Fails with [`FleetError::LeaseLost`] if
    /// the host is no longer `up` or `leaving` under its epoch or the lease
    /// already expired (the local fence is then closed:
    /// rejoin); with [`FleetError::Unavailable`] if the database cannot be
    /// reached (the fence closes on its own when its time runs out).
    pub async fn renew(&self) -> Result<(), FleetError> {
        let epoch = self.guard.epoch();
        let sent = Instant::now();
        let renewed = sqlx::query(
            "UPDATE fleet_hosts SET lease_expires_at = fleet_now_ms() + lease_ms, renewed_at = fleet_now_ms() \
             WHERE fleet = $1 AND instance_id = $2 AND epoch = $3 AND state IN ('up', 'leaving') \
               AND lease_expires_at > fleet_now_ms()",
        )
        .bind(self.fleet.name())
        .bind(&self.instance)
        .bind(epoch)
        .execute(self.fleet.pool())
        .await?
        .rows_affected();
        if renewed == 0 {
            self.guard.invalidate();
            return Err(FleetError::LeaseLost {
                instance: self.instance.clone(),
                epoch,
            });
        }
        self.guard.renewed(epoch, valid_until(sent, &self.spec));
        Ok(())
    }

    /// Records this host's free capacity (JSON, for status and the entry
    /// host's explanations).
    pub async fn report_free(&self, free: &serde_json::Value) -> Result<(), FleetError> {
        sqlx::query("UPDATE fleet_hosts SET free = $3 WHERE fleet = $1 AND instance_id = $2")
            .bind(self.fleet.name())
            .bind(&self.instance)
            .bind(canonical(free))
            .execute(self.fleet.pool())
            .await?;
        Ok(())
    }

    /// Handover: the host stops claiming (state `leaving`, fence closed) and
    /// returns every request it claimed and has not started to the queue at
    /// its original place, at once. Returns their job ids. Its live agents
    /// stay its own (the daemon finishes or destroys them, then calls
    /// [`Membership::leave`]).
    pub async fn hand_back(&self) -> Result<Vec<String>, FleetError> {
        self.guard.close();
        let mut tx = self.fleet.pool().begin().await?;
        sqlx::query(
            "UPDATE fleet_hosts SET state = 'leaving' WHERE fleet = $1 AND instance_id = $2 AND state = 'up'",
        )
        .bind(self.fleet.name())
        .bind(&self.instance)
        .execute(&mut *tx)
        .await?;
        let rows = sqlx::query(
            "UPDATE fleet_requests SET state = 'queued', claimed_by = NULL, claim_epoch = NULL, \
                 claim_seq = NULL, claimed_at = NULL \
             WHERE fleet = $1 AND claimed_by = $2 AND state = 'claimed' RETURNING job_id, pool",
        )
        .bind(self.fleet.name())
        .bind(&self.instance)
        .fetch_all(&mut *tx)
        .await?;
        let (jobs, pools) = jobs_and_pools(&rows)?;
        for pool in &pools {
            crate::notify(&mut tx, self.fleet.name(), pool).await?;
        }
        tx.commit().await?;
        Ok(jobs)
    }

    /// Leaves the fleet: hands back (see [`Membership::hand_back`]), then
    /// marks the host `left` with its lease ended. Call once its agents are
    /// gone; any still recorded live are marked lost by the next leader
    /// chore.
    pub async fn leave(self) -> Result<Vec<String>, FleetError> {
        let jobs = self.hand_back().await?;
        sqlx::query(
            "UPDATE fleet_hosts SET state = 'left', left_at = fleet_now_ms(), lease_expires_at = fleet_now_ms() \
             WHERE fleet = $1 AND instance_id = $2 AND state IN ('up', 'leaving')",
        )
        .bind(self.fleet.name())
        .bind(&self.instance)
        .execute(self.fleet.pool())
        .await?;
        Ok(jobs)
    }

    /// Every host of the fleet, newest join first.
    pub async fn hosts(&self) -> Result<Vec<HostStatus>, FleetError> {
        hosts(&self.fleet).await
    }
}

/// Every host of `fleet` as recorded, newest join first.
pub async fn hosts(fleet: &Fleet) -> Result<Vec<HostStatus>, FleetError> {
    let rows = sqlx::query(
        "SELECT h.instance_id, h.hostname, h.url, h.version, h.state, h.epoch, \
                fleet_now_ms() - h.renewed_at AS age, f.leader = h.instance_id AS leader, \
                COALESCE((SELECT string_agg(p.pool, ',' ORDER BY p.pool) FROM fleet_host_pools p \
                          WHERE p.fleet = h.fleet AND p.instance_id = h.instance_id), '') AS pools \
         FROM fleet_hosts h JOIN fleet_fleets f ON f.fleet = h.fleet \
         WHERE h.fleet = $1 ORDER BY h.joined_at DESC, h.instance_id",
    )
    .bind(fleet.name())
    .fetch_all(fleet.pool())
    .await?;
    rows.iter()
        .map(|r| {
            let pools: String = r.try_get("pools")?;
            Ok(HostStatus {
                instance_id: r.try_get("instance_id")?,
                hostname: r.try_get("hostname")?,
                url: r.try_get("url")?,
                version: r.try_get("version")?,
                state: r.try_get("state")?,
                epoch: r.try_get("epoch")?,
                lease_age_ms: r.try_get("age")?,
                leader: r.try_get::<Option<bool>, _>("leader")?.unwrap_or(false),
                pools: pools
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned)
                    .collect(),
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(FleetError::from)
}

fn valid_until(sent: Instant, spec: &HostSpec) -> Instant {
    sent + spec.lease.saturating_sub(spec.margin)
}

pub(crate) fn jobs_and_pools(
    rows: &[sqlx::postgres::PgRow],
) -> Result<(Vec<String>, Vec<String>), FleetError> {
    let mut jobs = Vec::with_capacity(rows.len());
    let mut pools = std::collections::BTreeSet::new();
    for r in rows {
        jobs.push(r.try_get::<String, _>("job_id")?);
        pools.insert(r.try_get::<String, _>("pool")?);
    }
    Ok((jobs, pools.into_iter().collect()))
}

/// Describes how `theirs` (a stored definition) differs from `ours`.
fn difference(ours: &PoolDefinition, theirs: &str) -> String {
    let Ok(theirs) = serde_json::from_str::<serde_json::Value>(theirs) else {
        return "the recorded definition is unreadable".into();
    };
    let mut parts = Vec::new();
    let our_sets = canonical(&ours.label_sets);
    let their_sets = theirs.get("labelSets").map(canonical).unwrap_or_default();
    if our_sets != their_sets {
        parts.push(format!(
            "label sets differ (this host: {}; theirs: {})",
            abbreviate(&our_sets),
            abbreviate(&their_sets)
        ));
    }
    let our_caps = canonical(&ours.fleet_caps.to_json());
    let their_caps = theirs.get("fleetCaps").map(canonical).unwrap_or_default();
    if our_caps != their_caps {
        parts.push(format!(
            "fleet caps differ (this host: {our_caps}; theirs: {their_caps})"
        ));
    }
    if parts.is_empty() {
        "the definitions differ".into()
    } else {
        parts.join("; ")
    }
}

fn abbreviate(s: &str) -> String {
    const MAX: usize = 300;
    if s.len() <= MAX {
        return s.to_owned();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The join transaction. Lock order (shared with claims, so they cannot
/// deadlock): the fleet row, then pool rows, then the host row, then
/// request rows.
async fn take_lease(
    fleet: &Fleet,
    spec: &HostSpec,
    instance: &str,
) -> Result<(i64, Instant), FleetError> {
    let name = fleet.name();
    let sent = Instant::now();
    let mut tx = fleet.pool().begin().await?;
    let (ga, gc, gm) = spec.global_caps.db();
    sqlx::query(
        "INSERT INTO fleet_fleets (fleet, max_agents, max_cpu, max_memory, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, fleet_now_ms(), fleet_now_ms()) ON CONFLICT (fleet) DO NOTHING",
    )
    .bind(name)
    .bind(ga)
    .bind(gc)
    .bind(gm)
    .execute(&mut *tx)
    .await?;
    let row = sqlx::query(
        "SELECT max_agents, max_cpu, max_memory FROM fleet_fleets WHERE fleet = $1 FOR UPDATE",
    )
    .bind(name)
    .fetch_one(&mut *tx)
    .await?;
    let recorded = Caps::from_db(
        "fleet_fleets",
        row.try_get("max_agents")?,
        row.try_get("max_cpu")?,
        row.try_get("max_memory")?,
    )?;
    let live: Vec<(String, String)> = sqlx::query_as(
        "SELECT instance_id, hostname FROM fleet_hosts \
         WHERE fleet = $1 AND instance_id <> $2 AND state = 'up' AND lease_expires_at > fleet_now_ms() \
         ORDER BY instance_id",
    )
    .bind(name)
    .bind(instance)
    .fetch_all(&mut *tx)
    .await?;
    if recorded != spec.global_caps {
        if !live.is_empty() {
            return Err(FleetError::GlobalCapsMismatch {
                hosts: live.iter().map(|(i, h)| format!("{i} ({h})")).collect(),
                ours: spec.global_caps.describe(),
                theirs: recorded.describe(),
            });
        }
        sqlx::query(
            "UPDATE fleet_fleets SET max_agents = $2, max_cpu = $3, max_memory = $4, updated_at = fleet_now_ms() \
             WHERE fleet = $1",
        )
        .bind(name)
        .bind(ga)
        .bind(gc)
        .bind(gm)
        .execute(&mut *tx)
        .await?;
    }

    // Pools, in name order (a fixed lock order between joins).
    let mut pools: Vec<&PoolDefinition> = spec.pools.iter().collect();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    let mut mismatches = Vec::new();
    for def in &pools {
        let fingerprint = def.fingerprint();
        let others = sqlx::query(
            "SELECT hp.instance_id, h.hostname, hp.definition FROM fleet_host_pools hp \
             JOIN fleet_hosts h ON h.fleet = hp.fleet AND h.instance_id = hp.instance_id \
             WHERE hp.fleet = $1 AND hp.pool = $2 AND hp.instance_id <> $3 AND hp.fingerprint <> $4 \
               AND h.state = 'up' AND h.lease_expires_at > fleet_now_ms() \
             ORDER BY hp.instance_id",
        )
        .bind(name)
        .bind(&def.name)
        .bind(instance)
        .bind(&fingerprint)
        .fetch_all(&mut *tx)
        .await?;
        if let Some(first) = others.first() {
            let theirs: String = first.try_get("definition")?;
            let hosts = others
                .iter()
                .map(|r| {
                    Ok(format!(
                        "{} ({})",
                        r.try_get::<String, _>("instance_id")?,
                        r.try_get::<String, _>("hostname")?
                    ))
                })
                .collect::<Result<Vec<_>, sqlx::Error>>()?;
            mismatches.push(PoolMismatch {
                pool: def.name.clone(),
                hosts,
                difference: difference(def, &theirs),
            });
        }
    }
    if !mismatches.is_empty() {
        return Err(FleetError::PoolMismatch(mismatches));
    }
    for def in &pools {
        let (pa, pc, pm) = def.fleet_caps.db();
        sqlx::query(
            "INSERT INTO fleet_pools (fleet, pool, fingerprint, definition, max_agents, max_cpu, max_memory, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, fleet_now_ms()) \
             ON CONFLICT (fleet, pool) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, \
                 definition = EXCLUDED.definition, max_agents = EXCLUDED.max_agents, \
                 max_cpu = EXCLUDED.max_cpu, max_memory = EXCLUDED.max_memory, updated_at = EXCLUDED.updated_at \
             WHERE fleet_pools.fingerprint <> EXCLUDED.fingerprint",
        )
        .bind(name)
        .bind(&def.name)
        .bind(def.fingerprint())
        .bind(def.definition_json())
        .bind(pa)
        .bind(pc)
        .bind(pm)
        .execute(&mut *tx)
        .await?;
    }

    let lease = lease_ms(spec.lease);
    let epoch: i64 = sqlx::query_scalar(
        "INSERT INTO fleet_hosts (fleet, instance_id, hostname, url, version, state, epoch, lease_ms, \
             lease_expires_at, renewed_at, joined_at, caps, free) \
         VALUES ($1, $2, $3, $4, $5, 'up', 1, $6, fleet_now_ms() + $6, fleet_now_ms(), fleet_now_ms(), $7, '{}') \
         ON CONFLICT (fleet, instance_id) DO UPDATE SET hostname = EXCLUDED.hostname, url = EXCLUDED.url, \
             version = EXCLUDED.version, state = 'up', epoch = fleet_hosts.epoch + 1, \
             lease_ms = EXCLUDED.lease_ms, lease_expires_at = EXCLUDED.lease_expires_at, \
             renewed_at = EXCLUDED.renewed_at, joined_at = EXCLUDED.joined_at, left_at = NULL, \
             caps = EXCLUDED.caps \
         RETURNING epoch",
    )
    .bind(name)
    .bind(instance)
    .bind(&spec.hostname)
    .bind(&spec.url)
    .bind(&spec.version)
    .bind(lease)
    .bind(canonical(&spec.host_caps))
    .fetch_one(&mut *tx)
    .await?;

    sqlx::query("DELETE FROM fleet_host_pools WHERE fleet = $1 AND instance_id = $2")
        .bind(name)
        .bind(instance)
        .execute(&mut *tx)
        .await?;
    for def in &pools {
        sqlx::query(
            "INSERT INTO fleet_host_pools (fleet, instance_id, pool, fingerprint, definition, host_max_agents) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(name)
        .bind(instance)
        .bind(&def.name)
        .bind(def.fingerprint())
        .bind(def.definition_json())
        .bind(def.host_max_agents.map(i64::from))
        .execute(&mut *tx)
        .await?;
    }

    // Claims made under an older epoch can no longer be started (starting
    // checks the epoch): give them back now rather than at the next chore.
    let rows = sqlx::query(
        "UPDATE fleet_requests SET state = 'queued', claimed_by = NULL, claim_epoch = NULL, \
             claim_seq = NULL, claimed_at = NULL \
         WHERE fleet = $1 AND claimed_by = $2 AND state = 'claimed' AND claim_epoch < $3 \
         RETURNING job_id, pool",
    )
    .bind(name)
    .bind(instance)
    .bind(epoch)
    .fetch_all(&mut *tx)
    .await?;
    let (_, requeued_pools) = jobs_and_pools(&rows)?;
    for pool in &requeued_pools {
        crate::notify(&mut tx, name, pool).await?;
    }
    tx.commit().await?;
    Ok((epoch, valid_until(sent, spec)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(sets: serde_json::Value, caps: Caps) -> PoolDefinition {
        PoolDefinition {
            name: "fc".into(),
            label_sets: sets,
            fleet_caps: caps,
            host_max_agents: Some(3),
        }
    }

    #[test]
    fn fingerprint_ignores_key_order_and_host_capacity() {
        let a = def(
            serde_json::json!([{"labels": ["linux", "x64"], "os": "linux"}]),
            Caps::default(),
        );
        let mut b = def(
            serde_json::from_str(r#"[{"os": "linux", "labels": ["linux", "x64"]}]"#).unwrap(),
            Caps::default(),
        );
        b.host_max_agents = Some(9);
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = def(
            serde_json::json!([{"labels": ["x64", "linux"], "os": "linux"}]),
            Caps::default(),
        );
        assert_ne!(a.fingerprint(), c.fingerprint());
        let d = def(
            a.label_sets.clone(),
            Caps {
                max_agents: Some(4),
                ..Caps::default()
            },
        );
        assert_ne!(a.fingerprint(), d.fingerprint());
        let diff = difference(&d, &a.definition_json());
        assert!(diff.contains("fleet caps differ"), "{diff}");
        assert!(!diff.contains("label sets"), "{diff}");
    }

    #[test]
    fn guard_closes_at_its_deadline_and_on_invalidate() {
        let g = LeaseGuard::new("0a0b0c0d", 3, Instant::now() + Duration::from_secs(60));
        assert_eq!(g.check().unwrap(), 3);
        g.renewed(2, Instant::now()); // an older epoch's answer is ignored
        assert!(g.is_valid());
        g.invalidate();
        assert!(matches!(
            g.check(),
            Err(FleetError::LeaseLapsed { epoch: 3, .. })
        ));
        g.rejoined(4, Instant::now() - Duration::from_millis(1));
        assert!(!g.is_valid());
    }
}
