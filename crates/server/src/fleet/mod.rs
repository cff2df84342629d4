//! This daemon as one host of a fleet: several daemons sharing one
//! PostgreSQL database serve as one scaler (see `docs/fleet.md`).
//!
//! What it owns: the host's membership (join, lease renewal, rejoin after a
//! lapse with reconciliation of its agents), leadership and the leader's
//! chores (lost hosts, the pending TTL), the claim loop that pulls the
//! fleet's queued scale requests and standalone jobs ([`jobs`]) into the
//! local engine, the settling of what a restarted host held, the binding of a claim to
//! its agent before any backend creates it, the follow-up of those agents until their
//! requests finish, the handover on shutdown, and the fleet's view for
//! `GET /v1/fleet`; fleet-wide reads and calls carried to an owner are
//! [`peer`]'s. The coordination itself (tables, locks, caps) is
//! `kici_fleet`'s; routing, admission and provisioning stay the engine's.
//!
//! A scale request's path: any host routes it and writes it to the queue
//! before answering ([`FleetHost::enter_scale`]); the hosts serving its
//! pool are notified and one claims it (placement, then the fleet caps in
//! the claim transaction). The engine is asked before it admits: it holds
//! what the request needs ([`Runtime::hold`], recording nothing), the claim
//! is bound to the held agent under the host's lease epoch, and only then
//! is the request admitted ([`Runtime::admit_held`]) and its backend
//! called. The entry host serves a request it may take the same way, in one
//! transaction. Standalone jobs pass the spawn gate instead.

pub mod auth;
pub mod jobs;
pub mod peer;
pub mod settings;
pub mod view;

use crate::events::metrics::Metrics;
use crate::jobs::JobBook;
use crate::service::requests::StoredScale;
use kici_engine::runtime::{Coordinator, Runtime};
use kici_engine::{EndedAgent, HoldRefused, ScaleOutcome, ScaleRequest};
use kici_fleet::{
    Adopted, Caps, Claim, Enqueued, Entered, Fleet, FleetError, HostSpec, Leader, LeaseGuard,
    Membership, NewRequest, PoolDefinition, Queue, RequestKind, RequestState,
};
use kici_model::{AgentId, Config, InstanceId, JobId, ScalerName};
use parking_lot::Mutex;
use settings::FleetSettings;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

/// Finished requests, gone agents and departed hosts are purged after this.
const RETAIN: Duration = Duration::from_secs(3600);
/// A pool whose claim the local engine could not admit is not claimed from
/// again until a local agent ends or this passes.
const LOCAL_BUSY_BACKOFF: Duration = Duration::from_secs(1);

/// Why this host could not join its fleet.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("fleet {fleet:?}: {source}")]
    Fleet {
        fleet: String,
        #[source]
        source: FleetError,
    },
}

/// This daemon's place in its fleet. Cheap to clone.
#[derive(Clone)]
pub struct FleetHost(Arc<Inner>);

struct Inner {
    settings: FleetSettings,
    /// The fleet key and peer TLS: how calls to and from peers are trusted.
    auth: Arc<auth::PeerAuth>,
    fleet: Fleet,
    queue: Queue,
    guard: LeaseGuard,
    instance: InstanceId,
    runtime: Runtime,
    /// Standalone jobs this host runs (claimed from the fleet's queue).
    jobs: Arc<JobBook>,
    metrics: Arc<Metrics>,
    /// The pools (scaler names) this host joined with.
    pools: Vec<String>,
    /// Pools refused at join (defined differently on live hosts), with why.
    refused: Vec<String>,
    /// Claims whose agent is not bound yet, by job (the spawn gate takes
    /// them out).
    claimed: Mutex<HashMap<JobId, Claim>>,
    /// Agents started for this host's claims, and their jobs.
    bound: Mutex<HashMap<AgentId, JobId>>,
    /// Pools whose last claim the engine could not admit, and since when.
    busy: Mutex<HashMap<String, Instant>>,
    /// The live hosts serving each pool, as last read (every lease/3).
    serving: Mutex<HashMap<String, Vec<String>>>,
    /// One claim at a time on this host (the entry's and the loop's): the
    /// loads it decides on and the local capacity it checks stay true until
    /// its request is admitted, so a claim is not given back for want of a
    /// slot another claim of this host just took — which would let a
    /// younger request start before it.
    claiming: tokio::sync::Mutex<()>,
    leading: AtomicBool,
    /// Wakes the claim loop: local capacity freed, or a new request here.
    wake: Notify,
    stop: watch::Sender<bool>,
    membership: tokio::sync::Mutex<Option<Membership>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// Each scaler of `config` as a fleet pool: what must mean the same on every
/// host (type, label sets, fleet caps), and this host's own capacity.
pub fn pool_definitions(config: &Config) -> Vec<PoolDefinition> {
    config
        .scalers
        .iter()
        .map(|s| {
            let label_sets: Vec<serde_json::Value> = s
                .label_sets
                .iter()
                .map(|ls| {
                    serde_json::json!({
                        "labels": ls.labels.key(),
                        "resources": ls.resources,
                    })
                })
                .collect();
            let cap = s.ext.fleet_resource_cap.unwrap_or_default();
            PoolDefinition {
                name: s.name.as_str().to_owned(),
                label_sets: serde_json::json!({
                    "type": s.kind.to_string(),
                    "mandatoryLabels": s.mandatory_labels.key(),
                    "labelSets": label_sets,
                }),
                fleet_caps: Caps {
                    max_agents: s.ext.fleet_max_agents,
                    max_cpu: cap.max_cpu,
                    max_memory: cap.max_memory,
                },
                host_max_agents: Some(s.max_agents),
            }
        })
        .collect()
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

impl FleetHost {
    /// Connects (migrating the fleet schema, refusing a newer one), joins
    /// with every scaler of `config` as a pool — a pool defined differently
    /// on a live host is left out, reported in the log and in
    /// `GET /v1/fleet` —, takes back the fleet rows of the agents the
    /// engine recovered, installs the spawn gate and starts the lease,
    /// leader, claim and follow-up tasks.
    #[allow(clippy::too_many_arguments)]
    pub async fn join(
        settings: FleetSettings,
        auth: auth::PeerAuth,
        postgres: kici_store::SharedPostgres,
        instance: InstanceId,
        config: &Config,
        runtime: Runtime,
        jobs: Arc<JobBook>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, JoinError> {
        let err = |source| JoinError::Fleet {
            fleet: settings.name.clone(),
            source,
        };
        // The store's pool and session: the host's connections are one
        // budget (`database-connections`).
        let fleet = Fleet::on(postgres, &settings.name).await.map_err(err)?;
        let mut spec = HostSpec::new(instance, &hostname(), env!("CARGO_PKG_VERSION"));
        spec.url = settings.advertise_url.clone();
        spec.pools = pool_definitions(config);
        spec.global_caps = settings.global_caps;
        spec.lease = settings.lease;
        spec.margin = settings.lease / 3;
        spec.host_caps = serde_json::json!({
            "maxAgents": config.global_max_agents,
        });
        let mut refused = Vec::new();
        let membership = match fleet.join(spec.clone()).await {
            Ok(m) => m,
            Err(FleetError::PoolMismatch(mismatches)) => {
                let names: HashSet<&str> = mismatches.iter().map(|m| m.pool.as_str()).collect();
                for m in &mismatches {
                    tracing::error!(pool = %m.pool, hosts = ?m.hosts, difference = %m.difference,
                        "fleet: this host's definition of the pool differs from the live hosts'; it does not serve the pool");
                    refused.push(m.to_string());
                }
                spec.pools.retain(|p| !names.contains(p.name.as_str()));
                fleet.join(spec).await.map_err(err)?
            }
            Err(e) => return Err(err(e)),
        };
        let pools: Vec<String> = membership
            .spec()
            .pools
            .iter()
            .map(|p| p.name.clone())
            .collect();
        jobs.set_host(instance.to_string());
        let host = Self(Arc::new(Inner {
            auth: Arc::new(auth),
            queue: fleet.queue(),
            guard: membership.guard().clone(),
            settings,
            fleet,
            instance,
            runtime,
            jobs,
            metrics,
            pools,
            refused,
            claimed: Mutex::new(HashMap::new()),
            bound: Mutex::new(HashMap::new()),
            busy: Mutex::new(HashMap::new()),
            serving: Mutex::new(HashMap::new()),
            claiming: tokio::sync::Mutex::new(()),
            leading: AtomicBool::new(false),
            wake: Notify::new(),
            stop: watch::Sender::new(false),
            membership: tokio::sync::Mutex::new(Some(membership)),
            tasks: Mutex::new(Vec::new()),
        }));
        host.reconcile().await;
        host.settle_held().await;
        host.0
            .runtime
            .set_coordinator(Arc::new(FleetCoordinator(Arc::downgrade(&host.0))));
        let tasks = vec![
            tokio::spawn(host.clone().lease_loop()),
            tokio::spawn(host.clone().claim_loop()),
        ];
        *host.0.tasks.lock() = tasks;
        tracing::info!(
            fleet = %host.0.settings.name,
            epoch = host.0.guard.epoch(),
            pools = ?host.0.pools,
            url = ?host.0.settings.advertise_url,
            "joined the fleet"
        );
        Ok(host)
    }

    pub fn fleet(&self) -> &Fleet {
        &self.0.fleet
    }

    pub fn queue(&self) -> &Queue {
        &self.0.queue
    }

    pub fn instance(&self) -> InstanceId {
        self.0.instance
    }

    /// How this host signs its calls to peers and checks theirs.
    pub fn auth(&self) -> &auth::PeerAuth {
        &self.0.auth
    }

    pub fn refused_pools(&self) -> &[String] {
        &self.0.refused
    }

    fn serves(&self, pool: &str) -> bool {
        self.0.pools.iter().any(|p| p == pool)
    }

    // ------------------------------------------------------------- entry

    /// A scale request arriving at this host: routed by the local engine,
    /// written to the fleet's queue (committed before the answer), tried at
    /// once here when this host serves its pool, and answered from where
    /// it is now. `body` is the request as the caller sent it (its stored
    /// text is the dedupe key).
    pub async fn enter_scale(
        &self,
        body: &StoredScale,
        request: ScaleRequest,
    ) -> Result<(ScaleOutcome, Vec<String>), EntryError> {
        let rt = &self.0.runtime;
        let (pool, resources) = match rt.call(|e, _| e.classify(&request)) {
            Ok(route) => route,
            // Final answers: nothing is queued for a request no pool takes.
            Err(outcome) => return Ok((outcome, Vec::new())),
        };
        let outcome = self
            .enter_routed(body, request, pool.as_str(), resources)
            .await?;
        Ok((outcome, self.hosts_serving(pool.as_str())))
    }

    /// The live hosts serving `pool` (instance ids), as last read.
    pub fn hosts_serving(&self, pool: &str) -> Vec<String> {
        self.0.serving.lock().get(pool).cloned().unwrap_or_default()
    }

    /// [`FleetHost::enter_scale`] once routed to `pool`.
    async fn enter_routed(
        &self,
        body: &StoredScale,
        request: ScaleRequest,
        pool: &str,
        resources: kici_model::EffectiveResources,
    ) -> Result<ScaleOutcome, EntryError> {
        let job = request.job.clone();
        let body_json = body.text().map_err(|e| EntryError::Body(e.to_string()))?;
        let new = NewRequest {
            job_id: job.to_string(),
            kind: RequestKind::Scale,
            pool: pool.to_owned(),
            body: body_json,
            answer: String::new(),
            cpu: resources.requests.cpu,
            memory: resources.requests.memory,
            entry_host: self.0.instance.to_string(),
            secret: None,
        };
        if self.serves(pool) {
            if let Some(outcome) = self.enter_here(&new, request).await? {
                return Ok(outcome);
            }
        }
        // Not served here now: queued, and the pool's hosts are notified.
        match self.0.queue.enqueue(&new).await {
            Ok(Enqueued::New { .. } | Enqueued::Existing { .. }) => {}
            Err(FleetError::Conflict { .. }) => {
                return Err(EntryError::Conflict(job));
            }
            Err(e) => return Err(EntryError::Unavailable(e.to_string())),
        }
        self.answer(&job).await
    }

    /// The entry host serves the request itself when placement picks it and
    /// it has room. The engine first holds what the request needs (an idle
    /// warm agent or capacity for a new one), recording nothing; one
    /// transaction then writes the request already started with the held
    /// agent — if it is its pool's head and the fleet caps admit it — and
    /// only then does the engine admit it. Otherwise the hold is let go and
    /// the request stays queued (or was known already): nothing was
    /// admitted, so nothing is undone. `None`: not tried here (enqueue it).
    async fn enter_here(
        &self,
        new: &NewRequest,
        request: ScaleRequest,
    ) -> Result<Option<ScaleOutcome>, EntryError> {
        let inner = &self.0;
        let job = request.job.clone();
        let Some(_one) = self.may_take(&new.pool, Take::Entry).await else {
            return Ok(None);
        };
        // Refused when the engine knows the job already — also when the
        // claim loop served it while this call waited for the claim guard:
        // the queue has it too, and answers.
        let Ok(hold) = inner.runtime.hold(&request) else {
            return Ok(None);
        };
        let agent_id = hold.agent();
        let entered = inner
            .queue
            .enqueue_started(&inner.guard, new, &agent_id.to_string())
            .await;
        match entered {
            Ok(Entered::Started { .. }) => {}
            // Not this host's to serve: the hold is let go.
            Ok(Entered::Queued { .. } | Entered::Existing { .. }) => {
                drop(hold);
                return self.answer(&job).await.map(Some);
            }
            // Queued behind older requests; this host serves the oldest
            // instead, as any claim (still holding the claim guard).
            Ok(Entered::ClaimedHead { head, .. }) => {
                drop(hold);
                self.serve(head).await;
                return self.answer(&job).await.map(Some);
            }
            Err(FleetError::Conflict { .. }) => return Err(EntryError::Conflict(job)),
            // The fence is closed or moved: queued the ordinary way.
            Err(FleetError::LeaseLapsed { .. } | FleetError::StaleEpoch { .. }) => return Ok(None),
            Err(e) => return Err(EntryError::Unavailable(e.to_string())),
        }
        inner.bound.lock().insert(agent_id, job.clone());
        match inner.runtime.admit_held(hold) {
            Ok(outcome) => {
                inner.metrics.fleet_claim("started");
                Ok(Some(outcome))
            }
            Err(lapsed) => {
                // Recorded started with an agent that will never exist: as
                // for an agent that ended before it registered, the request
                // goes back to its place in the queue.
                tracing::warn!(job_id = %job, agent_id = %agent_id, reason = %lapsed,
                    "fleet: the held capacity lapsed before the request was admitted; queued again");
                self.finish(agent_id, "hold-lapsed", true).await;
                self.answer(&job).await.map(Some)
            }
        }
    }

    /// The answer to `job`'s request as it stands: from the local engine if
    /// this host serves it, else from the queue.
    async fn answer(&self, job: &JobId) -> Result<ScaleOutcome, EntryError> {
        if let Some(outcome) = self.0.runtime.call(|e, _| e.job_outcome(job)) {
            return Ok(outcome);
        }
        let view = self
            .0
            .queue
            .lookup(job.as_str())
            .await
            .map_err(|e| EntryError::Unavailable(e.to_string()))?;
        let Some(view) = view else {
            return Err(EntryError::Unavailable(format!(
                "request {job} left the queue while being answered; retry"
            )));
        };
        let agent = view
            .agent_id
            .as_deref()
            .and_then(|a| a.parse::<AgentId>().ok());
        let backend = self
            .0
            .runtime
            .call(|e, _| e.config().scaler(&view.pool).map(|s| s.kind));
        match (view.state, agent, backend) {
            (RequestState::Started | RequestState::Lost, Some(agent_id), Some(backend)) => {
                Ok(ScaleOutcome::Spawning {
                    agent_id,
                    scaler: ScalerName::new(&view.pool),
                    backend,
                    warm: false,
                })
            }
            _ => Ok(ScaleOutcome::Pending {
                position: usize::try_from(view.position).unwrap_or(usize::MAX),
            }),
        }
    }

    /// `DELETE /v1/scale/{jobId}` on a fleet host: the request is cancelled
    /// wherever this host can reach it — in the queue, or here.
    pub async fn cancel_scale(&self, job: &JobId) -> Result<bool, EntryError> {
        let queued = self
            .0
            .queue
            .cancel_queued(job.as_str())
            .await
            .map_err(|e| EntryError::Unavailable(e.to_string()))?;
        let local = self.0.runtime.cancel_scale(job);
        Ok(queued || local)
    }

    // ------------------------------------------------------------- claims

    /// One claim attempt in `pool`: placement first, then the claim (fleet
    /// caps in its transaction), then local admission. Returns whether a
    /// request was claimed (served or given back).
    async fn claim_from(&self, pool: &str) -> bool {
        let inner = &self.0;
        if let Some(since) = inner.busy.lock().get(pool) {
            if since.elapsed() < LOCAL_BUSY_BACKOFF {
                return false;
            }
        }
        let Some(_one) = self.may_take(pool, Take::Claim).await else {
            return false;
        };
        let claim = match inner.queue.claim(&inner.guard, &[pool.to_owned()]).await {
            Ok(Some(claim)) => claim,
            Ok(None) => return false,
            Err(e) => {
                inner.metrics.fleet_claim("error");
                tracing::warn!(error = %e, pool, "fleet: claim failed");
                return false;
            }
        };
        self.serve(claim).await;
        true
    }

    /// Whether this host may take a request of `pool` now — its fence is
    /// open, the engine has a slot in the pool's scaler, and placement picks
    /// it — holding the one claim this host makes at a time (the guard).
    async fn may_take(&self, pool: &str, take: Take) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        let inner = &self.0;
        if !inner.guard.is_valid() || *inner.stop.borrow() {
            return None;
        }
        let one = inner.claiming.lock().await;
        if !inner.runtime.call(|e, _| e.has_agent_slot(pool)) {
            return None;
        }
        match inner.queue.pool_loads(pool).await {
            Ok(loads) => {
                let pick = match take {
                    Take::Entry => kici_fleet::should_enter,
                    Take::Claim => kici_fleet::should_claim,
                };
                pick(inner.settings.placement, inner.instance, &loads).then_some(one)
            }
            Err(e) => {
                tracing::debug!(error = %e, pool, "fleet: reading the pool's loads failed");
                None
            }
        }
    }

    /// Admits a claimed request here, or gives it back.
    async fn serve(&self, claim: Claim) {
        if claim.kind == RequestKind::Job {
            return self.serve_job(claim).await;
        }
        let inner = &self.0;
        // The stored body, typed, read back and converted as at the entry.
        let request = match StoredScale::parse(&claim.body)
            .map_err(|e| e.to_string())
            .and_then(|stored| stored.into_request().map_err(|e| e.message))
        {
            Ok(r) => r,
            Err(e) => {
                // Written by a host of this fleet: unreadable means a newer
                // host wrote what this one cannot serve. Let another try.
                tracing::error!(job_id = %claim.job_id, error = %e, "fleet: a claimed request is unreadable here; given back");
                self.give_back(&claim, "error").await;
                return;
            }
        };
        // Asked before admitted: the engine holds what the request needs,
        // the claim is bound to the held agent, and only then is the
        // request admitted here.
        let job = request.job.clone();
        let hold = match inner.runtime.hold(&request) {
            Ok(hold) => hold,
            Err(HoldRefused::Final(outcome)) => {
                inner.metrics.fleet_claim("refused");
                let text = match outcome {
                    ScaleOutcome::TooLarge { detail, .. } => format!("too-large: {detail}"),
                    ScaleOutcome::NoBackend { explanation } => format!("no-backend: {explanation}"),
                    other => format!("{other:?}"),
                };
                if let Err(e) = inner
                    .queue
                    .complete(&claim.instance, &claim.job_id, &text)
                    .await
                {
                    tracing::warn!(job_id = %job, error = %e, "fleet: finishing a refused request failed");
                }
                return;
            }
            Err(refused) => {
                // No room here now (or the job is known here, or the engine
                // stops): another host, or this one later, serves it.
                tracing::debug!(job_id = %job, refused = ?refused, "fleet: no room for a claimed request here; given back");
                inner.busy.lock().insert(claim.pool.clone(), Instant::now());
                self.give_back(&claim, "released").await;
                return;
            }
        };
        let agent_id = hold.agent();
        if let Err(e) = inner
            .queue
            .start(&inner.guard, &claim, &agent_id.to_string())
            .await
        {
            drop(hold);
            tracing::warn!(job_id = %job, agent_id = %agent_id, error = %e,
                "fleet: the claim could not be bound; nothing is admitted");
            // Still ours under a lapsed lease: given back at once (always
            // safe) rather than when the leader finds it.
            self.give_back(&claim, "error").await;
            return;
        }
        inner.bound.lock().insert(agent_id, job.clone());
        match inner.runtime.admit_held(hold) {
            Ok(_) => inner.metrics.fleet_claim("started"),
            Err(lapsed) => {
                tracing::warn!(job_id = %job, agent_id = %agent_id, reason = %lapsed,
                    "fleet: the held capacity lapsed before the request was admitted; queued again");
                self.finish(agent_id, "hold-lapsed", true).await;
            }
        }
    }

    /// A warm agent took a claimed request: no spawn passes the gate, so
    /// the claim is bound here (or the agent given up).
    async fn bind_warm(&self, job: &JobId, agent_id: AgentId) {
        let inner = &self.0;
        let claim = inner.claimed.lock().remove(job);
        if let Some(claim) = claim {
            if let Err(e) = inner
                .queue
                .start(&inner.guard, &claim, &agent_id.to_string())
                .await
            {
                tracing::warn!(job_id = %job, agent_id = %agent_id, error = %e,
                    "fleet: the warm agent could not be bound to its claim; giving it up");
                // Bound to the job already: a registered agent is not
                // unbound by a cancel, so it is given up.
                inner.bound.lock().remove(&agent_id);
                let _ = inner.runtime.destroy_agent(agent_id);
            }
        }
    }

    async fn give_back(&self, claim: &Claim, result: &'static str) {
        self.0.metrics.fleet_claim(result);
        if let Err(e) = self.0.queue.release(claim).await {
            // The claim stays until this host's lease lapses; the leader
            // then returns it.
            tracing::warn!(job_id = %claim.job_id, error = %e, "fleet: giving a claim back failed");
        }
    }

    async fn claim_loop(self) {
        let inner = Arc::clone(&self.0);
        let mut stop = inner.stop.subscribe();
        let mut waker = inner.fleet.waker(&inner.pools);
        loop {
            if *stop.borrow() {
                return;
            }
            let mut progressed = false;
            for pool in &inner.pools {
                while self.claim_from(pool).await {
                    progressed = true;
                    if *stop.borrow() {
                        return;
                    }
                }
            }
            if progressed {
                continue;
            }
            tokio::select! {
                _ = waker.wait() => {}
                _ = inner.wake.notified() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    // -------------------------------------------------------- follow-up

    /// An agent of this host is gone (told by the engine through the
    /// coordinator port, once per agent): its request is finished — or, if
    /// the agent ended before anybody could give it its job, queued again —
    /// and the claim loop woken (local capacity freed). Every lease/3 the
    /// requests of agents the engine no longer has are finished from its
    /// state too ([`FleetHost::finish_vanished`]): an end that came before
    /// the coordinator was installed, or whose recording failed, is caught
    /// up there.
    async fn on_ended(&self, ended: &EndedAgent) {
        // Shutting down: [`FleetHost::leave`] finishes what its agents held,
        // as "host shut down", once they are destroyed.
        if *self.0.stop.borrow() {
            return;
        }
        let outcome = match ended.failure {
            Some(r) => format!("agent ended: {r}"),
            None => "agent ended".to_owned(),
        };
        // These failures only happen before an agent registers (the engine
        // fails a registered agent only for the pending-dispatch timeout or
        // its lifetime): nobody could have given it the job, so a scale
        // request goes back to the fleet's queue at its place — never to the
        // engine's own, which would admit it outside the fleet's caps.
        self.finish(ended.agent, &outcome, ended.before_dispatch())
            .await;
        self.0.busy.lock().clear();
        self.0.wake.notify_one();
    }

    async fn finish(&self, agent: AgentId, outcome: &str, unstarted: bool) {
        let Some(job) = self.0.bound.lock().remove(&agent) else {
            return;
        };
        self.0.claimed.lock().remove(&job);
        let me = self.0.instance.to_string();
        // A standalone job is in this host's job book, and ends with its
        // agent (never served twice); a scale request whose agent never
        // registered is served again.
        if unstarted && self.0.jobs.view(&job).is_none() {
            match self.0.queue.requeue(&me, job.as_str()).await {
                Ok(true) => {
                    tracing::info!(job_id = %job, agent_id = %agent, reason = %outcome, "fleet: a request whose agent never registered is queued again");
                    return;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(job_id = %job, error = %e, "fleet: re-queueing a request failed");
                    self.0.bound.lock().insert(agent, job);
                    return;
                }
            }
        }
        let outcome = self.outcome_of(&job, outcome).await;
        if let Err(e) = self.0.queue.complete(&me, job.as_str(), &outcome).await {
            // Left `started`: finished by the next sweep of vanished agents.
            tracing::warn!(job_id = %job, error = %e, "fleet: finishing a request failed");
            self.0.bound.lock().insert(agent, job);
        }
    }

    /// Gives back the claims no agent will bind: their job is no longer the
    /// engine's (its admission was cancelled or its agent ended before the
    /// spawn gate took the claim). Under the claim guard, so a claim being
    /// served right now (recorded just before the engine admits it) is not
    /// taken for one.
    async fn release_orphaned_claims(&self) {
        let inner = &self.0;
        let _one = inner.claiming.lock().await;
        let jobs: Vec<JobId> = inner.claimed.lock().keys().cloned().collect();
        let unknown: Vec<JobId> = jobs
            .into_iter()
            .filter(|job| inner.runtime.call(|e, _| e.job_outcome(job)).is_none())
            .collect();
        let orphaned: Vec<Claim> = {
            let mut claimed = inner.claimed.lock();
            unknown.iter().filter_map(|j| claimed.remove(j)).collect()
        };
        for claim in orphaned {
            // A job that ended before its agent was bound (cancelled, say)
            // is finished, never served again.
            if let Some(outcome) = self.ended_here(&claim.job_id) {
                if let Err(e) = inner
                    .queue
                    .complete(&claim.instance, &claim.job_id, &outcome)
                    .await
                {
                    tracing::warn!(job_id = %claim.job_id, error = %e, "fleet: finishing an ended job failed");
                }
                continue;
            }
            tracing::warn!(job_id = %claim.job_id, "fleet: a claim no agent took is given back");
            self.give_back(&claim, "released").await;
        }
    }

    /// Finishes the requests of bound agents the engine no longer has (an
    /// event was missed, or a completion failed to reach the database).
    async fn finish_vanished(&self) {
        let live = self.0.runtime.live_agent_ids();
        let gone: Vec<AgentId> = self
            .0
            .bound
            .lock()
            .keys()
            .filter(|a| !live.contains(a))
            .copied()
            .collect();
        for agent in gone {
            // Its last view says how it ended, while the engine keeps it.
            let failure = self
                .0
                .runtime
                .call(|e, now| e.agent(agent, now))
                .and_then(|view| view.failure_reason);
            let ended = EndedAgent {
                agent,
                job: None,
                failure,
            };
            self.on_ended(&ended).await;
        }
    }

    // ------------------------------------------------------ lease, leader

    async fn lease_loop(self) {
        let inner = Arc::clone(&self.0);
        let mut stop = inner.stop.subscribe();
        let mut leader = inner.fleet.leader(inner.instance);
        // Renewals every lease/3; the leader's checks twice as often, so a
        // lapsed lease is acted on within lease/6 of its expiry.
        let every = (inner.settings.lease / 6).max(Duration::from_millis(250));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut leading_since = Instant::now();
        let mut round: u64 = 0;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            round += 1;
            if round % 2 == 1 {
                self.renew().await;
            }
            let leading = match leader.try_lead().await {
                Ok(l) => l,
                Err(e) => {
                    tracing::debug!(error = %e, "fleet: leadership check failed");
                    false
                }
            };
            if leading != inner.leading.swap(leading, Ordering::Relaxed) {
                tracing::info!(leading, "fleet: leadership changed");
                leading_since = Instant::now();
            }
            inner.metrics.set_fleet_leader(leading);
            // A new leader lets half a lease pass before its first chores:
            // leadership changes when sessions drop — the old leader's, or
            // everyone's when the database restarted — and every live host
            // renews (or rejoins) within a third of a lease. Declaring them
            // lost at once would move work that is still served.
            if leading && leading_since.elapsed() >= inner.settings.lease / 2 {
                self.chores(&leader).await;
            }
            if round % 2 == 1 {
                self.finish_vanished().await;
                self.release_orphaned_claims().await;
                self.refresh_view().await;
            }
        }
        leader.step_down().await;
        inner.metrics.set_fleet_leader(false);
    }

    /// Renews the lease; a lease found lost is taken anew (new epoch), then
    /// this host's agents are reconciled against the queue.
    async fn renew(&self) {
        let mut guard = self.0.membership.lock().await;
        let Some(membership) = guard.as_mut() else {
            return;
        };
        match membership.renew().await {
            Ok(()) => {}
            Err(FleetError::LeaseLost { epoch, .. }) => {
                tracing::warn!(
                    epoch,
                    "fleet: the lease was lost (this host was silent too long); rejoining"
                );
                match membership.rejoin().await {
                    Ok(epoch) => {
                        tracing::info!(epoch, "fleet: rejoined");
                        drop(guard);
                        self.reconcile().await;
                    }
                    Err(e) => tracing::warn!(error = %e, "fleet: rejoining failed; retrying"),
                }
            }
            Err(e) => {
                // The local fence closes on its own before the database's
                // lease could expire: claiming and starting stop meanwhile.
                tracing::warn!(error = %e, valid = self.0.guard.is_valid(), "fleet: renewing the lease failed");
            }
        }
    }

    /// After a (re)join: each agent the engine runs for a job is taken back
    /// under the current epoch if its request is still this host's, else
    /// destroyed (another host serves it now). Claims from older epochs
    /// went back to the queue with the rejoin.
    async fn reconcile(&self) {
        let inner = &self.0;
        // Claims of the old epoch whose agent was not bound yet (waiting for
        // a spawn slot, say) went back to the queue with the rejoin: their
        // agents must never be created.
        let void: Vec<JobId> = inner.claimed.lock().drain().map(|(job, _)| job).collect();
        for job in void {
            inner.runtime.cancel_scale(&job);
        }
        let agents = inner.runtime.agents(false);
        for a in agents {
            let Some(job) = a.job_id.clone() else {
                continue;
            };
            match inner
                .queue
                .adopt(&inner.guard, &a.agent_id.to_string())
                .await
            {
                Ok(Adopted::Live) => {
                    inner.bound.lock().insert(a.agent_id, job);
                }
                Ok(verdict @ (Adopted::NotOurs | Adopted::OverCap)) => {
                    tracing::warn!(agent_id = %a.agent_id, job_id = %job, ?verdict,
                        "fleet: an agent's request is no longer this host's; destroying it");
                    inner.bound.lock().remove(&a.agent_id);
                    if a.mode == kici_engine::Mode::Standalone {
                        inner
                            .jobs
                            .abort(&job, crate::jobs::HOST_LOST_WHILE_RUNNING.to_owned());
                    }
                    let _ = inner.runtime.destroy_agent(a.agent_id);
                }
                Err(e) => {
                    tracing::warn!(agent_id = %a.agent_id, error = %e, "fleet: reconciling an agent failed")
                }
            }
        }
    }

    /// At start-up: the requests this host held with an agent that did not
    /// survive the restart (the recovery destroyed it, or it died) are
    /// settled — served again if the agent never registered, else
    /// finished with what this host knows of them. Nothing else would: the
    /// host's lease is live again, so the leader does not touch them.
    async fn settle_held(&self) {
        let inner = &self.0;
        let me = inner.instance.to_string();
        let held = match inner.queue.held(&me).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "fleet: reading this host's requests failed");
                return;
            }
        };
        let adopted: HashSet<String> = inner.bound.lock().keys().map(|a| a.to_string()).collect();
        for h in held {
            if h.agent_id.as_ref().is_some_and(|a| adopted.contains(a)) {
                continue;
            }
            let Ok(job) = h.job_id.parse::<JobId>() else {
                continue;
            };
            let result = if h.registered {
                // A job's record was restored ended (aborted by the restart).
                let outcome = self
                    .ended_here(&h.job_id)
                    .unwrap_or_else(|| "agent ended: kici-scaler restarted".to_owned());
                inner.queue.complete(&me, &h.job_id, &outcome).await
            } else {
                // Served again, elsewhere maybe: this host's record of the
                // job (aborted by the restart) would shadow the new run.
                if h.kind == RequestKind::Job {
                    inner.jobs.remove(&job);
                }
                inner.queue.requeue(&me, &h.job_id).await
            };
            match result {
                Ok(_) => {
                    tracing::info!(job_id = %h.job_id, requeued = !h.registered,
                        "fleet: a request whose agent did not survive the restart was settled")
                }
                Err(e) => {
                    tracing::warn!(job_id = %h.job_id, error = %e, "fleet: settling a request failed")
                }
            }
        }
    }

    async fn chores(&self, leader: &Leader) {
        let inner = &self.0;
        let report = match leader.run_chores(RETAIN).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "fleet: the leader's chores failed");
                return;
            }
        };
        if !report.lost_hosts.is_empty() {
            inner.metrics.fleet_failovers(report.lost_hosts.len());
        }
        // The pending TTL holds in the fleet's queue as on a single host.
        let ttl = inner.runtime.call(|e, _| e.settings().pending_ttl);
        match leader.expire_queued(ttl).await {
            Ok(expired) => {
                for job in expired {
                    tracing::warn!(job_id = %job, ttl_seconds = ttl.as_secs(),
                        "fleet: a request waited in the queue past the pending TTL; it ends expired");
                }
            }
            Err(e) => tracing::warn!(error = %e, "fleet: expiring old requests failed"),
        }
        for h in &report.lost_hosts {
            tracing::warn!(instance = %h.instance_id, hostname = %h.hostname, epoch = h.epoch,
                "fleet: host lost (lease expired); its unstarted requests return to the queue");
        }
        for job in &report.aborted_jobs {
            tracing::warn!(job_id = %job, "fleet: a standalone job ran on a lost host; it ends aborted (host lost)");
        }
        for job in &report.requeued {
            tracing::info!(job_id = %job, "fleet: a lost host's claim returned to the queue");
        }
        for a in &report.lost_agents {
            tracing::warn!(agent_id = %a.agent_id, instance = %a.instance_id, job_id = ?a.job_id,
                registered = a.registered, "fleet: agent lost with its host");
            // An agent that never registered never got its job: serve the
            // request again elsewhere. A registered one's job belongs to the
            // orchestrator, which sees the agent disconnect.
            if let (false, Some(job)) = (a.registered, &a.job_id) {
                if let Err(e) = inner.queue.requeue(&a.instance_id, job).await {
                    tracing::warn!(job_id = %job, error = %e, "fleet: requeueing a lost agent's request failed");
                }
            }
        }
    }

    /// Reads the fleet's hosts and queue depths into the metrics.
    async fn refresh_view(&self) {
        let Ok(hosts) = kici_fleet::membership::hosts(&self.0.fleet).await else {
            return;
        };
        let count = |state: &str| hosts.iter().filter(|h| h.state == state).count() as i64;
        let mut serving: HashMap<String, Vec<String>> = HashMap::new();
        for h in hosts
            .iter()
            .filter(|h| h.state == "up" || h.state == "leaving")
        {
            for pool in &h.pools {
                serving
                    .entry(pool.clone())
                    .or_default()
                    .push(h.instance_id.clone());
            }
        }
        for hosts in serving.values_mut() {
            hosts.sort();
        }
        *self.0.serving.lock() = serving;
        let states: Vec<(&'static str, i64)> = crate::events::metrics::FLEET_HOST_STATES
            .iter()
            .map(|s| (*s, count(s)))
            .collect();
        let mut depths = Vec::new();
        for pool in &self.0.pools {
            if let Ok(d) = self.0.queue.depth(pool).await {
                depths.push((pool.clone(), i64::try_from(d).unwrap_or(i64::MAX)));
            }
        }
        self.0.metrics.set_fleet_view(&states, &depths);
    }

    // ---------------------------------------------------------- shutdown

    /// SIGTERM, before the agents are destroyed: stop claiming and hand the
    /// claimed-but-unstarted requests back to the queue at once (not after
    /// the lease expires), so other hosts serve them now.
    pub async fn hand_back(&self) {
        self.0.stop.send_replace(true);
        let guard = self.0.membership.lock().await;
        if let Some(m) = guard.as_ref() {
            match m.hand_back().await {
                Ok(jobs) => {
                    tracing::info!(returned = jobs.len(), "fleet: claimed requests handed back")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fleet: handing claims back failed; the leader returns them when the lease expires")
                }
            }
        }
    }

    /// After the agents were destroyed: the requests of this host's agents
    /// are finished and the host leaves the fleet (its row `left`).
    pub async fn leave(&self) {
        self.0.stop.send_replace(true);
        let agents: Vec<AgentId> = self.0.bound.lock().keys().copied().collect();
        for agent in agents {
            self.finish(agent, "host shut down", false).await;
        }
        let tasks = std::mem::take(&mut *self.0.tasks.lock());
        for t in tasks {
            t.abort();
        }
        let membership = self.0.membership.lock().await.take();
        if let Some(m) = membership {
            if let Err(e) = m.leave().await {
                tracing::warn!(error = %e, "fleet: leaving failed; the leader declares this host lost when its lease expires");
            }
        }
        // The pool and the session are the store's: closed with it, which
        // also releases leadership if this host held it.
        tracing::info!("left the fleet");
    }
}

/// What [`FleetHost::may_take`] is asked for: a request entering through
/// this host, or a claim from the queue (placement differs; see
/// [`kici_fleet::should_enter`]).
#[derive(Debug, Clone, Copy)]
enum Take {
    Entry,
    Claim,
}

/// Why a request could not be entered into the fleet's queue.
#[derive(Debug, thiserror::Error)]
pub enum EntryError {
    #[error("job {0} was already requested with a different body")]
    Conflict(JobId),
    #[error("the fleet's database is unavailable: {0}")]
    Unavailable(String),
    #[error("the request body cannot be recorded: {0}")]
    Body(String),
}

/// The engine's coordinator: an agent for a fleet claim is bound to it
/// (recorded `live` under this host's epoch, fenced) before its backend
/// creates it, and its registration is recorded before the engine accepts
/// it.
struct FleetCoordinator(std::sync::Weak<Inner>);

/// Every failpoint of the fleet's host side (see the daemon's crashpoints):
/// - `kici_scaler::registration::record`: recording an agent's registration
///   fails as a database error would.
pub const FAILPOINTS: &[&str] = &[REGISTRATION_FAILPOINT];
const REGISTRATION_FAILPOINT: &str = "kici_scaler::registration::record";

/// Attempts at recording a registration before it is refused, and the
/// pause between them: a transient database error costs the agent a moment,
/// not its registration.
const REGISTRATION_ATTEMPTS: u32 = 4;
const REGISTRATION_RETRY: Duration = Duration::from_millis(250);

/// Whether the registration failpoint fires now (never without the
/// `failpoints` feature).
fn registration_fails_here() -> bool {
    fail::fail_point!(REGISTRATION_FAILPOINT, |_| true);
    false
}

#[async_trait::async_trait]
impl Coordinator for FleetCoordinator {
    async fn agent_ended(&self, ended: EndedAgent) {
        if let Some(inner) = self.0.upgrade() {
            FleetHost(inner).on_ended(&ended).await;
        }
    }

    async fn record_registration(&self, agent: AgentId) -> Result<(), String> {
        let Some(inner) = self.0.upgrade() else {
            return Ok(());
        };
        // Agents of this host's fleet requests only (a warm agent has none).
        if !inner.bound.lock().contains_key(&agent) {
            return Ok(());
        }
        let me = inner.instance.to_string();
        let id = agent.to_string();
        let mut last = String::new();
        for attempt in 1..=REGISTRATION_ATTEMPTS {
            let recorded = if registration_fails_here() {
                Err(FleetError::Unavailable(format!(
                    "failpoint {REGISTRATION_FAILPOINT}"
                )))
            } else {
                inner.queue.mark_registered(&me, &id).await
            };
            match recorded {
                // `false`: recorded already (the agent registered again).
                Ok(_) => return Ok(()),
                Err(e) => {
                    tracing::warn!(agent_id = %agent, attempt, error = %e, "fleet: recording a registration failed");
                    last = e.to_string();
                }
            }
            if attempt < REGISTRATION_ATTEMPTS {
                tokio::time::sleep(REGISTRATION_RETRY).await;
            }
        }
        Err(format!(
            "the fleet could not record the registration: {last}"
        ))
    }

    async fn may_spawn(&self, agent: AgentId, job: Option<&JobId>) -> Result<(), String> {
        let (Some(inner), Some(job)) = (self.0.upgrade(), job) else {
            return Ok(());
        };
        // Not a fleet claim (a standalone job, or a warm spawn): ungated.
        let Some(claim) = inner.claimed.lock().remove(job) else {
            return Ok(());
        };
        match inner
            .queue
            .start(&inner.guard, &claim, &agent.to_string())
            .await
        {
            Ok(()) => Ok(()),
            Err(e) => {
                inner.bound.lock().remove(&agent);
                tracing::warn!(job_id = %job, agent_id = %agent, error = %e,
                    "fleet: the claim could not be bound; the agent is not created");
                // Still ours under a lapsed lease: give it back at once
                // (always safe) rather than when the leader finds it.
                if let Err(e) = inner.queue.release(&claim).await {
                    tracing::debug!(job_id = %job, error = %e, "fleet: giving the claim back failed");
                }
                Err(format!("the fleet claim could not be bound: {e}"))
            }
        }
    }
}
