//! The running parts `serve` and `run` share: the configuration as loaded
//! (agent binaries resolved), the engine runtime, agent tokens, the event
//! pump, the standalone-job book and the agent gateway on its own listener;
//! and their orderly shutdown.
//!
//! [`Stack::start`] wires them before the first await lets the runtime's
//! first tick run: the job driver takes the engine's standalone-job
//! effects (control: every one is applied, in order) and the pump
//! subscribes to its events (observers: SSE, metrics, logs, which may fall
//! behind). [`Stack::shutdown`] destroys every agent, lets the driver apply
//! the last effects (so every job has its end) and the pump deliver the
//! last events (every SSE stream closes), stops the gateway, then runs the
//! backends' clean-up hooks.

use crate::daemon::agent_binary::{self, SearchPath};
use crate::daemon::backends::Built;
use crate::daemon::serving::{ConnectionLimits, Listener, ListenerName, Server};
use crate::durable::persist::{self, Persister};
use crate::durable::state::{
    durable_from_record, pending_from_record, RecordedToken, StoreJournal,
};
use crate::events::metrics::Metrics;
use crate::events::pump::Pump;
use crate::events::{EventLog, LoggedEvent};
use crate::gateway::token::{TokenBootstrapper, TokenStore};
use crate::gateway::{Gateway, GatewaySettings, JobDriver};
use crate::jobs::JobBook;
use kici_admission::{Admission, MachineLedger};
use kici_engine::runtime::{PendingReport, Recorded, RecoveryReport, Runtime};
use kici_engine::{Engine, EngineSettings};
use kici_model::Config;
use kici_model::{AgentId, Label, LabelSet};
use kici_routing::HostPlatform;
use kici_store::StateStore;
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use std::time::SystemTime;

/// How long the gateway's listener may take to stop once every agent is
/// gone.
const GATEWAY_STOP: Duration = Duration::from_secs(5);

/// Why a configuration could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// Already one `file:line:col: path: message` per line.
    Config(kici_config::ConfigErrors),
    /// Bare-metal agent binaries that are nowhere to be found.
    Binaries(Vec<String>),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(errors) => write!(f, "{errors}"),
            Self::Binaries(lines) => f.write_str(&lines.join("\n")),
        }
    }
}

impl std::error::Error for LoadError {}

impl LoadError {
    /// One problem per entry.
    pub fn lines(&self) -> Vec<String> {
        match self {
            Self::Config(errors) => errors.iter().map(|d| d.to_string()).collect(),
            Self::Binaries(lines) => lines.clone(),
        }
    }
}

/// Loads and validates the configuration, then resolves every bare-metal
/// `binaryPath` (see [`crate::daemon::agent_binary`]).
pub fn load_config(main: &Path, dir: Option<&Path>) -> Result<kici_config::Loaded, LoadError> {
    let mut loaded = kici_config::load(main, dir).map_err(LoadError::Config)?;
    agent_binary::resolve_all(&mut loaded.config, &SearchPath::current())
        .map_err(LoadError::Binaries)?;
    Ok(loaded)
}

/// Binds the agent gateway's listener (`--gateway-listen`).
pub fn bind_gateway(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Binds the gateway on a backend network's gateway address, with
/// `IP_FREEBIND`: Podman (netavark) gives its bridge that address only when
/// the network's first container starts, and takes it away with the last
/// one — the listener must exist before either (a socket bound to an
/// address keeps receiving whenever the address is there).
pub fn bind_backend_gateway(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    use rustix::net::{sockopt, AddressFamily, SocketFlags, SocketType};
    let family = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = rustix::net::socket_with(family, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    sockopt::set_socket_reuseaddr(&fd, true)?;
    if addr.is_ipv4() {
        sockopt::set_ip_freebind(&fd, true)?;
    } else {
        sockopt::set_ipv6_freebind(&fd, true)?;
    }
    rustix::net::bind(&fd, &addr)?;
    rustix::net::listen(&fd, 1024)?;
    let listener = std::net::TcpListener::from(fd);
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Settings of a [`Stack`] that are not in the configuration.
#[derive(Debug, Clone, Default)]
pub struct StackOptions {
    pub engine: EngineSettings,
    /// Events kept for `GET /v1/events` resumption.
    pub event_replay: usize,
    pub gateway: GatewaySettings,
    /// Each gateway listener's connection bounds.
    pub gateway_limits: ConnectionLimits,
    /// Where standalone jobs' output is kept on disk (with a state store:
    /// readable again after a crash); `None`: in memory only.
    pub job_output: Option<PathBuf>,
    /// A fleet's host: a job that ran when the daemon died ends as lost
    /// with its host (see [`JobBook::set_in_fleet`]).
    pub in_fleet: bool,
}

/// Why a stack did not start.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("admission: {0}")]
    Admission(#[from] kici_admission::AdmissionError),
    #[error("the agent gateway: {0}")]
    Gateway(io::Error),
    #[error("reading recorded agents: {0}")]
    Store(#[from] kici_store::StoreError),
}

/// What start-up recovery found in the state store.
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    pub report: RecoveryReport,
    /// Rows that did not decode; left in the store untouched.
    pub unreadable: Vec<String>,
    /// What became of the recorded pending requests (also in `report`).
    pub pending: PendingReport,
}

/// How a shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    /// Agents not destroyed within the grace.
    pub agents_left: usize,
}

/// The engine and everything around it (no control API).
pub struct Stack {
    pub config: Arc<Config>,
    pub runtime: Runtime,
    pub tokens: Arc<TokenStore>,
    pub jobs: Arc<JobBook>,
    pub gateway: Arc<Gateway>,
    pub metrics: Arc<Metrics>,
    pub events: Arc<EventLog>,
    /// Where the gateway listens (what agents are told, as `ws://…/ws`).
    pub gateway_addr: SocketAddr,
    pump: Pump,
    /// `None` only if something else took the runtime's job effects.
    job_driver: Option<JobDriver>,
    /// The gateway's listeners, the `--gateway-listen` one first.
    gateway_servers: Vec<Server>,
    after_shutdown: Vec<Box<dyn FnOnce() + Send>>,
}

impl Stack {
    /// Starts the engine on `backends` and serves the gateway on `gateway`.
    /// With a state store, every agent it records is taken back first (see
    /// [`kici_engine::Engine::recover`]) and every change is written to it.
    /// Must run inside a tokio runtime.
    pub async fn start(
        config: Arc<Config>,
        backends: Built,
        ledger: Option<MachineLedger>,
        gateway: std::net::TcpListener,
        options: StackOptions,
        store: Option<Arc<dyn StateStore>>,
    ) -> Result<(Self, Recovery), StackError> {
        let gateway_addr = gateway.local_addr().map_err(StackError::Gateway)?;
        let listener = Listener::tcp(gateway).map_err(StackError::Gateway)?;
        // The gateway also listens on each backend network's gateway
        // address (same port): containers and VMs cannot reach loopback.
        let mut extra_listeners = Vec::new();
        let mut backend_gateways = Vec::new();
        for (kind, ip) in &backends.agent_gateways {
            let addr = SocketAddr::new(*ip, gateway_addr.port());
            let l = bind_backend_gateway(addr).map_err(StackError::Gateway)?;
            extra_listeners.push(Listener::tcp(l).map_err(StackError::Gateway)?);
            backend_gateways.push((*kind, addr));
        }
        let admission = Admission::new(&config, ledger)?;
        let engine = Engine::new(
            Arc::clone(&config),
            admission,
            HostPlatform::current(),
            options.engine,
        );
        let tokens = Arc::new(TokenStore::new());
        let bootstrapper = Arc::new(backend_gateways.iter().fold(
            TokenBootstrapper::new(Arc::clone(&tokens), gateway_addr),
            |b, (kind, addr)| b.with_backend_gateway(*kind, *addr),
        ));
        let metrics = Arc::new(Metrics::new(&config));
        let events = Arc::new(EventLog::new(options.event_replay.max(1)));
        let mut recovery = Recovery::default();
        let mut recorded = Vec::new();
        let mut pending_recorded = Recorded::default();
        let mut pending_labels = HashMap::new();
        let mut job_records = Vec::new();
        let mut persister = None;
        let runtime = match &store {
            None => Runtime::start(engine, backends.backends, bootstrapper),
            Some(store) => {
                let now = SystemTime::now();
                for row in store.agents().await? {
                    match durable_from_record(&row, now) {
                        Ok(pair) => recorded.push(pair),
                        Err(e) => recovery.unreadable.push(e),
                    }
                }
                for row in store.pending().await? {
                    match pending_from_record(&row, now) {
                        Ok(p) => {
                            pending_labels.insert(p.request.job.clone(), p.request.labels.clone());
                            pending_recorded.pending.push(p);
                        }
                        Err(e) => pending_recorded.unreadable_pending.push((row.job_id, e)),
                    }
                }
                job_records = store.jobs().await?;
                // Event ids continue after the highest recorded one; the
                // newest recorded events are replayable at once.
                let last = store.last_event_seq().await?.unwrap_or(0);
                let keep = u64::try_from(events.capacity()).unwrap_or(u64::MAX);
                let from = last.saturating_sub(keep);
                let limit = u32::try_from(keep).unwrap_or(u32::MAX);
                events.restore(
                    store
                        .events_after(from, limit)
                        .await?
                        .into_iter()
                        .map(LoggedEvent::from_record),
                );
                persister = Some((
                    Persister::start(Arc::clone(store), Arc::clone(&events), keep),
                    last,
                ));
                let journal = Arc::new(StoreJournal::new(Arc::clone(store), Arc::clone(&tokens)));
                Runtime::with_journal(engine, backends.backends, bootstrapper, journal)
            }
        };
        // With a store, every job is recorded as it changes.
        let jobs = Arc::new(match &persister {
            Some((p, _)) => JobBook::durable(p.job_recorder(), options.job_output.as_deref()),
            None => JobBook::new(),
        });
        if options.in_fleet {
            jobs.set_in_fleet();
        }
        // Subscribed before anything yields: the runtime's first tick runs
        // only then.
        let gateway = Gateway::new(
            runtime.clone(),
            Arc::clone(&tokens),
            Arc::clone(&jobs),
            options.gateway,
            Arc::clone(&metrics),
        );
        let job_driver = gateway.drive_jobs();
        let pump = Pump::start_recorded(
            &runtime,
            Arc::clone(&events),
            Arc::clone(&metrics),
            persister,
        );
        if store.is_some() {
            // Jobs first: a job recorded as waiting shows its end once the
            // engine declines to run it again.
            persist::log_jobs_restored(&jobs.restore(job_records));
            let (records, tokens_of): (Vec<_>, Vec<_>) = recorded
                .into_iter()
                .map(|(d, t)| (d.clone(), (d.agent, t)))
                .unzip();
            pending_recorded.agents = records;
            recovery.report = runtime.recover_and_start(pending_recorded).await;
            recovery.pending = recovery.report.pending.clone();
            for job in &recovery.pending.standalone_failed {
                // Usually the job's own record already showed it; this
                // covers a request recorded without one.
                jobs.restore_aborted(
                    job.clone(),
                    pending_labels.remove(job).unwrap_or_default(),
                    Vec::new(),
                    persist::STANDALONE_LOST.to_owned(),
                );
            }
            restore_tokens(&runtime, &tokens, &recovery.report.adopted, tokens_of);
        }
        let router = gateway.router();
        let serve = |listener| {
            Server::start(
                ListenerName::Gateway,
                listener,
                None,
                router.clone(),
                options.gateway_limits,
                metrics.listener(ListenerName::Gateway),
            )
        };
        let mut gateway_servers = vec![serve(listener)];
        for (l, (kind, addr)) in extra_listeners.into_iter().zip(&backend_gateways) {
            gateway_servers.push(serve(l));
            tracing::info!(addr = %addr, backend = %kind, "agent gateway listening for a backend network");
        }
        tracing::info!(addr = %gateway_addr, "agent gateway listening");
        let stack = Self {
            config,
            runtime,
            tokens,
            jobs,
            gateway,
            metrics,
            events,
            gateway_addr,
            pump,
            job_driver,
            gateway_servers,
            after_shutdown: backends.after_shutdown,
        };
        Ok((stack, recovery))
    }

    /// Whether the gateway's server task ended on its own (its error).
    pub fn gateway_failed(&self) -> bool {
        self.gateway_servers
            .first()
            .is_some_and(|server| server.task.is_finished())
    }

    /// Stops admitting, cancels pending requests, destroys every agent (up
    /// to `grace`), delivers the last events, stops the gateway and, when
    /// every agent is gone, runs the backends' clean-up.
    pub async fn shutdown(self, grace: Duration) -> Stopped {
        let all_gone = self.runtime.shutdown(grace).await;
        let agents_left = self.runtime.agents(false).len();
        // Every job gets its end (from the engine's last job effects)
        // before the pump closes the event log.
        if let Some(driver) = self.job_driver {
            driver.finish().await;
        }
        self.pump.finish().await;
        for server in &self.gateway_servers {
            server.graceful_shutdown(Some(GATEWAY_STOP));
        }
        for server in self.gateway_servers {
            match tokio::time::timeout(GATEWAY_STOP * 2, server.task).await {
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "agent gateway ended with an error"),
                Ok(Err(e)) => tracing::warn!(error = %e, "agent gateway task failed"),
                Ok(Ok(Ok(()))) => {}
                Err(_) => tracing::warn!("agent gateway did not stop in time"),
            }
        }
        if all_gone {
            for hook in self.after_shutdown {
                hook();
            }
        }
        Stopped { agents_left }
    }
}

/// A re-adopted agent keeps the token it was given before the restart
/// (its hash was recorded), scoped to its `KICI_LABELS` as before.
fn restore_tokens(
    runtime: &Runtime,
    tokens: &TokenStore,
    adopted: &[AgentId],
    recorded: Vec<(AgentId, Option<RecordedToken>)>,
) {
    let now = SystemTime::now();
    for (agent, token) in recorded {
        let Some(token) = token else { continue };
        if !adopted.contains(&agent) {
            continue;
        }
        let remaining = token.expires_at.duration_since(now).unwrap_or_default();
        let scope = runtime
            .call(|e, _| e.agent_labels_of(agent))
            .map(|labels| LabelSet::from_labels(labels.iter().filter_map(|l| Label::parse(l).ok())))
            .unwrap_or_default();
        if let Err(e) = tokens.restore(agent, &token.hash, remaining, scope) {
            tracing::warn!(agent = %agent, error = %e, "recorded token unusable; the agent cannot register again");
        }
    }
}
