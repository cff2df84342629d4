//! The agent gateway: the WebSocket at `/ws` that agents of scalers without
//! an `orchestratorUrl` connect back to (its own listener,
//! `--gateway-listen`), speaking the KiCI registration handshake
//! (KiCI's agent protocol; the message types are `kici-protocol`'s).
//!
//! One connection's life ([`Gateway::session`]):
//!
//! 1. `auth.request` within [`GatewaySettings::auth_timeout`] (else close
//!    4002). Its `protocolVersion` must be one the gateway speaks
//!    ([`SUPPORTED_PROTOCOL_VERSIONS`]; else `auth.failure` and close 4005).
//!    Its token must be one this daemon minted, unexpired and not
//!    revoked (looked up in constant time by [`TokenStore::identify`]); a
//!    wrong, expired, revoked or malformed token gets `auth.failure` and close
//!    4010. Anything else first: `auth.failure`, 4010 (every agent we spawn
//!    has a token).
//! 2. `agent.register` within `register_timeout` (4002), gated: its agent id
//!    must be the token's (4010), every label outside the `kici:os:`,
//!    `kici:arch:`, `kici:host:` prefixes must be in the token's scope (the
//!    `KICI_LABELS` it was given, 4010), and the agent must be one the engine
//!    follows and able to register (4010). An open connection of the same
//!    agent is superseded: a reconnect after a network blip may find its
//!    old socket still open (half-open), and must not be locked out by it;
//!    the old connection is closed with 4009 and its end destroys nothing.
//!    The engine is told (`agent_registered`, idempotent), then
//!    `register.ack` (`scalerManaged`, `capabilities`, `pendingDispatch`
//!    when a job is bound, `warmPool` when none is).
//! 3. `config.ack` within `config_ack_timeout` (4002).
//! 4. Standalone: the bound job (or one a warm agent takes later) is sent as
//!    `job.dispatch`, after the scaler's mandatory labels are checked against
//!    the job's; `job.ack` (or `job.status running`) within
//!    `dispatch_ack_timeout` (else `job.cancel` and close 4031) tells the
//!    engine `job_started`. A reconnecting agent whose job already runs is
//!    not sent it again: it goes on with it if its registration lists it in
//!    `inFlightJobs`, else the job ends (aborted, never run twice); `log.chunk`s go to the job's output; the terminal
//!    `job.status` ends the job, tells the engine `job_completed` (which
//!    destroys a standalone agent) and the gateway closes with 1000.
//! 5. Heartbeats: any frame counts; none for `heartbeat_timeout` (KiCI's
//!    180 s, six missed 30 s heartbeats) closes with 4004.
//!
//! After registration, KiCI's notifications this protocol does not use
//! ([`IGNORED_AGENT_MESSAGES`]: `agent.status`, `agent.log`, `job.heartbeat`,
//! …) are accepted, ignored and counted
//! (`kici_orch_scaler_agent_messages_ignored_total{type}`); any other
//! message that does not parse closes with 4003.
//!
//! When a registered connection ends, for whatever reason, the engine is
//! told `agent_disconnected`: the agent is destroyed and everything it held
//! released (the engine's job). Frames above [`MAX_FRAME_BYTES`] are refused
//! by the WebSocket layer and end the connection (close 1009).

pub mod enrolment;
pub mod token;

use crate::events::metrics::Metrics;
use crate::gateway::enrolment::{Enrolment, Refusal, Via};
use crate::gateway::token::{TokenGrant, TokenRejection, TokenStore};
use crate::jobs::{Action, JobBook};
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use kici_engine::runtime::Runtime;
use kici_engine::{AgentError, JobEffect};
use kici_model::{AgentId, JobId, Label, LabelSet};
use kici_protocol::{
    message_type, AgentMessage, AuthFailure, AuthSuccess, CloseCode, GatewayMessage, JobCancel,
    JobDispatch, JobProgress, JobSpec, RegisterAck, UnixMillis, AGENT_WS_PATH,
    IGNORED_AGENT_MESSAGES, MAX_FRAME_BYTES, SUPPORTED_PROTOCOL_VERSIONS,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

/// The task applying the engine's standalone-job effects to the job book
/// and the gateway ([`Gateway::drive_jobs`]).
pub struct JobDriver {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl JobDriver {
    /// Applies every effect queued so far, then stops.
    pub async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            // The task may have ended already (channel closed): fine.
            let _ = stop.send(());
        }
        if let Err(e) = (&mut self.task).await {
            tracing::error!(error = %e, "the job driver failed");
        }
    }
}

/// The handshake and liveness deadlines (KiCI's defaults).
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// Open → `auth.request` (KiCI: 5 s).
    pub auth_timeout: Duration,
    /// `auth.success` → `agent.register` (KiCI: 10 s).
    pub register_timeout: Duration,
    /// `register.ack` → `config.ack`.
    pub config_ack_timeout: Duration,
    /// `job.dispatch` → `job.ack` (KiCI: 10 s), else close 4031.
    pub dispatch_ack_timeout: Duration,
    /// No frame at all for this long closes with 4004 (KiCI: 180 s).
    pub heartbeat_timeout: Duration,
}

impl Default for GatewaySettings {
    fn default() -> Self {
        Self {
            auth_timeout: Duration::from_secs(5),
            register_timeout: Duration::from_secs(10),
            config_ack_timeout: Duration::from_secs(10),
            dispatch_ack_timeout: Duration::from_secs(10),
            heartbeat_timeout: Duration::from_secs(180),
        }
    }
}

/// The longest close reason a close frame can carry.
const MAX_CLOSE_REASON: usize = 123;
/// How long a close waits for the agent's answering close frame.
const CLOSE_LINGER: Duration = Duration::from_secs(1);
/// WebSocket's "message too big".
const CLOSE_TOO_BIG: u16 = 1009;

/// What the rest of the daemon asks of a connected agent's session.
#[derive(Debug)]
enum Command {
    Dispatch(JobSpec),
    /// A newer connection of the same agent registered: close this one.
    Supersede,
}

struct SessionHandle {
    id: u64,
    commands: mpsc::UnboundedSender<Command>,
}

/// The gateway: shared by every connection. Cheap to share (`Arc`).
pub struct Gateway {
    runtime: Runtime,
    enrolment: Enrolment,
    jobs: Arc<JobBook>,
    settings: GatewaySettings,
    metrics: Arc<Metrics>,
    sessions: Mutex<HashMap<AgentId, SessionHandle>>,
    next_session: AtomicU64,
    /// Where `scaler.claim-credentials` redeems codes (set when the
    /// configuration has `type: event` scalers).
    claims: std::sync::OnceLock<Arc<crate::provisioning::Provisioning>>,
}

/// How a connection ends early.
struct Closed;

impl Gateway {
    pub fn new(
        runtime: Runtime,
        tokens: Arc<TokenStore>,
        jobs: Arc<JobBook>,
        settings: GatewaySettings,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Arc::new(Self {
            enrolment: Enrolment::new(runtime.clone(), tokens),
            runtime,
            jobs,
            settings,
            metrics,
            sessions: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            claims: std::sync::OnceLock::new(),
        })
    }

    /// Answers upstream's pre-auth `scaler.claim-credentials` from `hub`.
    pub fn serve_claims(&self, hub: Arc<crate::provisioning::Provisioning>) {
        let _ = self.claims.set(hub);
    }

    /// The gateway's HTTP router: `GET /ws` (WebSocket upgrade) only.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route(AGENT_WS_PATH, get(upgrade))
            .with_state(Arc::clone(self))
    }

    /// Agents with a live, registered connection.
    pub fn connected(&self) -> usize {
        self.sessions.lock().len()
    }

    /// Applies the engine's standalone-job effects, every one and in the
    /// engine's order, to the job book, and carries out what they require
    /// (dispatch to a warm agent that took a job). `None` when the
    /// runtime's job effects were taken already. Start it before the
    /// runtime's first tick.
    pub fn drive_jobs(self: &Arc<Self>) -> Option<JobDriver> {
        let mut effects = self.runtime.job_effects()?;
        let gw = Arc::clone(self);
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let handle = |effect: JobEffect| {
                if let Some(action) = gw.jobs.apply(effect) {
                    gw.act(action);
                }
            };
            loop {
                tokio::select! {
                    biased;
                    received = effects.recv() => match received {
                        Some(effect) => handle(effect),
                        None => break,
                    },
                    _ = &mut stopped => {
                        // What was queued so far is applied first.
                        while let Ok(effect) = effects.try_recv() {
                            handle(effect);
                        }
                        break;
                    }
                }
            }
        });
        Some(JobDriver {
            stop: Some(stop),
            task,
        })
    }

    fn act(&self, action: Action) {
        match action {
            Action::Dispatch { agent, spec } => {
                let sent = self
                    .sessions
                    .lock()
                    .get(&agent)
                    .is_some_and(|s| s.commands.send(Command::Dispatch(spec.clone())).is_ok());
                if !sent {
                    let job = spec.job_id().clone();
                    tracing::warn!(agent_id = %agent, job_id = %job, "the agent that took the job is not connected");
                    self.jobs.abort(
                        &job,
                        format!("agent {agent} took the job but is not connected to the gateway"),
                    );
                    let _ = self.runtime.destroy_agent(agent);
                }
            }
        }
    }

    /// One agent connection, from upgrade to close.
    pub async fn session(self: Arc<Self>, socket: WebSocket, peer: Option<std::net::IpAddr>) {
        let mut conn = Conn {
            ws: socket,
            agent: None,
        };
        let Ok(grant) = self.authenticate(&mut conn, peer).await else {
            return;
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let session_id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let Ok(registered) = self.register(&mut conn, &grant, session_id, tx).await else {
            return;
        };
        let agent = registered.agent;
        let span = tracing::info_span!("agent_session", agent_id = %agent);
        let _ = self.serve(&mut conn, registered, rx).instrument(span).await;
        // Whatever ended the connection, the agent is done — unless a
        // newer connection of it took over: then it lives on there.
        let superseded = {
            let mut sessions = self.sessions.lock();
            match sessions.get(&agent) {
                Some(s) if s.id == session_id => {
                    sessions.remove(&agent);
                    false
                }
                Some(_) => true,
                None => false,
            }
        };
        if superseded {
            tracing::info!(agent_id = %agent, "connection superseded by the agent's reconnect; the agent goes on");
            return;
        }
        // The engine destroys it and releases what it held.
        match self.enrolment.disconnected(agent, Via::Gateway) {
            Ok(()) | Err(AgentError::NotOurs(_)) => {}
            Err(e) => tracing::warn!(agent_id = %agent, error = %e, "disconnect not applied"),
        }
    }

    async fn authenticate(
        &self,
        conn: &mut Conn,
        peer: Option<std::net::IpAddr>,
    ) -> Result<TokenGrant, Closed> {
        let deadline = Instant::now() + self.settings.auth_timeout;
        loop {
            let text = self.next_auth_text(conn, deadline).await?;
            match AgentMessage::from_json(&text) {
                // Upstream's self-bootstrap: a code redeemed before auth,
                // under the same deadline.
                Ok(AgentMessage::ClaimCredentials(c)) => {
                    let answer = self.claim_credentials(c, peer).await;
                    conn.send(&GatewayMessage::ClaimCredentialsResponse(answer))
                        .await?;
                }
                _ => return self.authenticate_with(conn, &text).await,
            }
        }
    }

    async fn claim_credentials(
        &self,
        c: kici_protocol::ClaimCredentials,
        peer: Option<std::net::IpAddr>,
    ) -> kici_protocol::ClaimCredentialsResponse {
        use crate::provisioning::hub::Redeem;
        let refused = |error: &str| kici_protocol::ClaimCredentialsResponse {
            request_id: c.request_id.clone(),
            credentials: None,
            error: Some(error.to_owned()),
        };
        let Some(hub) = self.claims.get() else {
            return refused("no type: event scaler here");
        };
        // Without a peer address (a unix socket) every caller shares one
        // budget: the limit still holds.
        let source = peer.unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        match hub.redeem(source, &c.claim_code).await {
            Ok(creds) => {
                tracing::info!(agent_id = %creds.agent_id, "claim code redeemed over the gateway");
                kici_protocol::ClaimCredentialsResponse {
                    request_id: c.request_id,
                    credentials: Some(kici_protocol::ClaimedAgentCredentials {
                        agent_token: creds.agent_token,
                        agent_id: creds.agent_id,
                        orchestrator_url: creds.gateway_url,
                        labels: creds.labels,
                    }),
                    error: None,
                }
            }
            Err(Redeem::Limited(_)) => refused("rate-limited"),
            Err(Redeem::Failed(kici_provision::RedeemError::Refused(f))) => refused(f.as_str()),
            Err(Redeem::Failed(kici_provision::RedeemError::Malformed)) => refused("malformed"),
            Err(Redeem::Failed(e)) => {
                tracing::warn!(error = %e, "claim over the gateway failed");
                refused("claim-failed")
            }
        }
    }

    async fn next_auth_text(&self, conn: &mut Conn, deadline: Instant) -> Result<String, Closed> {
        match conn.next_text(deadline).await {
            Next::Text(t) => Ok(t),
            Next::Timeout => Err(conn
                .close(CloseCode::HandshakeTimeout, "auth timeout")
                .await),
            // Anything but `auth.request` first is an authentication
            // failure, a binary frame included.
            Next::Binary => Err(conn
                .refuse("first message must be auth.request, not a binary frame")
                .await),
            other => Err(conn.end(other).await),
        }
    }

    async fn authenticate_with(&self, conn: &mut Conn, text: &str) -> Result<TokenGrant, Closed> {
        let text = text.to_owned();
        let auth = match AgentMessage::from_json(&text) {
            Ok(AgentMessage::AuthRequest(a)) => a,
            Ok(other) => {
                return Err(conn
                    .refuse(&format!(
                        "first message must be auth.request, not {}",
                        other.type_name()
                    ))
                    .await)
            }
            Err(e) if message_type(&text).as_deref() == Some("auth.request") => {
                tracing::warn!(error = %e, "malformed auth.request");
                return Err(conn.refuse("invalid or expired token").await);
            }
            Err(e) => {
                tracing::warn!(error = %e, "unreadable first message");
                return Err(conn.refuse("first message must be auth.request").await);
            }
        };
        if !SUPPORTED_PROTOCOL_VERSIONS.contains(&auth.protocol_version) {
            tracing::warn!(
                received = auth.protocol_version,
                min = SUPPORTED_PROTOCOL_VERSIONS.start(),
                max = SUPPORTED_PROTOCOL_VERSIONS.end(),
                "agent protocol version not supported"
            );
            return Err(conn
                .refuse_with(
                    CloseCode::UnsupportedProtocolVersion,
                    "Unsupported protocol version",
                )
                .await);
        }
        match self.enrolment.identify(auth.token.expose()) {
            Ok(grant) => {
                let connection_id = format!("conn-{}", hex::encode(rand_bytes()));
                conn.send(&GatewayMessage::AuthSuccess(AuthSuccess { connection_id }))
                    .await?;
                Ok(grant)
            }
            Err(refusal) => Err(conn.refuse(&close_reason(&refusal)).await),
        }
    }

    async fn register(
        &self,
        conn: &mut Conn,
        grant: &TokenGrant,
        session_id: u64,
        commands: mpsc::UnboundedSender<Command>,
    ) -> Result<Registered, Closed> {
        let deadline = Instant::now() + self.settings.register_timeout;
        let register = match conn.next_message(deadline).await? {
            AgentMessage::Register(r) => r,
            other => {
                return Err(conn
                    .close(
                        CloseCode::InvalidMessage,
                        &format!("expected agent.register, got {}", other.type_name()),
                    )
                    .await)
            }
        };
        let agent = register.agent_id;
        conn.agent = Some(agent);
        if let Err(refusal) =
            self.enrolment
                .check_claim(grant, agent, register.labels.iter().cloned())
        {
            return Err(conn.refuse(&close_reason(&refusal)).await);
        }
        // In the map before the engine hears of the registration, so a
        // dispatch it triggers finds the session. An open connection of
        // the same agent (its token proved it is the agent) is superseded.
        let superseded = self.sessions.lock().insert(
            agent,
            SessionHandle {
                id: session_id,
                commands,
            },
        );
        if let Some(old) = superseded {
            tracing::info!(agent_id = %agent, "the agent reconnected while its old connection was open; closing the old one");
            // Gone already: its end finds this session in the map.
            let _ = old.commands.send(Command::Supersede);
        }
        let registration = match self.enrolment.register(agent, Via::Gateway).await {
            Ok(r) => r,
            Err(refusal) => {
                {
                    let mut sessions = self.sessions.lock();
                    if sessions.get(&agent).is_some_and(|s| s.id == session_id) {
                        sessions.remove(&agent);
                    }
                }
                return Err(conn.refuse(&close_reason(&refusal)).await);
            }
        };
        if let Some(version) = register.version.as_deref() {
            tracing::debug!(agent_id = %agent, version, "agent version");
        }
        conn.send(&GatewayMessage::RegisterAck(RegisterAck {
            agent_id: agent,
            labels: register.labels.clone(),
            scaler_managed: true,
            capabilities: RegisterAck::capabilities(),
            pending_dispatch: registration.bound_job_id.is_some(),
            // Every agent of ours is the engine's: one with no job bound
            // was spawned for a warm pool.
            warm_pool: registration.bound_job_id.is_none(),
        }))
        .await?;
        Ok(Registered {
            agent,
            bound_job: registration.bound_job_id,
            mandatory_labels: registration.mandatory_labels,
            in_flight: register
                .in_flight_jobs
                .iter()
                .map(|j| j.job_id.clone())
                .collect(),
        })
    }

    async fn serve(
        &self,
        conn: &mut Conn,
        registered: Registered,
        mut commands: mpsc::UnboundedReceiver<Command>,
    ) -> Result<(), Closed> {
        let agent = registered.agent;
        // config.ack first: nothing is dispatched before it (on Firecracker
        // the MMDS is cleared then).
        let deadline = Instant::now() + self.settings.config_ack_timeout;
        loop {
            let text = match conn.next_text(deadline).await {
                Next::Text(t) => t,
                Next::Timeout => {
                    return Err(conn
                        .close(CloseCode::HandshakeTimeout, "config.ack timeout")
                        .await)
                }
                other => return Err(conn.end(other).await),
            };
            match self.parse_registered(agent, &text) {
                Ok(Some(AgentMessage::ConfigAck(_))) => break,
                Ok(Some(AgentMessage::Heartbeat(_)) | None) => continue,
                Ok(Some(other)) => {
                    return Err(conn
                        .close(
                            CloseCode::InvalidMessage,
                            &format!("expected config.ack, got {}", other.type_name()),
                        )
                        .await)
                }
                Err(e) => {
                    tracing::warn!(agent_id = %agent, error = %e, "invalid message from the agent");
                    return Err(conn
                        .close(CloseCode::InvalidMessage, "invalid message")
                        .await);
                }
            }
        }
        // Bootstrap secrets handed over a side channel (Firecracker's MMDS)
        // are gone, verified, before the agent gets any job.
        if self
            .enrolment
            .configured(agent, Via::Gateway)
            .await
            .is_err()
        {
            return Err(conn
                .close(CloseCode::GoingAway, "bootstrap data could not be cleared")
                .await);
        }
        let mut job = JobTrack::default();
        if let Some(bound) = &registered.bound_job {
            match self.jobs.dispatchable(bound) {
                // Started on an earlier connection of this agent: never
                // sent twice. It goes on if the agent still runs it.
                Some(_) if self.jobs.running_on(bound, agent) => {
                    if registered.in_flight.iter().any(|j| j == bound.as_str()) {
                        tracing::info!(agent_id = %agent, job_id = %bound, "the reconnected agent goes on with its job");
                        job.current = Some(bound.clone());
                        job.acked = true;
                    } else {
                        self.jobs.abort(
                            bound,
                            format!("agent {agent} reconnected without its running job"),
                        );
                        return Err(conn.close(CloseCode::Normal, "job lost").await);
                    }
                }
                Some((spec, labels)) => {
                    self.dispatch(conn, &mut job, &registered, spec, &labels)
                        .await?;
                }
                None => tracing::info!(
                    agent_id = %agent,
                    job_id = %bound,
                    "the bound job is not a standalone job: waiting for a dispatcher"
                ),
            }
        }
        let mut last_seen = Instant::now();
        loop {
            let heartbeat_deadline = last_seen + self.settings.heartbeat_timeout;
            let deadline = match job.ack_deadline {
                Some(ack) => ack.min(heartbeat_deadline),
                None => heartbeat_deadline,
            };
            tokio::select! {
                next = conn.next_frame() => {
                    last_seen = Instant::now();
                    let text = match next {
                        Next::Text(t) => t,
                        Next::Other => continue,
                        other => return Err(conn.end(other).await),
                    };
                    let msg = match self.parse_registered(agent, &text) {
                        Ok(Some(m)) => m,
                        Ok(None) => continue,
                        Err(e) => {
                            tracing::warn!(agent_id = %agent, error = %e, "invalid message from the agent");
                            return Err(conn.close(CloseCode::InvalidMessage, "invalid message").await);
                        }
                    };
                    if self.on_message(conn, &mut job, agent, msg).await? == Flow::Done {
                        return Ok(());
                    }
                }
                command = commands.recv() => {
                    match command {
                        Some(Command::Dispatch(spec)) => {
                            match self.jobs.dispatchable(spec.job_id()) {
                                Some((spec, labels)) if job.current.is_none() => {
                                    self.dispatch(conn, &mut job, &registered, spec, &labels).await?;
                                }
                                Some(_) => {
                                    self.jobs.abort(spec.job_id(), format!("agent {agent} is already running a job"));
                                }
                                None => {}
                            }
                        }
                        Some(Command::Supersede) => {
                            return Err(conn.close(CloseCode::SupersededByReconnect, "Superseded by reconnect").await);
                        }
                        // The gateway itself is going away.
                        None => return Err(conn.close(CloseCode::GoingAway, "gateway stopping").await),
                    }
                }
                () = tokio::time::sleep_until(deadline) => {
                    if job.ack_deadline.is_some_and(|d| d <= Instant::now()) {
                        let Some(current) = job.current.clone() else {
                            job.ack_deadline = None;
                            continue;
                        };
                        tracing::warn!(agent_id = %agent, job_id = %current, "the agent did not acknowledge the job in time");
                        let _ = conn.send(&GatewayMessage::JobCancel(JobCancel {
                            job_id: current.clone(),
                            reason: "dispatch ack timeout".to_owned(),
                        })).await;
                        self.jobs.abort(&current, format!(
                            "agent {agent} did not acknowledge the job within {}s",
                            self.settings.dispatch_ack_timeout.as_secs()
                        ));
                        return Err(conn.close(CloseCode::DispatchAckTimeout, "dispatch ack timeout").await);
                    }
                    tracing::warn!(agent_id = %agent, "no heartbeat from the agent in time");
                    return Err(conn.close(CloseCode::HeartbeatTimeout, "heartbeat timeout").await);
                }
            }
        }
    }

    async fn dispatch(
        &self,
        conn: &mut Conn,
        job: &mut JobTrack,
        registered: &Registered,
        spec: JobSpec,
        job_labels: &LabelSet,
    ) -> Result<(), Closed> {
        let agent = registered.agent;
        let id = spec.job_id().clone();
        // The scaler's mandatory labels gate which jobs its agents may take
        // (routing already applies it; this is the dispatcher's own check).
        let missing: Vec<&str> = registered
            .mandatory_labels
            .missing_from(job_labels)
            .map(Label::as_str)
            .collect();
        if !missing.is_empty() {
            self.jobs.abort(
                &id,
                format!(
                    "the job lacks the scaler's mandatory labels: {}",
                    missing.join(", ")
                ),
            );
            return Err(conn.close(CloseCode::Normal, "job refused").await);
        }
        let now = UnixMillis::now();
        conn.send(&GatewayMessage::JobDispatch(JobDispatch {
            message_id: format!("job-dispatch-{id}-{}", now.0),
            job: spec,
            timestamp: now,
        }))
        .await?;
        tracing::info!(agent_id = %agent, job_id = %id, "job dispatched");
        job.current = Some(id);
        job.acked = false;
        job.ack_deadline = Some(Instant::now() + self.settings.dispatch_ack_timeout);
        Ok(())
    }

    async fn on_message(
        &self,
        conn: &mut Conn,
        job: &mut JobTrack,
        agent: AgentId,
        msg: AgentMessage,
    ) -> Result<Flow, Closed> {
        match msg {
            AgentMessage::Heartbeat(_) | AgentMessage::ConfigAck(_) => {}
            AgentMessage::JobAck(ack) => self.acked(job, agent, &ack.job_id),
            AgentMessage::JobReject(reject) => {
                if job.current.as_ref() == Some(&reject.job_id) {
                    self.jobs.abort(
                        &reject.job_id,
                        format!("agent {agent} rejected the job ({:?})", reject.reason),
                    );
                    return Err(conn.close(CloseCode::Normal, "job rejected").await);
                }
            }
            AgentMessage::OutputChunk(chunk) => {
                if job.current.as_ref() == Some(&chunk.job_id) {
                    if chunk.seq != job.next_seq {
                        tracing::warn!(agent_id = %agent, job_id = %chunk.job_id, expected = job.next_seq, got = chunk.seq, "output chunks missing");
                    }
                    job.next_seq = chunk.seq + 1;
                    self.jobs.output(&chunk.job_id, chunk.stream, chunk.data);
                } else {
                    tracing::warn!(agent_id = %agent, job_id = %chunk.job_id, "output for a job not dispatched here; dropped");
                }
            }
            AgentMessage::JobStatus(status) => {
                if job.current.as_ref() != Some(&status.job_id) {
                    tracing::warn!(agent_id = %agent, job_id = %status.job_id, "status of a job not dispatched here; ignored");
                    return Ok(Flow::Continue);
                }
                match status.progress {
                    // `running` counts as an ack (KiCI).
                    JobProgress::Running => self.acked(job, agent, &status.job_id),
                    JobProgress::Finished(end) => {
                        let id = status.job_id;
                        self.jobs.ended(&id, &end);
                        let exit_code = end.result().and_then(|r| r.exit_code());
                        if !job.acked {
                            // A job that could not start was never running.
                            self.acked(job, agent, &id);
                        }
                        if let Err(e) = self.runtime.job_completed(agent, &id, exit_code) {
                            tracing::warn!(agent_id = %agent, job_id = %id, error = %e, "job completion not applied");
                        }
                        job.current = None;
                        job.ack_deadline = None;
                        // Standalone: the agent's work is done.
                        conn.close(CloseCode::Normal, "job finished").await;
                        return Ok(Flow::Done);
                    }
                }
            }
            other @ (AgentMessage::AuthRequest(_)
            | AgentMessage::Register(_)
            | AgentMessage::ClaimCredentials(_)) => {
                return Err(conn
                    .close(
                        CloseCode::InvalidMessage,
                        &format!("unexpected {} after registration", other.type_name()),
                    )
                    .await)
            }
        }
        Ok(Flow::Continue)
    }

    /// A registered agent's message: `Ok(None)` for one of KiCI's that this
    /// protocol does not use (counted, otherwise ignored).
    fn parse_registered(
        &self,
        agent: AgentId,
        text: &str,
    ) -> Result<Option<AgentMessage>, serde_json::Error> {
        let e = match AgentMessage::from_json(text) {
            Ok(m) => return Ok(Some(m)),
            Err(e) => e,
        };
        let kind = message_type(text);
        match IGNORED_AGENT_MESSAGES
            .iter()
            .find(|k| kind.as_deref() == Some(**k))
        {
            Some(kind) => {
                tracing::debug!(agent_id = %agent, message_type = kind, "ignoring a message this gateway does not use");
                self.metrics.agent_message_ignored(kind);
                Ok(None)
            }
            None => Err(e),
        }
    }

    fn acked(&self, job: &mut JobTrack, agent: AgentId, id: &JobId) {
        if job.current.as_ref() != Some(id) || job.acked {
            return;
        }
        job.acked = true;
        job.ack_deadline = None;
        self.jobs.started(id, agent);
        if let Err(e) = self.runtime.job_started(agent, id.clone()) {
            tracing::warn!(agent_id = %agent, job_id = %id, error = %e, "job start not applied");
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    Done,
}

struct Registered {
    agent: AgentId,
    bound_job: Option<JobId>,
    mandatory_labels: LabelSet,
    /// The jobs the agent says it still runs (`inFlightJobs`).
    in_flight: Vec<String>,
}

/// The job this connection runs, if any.
#[derive(Debug, Default)]
struct JobTrack {
    current: Option<JobId>,
    acked: bool,
    ack_deadline: Option<Instant>,
    next_seq: u64,
}

/// The reason an `auth.failure` gives for a refusal: what the agent must
/// know to stop retrying, nothing about which tokens exist.
fn close_reason(refusal: &Refusal) -> String {
    match refusal {
        Refusal::Token(TokenRejection::Expired) => "token expired".to_owned(),
        Refusal::Token(TokenRejection::NoToken | TokenRejection::Mismatch) => {
            "invalid or expired token".to_owned()
        }
        other => other.to_string(),
    }
}

fn rand_bytes() -> [u8; 8] {
    use rand::RngCore;
    let mut b = [0u8; 8];
    rand::thread_rng().fill_bytes(&mut b);
    b
}

async fn upgrade(
    State(gateway): State<Arc<Gateway>>,
    peer: Option<axum::Extension<axum::extract::ConnectInfo<std::net::SocketAddr>>>,
    ws: WebSocketUpgrade,
) -> Response {
    let peer = peer.map(|p| p.0 .0.ip());
    ws.max_message_size(MAX_FRAME_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .on_upgrade(move |socket| gateway.session(socket, peer))
}

/// What the socket gave.
enum Next {
    Text(String),
    /// Ping, pong: liveness only.
    Other,
    Binary,
    Closed,
    TooBig,
    Error(String),
    Timeout,
}

struct Conn {
    ws: WebSocket,
    agent: Option<AgentId>,
}

impl Conn {
    async fn next_frame(&mut self) -> Next {
        match self.ws.recv().await {
            None => Next::Closed,
            Some(Ok(Message::Text(t))) => Next::Text(t.as_str().to_owned()),
            Some(Ok(Message::Close(_))) => Next::Closed,
            Some(Ok(Message::Binary(_))) => Next::Binary,
            Some(Ok(_)) => Next::Other,
            Some(Err(e)) => {
                let text = e.to_string();
                // tungstenite's capacity errors ("Space limit exceeded:
                // Message too long ...").
                if text.contains("too long")
                    || text.contains("too big")
                    || text.contains("Space limit")
                {
                    Next::TooBig
                } else {
                    Next::Error(text)
                }
            }
        }
    }

    /// The next text frame (pings skipped) before `deadline`.
    async fn next_text(&mut self, deadline: Instant) -> Next {
        loop {
            match tokio::time::timeout_at(deadline, self.next_frame()).await {
                Err(_) => return Next::Timeout,
                Ok(Next::Other) => continue,
                Ok(next) => return next,
            }
        }
    }

    /// The next protocol message before `deadline`; anything else ends the
    /// connection with the matching close.
    async fn next_message(&mut self, deadline: Instant) -> Result<AgentMessage, Closed> {
        let text = match self.next_text(deadline).await {
            Next::Text(t) => t,
            Next::Timeout => {
                return Err(self
                    .close(CloseCode::HandshakeTimeout, "registration timeout")
                    .await)
            }
            other => return Err(self.end(other).await),
        };
        match AgentMessage::from_json(&text) {
            Ok(m) => Ok(m),
            Err(e) => {
                tracing::warn!(agent_id = self.agent.map(|a| a.to_string()), error = %e, "invalid message from the agent");
                Err(self
                    .close(CloseCode::InvalidMessage, "invalid message")
                    .await)
            }
        }
    }

    async fn send(&mut self, msg: &GatewayMessage) -> Result<(), Closed> {
        self.ws
            .send(Message::Text(msg.to_json().into()))
            .await
            .map_err(|e| {
                tracing::debug!(agent_id = self.agent.map(|a| a.to_string()), error = %e, "send to the agent failed");
                Closed
            })
    }

    /// `auth.failure` then close 4010.
    async fn refuse(&mut self, reason: &str) -> Closed {
        self.refuse_with(CloseCode::AuthFailed, reason).await
    }

    /// `auth.failure` then close `code`.
    async fn refuse_with(&mut self, code: CloseCode, reason: &str) -> Closed {
        let _ = self
            .send(&GatewayMessage::AuthFailure(AuthFailure {
                reason: reason.to_owned(),
            }))
            .await;
        self.close(code, reason).await
    }

    /// How a non-message frame ends the connection.
    async fn end(&mut self, next: Next) -> Closed {
        match next {
            Next::Binary => {
                self.close(
                    CloseCode::InvalidMessage,
                    "binary frames are not part of the protocol",
                )
                .await
            }
            Next::TooBig => {
                tracing::warn!(
                    agent_id = self.agent.map(|a| a.to_string()),
                    limit = MAX_FRAME_BYTES,
                    "frame above the size limit; closing"
                );
                self.close_raw(CLOSE_TOO_BIG, "frame too large").await
            }
            Next::Error(e) => {
                tracing::debug!(agent_id = self.agent.map(|a| a.to_string()), error = %e, "connection error");
                Closed
            }
            Next::Timeout => self.close(CloseCode::HandshakeTimeout, "timeout").await,
            Next::Closed | Next::Text(_) | Next::Other => Closed,
        }
    }

    async fn close(&mut self, code: CloseCode, reason: &str) -> Closed {
        self.close_raw(code.code(), reason).await
    }

    /// Sends a close frame and waits briefly for the agent's.
    async fn close_raw(&mut self, code: u16, reason: &str) -> Closed {
        let mut reason = reason.to_owned();
        if reason.len() > MAX_CLOSE_REASON {
            let mut cut = MAX_CLOSE_REASON;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        let frame = CloseFrame {
            code,
            reason: reason.into(),
        };
        if self.ws.send(Message::Close(Some(frame))).await.is_ok() {
            let drain = async {
                while let Some(Ok(msg)) = self.ws.recv().await {
                    if matches!(msg, Message::Close(_)) {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(CLOSE_LINGER, drain).await;
        }
        Closed
    }
}
