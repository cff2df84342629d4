//! The real `kici-agent-lite` binary against an in-test gateway (a
//! tokio-tungstenite server on 127.0.0.1:0) that plays kici-scaler's side
//! of the protocol message by message.
//!
//! Every wait is on an event (a message, a close, an EOF, the process
//! exit); [`GUARD`] only turns a hang into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]
// tungstenite's accept callback signature fixes the size of its error type.
#![allow(clippy::result_large_err)]

use futures_util::{FutureExt, SinkExt, StreamExt};
use kici_model::{AgentId, LabelSet};
use kici_protocol::{
    AgentMessage, AuthFailure, AuthSuccess, GatewayMessage, JobCancel, JobDispatch, JobEnd,
    JobProgress, JobResult, JobSpec, OutputStream, RegisterAck, RejectReason, UnixMillis,
};
use std::collections::BTreeMap;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

const TOKEN: &str = "kat_9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0";
const AGENT_ID: &str = "scaler-bare-metal-0a1b2c3d";
/// Turns a hang into a failure; never part of what a test asserts.
const GUARD: Duration = Duration::from_secs(60);

async fn guard<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(GUARD, f)
        .await
        .unwrap_or_else(|_| panic!("hung waiting for {what}"))
}

struct Gateway {
    listener: TcpListener,
}

impl Gateway {
    async fn bind() -> Self {
        Self {
            listener: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        }
    }

    fn url(&self) -> String {
        format!("ws://{}/ws", self.listener.local_addr().unwrap())
    }

    async fn accept(&self) -> Conn {
        let (tcp, _) = guard("a connection", self.listener.accept()).await.unwrap();
        let mut path = String::new();
        let ws = tokio_tungstenite::accept_hdr_async(tcp, |req: &Request, resp: Response| {
            path = req.uri().path().to_owned();
            Ok(resp)
        })
        .await
        .unwrap();
        assert_eq!(path, "/ws");
        Conn { ws }
    }

    /// True when a connection attempt is waiting to be accepted.
    fn has_pending_connection(&self) -> bool {
        self.listener.accept().now_or_never().is_some()
    }
}

#[derive(Debug)]
enum Frame {
    Msg(AgentMessage),
    Closed(Option<u16>, String),
}

struct Conn {
    ws: WebSocketStream<TcpStream>,
}

impl Conn {
    async fn next(&mut self) -> Frame {
        loop {
            match guard("a frame", self.ws.next()).await {
                None | Some(Err(_)) => return Frame::Closed(None, String::new()),
                Some(Ok(Message::Text(t))) => {
                    return Frame::Msg(
                        AgentMessage::from_json(t.as_str())
                            .unwrap_or_else(|e| panic!("agent sent {t}: {e}")),
                    )
                }
                Some(Ok(Message::Close(f))) => {
                    return Frame::Closed(
                        f.as_ref().map(|f| u16::from(f.code)),
                        f.map(|f| f.reason.to_string()).unwrap_or_default(),
                    )
                }
                Some(Ok(_)) => continue,
            }
        }
    }

    /// The next message that is not a heartbeat.
    async fn recv(&mut self) -> AgentMessage {
        loop {
            match self.next().await {
                Frame::Msg(AgentMessage::Heartbeat(_)) => continue,
                Frame::Msg(m) => return m,
                Frame::Closed(code, reason) => {
                    panic!("connection closed ({code:?} {reason}) while a message was expected")
                }
            }
        }
    }

    async fn expect_close(&mut self) -> (Option<u16>, String) {
        loop {
            match self.next().await {
                Frame::Msg(AgentMessage::Heartbeat(_)) => continue,
                Frame::Msg(m) => panic!("expected a close, got {m:?}"),
                Frame::Closed(code, reason) => return (code, reason),
            }
        }
    }

    async fn send(&mut self, msg: GatewayMessage) {
        self.ws.send(Message::text(msg.to_json())).await.unwrap();
    }

    /// Any JSON text, as a gateway newer than this agent might send it.
    async fn send_raw(&mut self, v: serde_json::Value) {
        self.ws.send(Message::text(v.to_string())).await.unwrap();
    }

    async fn close(&mut self, code: u16, reason: &str) {
        let frame = CloseFrame {
            code: WsCloseCode::from(code),
            reason: reason.to_owned().into(),
        };
        // The agent may already be gone; the close is best effort.
        let _ = self.ws.close(Some(frame)).await;
    }

    /// auth (when the agent has a token) + register + register.ack +
    /// config.ack; returns the registered labels.
    async fn handshake(&mut self, with_token: bool, pending_dispatch: bool) -> LabelSet {
        if with_token {
            match self.recv().await {
                AgentMessage::AuthRequest(a) => {
                    assert_eq!(a.token.expose(), TOKEN);
                    assert_eq!(a.protocol_version, 1);
                }
                other => panic!("expected auth.request, got {other:?}"),
            }
            self.send(GatewayMessage::AuthSuccess(AuthSuccess {
                connection_id: "conn-1".into(),
            }))
            .await;
        }
        let register = match self.recv().await {
            AgentMessage::Register(r) => r,
            other => panic!("expected agent.register, got {other:?}"),
        };
        assert_eq!(register.agent_id.to_string(), AGENT_ID);
        assert!(register
            .message_id
            .starts_with(&format!("register-{AGENT_ID}-")));
        self.send(GatewayMessage::RegisterAck(RegisterAck {
            agent_id: register.agent_id,
            labels: register.labels.clone(),
            scaler_managed: true,
            capabilities: RegisterAck::capabilities(),
            pending_dispatch,
            warm_pool: !pending_dispatch,
        }))
        .await;
        match self.recv().await {
            AgentMessage::ConfigAck(c) => assert_eq!(c.agent_id.to_string(), AGENT_ID),
            other => panic!("expected config.ack, got {other:?}"),
        }
        register.labels
    }

    async fn dispatch(&mut self, job_id: &str, argv: &[&str], timeout: Option<u64>) {
        self.dispatch_env(job_id, argv, BTreeMap::new(), timeout)
            .await
    }

    async fn dispatch_env(
        &mut self,
        job_id: &str,
        argv: &[&str],
        env: BTreeMap<String, String>,
        timeout: Option<u64>,
    ) {
        let spec = JobSpec::new(
            job_id.parse().unwrap(),
            argv.iter().map(|s| s.to_string()).collect(),
            env,
            timeout,
        )
        .unwrap();
        self.send(GatewayMessage::JobDispatch(JobDispatch {
            message_id: format!("dispatch-{job_id}"),
            job: spec,
            timestamp: UnixMillis::now(),
        }))
        .await;
    }

    /// `job.ack` then `job.status running`.
    async fn expect_started(&mut self, job_id: &str) {
        match self.recv().await {
            AgentMessage::JobAck(a) => assert_eq!(a.job_id.as_str(), job_id),
            other => panic!("expected job.ack, got {other:?}"),
        }
        match self.recv().await {
            AgentMessage::JobStatus(s) => {
                assert_eq!(s.job_id.as_str(), job_id);
                assert_eq!(s.progress, JobProgress::Running);
            }
            other => panic!("expected job.status running, got {other:?}"),
        }
    }

    /// Collects output until the terminal `job.status`.
    async fn run_to_end(&mut self, job_id: &str) -> (Output, JobEnd) {
        let mut out = Output::default();
        loop {
            match self.recv().await {
                AgentMessage::OutputChunk(c) => {
                    assert_eq!(c.job_id.as_str(), job_id);
                    assert_eq!(c.seq, out.chunks, "chunks numbered in order from 0");
                    out.chunks += 1;
                    match c.stream {
                        OutputStream::Stdout => out.stdout.extend(c.data.as_bytes()),
                        OutputStream::Stderr => out.stderr.extend(c.data.as_bytes()),
                    }
                }
                AgentMessage::JobStatus(s) => {
                    assert_eq!(s.job_id.as_str(), job_id);
                    match s.progress {
                        JobProgress::Finished(end) => return (out, end),
                        JobProgress::Running => panic!("second running status"),
                    }
                }
                other => panic!("expected output or job.status, got {other:?}"),
            }
        }
    }
}

#[derive(Default, Debug)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    chunks: u64,
}

/// Starts the agent binary with exactly `vars` (plus `PATH`).
fn agent(vars: &[(&str, &str)], args: &[&str]) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kici-agent-lite"));
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd.spawn().unwrap()
}

fn bootstrap<'a>(url: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut v = vec![
        ("KICI_ORCHESTRATOR_URL", url),
        ("KICI_AGENT_ID", AGENT_ID),
        ("KICI_AGENT_TOKEN", TOKEN),
        (
            "KICI_LABELS",
            "linux,kici:agent:bare-metal,kici:scaler:test",
        ),
        ("KICI_SCALER_MANAGED", "1"),
        ("KICI_AGENT_MAX_RECONNECT_DELAY_MS", "20"),
    ];
    v.extend_from_slice(extra);
    v
}

struct Exited {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

async fn exited(child: Child) -> Exited {
    let out = guard("the agent to exit", child.wait_with_output())
        .await
        .unwrap();
    let ex = Exited {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    // Logs are JSON lines on stderr; stdout is empty; the token never shows.
    for line in ex.stderr.lines() {
        serde_json::from_str::<serde_json::Value>(line)
            .unwrap_or_else(|e| panic!("stderr line is not JSON ({e}): {line}"));
    }
    assert_eq!(ex.stdout, "");
    assert!(
        !ex.stderr.contains(&TOKEN[4..]),
        "token in the log:\n{}",
        ex.stderr
    );
    ex
}

fn log_has(stderr: &str, field: &str, value: &str) -> bool {
    stderr.lines().any(|l| {
        serde_json::from_str::<serde_json::Value>(l)
            .ok()
            .and_then(|v| v.get(field).and_then(|f| f.as_str().map(str::to_owned)))
            .is_some_and(|v| v.contains(value))
    })
}

#[tokio::test]
async fn handshake_then_a_job_streams_output_and_reports_exit_3() {
    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(&bootstrap(&url, &[("KICI_SCALER_IDLE_TIMEOUT", "0")]), &[]);
    let mut conn = gw.accept().await;
    let labels = conn.handshake(true, true).await;
    let key = labels.key();
    for want in [
        "linux",
        "kici:agent:bare-metal",
        "kici:scaler:test",
        "kici:os:linux",
        "kici:arch:",
        "kici:host:",
        "kici:role:builder",
        "kici:role:init-runner",
    ] {
        assert!(key.contains(want), "{want} missing from {key}");
    }

    conn.dispatch(
        "job-1",
        &["sh", "-c", "echo hi; echo err >&2; exit 3"],
        None,
    )
    .await;
    conn.expect_started("job-1").await;
    let (out, end) = conn.run_to_end("job-1").await;
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(end, JobEnd::Completed(JobResult::exited(3)));

    // KICI_SCALER_IDLE_TIMEOUT=0: the agent leaves right after the job.
    let (code, reason) = conn.expect_close().await;
    assert_eq!(code, Some(1000));
    assert_eq!(reason, "idle-timeout");
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
    assert!(log_has(&ex.stderr, "message", "registered"));
}

#[tokio::test]
async fn job_ends_signal_timeout_cancel_spawn_failure_and_busy() {
    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(
        &bootstrap(&url, &[("KICI_SCALER_IDLE_TIMEOUT", "600000")]),
        &[],
    );
    let mut conn = gw.accept().await;
    conn.handshake(true, true).await;

    // Killed by a signal.
    conn.dispatch("sig", &["sh", "-c", "kill -TERM $$"], None)
        .await;
    conn.expect_started("sig").await;
    let (_, end) = conn.run_to_end("sig").await;
    assert_eq!(end, JobEnd::Completed(JobResult::signalled(15).unwrap()));

    // Timed out: SIGTERM to the group.
    conn.dispatch("slow", &["sleep", "600"], Some(1)).await;
    conn.expect_started("slow").await;
    let (_, end) = conn.run_to_end("slow").await;
    assert_eq!(end, JobEnd::TimedOut(JobResult::signalled(15).unwrap()));

    // Cancelled, and a dispatch while busy is rejected.
    conn.dispatch("long", &["sh", "-c", "echo up; exec sleep 600"], None)
        .await;
    conn.expect_started("long").await;
    match conn.recv().await {
        AgentMessage::OutputChunk(c) => assert_eq!(c.data.as_bytes(), b"up\n"),
        other => panic!("expected output, got {other:?}"),
    }
    conn.dispatch("second", &["true"], None).await;
    match conn.recv().await {
        AgentMessage::JobReject(r) => {
            assert_eq!(r.job_id.as_str(), "second");
            assert_eq!(r.reason, RejectReason::Busy);
        }
        other => panic!("expected job.reject, got {other:?}"),
    }
    conn.send(GatewayMessage::JobCancel(JobCancel {
        job_id: "long".parse().unwrap(),
        reason: "test".into(),
    }))
    .await;
    let (_, end) = conn.run_to_end("long").await;
    assert_eq!(end, JobEnd::Cancelled(JobResult::signalled(15).unwrap()));

    // A program that does not exist.
    conn.dispatch("missing", &["/nonexistent/kici-test-program"], None)
        .await;
    match conn.recv().await {
        AgentMessage::JobAck(a) => assert_eq!(a.job_id.as_str(), "missing"),
        other => panic!("expected job.ack, got {other:?}"),
    }
    match conn.recv().await {
        AgentMessage::JobStatus(s) => match s.progress {
            JobProgress::Finished(JobEnd::SpawnFailed { error }) => {
                assert!(error.contains("/nonexistent/kici-test-program"), "{error}")
            }
            other => panic!("expected a spawn failure, got {other:?}"),
        },
        other => panic!("expected job.status, got {other:?}"),
    }

    // The job's environment: the base env plus its own, never the agent's.
    let env = BTreeMap::from([("JOB_VAR".to_string(), "from-job".to_string())]);
    conn.dispatch_env("env", &["sh", "-c", "env | sort"], env, None)
        .await;
    conn.expect_started("env").await;
    let (out, end) = conn.run_to_end("env").await;
    assert!(end.is_success());
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(printed.contains("JOB_VAR=from-job"), "{printed}");
    assert!(printed.contains("PATH="), "{printed}");
    assert!(!printed.contains("KICI_"), "{printed}");

    // The gateway dismisses the agent: exit 0, no reconnect.
    conn.close(1000, "done").await;
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
    assert!(!gw.has_pending_connection());
}

#[tokio::test]
async fn unknown_fields_and_message_types_from_a_newer_gateway_are_read_past() {
    use serde_json::json;
    let gw = Gateway::bind().await;
    let url = gw.url();
    // The KiCI agent's 0.9 variables are accepted like the rest of its list.
    let child = agent(
        &bootstrap(
            &url,
            &[
                ("KICI_SCALER_IDLE_TIMEOUT", "0"),
                ("KICI_RUNTIME_IMAGE", "registry.local/kici-runtime:1"),
                ("KICI_JOB_IMAGE_AGENT", "1"),
            ],
        ),
        &[],
    );
    let mut conn = gw.accept().await;
    assert!(matches!(conn.recv().await, AgentMessage::AuthRequest(_)));
    conn.send_raw(json!({"type":"auth.success","connectionId":"c1","region":"eu"}))
        .await;
    let register = match conn.recv().await {
        AgentMessage::Register(r) => r,
        other => panic!("expected agent.register, got {other:?}"),
    };
    // KiCI's gateway warns a fast sender; this agent does not know it.
    conn.send_raw(json!({"type":"rate.limit.warning","retryAfterMs":10}))
        .await;
    conn.send_raw(json!({
        "type":"register.ack","agentId":AGENT_ID,"labels":register.labels,
        "scalerManaged":true,"capabilities":{"artifactCompleteAck":true},
        "pendingDispatch":true,"futureField":{"nested":[1,2]}
    }))
    .await;
    match conn.recv().await {
        AgentMessage::ConfigAck(c) => assert_eq!(c.agent_id.to_string(), AGENT_ID),
        other => panic!("expected config.ack, got {other:?}"),
    }
    conn.send_raw(json!({"type":"error","code":"INVALID_MESSAGE","message":"x"}))
        .await;
    conn.send_raw(json!({
        "type":"job.dispatch","messageId":"d1","timestamp":1,"priority":3,
        "job":{"jobId":"job-1","argv":["sh","-c","echo fwd"],"cwd":"/ignored"}
    }))
    .await;
    conn.expect_started("job-1").await;
    let (out, end) = conn.run_to_end("job-1").await;
    assert_eq!(out.stdout, b"fwd\n");
    assert_eq!(end, JobEnd::Completed(JobResult::exited(0)));
    let (code, reason) = conn.expect_close().await;
    assert_eq!((code, reason.as_str()), (Some(1000), "idle-timeout"));
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
}

#[tokio::test]
async fn unknown_kici_variable_exits_before_connecting() {
    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(&bootstrap(&url, &[("KICI_NOT_IN_CONTRACT", "1")]), &[]);
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(2), "{}", ex.stderr);
    assert!(
        log_has(&ex.stderr, "error", "KICI_NOT_IN_CONTRACT"),
        "{}",
        ex.stderr
    );
    assert!(!gw.has_pending_connection(), "the agent connected anyway");
}

#[tokio::test]
async fn wss_is_refused_before_connecting() {
    let child = agent(&bootstrap("wss://127.0.0.1:1/ws", &[]), &[]);
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(2), "{}", ex.stderr);
    assert!(log_has(&ex.stderr, "message", "wss:// is not supported"));
}

#[tokio::test]
async fn a_refused_token_ends_the_agent_without_retrying() {
    // auth.failure then 4010, as the gateway answers a bad token.
    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(&bootstrap(&url, &[]), &[]);
    let mut conn = gw.accept().await;
    assert!(matches!(conn.recv().await, AgentMessage::AuthRequest(_)));
    conn.send(GatewayMessage::AuthFailure(AuthFailure {
        reason: "Invalid or expired token".into(),
    }))
    .await;
    conn.close(4010, "Agent auth failed").await;
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(3), "{}", ex.stderr);
    assert!(!gw.has_pending_connection(), "the agent retried");

    // A bare 4010 (a registration the token does not authorise) is as final.
    let child = agent(&bootstrap(&url, &[]), &[]);
    let mut conn = gw.accept().await;
    assert!(matches!(conn.recv().await, AgentMessage::AuthRequest(_)));
    conn.send(GatewayMessage::AuthSuccess(AuthSuccess {
        connection_id: "c".into(),
    }))
    .await;
    assert!(matches!(conn.recv().await, AgentMessage::Register(_)));
    conn.close(4010, "labels outside the token's scope").await;
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(3), "{}", ex.stderr);
    assert!(!gw.has_pending_connection(), "the agent retried");
}

#[tokio::test]
async fn reconnects_after_the_gateway_restarts_before_registration() {
    let gw = Gateway::bind().await;
    let addr = gw.listener.local_addr().unwrap();
    let url = gw.url();
    let child = agent(&bootstrap(&url, &[("KICI_SCALER_IDLE_TIMEOUT", "0")]), &[]);
    let mut conn = gw.accept().await;
    assert!(matches!(conn.recv().await, AgentMessage::AuthRequest(_)));
    // The gateway dies: connection and listener gone, no close frame.
    drop(conn);
    drop(gw);
    let gw = Gateway {
        listener: TcpListener::bind(addr).await.unwrap(),
    };
    let mut conn = gw.accept().await;
    conn.handshake(true, true).await;
    conn.dispatch("after-restart", &["true"], None).await;
    conn.expect_started("after-restart").await;
    let (_, end) = conn.run_to_end("after-restart").await;
    assert_eq!(end, JobEnd::Completed(JobResult::exited(0)));
    assert_eq!(conn.expect_close().await.0, Some(1000));
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
    assert!(
        log_has(&ex.stderr, "message", "reconnecting"),
        "{}",
        ex.stderr
    );
}

#[tokio::test]
async fn gives_up_when_the_gateway_never_answers() {
    // Bind then close a port, so every attempt is refused.
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let url = format!("ws://{addr}/ws");
    let child = agent(&bootstrap(&url, &[]), &[]);
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(4), "{}", ex.stderr);
    assert!(log_has(&ex.stderr, "message", "giving up"), "{}", ex.stderr);
}

#[tokio::test]
async fn a_broken_stderr_does_not_kill_the_agent() {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let url = format!("ws://{addr}/ws");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kici-agent-lite"));
    cmd.env_clear()
        .envs(bootstrap(&url, &[]))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // Every log write fails (ENOSPC), as when the log reader is gone.
        .stderr(std::fs::File::create("/dev/full").unwrap())
        .kill_on_drop(true);
    let status = guard("the agent to exit", cmd.status()).await.unwrap();
    // It still ran its course (gave up reconnecting) instead of panicking.
    assert_eq!(status.code(), Some(4));
}

#[tokio::test]
async fn pending_dispatch_window_passes_and_the_agent_leaves() {
    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(
        &bootstrap(&url, &[("KICI_SCALER_PENDING_DISPATCH_TIMEOUT", "50")]),
        &[],
    );
    let mut conn = gw.accept().await;
    conn.handshake(true, true).await;
    let (code, reason) = conn.expect_close().await;
    assert_eq!(code, Some(1000));
    assert_eq!(reason, "scaler-pending-dispatch-timeout");
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
}

#[tokio::test]
async fn without_a_bound_job_the_idle_window_applies() {
    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(
        &bootstrap(
            &url,
            &[
                ("KICI_SCALER_IDLE_TIMEOUT", "50"),
                ("KICI_SCALER_PENDING_DISPATCH_TIMEOUT", "600000"),
            ],
        ),
        &[],
    );
    let mut conn = gw.accept().await;
    conn.handshake(true, false).await;
    let (code, reason) = conn.expect_close().await;
    assert_eq!((code, reason.as_str()), (Some(1000), "idle-timeout"));
    assert_eq!(exited(child).await.status.code(), Some(0));
}

#[tokio::test]
async fn without_a_token_it_registers_directly_and_sends_heartbeats() {
    let gw = Gateway::bind().await;
    let url = gw.url();
    let vars: Vec<(&str, &str)> = bootstrap(&url, &[])
        .into_iter()
        .filter(|(k, _)| *k != "KICI_AGENT_TOKEN")
        .collect();
    let child = agent(&vars, &["--heartbeat-interval-ms", "20"]);
    let mut conn = gw.accept().await;
    conn.handshake(false, true).await;
    for _ in 0..2 {
        match conn.next().await {
            Frame::Msg(AgentMessage::Heartbeat(h)) => assert!(h.timestamp.0 > 0),
            other => panic!("expected a heartbeat, got {other:?}"),
        }
    }
    conn.close(1000, "done").await;
    assert_eq!(exited(child).await.status.code(), Some(0));
}

#[tokio::test]
async fn a_lost_connection_kills_the_running_job_and_the_agent_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("alive");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    // Opened before the job: the job's `exec 3>fifo` then does not block,
    // and EOF here means every process holding it (the job's shell and its
    // background child) is dead.
    let mut alive = tokio::net::unix::pipe::OpenOptions::new()
        .open_receiver(&fifo)
        .unwrap();

    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(&bootstrap(&url, &[]), &[]);
    let mut conn = gw.accept().await;
    conn.handshake(true, true).await;
    let env = BTreeMap::from([("FIFO".to_string(), fifo.display().to_string())]);
    conn.dispatch_env(
        "doomed",
        &[
            "sh",
            "-c",
            "exec 3>\"$FIFO\"; sleep 600 & echo started; wait",
        ],
        env,
        None,
    )
    .await;
    conn.expect_started("doomed").await;
    match conn.recv().await {
        AgentMessage::OutputChunk(c) => assert_eq!(c.data.as_bytes(), b"started\n"),
        other => panic!("expected output, got {other:?}"),
    }
    // The gateway vanishes mid-job.
    drop(conn);
    let mut rest = Vec::new();
    guard("the job's processes to die", alive.read_to_end(&mut rest))
        .await
        .unwrap();

    // It comes back and registers again, then is dismissed.
    let mut conn = gw.accept().await;
    conn.handshake(true, false).await;
    conn.close(1000, "done").await;
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
    assert!(log_has(&ex.stderr, "message", "killing its process group"));
}

#[tokio::test]
async fn sigterm_kills_the_running_job_and_the_agent_exits() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("alive");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let mut alive = tokio::net::unix::pipe::OpenOptions::new()
        .open_receiver(&fifo)
        .unwrap();
    let gw = Gateway::bind().await;
    let url = gw.url();
    let child = agent(&bootstrap(&url, &[]), &[]);
    let mut conn = gw.accept().await;
    conn.handshake(true, true).await;
    let env = BTreeMap::from([("FIFO".to_string(), fifo.display().to_string())]);
    conn.dispatch_env(
        "stopped",
        &[
            "sh",
            "-c",
            "exec 3>\"$FIFO\"; sleep 600 & echo started; wait",
        ],
        env,
        None,
    )
    .await;
    conn.expect_started("stopped").await;
    assert!(matches!(conn.recv().await, AgentMessage::OutputChunk(_)));

    // What a backend's destroy sends to the agent (not to the job's group).
    let pid = rustix::process::Pid::from_raw(i32::try_from(child.id().unwrap()).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let mut rest = Vec::new();
    guard("the job's processes to die", alive.read_to_end(&mut rest))
        .await
        .unwrap();
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
    assert!(log_has(&ex.stderr, "reason", "signal"), "{}", ex.stderr);
}

#[test]
fn agent_id_constant_is_valid() {
    AGENT_ID.parse::<AgentId>().unwrap();
}

/// A loopback claim endpoint: answers `POST /v1/claims` with `answers` in
/// order (the last one repeated) and records each request body.
struct ClaimServer {
    url: String,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
}

impl ClaimServer {
    async fn start(answers: Vec<(u16, serde_json::Value)>) -> Self {
        use http_body_util::BodyExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/claims", listener.local_addr().unwrap());
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = bodies.clone();
        let answers = std::sync::Arc::new(answers);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (seen, answers) = (seen.clone(), answers.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let (seen, answers) = (seen.clone(), answers.clone());
                            async move {
                                assert_eq!(req.method(), hyper::Method::POST);
                                assert_eq!(req.uri().path(), "/v1/claims");
                                let body = req.into_body().collect().await.unwrap().to_bytes();
                                let n = {
                                    let mut s = seen.lock().unwrap();
                                    s.push(serde_json::from_slice(&body).unwrap());
                                    s.len()
                                };
                                let (status, answer) = &answers[(n - 1).min(answers.len() - 1)];
                                Ok::<_, std::convert::Infallible>(
                                    hyper::Response::builder()
                                        .status(*status)
                                        .header("content-type", "application/json")
                                        .body(http_body_util::Full::new(bytes::Bytes::from(
                                            answer.to_string(),
                                        )))
                                        .unwrap(),
                                )
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        Self { url, bodies }
    }

    fn bodies(&self) -> Vec<serde_json::Value> {
        self.bodies.lock().unwrap().clone()
    }
}

const CLAIM_CODE: &str = "kcc_00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn credentials(gateway_url: &str) -> serde_json::Value {
    serde_json::json!({
        "agentToken": TOKEN,
        "agentId": AGENT_ID,
        "gatewayUrl": gateway_url,
        "labels": ["linux", "kici:scaler:cloud"],
    })
}

#[tokio::test]
async fn a_claim_code_is_redeemed_then_the_agent_registers_with_its_credentials() {
    let gw = Gateway::bind().await;
    let claims = ClaimServer::start(vec![(200, credentials(&gw.url()))]).await;
    // Nothing but the claim: everything else comes from redeeming it.
    let child = agent(
        &[("KICI_SCALER_PENDING_DISPATCH_TIMEOUT", "50")],
        &["--claim", CLAIM_CODE, "--claim-url", &claims.url],
    );
    let mut conn = gw.accept().await;
    // Checks the token and the agent id from the claim.
    let labels = conn.handshake(true, true).await;
    assert!(labels.iter().any(|l| l.as_str() == "kici:scaler:cloud"));
    assert!(labels.iter().any(|l| l.as_str() == "linux"));
    let (code, _) = conn.expect_close().await;
    assert_eq!(code, Some(1000));
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
    assert_eq!(
        claims.bodies(),
        [serde_json::json!({"claimCode": CLAIM_CODE})]
    );
    assert!(
        !ex.stderr.contains(&CLAIM_CODE[4..]),
        "claim code in the log"
    );
}

#[tokio::test]
async fn the_claim_can_come_from_the_environment_and_unreachable_is_retried() {
    let gw = Gateway::bind().await;
    // 503 twice (the daemon restarting), then the credentials.
    let claims = ClaimServer::start(vec![
        (
            503,
            serde_json::json!({"error": {"code": "store-unavailable", "message": "later"}}),
        ),
        (
            503,
            serde_json::json!({"error": {"code": "store-unavailable", "message": "later"}}),
        ),
        (200, credentials(&gw.url())),
    ])
    .await;
    let child = agent(
        &[
            ("KICI_CLAIM_CODE", CLAIM_CODE),
            ("KICI_CLAIM_URL", &claims.url),
            ("KICI_SCALER_PENDING_DISPATCH_TIMEOUT", "50"),
        ],
        &[],
    );
    let mut conn = gw.accept().await;
    conn.handshake(true, true).await;
    conn.expect_close().await;
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(0), "{}", ex.stderr);
    assert_eq!(claims.bodies().len(), 3);
}

#[tokio::test]
async fn a_refused_claim_prints_the_servers_reason_and_exits_5() {
    for reason in ["consumed", "expired", "unknown"] {
        let claims = ClaimServer::start(vec![(
            403,
            serde_json::json!({"error": {"code": "claim-refused", "message": "no", "reason": reason}}),
        )])
        .await;
        let child = agent(&[], &["--claim", CLAIM_CODE, "--claim-url", &claims.url]);
        let ex = exited(child).await;
        assert_eq!(ex.status.code(), Some(5), "{}", ex.stderr);
        assert!(log_has(&ex.stderr, "reason", reason), "{}", ex.stderr);
        assert!(
            log_has(&ex.stderr, "message", "claim failed"),
            "{}",
            ex.stderr
        );
        // Refusals are final: one request, no retry.
        assert_eq!(claims.bodies().len(), 1);
    }
}

#[tokio::test]
async fn an_unreachable_claim_url_gives_up_at_its_deadline_with_exit_5() {
    // A port freed on a loopback address no other test listens on: on
    // 127.0.0.1 another test's listener could be given the same port while
    // the agent still POSTs to it.
    let closed = TcpListener::bind("127.0.0.254:0").await.unwrap();
    let url = format!("http://{}/v1/claims", closed.local_addr().unwrap());
    drop(closed);
    let child = agent(
        &[],
        &[
            "--claim",
            CLAIM_CODE,
            "--claim-url",
            &url,
            "--claim-timeout-secs",
            "1",
        ],
    );
    let ex = exited(child).await;
    assert_eq!(ex.status.code(), Some(5), "{}", ex.stderr);
    assert!(ex.stderr.contains("no answer from"), "{}", ex.stderr);
}

#[tokio::test]
async fn half_a_claim_or_an_https_url_is_a_bad_bootstrap() {
    for args in [
        vec!["--claim", CLAIM_CODE],
        vec!["--claim-url", "http://127.0.0.1:9/v1/claims"],
        vec![
            "--claim",
            CLAIM_CODE,
            "--claim-url",
            "https://127.0.0.1:9/v1/claims",
        ],
    ] {
        let ex = exited(agent(&[], &args)).await;
        assert_eq!(ex.status.code(), Some(2), "{args:?}: {}", ex.stderr);
    }
    // The environment form is accepted (not an unknown KICI_* name) and
    // checked the same way.
    let ex = exited(agent(&[("KICI_CLAIM_CODE", CLAIM_CODE)], &[])).await;
    assert_eq!(ex.status.code(), Some(2));
    assert!(ex.stderr.contains("KICI_CLAIM_URL"), "{}", ex.stderr);
}
