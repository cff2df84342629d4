//! The fleet's one queue (`fleet_requests`) and the agents started for it
//! (`fleet_agents`): enqueue with fleet-wide dedupe, claim under the fleet
//! caps, start, release, complete, and the [`Waker`] that tells a host when
//! to try claiming.
//!
//! A request's life: `queued` → `claimed` (by a host under an epoch) →
//! `started` (an agent bound; an agent row `live`) → `finished`. A claim
//! goes back to `queued` — keeping its `seq`, so its original place — when
//! the host releases it, hands it back, rejoins, or is declared lost. A
//! started request whose host was declared lost is `lost` (its agent too)
//! until its host finishes it or the daemon [`Queue::requeue`]s it.
//!
//! **Caps cannot be exceeded.** Usage of a pool is the claimed requests
//! plus the live agents in it (starting turns one into the other in one
//! transaction, so the sum does not move). A claim locks the pool's
//! `fleet_pools` row (and the fleet's `fleet_fleets` row when a global cap
//! is set) `FOR UPDATE` before it reads the usage, and adds to it before
//! committing; any other claim that could add to the same sums waits on the
//! same row, and under READ COMMITTED its usage query, a later statement,
//! sees the first claim committed. Nothing else increases usage. So the
//! check and the increase are atomic with respect to every other increase.
//!
//! **A request never has two claims.** The claim is an UPDATE of the
//! request row from `queued` to `claimed`, on a row locked `FOR UPDATE SKIP
//! LOCKED`; PostgreSQL re-checks the row after the lock and a row another
//! claim took is no longer `queued`. A started agent is bound only if the
//! request is still claimed by this host under this host's current epoch
//! (checked under a share lock on the host row, which the leader's
//! "declare lost" must wait for), so work from a lapsed lease cannot start.

use crate::error::FleetError;
use crate::membership::{Caps, LeaseGuard};
use crate::placement::HostLoad;
use crate::{non_negative, notify, to_db, Fleet, CHANNEL};
use kici_model::{InstanceId, MemoryBytes, MilliCpu};
use kici_store::Notice;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};
use std::collections::HashSet;
use std::time::Duration;

/// What kind of work a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// An orchestrator's scale request.
    Scale,
    /// A standalone job.
    Job,
}

impl RequestKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Scale => "scale",
            Self::Job => "job",
        }
    }

    fn parse(s: &str) -> Result<Self, FleetError> {
        match s {
            "scale" => Ok(Self::Scale),
            "job" => Ok(Self::Job),
            other => Err(FleetError::Corrupt {
                table: "fleet_requests",
                reason: format!("unknown kind `{other}`"),
            }),
        }
    }
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestState {
    /// Waiting to be claimed.
    Queued,
    /// Claimed by a host, no agent yet.
    Claimed,
    /// An agent was started for it.
    Started,
    /// Its host was declared lost while its agent ran.
    Lost,
    /// Done.
    Finished,
}

impl RequestState {
    fn parse(s: &str) -> Result<Self, FleetError> {
        Ok(match s {
            "queued" => Self::Queued,
            "claimed" => Self::Claimed,
            "started" => Self::Started,
            "lost" => Self::Lost,
            "finished" => Self::Finished,
            other => {
                return Err(FleetError::Corrupt {
                    table: "fleet_requests",
                    reason: format!("unknown state `{other}`"),
                })
            }
        })
    }
}

/// A request as the entry host writes it, routed to its pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    /// The job id: the fleet-wide dedupe key.
    pub job_id: String,
    /// Scale request or standalone job.
    pub kind: RequestKind,
    /// The pool it was routed to.
    pub pool: String,
    /// The request body (canonical JSON as the daemon renders it): a second
    /// request with this job id is the same request iff its body is equal.
    pub body: String,
    /// What the claiming host needs but must not be kept once the request
    /// finished (a standalone job's environment): handed over with the
    /// claim, erased at the end, not compared for dedupe.
    pub secret: Option<String>,
    /// The answer the entry host gives (and any host gives again to a
    /// duplicate).
    pub answer: String,
    /// CPU the agent will reserve (for the fleet resource caps).
    pub cpu: MilliCpu,
    /// Memory the agent will reserve.
    pub memory: MemoryBytes,
    /// The instance id of the entry host.
    pub entry_host: String,
}

/// The outcome of [`Queue::enqueue`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enqueued {
    /// Written; `seq` is its place in arrival order.
    New {
        /// Arrival order.
        seq: i64,
    },
    /// The same request (same job id, same body) was already in the fleet:
    /// answer as it was answered.
    Existing {
        /// The answer recorded with the first.
        answer: String,
        /// Where it is now.
        state: RequestState,
    },
}

/// The host that owns an agent or a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// Its instance id.
    pub instance: String,
    /// Its advertised control API (None: it advertised none).
    pub url: Option<String>,
}

/// One request, as any host reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestView {
    /// Job id.
    pub job_id: String,
    /// Its pool.
    pub pool: String,
    /// Scale request or standalone job.
    pub kind: RequestKind,
    /// The body as enqueued.
    pub body: String,
    /// Where it is.
    pub state: RequestState,
    /// The host holding it (claimed, started, lost, or finished by it).
    pub host: Option<String>,
    /// Its agent, once started.
    pub agent_id: Option<String>,
    /// How it finished.
    pub outcome: Option<String>,
    /// Among its pool's queued requests, its place (1 = next); 0 when not
    /// queued.
    pub position: u64,
}

/// A request a host holds with an agent (started, or lost while it ran).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Job id.
    pub job_id: String,
    /// Scale request or standalone job.
    pub kind: RequestKind,
    /// The agent started for it.
    pub agent_id: Option<String>,
    /// Whether that agent registered (then its job may have begun).
    pub registered: bool,
}

/// The outcome of [`Queue::enqueue_started`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entered {
    /// Written, claimed and started with the caller's agent.
    Started {
        /// Arrival order.
        seq: i64,
    },
    /// Written and queued (an older request waits, or a cap is reached):
    /// the caller's agent must not be created.
    Queued {
        /// Arrival order.
        seq: i64,
    },
    /// Written and queued behind older requests; the caller's host, which
    /// has room, claimed the pool's head instead (FIFO): its agent for this
    /// request must not be created, and it serves `head` as any claim.
    ClaimedHead {
        /// Arrival order.
        seq: i64,
        /// The pool's oldest request, claimed by the caller.
        head: Claim,
    },
    /// The same request was in the fleet already (see
    /// [`Enqueued::Existing`]): the caller's agent must not be created.
    Existing {
        /// The answer recorded with the first.
        answer: String,
        /// Where it is now.
        state: RequestState,
    },
}

/// A request claimed by this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Job id.
    pub job_id: String,
    /// Pool.
    pub pool: String,
    /// Kind.
    pub kind: RequestKind,
    /// Body as enqueued.
    pub body: String,
    /// The secret part as enqueued.
    pub secret: Option<String>,
    /// Arrival order (kept across returns to the queue).
    pub seq: i64,
    /// Claim order (within a pool it follows arrival order).
    pub claim_seq: i64,
    /// The claiming host.
    pub instance: String,
    /// The epoch the claim was made under.
    pub epoch: i64,
    /// CPU reserved against the fleet caps.
    pub cpu: MilliCpu,
    /// Memory reserved against the fleet caps.
    pub memory: MemoryBytes,
    /// Arrival time (database clock, unix ms).
    pub arrived_at: i64,
}

/// Usage of a pool or of the whole fleet: claimed requests plus live agents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Count.
    pub agents: u64,
    /// Summed CPU.
    pub cpu: u64,
    /// Summed memory.
    pub memory: u64,
}

impl Usage {
    /// Whether one more of (`cpu`, `memory`) fits under `caps`.
    pub fn admits(&self, caps: &Caps, cpu: u64, memory: u64) -> bool {
        caps.max_agents
            .is_none_or(|m| self.agents.saturating_add(1) <= u64::from(m))
            && caps
                .max_cpu
                .is_none_or(|m| self.cpu.saturating_add(cpu) <= m.millis())
            && caps
                .max_memory
                .is_none_or(|m| self.memory.saturating_add(memory) <= m.bytes())
    }
}

/// The outcome of [`Queue::adopt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adopted {
    /// The agent is this host's again, under the current epoch: keep it.
    Live,
    /// Its request is no longer this host's (another host may serve it),
    /// or the agent is unknown or gone: destroy it.
    NotOurs,
    /// It was marked lost and the caps no longer have room for it.
    OverCap,
}

/// The fleet's queue. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Queue {
    fleet: Fleet,
}

/// The fleet's usage: the sum of its pools' counters (kept exact by the
/// triggers of migration 4), one row per pool, not per agent.
const USAGE_FLEET: &str = "SELECT COALESCE(sum(used_agents), 0)::BIGINT AS n, \
        COALESCE(sum(used_cpu), 0)::BIGINT AS cpu, COALESCE(sum(used_memory), 0)::BIGINT AS mem \
      FROM fleet_pools WHERE fleet = $1";

fn usage_row(r: &PgRow) -> Result<Usage, FleetError> {
    Ok(Usage {
        agents: non_negative("fleet_requests", "count", r.try_get("n")?)?,
        cpu: non_negative("fleet_requests", "milli_cpu", r.try_get("cpu")?)?,
        memory: non_negative("fleet_requests", "memory_bytes", r.try_get("mem")?)?,
    })
}

/// Why one pool gave no claim.
enum PoolAttempt {
    Claimed(Claim),
    Empty,
    AtCap,
    /// Its row stayed locked past [`CLAIM_LOCK_TIMEOUT`].
    Busy,
}

/// Attempts of a transaction rolled back to break a deadlock.
const DEADLOCK_ATTEMPTS: u32 = 3;

/// Runs `transaction` again (up to [`DEADLOCK_ATTEMPTS`] in all) when
/// PostgreSQL rolled it back to break a deadlock: nothing of it was
/// written, and the other side has gone on by the time it is retried.
async fn retry_on_deadlock<T, F, Fut>(mut transaction: F) -> Result<T, FleetError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, FleetError>>,
{
    let mut attempt = 1;
    loop {
        match transaction().await {
            Err(FleetError::Deadlock) if attempt < DEADLOCK_ATTEMPTS => attempt += 1,
            other => return other,
        }
    }
}

/// How long a claim waits for its pool's (and the fleet's) row.
const CLAIM_LOCK_TIMEOUT: &str = "200ms";

impl Queue {
    pub(crate) fn new(fleet: Fleet) -> Self {
        Self { fleet }
    }

    /// Writes a request to the queue (committed before this returns, so the
    /// entry host may answer). A request whose job id is already in the
    /// fleet and not finished is not written again: same body →
    /// [`Enqueued::Existing`] with the first answer; different body →
    /// [`FleetError::Conflict`]. The same body again after the first one
    /// finished is a new request (queued anew, at the back). The pool's
    /// listeners are notified at commit.
    pub async fn enqueue(&self, req: &NewRequest) -> Result<Enqueued, FleetError> {
        // A repeat of a request still in the fleet (a client's retry, the
        // same job sent through a second host) is answered from a plain
        // read, taking no lock: the insert below would lock the pool's row
        // and then wait on the request's row, the reverse of the order in
        // which starting or completing that request locks them (its row,
        // then the pool's through the usage trigger).
        if let Some((answer, state)) = self.recorded(req).await? {
            if state != RequestState::Finished {
                return Ok(Enqueued::Existing { answer, state });
            }
        }
        // A deadlock is still possible when the request's row is re-queued
        // or changes between the read and the insert; PostgreSQL then rolls
        // one back, and an enqueue rolled back is tried again.
        retry_on_deadlock(|| self.enqueue_once(req)).await
    }

    async fn enqueue_once(&self, req: &NewRequest) -> Result<Enqueued, FleetError> {
        let name = self.fleet.name();
        let mut tx = self.fleet.pool().begin().await?;
        // The pool's row, shared until commit: an arrival's place (`seq`)
        // is taken at its insert, so a request entered and started at once
        // elsewhere ([`Queue::enqueue_started`], which locks the row for
        // update) or a claim must wait until this one is visible — else a
        // later arrival could start while this earlier one is not yet seen
        // queued. Arrivals do not wait for each other.
        sqlx::query("SELECT 1 FROM fleet_pools WHERE fleet = $1 AND pool = $2 FOR SHARE")
            .bind(name)
            .bind(&req.pool)
            .execute(&mut *tx)
            .await?;
        if let Some(seq) = insert_request(&mut tx, name, req).await? {
            notify(&mut tx, name, &req.pool).await?;
            tx.commit().await?;
            return Ok(Enqueued::New { seq });
        }
        tx.commit().await?;
        let (answer, state) = self.existing(req).await?;
        Ok(Enqueued::Existing { answer, state })
    }

    /// The request already recorded under `req`'s job id: its answer and
    /// state if its body is `req`'s, else [`FleetError::Conflict`].
    async fn existing(&self, req: &NewRequest) -> Result<(String, RequestState), FleetError> {
        // The insert's ON CONFLICT waited for any concurrent insert of the
        // same id to commit, so the existing row is visible now.
        self.recorded(req).await?.ok_or_else(|| {
            // Purged in between: rare; the caller retries.
            FleetError::Unavailable(format!(
                "request {} changed while being enqueued; retry",
                req.job_id
            ))
        })
    }

    /// The request recorded under `req`'s job id, if any: its answer and
    /// state if its body is `req`'s, else [`FleetError::Conflict`].
    async fn recorded(
        &self,
        req: &NewRequest,
    ) -> Result<Option<(String, RequestState)>, FleetError> {
        let row = sqlx::query(
            "SELECT body, answer, state FROM fleet_requests WHERE fleet = $1 AND job_id = $2",
        )
        .bind(self.fleet.name())
        .bind(&req.job_id)
        .fetch_optional(self.fleet.pool())
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let body: String = row.try_get("body")?;
        if body != req.body {
            return Err(FleetError::Conflict {
                job_id: req.job_id.clone(),
            });
        }
        Ok(Some((
            row.try_get("answer")?,
            RequestState::parse(&row.try_get::<String, _>("state")?)?,
        )))
    }

    /// [`Queue::enqueue`] by a host that serves the request's pool and has
    /// already admitted it locally with agent `agent_id`: in one
    /// transaction the request is written and — if it is the head of its
    /// pool (FIFO), the fleet caps admit it and this host is `up` under its
    /// epoch — claimed and started with that agent at once
    /// ([`Entered::Started`]: create the agent). Otherwise it is only
    /// queued ([`Entered::Queued`]: undo the local admission; the pool's
    /// hosts are notified) or it existed already ([`Entered::Existing`]:
    /// undo it too). One commit instead of the three of enqueue, claim and
    /// start.
    pub async fn enqueue_started(
        &self,
        guard: &LeaseGuard,
        req: &NewRequest,
        agent_id: &str,
    ) -> Result<Entered, FleetError> {
        // `fleet_enter` answers a repeat before any lock (see
        // [`Queue::enqueue`]); a deadlock remains possible when the request
        // changes between that look and its insert.
        retry_on_deadlock(|| self.enqueue_started_once(guard, req, agent_id)).await
    }

    async fn enqueue_started_once(
        &self,
        guard: &LeaseGuard,
        req: &NewRequest,
        agent_id: &str,
    ) -> Result<Entered, FleetError> {
        let epoch = guard.check()?;
        let name = self.fleet.name();
        // One statement (`fleet_enter`, migration 5): the pool's row, which
        // every entry and claim of the pool waits for, is held while the
        // function runs rather than across a round trip per statement.
        let row = sqlx::query(
            "SELECT outcome, seq, head_job_id AS job_id, head_seq, head_kind AS kind, head_body AS body, \
                 head_secret AS secret, head_milli_cpu AS milli_cpu, head_memory_bytes AS memory_bytes, \
                 head_arrived_at AS arrived_at, head_claim_seq AS claim_seq \
             FROM fleet_enter($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        )
        .bind(name)
        .bind(&req.job_id)
        .bind(req.kind.as_str())
        .bind(&req.pool)
        .bind(&req.body)
        .bind(&req.answer)
        .bind(to_db(req.cpu.millis()))
        .bind(to_db(req.memory.bytes()))
        .bind(&req.entry_host)
        .bind(&req.secret)
        .bind(guard.instance())
        .bind(epoch)
        .bind(agent_id)
        .bind(crate::CHANNEL)
        .fetch_one(self.fleet.pool())
        .await;
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                return Err(stale_epoch(&e, guard.instance(), epoch).unwrap_or_else(|| e.into()))
            }
        };
        let outcome: String = row.try_get("outcome")?;
        let seq: Option<i64> = row.try_get("seq")?;
        match (outcome.as_str(), seq) {
            ("started", Some(seq)) => Ok(Entered::Started { seq }),
            ("queued", Some(seq)) => Ok(Entered::Queued { seq }),
            ("claimed-head", Some(seq)) => Ok(Entered::ClaimedHead {
                seq,
                head: claimed(&row, "head_seq", &req.pool, guard.instance(), epoch)?,
            }),
            ("existing", _) => self
                .existing(req)
                .await
                .map(|(answer, state)| Entered::Existing { answer, state }),
            (other, _) => Err(FleetError::Corrupt {
                table: "fleet_requests",
                reason: format!("fleet_enter answered `{other}`"),
            }),
        }
    }

    /// Claims the oldest queued request, among `pools`, that the fleet caps
    /// admit now. Pools are tried oldest head first; in each, only the head
    /// is considered (FIFO: a later, smaller request does not overtake a
    /// head that does not fit). `None`: nothing to claim now (empty, or at
    /// a cap). Refused with [`FleetError::LeaseLapsed`] when the local fence
    /// is closed, and with [`FleetError::StaleEpoch`] when the database has
    /// this host under another epoch or not `up`.
    pub async fn claim(
        &self,
        guard: &LeaseGuard,
        pools: &[String],
    ) -> Result<Option<Claim>, FleetError> {
        let epoch = guard.check()?;
        if pools.is_empty() {
            return Ok(None);
        }
        // One pool (a host's claim loop asks per pool): no need to order
        // pools by their heads first.
        if let [pool] = pools {
            guard.check()?;
            return match self.claim_in(guard.instance(), epoch, pool).await? {
                PoolAttempt::Claimed(c) => Ok(Some(c)),
                PoolAttempt::AtCap => {
                    tracing::debug!(pool = %pool, "fleet cap reached; not claiming in this pool");
                    Ok(None)
                }
                PoolAttempt::Empty | PoolAttempt::Busy => Ok(None),
            };
        }
        let heads: Vec<String> = sqlx::query_scalar(
            "SELECT pool FROM fleet_requests WHERE fleet = $1 AND state = 'queued' AND pool = ANY($2) \
             GROUP BY pool ORDER BY min(seq)",
        )
        .bind(self.fleet.name())
        .bind(pools)
        .fetch_all(self.fleet.pool())
        .await?;
        for pool in heads {
            // Re-check the fence per attempt: an attempt may wait on a lock.
            guard.check()?;
            match self.claim_in(guard.instance(), epoch, &pool).await? {
                PoolAttempt::Claimed(c) => return Ok(Some(c)),
                PoolAttempt::AtCap => {
                    tracing::debug!(pool = %pool, "fleet cap reached; not claiming in this pool")
                }
                PoolAttempt::Empty | PoolAttempt::Busy => {}
            }
        }
        Ok(None)
    }

    /// One claim attempt in one pool, one transaction. Lock order: fleet
    /// row (if a global cap is set), pool row, host row (shared), request row.
    async fn claim_in(
        &self,
        instance: &str,
        epoch: i64,
        pool: &str,
    ) -> Result<PoolAttempt, FleetError> {
        // One statement (`fleet_claim`, migration 5), for the pool's row's
        // sake as on the entry path. A claim that cannot have that row soon
        // gives up and is tried again at the next wake-up, rather than hold
        // one of the host's few connections while every host of the pool
        // queues on it (its lease renewals need the connection).
        let row = sqlx::query(
            "SELECT outcome, job_id, seq, kind, body, secret, milli_cpu, memory_bytes, arrived_at, claim_seq \
             FROM fleet_claim($1, $2, $3, $4, $5, $6)",
        )
        .bind(self.fleet.name())
        .bind(pool)
        .bind(instance)
        .bind(epoch)
        .bind(crate::CHANNEL)
        .bind(CLAIM_LOCK_TIMEOUT)
        .fetch_one(self.fleet.pool())
        .await;
        let row = match row {
            Ok(row) => row,
            Err(e) => {
                if let Some(stale) = stale_epoch(&e, instance, epoch) {
                    return Err(stale);
                }
                let e = FleetError::from(e);
                if e.is_lock_timeout() {
                    tracing::debug!(pool, "fleet: the pool's row is busy; claiming later");
                    return Ok(PoolAttempt::Busy);
                }
                return Err(e);
            }
        };
        let outcome: String = row.try_get("outcome")?;
        match outcome.as_str() {
            "claimed" => {}
            "empty" => return Ok(PoolAttempt::Empty),
            "at-cap" => return Ok(PoolAttempt::AtCap),
            other => {
                return Err(FleetError::Corrupt {
                    table: "fleet_requests",
                    reason: format!("fleet_claim answered `{other}`"),
                })
            }
        }
        Ok(PoolAttempt::Claimed(claimed(
            &row, "seq", pool, instance, epoch,
        )?))
    }

    /// Binds the agent started for `claim` (records it `live` under the
    /// claim's epoch) — before the backend is asked to create it. Refused,
    /// changing nothing, when the local fence is closed
    /// ([`FleetError::LeaseLapsed`]), the host's epoch moved
    /// ([`FleetError::StaleEpoch`]), or the request is no longer this
    /// claim's ([`FleetError::NotClaimed`]): then the agent must not be
    /// started (or must be destroyed).
    pub async fn start(
        &self,
        guard: &LeaseGuard,
        claim: &Claim,
        agent_id: &str,
    ) -> Result<(), FleetError> {
        let epoch = guard.check()?;
        if epoch != claim.epoch {
            return Err(FleetError::StaleEpoch {
                instance: claim.instance.clone(),
                held: claim.epoch,
                current: Some(epoch),
            });
        }
        // Its request's row, then the pool's (usage trigger): the order a
        // completion or a requeue of the same job takes them in too, but a
        // repeat entering through a host may still lock them the other way
        // round; whichever PostgreSQL rolls back is tried again.
        retry_on_deadlock(|| self.start_once(claim, agent_id)).await
    }

    async fn start_once(&self, claim: &Claim, agent_id: &str) -> Result<(), FleetError> {
        let name = self.fleet.name();
        let mut tx = self.fleet.pool().begin().await?;
        fence(&mut tx, name, &claim.instance, claim.epoch).await?;
        let started = sqlx::query(
            "UPDATE fleet_requests SET state = 'started', agent_id = $5, started_at = fleet_now_ms() \
             WHERE fleet = $1 AND job_id = $2 AND state = 'claimed' AND claimed_by = $3 AND claim_epoch = $4",
        )
        .bind(name)
        .bind(&claim.job_id)
        .bind(&claim.instance)
        .bind(claim.epoch)
        .bind(agent_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if started == 0 {
            return Err(FleetError::NotClaimed {
                job_id: claim.job_id.clone(),
                epoch: claim.epoch,
            });
        }
        insert_live_agent(
            &mut tx,
            name,
            &LiveAgent {
                agent_id,
                instance: &claim.instance,
                epoch: claim.epoch,
                pool: &claim.pool,
                job_id: &claim.job_id,
                cpu: claim.cpu.millis(),
                memory: claim.memory.bytes(),
            },
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Takes one of this host's agents back under its current epoch (after
    /// a rejoin, while reconciling): the agent's request must still be this
    /// host's (`started`, or `lost` if the leader declared the host lost
    /// meanwhile). An agent marked lost had left the caps, so taking it
    /// back is checked against them like a claim. Returns what the daemon
    /// does with the agent: keep it ([`Adopted::Live`]) or destroy it.
    pub async fn adopt(&self, guard: &LeaseGuard, agent_id: &str) -> Result<Adopted, FleetError> {
        let epoch = guard.check()?;
        let name = self.fleet.name();
        let instance = guard.instance();
        let Some(agent) = sqlx::query(
            "SELECT pool, job_id, state, milli_cpu, memory_bytes FROM fleet_agents \
             WHERE fleet = $1 AND agent_id = $2 AND instance_id = $3",
        )
        .bind(name)
        .bind(agent_id)
        .bind(instance)
        .fetch_optional(self.fleet.pool())
        .await?
        else {
            return Ok(Adopted::NotOurs);
        };
        let pool: String = agent.try_get("pool")?;
        let job_id: Option<String> = agent.try_get("job_id")?;
        let cpu = non_negative("fleet_agents", "milli_cpu", agent.try_get("milli_cpu")?)?;
        let memory = non_negative(
            "fleet_agents",
            "memory_bytes",
            agent.try_get("memory_bytes")?,
        )?;
        let Some(job_id) = job_id else {
            return Ok(Adopted::NotOurs);
        };
        // The claim's lock order: fleet, pool, host, request, agent.
        let mut tx = self.fleet.pool().begin().await?;
        let (global, pool_row) = lock_caps(&mut tx, name, &pool).await?;
        let pool_row = pool_row.unwrap_or_default();
        fence(&mut tx, name, instance, epoch).await?;
        let request_state: Option<String> = sqlx::query_scalar(
            "SELECT state FROM fleet_requests WHERE fleet = $1 AND job_id = $2 AND claimed_by = $3 \
                 AND agent_id = $4 AND state IN ('started', 'lost') FOR UPDATE",
        )
        .bind(name)
        .bind(&job_id)
        .bind(instance)
        .bind(agent_id)
        .fetch_optional(&mut *tx)
        .await?;
        let agent_state: String = sqlx::query_scalar(
            "SELECT state FROM fleet_agents WHERE fleet = $1 AND agent_id = $2 FOR UPDATE",
        )
        .bind(name)
        .bind(agent_id)
        .fetch_one(&mut *tx)
        .await?;
        if request_state.is_none() || agent_state == "gone" {
            return Ok(Adopted::NotOurs);
        }
        if agent_state != "live"
            && !caps_admit(&mut tx, name, &pool_row, &global, cpu, memory).await?
        {
            return Ok(Adopted::OverCap);
        }
        sqlx::query(
            "UPDATE fleet_requests SET state = 'started', claim_epoch = $3 WHERE fleet = $1 AND job_id = $2",
        )
        .bind(name)
        .bind(&job_id)
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE fleet_agents SET state = 'live', epoch = $3, updated_at = fleet_now_ms() \
             WHERE fleet = $1 AND agent_id = $2",
        )
        .bind(name)
        .bind(agent_id)
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Adopted::Live)
    }

    /// Returns an unstarted claim to the queue at its original place (local
    /// admission refused it, or the host gives it up). Returns whether it
    /// was still this claim's. Not fenced: giving work back is always safe.
    pub async fn release(&self, claim: &Claim) -> Result<bool, FleetError> {
        let name = self.fleet.name();
        let mut tx = self.fleet.pool().begin().await?;
        let n = sqlx::query(
            "UPDATE fleet_requests SET state = 'queued', claimed_by = NULL, claim_epoch = NULL, \
                 claim_seq = NULL, claimed_at = NULL \
             WHERE fleet = $1 AND job_id = $2 AND state = 'claimed' AND claimed_by = $3 AND claim_epoch = $4",
        )
        .bind(name)
        .bind(&claim.job_id)
        .bind(&claim.instance)
        .bind(claim.epoch)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n > 0 {
            notify(&mut tx, name, &claim.pool).await?;
        }
        tx.commit().await?;
        Ok(n > 0)
    }

    /// Finishes a request this host (`instance`) holds — claimed, started,
    /// or lost while its agent ran — with `outcome`, and marks its agent
    /// gone, freeing its share of the caps. Returns whether it was this
    /// host's to finish (false: another host has it now; destroy any agent
    /// still running for it). Listeners of the pool are notified.
    pub async fn complete(
        &self,
        instance: &str,
        job_id: &str,
        outcome: &str,
    ) -> Result<bool, FleetError> {
        let name = self.fleet.name();
        let mut tx = self.fleet.pool().begin().await?;
        let pool: Option<String> = sqlx::query_scalar(
            "UPDATE fleet_requests SET state = 'finished', finished_at = fleet_now_ms(), outcome = $4, secret = NULL \
             WHERE fleet = $1 AND job_id = $2 AND claimed_by = $3 AND state IN ('claimed', 'started', 'lost') \
             RETURNING pool",
        )
        .bind(name)
        .bind(job_id)
        .bind(instance)
        .bind(outcome)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(pool) = pool else {
            tx.commit().await?;
            return Ok(false);
        };
        sqlx::query(
            "UPDATE fleet_agents SET state = 'gone', updated_at = fleet_now_ms() \
             WHERE fleet = $1 AND job_id = $2 AND instance_id = $3 AND state IN ('live', 'lost')",
        )
        .bind(name)
        .bind(job_id)
        .bind(instance)
        .execute(&mut *tx)
        .await?;
        notify(&mut tx, name, &pool).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Puts a started (by `instance`) or lost request back in the queue at
    /// its original place, its agent marked gone (the agent died before it
    /// registered, or the leader reported it lost and it had not registered:
    /// the request is to be served again). Returns whether it was requeued.
    pub async fn requeue(&self, instance: &str, job_id: &str) -> Result<bool, FleetError> {
        let name = self.fleet.name();
        let mut tx = self.fleet.pool().begin().await?;
        let pool: Option<String> = sqlx::query_scalar(
            "UPDATE fleet_requests SET state = 'queued', claimed_by = NULL, claim_epoch = NULL, \
                 claim_seq = NULL, claimed_at = NULL, agent_id = NULL, started_at = NULL \
             WHERE fleet = $1 AND job_id = $2 AND claimed_by = $3 AND state IN ('started', 'lost') \
             RETURNING pool",
        )
        .bind(name)
        .bind(job_id)
        .bind(instance)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(pool) = pool else {
            tx.commit().await?;
            return Ok(false);
        };
        sqlx::query(
            "UPDATE fleet_agents SET state = 'gone', updated_at = fleet_now_ms() \
             WHERE fleet = $1 AND job_id = $2 AND instance_id = $3 AND state IN ('live', 'lost')",
        )
        .bind(name)
        .bind(job_id)
        .bind(instance)
        .execute(&mut *tx)
        .await?;
        notify(&mut tx, name, &pool).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Records that the agent `agent_id` of `instance` registered: from now
    /// on its job belongs to the orchestrator, and a lost host's request
    /// with this agent is not served again. Returns whether the row was
    /// this host's.
    pub async fn mark_registered(
        &self,
        instance: &str,
        agent_id: &str,
    ) -> Result<bool, FleetError> {
        let n = sqlx::query(
            "UPDATE fleet_agents SET registered_at = fleet_now_ms(), updated_at = fleet_now_ms() \
             WHERE fleet = $1 AND agent_id = $2 AND instance_id = $3 AND registered_at IS NULL",
        )
        .bind(self.fleet.name())
        .bind(agent_id)
        .bind(instance)
        .execute(self.fleet.pool())
        .await?
        .rows_affected();
        Ok(n > 0)
    }

    /// Cancels a request still waiting in the queue (finished, outcome
    /// `cancelled`). Returns whether it was queued; a claimed or started
    /// request is its host's to cancel.
    pub async fn cancel_queued(&self, job_id: &str) -> Result<bool, FleetError> {
        let mut tx = self.fleet.pool().begin().await?;
        let pool: Option<String> = sqlx::query_scalar(
            "UPDATE fleet_requests SET state = 'finished', finished_at = fleet_now_ms(), outcome = 'cancelled', \
                 secret = NULL \
             WHERE fleet = $1 AND job_id = $2 AND state = 'queued' RETURNING pool",
        )
        .bind(self.fleet.name())
        .bind(job_id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(pool) = &pool {
            notify(&mut tx, self.fleet.name(), pool).await?;
        }
        tx.commit().await?;
        Ok(pool.is_some())
    }

    /// One request as the queue knows it (None: unknown or purged), with
    /// its place among the queued requests of its pool (1 = next).
    pub async fn lookup(&self, job_id: &str) -> Result<Option<RequestView>, FleetError> {
        let row = sqlx::query(
            "SELECT r.pool, r.kind, r.body, r.state, r.claimed_by, r.agent_id, r.outcome, \
                 CASE WHEN r.state = 'queued' THEN (SELECT count(*) FROM fleet_requests q \
                     WHERE q.fleet = r.fleet AND q.pool = r.pool AND q.state = 'queued' AND q.seq <= r.seq) \
                 ELSE 0 END AS position \
             FROM fleet_requests r WHERE r.fleet = $1 AND r.job_id = $2",
        )
        .bind(self.fleet.name())
        .bind(job_id)
        .fetch_optional(self.fleet.pool())
        .await?;
        let Some(r) = row else { return Ok(None) };
        Ok(Some(RequestView {
            job_id: job_id.to_owned(),
            pool: r.try_get("pool")?,
            kind: RequestKind::parse(&r.try_get::<String, _>("kind")?)?,
            body: r.try_get("body")?,
            state: RequestState::parse(&r.try_get::<String, _>("state")?)?,
            host: r.try_get("claimed_by")?,
            agent_id: r.try_get("agent_id")?,
            outcome: r.try_get("outcome")?,
            position: non_negative("fleet_requests", "position", r.try_get("position")?)?,
        }))
    }

    /// The requests `instance` holds with an agent (started, or lost while
    /// it ran): after a restart, the host finishes those whose agent it no
    /// longer has, which nothing else would (its lease is live again).
    pub async fn held(&self, instance: &str) -> Result<Vec<Held>, FleetError> {
        let rows = sqlx::query(
            "SELECT r.job_id, r.kind, r.agent_id, a.registered_at IS NOT NULL AS registered \
             FROM fleet_requests r LEFT JOIN fleet_agents a ON a.fleet = r.fleet AND a.agent_id = r.agent_id \
             WHERE r.fleet = $1 AND r.claimed_by = $2 AND r.state IN ('started', 'lost') ORDER BY r.seq",
        )
        .bind(self.fleet.name())
        .bind(instance)
        .fetch_all(self.fleet.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Held {
                    job_id: r.try_get("job_id")?,
                    kind: RequestKind::parse(&r.try_get::<String, _>("kind")?)?,
                    agent_id: r.try_get("agent_id")?,
                    registered: r.try_get::<Option<bool>, _>("registered")?.unwrap_or(false),
                })
            })
            .collect()
    }

    /// The live host running agent `agent_id` — its instance id and
    /// advertised URL — if one does (for carrying a call to the owner).
    pub async fn agent_owner(&self, agent_id: &str) -> Result<Option<Owner>, FleetError> {
        self.owner(
            "SELECT h.instance_id, h.url FROM fleet_agents a JOIN fleet_hosts h \
                 ON h.fleet = a.fleet AND h.instance_id = a.instance_id \
             WHERE a.fleet = $1 AND a.agent_id = $2 AND a.state = 'live' AND h.state IN ('up', 'leaving')",
            agent_id,
        )
        .await
    }

    /// The live host holding request `job_id` (claimed or started) or that
    /// finished it (it may still know how it went), if one does.
    pub async fn job_owner(&self, job_id: &str) -> Result<Option<Owner>, FleetError> {
        self.owner(
            "SELECT h.instance_id, h.url FROM fleet_requests r JOIN fleet_hosts h \
                 ON h.fleet = r.fleet AND h.instance_id = r.claimed_by \
             WHERE r.fleet = $1 AND r.job_id = $2 AND r.state IN ('claimed', 'started', 'finished') \
                 AND h.state IN ('up', 'leaving')",
            job_id,
        )
        .await
    }

    async fn owner(&self, query: &str, key: &str) -> Result<Option<Owner>, FleetError> {
        let row = sqlx::query(query)
            .bind(self.fleet.name())
            .bind(key)
            .fetch_optional(self.fleet.pool())
            .await?;
        row.map(|r| {
            Ok(Owner {
                instance: r.try_get("instance_id")?,
                url: r.try_get("url")?,
            })
        })
        .transpose()
    }

    /// Where a request is, and who holds it (None: unknown or purged).
    pub async fn state(
        &self,
        job_id: &str,
    ) -> Result<Option<(RequestState, Option<String>)>, FleetError> {
        let row = sqlx::query(
            "SELECT state, claimed_by FROM fleet_requests WHERE fleet = $1 AND job_id = $2",
        )
        .bind(self.fleet.name())
        .bind(job_id)
        .fetch_optional(self.fleet.pool())
        .await?;
        row.map(|r| {
            Ok((
                RequestState::parse(&r.try_get::<String, _>("state")?)?,
                r.try_get("claimed_by")?,
            ))
        })
        .transpose()
    }

    /// Queued requests in `pool`.
    pub async fn depth(&self, pool: &str) -> Result<u64, FleetError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM fleet_requests WHERE fleet = $1 AND pool = $2 AND state = 'queued'",
        )
        .bind(self.fleet.name())
        .bind(pool)
        .fetch_one(self.fleet.pool())
        .await?;
        non_negative("fleet_requests", "count", n)
    }

    /// Usage of `pool` (claimed requests + live agents), as counted on its
    /// row (zero for a pool nobody defined).
    pub async fn pool_usage(&self, pool: &str) -> Result<Usage, FleetError> {
        let row = sqlx::query(
            "SELECT used_agents AS n, used_cpu AS cpu, used_memory AS mem FROM fleet_pools \
             WHERE fleet = $1 AND pool = $2",
        )
        .bind(self.fleet.name())
        .bind(pool)
        .fetch_optional(self.fleet.pool())
        .await?;
        row.as_ref().map_or(Ok(Usage::default()), usage_row)
    }

    /// Usage of the whole fleet, one statement.
    pub async fn fleet_usage(&self) -> Result<Usage, FleetError> {
        usage_row(
            &sqlx::query(USAGE_FLEET)
                .bind(self.fleet.name())
                .fetch_one(self.fleet.pool())
                .await?,
        )
    }

    /// The load of every live host serving `pool`: its claimed requests and
    /// live agents there, and its own capacity — the input of
    /// [`crate::should_claim`].
    pub async fn pool_loads(&self, pool: &str) -> Result<Vec<HostLoad>, FleetError> {
        let rows = sqlx::query(
            "SELECT hp.instance_id, hp.host_max_agents, hp.used_agents AS agents \
             FROM fleet_host_pools hp JOIN fleet_hosts h ON h.fleet = hp.fleet AND h.instance_id = hp.instance_id \
             WHERE hp.fleet = $1 AND hp.pool = $2 AND h.state = 'up' AND h.lease_expires_at > fleet_now_ms() \
             ORDER BY hp.instance_id",
        )
        .bind(self.fleet.name())
        .bind(pool)
        .fetch_all(self.fleet.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.try_get("instance_id")?;
                let host = id.parse::<InstanceId>().map_err(|e| FleetError::Corrupt {
                    table: "fleet_host_pools",
                    reason: e.to_string(),
                })?;
                let cap: Option<i64> = r.try_get("host_max_agents")?;
                let agents: i64 = r.try_get("agents")?;
                Ok(HostLoad {
                    host,
                    agents: u32::try_from(non_negative("fleet_requests", "count", agents)?)
                        .unwrap_or(u32::MAX),
                    capacity: cap
                        .map(|c| {
                            non_negative("fleet_host_pools", "host_max_agents", c)
                                .map(|c| u32::try_from(c).unwrap_or(u32::MAX))
                        })
                        .transpose()?,
                })
            })
            .collect()
    }
}

/// The fleet's global caps, optionally locking the fleet row.
async fn fleet_caps(conn: &mut PgConnection, fleet: &str, lock: bool) -> Result<Caps, FleetError> {
    let sql = if lock {
        "SELECT max_agents, max_cpu, max_memory FROM fleet_fleets WHERE fleet = $1 FOR UPDATE"
    } else {
        "SELECT max_agents, max_cpu, max_memory FROM fleet_fleets WHERE fleet = $1"
    };
    let Some(row) = sqlx::query(sql).bind(fleet).fetch_optional(conn).await? else {
        return Ok(Caps::default());
    };
    Caps::from_db(
        "fleet_fleets",
        row.try_get("max_agents")?,
        row.try_get("max_cpu")?,
        row.try_get("max_memory")?,
    )
}

/// A pool's caps and its usage as counted on its row.
#[derive(Debug, Clone, Copy, Default)]
struct PoolRow {
    caps: Caps,
    used: Usage,
}

/// The caps an admission in `pool` is checked against, locked in the
/// claim's lock order: the fleet row first (locked only when a global cap
/// is set: without one, claims of different pools need not serialise
/// fleet-wide), then the pool's row, with its usage counters. The pool is
/// `None` when no host ever defined it.
async fn lock_caps(
    conn: &mut PgConnection,
    fleet: &str,
    pool: &str,
) -> Result<(Caps, Option<PoolRow>), FleetError> {
    let global = fleet_caps(&mut *conn, fleet, false).await?;
    let global = if global.any() {
        fleet_caps(&mut *conn, fleet, true).await?
    } else {
        global
    };
    let row = sqlx::query(
        "SELECT max_agents, max_cpu, max_memory, used_agents AS n, used_cpu AS cpu, used_memory AS mem \
         FROM fleet_pools WHERE fleet = $1 AND pool = $2 FOR UPDATE",
    )
    .bind(fleet)
    .bind(pool)
    .fetch_optional(&mut *conn)
    .await?;
    let pool_row = match row {
        Some(row) => Some(PoolRow {
            caps: Caps::from_db(
                "fleet_pools",
                row.try_get("max_agents")?,
                row.try_get("max_cpu")?,
                row.try_get("max_memory")?,
            )?,
            used: usage_row(&row)?,
        }),
        None => None,
    };
    Ok((global, pool_row))
}

/// An agent started for a request, as `fleet_agents` records it.
struct LiveAgent<'a> {
    agent_id: &'a str,
    instance: &'a str,
    epoch: i64,
    pool: &'a str,
    job_id: &'a str,
    cpu: u64,
    memory: u64,
}

/// Records `agent` live: from now on it counts against the caps.
async fn insert_live_agent(
    conn: &mut PgConnection,
    fleet: &str,
    agent: &LiveAgent<'_>,
) -> Result<(), FleetError> {
    sqlx::query(
        "INSERT INTO fleet_agents (fleet, agent_id, instance_id, epoch, pool, job_id, milli_cpu, memory_bytes, \
             state, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'live', fleet_now_ms(), fleet_now_ms())",
    )
    .bind(fleet)
    .bind(agent.agent_id)
    .bind(agent.instance)
    .bind(agent.epoch)
    .bind(agent.pool)
    .bind(agent.job_id)
    .bind(to_db(agent.cpu))
    .bind(to_db(agent.memory))
    .execute(conn)
    .await?;
    Ok(())
}

/// Writes `req` as queued (or queues a finished request with its job id and
/// body anew); its `seq`, or `None` when a request with its job id is in the
/// fleet and not finished.
async fn insert_request(
    conn: &mut PgConnection,
    fleet: &str,
    req: &NewRequest,
) -> Result<Option<i64>, FleetError> {
    Ok(sqlx::query_scalar(
        "INSERT INTO fleet_requests (fleet, job_id, kind, pool, body, answer, milli_cpu, memory_bytes, \
             entry_host, secret, state, arrived_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'queued', fleet_now_ms()) \
         ON CONFLICT (fleet, job_id) DO UPDATE SET seq = nextval('fleet_request_seq'), \
             pool = EXCLUDED.pool, secret = EXCLUDED.secret, answer = EXCLUDED.answer, milli_cpu = EXCLUDED.milli_cpu, \
             memory_bytes = EXCLUDED.memory_bytes, entry_host = EXCLUDED.entry_host, state = 'queued', \
             arrived_at = fleet_now_ms(), claimed_by = NULL, claim_epoch = NULL, claim_seq = NULL, \
             claimed_at = NULL, agent_id = NULL, started_at = NULL, finished_at = NULL, outcome = NULL \
           WHERE fleet_requests.state = 'finished' AND fleet_requests.body = EXCLUDED.body \
         RETURNING seq",
    )
    .bind(fleet)
    .bind(&req.job_id)
    .bind(req.kind.as_str())
    .bind(&req.pool)
    .bind(&req.body)
    .bind(&req.answer)
    .bind(to_db(req.cpu.millis()))
    .bind(to_db(req.memory.bytes()))
    .bind(&req.entry_host)
    .bind(&req.secret)
    .fetch_optional(&mut *conn)
    .await?)
}

/// Whether the pool's and the fleet's usage leave room for `cpu`/`memory`
/// more (the callers hold the rows the counts depend on, locked: the pool's
/// row, and the fleet's row when a global cap is set — only claims, which
/// take those locks, increase usage).
async fn caps_admit(
    conn: &mut PgConnection,
    fleet: &str,
    pool: &PoolRow,
    global: &Caps,
    cpu: u64,
    memory: u64,
) -> Result<bool, FleetError> {
    if pool.caps.any() && !pool.used.admits(&pool.caps, cpu, memory) {
        return Ok(false);
    }
    if global.any() {
        let used = usage_row(
            &sqlx::query(USAGE_FLEET)
                .bind(fleet)
                .fetch_one(&mut *conn)
                .await?,
        )?;
        if !used.admits(global, cpu, memory) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A request a database function claimed for `instance` under `epoch`,
/// from its row (`seq_column` names its arrival order's column).
fn claimed(
    row: &PgRow,
    seq_column: &str,
    pool: &str,
    instance: &str,
    epoch: i64,
) -> Result<Claim, FleetError> {
    let cpu = non_negative("fleet_requests", "milli_cpu", row.try_get("milli_cpu")?)?;
    let memory = non_negative(
        "fleet_requests",
        "memory_bytes",
        row.try_get("memory_bytes")?,
    )?;
    Ok(Claim {
        job_id: row.try_get("job_id")?,
        pool: pool.to_owned(),
        kind: RequestKind::parse(&row.try_get::<String, _>("kind")?)?,
        body: row.try_get("body")?,
        secret: row.try_get("secret")?,
        seq: row.try_get(seq_column)?,
        claim_seq: row.try_get("claim_seq")?,
        instance: instance.to_owned(),
        epoch,
        cpu: MilliCpu::from_millis(cpu),
        memory: MemoryBytes::from_bytes(memory),
        arrived_at: row.try_get("arrived_at")?,
    })
}

/// The fence's refusal raised inside a database function (SQLSTATE
/// `KF001`, the host's current epoch as its DETAIL when its lease is
/// valid), as [`FleetError::StaleEpoch`].
fn stale_epoch(e: &sqlx::Error, instance: &str, epoch: i64) -> Option<FleetError> {
    let db = e.as_database_error()?;
    if db.code().as_deref() != Some(FENCE_REFUSED) {
        return None;
    }
    let current = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .and_then(|pg| pg.detail())
        .and_then(|d| d.parse().ok());
    Some(FleetError::StaleEpoch {
        instance: instance.to_owned(),
        held: epoch,
        current,
    })
}

/// The SQLSTATE the fleet's functions raise for a host not `up` under its
/// epoch.
const FENCE_REFUSED: &str = "KF001";

/// The database-side fence: the host row, share-locked for the rest of the
/// transaction (the leader's "declare lost" waits for it), must be `up`
/// under `epoch` with an unexpired lease.
async fn fence(
    conn: &mut PgConnection,
    fleet: &str,
    instance: &str,
    epoch: i64,
) -> Result<(), FleetError> {
    let row = sqlx::query(
        "SELECT epoch, state = 'up' AND lease_expires_at > fleet_now_ms() AS valid FROM fleet_hosts \
         WHERE fleet = $1 AND instance_id = $2 FOR SHARE",
    )
    .bind(fleet)
    .bind(instance)
    .fetch_optional(conn)
    .await?;
    let current = match row {
        Some(r) => {
            let current: i64 = r.try_get("epoch")?;
            let valid: bool = r.try_get("valid")?;
            if valid && current == epoch {
                return Ok(());
            }
            valid.then_some(current)
        }
        None => None,
    };
    Err(FleetError::StaleEpoch {
        instance: instance.to_owned(),
        held: epoch,
        current,
    })
}

/// Tells a host when to try claiming: woken by NOTIFYs of arrivals and
/// releases in its pools (received on the host's session), with a fallback
/// poll (at most 1 s) so a lost notification (session reconnecting,
/// database restart) delays a claim by at most that.
pub struct Waker {
    fleet: Fleet,
    pools: HashSet<String>,
    notices: tokio::sync::broadcast::Receiver<Notice>,
    poll: Duration,
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waker")
            .field("fleet", &self.fleet.name())
            .field("pools", &self.pools)
            .finish()
    }
}

/// The longest a [`Waker`] sleeps without a notification.
pub const FALLBACK_POLL: Duration = Duration::from_secs(1);

impl Waker {
    pub(crate) fn listen(fleet: &Fleet, pools: &[String]) -> Self {
        Self {
            fleet: fleet.clone(),
            pools: pools.iter().cloned().collect(),
            notices: fleet.session().subscribe(),
            poll: FALLBACK_POLL,
        }
    }

    /// Shortens the fallback poll (never lengthens it past 1 s).
    pub fn with_poll(mut self, poll: Duration) -> Self {
        self.poll = poll.min(FALLBACK_POLL);
        self
    }

    /// Waits until a request arrives or is released in one of the pools
    /// (true), or the fallback poll interval passes (false). Never fails: a
    /// reset of the session or missed notifications count as a wake-up
    /// (the caller looks at the queue).
    pub async fn wait(&mut self) -> bool {
        use tokio::sync::broadcast::error::RecvError;
        let deadline = tokio::time::Instant::now() + self.poll;
        loop {
            match tokio::time::timeout_at(deadline, self.notices.recv()).await {
                Err(_) => return false,
                Ok(Ok(Notice::Notification { channel, payload })) => {
                    if channel != CHANNEL {
                        continue;
                    }
                    let Ok([fleet, pool]) = serde_json::from_str::<[String; 2]>(&payload) else {
                        continue;
                    };
                    if fleet == self.fleet.name() && self.pools.contains(&pool) {
                        return true;
                    }
                }
                Ok(Ok(Notice::Reset)) | Ok(Err(RecvError::Lagged(_))) => return true,
                Ok(Err(RecvError::Closed)) => {
                    tokio::time::sleep_until(deadline).await;
                    return false;
                }
            }
        }
    }
}
