//! What backends and agents report: a spawn's result, an exit, a
//! registration, a job's start and end, a disconnect, a destroy's result.

use super::*;

impl Engine {
    /// The backend reports the resource up.
    pub fn spawn_succeeded(&mut self, agent: AgentId, handle: ResourceHandle, now: Instant) {
        let Some(a) = self.agents.get_mut(&agent) else {
            return;
        };
        a.handle = Some(handle);
        if a.state == AgentState::Provisioning && a.scaler().kind == ScalerType::Event {
            // Delivered, not booted: the instance boots elsewhere and the
            // agent stays provisioning until it registers. The spawn itself
            // is over, so its throttle slot goes to the next one.
            if a.delivered_at.is_none() {
                a.delivered_at = Some(now);
                let scaler = a.name().clone();
                self.journal_agent(agent, now);
                if self.book_spawn_slot(&scaler, true, false) {
                    self.dispatch_spawns(&scaler, now);
                }
            }
        } else if matches!(a.state, AgentState::Requested | AgentState::Provisioning) {
            self.step(agent, AgentEvent::Booted, now);
        } else {
            // Registration came first; the handle still has to be recorded.
            self.journal_agent(agent, now);
        }
    }

    /// The backend could not create the resource.
    pub fn spawn_failed(&mut self, agent: AgentId, detail: String, now: Instant) {
        self.fail(agent, FailureReason::ProvisionError, Some(detail), now);
    }

    /// The agent's process/container/VM ended, or the guest failed to boot.
    pub fn agent_exited(
        &mut self,
        agent: AgentId,
        boot_failure: bool,
        detail: String,
        now: Instant,
    ) {
        let Some(a) = self.agents.get(&agent) else {
            return;
        };
        if a.state.is_spawning() {
            let reason = if boot_failure {
                FailureReason::BootFailure
            } else {
                FailureReason::ExitedEarly
            };
            self.fail(agent, reason, Some(detail), now);
        } else if !matches!(a.state, AgentState::Destroying | AgentState::Gone) {
            self.stop(agent, StopCause::Disconnected, now);
        }
    }

    /// A valid registration (the token was checked by the caller).
    pub fn agent_registered(
        &mut self,
        agent: AgentId,
        now: Instant,
    ) -> Result<Registration, AgentError> {
        let a = self.agents.get(&agent).ok_or_else(|| self.unknown(agent))?;
        let state = a.state;
        let (scaler, took) = (a.name().clone(), now.saturating_duration_since(a.created));
        let registration = Registration {
            bound_job_id: a.job.clone(),
            mandatory_labels: a.gate.clone(),
        };
        match state {
            // Idempotent: a retried call gets the same answer.
            AgentState::Registered | AgentState::Idle | AgentState::Busy => {
                return Ok(registration)
            }
            AgentState::Requested => {
                self.step(agent, AgentEvent::ProvisionStarted, now);
            }
            _ => {}
        }
        let key = self.breaker_key(agent);
        self.apply(agent, AgentEvent::Registered, now, None, None)?;
        // The forecast's lead time: how long this scaler's agents take.
        self.record_lead(&scaler, took);
        if let Some(b) = key.and_then(|k| self.breakers.get_mut(&k)) {
            let was = b.state(now);
            b.on_success();
            if was != BreakerState::Closed {
                self.breaker_changed(agent, BreakerState::Closed);
            }
        }
        if registration.bound_job_id.is_none() {
            self.apply(agent, AgentEvent::NoJobBound, now, None, None)?;
            // An unbound agent of a draining or removed scaler leaves at once.
            if self.should_leave_idle(agent) {
                self.drain_idle(agent, StopCause::ScaleIn, now);
            }
        }
        Ok(registration)
    }

    pub(super) fn should_leave_idle(&self, agent: AgentId) -> bool {
        let Some(a) = self.agents.get(&agent) else {
            return false;
        };
        a.drain_after_job
            || self.switches.get(a.name()).is_some_and(|s| s.draining)
            || self.config.scaler(a.name().as_str()).is_none()
    }

    /// The orchestrator (or our gateway) handed `job` to the agent.
    pub fn job_started(
        &mut self,
        agent: AgentId,
        job: JobId,
        now: Instant,
    ) -> Result<(), AgentError> {
        let a = self
            .agents
            .get_mut(&agent)
            .ok_or(AgentError::NotOurs(agent))?;
        match a.state {
            AgentState::Busy if a.job.as_ref() == Some(&job) => Ok(()),
            AgentState::Busy => Err(AgentError::WrongJob {
                agent,
                current: a.job.clone().unwrap_or_else(|| job.clone()),
                given: job,
            }),
            _ => {
                a.job = Some(job);
                a.warm = false;
                self.apply(agent, AgentEvent::JobStarted, now, None, None)?;
                Ok(())
            }
        }
    }

    /// The job ended. Standalone: the agent is destroyed; orchestrator mode:
    /// it goes idle and may take another job (unless its scaler drains).
    pub fn job_completed(
        &mut self,
        agent: AgentId,
        job: &JobId,
        exit_code: Option<i32>,
        now: Instant,
    ) -> Result<(), AgentError> {
        let a = self
            .agents
            .get_mut(&agent)
            .ok_or(AgentError::NotOurs(agent))?;
        if a.state != AgentState::Busy {
            // Idempotent: a retried completion, or one after disconnect.
            return Ok(());
        }
        if a.job.as_ref() != Some(job) {
            return Err(AgentError::WrongJob {
                agent,
                current: a.job.clone().unwrap_or_else(|| job.clone()),
                given: job.clone(),
            });
        }
        a.last_exit_code = exit_code;
        a.release_job();
        let mode = a.mode;
        let drain = a.drain_after_job;
        let name = a.name().clone();
        let draining = self.switches.get(&name).is_some_and(|s| s.draining)
            || self.config.scaler(name.as_str()).is_none();
        self.jobs.remove(job);
        let event = AgentEvent::JobCompleted {
            mode,
            drain: drain || draining,
        };
        self.apply(agent, event, now, None, None)?;
        if self
            .agents
            .get(&agent)
            .is_some_and(|a| a.state == AgentState::Destroying)
        {
            self.issue_destroy(agent, now);
        }
        Ok(())
    }

    /// The agent's connection closed: destroy it (every mode).
    pub fn agent_disconnected(&mut self, agent: AgentId, now: Instant) -> Result<(), AgentError> {
        let a = self.agents.get(&agent).ok_or_else(|| self.unknown(agent))?;
        if !matches!(a.state, AgentState::Destroying | AgentState::Gone) {
            self.stop(agent, StopCause::Disconnected, now);
        }
        Ok(())
    }

    /// Operator DELETE.
    pub fn destroy_agent(&mut self, agent: AgentId, now: Instant) -> Result<(), AgentError> {
        let a = self.agents.get(&agent).ok_or_else(|| self.unknown(agent))?;
        if !matches!(a.state, AgentState::Destroying | AgentState::Gone) {
            self.stop(agent, StopCause::Operator, now);
        }
        Ok(())
    }

    /// Every release step of the backend finished: the agent is gone and its
    /// reservation is released, which may admit pending requests.
    pub fn destroy_finished(&mut self, agent: AgentId, now: Instant) {
        let Some(a) = self.agents.get(&agent) else {
            return;
        };
        if a.state != AgentState::Destroying {
            return;
        }
        self.step(agent, AgentEvent::Released, now);
        self.effects.push(Effect::Revoke(agent));
        if let Some(mut a) = self.agents.remove(&agent) {
            // Its last view keeps what it had (job, resources) for
            // `GET /v1/agents?all=true`: taken before they are released.
            // A job it let go of earlier (completed, ended, cancelled) is
            // still the job it served.
            let mut view = self.view(&a, now);
            if view.job_id.is_none() {
                view.job_id.clone_from(&a.last_job);
            }
            self.effects.push(Effect::Ended(EndedAgent {
                agent,
                job: view.job_id.clone(),
                failure: a.failure,
            }));
            // The single release of this agent's capacity.
            drop(a.reservation.take());
            if let Some(job) = a.job.take() {
                if self.jobs.get(&job).is_some_and(|r| r.agent == Some(agent)) {
                    self.jobs.remove(&job);
                }
            }
            self.gone.push_back(GoneAgent { view, since: now });
            while self.gone.len() > self.settings.gone_history {
                self.gone.pop_front();
            }
        }
        self.after_release(now);
    }

    /// The backend could not finish destroying; it is retried later.
    pub fn destroy_failed(&mut self, agent: AgentId, detail: String, now: Instant) {
        if let Some(a) = self.agents.get_mut(&agent) {
            if a.state == AgentState::Destroying {
                let failures = a.destroy.map_or(0, DestroyProgress::failures) + 1;
                a.destroy = Some(DestroyProgress::Backoff {
                    at: now + destroy_backoff(failures, self.settings.destroy_retry),
                    failures,
                });
                let (scaler, backend) = (a.name().clone(), a.scaler().kind);
                self.events.push(EngineEvent::AgentTransition {
                    agent_id: agent,
                    scaler,
                    backend,
                    from: AgentState::Destroying,
                    to: AgentState::Destroying,
                    job_id: None,
                    failure_reason: None,
                    cause: Some(TransitionCause::DestroyRetry),
                    detail: Some(detail),
                    seconds_in_state: 0.0,
                });
            }
        }
    }

    pub(super) fn after_release(&mut self, now: Instant) {
        // A ledger failure here leaves requests pending; they are retried on
        // the next release or tick.
        let _ = self.serve_pending(now);
        self.refill_warm(now);
    }

    pub(super) fn unknown(&self, agent: AgentId) -> AgentError {
        if self.gone.iter().any(|g| g.view.agent_id == agent) {
            AgentError::Gone(agent)
        } else {
            AgentError::NotOurs(agent)
        }
    }
}
