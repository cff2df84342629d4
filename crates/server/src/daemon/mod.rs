//! `kici-scaler serve`: start-up, the control API listener, signals and
//! shutdown.
//!
//! Start-up, in order, each step refusing to go on with every problem
//! listed: daemon settings; the API token rule; the state dir (identity and
//! lock); the configuration (agent binaries resolved); the control API and
//! agent gateway listeners (bound before any agent exists, so a busy port
//! costs nothing); the backends and their validation of the configuration;
//! the machine-pool ledger; the engine, gateway, job book and event pump
//! ([`crate::daemon::stack`]); then the API serves and `/readyz` turns ready.
//!
//! SIGHUP reloads the configuration (all or nothing). SIGTERM and SIGINT stop
//! accepting connections, destroy every agent (up to the shutdown grace) —
//! running jobs end `failed` —, end the event and log streams and exit 0 —
//! or 1 if agents could not all be destroyed in time.

pub mod agent_binary;
pub mod backends;
pub mod cgroups;
pub mod crashpoints;
pub mod dead_runs;
pub mod identity;
pub mod reload;
pub mod run_dirs;
pub mod serving;
pub mod settings;
pub mod stack;
pub mod systemd;
pub mod tls;

use crate::api::{self, AppState};
use crate::daemon::backends::{BackendContext, BackendRegistry};
use crate::daemon::identity::{IdentityError, IdentitySource, StateDir};
use crate::daemon::reload::{ConfigReloader, Reload};
use crate::daemon::serving::{Listener, ListenerName, Server};
use crate::daemon::settings::{
    DaemonFile, DaemonSettings, ListenAddr, ServeArgs, SettingsError, API_TOKEN_ENV,
    MIN_API_TOKEN_BYTES,
};
use crate::daemon::stack::{Stack, StackOptions};
use crate::daemon::tls::TlsError;
use crate::durable::reconcile::{Reaping, Reconciler, SweepReport};
use crate::gateway::token::Secret;
use crate::gateway::GatewaySettings;
use kici_admission::MachineLedger;
use kici_store::StoreOptions;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinHandle;

/// How long the API may take to finish open connections once the event
/// streams have ended.
const CONNECTION_DRAIN: Duration = Duration::from_secs(5);

/// Why `serve` did not start (or did not stop cleanly). Each variant's
/// message is complete: it is printed as is, one problem per line.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Settings(#[from] SettingsError),
    #[error("{API_TOKEN_ENV} is set but empty")]
    EmptyApiToken,
    #[error("{API_TOKEN_ENV} is {0} bytes long: an API token must be at least {MIN_API_TOKEN_BYTES} bytes (e.g. `openssl rand -hex 32`)")]
    ShortApiToken(usize),
    #[error("--listen {0} is a TCP address, which every local user can reach: set {API_TOKEN_ENV} (at least {MIN_API_TOKEN_BYTES} bytes; every request must then carry it as a bearer token), or serve on a unix socket (the default, --listen unix:{socket})", socket = crate::daemon::settings::default_api_socket().display())]
    TcpWithoutToken(ListenAddr),
    #[error("{0}")]
    Identity(#[from] IdentityError),
    /// Already one `file:line:col: path: message` per line.
    #[error("{0}")]
    Config(crate::daemon::stack::LoadError),
    #[error("{}", .0.join("\n"))]
    Backends(Vec<String>),
    #[error("machine-pool ledger: {0}")]
    Ledger(#[from] kici_admission::LedgerError),
    #[error("{0}")]
    Stack(#[from] crate::daemon::stack::StackError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: ListenAddr, source: io::Error },
    #[error("{0}")]
    Tls(#[from] TlsError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(io::Error),
    #[error("cannot install the {0} handler: {1}")]
    Signal(&'static str, io::Error),
    #[error("the control API failed: {0}")]
    Serve(io::Error),
    #[error("state store: {0}")]
    Store(kici_store::StoreError),
    #[error("{0}")]
    Crashpoints(#[from] crate::daemon::crashpoints::CrashpointError),
    #[error("{0}")]
    Fleet(#[from] crate::fleet::JoinError),
    #[error("{0}")]
    FleetKey(#[from] crate::fleet::auth::FleetKeyError),
    #[error("fleet-ca-cert: {0}")]
    FleetTls(TlsError),
    #[error("shutdown: {0} agent(s) were not destroyed within the shutdown grace")]
    AgentsLeft(usize),
}

/// The daemon's whole life, from the command line to exit.
pub fn serve(args: &ServeArgs) -> Result<(), ServeError> {
    let file = args
        .daemon_config
        .as_deref()
        .map(DaemonFile::load)
        .transpose()?;
    let settings = DaemonSettings::resolve(args, file.as_ref())?;
    crate::cli::log_format::set_agent_log_format(settings.agent_log_format);
    let armed = crate::daemon::crashpoints::arm_from_env()?;
    if !armed.is_empty() {
        tracing::warn!(failpoints = ?armed, "crash failpoints armed: this daemon kills itself when it reaches them");
    }
    let failing = crate::daemon::crashpoints::arm_failures_from_env()?;
    if !failing.is_empty() {
        tracing::warn!(failpoints = ?failing, "error failpoints armed: these steps fail as told");
    }
    let registry = registry_for(args);
    let api_token = api_token_from_env(&settings)?;
    let peers = fleet_credentials(&settings)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kici-scaler")
        .build()
        .map_err(ServeError::Runtime)?;
    runtime.block_on(run(settings, registry, api_token, peers))
}

/// A fleet host's key (`KICI_SCALER_FLEET_KEY` or `--fleet-key-file`,
/// required) and how it verifies `https` peers; `None` off a fleet.
fn fleet_credentials(
    settings: &DaemonSettings,
) -> Result<Option<(crate::fleet::auth::FleetKeys, crate::fleet::auth::PeerTls)>, ServeError> {
    use crate::fleet::auth::{peer_tls, FleetKeys, FLEET_KEY_ENV};
    let Some(fleet) = &settings.fleet else {
        return Ok(None);
    };
    let env = std::env::var(FLEET_KEY_ENV).ok();
    let keys = FleetKeys::load(env.as_deref(), fleet.key_file.as_deref(), &fleet.name)?;
    let tls = peer_tls(fleet.ca_cert.as_deref()).map_err(ServeError::FleetTls)?;
    let https = fleet
        .advertise_url
        .as_deref()
        .is_some_and(|u| u.starts_with("https://"));
    if https && settings.tls.is_none() {
        tracing::warn!(
            url = ?fleet.advertise_url,
            "--advertise-url is https but this host serves plain HTTP (no --tls-cert): peers reach it only through a TLS proxy in front of it"
        );
    }
    if !https {
        tracing::info!(
            "fleet peers call this host over plain HTTP: the fleet key authenticates the calls, but what they carry (job output, environment) crosses the network in clear"
        );
    }
    Ok(Some((keys, tls)))
}

fn registry_for(args: &ServeArgs) -> BackendRegistry {
    #[cfg(feature = "memory-backends")]
    if args.memory_backends {
        tracing::warn!(
            "serving with in-memory backends: nothing real is provisioned (test builds only)"
        );
        return BackendRegistry::memory();
    }
    let _ = args;
    BackendRegistry::builtin()
}

/// `KICI_SCALER_API_TOKEN`, required for any TCP listener (loopback
/// included) and at least [`MIN_API_TOKEN_BYTES`] long when set.
fn api_token_from_env(settings: &DaemonSettings) -> Result<Option<Secret>, ServeError> {
    let token = match std::env::var(API_TOKEN_ENV) {
        Ok(t) if t.trim().is_empty() => return Err(ServeError::EmptyApiToken),
        Ok(t) if t.trim().len() < MIN_API_TOKEN_BYTES => {
            return Err(ServeError::ShortApiToken(t.trim().len()))
        }
        Ok(t) => Some(Secret::new(t.trim().to_owned())),
        Err(_) => None,
    };
    if token.is_none() && settings.listen.needs_token() {
        return Err(ServeError::TcpWithoutToken(settings.listen.clone()));
    }
    Ok(token)
}

/// A bound listener, before serving, and what to print as its address.
struct Bound {
    listener: Listener,
    tls: Option<Arc<rustls::ServerConfig>>,
    addr: String,
}

fn bind(settings: &DaemonSettings) -> Result<Bound, ServeError> {
    let listen_err = |source| ServeError::Listen {
        addr: settings.listen.clone(),
        source,
    };
    match &settings.listen {
        ListenAddr::Tcp(addr) => {
            let tls = match &settings.tls {
                Some(files) => Some(Arc::new(tls::server_config(&files.cert, &files.key)?)),
                None => None,
            };
            let listener = std::net::TcpListener::bind(addr).map_err(listen_err)?;
            let addr = listener.local_addr().map_err(listen_err)?.to_string();
            Ok(Bound {
                listener: Listener::tcp(listener).map_err(listen_err)?,
                tls,
                addr,
            })
        }
        ListenAddr::Unix(path) => {
            let listener = bind_private_socket(path).map_err(listen_err)?;
            Ok(Bound {
                listener: Listener::unix(listener).map_err(listen_err)?,
                tls: None,
                addr: format!("unix:{}", path.display()),
            })
        }
    }
}

/// Binds the control API's unix socket so that only the daemon's user can
/// ever connect: the socket is the API's only guard when no token is set.
///
/// The socket is bound under a temporary name, made 0600, and only then
/// renamed into place: binding at the final path and changing the mode
/// afterwards would leave a moment in which another local user could
/// connect. A missing parent dir is created 0700 (the default path's
/// `kici-scaler/` under `/run` or `$XDG_RUNTIME_DIR`).
fn bind_private_socket(path: &std::path::Path) -> io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    if !parent.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&parent)?;
    }
    remove_stale_socket(path)?;
    let file_name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the socket path has no file name",
        )
    })?;
    let mut staging = file_name.to_os_string();
    staging.push(format!(".{}.binding", std::process::id()));
    let staging = parent.join(staging);
    let _ = std::fs::remove_file(&staging);
    let listener = std::os::unix::net::UnixListener::bind(&staging)?;
    let placed = std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&staging, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&staging);
        return Err(e);
    }
    Ok(listener)
}

/// A socket file left by a dead daemon is removed; a live one is refused.
fn remove_stale_socket(path: &std::path::Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(meta) if !meta.file_type().is_socket() => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket",
        )),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another process is serving on this socket",
            )),
            Err(_) => std::fs::remove_file(path),
        },
    }
}

/// A PostgreSQL database may be shared by daemons on several machines, each
/// with its own bridges: guest address pools are scoped by machine id there
/// (SQLite is one machine's file, so nothing to scope). On PostgreSQL the
/// store's pool is all the host holds (the fleet shares it); in a fleet the
/// server ends a silent session after one lease, so a host cut off from the
/// database loses leadership in bounded time.
fn store_options(
    state: &kici_store::StoreUrl,
    database_connections: u32,
    fleet_lease: Option<Duration>,
    state_dir: &StateDir,
) -> StoreOptions {
    let defaults = StoreOptions::default();
    match state {
        kici_store::StoreUrl::Postgres(_) => StoreOptions {
            address_scope: state_dir.machine_id().parse().ok(),
            max_connections: database_connections,
            session_idle_timeout: fleet_lease,
            // Well within the idle timeout, so a healthy session is never
            // ended by it.
            session_keepalive: fleet_lease.map_or(defaults.session_keepalive, |l| {
                (l / 3).min(defaults.session_keepalive)
            }),
            ..defaults
        },
        kici_store::StoreUrl::Sqlite(_) => defaults,
    }
}

async fn run(
    settings: DaemonSettings,
    registry: BackendRegistry,
    api_token: Option<Secret>,
    peers: Option<(crate::fleet::auth::FleetKeys, crate::fleet::auth::PeerTls)>,
) -> Result<(), ServeError> {
    let state_dir = StateDir::open(&settings.state_dir, settings.reset_identity)?;
    let instance = state_dir.instance_id();
    // Each listener's cap is at most a quarter of the descriptors, so
    // stalled clients of both together cannot exhaust them.
    let open_files = serving::raise_open_file_limit();
    let api_limits = settings.api_limits.within_descriptors(open_files, 4);
    let gateway_limits = settings.gateway_limits.within_descriptors(open_files, 4);
    tracing::info!(
        open_files,
        api_max_connections = api_limits.max_connections,
        gateway_max_connections = gateway_limits.max_connections,
        "connection limits"
    );
    match state_dir.identity_source() {
        IdentitySource::Existing => {}
        IdentitySource::Created => {
            tracing::info!(instance = %instance, "new instance id minted")
        }
        IdentitySource::Reset { previous } => tracing::warn!(
            instance = %instance,
            previous = previous.map(|p| p.to_string()),
            "instance identity reset"
        ),
    }
    let loaded = stack::load_config(&settings.config, settings.config_dir.as_deref())
        .map_err(ServeError::Config)?;
    for w in &loaded.warnings {
        tracing::warn!(warning = %w, "configuration warning");
    }
    let config = Arc::new(loaded.config);
    // What a `kici-scaler run` killed with SIGKILL left on this host goes,
    // beside start-up (it concerns other instances only).
    let dead_run_tuning = settings.backends.clone();
    tokio::spawn(async move {
        crate::daemon::dead_runs::sweep(&dead_run_tuning).await;
    });

    // Both listeners before any agent exists: a busy port costs nothing.
    let bound = bind(&settings)?;
    let gateway_listener =
        stack::bind_gateway(settings.gateway_listen).map_err(|source| ServeError::Listen {
            addr: ListenAddr::Tcp(settings.gateway_listen),
            source,
        })?;

    let claims_bound = crate::provisioning::bind_claims(settings.claims.as_ref(), &config)
        .map_err(|e| ServeError::Backends(vec![e]))?;

    // The store before any backend: what it records decides what the
    // backends' resources are (ours and live, or orphans).
    let store = kici_store::open(
        &settings.state,
        instance,
        store_options(
            &settings.state,
            settings.database_connections,
            settings.fleet.as_ref().map(|f| f.lease),
            &state_dir,
        ),
    )
    .await
    .map_err(ServeError::Store)?;

    let ctx = BackendContext {
        config: None,
        instance,
        state_dir: settings.state_dir.clone(),
        store: Some(Arc::clone(&store)),
        tuning: settings.backends.clone(),
        ephemeral: false,
        gateway_port: gateway_listener
            .local_addr()
            .map_err(|source| ServeError::Listen {
                addr: ListenAddr::Tcp(settings.gateway_listen),
                source,
            })?
            .port(),
    };
    let mut backends = registry
        .start(&config, &ctx)
        .await
        .map_err(ServeError::Backends)?;
    let swept = backends
        .sweep_stale_rules()
        .await
        .map_err(ServeError::Backends)?;
    if !swept.is_empty() {
        tracing::info!(
            agents = %swept.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
            "start-up: egress rules of agents without a resource removed"
        );
    }
    let rule_sweeps = backends.rule_sweeps.clone();
    let provisioning = backends.provisioning.clone();
    let orphan_reports = std::mem::take(&mut backends.orphan_reports);
    let ledger = MachineLedger::open(settings.machine_ledger_dir.as_deref(), instance)?;
    let (stack, recovery) = Stack::start(
        Arc::clone(&config),
        backends,
        Some(ledger),
        gateway_listener,
        StackOptions {
            engine: settings.engine.clone(),
            event_replay: settings.event_replay,
            gateway: GatewaySettings::default(),
            gateway_limits,
            job_output: Some(settings.state_dir.join(crate::jobs::OUTPUT_DIR)),
            in_fleet: settings.fleet.is_some(),
        },
        Some(Arc::clone(&store)),
    )
    .await?;
    for row in &recovery.unreadable {
        tracing::error!(row = %row, "recorded agent unreadable; its row is left as is");
    }
    tracing::info!(
        adopted = recovery.report.adopted.len(),
        released = recovery.report.released.len(),
        errors = recovery.report.errors.len(),
        "recovery done"
    );
    for e in &recovery.report.errors {
        tracing::warn!(error = %e, "recovery");
    }
    let p = &recovery.pending;
    tracing::info!(
        requeued = p.requeued.len(),
        standalone_failed = p.standalone_failed.len(),
        expired = p.expired.len(),
        already_admitted = p.already_admitted.len(),
        dropped = p.dropped.len(),
        "recorded pending requests restored"
    );
    for (job, why) in &p.dropped {
        tracing::warn!(job_id = %job, reason = %why, "recorded pending request dropped");
    }
    for mut reports in orphan_reports {
        let metrics = Arc::clone(&stack.metrics);
        // Ends when the backend's sweep does (its sender goes with it).
        tokio::spawn(async move {
            while let Some(removed) = reports.recv().await {
                for (kind, n) in removed {
                    for _ in 0..n {
                        metrics.orphan_reaped(kind);
                    }
                }
            }
        });
    }
    let runtime = stack.runtime.clone();
    let claims_task = crate::provisioning::start(
        provisioning,
        claims_bound,
        &runtime,
        &stack.tokens,
        &stack.gateway,
        api_limits,
        stack.metrics.listener(ListenerName::Claims),
    )
    .map_err(|e| ServeError::Backends(vec![e]))?;
    let reconciler = Arc::new(
        Reconciler::new(
            Arc::clone(&store),
            runtime.backends(),
            Some(runtime.clone()),
            Some(Arc::clone(&stack.metrics)),
            settings.reconcile_age,
        )
        .with_rule_sweeps(rule_sweeps),
    );
    // The first pass at start-up marks; the periodic ones reap what is
    // still unowned.
    let first = reconciler.pass(Reaping::MarkThenReap).await;
    log_sweep(&first);
    let reconcile_task = spawn_reconciler(Arc::clone(&reconciler), settings.reconcile_every);
    let reloader: Arc<dyn Reload> = Arc::new(ConfigReloader::new(
        settings.config.clone(),
        settings.config_dir.clone(),
        runtime.clone(),
        Arc::clone(&stack.metrics),
    ));
    let local = crate::service::Local::new(
        runtime.clone(),
        instance,
        Arc::clone(&stack.tokens),
        Arc::clone(&stack.events),
        Arc::clone(&stack.jobs),
    );
    local.set_store(Arc::clone(&store));
    // Joined last: the engine holds its recovered agents, so the fleet rows
    // of those agents are taken back (or the agents destroyed) before this
    // host claims anything.
    let fleet = match (&settings.fleet, store.postgres(), peers) {
        (Some(fleet_settings), Some(postgres), Some((keys, tls))) => {
            let auth = crate::fleet::auth::PeerAuth::new(keys, &instance.to_string(), tls);
            let host = crate::fleet::FleetHost::join(
                fleet_settings.clone(),
                auth,
                postgres,
                instance,
                &config,
                runtime.clone(),
                Arc::clone(&stack.jobs),
                Arc::clone(&stack.metrics),
            )
            .await;
            match host {
                Ok(host) => Some(host),
                Err(e) => {
                    stack.shutdown(settings.shutdown_grace).await;
                    return Err(e.into());
                }
            }
        }
        _ => None,
    };
    // How the control API serves — alone, or as this host of the fleet —
    // is decided here, once.
    let service = match &fleet {
        Some(host) => {
            crate::service::Service::Fleet(crate::service::Fleet::new(local, host.clone()))
        }
        None => crate::service::Service::Local(local),
    };
    let state = AppState::serving(
        service,
        Arc::clone(&stack.metrics),
        Arc::clone(&reloader),
        api_token,
    );
    let heartbeat_task = spawn_heartbeat(Arc::clone(&store));
    let router = api::router_with(state.clone(), api::jobs::routes());

    let mut hangup = signal(SignalKind::hangup()).map_err(|e| ServeError::Signal("SIGHUP", e))?;
    let mut terminate =
        signal(SignalKind::terminate()).map_err(|e| ServeError::Signal("SIGTERM", e))?;
    let mut interrupt =
        signal(SignalKind::interrupt()).map_err(|e| ServeError::Signal("SIGINT", e))?;

    let Bound {
        listener,
        tls,
        addr,
    } = bound;
    let mut server = Server::start(
        ListenerName::Api,
        listener,
        tls,
        router,
        api_limits,
        stack.metrics.listener(ListenerName::Api),
    );
    // Ready before the log line says so: scripts (and tests) wait for it.
    state.set_ready(true);
    tracing::info!(
        addr = %addr,
        tls = settings.tls.is_some(),
        gateway = %stack.gateway_addr,
        state = %settings.state,
        instance = %instance,
        scalers = config.scalers.len(),
        "control API listening"
    );
    crate::daemon::systemd::ready(&format!("control API listening on {addr}"));

    let stop = loop {
        tokio::select! {
            _ = hangup.recv() => {
                tracing::info!("SIGHUP: reloading the configuration");
                crate::daemon::systemd::reloading();
                // The reloader logs and counts the outcome.
                let _ = reloader.reload().await;
                crate::daemon::systemd::ready(&format!("control API listening on {addr}"));
            }
            _ = terminate.recv() => break "SIGTERM",
            _ = interrupt.recv() => break "SIGINT",
            result = &mut server.task => {
                // The listener died on its own: stop everything.
                let err = match result {
                    Ok(Ok(())) => io::Error::other("the listener stopped"),
                    Ok(Err(e)) => e,
                    Err(e) => io::Error::other(e),
                };
                state.set_ready(false);
                stack.shutdown(settings.shutdown_grace).await;
                return Err(ServeError::Serve(err));
            }
        }
    };

    tracing::info!(
        signal = stop,
        grace_seconds = settings.shutdown_grace.as_secs(),
        "shutting down: destroying every agent"
    );
    crate::daemon::systemd::stopping("shutting down: destroying every agent");
    state.set_ready(false);
    // No new connections; open ones continue, so event and log streams
    // report the shutdown's destroys and the jobs' ends.
    server.graceful_shutdown(None);
    reconcile_task.abort();
    heartbeat_task.abort();
    if let Some(fleet) = &fleet {
        // Before any agent goes: the requests this host claimed but did not
        // start are served by the other hosts right away.
        fleet.hand_back().await;
    }
    let stopped = stack.shutdown(settings.shutdown_grace).await;
    if let Some(fleet) = &fleet {
        fleet.leave().await;
    }
    if let Some(claims) = claims_task {
        claims.shutdown();
    }
    store.close().await;
    server.graceful_shutdown(Some(CONNECTION_DRAIN));
    match tokio::time::timeout(CONNECTION_DRAIN * 2, &mut server.task).await {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "control API ended with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "control API task failed"),
        Ok(Ok(Ok(()))) => {}
        Err(_) => {
            server.shutdown();
            tracing::warn!("control API connections did not close in time; closed");
        }
    }
    if let ListenAddr::Unix(path) = &settings.listen {
        // Ours (we bound it); a failure only leaves a stale file, which the
        // next start removes.
        let _ = std::fs::remove_file(path);
    }
    drop(state_dir);
    if stopped.agents_left == 0 {
        tracing::info!("shutdown complete: every agent destroyed");
        Ok(())
    } else {
        tracing::error!(
            left = stopped.agents_left,
            "shutdown incomplete: agents left"
        );
        Err(ServeError::AgentsLeft(stopped.agents_left))
    }
}

/// Logs what a reconcile pass found (one line; details at debug).
pub fn log_sweep(report: &SweepReport) {
    tracing::info!(
        orphans = report.orphans.len(),
        marked = report.marked.len(),
        reaped = report.reaped.len(),
        young = report.young,
        leases_released = report.leases_released.len(),
        stale_rows = report.stale_rows_deleted.len(),
        stale_rules = report.stale_rules_removed.len(),
        errors = report.errors.len(),
        "reconcile pass"
    );
    for agent in &report.stale_rules_removed {
        tracing::info!(agent_id = %agent, "reconcile: egress rules of an agent without a resource removed");
    }
    for e in &report.errors {
        tracing::warn!(error = %e, "reconcile");
    }
}

fn spawn_reconciler(reconciler: Arc<Reconciler>, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick completes at once; start-up already ran a pass.
        tick.tick().await;
        loop {
            tick.tick().await;
            log_sweep(&reconciler.pass(Reaping::MarkThenReap).await);
        }
    })
}

/// How often the store's instance heartbeat is refreshed.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(10);

/// Refreshes this instance's heartbeat in the store and, on PostgreSQL,
/// re-takes the instance's advisory lock if its connection was lost
/// ([`kici_store::StateStore::ping`]) — on its own clock, not as a side
/// effect of API requests.
fn spawn_heartbeat(store: Arc<dyn kici_store::StateStore>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            match store.ping().await {
                Ok(()) => {
                    if failing {
                        tracing::info!("the state store answers the heartbeat again");
                    }
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "the state store's heartbeat failed; retrying");
                    }
                    failing = true;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn address_pools_are_scoped_by_machine_and_connections_bounded_on_postgres_only() {
        let dir = tempfile::tempdir().unwrap();
        let machine = dir.path().join("machine-id");
        std::fs::write(&machine, "0123456789abcdef0123456789abcdef\n").unwrap();
        let state_dir =
            StateDir::open_with_machine_id(&dir.path().join("state"), &machine, false).unwrap();
        let pg: kici_store::StoreUrl = "postgres://u@localhost/db".parse().unwrap();
        let lease = Some(Duration::from_secs(9));
        let options = store_options(&pg, 2, lease, &state_dir);
        let scope = options.address_scope.unwrap();
        assert_eq!(scope.as_str(), "0123456789abcdef0123456789abcdef");
        assert_eq!(options.max_connections, 2);
        assert_eq!(options.session_idle_timeout, lease);
        let sqlite: kici_store::StoreUrl = "sqlite:/tmp/x.db".parse().unwrap();
        let options = store_options(&sqlite, 2, lease, &state_dir);
        assert_eq!(options.address_scope, None);
        assert_eq!(options.session_idle_timeout, None);
    }
}
