//! Removing what an agent holds, step by step, from the agent id alone if
//! need be: stop, drain the output, remove with volumes, rules, lease.

use super::*;

/// `DELETE /containers/{id}?force=true&v=true` (anonymous volumes too: see
/// docs/deviations.md, D-container-cleanup);
/// gone already or being removed (a concurrent destroy) counts as done.
pub(super) async fn remove_forced(rt: &Runtime, id: &str, api: Duration) -> Result<(), StepError> {
    let removed = rt
        .call_opt(
            "DELETE /containers/{id}",
            api,
            rt.conn.docker.remove_container(
                id,
                Some(RemoveContainerOptions {
                    force: true,
                    v: true,
                    link: false,
                }),
            ),
        )
        .await;
    match removed {
        Ok(_) => Ok(()),
        Err(StepError::Api { reason, .. }) if reason.contains("409") => Ok(()),
        Err(e) => Err(e),
    }
}

impl ContainerBackend {
    /// Removes everything of `agent`: the container on each of `runtimes`
    /// (only if it carries our instance label), the rules, the lease.
    pub(super) async fn teardown(
        &self,
        agent: AgentId,
        container: Option<&str>,
        runtimes: &[Arc<Runtime>],
        logs: Option<JoinHandle<()>>,
        grace: Duration,
        api: Duration,
    ) -> Result<(), Vec<StepError>> {
        let mut errors = Vec::new();
        let name = container_name(&agent);
        let mut logs = logs;
        for rt in runtimes {
            let docker = &rt.conn.docker;
            // By id when we have it (a renamed container is still ours), by
            // name otherwise; only ours by label is touched.
            let mut target = container.map(str::to_owned);
            let inspected = match rt
                .call_opt(
                    "GET /containers/{id}/json",
                    api,
                    states::inspect_container(docker, target.as_deref().unwrap_or(&name)),
                )
                .await
            {
                Ok(Some(c)) => Some(c),
                Ok(None) if target.is_some() => {
                    target = None;
                    match rt
                        .call_opt(
                            "GET /containers/{id}/json",
                            api,
                            states::inspect_container(docker, &name),
                        )
                        .await
                    {
                        Ok(c) => c,
                        Err(e) => {
                            errors.push(e);
                            continue;
                        }
                    }
                }
                Ok(None) => None,
                Err(e @ StepError::Api { .. }) if container.is_some() => {
                    // The id is our own create's: ours without its labels.
                    // An answer that cannot be read must not leave the
                    // container behind; a forced removal kills it if it runs.
                    let id = container.unwrap_or(&name);
                    tracing::warn!(
                        agent_id = %agent,
                        container = %id,
                        error = %e,
                        "cannot read the container's state; removing it by id"
                    );
                    if let Err(removal) = remove_forced(rt, id, api).await {
                        errors.push(e);
                        errors.push(removal);
                    }
                    continue;
                }
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            let Some(inspected) = inspected else {
                continue;
            };
            let labels = inspected
                .config
                .as_ref()
                .and_then(|c| c.labels.clone())
                .unwrap_or_default();
            let ours = labels.get(LABEL_INSTANCE).map(String::as_str)
                == Some(self.inner.options.instance.to_string().as_str())
                && labels.get(LABEL_AGENT).map(String::as_str) == Some(agent.to_string().as_str());
            if !ours {
                tracing::warn!(
                    agent_id = %agent,
                    container = %name,
                    endpoint = %rt.conn.endpoint,
                    "a container with this agent's name is not ours (owner labels differ); left alone"
                );
                continue;
            }
            let id = inspected.id.clone().unwrap_or(name.clone());
            let running = inspected
                .state
                .as_ref()
                .and_then(|s| s.running)
                .unwrap_or(false);
            if running {
                let t = i32::try_from(grace.as_secs()).unwrap_or(i32::MAX);
                let stopped = rt
                    .call_opt(
                        "POST /containers/{id}/stop",
                        api + grace,
                        docker.stop_container(
                            &id,
                            Some(StopContainerOptions {
                                t: Some(t),
                                signal: None,
                            }),
                        ),
                    )
                    .await;
                if let Err(e) = stopped {
                    tracing::warn!(agent_id = %agent, error = %e, "stop failed; killing");
                    let killed = rt
                        .call_opt(
                            "POST /containers/{id}/kill",
                            api,
                            docker.kill_container(
                                &id,
                                Some(KillContainerOptions {
                                    signal: "SIGKILL".to_owned(),
                                }),
                            ),
                        )
                        .await;
                    if let Err(e) = killed {
                        // 409 "is not running": it stopped in between.
                        if !e.to_string().contains("409") {
                            tracing::warn!(agent_id = %agent, error = %e, "kill failed");
                        }
                    }
                }
            }
            if let Err(e) = failpoint("kici_container::destroy::stop") {
                errors.push(e);
                return Err(errors);
            }
            // The container stopped: its log stream ends after the last line.
            if let Some(task) = logs.take() {
                let abort = task.abort_handle();
                if tokio::time::timeout(LOG_DRAIN, task).await.is_err() {
                    abort.abort();
                }
            }
            if let Err(e) = remove_forced(rt, &id, api).await {
                errors.push(e);
            }
            if let Err(e) = failpoint("kici_container::destroy::remove") {
                errors.push(e);
                return Err(errors);
            }
        }
        if let Some(task) = logs {
            task.abort();
        }
        if !errors.is_empty() {
            // Rules and lease stay until the container is surely gone: a
            // live container must never run without its rules.
            return Err(errors);
        }
        let options = &self.inner.options;
        if let Err(e) = options.egress.remove(&agent).await {
            errors.push(e.into());
            return Err(errors);
        }
        if let Err(e) = failpoint("kici_container::destroy::rules") {
            errors.push(e);
            return Err(errors);
        }
        if let Err(e) = options.allocator.release_agent(&agent).await {
            errors.push(StepError::Release(e));
            return Err(errors);
        }
        if let Err(e) = failpoint("kici_container::destroy::lease") {
            errors.push(e);
            return Err(errors);
        }
        Ok(())
    }

    /// Runtimes to look for `agent` in: the one its handle names, else every
    /// connected one, else the default probe.
    pub(super) async fn runtimes_for_destroy(
        &self,
        handle: Option<&ResourceHandle>,
    ) -> Result<Vec<Arc<Runtime>>, StepError> {
        let connected = self.connected().await?;
        if let Some(endpoint) = handle.and_then(|h| h.extra.get("endpoint")) {
            let named: Vec<_> = connected
                .iter()
                .filter(|rt| rt.conn.endpoint.to_string() == *endpoint)
                .cloned()
                .collect();
            if !named.is_empty() {
                return Ok(named);
            }
        }
        Ok(connected)
    }
}
