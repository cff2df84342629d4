//! Reload: a new configuration applied at once, all or nothing.

use super::*;

impl Engine {
    /// Applies a new, fully validated configuration atomically. Removed
    /// scalers (and scalers whose `type` changed) stop routing at once, their
    /// pending requests are cancelled and their agents finish and leave.
    pub fn reload(
        &mut self,
        config: Arc<Config>,
        now: Instant,
    ) -> Result<ReloadReport, ReloadError> {
        self.admission
            .reconfigure(&config)
            .map_err(|e| ReloadError::Admission(e.to_string()))?;
        let old = std::mem::replace(&mut self.config, Arc::clone(&config));
        self.router = Router::new(&config, &self.host);
        let changes: Vec<String> = kici_config::diff(&old, &config)
            .iter()
            .map(|c| c.to_string())
            .collect();
        for change in &changes {
            tracing::info!(change = %change, "config reload: field changed");
        }
        let kept = |name: &ScalerName, kind: ScalerType| {
            config.scaler(name.as_str()).is_some_and(|s| s.kind == kind)
        };
        let removed: Vec<ScalerName> = old
            .scalers
            .iter()
            .filter(|s| !kept(&s.name, s.kind))
            .map(|s| s.name.clone())
            .collect();
        let added: Vec<ScalerName> = config
            .scalers
            .iter()
            .filter(|s| old.scaler(s.name.as_str()).is_none_or(|o| o.kind != s.kind))
            .map(|s| s.name.clone())
            .collect();
        // Switches survive for scalers that stay.
        self.switches
            .retain(|name, _| !removed.contains(name) && config.scaler(name.as_str()).is_some());
        self.cordons = CordonSet::from_indices(
            config
                .scalers
                .iter()
                .enumerate()
                .filter(|(_, s)| self.switches.get(&s.name).is_some_and(|w| w.cordoned))
                .map(|(i, _)| i),
        );
        // Agents of removed scalers finish and leave.
        for name in &removed {
            let ids: Vec<AgentId> = self
                .agents
                .values()
                .filter(|a| {
                    a.name() == name
                        && a.scaler().kind
                            == old
                                .scaler(name.as_str())
                                .map_or(a.scaler().kind, |s| s.kind)
                })
                .map(|a| a.id)
                .collect();
            for id in ids {
                if let Some(a) = self.agents.get_mut(&id) {
                    a.drain_after_job = true;
                }
            }
            self.drain_agents_of(name.as_str(), now);
        }
        // Re-route every pending request against the new config.
        let entries = self.pending.take_where(|_| true);
        let mut report = ReloadReport {
            added: added.iter().map(|n| n.to_string()).collect(),
            removed: removed.iter().map(|n| n.to_string()).collect(),
            cancelled: Vec::new(),
            changes,
        };
        for mut entry in entries {
            let was_removed = removed.contains(&entry.scaler);
            let route = self.router.route(
                &entry.request.labels,
                &entry.request.exclude,
                &CordonSet::none(),
            );
            match route {
                Some(route)
                    if !was_removed || config.scalers[route.scaler].name != entry.scaler =>
                {
                    entry.scaler = config.scalers[route.scaler].name.clone();
                    entry.scaler_index = route.scaler;
                    entry.label_set = route.label_set;
                    entry.resources = self.resolve_resources(&entry.request, route);
                    self.pending.insert(entry);
                }
                _ => {
                    self.jobs.remove(&entry.request.job);
                    report.cancelled.push(entry.request.job.to_string());
                    let end = if was_removed {
                        PendingEnd::Cancelled
                    } else {
                        PendingEnd::NoBackend
                    };
                    self.pending_ended(&entry, end, now);
                }
            }
        }
        self.rebuild_breakers();
        // Schedules and forecasts apply the new configuration at once.
        self.plan_warm(now);
        self.shrink_warm(now);
        self.events.push(EngineEvent::Reloaded {
            added: report.added.clone(),
            removed: report.removed.clone(),
        });
        self.after_release(now);
        // A raised `maxConcurrentSpawns` starts waiting spawns now.
        self.dispatch_all_spawns(now);
        Ok(report)
    }

    pub(super) fn rebuild_breakers(&mut self) {
        let mut live = HashSet::new();
        for scaler in &self.config.scalers {
            for ls in &scaler.label_sets {
                let key = (scaler.name.clone(), ls.labels.clone());
                self.breakers
                    .entry(key.clone())
                    .and_modify(|b| b.set_policy(scaler.ext.backoff))
                    .or_insert_with(|| Breaker::new(scaler.ext.backoff));
                live.insert(key);
            }
        }
        self.breakers.retain(|k, _| live.contains(k));
    }

    /// A smaller warm target destroys the newest idle warm agents first.
    pub(super) fn shrink_warm(&mut self, now: Instant) {
        let config = Arc::clone(&self.config);
        for scaler in &config.scalers {
            for li in 0..scaler.label_sets.len() {
                let target = self.warm_target_of(scaler, li);
                // A held agent is about to take a job: not shrunk away.
                let mut warm: Vec<((Instant, u64), AgentId, AgentState)> = self
                    .warm_members(&scaler.name, li)
                    .filter(|a| !self.warm_held(a.id))
                    .map(|a| ((a.created, a.seq), a.id, a.state))
                    .collect();
                if warm.len() <= target {
                    continue;
                }
                warm.sort_by_key(|w| w.0);
                for (_, id, state) in warm.split_off(target) {
                    match state {
                        AgentState::Idle => self.drain_idle(id, StopCause::ScaleIn, now),
                        s if s.is_spawning() => self.stop(id, StopCause::ScaleIn, now),
                        _ => {}
                    }
                }
            }
        }
    }
}
