//! Leadership and the leader's chores.
//!
//! The leader is whichever host holds a session-level advisory lock keyed
//! by the fleet's name, on the host's session ([`kici_store::PgSession`],
//! the connection that also carries its `LISTEN`), so leadership costs no
//! connection of its own and lives exactly as long as that session. When
//! the leader dies or its session is cut, PostgreSQL releases the lock and
//! the next candidate's [`Leader::try_lead`] takes it; hosts call it every
//! lease/3 or so, so leadership moves within one lease period. A session
//! cut off by a partition is ended by the server after its idle timeout
//! ([`crate::FleetOptions::session_idle_timeout`]).
//!
//! The chores ([`Leader::run_chores`]) are conditional updates a non-leader
//! could run just as safely: a host is declared lost only if its lease
//! expired by the database's clock; a claim goes back to the queue only if
//! its host is not `up` under the claim's epoch; agents are marked lost
//! only on a lost host. A deposed leader running one last round (it has not
//! noticed its session died) therefore does no harm. Leadership only keeps
//! the fleet from doing the work N times.

use crate::error::FleetError;
use crate::membership::jobs_and_pools;
use crate::{notify, Fleet};
use kici_model::InstanceId;
use kici_store::{AdvisoryKey, Locked};
use sqlx::Row;
use std::time::Duration;

/// A host the chores declared lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostHost {
    /// Instance id.
    pub instance_id: String,
    /// Hostname.
    pub hostname: String,
    /// The epoch whose lease expired.
    pub epoch: i64,
}

/// An agent the chores marked lost (its host was lost): the daemon emits
/// the event and decides, from what it knows of the agent (registered or
/// not), whether its request is served again ([`crate::Queue::requeue`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostAgent {
    /// Agent id.
    pub agent_id: String,
    /// The lost host.
    pub instance_id: String,
    /// The request it served.
    pub job_id: Option<String>,
    /// Its pool.
    pub pool: String,
    /// Whether it had registered (then its job belongs to the orchestrator
    /// and the request is not served again).
    pub registered: bool,
}

/// What one round of chores did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChoreReport {
    /// Hosts declared lost this round.
    pub lost_hosts: Vec<LostHost>,
    /// Claimed-but-unstarted requests returned to the queue (original place).
    pub requeued: Vec<String>,
    /// Agents marked lost.
    pub lost_agents: Vec<LostAgent>,
    /// Standalone jobs whose agent had registered (so their command may
    /// have run) on a host lost this round: finished with outcome
    /// [`crate::HOST_LOST`] in the same transaction — never run again, and
    /// a host that returns finds them no longer its own.
    pub aborted_jobs: Vec<String>,
    /// Requests that stayed `lost` (nobody requeued or finished them) for
    /// `retain` after their host was lost: finished with outcome
    /// `host lost` (the daemon reports standalone jobs among them aborted).
    pub abandoned: Vec<String>,
    /// Old rows deleted (finished requests, gone agents, departed hosts).
    pub purged: u64,
}

/// This host's candidacy for leadership of one fleet.
pub struct Leader {
    fleet: Fleet,
    instance: String,
    key: i64,
    /// The lock, as taken on the host's session, while leading.
    locked: Option<Locked>,
}

impl std::fmt::Debug for Leader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leader")
            .field("fleet", &self.fleet.name())
            .field("instance", &self.instance)
            .field("leading", &self.is_leader())
            .finish()
    }
}

/// The advisory-lock key of `fleet`'s leadership: FNV-1a (64 bit) of a
/// prefixed name — stable across builds and platforms, unlike `Hash`. A
/// collision between two fleets of one database would only make one host
/// lead both.
pub fn lock_key(fleet: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in "kici-fleet-leader:".bytes().chain(fleet.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    i64::from_ne_bytes(h.to_ne_bytes())
}

impl Leader {
    pub(crate) fn new(fleet: Fleet, instance: InstanceId) -> Self {
        let key = lock_key(fleet.name());
        Self {
            fleet,
            instance: instance.to_string(),
            key,
            locked: None,
        }
    }

    /// Whether this host held the lock at the last [`Leader::try_lead`] and
    /// its session has not been lost since.
    pub fn is_leader(&self) -> bool {
        self.locked.is_some_and(|l| self.fleet.session().holds(l))
    }

    /// Keeps or takes leadership; returns whether this host leads now. A
    /// leader whose session was lost has lost the lock with it (PostgreSQL
    /// releases a dead session's locks), so it tries to take it again like
    /// any candidate. Becoming leader is recorded in `fleet_fleets.leader`
    /// (for status).
    pub async fn try_lead(&mut self) -> Result<bool, FleetError> {
        // A round trip, not only the session's own bookkeeping: a session
        // the server ended a moment ago is found gone here (and reset).
        if self.is_leader() && self.fleet.session().ping().await.is_ok() && self.is_leader() {
            return Ok(true);
        }
        if self.locked.take().is_some() {
            tracing::warn!(fleet = %self.fleet.name(), "the leader's session is gone; leadership lost");
        }
        let Some(locked) = self
            .fleet
            .session()
            .try_lock(AdvisoryKey::Single(self.key))
            .await
            .map_err(FleetError::from_store)?
        else {
            return Ok(false);
        };
        let recorded = sqlx::query(
            "UPDATE fleet_fleets SET leader = $2, leader_since = fleet_now_ms() WHERE fleet = $1",
        )
        .bind(self.fleet.name())
        .bind(&self.instance)
        .execute(self.fleet.pool())
        .await;
        if let Err(e) = recorded {
            // Leading without the record would show a stale leader; give
            // the lock back and try again at the next call.
            self.release().await;
            return Err(e.into());
        }
        tracing::info!(fleet = %self.fleet.name(), instance = %self.instance, "leading the fleet");
        self.locked = Some(locked);
        Ok(true)
    }

    /// The backend process id of the session holding the lock (None when
    /// not leading), for operators (`pg_stat_activity`) and tests.
    pub async fn session_pid(&mut self) -> Option<i32> {
        if !self.is_leader() {
            return None;
        }
        self.fleet.session().backend_pid().await
    }

    /// Gives leadership up (releases the lock; the host's session stays).
    pub async fn step_down(&mut self) {
        if self.locked.take().is_some() {
            self.release().await;
        }
    }

    async fn release(&self) {
        if let Err(e) = self
            .fleet
            .session()
            .unlock(AdvisoryKey::Single(self.key))
            .await
        {
            // A lost session released it already; a session that does not
            // answer is reset, which releases it too.
            tracing::debug!(error = %e, "releasing leadership");
        }
    }

    /// Finishes the requests that waited in the queue longer than
    /// `older_than` since they arrived (outcome [`crate::EXPIRED`]; a job's
    /// secret erased): no host had room for them in time, as a single host
    /// ends a pending request at its TTL. Returns their job ids; their
    /// pools are notified (a head that left may let the next one fit).
    pub async fn expire_queued(&self, older_than: Duration) -> Result<Vec<String>, FleetError> {
        let name = self.fleet.name();
        let older_ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let mut tx = self.fleet.pool().begin().await?;
        let expired = sqlx::query(
            "UPDATE fleet_requests SET state = 'finished', finished_at = fleet_now_ms(), outcome = $3, \
                 secret = NULL \
             WHERE fleet = $1 AND state = 'queued' AND arrived_at < fleet_now_ms() - $2 \
             RETURNING job_id, pool",
        )
        .bind(name)
        .bind(older_ms)
        .bind(crate::EXPIRED)
        .fetch_all(&mut *tx)
        .await?;
        let (jobs, pools) = jobs_and_pools(&expired)?;
        for pool in &pools {
            notify(&mut tx, name, pool).await?;
        }
        tx.commit().await?;
        Ok(jobs)
    }

    /// One round of the fleet's chores (see the module docs for why any
    /// host could run them safely):
    /// 1. hosts `up` or `leaving` whose lease expired → `lost`;
    /// 2. claims whose host is not `up` under the claim's epoch → back to
    ///    the queue, keeping their arrival order;
    /// 3. live agents of lost hosts → `lost`, and their requests `lost`;
    /// 4. requests still `lost` `retain` after their host was lost →
    ///    finished, outcome `host lost`;
    /// 5. finished requests, gone or lost agents and departed hosts older
    ///    than `retain` → deleted.
    ///
    /// Listeners of every pool that got a request back are notified.
    pub async fn run_chores(&self, retain: Duration) -> Result<ChoreReport, FleetError> {
        let name = self.fleet.name();
        let retain_ms = i64::try_from(retain.as_millis()).unwrap_or(i64::MAX);
        let mut report = ChoreReport::default();
        let mut tx = self.fleet.pool().begin().await?;
        let lost = sqlx::query(
            "UPDATE fleet_hosts SET state = 'lost', left_at = fleet_now_ms() \
             WHERE fleet = $1 AND state IN ('up', 'leaving') AND lease_expires_at <= fleet_now_ms() \
             RETURNING instance_id, hostname, epoch",
        )
        .bind(name)
        .fetch_all(&mut *tx)
        .await?;
        for r in &lost {
            report.lost_hosts.push(LostHost {
                instance_id: r.try_get("instance_id")?,
                hostname: r.try_get("hostname")?,
                epoch: r.try_get("epoch")?,
            });
        }
        // A claim in flight holds its host row FOR SHARE, so the UPDATE
        // above waited for it; this later statement sees it committed.
        let requeued = sqlx::query(
            "UPDATE fleet_requests r SET state = 'queued', claimed_by = NULL, claim_epoch = NULL, \
                 claim_seq = NULL, claimed_at = NULL \
             WHERE r.fleet = $1 AND r.state = 'claimed' AND NOT EXISTS ( \
                 SELECT 1 FROM fleet_hosts h WHERE h.fleet = r.fleet AND h.instance_id = r.claimed_by \
                     AND h.epoch = r.claim_epoch AND h.state = 'up') \
             RETURNING r.job_id AS job_id, r.pool AS pool",
        )
        .bind(name)
        .fetch_all(&mut *tx)
        .await?;
        let (jobs, pools) = jobs_and_pools(&requeued)?;
        report.requeued = jobs;
        // Requests before agents: the order `complete` and `requeue` lock
        // them in, so the chores cannot deadlock with a host finishing.
        sqlx::query(
            "UPDATE fleet_requests r SET state = 'lost' \
             WHERE r.fleet = $1 AND r.state = 'started' AND EXISTS ( \
                 SELECT 1 FROM fleet_hosts h WHERE h.fleet = r.fleet AND h.instance_id = r.claimed_by \
                     AND h.state = 'lost')",
        )
        .bind(name)
        .execute(&mut *tx)
        .await?;
        let agents = sqlx::query(
            "UPDATE fleet_agents a SET state = 'lost', updated_at = fleet_now_ms() \
             WHERE a.fleet = $1 AND a.state = 'live' AND EXISTS ( \
                 SELECT 1 FROM fleet_hosts h WHERE h.fleet = a.fleet AND h.instance_id = a.instance_id \
                     AND h.state = 'lost') \
             RETURNING a.agent_id AS agent_id, a.instance_id AS instance_id, a.job_id AS job_id, a.pool AS pool, \
                 a.registered_at IS NOT NULL AS registered",
        )
        .bind(name)
        .fetch_all(&mut *tx)
        .await?;
        for r in &agents {
            report.lost_agents.push(LostAgent {
                agent_id: r.try_get("agent_id")?,
                instance_id: r.try_get("instance_id")?,
                job_id: r.try_get("job_id")?,
                pool: r.try_get("pool")?,
                registered: r.try_get("registered")?,
            });
        }
        report.aborted_jobs = sqlx::query_scalar(
            "UPDATE fleet_requests r SET state = 'finished', finished_at = fleet_now_ms(), outcome = $2, \
                 secret = NULL \
             WHERE r.fleet = $1 AND r.kind = 'job' AND r.state = 'lost' AND EXISTS ( \
                 SELECT 1 FROM fleet_agents a WHERE a.fleet = r.fleet AND a.agent_id = r.agent_id \
                     AND a.registered_at IS NOT NULL) \
             RETURNING r.job_id",
        )
        .bind(name)
        .bind(crate::HOST_LOST)
        .fetch_all(&mut *tx)
        .await?;
        for pool in &pools {
            notify(&mut tx, name, pool).await?;
        }
        tx.commit().await?;

        report.abandoned = sqlx::query_scalar(
            "UPDATE fleet_requests r SET state = 'finished', finished_at = fleet_now_ms(), outcome = $3, \
                 secret = NULL \
             WHERE r.fleet = $1 AND r.state = 'lost' AND EXISTS ( \
                 SELECT 1 FROM fleet_hosts h WHERE h.fleet = r.fleet AND h.instance_id = r.claimed_by \
                     AND h.state = 'lost' AND h.left_at < fleet_now_ms() - $2) \
             RETURNING r.job_id",
        )
        .bind(name)
        .bind(retain_ms)
        .bind(crate::HOST_LOST)
        .fetch_all(self.fleet.pool())
        .await?;
        let mut purged = sqlx::query(
            "DELETE FROM fleet_requests WHERE fleet = $1 AND state = 'finished' \
                 AND finished_at < fleet_now_ms() - $2",
        )
        .bind(name)
        .bind(retain_ms)
        .execute(self.fleet.pool())
        .await?
        .rows_affected();
        purged += sqlx::query(
            "DELETE FROM fleet_agents WHERE fleet = $1 AND state IN ('gone', 'lost') \
                 AND updated_at < fleet_now_ms() - $2 \
                 AND NOT EXISTS (SELECT 1 FROM fleet_requests r WHERE r.fleet = fleet_agents.fleet \
                     AND r.job_id = fleet_agents.job_id AND r.state = 'lost')",
        )
        .bind(name)
        .bind(retain_ms)
        .execute(self.fleet.pool())
        .await?
        .rows_affected();
        let mut tx = self.fleet.pool().begin().await?;
        let gone: Vec<String> = sqlx::query_scalar(
            "DELETE FROM fleet_hosts h WHERE h.fleet = $1 AND h.state IN ('left', 'lost') \
                 AND h.left_at < fleet_now_ms() - $2 \
                 AND NOT EXISTS (SELECT 1 FROM fleet_agents a WHERE a.fleet = h.fleet \
                     AND a.instance_id = h.instance_id AND a.state <> 'gone') \
             RETURNING h.instance_id",
        )
        .bind(name)
        .bind(retain_ms)
        .fetch_all(&mut *tx)
        .await?;
        if !gone.is_empty() {
            sqlx::query("DELETE FROM fleet_host_pools WHERE fleet = $1 AND instance_id = ANY($2)")
                .bind(name)
                .bind(&gone)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        purged += u64::try_from(gone.len()).unwrap_or(u64::MAX);
        report.purged = purged;
        if !report.lost_hosts.is_empty() || !report.requeued.is_empty() {
            tracing::info!(
                fleet = %name,
                lost_hosts = report.lost_hosts.len(),
                requeued = report.requeued.len(),
                lost_agents = report.lost_agents.len(),
                "fleet chores"
            );
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_key_is_stable_and_per_fleet() {
        assert_eq!(lock_key("default"), lock_key("default"));
        assert_ne!(lock_key("default"), lock_key("other"));
    }
}
