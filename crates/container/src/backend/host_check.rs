//! The host check (`serve` start-up, `kici-scaler doctor`, validation):
//! the runtime answers, the network is as expected, the images are
//! well-formed and the limits fit the host.

use super::*;

/// What [`ContainerBackend::check_host`] found for one scaler.
#[derive(Debug, Default)]
pub struct HostCheck {
    /// `unix:///var/run/docker.sock`, ...
    pub endpoint: Option<String>,
    pub runtime: Option<RuntimeKind>,
    pub version: Option<String>,
    pub api_version: Option<String>,
    /// `<id> (bridge <if>, gateway <ip>)` when the network is as expected.
    pub network: Option<String>,
    /// Everything that would make spawns fail.
    pub problems: Vec<ContainerProblem>,
}

impl HostCheck {
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// Each problem as a full sentence.
    pub fn messages(&self) -> Vec<String> {
        self.problems.iter().map(ToString::to_string).collect()
    }
}

impl ContainerBackend {
    /// Serve start-up and `kici-scaler doctor`: the runtime answers, the
    /// network is as expected (created when missing), the label sets'
    /// images are well-formed and their limits fit the host.
    pub async fn check_host(&self, scaler: &ScalerEntry) -> HostCheck {
        let mut check = HostCheck::default();
        let settings = match settings_of(scaler) {
            Ok(s) => s,
            Err(e) => {
                check.problems.push(ContainerProblem::Runtime(e));
                return check;
            }
        };
        let mut images = Vec::new();
        for (i, set) in scaler.label_sets.iter().enumerate() {
            match &set.backend {
                LabelSetBackend::Container { image, .. } => match ImageReference::parse(image) {
                    Ok(r) => images.push(r),
                    Err(source) => check
                        .problems
                        .push(ContainerProblem::Image { index: i, source }),
                },
                _ => check
                    .problems
                    .push(ContainerProblem::NotContainerLabelSet { index: i }),
            }
        }
        match RuntimeTarget::of(settings, self.inner.options.tls.as_ref()) {
            Ok(RuntimeTarget::Fixed { endpoint, .. })
                if !endpoint.is_local() && settings.network_isolation =>
            {
                check
                    .problems
                    .push(ContainerProblem::RemoteIsolation { endpoint });
            }
            _ => {}
        }
        let rt = match self.runtime_for(scaler).await {
            Ok(rt) => rt,
            Err(e) => {
                check.problems.push(ContainerProblem::Runtime(e));
                return check;
            }
        };
        check.endpoint = Some(rt.conn.endpoint.to_string());
        check.runtime = Some(rt.conn.kind);
        check.version = Some(rt.conn.version.clone());
        check.api_version = Some(rt.conn.api_version.clone());
        check.network = Some(rt.network.to_string());
        let deadline = scaler.ext.deadlines.api_call;
        match rt.call("GET /info", deadline, rt.conn.docker.info()).await {
            Ok(info) => {
                let host_memory = info.mem_total.unwrap_or(0);
                let host_cpus = info.ncpu.unwrap_or(0);
                for (i, set) in scaler.label_sets.iter().enumerate() {
                    let Some(limits) = set.resources.as_ref().and_then(|r| r.mirrored().1) else {
                        continue;
                    };
                    if let Some(memory) = limits.memory {
                        let bytes = i64::try_from(memory.bytes()).unwrap_or(i64::MAX);
                        if host_memory > 0 && bytes > host_memory {
                            check.problems.push(ContainerProblem::MemoryExceedsHost {
                                index: i,
                                bytes,
                                host_bytes: host_memory,
                                endpoint: rt.conn.endpoint.clone(),
                            });
                        }
                    }
                    if let Some(cpus) = limits.cpus {
                        let millis = i64::try_from(cpus.millis()).unwrap_or(i64::MAX);
                        if host_cpus > 0 && millis > host_cpus * 1000 {
                            check.problems.push(ContainerProblem::CpusExceedHost {
                                index: i,
                                cores: cpus.as_cores().to_string(),
                                host_cpus,
                                endpoint: rt.conn.endpoint.clone(),
                            });
                        }
                    }
                }
            }
            Err(e) => check.problems.push(ContainerProblem::Runtime(e)),
        }
        let capacity = self.inner.options.network.pool.capacity();
        if scaler.max_agents > capacity {
            check.problems.push(ContainerProblem::PoolTooSmall {
                max_agents: scaler.max_agents,
                capacity,
                network: self.inner.options.network.name.clone(),
                pool: self.inner.options.network.pool.to_string(),
            });
        }
        check
    }
}
