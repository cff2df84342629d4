//! The `POST /containers/create` body of one agent: a pure function of the
//! spawn, so every field is unit-tested without a daemon.
//!
//! Hardened by default (docs/deviations.md, D-container-hardening): every
//! capability dropped (the
//! reference agent needs none), `no-new-privileges`, a pids limit, swap
//! capped at the memory limit, a bounded json-file log (Docker), a read-only
//! root with a private `/tmp` when the label set asks, integer `NanoCpus`
//! (docs/deviations.md, D-integer-resources). The image's entrypoint and command are left alone; the token is in
//! the environment only (never argv). Name `kici-<agent id>`; owner labels
//! `dev.kici.scaler.*` (never `kici-managed`, which upstream sweeps).

use crate::reference::ImageReference;
use crate::runtime::RuntimeKind;
use bollard::models::{
    ContainerCreateBody, EndpointIpamConfig, EndpointSettings, HostConfig, HostConfigLogConfig,
    NetworkingConfig, ResourcesUlimits,
};
use kici_engine::SpawnSpec;
use kici_model::{AgentId, InstanceId};
use std::collections::HashMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

pub const LABEL_INSTANCE: &str = "dev.kici.scaler.instance";
pub const LABEL_SCALER: &str = "dev.kici.scaler.scaler";
pub const LABEL_AGENT: &str = "dev.kici.scaler.agent";
pub const LABEL_JOB: &str = "dev.kici.scaler.job";

/// Processes one agent container may hold (a fork bomb stops here).
pub const DEFAULT_PIDS_LIMIT: i64 = 4096;
/// Per-container json-file log cap (Docker): the daemon keeps the agent's
/// output on disk too, and it must not grow without bound.
const LOG_MAX_SIZE: &str = "10m";
const LOG_MAX_FILES: &str = "2";

/// `kici-<agent id>`.
pub fn container_name(agent: &AgentId) -> String {
    format!("kici-{agent}")
}

/// One `ulimit` (`name=soft:hard`), e.g. `nofile=20000:20000`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ulimit {
    pub name: String,
    pub soft: i64,
    pub hard: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ulimit {input:?}: expected name=soft:hard (e.g. nofile=20000:20000)")]
pub struct UlimitError {
    pub input: String,
}

impl FromStr for Ulimit {
    type Err = UlimitError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || UlimitError {
            input: s.to_owned(),
        };
        let (name, values) = s.split_once('=').ok_or_else(bad)?;
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(bad());
        }
        let (soft, hard) = match values.split_once(':') {
            Some((soft, hard)) => (soft, hard),
            None => (values, values),
        };
        let soft: i64 = soft.parse().map_err(|_| bad())?;
        let hard: i64 = hard.parse().map_err(|_| bad())?;
        if soft < 0 || hard < 0 || soft > hard {
            return Err(bad());
        }
        Ok(Self {
            name: name.to_owned(),
            soft,
            hard,
        })
    }
}

impl fmt::Display for Ulimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}:{}", self.name, self.soft, self.hard)
    }
}

/// The container label-set fields, taken out of the config enum.
#[derive(Debug, Clone)]
pub struct ContainerLabelSet<'a> {
    pub image: &'a ImageReference,
    pub container_socket: bool,
    pub volumes: &'a [String],
    pub read_only_rootfs: bool,
}

/// Everything the body depends on besides the spawn spec.
#[derive(Debug, Clone)]
pub struct CreateContext<'a> {
    pub instance: InstanceId,
    pub kind: RuntimeKind,
    pub network: &'a str,
    pub ip: Ipv4Addr,
    pub env: &'a [(String, String)],
    pub extra_hosts: &'a [String],
    pub pids_limit: i64,
    pub ulimits: &'a [Ulimit],
    /// The runtime socket as the *host* sees it, when `containerSocket` may
    /// mount it (local runtimes only; upstream mounted its own path).
    pub socket_on_host: Option<PathBuf>,
    /// `StopTimeout`: the destroy grace (Podman's default is short anyway;
    /// both then honour what destroy asks).
    pub stop_timeout: Duration,
}

/// The create body for `spec`.
pub fn create_body(
    spec: &SpawnSpec,
    set: &ContainerLabelSet<'_>,
    ctx: &CreateContext<'_>,
) -> ContainerCreateBody {
    let mut labels = HashMap::from([
        (LABEL_INSTANCE.to_owned(), ctx.instance.to_string()),
        (LABEL_SCALER.to_owned(), spec.scaler.name.to_string()),
        (LABEL_AGENT.to_owned(), spec.agent.to_string()),
    ]);
    if let Some(job) = &spec.job {
        labels.insert(LABEL_JOB.to_owned(), job.to_string());
    }
    let limits = spec.resources.limits;
    let memory = i64::try_from(limits.memory.bytes()).ok().filter(|m| *m > 0);
    // Milli-CPUs to nano-CPUs: an integer by construction (dockerd rejects
    // a fraction; docs/deviations.md, D-integer-resources).
    let nano_cpus = i64::try_from(limits.cpu.millis())
        .ok()
        .and_then(|m| m.checked_mul(1_000_000))
        .filter(|n| *n > 0);
    let mut binds: Vec<String> = set.volumes.to_vec();
    if set.container_socket {
        if let Some(socket) = &ctx.socket_on_host {
            binds.push(format!("{0}:{0}", socket.display()));
        }
    }
    let tmpfs = set.read_only_rootfs.then(|| {
        HashMap::from([(
            "/tmp".to_owned(),
            "rw,nosuid,nodev,size=268435456".to_owned(),
        )])
    });
    let host_config = HostConfig {
        memory,
        // No swap beyond the memory limit: the limit kills instead of
        // swapping on hosts that have swap.
        memory_swap: memory,
        nano_cpus,
        pids_limit: Some(ctx.pids_limit),
        ulimits: (!ctx.ulimits.is_empty()).then(|| {
            ctx.ulimits
                .iter()
                .map(|u| ResourcesUlimits {
                    name: Some(u.name.clone()),
                    soft: Some(u.soft),
                    hard: Some(u.hard),
                })
                .collect()
        }),
        cap_drop: Some(vec!["ALL".to_owned()]),
        security_opt: Some(vec!["no-new-privileges".to_owned()]),
        readonly_rootfs: Some(set.read_only_rootfs),
        tmpfs,
        binds: (!binds.is_empty()).then_some(binds),
        extra_hosts: (!ctx.extra_hosts.is_empty()).then(|| ctx.extra_hosts.to_vec()),
        auto_remove: Some(false),
        log_config: (ctx.kind == RuntimeKind::Docker).then(|| HostConfigLogConfig {
            typ: Some("json-file".to_owned()),
            config: Some(HashMap::from([
                ("max-size".to_owned(), LOG_MAX_SIZE.to_owned()),
                ("max-file".to_owned(), LOG_MAX_FILES.to_owned()),
            ])),
        }),
        ..Default::default()
    };
    let endpoint = EndpointSettings {
        ipam_config: Some(EndpointIpamConfig {
            ipv4_address: Some(ctx.ip.to_string()),
            ..Default::default()
        }),
        mac_address: Some(crate::backend::agent_mac(ctx.ip).to_string()),
        ..Default::default()
    };
    ContainerCreateBody {
        image: Some(set.image.as_str().to_owned()),
        env: Some(ctx.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        labels: Some(labels),
        stop_timeout: i64::try_from(ctx.stop_timeout.as_secs()).ok(),
        host_config: Some(host_config),
        networking_config: Some(NetworkingConfig {
            endpoints_config: Some(HashMap::from([(ctx.network.to_owned(), endpoint)])),
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::test_support::{scaler_from_yaml, spawn_spec};
    use kici_model::{EffectiveResources, JobId, MemoryBytes, MilliCpu, Resources};

    const YAML: &str = r#"
version: 1
scalers:
  - name: boxes
    type: container
    maxAgents: 2
    labelSets:
      - labels: [linux]
        image: agent:1
"#;

    #[derive(Default)]
    struct SetFlags {
        container_socket: bool,
        read_only_rootfs: bool,
        volumes: Vec<String>,
    }

    fn body(
        adjust_spec: impl FnOnce(&mut SpawnSpec),
        set: impl FnOnce(&mut SetFlags),
        kind: RuntimeKind,
    ) -> (SpawnSpec, ContainerCreateBody) {
        let scaler = scaler_from_yaml(YAML, "boxes");
        let (mut spec, _rx) = spawn_spec(&scaler, 0);
        adjust_spec(&mut spec);
        let image = ImageReference::parse("agent:1").unwrap();
        let mut flags = SetFlags::default();
        set(&mut flags);
        let label_set = ContainerLabelSet {
            image: &image,
            container_socket: flags.container_socket,
            volumes: &flags.volumes,
            read_only_rootfs: flags.read_only_rootfs,
        };
        let env = vec![("KICI_AGENT_ID".to_owned(), spec.agent.to_string())];
        let ulimits: Vec<Ulimit> = vec!["nofile=20000:20000".parse().unwrap()];
        let hosts = vec!["host.docker.internal:host-gateway".to_owned()];
        let ctx = CreateContext {
            instance: "0a1b2c3d".parse().unwrap(),
            kind,
            network: "kici-scaler-net",
            ip: Ipv4Addr::new(172, 29, 0, 7),
            env: &env,
            extra_hosts: &hosts,
            pids_limit: DEFAULT_PIDS_LIMIT,
            ulimits: &ulimits,
            socket_on_host: Some("/var/run/docker.sock".into()),
            stop_timeout: Duration::from_secs(10),
        };
        let b = create_body(&spec, &label_set, &ctx);
        (spec, b)
    }

    #[test]
    fn hardened_defaults_labels_address_and_no_command() {
        let (spec, b) = body(|_| {}, |_| {}, RuntimeKind::Docker);
        assert_eq!(b.image.as_deref(), Some("agent:1"));
        assert!(b.cmd.is_none() && b.entrypoint.is_none(), "image's own");
        assert_eq!(
            b.env.unwrap(),
            vec![format!("KICI_AGENT_ID={}", spec.agent)]
        );
        let labels = b.labels.unwrap();
        assert_eq!(labels[LABEL_INSTANCE], "0a1b2c3d");
        assert_eq!(labels[LABEL_SCALER], "boxes");
        assert_eq!(labels[LABEL_AGENT], spec.agent.to_string());
        assert!(!labels.contains_key(LABEL_JOB));
        assert!(labels.keys().all(|k| !k.contains("kici-managed")));
        let h = b.host_config.unwrap();
        assert_eq!(h.cap_drop.unwrap(), vec!["ALL"]);
        assert!(h.cap_add.is_none());
        assert_eq!(h.security_opt.unwrap(), vec!["no-new-privileges"]);
        assert_eq!(h.pids_limit, Some(DEFAULT_PIDS_LIMIT));
        assert_eq!(h.readonly_rootfs, Some(false));
        assert!(h.tmpfs.is_none());
        assert!(
            h.memory.is_none() && h.nano_cpus.is_none(),
            "no limits asked"
        );
        assert!(h.binds.is_none(), "containerSocket off");
        assert_eq!(
            h.extra_hosts.unwrap(),
            vec!["host.docker.internal:host-gateway"]
        );
        let u = &h.ulimits.unwrap()[0];
        assert_eq!(
            (u.name.as_deref(), u.soft, u.hard),
            (Some("nofile"), Some(20000), Some(20000))
        );
        assert_eq!(h.log_config.unwrap().typ.as_deref(), Some("json-file"));
        assert_eq!(b.stop_timeout, Some(10));
        let ep = &b.networking_config.unwrap().endpoints_config.unwrap()["kici-scaler-net"];
        assert_eq!(
            ep.ipam_config.as_ref().unwrap().ipv4_address.as_deref(),
            Some("172.29.0.7")
        );
        assert_eq!(ep.mac_address.as_deref(), Some("02:42:ac:1d:00:07"));
    }

    #[test]
    fn limits_are_integers_and_swap_is_capped() {
        let (_, b) = body(
            |s| {
                s.resources = EffectiveResources {
                    requests: Resources::ZERO,
                    limits: Resources::new(
                        MilliCpu::from_cores(1.07).unwrap(),
                        MemoryBytes::from_bytes(512 * 1024 * 1024),
                    ),
                };
                s.job = Some("job-1".parse::<JobId>().unwrap());
            },
            |_| {},
            RuntimeKind::Podman,
        );
        let labels = b.labels.unwrap();
        assert_eq!(labels[LABEL_JOB], "job-1");
        let h = b.host_config.unwrap();
        assert_eq!(h.nano_cpus, Some(1_070_000_000));
        assert_eq!(h.memory, Some(512 * 1024 * 1024));
        assert_eq!(h.memory_swap, h.memory);
        assert!(h.log_config.is_none(), "Podman keeps its own log driver");
    }

    #[test]
    fn read_only_root_socket_and_volumes() {
        let (_, b) = body(
            |_| {},
            |s| {
                s.read_only_rootfs = true;
                s.container_socket = true;
                s.volumes = vec!["/srv/cache:/cache:ro".to_owned()];
            },
            RuntimeKind::Docker,
        );
        let h = b.host_config.unwrap();
        assert_eq!(h.readonly_rootfs, Some(true));
        assert!(h.tmpfs.unwrap().contains_key("/tmp"));
        assert_eq!(
            h.binds.unwrap(),
            vec![
                "/srv/cache:/cache:ro".to_owned(),
                "/var/run/docker.sock:/var/run/docker.sock".to_owned()
            ]
        );
    }

    #[test]
    fn ulimits_parse() {
        let u: Ulimit = "nproc=4096:4096".parse().unwrap();
        assert_eq!(u.to_string(), "nproc=4096:4096");
        let u: Ulimit = "core=0".parse().unwrap();
        assert_eq!((u.soft, u.hard), (0, 0));
        for bad in ["nofile", "nofile=a:b", "=1:1", "nofile=2:1", "NOFILE=1:1"] {
            assert!(bad.parse::<Ulimit>().is_err(), "{bad}");
        }
    }
}
