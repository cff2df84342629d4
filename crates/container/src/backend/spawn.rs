//! The spawn steps, in order, each followed by its failpoint: lease, pull,
//! create, rules, start; then the log stream and the exit watch.

use super::*;

impl ContainerBackend {
    pub(super) async fn spawn_steps(
        &self,
        spec: &SpawnSpec,
        rt_slot: &mut Option<Arc<Runtime>>,
    ) -> Result<ResourceHandle, StepError> {
        let started = Instant::now();
        let options = &self.inner.options;
        let scaler = &spec.scaler;
        let settings = settings_of(scaler)?;
        let LabelSetBackend::Container {
            image,
            image_pull_policy,
            container_socket,
            volumes,
        } = &spec.label_set.backend
        else {
            return Err(StepError::NotContainer(scaler.name.to_string()));
        };
        let image = ImageReference::parse(image)?;
        let deadlines = scaler.ext.deadlines;
        let api = deadlines.api_call;
        let rt = self.runtime_for(scaler).await?;
        *rt_slot = Some(rt.clone());
        let agent = spec.agent;

        let lease: Lease = options
            .allocator
            .allocate(&options.network.pool, &agent)
            .await
            .map_err(|source| StepError::Lease {
                network: options.network.name.clone(),
                source,
            })?;
        failpoint("kici_container::spawn::lease")?;

        self.ensure_image(
            &rt,
            &image,
            *image_pull_policy,
            api,
            started + deadlines.provision,
        )
        .await?;
        failpoint("kici_container::spawn::pull")?;

        let env = agent_env(
            spec,
            ScalerType::Container,
            &SystemEnv::default(),
            &self.inner.forwarded,
        );
        let socket_on_host = match (&options.socket_on_host, &rt.conn.endpoint) {
            (Some(path), _) => Some(path.clone()),
            (None, crate::runtime::Endpoint::Unix(path)) => Some(path.clone()),
            (None, _) => None,
        };
        if *container_socket {
            match &socket_on_host {
                Some(path) => tracing::warn!(
                    agent_id = %agent,
                    scaler = scaler.name.as_str(),
                    socket = %path.display(),
                    "containerSocket: the agent and every job it runs get full control of the \
                     host's container runtime (root-equivalent on this host)"
                ),
                None => tracing::warn!(
                    agent_id = %agent,
                    scaler = scaler.name.as_str(),
                    "containerSocket ignored: the runtime is remote, there is no host socket to mount"
                ),
            }
        }
        let ulimits = scaler_ulimits(&options.ulimits, &scaler.ext.ulimits);
        let body = create_body(
            spec,
            &ContainerLabelSet {
                image: &image,
                container_socket: *container_socket,
                volumes,
                read_only_rootfs: spec.label_set.ext.read_only_rootfs,
            },
            &CreateContext {
                instance: options.instance,
                kind: rt.conn.kind,
                network: &options.network.name,
                ip: lease.ip,
                env: &env,
                extra_hosts: &settings.extra_hosts,
                pids_limit: options.pids_limit,
                ulimits: &ulimits,
                socket_on_host,
                stop_timeout: deadlines.destroy_grace,
            },
        );
        let name = container_name(&agent);
        // Until the rules are in: a rule sweep now would not see them
        // belong to a container.
        let rules_gate = self.inner.rules_gate.read().await;
        let created = rt
            .call(
                "POST /containers/create",
                api,
                rt.conn.docker.create_container(
                    Some(CreateContainerOptions {
                        name: Some(name.clone()),
                        ..Default::default()
                    }),
                    body,
                ),
            )
            .await?;
        for warning in &created.warnings {
            tracing::warn!(agent_id = %agent, warning = %warning, "container create warning");
        }
        failpoint("kici_container::spawn::create")?;

        if settings.network_isolation {
            options
                .egress
                .install(
                    &EgressTarget {
                        agent,
                        ip: lease.ip,
                        mac: agent_mac(lease.ip).0,
                        // A container's veth is created at start: not known yet.
                        port: None,
                        bridge: rt.network.bridge.clone(),
                        gateway: rt.network.gateway,
                    },
                    spec.label_set.network_policy.as_ref(),
                )
                .await?;
        }
        drop(rules_gate);
        failpoint("kici_container::spawn::rules")?;

        rt.call(
            "POST /containers/{id}/start",
            api,
            rt.conn
                .docker
                .start_container(&created.id, None::<StartContainerOptions>),
        )
        .await
        .map_err(|e| match e {
            // Podman asks for its own default rlimits, which root cannot
            // raise on hosts with lower hard limits.
            StepError::Api {
                call,
                endpoint,
                reason,
            } if reason.contains("rlimit") => StepError::Api {
                call,
                endpoint,
                reason: format!(
                    "{reason} (the runtime could not set the container's rlimits: configure \
                     ulimits within this host's hard limits, e.g. nofile=20000:20000 and \
                     nproc=4096:4096)"
                ),
            },
            other => other,
        })?;
        failpoint("kici_container::spawn::start")?;

        self.follow(&rt, spec.agent, &created.id, spec, spec.reports.clone(), 0);
        let mut extra = BTreeMap::from([
            ("name".to_owned(), name),
            ("endpoint".to_owned(), rt.conn.endpoint.to_string()),
            ("ip".to_owned(), lease.ip.to_string()),
            ("network".to_owned(), options.network.name.clone()),
        ]);
        extra.insert("runtime".to_owned(), rt.conn.kind.to_string());
        tracing::info!(
            agent_id = %agent,
            scaler = scaler.name.as_str(),
            job_id = spec.job.as_ref().map(|j| j.as_str()),
            container = %created.id,
            ip = %lease.ip,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "container agent started"
        );
        Ok(ResourceHandle {
            id: created.id,
            extra,
        })
    }
}
