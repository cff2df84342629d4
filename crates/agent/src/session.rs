//! The connection to the gateway: connect, handshake, serve, reconnect.
//!
//! One connection's life:
//!
//! 1. connect to `KICI_ORCHESTRATOR_URL` (bounded by [`CONNECT_TIMEOUT`]);
//! 2. with a token: `auth.request` → wait `auth.success` (an
//!    `auth.failure` is final);
//! 3. `agent.register` with the bootstrap labels plus the host's
//!    `kici:os:*` / `kici:arch:*` / `kici:host:*` and role labels → wait
//!    `register.ack` (steps 2–3 bounded by [`HANDSHAKE_TIMEOUT`] each);
//! 4. scaler-managed (by `register.ack` or `KICI_SCALER_MANAGED=1`):
//!    `config.ack`;
//! 5. serve: heartbeats every `--heartbeat-interval-ms` (30 s); run each
//!    `job.dispatch` (`job.ack`, `job.status running`, `log.chunk`s, the
//!    terminal `job.status`), answering `job.reject busy` to a dispatch
//!    while busy; `job.cancel` stops the job.
//!
//! While no job runs, one window is armed: after `register.ack` with
//! `pendingDispatch` the pending-dispatch window
//! (`KICI_SCALER_PENDING_DISPATCH_TIMEOUT`, 60 s), otherwise and after each
//! job the idle window (`KICI_SCALER_IDLE_TIMEOUT`, 5 s). When it passes
//! the agent closes with 1000 (reason `scaler-pending-dispatch-timeout` or
//! `idle-timeout`, KiCI's shutdown reasons) and exits 0. This agent is ephemeral by
//! design, so it arms them whether or not it is scaler-managed.
//!
//! A lost connection kills the running job's process group at once (the
//! gateway fails a job whose agent disconnects), then reconnects with
//! [`crate::backoff`]; the windows wait until the agent is registered
//! again. Close codes 4010, 4005, 4003 and `auth.failure` are final (exit
//! 3); 1000 from the gateway means "leave" (exit 0).

use crate::backoff::Backoff;
use crate::exit::{AgentExit, DoneReason};
use crate::job::{JobEvent, RunningJob};
use crate::{host, Flags};
use futures_util::{SinkExt, StreamExt};
use kici_protocol::bootstrap::Bootstrap;
use kici_protocol::{
    AgentMessage, AuthRequest, CloseCode, ConfigAck, GatewayMessage, Heartbeat, JobAck,
    JobDispatch, JobProgress, JobReject, JobStatus, OutputChunk, Register, RegisterAck,
    RejectReason, UnixMillis, MAX_FRAME_BYTES, PROTOCOL_VERSION,
};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// TCP connect + WebSocket upgrade.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Each handshake reply (`auth.success`, `register.ack`); the gateway's own
/// deadlines are 5 s and 10 s.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);
/// Waiting for the gateway to answer our close frame.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How one connection ended.
enum Outcome {
    Exit(AgentExit),
    /// Retry: the connection failed or dropped for a reason that may pass.
    Reconnect(String),
}

/// Runs the agent until it has a reason to exit.
pub async fn run(
    bootstrap: Bootstrap,
    flags: Flags,
    base_env: BTreeMap<String, String>,
) -> AgentExit {
    let mut agent = Agent {
        host_labels: bootstrap.register_labels(&host::facts()),
        bootstrap,
        flags,
        base_env,
        backoff: None,
    };
    agent.backoff = Some(Backoff::new(agent.bootstrap.max_reconnect_delay));
    let mut terminate = match Terminate::install() {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, "cannot install signal handlers");
            return AgentExit::Internal;
        }
    };
    tracing::info!(
        agent_id = %agent.bootstrap.agent_id,
        url = %agent.bootstrap.orchestrator_url,
        labels = %agent.host_labels,
        "agent starting"
    );
    loop {
        let outcome = tokio::select! {
            o = agent.connection() => o,
            () = terminate.recv() => Outcome::Exit(AgentExit::Done(DoneReason::Signal)),
        };
        let reason = match outcome {
            Outcome::Exit(exit) => return exit,
            Outcome::Reconnect(reason) => reason,
        };
        let Some(backoff) = agent.backoff.as_mut() else {
            return AgentExit::Internal;
        };
        let Some(delay) = backoff.next_delay() else {
            tracing::error!(
                reason = %reason,
                attempts = backoff.failed_attempts(),
                "giving up reconnecting"
            );
            return AgentExit::GaveUp;
        };
        tracing::warn!(
            reason = %reason,
            attempt = backoff.failed_attempts(),
            delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "connection lost; reconnecting"
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = terminate.recv() => return AgentExit::Done(DoneReason::Signal),
        }
    }
}

/// SIGTERM / SIGINT.
struct Terminate {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Terminate {
    fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

struct Agent {
    bootstrap: Bootstrap,
    flags: Flags,
    base_env: BTreeMap<String, String>,
    host_labels: kici_model::LabelSet,
    backoff: Option<Backoff>,
}

/// What the serve loop is waiting for while no job runs.
#[derive(Clone, Copy)]
enum Window {
    PendingDispatch(Instant),
    Idle(Instant),
}

impl Window {
    fn deadline(self) -> Instant {
        match self {
            Self::PendingDispatch(d) | Self::Idle(d) => d,
        }
    }

    fn reason(self) -> DoneReason {
        match self {
            Self::PendingDispatch(_) => DoneReason::PendingDispatchTimeout,
            Self::Idle(_) => DoneReason::IdleTimeout,
        }
    }
}

/// A job and the sequence number of its next output chunk.
struct Current {
    job: RunningJob,
    seq: u64,
}

impl Agent {
    async fn connection(&mut self) -> Outcome {
        let mut config = WebSocketConfig::default();
        config.max_message_size = Some(MAX_FRAME_BYTES);
        config.max_frame_size = Some(MAX_FRAME_BYTES);
        let url = self.bootstrap.orchestrator_url.as_str().to_owned();
        let connect = tokio_tungstenite::connect_async_with_config(url, Some(config), false);
        let mut ws = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok((ws, _response))) => ws,
            Ok(Err(e)) => return Outcome::Reconnect(format!("connect: {e}")),
            Err(_) => return Outcome::Reconnect("connect: timed out".into()),
        };
        tracing::debug!("connected");
        let ack = match self.handshake(&mut ws).await {
            Ok(ack) => ack,
            Err(outcome) => return outcome,
        };
        if let Some(b) = self.backoff.as_mut() {
            b.reset();
        }
        tracing::info!(
            scaler_managed = ack.scaler_managed,
            pending_dispatch = ack.pending_dispatch,
            "registered"
        );
        if ack.scaler_managed || self.bootstrap.scaler_managed {
            let msg = AgentMessage::ConfigAck(ConfigAck {
                message_id: ConfigAck::message_id_for(self.bootstrap.agent_id, UnixMillis::now()),
                agent_id: self.bootstrap.agent_id,
            });
            if let Err(e) = send(&mut ws, &msg).await {
                return Outcome::Reconnect(format!("send config.ack: {e}"));
            }
        }
        let now = Instant::now();
        let window = if ack.pending_dispatch {
            Window::PendingDispatch(now + self.bootstrap.pending_dispatch_timeout)
        } else {
            Window::Idle(now + self.bootstrap.idle_timeout)
        };
        self.serve(ws, window).await
    }

    /// Auth (with a token) and registration; `Err` is how the connection
    /// ends instead.
    async fn handshake(&self, ws: &mut Ws) -> Result<RegisterAck, Outcome> {
        if let Some(token) = &self.bootstrap.token {
            let msg = AgentMessage::AuthRequest(AuthRequest {
                token: token.clone(),
                protocol_version: PROTOCOL_VERSION,
            });
            send(ws, &msg)
                .await
                .map_err(|e| Outcome::Reconnect(format!("send auth.request: {e}")))?;
            match next_message(ws, "auth.success").await? {
                GatewayMessage::AuthSuccess(s) => {
                    tracing::debug!(connection_id = %s.connection_id, "authenticated");
                }
                GatewayMessage::AuthFailure(f) => {
                    tracing::error!(reason = %f.reason, "authentication refused; not retrying");
                    return Err(Outcome::Exit(AgentExit::Rejected));
                }
                other => return Err(protocol_violation(ws, "auth.success", &other).await),
            }
        }
        let now = UnixMillis::now();
        let facts = host::facts();
        let mut register = Register::new(
            Register::message_id_for(self.bootstrap.agent_id, now),
            self.bootstrap.agent_id,
            self.host_labels.clone(),
        );
        register.platform = Some(facts.platform().to_owned());
        register.arch = Some(facts.node_arch().to_owned());
        register.version = Some(format!("kici-agent-lite/{}", env!("CARGO_PKG_VERSION")));
        register.hostname = facts.hostname.clone();
        register.os_release = host::os_release();
        register.cpu_count = host::cpu_count();
        register.running_as_uid = Some(host::uid());
        send(ws, &AgentMessage::Register(Box::new(register)))
            .await
            .map_err(|e| Outcome::Reconnect(format!("send agent.register: {e}")))?;
        match next_message(ws, "register.ack").await? {
            GatewayMessage::RegisterAck(ack) => Ok(ack),
            GatewayMessage::AuthFailure(f) => {
                tracing::error!(reason = %f.reason, "registration refused; not retrying");
                Err(Outcome::Exit(AgentExit::Rejected))
            }
            other => Err(protocol_violation(ws, "register.ack", &other).await),
        }
    }

    async fn serve(&mut self, mut ws: Ws, first_window: Window) -> Outcome {
        let mut window = Some(first_window);
        let mut current: Option<Current> = None;
        let period = self.flags.heartbeat_interval;
        let mut heartbeat = tokio::time::interval_at(Instant::now() + period, period);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        let outcome = loop {
            let deadline = window.map(Window::deadline);
            tokio::select! {
                frame = ws.next() => {
                    match self.on_frame(&mut ws, frame, &mut current, &mut window).await {
                        Ok(()) => {}
                        Err(outcome) => break outcome,
                    }
                }
                event = next_event(&mut current) => {
                    if let Err(e) = self.on_job_event(&mut ws, event, &mut current, &mut window).await {
                        break Outcome::Reconnect(format!("send: {e}"));
                    }
                }
                _ = heartbeat.tick() => {
                    let msg = AgentMessage::Heartbeat(Heartbeat { timestamp: UnixMillis::now() });
                    if let Err(e) = send(&mut ws, &msg).await {
                        break Outcome::Reconnect(format!("send heartbeat: {e}"));
                    }
                }
                () = sleep_until(deadline) => {
                    let reason = window.map_or(DoneReason::IdleTimeout, Window::reason);
                    let exit = AgentExit::Done(reason);
                    tracing::info!(reason = %exit, "no job to run; leaving");
                    close(&mut ws, CloseCode::Normal, &exit.to_string()).await;
                    break Outcome::Exit(exit);
                }
            }
        };
        if let Some(c) = current.take() {
            tracing::warn!(job_id = %c.job.job_id, "connection ended while the job ran; killing its process group");
            c.job.kill_now();
        }
        outcome
    }

    async fn on_frame(
        &mut self,
        ws: &mut Ws,
        frame: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
        current: &mut Option<Current>,
        window: &mut Option<Window>,
    ) -> Result<(), Outcome> {
        let text = match frame {
            None => return Err(Outcome::Reconnect("connection closed".into())),
            Some(Err(e)) => return Err(Outcome::Reconnect(format!("receive: {e}"))),
            Some(Ok(Message::Close(frame))) => return Err(closed_by_gateway(frame.as_ref())),
            Some(Ok(Message::Text(text))) => text,
            // Pings are answered by the WebSocket layer.
            Some(Ok(_)) => return Ok(()),
        };
        let msg = match GatewayMessage::from_json(text.as_str()) {
            Ok(msg) => msg,
            Err(_) if is_unknown_type(text.as_str()) => return Ok(()),
            Err(e) => {
                tracing::error!(error = %e, "unreadable message from the gateway");
                close(ws, CloseCode::InvalidMessage, "invalid message").await;
                return Err(Outcome::Exit(AgentExit::Rejected));
            }
        };
        match msg {
            GatewayMessage::JobDispatch(dispatch) => {
                self.on_dispatch(ws, dispatch, current, window).await
            }
            GatewayMessage::JobCancel(cancel) => {
                match current {
                    Some(c) if c.job.job_id == cancel.job_id => {
                        tracing::info!(job_id = %cancel.job_id, reason = %cancel.reason, "cancelling the job");
                        c.job.cancel();
                    }
                    _ => {
                        tracing::debug!(job_id = %cancel.job_id, "cancel for a job not running here; ignored")
                    }
                }
                Ok(())
            }
            GatewayMessage::AuthFailure(f) => {
                tracing::error!(reason = %f.reason, "the gateway revoked this agent's authentication");
                Err(Outcome::Exit(AgentExit::Rejected))
            }
            other @ (GatewayMessage::AuthSuccess(_)
            | GatewayMessage::RegisterAck(_)
            | GatewayMessage::ClaimCredentialsResponse(_)) => {
                tracing::warn!(
                    r#type = other.type_name(),
                    "unexpected message after registration; ignored"
                );
                Ok(())
            }
        }
    }

    async fn on_dispatch(
        &mut self,
        ws: &mut Ws,
        dispatch: JobDispatch,
        current: &mut Option<Current>,
        window: &mut Option<Window>,
    ) -> Result<(), Outcome> {
        let job_id = dispatch.job.job_id().clone();
        let send_err = |e: String| Outcome::Reconnect(format!("send: {e}"));
        if current.is_some() {
            tracing::warn!(job_id = %job_id, "dispatch while busy; rejecting");
            let msg = AgentMessage::JobReject(JobReject {
                message_id: format!("job-reject-{job_id}-{}", UnixMillis::now().0),
                job_id,
                reason: RejectReason::Busy,
                timestamp: UnixMillis::now(),
            });
            return send(ws, &msg).await.map_err(send_err);
        }
        let ack = AgentMessage::JobAck(JobAck {
            message_id: format!("job-ack-{job_id}-{}", UnixMillis::now().0),
            job_id: job_id.clone(),
            timestamp: UnixMillis::now(),
        });
        send(ws, &ack).await.map_err(send_err)?;
        match RunningJob::start(&dispatch.job, &self.base_env, self.bootstrap.backpressure) {
            Ok(job) => {
                tracing::info!(job_id = %job_id, argv0 = %dispatch.job.argv()[0], "job started");
                *window = None;
                *current = Some(Current { job, seq: 0 });
                send(ws, &status(&job_id, JobProgress::Running))
                    .await
                    .map_err(send_err)
            }
            Err(error) => {
                tracing::warn!(job_id = %job_id, error = %error, "job could not start");
                *window = Some(Window::Idle(Instant::now() + self.bootstrap.idle_timeout));
                let end = kici_protocol::JobEnd::SpawnFailed { error };
                send(ws, &status(&job_id, JobProgress::Finished(end)))
                    .await
                    .map_err(send_err)
            }
        }
    }

    async fn on_job_event(
        &mut self,
        ws: &mut Ws,
        event: JobEvent,
        current: &mut Option<Current>,
        window: &mut Option<Window>,
    ) -> Result<(), String> {
        let Some(c) = current.as_mut() else {
            return Ok(());
        };
        match event {
            JobEvent::Output(stream, data) => {
                let msg = AgentMessage::OutputChunk(OutputChunk {
                    job_id: c.job.job_id.clone(),
                    seq: c.seq,
                    stream,
                    data,
                });
                c.seq += 1;
                send(ws, &msg).await
            }
            JobEvent::Ended(end) => {
                let job_id = c.job.job_id.clone();
                tracing::info!(job_id = %job_id, end = ?end, "job ended");
                if let Some(c) = current.take() {
                    c.job.finished();
                }
                *window = Some(Window::Idle(Instant::now() + self.bootstrap.idle_timeout));
                send(ws, &status(&job_id, JobProgress::Finished(end))).await
            }
        }
    }
}

fn status(job_id: &kici_model::JobId, progress: JobProgress) -> AgentMessage {
    let now = UnixMillis::now();
    AgentMessage::JobStatus(JobStatus {
        message_id: format!("job-status-{job_id}-{}", now.0),
        job_id: job_id.clone(),
        timestamp: now,
        progress,
    })
}

/// The next event of the running job; never resolves without one.
async fn next_event(current: &mut Option<Current>) -> JobEvent {
    match current {
        Some(c) => match c.job.events.recv().await {
            Some(e) => e,
            // The supervisor always ends with `Ended`; a closed channel
            // without it means it was aborted, which only `kill_now` does.
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn send(ws: &mut Ws, msg: &AgentMessage) -> Result<(), String> {
    ws.send(Message::text(msg.to_json()))
        .await
        .map_err(|e| e.to_string())
}

/// The next protocol message during the handshake.
async fn next_message(ws: &mut Ws, awaiting: &str) -> Result<GatewayMessage, Outcome> {
    let wait = async {
        loop {
            match ws.next().await {
                None => return Err(Outcome::Reconnect(format!("closed while awaiting {awaiting}"))),
                Some(Err(e)) => return Err(Outcome::Reconnect(format!("receive: {e}"))),
                Some(Ok(Message::Close(frame))) => return Err(closed_by_gateway(frame.as_ref())),
                Some(Ok(Message::Text(text))) if is_unknown_type(text.as_str()) => continue,
                Some(Ok(Message::Text(text))) => {
                    return GatewayMessage::from_json(text.as_str()).map_err(|e| {
                        tracing::error!(error = %e, awaiting, "unreadable message from the gateway");
                        Outcome::Exit(AgentExit::Rejected)
                    })
                }
                Some(Ok(_)) => continue,
            }
        }
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, wait).await {
        Ok(r) => r,
        Err(_) => Err(Outcome::Reconnect(format!("no {awaiting} in time"))),
    }
}

/// A message of a type this agent does not know (KiCI's gateway also sends
/// `rate.limit.warning` and `error`; a newer gateway may send more): read
/// past, logged, never a reason to leave. A known type that does not parse
/// is still a protocol violation.
fn is_unknown_type(text: &str) -> bool {
    match kici_protocol::message_type(text) {
        Some(t) if !GatewayMessage::TYPES.contains(&t.as_str()) => {
            tracing::debug!(message_type = %t, "ignoring a message this agent does not know");
            true
        }
        _ => false,
    }
}

async fn protocol_violation(ws: &mut Ws, awaiting: &str, got: &GatewayMessage) -> Outcome {
    tracing::error!(
        awaiting,
        got = got.type_name(),
        "unexpected message during the handshake"
    );
    close(ws, CloseCode::InvalidMessage, "unexpected message").await;
    Outcome::Exit(AgentExit::Rejected)
}

/// How a close from the gateway ends this connection.
fn closed_by_gateway(frame: Option<&CloseFrame>) -> Outcome {
    let code = frame.map(|f| u16::from(f.code));
    let reason = frame.map(|f| f.reason.as_str()).unwrap_or("");
    match code.and_then(CloseCode::from_code) {
        Some(CloseCode::Normal) => {
            tracing::info!(reason, "the gateway closed the connection; leaving");
            Outcome::Exit(AgentExit::Done(DoneReason::ClosedByGateway))
        }
        Some(c) if c.is_permanent() => {
            tracing::error!(code = %c, reason, "the gateway rejected this agent; not retrying");
            Outcome::Exit(AgentExit::Rejected)
        }
        Some(c) => Outcome::Reconnect(format!("closed by the gateway: {c} {reason}")),
        None => Outcome::Reconnect(format!(
            "closed by the gateway: {} {reason}",
            code.map_or_else(|| "no code".to_owned(), |c| c.to_string())
        )),
    }
}

/// Sends a close frame and waits briefly for the gateway's answer, so the
/// close is seen before the process exits.
async fn close(ws: &mut Ws, code: CloseCode, reason: &str) {
    let frame = CloseFrame {
        code: WsCloseCode::from(code.code()),
        reason: reason.to_owned().into(),
    };
    if ws.close(Some(frame)).await.is_err() {
        return;
    }
    let drain = async { while let Some(Ok(_)) = ws.next().await {} };
    let _ = tokio::time::timeout(CLOSE_LINGER, drain).await;
}
