//! Admission holds: capacity set aside for a request while a coordinator
//! (a fleet's shared queue) decides whether this host serves it.
//!
//! A host that records requests in a shared queue must not admit one before
//! the queue agrees — else it admits, then takes the admission back when the
//! queue says another request is first. A hold asks first: it reserves what
//! the request would need (or sets an idle warm agent aside) and records
//! nothing else — no job, no agent, no event. The coordinator's answer then
//! either turns the hold into the admission ([`Engine::admit_held`]) or lets
//! it go (dropping it releases the reservation and the warm agent).

use std::sync::Weak;

use super::*;

/// What an [`AdmissionHold`] sets aside.
enum Held {
    /// Capacity reserved for a new agent, under an id drawn for it.
    Fresh {
        agent: AgentId,
        reservation: Reservation,
    },
    /// An idle warm agent, kept from other jobs and from shrinking while
    /// the hold lives (the engine sees the hold's token alive).
    Warm { agent: AgentId, _token: Arc<()> },
}

/// Capacity held for one request until the coordinator answers. Not
/// `Clone`; dropping it releases what it holds.
pub struct AdmissionHold {
    request: ScaleRequest,
    /// The configuration the hold was routed under: a reload in between
    /// lapses it.
    config: Arc<Config>,
    route: Route,
    resources: EffectiveResources,
    held: Held,
}

impl AdmissionHold {
    /// The agent that will serve the request if the hold is admitted.
    pub fn agent(&self) -> AgentId {
        match &self.held {
            Held::Fresh { agent, .. } | Held::Warm { agent, .. } => *agent,
        }
    }

    /// Whether the agent is an idle warm one (no spawn follows).
    pub fn warm(&self) -> bool {
        matches!(self.held, Held::Warm { .. })
    }

    pub fn job(&self) -> &JobId {
        &self.request.job
    }
}

impl std::fmt::Debug for AdmissionHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionHold")
            .field("job", &self.request.job)
            .field("agent", &self.agent())
            .field("warm", &self.warm())
            .finish()
    }
}

/// Why no hold was taken.
#[derive(Debug, Clone, PartialEq)]
pub enum HoldRefused {
    /// The engine knows the job already (its answer is
    /// [`Engine::job_outcome`]).
    Known,
    /// Not here now: the scaler is cordoned, draining or backing off, its
    /// local queue has older requests, or a cap is full.
    NotNow,
    /// The final answer for this request (no scaler takes it, or it can
    /// never fit).
    Final(ScaleOutcome),
    /// The engine is shutting down.
    ShuttingDown,
}

/// Why a hold could not be admitted: what it held is gone. Nothing was
/// recorded; the coordinator must take back what it granted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HoldLapsed {
    #[error("the configuration was reloaded while the hold waited")]
    Reloaded,
    #[error("the held warm agent {0} is no longer idle")]
    WarmAgentGone(AgentId),
    #[error("the engine learnt of job {0} while the hold waited")]
    Known(JobId),
    #[error("the engine is shutting down")]
    ShuttingDown,
}

impl Engine {
    /// Sets aside what `request` needs here, recording nothing: an idle warm
    /// agent of its label set if one fits exactly, else capacity for a new
    /// agent. Refused when the job is known, the request's scaler cannot
    /// take it now, or older requests wait for that scaler locally.
    pub fn hold(
        &mut self,
        request: &ScaleRequest,
        now: Instant,
    ) -> Result<AdmissionHold, HoldRefused> {
        if self.shutting_down {
            return Err(HoldRefused::ShuttingDown);
        }
        if self.jobs.contains_key(&request.job) {
            return Err(HoldRefused::Known);
        }
        let (route, resources) = self.route_request(request).map_err(HoldRefused::Final)?;
        let config = Arc::clone(&self.config);
        let scaler = &config.scalers[route.scaler];
        let name = scaler.name.clone();
        let switches = self.switches.get(&name).copied().unwrap_or_default();
        if switches.cordoned || switches.draining || self.pending.count_for(name.as_str()) > 0 {
            return Err(HoldRefused::NotNow);
        }
        self.forget_dropped_holds();
        if let Some(agent) = self.idle_warm_agent(route, resources) {
            let token = Arc::new(());
            self.warm_holds.insert(agent, Arc::downgrade(&token));
            return Ok(AdmissionHold {
                request: request.clone(),
                config,
                route,
                resources,
                held: Held::Warm {
                    agent,
                    _token: token,
                },
            });
        }
        let key = (
            name.clone(),
            scaler.label_sets[route.label_set].labels.clone(),
        );
        if self
            .breakers
            .get(&key)
            .is_some_and(|b| b.check(now).is_err())
        {
            return Err(HoldRefused::NotNow);
        }
        for _ in 0..ID_DRAWS {
            let agent = self.fresh_agent_id(scaler.kind, &[]);
            let demand = Demand {
                agent,
                scaler: name.clone(),
                requests: resources.requests,
                pool: scaler.machine_pool.clone(),
            };
            match self.admission.try_reserve(demand, &Holds::none()) {
                Ok(reservation) => {
                    return Ok(AdmissionHold {
                        request: request.clone(),
                        config,
                        route,
                        resources,
                        held: Held::Fresh { agent, reservation },
                    })
                }
                // A colliding id: draw another.
                Err(AdmitError::DuplicateAgent(_)) => {}
                Err(_) => return Err(HoldRefused::NotNow),
            }
        }
        Err(HoldRefused::NotNow)
    }

    /// Admits the request `hold` was taken for, with the agent it names:
    /// a new agent is created (its spawn follows), a held warm agent takes
    /// the job. Nothing was recorded for the request before this call.
    pub fn admit_held(
        &mut self,
        hold: AdmissionHold,
        now: Instant,
    ) -> Result<ScaleOutcome, HoldLapsed> {
        let AdmissionHold {
            request,
            config,
            route,
            resources,
            held,
        } = hold;
        if self.shutting_down {
            return Err(HoldLapsed::ShuttingDown);
        }
        if !Arc::ptr_eq(&config, &self.config) {
            return Err(HoldLapsed::Reloaded);
        }
        if self.jobs.contains_key(&request.job) {
            return Err(HoldLapsed::Known(request.job));
        }
        match held {
            Held::Fresh { agent, reservation } => {
                self.record_arrival(route.scaler, route.label_set, now);
                let job = request.job.clone();
                self.jobs.insert(
                    job.clone(),
                    JobRecord {
                        request: Some(request.clone()),
                        agent: Some(agent),
                    },
                );
                self.start_agent(
                    agent,
                    route.scaler,
                    route.label_set,
                    reservation,
                    resources,
                    Some(request),
                    now,
                );
                Ok(self.current_outcome(&job, Some(agent)))
            }
            Held::Warm { agent, _token } => {
                self.warm_holds.remove(&agent);
                let idle = self
                    .agents
                    .get(&agent)
                    .is_some_and(|a| a.warm && a.state == AgentState::Idle && a.job.is_none());
                if !idle {
                    return Err(HoldLapsed::WarmAgentGone(agent));
                }
                self.record_arrival(route.scaler, route.label_set, now);
                self.bind_warm(agent, &request, now);
                Ok(self.current_outcome(&request.job, Some(agent)))
            }
        }
    }

    /// Whether a live hold sets `agent` aside.
    pub(super) fn warm_held(&self, agent: AgentId) -> bool {
        self.warm_holds
            .get(&agent)
            .is_some_and(|token| token.strong_count() > 0)
    }

    /// Forgets the marks of holds dropped without being admitted.
    fn forget_dropped_holds(&mut self) {
        self.warm_holds.retain(|_, token| token.strong_count() > 0);
    }
}

/// The engine's marks of held warm agents: alive while the hold is.
pub(super) type WarmHolds = HashMap<AgentId, Weak<()>>;
