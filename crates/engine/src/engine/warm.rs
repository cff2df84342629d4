//! Warm pools: keeping each warm label set at its target, handing an idle
//! warm agent to a job, shrinking a pool after a reload.

use super::*;

impl Engine {
    /// Binds the job to an idle warm agent of the routed label set whose
    /// reservation covers exactly the job's requests; one replacement follows.
    pub(super) fn take_warm(
        &mut self,
        route: Route,
        request: &ScaleRequest,
        resources: EffectiveResources,
        now: Instant,
    ) -> Option<AgentId> {
        let id = self.idle_warm_agent(route, resources)?;
        self.bind_warm(id, request, now);
        Some(id)
    }

    /// The longest-idle warm agent of `route`'s label set whose reservation
    /// is exactly `resources`' requests, not set aside by a hold.
    pub(super) fn idle_warm_agent(
        &self,
        route: Route,
        resources: EffectiveResources,
    ) -> Option<AgentId> {
        let name = &self.config.scalers[route.scaler].name;
        self.agents
            .values()
            .filter(|a| {
                a.warm
                    && a.state == AgentState::Idle
                    && a.job.is_none()
                    && a.name() == name
                    && a.label_set == route.label_set
                    && a.requests() == resources.requests
                    && !self.warm_held(a.id)
            })
            .min_by_key(|a| (a.since, a.seq))
            .map(|a| a.id)
    }

    /// Gives `request`'s job to the idle warm agent `id`; one replacement
    /// follows.
    pub(super) fn bind_warm(&mut self, id: AgentId, request: &ScaleRequest, now: Instant) {
        self.jobs.insert(
            request.job.clone(),
            JobRecord {
                request: Some(request.clone()),
                agent: Some(id),
            },
        );
        if let Some(a) = self.agents.get_mut(&id) {
            a.job = Some(request.job.clone());
            a.run_id.clone_from(&request.run_id);
            a.mode = request.mode;
            // The agent leaves the pool: it is a job agent from now on.
            a.warm = false;
            a.from_pool = true;
        }
        self.step(id, AgentEvent::JobStarted, now);
        if request.mode == Mode::Standalone {
            // Its connection is open and idle: nobody else sends it the job.
            self.effects.push(Effect::Job(JobEffect::Dispatch {
                job: request.job.clone(),
                agent: id,
            }));
        }
        self.refill_warm(now);
    }

    /// The agents that count toward a label set's warm pool: spawned warm,
    /// not taken, not on their way out.
    pub(super) fn warm_members<'a>(
        &'a self,
        scaler: &'a ScalerName,
        label_set: usize,
    ) -> impl Iterator<Item = &'a Agent> + 'a {
        self.agents.values().filter(move |a| {
            a.warm
                && a.name() == scaler
                && a.label_set == label_set
                && !matches!(
                    a.state,
                    AgentState::Draining | AgentState::Destroying | AgentState::Gone
                )
        })
    }

    /// Spawns warm agents until every warm label set has `size` idle or
    /// in-flight warm agents. Never ahead of pending requests of the same
    /// scaler, never past a cap, never while the label set backs off.
    pub(super) fn refill_warm(&mut self, now: Instant) {
        if self.shutting_down {
            return;
        }
        let config = Arc::clone(&self.config);
        for (si, scaler) in config.scalers.iter().enumerate() {
            let switches = self.switches.get(&scaler.name).copied().unwrap_or_default();
            if switches.cordoned || switches.draining {
                continue;
            }
            if self.pending.count_for(scaler.name.as_str()) > 0 {
                continue;
            }
            for (li, ls) in scaler.label_sets.iter().enumerate() {
                let target = self.warm_target_of(scaler, li);
                if target == 0 {
                    continue;
                }
                let have = self.warm_members(&scaler.name, li).count();
                let key = (scaler.name.clone(), ls.labels.clone());
                for _ in have..target {
                    if self
                        .breakers
                        .get(&key)
                        .is_some_and(|b| b.check(now).is_err())
                    {
                        break;
                    }
                    let resources = EffectiveResources::resolve(&[
                        ls.resources.as_ref(),
                        config.defaults.as_ref(),
                    ]);
                    let agent = self.fresh_agent_id(scaler.kind, &[]);
                    let demand = Demand {
                        agent,
                        scaler: scaler.name.clone(),
                        requests: resources.requests,
                        pool: scaler.machine_pool.clone(),
                    };
                    match self.admission.try_reserve(demand, &Holds::none()) {
                        Ok(reservation) => {
                            self.start_agent(agent, si, li, reservation, resources, None, now)
                        }
                        Err(_) => break,
                    }
                }
            }
        }
    }
}
