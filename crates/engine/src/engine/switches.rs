//! Operator switches per scaler: cordon, uncordon, drain.

use super::*;

impl Engine {
    pub(super) fn scaler_index(&self, name: &str) -> Result<usize, AgentError> {
        self.router
            .scaler_index(name)
            .ok_or_else(|| AgentError::UnknownScaler(name.to_owned()))
    }

    /// Stop routing new requests to a scaler; running agents are untouched.
    pub fn cordon(&mut self, name: &str) -> Result<(), AgentError> {
        self.set_switches(name, |s| s.cordoned = true)
    }

    pub fn uncordon(&mut self, name: &str, now: Instant) -> Result<(), AgentError> {
        self.set_switches(name, |s| *s = ScalerSwitches::default())?;
        self.after_release(now);
        Ok(())
    }

    /// Cordon, cancel the scaler's pending requests, destroy its idle agents,
    /// let busy ones finish their job and then leave.
    pub fn drain(&mut self, name: &str, now: Instant) -> Result<(), AgentError> {
        self.set_switches(name, |s| {
            s.cordoned = true;
            s.draining = true;
        })?;
        let cancelled = self.pending.take_where(|e| e.scaler.as_str() == name);
        for entry in cancelled {
            self.jobs.remove(&entry.request.job);
            self.pending_ended(&entry, PendingEnd::Cancelled, now);
        }
        self.drain_agents_of(name, now);
        Ok(())
    }

    pub(super) fn drain_agents_of(&mut self, name: &str, now: Instant) {
        let ids: Vec<AgentId> = self
            .agents
            .values()
            .filter(|a| a.name().as_str() == name)
            .map(|a| a.id)
            .collect();
        for id in ids {
            let Some(a) = self.agents.get_mut(&id) else {
                continue;
            };
            a.drain_after_job = true;
            match a.state {
                AgentState::Idle => self.drain_idle(id, StopCause::ScaleIn, now),
                // Unbound (warm) agents still coming up are not needed.
                s if s.is_spawning() && a.job.is_none() => self.stop(id, StopCause::ScaleIn, now),
                _ => {}
            }
        }
    }

    pub(super) fn set_switches(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut ScalerSwitches),
    ) -> Result<(), AgentError> {
        let index = self.scaler_index(name)?;
        let key = self.config.scalers[index].name.clone();
        let switches = self.switches.entry(key.clone()).or_default();
        f(switches);
        let s = *switches;
        if s.cordoned {
            self.cordons.insert(index);
        } else {
            self.cordons.remove(index);
        }
        self.events.push(EngineEvent::ScalerCordon {
            scaler: key,
            cordoned: s.cordoned,
            draining: s.draining,
        });
        Ok(())
    }
}
