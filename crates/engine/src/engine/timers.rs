//! Deadlines: the next instant the engine must act, and firing what passed.

use super::*;

impl Engine {
    /// The earliest instant at which [`Engine::tick`] has something to do.
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let agents = self
            .agents
            .values()
            .filter_map(|a| a.deadline(&self.settings));
        let pending = self.pending.next_expiry();
        // Breakers matter only while they hold back a waiting request or a
        // warm-pool refill.
        let someone_waits = !self.pending.is_empty() || self.any_warm_target();
        let breakers = self
            .breakers
            .values()
            .filter(|_| someone_waits)
            .filter_map(|b| b.next_change(now));
        agents
            .chain(pending)
            .chain(breakers)
            .chain(self.next_plan(now))
            .min()
    }

    /// Fires every deadline that has passed.
    pub fn tick(&mut self, now: Instant) {
        let due: Vec<(AgentId, AgentState)> = self
            .agents
            .values()
            .filter(|a| a.deadline(&self.settings).is_some_and(|d| d <= now))
            .map(|a| (a.id, a.state))
            .collect();
        for (id, state) in due {
            let Some(a) = self.agents.get(&id) else {
                continue;
            };
            let lifetime_over = now >= a.created + a.scaler().ext.deadlines.max_lifetime;
            match state {
                AgentState::Destroying => self.issue_destroy(id, now),
                _ if lifetime_over => {
                    self.fail(id, FailureReason::LifetimeExceeded, None, now);
                }
                AgentState::Provisioning if a.delivered_at.is_some() => {
                    self.fail(id, FailureReason::RegistrationTimeout, None, now)
                }
                AgentState::Requested | AgentState::Provisioning => {
                    self.fail(id, FailureReason::ProvisionTimeout, None, now)
                }
                AgentState::Booted => self.fail(id, FailureReason::RegistrationTimeout, None, now),
                AgentState::Registered => {
                    self.fail(id, FailureReason::PendingDispatchTimeout, None, now)
                }
                AgentState::Idle => self.drain_idle(id, StopCause::IdleExpired, now),
                AgentState::Busy | AgentState::Draining | AgentState::Gone => {}
            }
        }
        // Schedules and forecasts: new targets, and a smaller one drains
        // the pool's newest idle agents (the refill below grows it).
        if self.plan_if_due(now) {
            self.shrink_warm(now);
        }
        let expired = self.pending.take_expired(now);
        for entry in expired {
            self.jobs.remove(&entry.request.job);
            self.pending_ended(&entry, PendingEnd::Expired, now);
        }
        self.after_release(now);
    }
}
