//! The spawn throttle: at most `maxConcurrentSpawns` backend spawns of one
//! scaler in flight at once; admitted agents beyond it wait in `requested`,
//! in admission order, and are started one by one as earlier spawns end.
//!
//! An agent holds its reservation while it waits (it is admitted: the
//! throttle bounds the provisioning rate, not the population), and its
//! provisioning deadline starts only when its spawn does. "In flight" is
//! exactly the agents in `provisioning` whose spawn has not ended (an
//! external `event` agent stays `provisioning` after its scale-up was
//! delivered, until it registers, without holding a slot); the counts are
//! kept by
//! [`Engine::apply`](super::Engine) as agents enter and leave that state,
//! so every path out of it (booted, failed, timed out, stopped) frees its
//! slot.

use super::*;

/// One scaler's throttle, keyed by scaler name so it survives a reload.
#[derive(Debug, Default)]
pub(super) struct SpawnQueue {
    /// Agents in `provisioning`: their backend spawn runs.
    pub(super) in_flight: usize,
    /// Admitted agents waiting for a slot, oldest first.
    pub(super) waiting: VecDeque<AgentId>,
}

impl Engine {
    /// The throttle's limit for `scaler`: the current configuration's, or,
    /// for a scaler a reload removed, the one its agents were created under.
    fn spawn_limit(&self, scaler: &ScalerName, fallback: &ScalerEntry) -> usize {
        let limit = self
            .config
            .scaler(scaler.as_str())
            .map_or(fallback.max_concurrent_spawns, |s| s.max_concurrent_spawns);
        // The loader refuses 0; a limit of 0 would wait forever.
        (limit as usize).max(1)
    }

    /// Queues `order`'s spawn behind its scaler's waiting agents and starts
    /// what the limit allows.
    pub(super) fn queue_spawn(&mut self, order: SpawnOrder, now: Instant) {
        let id = order.agent;
        let name = order.scaler().name.clone();
        let Some(a) = self.agents.get_mut(&id) else {
            return;
        };
        a.queued_spawn = Some(order);
        self.spawn_queues
            .entry(name.clone())
            .or_default()
            .waiting
            .push_back(id);
        self.dispatch_spawns(&name, now);
        if self
            .agents
            .get(&id)
            .is_some_and(|a| a.state == AgentState::Requested)
        {
            // Still waiting: recorded, so that a restart finds (and
            // releases) its reservation's owner.
            self.journal_agent(id, now);
        }
    }

    /// Starts the spawns of `scaler`'s oldest waiting agents while it has
    /// free slots.
    pub(super) fn dispatch_spawns(&mut self, scaler: &ScalerName, now: Instant) {
        if self.shutting_down {
            return;
        }
        loop {
            let Some(queue) = self.spawn_queues.get_mut(scaler) else {
                return;
            };
            let Some(&next) = queue.waiting.front() else {
                return;
            };
            let in_flight = queue.in_flight;
            let Some(a) = self.agents.get(&next) else {
                queue.waiting.pop_front();
                continue;
            };
            if in_flight >= self.spawn_limit(scaler, a.scaler()) {
                return;
            }
            if let Some(queue) = self.spawn_queues.get_mut(scaler) {
                queue.waiting.pop_front();
            }
            let order = self
                .agents
                .get_mut(&next)
                .and_then(|a| a.queued_spawn.take());
            let Some(order) = order else {
                continue;
            };
            self.effects.push(Effect::Spawn(order));
            self.step(next, AgentEvent::ProvisionStarted, now);
        }
    }

    /// Starts what every scaler's limit allows (after a reload changed them).
    pub(super) fn dispatch_all_spawns(&mut self, now: Instant) {
        let names: Vec<ScalerName> = self
            .spawn_queues
            .iter()
            .filter(|(_, q)| !q.waiting.is_empty())
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            self.dispatch_spawns(&name, now);
        }
    }

    /// Keeps the throttle's books as `agent` goes `from` → `to`; returns
    /// whether a slot of its scaler was freed.
    pub(super) fn track_spawn(
        &mut self,
        agent: AgentId,
        scaler: &ScalerName,
        from: AgentState,
        to: AgentState,
    ) -> bool {
        let queue = self.spawn_queues.entry(scaler.clone()).or_default();
        if from == AgentState::Requested && to != AgentState::Requested {
            // Left the queue some other way (stopped, registered early):
            // its order is dropped with it.
            queue.waiting.retain(|w| *w != agent);
            if let Some(a) = self.agents.get_mut(&agent) {
                a.queued_spawn = None;
            }
        }
        // A delivered external agent stays provisioning without its slot.
        let delivered = self
            .agents
            .get(&agent)
            .is_some_and(|a| a.delivered_at.is_some());
        self.book_spawn_slot(
            scaler,
            from == AgentState::Provisioning && !delivered,
            to == AgentState::Provisioning && !delivered,
        )
    }

    /// The one place the books of `scaler`'s slots change: an agent that
    /// `held` a slot and now `holds` one or not; returns whether a slot was
    /// freed.
    pub(super) fn book_spawn_slot(&mut self, scaler: &ScalerName, held: bool, holds: bool) -> bool {
        let queue = self.spawn_queues.entry(scaler.clone()).or_default();
        match (held, holds) {
            (false, true) => {
                queue.in_flight += 1;
                false
            }
            (true, false) => {
                queue.in_flight = queue.in_flight.saturating_sub(1);
                true
            }
            _ => false,
        }
    }

    /// `(in flight, waiting)` for `scaler`.
    pub(super) fn spawn_counts(&self, scaler: &ScalerName) -> (usize, usize) {
        self.spawn_queues
            .get(scaler)
            .map_or((0, 0), |q| (q.in_flight, q.waiting.len()))
    }
}
