//! Finding what is ours after a restart: every container carrying this
//! instance's owner labels (for the reconciler), and adopting a recorded
//! agent whose container still runs (its log stream and exit watch
//! started again).

use super::*;

impl ContainerBackend {
    pub(super) async fn owned_containers(&self) -> Result<Vec<OwnedResource>, BackendError> {
        let instance = self.inner.options.instance.to_string();
        let filters = HashMap::from([(
            "label".to_owned(),
            vec![format!("{LABEL_INSTANCE}={instance}")],
        )]);
        let mut owned = Vec::new();
        let api = default_api_deadline();
        let runtimes = self
            .connected()
            .await
            .map_err(ContainerError::Unavailable)?;
        for rt in runtimes {
            let list = rt
                .call(
                    "GET /containers/json",
                    api,
                    states::list_containers(
                        &rt.conn.docker,
                        ListContainersOptions {
                            all: true,
                            filters: Some(filters.clone()),
                            ..Default::default()
                        },
                    ),
                )
                .await
                .map_err(ContainerError::Unavailable)?;
            for c in list {
                let labels = c.labels.clone().unwrap_or_default();
                // The filter is the daemon's; check again, it is cheap.
                if labels.get(LABEL_INSTANCE) != Some(&instance) {
                    continue;
                }
                let agent = labels.get(LABEL_AGENT).and_then(|a| a.parse().ok());
                let mut extra =
                    BTreeMap::from([("endpoint".to_owned(), rt.conn.endpoint.to_string())]);
                if let Some(name) = c.names.as_ref().and_then(|n| n.first()) {
                    extra.insert("name".to_owned(), name.trim_start_matches('/').to_owned());
                }
                if let Some(scaler) = labels.get(LABEL_SCALER) {
                    extra.insert("scaler".to_owned(), scaler.clone());
                }
                if let Some(state) = &c.state {
                    extra.insert("state".to_owned(), state.to_string());
                }
                let created_at = c
                    .created
                    .and_then(|s| u64::try_from(s).ok())
                    .map_or(SystemTime::UNIX_EPOCH, |s| {
                        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
                    });
                owned.push(OwnedResource {
                    agent,
                    handle: ResourceHandle {
                        id: c.id.clone().unwrap_or_default(),
                        extra,
                    },
                    created_at,
                });
            }
        }
        Ok(owned)
    }

    pub(super) async fn adopt_container(
        &self,
        agent: &AgentId,
        handle: &ResourceHandle,
        reports: ReportSender,
    ) -> Result<Adoption, BackendError> {
        let api = default_api_deadline();
        let name = container_name(agent);
        let target = if handle.id.is_empty() {
            name.as_str()
        } else {
            handle.id.as_str()
        };
        let runtimes = self
            .runtimes_for_destroy(Some(handle))
            .await
            .map_err(ContainerError::Unavailable)?;
        for rt in runtimes {
            let found = rt
                .call_opt(
                    "GET /containers/{id}/json",
                    api,
                    states::inspect_container(&rt.conn.docker, target),
                )
                .await
                .map_err(ContainerError::Unavailable)?;
            let Some(c) = found else { continue };
            let labels = c
                .config
                .as_ref()
                .and_then(|cfg| cfg.labels.clone())
                .unwrap_or_default();
            let ours = labels.get(LABEL_INSTANCE) == Some(&self.inner.options.instance.to_string())
                && labels.get(LABEL_AGENT) == Some(&agent.to_string());
            let running = c.state.as_ref().and_then(|s| s.running).unwrap_or(false);
            if !ours || !running {
                return Ok(Adoption::Gone);
            }
            let id = c.id.clone().unwrap_or_else(|| target.to_owned());
            let scaler = labels
                .get(LABEL_SCALER)
                .map(|s| kici_model::ScalerName::new(s))
                .ok_or_else(|| ContainerError::NoScalerLabel {
                    agent: *agent,
                    container: id.clone(),
                })?;
            let job = labels
                .get(crate::create::LABEL_JOB)
                .and_then(|j| j.parse().ok());
            // Output before the restart was forwarded by the previous daemon.
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| i32::try_from(d.as_secs()).unwrap_or(i32::MAX));
            self.follow_with(
                &rt,
                *agent,
                &id,
                LogContext {
                    agent: *agent,
                    scaler,
                    job,
                    source: rt.conn.kind.as_str(),
                },
                reports,
                now,
            );
            tracing::info!(agent_id = %agent, container = %id, "container agent adopted");
            return Ok(Adoption::Alive);
        }
        Ok(Adoption::Gone)
    }
}
