//! Which backends this build can run, and bringing them up for a
//! configuration.
//!
//! [`BackendRegistry::builtin`] lists the real backends. A configuration
//! naming a scaler type that has no backend here is refused at start-up (and
//! at reload, by the runtime) with a message saying so, rather than failing
//! at the first spawn.

use crate::daemon::settings::BackendTuning;
use crate::events::metrics::OrphanKind;
use kici_engine::Backend;
use kici_model::{AgentId, Config, InstanceId, ScalerType};
use kici_store::StateStore;
use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

/// What a backend may need to know about the daemon to start.
#[derive(Clone)]
pub struct BackendContext {
    /// Owner of every resource the backend creates.
    pub instance: InstanceId,
    /// The daemon's state dir (per-agent files may live below it).
    pub state_dir: PathBuf,
    /// The state store (its IP allocator gives containers and VMs their
    /// addresses); `None` in `run`, which keeps no durable state.
    pub store: Option<Arc<dyn StateStore>>,
    /// The agent gateway's port: agents on a backend network reach it on
    /// that network's gateway address (their egress rules allow it).
    pub gateway_port: u16,
    /// The configuration being started (the Firecracker network block).
    pub config: Option<Arc<Config>>,
    /// Container ulimits, bare-metal pids and log caps.
    pub tuning: BackendTuning,
    /// The instance lives for this process only (`run`): what a backend
    /// keeps for the instance itself (the subnet's egress rules) goes at
    /// a clean shutdown, since no later daemon would ever own it again.
    pub ephemeral: bool,
}

/// Host state a backend keeps apart from its resources — per-agent egress
/// rules — swept against what still runs: once at start-up, before any
/// spawn ([`BackendRegistry::start`]), and by every reconcile pass, so a
/// reused address never inherits an old allowlist.
#[async_trait::async_trait]
pub trait StaleRuleSweep: Send + Sync {
    /// Removes the rules of this instance's agents that have no resource
    /// any more; returns those agents.
    async fn sweep_stale_rules(&self) -> Result<Vec<AgentId>, String>;
}

#[async_trait::async_trait]
impl StaleRuleSweep for kici_container::ContainerBackend {
    async fn sweep_stale_rules(&self) -> Result<Vec<AgentId>, String> {
        kici_container::ContainerBackend::sweep_stale_rules(self)
            .await
            .map_err(|e| format!("container egress rules: {e}"))
    }
}

/// A started backend and what to do once every agent is gone (remove
/// directories it keeps for the instance, ...).
pub struct Started {
    pub backend: Arc<dyn Backend>,
    pub after_shutdown: Option<Box<dyn FnOnce() + Send>>,
    /// Where this backend's agents reach the host (the gateway address of
    /// its network): the agent gateway listens there too and agents are
    /// told `ws://<it>:<port>/ws`. `None`: loopback (host processes).
    pub agent_gateway: Option<IpAddr>,
    /// Its stale-rule sweep, if it keeps rules apart from its resources.
    pub rule_sweep: Option<Arc<dyn StaleRuleSweep>>,
    /// What a sweep of the backend's own removes, by kind, if it has one
    /// (the daemon counts it in `kici_orch_scaler_orphans_reaped_total`).
    pub orphan_reports: Option<OrphanReports>,
    /// The `type: event` backend's shared state, which the daemon binds to
    /// the engine and serves claims from.
    pub provisioning: Option<Arc<crate::provisioning::Provisioning>>,
}

/// Orphans removed by a backend's own sweep: `(kind, how many)` per pass.
pub type OrphanReports = tokio::sync::mpsc::UnboundedReceiver<Vec<(OrphanKind, usize)>>;

impl Started {
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            after_shutdown: None,
            agent_gateway: None,
            rule_sweep: None,
            orphan_reports: None,
            provisioning: None,
        }
    }
}

/// Starting one backend: `Err` says why it cannot run on this host.
pub type StartFuture = Pin<Box<dyn Future<Output = Result<Started, String>> + Send>>;

/// Builds one backend.
pub type BackendFactory = Box<dyn Fn(BackendContext) -> StartFuture + Send + Sync>;

/// Every backend of a configuration, started.
#[derive(Default)]
pub struct Built {
    pub backends: Vec<Arc<dyn Backend>>,
    /// Run after a clean shutdown (every agent destroyed).
    pub after_shutdown: Vec<Box<dyn FnOnce() + Send>>,
    /// Per backend type, the host address its agents connect to.
    pub agent_gateways: BTreeMap<ScalerType, IpAddr>,
    /// For the reconciler: the backends' stale-rule sweeps.
    pub rule_sweeps: Vec<Arc<dyn StaleRuleSweep>>,
    /// For the metrics: what the backends' own sweeps remove.
    pub orphan_reports: Vec<OrphanReports>,
    /// Set when the configuration has `type: event` scalers.
    pub provisioning: Option<Arc<crate::provisioning::Provisioning>>,
}

/// The backends this build knows, by scaler type.
#[derive(Default)]
pub struct BackendRegistry {
    factories: BTreeMap<ScalerType, BackendFactory>,
}

impl BackendRegistry {
    pub fn empty() -> Self {
        Self::default()
    }

    /// The real backends of this build: bare-metal (containers and
    /// Firecracker come later).
    pub fn builtin() -> Self {
        let mut r = Self::empty();
        r.register(
            ScalerType::BareMetal,
            Box::new(|ctx| {
                Box::pin(async move {
                    // The backend keeps only `KICI_AGENT_ENV_*` and its allowlist
                    // of the daemon's environment for agents.
                    let mut options = kici_bare_metal::BareMetalOptions::new(
                        ctx.instance,
                        ctx.state_dir.clone(),
                        std::env::vars().collect(),
                    );
                    options.pids_max = ctx.tuning.bare_metal_pids_max;
                    if let Some(root) = &ctx.tuning.bare_metal_work_dir {
                        options.work_root = root.clone();
                    }
                    // `serve` warns about agents running as root; `run`
                    // runs its invoking user's own command.
                    options.warn_root_agents = !ctx.ephemeral;
                    options.log_keep_bytes = ctx.tuning.bare_metal_log_keep_bytes;
                    options.place(crate::daemon::cgroups::place_self(
                        ctx.tuning.cgroup_root.as_deref(),
                    )?);
                    let backend = kici_bare_metal::BareMetalBackend::new(options)
                        .map_err(|e| e.to_string())?;
                    let cleanup = backend.clone();
                    Ok(Started {
                        backend: Arc::new(backend),
                        // Every agent's cgroup and work dir is gone; the
                        // instance's (now empty) directories above them go too.
                        after_shutdown: Some(Box::new(move || {
                            cleanup.prune_empty_cgroups();
                            cleanup.remove_empty_work_dirs();
                        })),
                        agent_gateway: None,
                        rule_sweep: None,
                        orphan_reports: None,
                        provisioning: None,
                    })
                })
            }),
        );
        r.register(
            ScalerType::Container,
            Box::new(|ctx| Box::pin(start_container(ctx))),
        );
        r.register(
            ScalerType::Firecracker,
            Box::new(|ctx| Box::pin(start_firecracker(ctx))),
        );
        r.register(
            ScalerType::Event,
            Box::new(|ctx| Box::pin(start_event(ctx))),
        );
        r
    }

    /// An in-memory backend for every type (tests of the daemon itself).
    #[cfg(feature = "memory-backends")]
    pub fn memory() -> Self {
        let mut r = Self::empty();
        for kind in ScalerType::ALL {
            r.register(
                kind,
                Box::new(move |_| {
                    Box::pin(async move {
                        Ok(Started::new(Arc::new(
                            kici_engine::memory_backend::MemoryBackend::new(kind),
                        )))
                    })
                }),
            );
        }
        r
    }

    pub fn register(&mut self, kind: ScalerType, factory: BackendFactory) {
        self.factories.insert(kind, factory);
    }

    pub fn kinds(&self) -> impl Iterator<Item = ScalerType> + '_ {
        self.factories.keys().copied()
    }

    /// Starts the backends of the types `config` uses — and only those: a
    /// daemon with bare-metal scalers touches no Docker network and no
    /// nftables table. A reload that adds a type not started here is
    /// refused by the runtime (restart the daemon for it). Every scaler
    /// whose type has no backend, or whose backend cannot start on this
    /// host, is an error; all errors are returned together.
    pub async fn build(&self, config: &Config, ctx: &BackendContext) -> Result<Built, Vec<String>> {
        let mut built = Built::default();
        let mut errors = Vec::new();
        let mut broken = BTreeMap::new();
        let used: std::collections::BTreeSet<ScalerType> =
            config.scalers.iter().map(|s| s.kind).collect();
        for (kind, factory) in &self.factories {
            if !used.contains(kind) {
                continue;
            }
            let mut ctx = ctx.clone();
            ctx.config = Some(Arc::new(config.clone()));
            match factory(ctx).await {
                Ok(started) => {
                    built.backends.push(started.backend);
                    built.after_shutdown.extend(started.after_shutdown);
                    if let Some(ip) = started.agent_gateway {
                        built.agent_gateways.insert(*kind, ip);
                    }
                    built.rule_sweeps.extend(started.rule_sweep);
                    built.orphan_reports.extend(started.orphan_reports);
                    if started.provisioning.is_some() {
                        built.provisioning = started.provisioning;
                    }
                }
                Err(why) => {
                    tracing::warn!(backend = %kind, error = %why, "backend unavailable");
                    broken.insert(*kind, why);
                }
            }
        }
        for s in &config.scalers {
            if let Some(why) = broken.get(&s.kind) {
                errors.push(format!(
                    "{}: scalers[name={}]: the {} backend cannot start on this host: {why}",
                    s.origin, s.name, s.kind
                ));
            } else if !self.factories.contains_key(&s.kind) {
                let have: Vec<&str> = self.kinds().map(ScalerType::as_str).collect();
                errors.push(format!(
                    "{}: scalers[name={}]: type {} has no backend in this build of kici-scaler (available: {})",
                    s.origin,
                    s.name,
                    s.kind,
                    if have.is_empty() { "none yet".to_owned() } else { have.join(", ") }
                ));
            }
        }
        if errors.is_empty() {
            Ok(built)
        } else {
            Err(errors)
        }
    }

    /// [`BackendRegistry::build`], then every backend's own validation of
    /// the configuration.
    pub async fn start(&self, config: &Config, ctx: &BackendContext) -> Result<Built, Vec<String>> {
        let built = self.build(config, ctx).await?;
        validate(config, &built.backends).await?;
        Ok(built)
    }
}

impl Built {
    /// The daemon's start-up sweep of stale egress rules, after
    /// [`BackendRegistry::start`] (validation connected every runtime the
    /// configuration names) and before any agent is spawned or adopted, so
    /// none runs next to the rules of a dead agent that had its address. A
    /// sweep that cannot run is an error: rules it cannot judge stay.
    pub async fn sweep_stale_rules(&self) -> Result<Vec<AgentId>, Vec<String>> {
        let mut swept = Vec::new();
        let mut errors = Vec::new();
        for sweep in &self.rule_sweeps {
            match sweep.sweep_stale_rules().await {
                Ok(agents) => swept.extend(agents),
                Err(e) => errors.push(format!("start-up sweep of stale egress rules: {e}")),
            }
        }
        if errors.is_empty() {
            Ok(swept)
        } else {
            Err(errors)
        }
    }
}

/// Each backend's own validation of each scaler entry of its type (files,
/// engine, host capacity); every error, prefixed by the scaler.
pub async fn validate(config: &Config, backends: &[Arc<dyn Backend>]) -> Result<(), Vec<String>> {
    let mut errors = Vec::new();
    for s in &config.scalers {
        let Some(backend) = backends.iter().find(|b| b.kind() == s.kind) else {
            errors.push(format!("scalers[name={}]: no {} backend", s.name, s.kind));
            continue;
        };
        if let Err(errs) = backend.validate(s).await {
            errors.extend(
                errs.into_iter()
                    .map(|e| format!("{}: scalers[name={}]: {e}", s.origin, s.name)),
            );
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// The host's DNS resolvers (`/etc/resolv.conf`): a private one needs an
/// egress exception, or agents cannot resolve anything.
fn host_resolvers() -> Vec<IpAddr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|ip| ip.trim().parse().ok())
        .collect()
}

/// The egress table of a backend network: the subnet fails closed, agents
/// may reach the host only on the gateway port of the network's gateway
/// address.
async fn egress_table(
    ctx: &BackendContext,
    subnet: ipnet::Ipv4Net,
    gateway: std::net::Ipv4Addr,
    bridge: &str,
    docker_user: kici_netpolicy::DockerUserMode,
) -> Result<kici_netpolicy::EgressTable, String> {
    kici_netpolicy::EgressTable::ensure(
        ctx.instance,
        subnet,
        kici_netpolicy::TableOptions {
            gateway_port: Some(ctx.gateway_port),
            gateway_address: Some(gateway),
            resolvers: host_resolvers(),
            protect_host: true,
            docker_user,
            agent_bridge: Some(bridge.to_owned()),
            ..kici_netpolicy::TableOptions::default()
        },
    )
    .await
    .map_err(|e| format!("egress rules ({subnet}): {e}"))
}

fn allocator(ctx: &BackendContext, kind: &str) -> Result<Arc<dyn kici_store::IpAllocator>, String> {
    let store = ctx
        .store
        .clone()
        .ok_or_else(|| format!("the {kind} backend needs the state store for guest addresses"))?;
    Ok(store)
}

/// Containers on `kici-scaler-net` (Docker, or Podman's compatible socket).
async fn start_container(ctx: BackendContext) -> Result<Started, String> {
    let mut options = kici_container::ContainerOptions::new(
        ctx.instance,
        allocator(&ctx, "container")?,
        std::env::vars().collect(),
    );
    options.ulimits = ctx.tuning.container_ulimits.clone();
    options.network = ctx.tuning.container_network.clone();
    let network = options.network.clone();
    if !rustix::process::geteuid().is_root() {
        return start_container_unprivileged(ctx, options, network);
    }
    // dockerd's FORWARD policy is DROP: our subnet needs its accept in
    // DOCKER-USER (our own drops still apply: a drop in any table is final).
    let table = egress_table(
        &ctx,
        network.pool.network(),
        network.pool.gateway(),
        &network.bridge,
        kici_netpolicy::DockerUserMode::AcceptSubnet,
    )
    .await?;
    options.egress = Arc::new(table.clone());
    let backend = kici_container::ContainerBackend::new(options).map_err(|e| e.to_string())?;
    let after_shutdown: Option<Box<dyn FnOnce() + Send>> = if ctx.ephemeral {
        Some(Box::new(move || teardown_table(table)))
    } else {
        None
    };
    Ok(Started {
        backend: Arc::new(backend.clone()),
        after_shutdown,
        agent_gateway: Some(IpAddr::V4(network.pool.gateway())),
        rule_sweep: Some(Arc::new(backend)),
        orphan_reports: None,
        provisioning: None,
    })
}

/// Containers for a daemon that is not root (a user in the `docker` group,
/// a user's Podman socket). Egress rules live in nftables, which only root
/// may change: a scaler with `networkIsolation` on is refused at start with
/// the reason, and one a reload adds fails its spawns closed
/// ([`NoNftablesEgress`]) — never runs unisolated.
fn start_container_unprivileged(
    ctx: BackendContext,
    mut options: kici_container::ContainerOptions,
    network: kici_container::NetworkSettings,
) -> Result<Started, String> {
    let uid = rustix::process::geteuid().as_raw();
    let isolated: Vec<String> = ctx
        .config
        .iter()
        .flat_map(|c| c.scalers.iter())
        .filter(|s| s.kind == kici_model::ScalerType::Container)
        .filter(|s| match &s.backend {
            kici_model::BackendSettings::Container(c) => c.network_isolation,
            _ => false,
        })
        .map(|s| s.name.to_string())
        .collect();
    if !isolated.is_empty() {
        return Err(format!(
            "{}: {}",
            isolated.join(", "),
            NoNftablesEgress { uid }.reason()
        ));
    }
    options.egress = Arc::new(NoNftablesEgress { uid });
    let backend = kici_container::ContainerBackend::new(options).map_err(|e| e.to_string())?;
    Ok(Started {
        backend: Arc::new(backend.clone()),
        after_shutdown: None,
        agent_gateway: Some(IpAddr::V4(network.pool.gateway())),
        rule_sweep: Some(Arc::new(backend)),
        orphan_reports: None,
        provisioning: None,
    })
}

/// The egress hook of an unprivileged daemon: there are no rules to remove
/// or sweep, and installing one is refused, so isolation fails closed.
struct NoNftablesEgress {
    uid: u32,
}

impl NoNftablesEgress {
    fn reason(&self) -> String {
        format!(
            "networkIsolation needs nftables, which only root may change, and this daemon runs as uid {}; \
             set networkIsolation: false for the scaler (and isolate its network yourself) or run kici-scaler as root",
            self.uid
        )
    }
}

#[async_trait::async_trait]
impl kici_netpolicy::EgressRules for NoNftablesEgress {
    async fn install(
        &self,
        _target: &kici_netpolicy::EgressTarget,
        _policy: Option<&kici_model::NetworkPolicy>,
    ) -> Result<(), kici_netpolicy::NetPolicyError> {
        Err(kici_netpolicy::NetPolicyError::NotPermitted {
            reason: self.reason(),
        })
    }

    async fn remove(&self, _agent: &AgentId) -> Result<(), kici_netpolicy::NetPolicyError> {
        Ok(())
    }

    async fn sweep_stale(
        &self,
        _live: &[AgentId],
    ) -> Result<Vec<AgentId>, kici_netpolicy::NetPolicyError> {
        Ok(Vec::new())
    }
}

/// `autoProvisionHost`: the bridge and the host's forwarding for it, as
/// `kici-scaler firecracker provision` makes them, checked first and
/// provisioned only when something is missing (idempotent either way; the
/// bridge's ports — running VMs' TAPs — are never touched). A provisioning
/// failure refuses the backend, with what failed.
async fn ensure_firecracker_host(network: &kici_model::FirecrackerNetwork) -> Result<(), String> {
    let host = kici_firecracker::HostSetup {
        network,
        uplink: None,
    };
    let bridge = &network.bridge_name;
    let before = host
        .verify()
        .await
        .map_err(|e| format!("firecracker network {bridge}: {e}"))?;
    if before.healthy() {
        return Ok(());
    }
    let missing = before.problems(&host);
    tracing::info!(bridge = %bridge, missing = ?missing, "provisioning the Firecracker host network (firecracker.autoProvisionHost)");
    let after = host.provision().await.map_err(|e| {
        format!("firecracker network {bridge}: autoProvisionHost could not provision it: {e}")
    })?;
    if after.healthy() {
        tracing::info!(bridge = %bridge, "Firecracker host network provisioned");
    } else {
        // An existing bridge kici-scaler did not create is used as it is
        // (never re-tagged): the check below decides whether it can serve.
        tracing::warn!(bridge = %bridge, problems = ?after.problems(&host), "the Firecracker host network is not all in place after provisioning");
    }
    Ok(())
}

/// Removes the instance's subnet-level egress rules (default drops,
/// `DOCKER-USER` accepts) once every agent is gone. Shutdown hooks are
/// synchronous: the removal gets a runtime of its own on its own thread.
fn teardown_table(table: kici_netpolicy::EgressTable) {
    let subnet = table.subnet();
    let outcome = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
            .and_then(|rt| rt.block_on(table.teardown()).map_err(|e| e.to_string()))
    })
    .join();
    match outcome {
        Ok(Ok(removed)) => {
            tracing::debug!(%subnet, removed, "egress rules of the instance removed")
        }
        Ok(Err(e)) => {
            tracing::warn!(%subnet, error = %e, "egress rules of the instance left behind")
        }
        Err(_) => tracing::warn!(%subnet, "egress rule removal panicked"),
    }
}

/// Jailed microVMs on the configured bridge: with `autoProvisionHost`
/// (the default) start-up provisions or heals it as `kici-scaler
/// firecracker provision` does; without, it only checks it.
async fn start_firecracker(ctx: BackendContext) -> Result<Started, String> {
    let config = ctx
        .config
        .clone()
        .ok_or_else(|| "the Firecracker backend needs the configuration".to_owned())?;
    let network = config.firecracker.clone();
    if network.auto_provision_host {
        ensure_firecracker_host(&network).await?;
    }
    let status = kici_firecracker::HostNetwork { network: &network }
        .check()
        .await
        .map_err(|e| format!("bridge {}: {e}", network.bridge_name))?;
    if !status.healthy() {
        return Err(format!(
            "bridge {}: {}; run `kici-scaler firecracker provision --config <file>` once as root \
             (or leave firecracker.autoProvisionHost on)",
            network.bridge_name,
            status.problems(&network).join("; ")
        ));
    }
    let table = egress_table(
        &ctx,
        network.cidr,
        network.gateway,
        &network.bridge_name,
        kici_netpolicy::DockerUserMode::Leave,
    )
    .await?;
    let mut options = kici_firecracker::FirecrackerOptions::new(
        ctx.instance,
        network.clone(),
        allocator(&ctx, "Firecracker")?,
        Arc::new(table.clone()),
        std::env::vars().collect(),
    );
    options.sweep_min_age = ctx.tuning.orphan_min_age;
    let backend = kici_firecracker::FirecrackerBackend::new(options).map_err(|e| e.to_string())?;
    // The backend's own sweep (VM directories, TAPs, leases, rules) every
    // `firecracker-sweep-interval-seconds` (upstream's 15 minutes by
    // default); the reconciler covers start-up and `kici-scaler sweep`.
    // `run` keeps no store: nothing of an earlier instance can be its own,
    // so it has no periodic sweep.
    let (reports, orphan_reports) = tokio::sync::mpsc::unbounded_channel();
    let sweeper = ctx.store.clone().map(|store| {
        backend.spawn_periodic_sweep_reporting(
            ctx.tuning.firecracker_sweep_interval,
            move || {
                let store = store.clone();
                async move {
                    let rows = store.agents().await.ok()?;
                    Some(rows.into_iter().map(|r| r.agent_id).collect())
                }
            },
            move |report: &kici_firecracker::SweepReport| {
                let removed: Vec<(OrphanKind, usize)> = [
                    (OrphanKind::Vm, report.vms.len()),
                    (OrphanKind::Tap, report.taps.len()),
                    (OrphanKind::IpLease, report.leases),
                    (OrphanKind::NftablesRule, report.rules),
                ]
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .collect();
                if !removed.is_empty() {
                    // Nobody counts once the daemon stops listening.
                    let _ = reports.send(removed);
                }
            },
        )
    });
    let ephemeral = ctx.ephemeral;
    let after_shutdown: Option<Box<dyn FnOnce() + Send>> = Some(Box::new(move || {
        if let Some(task) = sweeper {
            task.abort();
        }
        if ephemeral {
            teardown_table(table);
        }
    }));
    Ok(Started {
        backend: Arc::new(backend),
        after_shutdown,
        agent_gateway: Some(IpAddr::V4(network.gateway)),
        // kici-firecracker sweeps its rules with its own orphan sweep
        // (not wired into this reconciler yet).
        rule_sweep: None,
        orphan_reports: Some(orphan_reports),
        provisioning: None,
    })
}

/// `type: event` scalers: nothing local; claims and the outbox live in the
/// state store, so a daemon without one (`run`) cannot have them.
async fn start_event(ctx: BackendContext) -> Result<Started, String> {
    let store = ctx.store.clone().ok_or_else(|| {
        "type: event scalers need the state store (claims and the event outbox): use `serve`"
            .to_owned()
    })?;
    let hub = crate::provisioning::Provisioning::open(ctx.instance, &ctx.state_dir, store)
        .map_err(|e| e.to_string())?;
    let mut started = Started::new(Arc::new(crate::provisioning::EventBackend::new(
        Arc::clone(&hub),
    )));
    started.provisioning = Some(hub);
    Ok(started)
}
