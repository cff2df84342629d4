//! The agent gateway in process: the real engine runtime, token store, job
//! book and gateway served on 127.0.0.1:0, an in-memory backend standing in
//! for the agent's process, and the test playing the agent over a real
//! WebSocket (tokio-tungstenite), message by message.
//!
//! Every wait is on an event (a frame, a close, an engine event, a job
//! change); [`GUARD`] only turns a hang into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use futures_util::{SinkExt, StreamExt};
use kici_engine::memory_backend::MemoryBackend;
use kici_engine::runtime::SequencedEvent;
use kici_engine::{AgentState, Backend, EngineEvent, EngineSettings};
use kici_model::{AgentId, JobId, LabelSet, ScalerType};
use kici_protocol::{
    AgentMessage, AuthRequest, ChunkData, ConfigAck, GatewayMessage, Heartbeat, InFlightJob,
    JobAck, JobEnd, JobProgress, JobResult, JobSpec, JobStatus, OutputChunk, OutputStream,
    Register, RegisterAck, UnixMillis, IGNORED_AGENT_MESSAGES, MAX_FRAME_BYTES, PROTOCOL_VERSION,
};
use kici_scaler::daemon::backends::Built;
use kici_scaler::daemon::stack::{Stack, StackOptions};
use kici_scaler::gateway::GatewaySettings;
use kici_scaler::jobs::{self, EndKind, JobRequest, JobState, JobView, Read};
use serde_json::json;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::broadcast;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Turns a hang into a failure; never part of what a test asserts.
const GUARD: Duration = Duration::from_secs(60);

async fn guard<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(GUARD, f)
        .await
        .unwrap_or_else(|_| panic!("hung waiting for {what}"))
}

const CONFIG: &str = "\
version: 1
globalMaxAgents: 4
scalers:
  - name: local
    type: bare-metal
    maxAgents: 2
    mandatoryLabels: [local]
    roles: []
    labelSets:
      - labels: [linux, local]
        binaryPath: /bin/true
";

struct Setup {
    stack: Stack,
    bare: Arc<MemoryBackend>,
    events: broadcast::Receiver<Arc<SequencedEvent>>,
    url: String,
    _dir: tempfile::TempDir,
}

impl Setup {
    async fn new() -> Self {
        Self::with(CONFIG, GatewaySettings::default()).await
    }

    async fn with(yaml: &str, settings: GatewaySettings) -> Self {
        Self::with_engine(yaml, settings, EngineSettings::default()).await
    }

    async fn with_engine(yaml: &str, settings: GatewaySettings, engine: EngineSettings) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("scalers.yaml");
        std::fs::write(&main, yaml).unwrap();
        let config = Arc::new(kici_config::load(&main, None).unwrap().config);
        let bare = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let stack = Stack::start(
            config,
            Built {
                backends: vec![bare.clone() as Arc<dyn Backend>],
                after_shutdown: Vec::new(),
                agent_gateways: Default::default(),
                ..Built::default()
            },
            None,
            listener,
            StackOptions {
                engine,
                event_replay: 100,
                gateway: settings,
                gateway_limits: kici_scaler::daemon::serving::ConnectionLimits::gateway(),
                job_output: None,
                in_fleet: false,
            },
            None,
        )
        .await
        .unwrap()
        .0;
        let events = stack.runtime.subscribe();
        let url = format!("ws://{}/ws", stack.gateway_addr);
        Self {
            stack,
            bare,
            events,
            url,
            _dir: dir,
        }
    }

    /// Submits a job and waits until its agent is booted (the in-memory
    /// backend "starts" it at once); returns the job id and the agent.
    async fn job(&mut self, argv: &[&str]) -> (JobId, AgentId) {
        let spec = JobSpec::new(
            kici_scaler::jobs::JobBook::mint_id(),
            argv.iter().map(|s| s.to_string()).collect(),
            BTreeMap::new(),
            None,
        )
        .unwrap();
        let id = spec.job_id().clone();
        let view = jobs::submit(
            &self.stack.runtime,
            &self.stack.jobs,
            JobRequest {
                labels: LabelSet::parse(["local"]).unwrap(),
                resources: None,
                spec,
            },
        )
        .unwrap();
        assert_eq!(view.state, JobState::Spawning);
        let agent: AgentId = view.agent_id.unwrap().parse().unwrap();
        self.agent_reaches(agent, AgentState::Booted).await;
        (id, agent)
    }

    async fn agent_reaches(&mut self, agent: AgentId, state: AgentState) {
        if self.stack.runtime.agent(agent).map(|v| v.state) == Some(state) {
            return;
        }
        loop {
            let e = guard("an agent transition", self.events.recv())
                .await
                .unwrap();
            if let EngineEvent::AgentTransition { agent_id, to, .. } = &e.event {
                if *agent_id == agent && *to == state {
                    return;
                }
            }
        }
    }

    fn token(&self, agent: AgentId) -> String {
        self.bare
            .spec(agent)
            .unwrap()
            .token
            .unwrap()
            .expose()
            .to_owned()
    }

    /// The labels the agent was given (`KICI_LABELS`).
    fn labels(&self, agent: AgentId) -> LabelSet {
        LabelSet::parse(self.bare.spec(agent).unwrap().agent_labels).unwrap()
    }

    /// A `sleep 100` job whose agent connected, took it and runs it.
    async fn running_job(&mut self) -> (JobId, AgentId, Agent) {
        let (job, agent) = self.job(&["sleep", "100"]).await;
        let mut a = self.connect().await;
        a.handshake(self, agent).await;
        a.expect_dispatch().await;
        a.ack(&job).await;
        self.job_until(&job, "running", |v| v.state == JobState::Running)
            .await;
        (job, agent, a)
    }

    async fn connect(&self) -> Agent {
        let mut config = WebSocketConfig::default();
        config.max_message_size = Some(MAX_FRAME_BYTES);
        let (ws, _) =
            tokio_tungstenite::connect_async_with_config(self.url.as_str(), Some(config), false)
                .await
                .unwrap();
        Agent { ws }
    }

    /// Waits until the job satisfies `cond`; returns its view.
    async fn job_until(&self, id: &JobId, what: &str, cond: impl Fn(&JobView) -> bool) -> JobView {
        loop {
            let view = self.stack.jobs.view(id).unwrap();
            if cond(&view) {
                return view;
            }
            assert!(
                !view.state.is_terminal(),
                "{what}: the job ended first: {view:?}"
            );
            let Some(Read::Wait(mut rx)) = self.stack.jobs.read(id, u64::MAX) else {
                continue;
            };
            // The state may have changed between the view and the read.
            if cond(&self.stack.jobs.view(id).unwrap()) {
                continue;
            }
            guard(what, rx.changed()).await.unwrap();
        }
    }

    /// Everything the job wrote, by stream.
    fn output(&self, id: &JobId) -> (String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut next = 0;
        while let Some(Read::Chunks { chunks, .. }) = self.stack.jobs.read(id, next) {
            for c in chunks {
                match c.stream {
                    OutputStream::Stdout => out.extend_from_slice(c.data.as_bytes()),
                    OutputStream::Stderr => err.extend_from_slice(c.data.as_bytes()),
                }
                next = c.index + 1;
            }
        }
        (
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }
}

#[derive(Debug)]
enum Frame {
    Msg(GatewayMessage),
    Closed(Option<u16>, String),
}

struct Agent {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

impl Agent {
    async fn send(&mut self, msg: AgentMessage) {
        self.ws.send(Message::text(msg.to_json())).await.unwrap();
    }

    async fn next(&mut self) -> Frame {
        loop {
            match guard("a frame", self.ws.next()).await {
                None | Some(Err(_)) => return Frame::Closed(None, String::new()),
                Some(Ok(Message::Text(t))) => {
                    return Frame::Msg(
                        GatewayMessage::from_json(t.as_str())
                            .unwrap_or_else(|e| panic!("gateway sent {t}: {e}")),
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

    async fn recv(&mut self) -> GatewayMessage {
        match self.next().await {
            Frame::Msg(m) => m,
            Frame::Closed(code, reason) => panic!("closed ({code:?} {reason}), expected a message"),
        }
    }

    async fn expect_close(&mut self) -> (Option<u16>, String) {
        loop {
            match self.next().await {
                Frame::Msg(GatewayMessage::AuthFailure(_)) => continue,
                Frame::Msg(m) => panic!("expected a close, got {m:?}"),
                Frame::Closed(code, reason) => return (code, reason),
            }
        }
    }

    /// `auth.failure` (with `needle` in its reason), then close 4010.
    async fn expect_refusal(&mut self, needle: &str) {
        match self.recv().await {
            GatewayMessage::AuthFailure(f) => {
                assert!(f.reason.contains(needle), "{:?} lacks {needle:?}", f.reason)
            }
            other => panic!("expected auth.failure, got {other:?}"),
        }
        let (code, _) = self.expect_close().await;
        assert_eq!(code, Some(4010));
    }

    async fn auth(&mut self, token: &str) {
        self.send(AgentMessage::AuthRequest(AuthRequest {
            token: token.parse().unwrap(),
            protocol_version: PROTOCOL_VERSION,
        }))
        .await;
    }

    async fn register(&mut self, agent: AgentId, labels: LabelSet) {
        self.register_running(agent, labels, &[]).await;
    }

    /// `agent.register` listing `running` as its `inFlightJobs` (what an
    /// agent reconnecting mid-job reports).
    async fn register_running(&mut self, agent: AgentId, labels: LabelSet, running: &[&JobId]) {
        let mut r = Register::new(
            Register::message_id_for(agent, UnixMillis::now()),
            agent,
            labels,
        );
        r.in_flight_jobs = running
            .iter()
            .map(|j| InFlightJob {
                job_id: j.to_string(),
                run_id: None,
            })
            .collect();
        self.send(AgentMessage::Register(Box::new(r))).await;
    }

    /// Any JSON text, as KiCI's agent might send it.
    async fn send_raw(&mut self, v: serde_json::Value) {
        self.ws.send(Message::text(v.to_string())).await.unwrap();
    }

    /// auth + register (with the scope plus host labels) + config.ack;
    /// returns `pendingDispatch`.
    async fn handshake(&mut self, setup: &Setup, agent: AgentId) -> bool {
        self.handshake_running(setup, agent, &[])
            .await
            .pending_dispatch
    }

    /// [`Agent::handshake`] reporting `running` as in flight; returns the
    /// whole `register.ack`.
    async fn handshake_running(
        &mut self,
        setup: &Setup,
        agent: AgentId,
        running: &[&JobId],
    ) -> RegisterAck {
        self.auth(&setup.token(agent)).await;
        assert!(matches!(self.recv().await, GatewayMessage::AuthSuccess(_)));
        // What an agent reports about itself is outside the token's scope
        // and accepted (KiCI's agent adds its container runtime).
        let labels = setup.labels(agent).union(
            &LabelSet::parse([
                "kici:os:linux",
                "kici:arch:x64",
                "kici:host:test-box",
                "kici:runtime:docker",
            ])
            .unwrap(),
        );
        self.register_running(agent, labels.clone(), running).await;
        let ack = match self.recv().await {
            GatewayMessage::RegisterAck(a) => a,
            other => panic!("expected register.ack, got {other:?}"),
        };
        assert_eq!(ack.agent_id, agent);
        assert_eq!(ack.labels, labels);
        assert!(ack.scaler_managed);
        assert_eq!(ack.capabilities, RegisterAck::capabilities());
        assert_eq!(ack.warm_pool, !ack.pending_dispatch);
        self.send(AgentMessage::ConfigAck(ConfigAck {
            message_id: ConfigAck::message_id_for(agent, UnixMillis::now()),
            agent_id: agent,
        }))
        .await;
        ack
    }

    async fn expect_dispatch(&mut self) -> JobSpec {
        match self.recv().await {
            GatewayMessage::JobDispatch(d) => d.job,
            other => panic!("expected job.dispatch, got {other:?}"),
        }
    }

    async fn ack(&mut self, job: &JobId) {
        self.send(AgentMessage::JobAck(JobAck {
            message_id: format!("job-ack-{job}"),
            job_id: job.clone(),
            timestamp: UnixMillis::now(),
        }))
        .await;
    }

    async fn chunk(&mut self, job: &JobId, seq: u64, stream: OutputStream, data: &str) {
        self.send(AgentMessage::OutputChunk(OutputChunk {
            job_id: job.clone(),
            seq,
            stream,
            data: ChunkData::new(data.as_bytes().to_vec()).unwrap(),
        }))
        .await;
    }

    async fn status(&mut self, job: &JobId, progress: JobProgress) {
        self.send(AgentMessage::JobStatus(JobStatus {
            message_id: format!("job-status-{job}"),
            job_id: job.clone(),
            timestamp: UnixMillis::now(),
            progress,
        }))
        .await;
    }
}

// ------------------------------------------------------------ happy path

#[tokio::test]
async fn a_standalone_job_runs_end_to_end_through_the_gateway() {
    let mut s = Setup::new().await;
    let (job, agent) = s.job(&["sh", "-c", "echo hi; echo oops >&2; exit 3"]).await;
    let mut a = s.connect().await;
    assert!(a.handshake(&s, agent).await, "a bound job: pendingDispatch");
    let spec = a.expect_dispatch().await;
    assert_eq!(spec.job_id(), &job);
    assert_eq!(spec.argv(), ["sh", "-c", "echo hi; echo oops >&2; exit 3"]);
    a.ack(&job).await;
    a.status(&job, JobProgress::Running).await;
    s.job_until(&job, "running", |v| v.state == JobState::Running)
        .await;
    s.agent_reaches(agent, AgentState::Busy).await;
    a.chunk(&job, 0, OutputStream::Stdout, "hi\n").await;
    a.chunk(&job, 1, OutputStream::Stderr, "oops\n").await;
    a.send(AgentMessage::Heartbeat(Heartbeat {
        timestamp: UnixMillis::now(),
    }))
    .await;
    a.status(
        &job,
        JobProgress::Finished(JobEnd::Completed(JobResult::exited(3))),
    )
    .await;
    let (code, reason) = a.expect_close().await;
    assert_eq!((code, reason.as_str()), (Some(1000), "job finished"));
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.state, JobState::Failed);
    assert_eq!(view.end, Some(EndKind::Exited));
    assert_eq!(view.exit_code, Some(3));
    assert_eq!(view.agent_id, Some(agent.to_string()));
    assert_eq!(view.run_exit_code(), Some(3));
    assert_eq!(s.output(&job), ("hi\n".to_owned(), "oops\n".to_owned()));
    // Standalone: the agent is destroyed when its job ends.
    s.agent_reaches(agent, AgentState::Gone).await;
    assert!(s.bare.destroyed().contains(&agent));
    assert_eq!(s.stack.runtime.agent(agent).unwrap().exit_code, Some(3));
}

#[tokio::test]
async fn a_command_that_cannot_start_fails_the_job_with_the_reason() {
    let mut s = Setup::new().await;
    let (job, agent) = s.job(&["no-such-program"]).await;
    let mut a = s.connect().await;
    a.handshake(&s, agent).await;
    a.expect_dispatch().await;
    a.ack(&job).await;
    a.status(
        &job,
        JobProgress::Finished(JobEnd::SpawnFailed {
            error: "no-such-program: No such file or directory (os error 2)".into(),
        }),
    )
    .await;
    assert_eq!(a.expect_close().await.0, Some(1000));
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.end, Some(EndKind::StartFailed));
    assert_eq!(view.run_exit_code(), Some(127));
    s.agent_reaches(agent, AgentState::Gone).await;
}

#[tokio::test]
async fn an_agent_lost_mid_job_fails_the_job_and_is_destroyed() {
    let mut s = Setup::new().await;
    let (job, agent, a) = s.running_job().await;
    drop(a);
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.state, JobState::Failed);
    assert_eq!(view.end, Some(EndKind::Aborted));
    assert!(
        view.reason.as_deref().unwrap().contains("disconnected"),
        "{view:?}"
    );
    assert_eq!(view.run_exit_code(), Some(125));
    s.agent_reaches(agent, AgentState::Gone).await;
}

#[tokio::test]
async fn a_warm_agent_receives_the_job_it_takes_on_its_open_connection() {
    let yaml = CONFIG.replace(
        "    roles: []\n",
        "    roles: []\n    warmPool: { enabled: true, size: 1, idleTimeoutSeconds: 300 }\n",
    );
    let mut s = Setup::with(&yaml, GatewaySettings::default()).await;
    let warm = loop {
        let e = guard("the warm spawn", s.events.recv()).await.unwrap();
        if let EngineEvent::AgentTransition {
            agent_id,
            to: AgentState::Booted,
            ..
        } = &e.event
        {
            break *agent_id;
        }
    };
    let mut a = s.connect().await;
    let ack = a.handshake_running(&s, warm, &[]).await;
    assert!(!ack.pending_dispatch, "no job bound yet");
    assert!(ack.warm_pool, "a warm-pool spawn is told so");
    s.agent_reaches(warm, AgentState::Idle).await;
    let spec = JobSpec::new(
        kici_scaler::jobs::JobBook::mint_id(),
        vec!["true".into()],
        BTreeMap::new(),
        None,
    )
    .unwrap();
    let job = spec.job_id().clone();
    let view = jobs::submit(
        &s.stack.runtime,
        &s.stack.jobs,
        JobRequest {
            labels: LabelSet::parse(["local"]).unwrap(),
            resources: None,
            spec,
        },
    )
    .unwrap();
    assert_eq!(view.agent_id, Some(warm.to_string()));
    let dispatched = a.expect_dispatch().await;
    assert_eq!(dispatched.job_id(), &job);
    a.ack(&job).await;
    a.status(
        &job,
        JobProgress::Finished(JobEnd::Completed(JobResult::exited(0))),
    )
    .await;
    assert_eq!(a.expect_close().await.0, Some(1000));
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.state, JobState::Succeeded);
}

// ------------------------------------------- control never rides on events

/// Plays the agent of job number `n` of [`jobs_end_right_with_a_one_event_stream_and_stalled_observers`]:
/// waits for the job's agent, connects, takes the job and ends it with
/// exit code `n` — or, every tenth job, drops the connection mid-job.
async fn play_agent(
    n: i32,
    job: JobId,
    jobs: Arc<kici_scaler::jobs::JobBook>,
    bare: Arc<MemoryBackend>,
    url: String,
) {
    // The job waits for capacity, then gets its agent; the agent is
    // "started" by the in-memory backend once its spawn runs.
    let spawned = async {
        loop {
            let agent = jobs
                .view(&job)
                .and_then(|v| v.agent_id)
                .map(|a| a.parse::<AgentId>().unwrap());
            if let Some(spec) = agent.and_then(|a| bare.spec(a)) {
                return spec;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let spec = guard("the job's agent", spawned).await;
    let agent = spec.agent;
    let mut config = WebSocketConfig::default();
    config.max_message_size = Some(MAX_FRAME_BYTES);
    let (ws, _) = tokio_tungstenite::connect_async_with_config(url.as_str(), Some(config), false)
        .await
        .unwrap();
    let mut a = Agent { ws };
    a.auth(spec.token.unwrap().expose()).await;
    assert!(matches!(a.recv().await, GatewayMessage::AuthSuccess(_)));
    a.register(agent, LabelSet::parse(spec.agent_labels).unwrap())
        .await;
    assert!(matches!(a.recv().await, GatewayMessage::RegisterAck(_)));
    a.send(AgentMessage::ConfigAck(ConfigAck {
        message_id: ConfigAck::message_id_for(agent, UnixMillis::now()),
        agent_id: agent,
    }))
    .await;
    assert_eq!(a.expect_dispatch().await.job_id(), &job);
    a.ack(&job).await;
    a.status(&job, JobProgress::Running).await;
    if n % 10 == 9 {
        // Lost mid-job: the engine's end of its agent ends the job.
        while jobs.view(&job).unwrap().state != JobState::Running {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(a);
        return;
    }
    a.status(
        &job,
        JobProgress::Finished(JobEnd::Completed(JobResult::exited(n))),
    )
    .await;
    assert_eq!(a.expect_close().await.0, Some(1000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_end_right_with_a_one_event_stream_and_stalled_observers() {
    let yaml = CONFIG
        .replace("globalMaxAgents: 4", "globalMaxAgents: 8")
        .replace("maxAgents: 2", "maxAgents: 8");
    // The engine's event stream holds one event: every observer lags all
    // the time. Two of them never read at all (`s.events` and `stalled`).
    let s = Setup::with_engine(
        &yaml,
        GatewaySettings::default(),
        EngineSettings {
            event_buffer: 1,
            ..EngineSettings::default()
        },
    )
    .await;
    let _stalled = s.stack.runtime.subscribe();
    let mut submitted = Vec::new();
    for n in 0..50 {
        let spec = JobSpec::new(
            kici_scaler::jobs::JobBook::mint_id(),
            vec!["sh".into(), "-c".into(), format!("exit {n}")],
            BTreeMap::new(),
            None,
        )
        .unwrap();
        let job = spec.job_id().clone();
        jobs::submit(
            &s.stack.runtime,
            &s.stack.jobs,
            JobRequest {
                labels: LabelSet::parse(["local"]).unwrap(),
                resources: None,
                spec,
            },
        )
        .unwrap();
        submitted.push(job);
    }
    let agents: Vec<_> = submitted
        .iter()
        .enumerate()
        .map(|(n, job)| {
            tokio::spawn(play_agent(
                i32::try_from(n).unwrap(),
                job.clone(),
                Arc::clone(&s.stack.jobs),
                Arc::clone(&s.bare),
                s.url.clone(),
            ))
        })
        .collect();
    for a in agents {
        a.await.unwrap();
    }
    for (n, job) in submitted.iter().enumerate() {
        let view = s
            .job_until(job, "the job's end", |v| v.state.is_terminal())
            .await;
        let n = i32::try_from(n).unwrap();
        if n % 10 == 9 {
            assert_eq!(view.end, Some(EndKind::Aborted), "{view:?}");
            assert!(
                view.reason.as_deref().unwrap().contains("disconnected"),
                "{view:?}"
            );
            assert_eq!(view.run_exit_code(), Some(125), "{view:?}");
        } else {
            assert_eq!(view.end, Some(EndKind::Exited), "{view:?}");
            assert_eq!(view.run_exit_code(), Some(n), "{view:?}");
        }
    }
    // Every agent is released, every token revoked.
    let gone = async {
        while !s.stack.runtime.agents(false).is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    guard("every agent gone", gone).await;
    assert_eq!(s.bare.destroyed().len(), 50);
    assert_eq!(s.stack.tokens.len(), 0);
    assert!(s.bare.live().is_empty());
}

// -------------------------------------------------------------- refusals

#[tokio::test]
async fn a_wrong_or_malformed_token_is_refused_with_4010() {
    let mut s = Setup::new().await;
    let (_job, agent) = s.job(&["true"]).await;
    let mut a = s.connect().await;
    a.auth(&format!("kat_{}", "0".repeat(64))).await;
    a.expect_refusal("invalid or expired token").await;

    let mut a = s.connect().await;
    a.ws.send(Message::text(
        r#"{"type":"auth.request","token":"kat_short","protocolVersion":1}"#,
    ))
    .await
    .unwrap();
    a.expect_refusal("invalid or expired token").await;

    // No auth at all: every agent we spawn has a token.
    let mut a = s.connect().await;
    a.register(agent, s.labels(agent)).await;
    a.expect_refusal("first message must be auth.request").await;
    // A binary frame first is an authentication failure too.
    let mut a = s.connect().await;
    a.ws.send(Message::binary(vec![0u8, 1, 2])).await.unwrap();
    a.expect_refusal("first message must be auth.request").await;
    // None of this registered the agent.
    assert_eq!(
        s.stack.runtime.agent(agent).unwrap().state,
        AgentState::Booted
    );
}

#[tokio::test]
async fn another_agents_token_and_an_agent_id_not_ours_are_refused() {
    let mut s = Setup::new().await;
    let (_j1, first) = s.job(&["true"]).await;
    let (_j2, second) = s.job(&["true"]).await;
    // The first agent's token, registering as the second.
    let mut a = s.connect().await;
    a.auth(&s.token(first)).await;
    assert!(matches!(a.recv().await, GatewayMessage::AuthSuccess(_)));
    a.register(second, s.labels(second)).await;
    a.expect_refusal(&format!("not bound to agent {second}"))
        .await;
    // An id this instance never minted.
    let stranger = AgentId::new(ScalerType::BareMetal, [0xde, 0xad, 0xbe, 0xef]);
    let mut a = s.connect().await;
    a.auth(&s.token(first)).await;
    assert!(matches!(a.recv().await, GatewayMessage::AuthSuccess(_)));
    a.register(stranger, s.labels(first)).await;
    a.expect_refusal(&format!("not bound to agent {stranger}"))
        .await;
    for agent in [first, second] {
        assert_eq!(
            s.stack.runtime.agent(agent).unwrap().state,
            AgentState::Booted
        );
    }
}

#[tokio::test]
async fn labels_outside_the_tokens_scope_are_refused() {
    let mut s = Setup::new().await;
    let (_job, agent) = s.job(&["true"]).await;
    let mut a = s.connect().await;
    a.auth(&s.token(agent)).await;
    assert!(matches!(a.recv().await, GatewayMessage::AuthSuccess(_)));
    let labels = s
        .labels(agent)
        .union(&LabelSet::parse(["gpu", "kici:role:builder", "kici:os:linux"]).unwrap());
    a.register(agent, labels).await;
    a.expect_refusal("labels outside the token's scope: gpu, kici:role:builder")
        .await;
}

#[tokio::test]
async fn a_revoked_token_is_refused_once_its_agent_is_gone() {
    let mut s = Setup::new().await;
    let (job, agent) = s.job(&["true"]).await;
    let token = s.token(agent);
    jobs::cancel(&s.stack.runtime, &s.stack.jobs, &job, "test");
    s.agent_reaches(agent, AgentState::Gone).await;
    let mut a = s.connect().await;
    a.auth(&token).await;
    a.expect_refusal("invalid or expired token").await;
    assert_eq!(s.stack.jobs.view(&job).unwrap().state, JobState::Cancelled);
}

#[tokio::test]
async fn a_reconnect_supersedes_the_open_connection_and_goes_on_with_its_job() {
    let mut s = Setup::new().await;
    let (job, agent, mut first) = s.running_job().await;
    first.chunk(&job, 0, OutputStream::Stdout, "before\n").await;
    s.job_until(&job, "the first output", |v| v.output_bytes > 0)
        .await;
    // The agent lost sight of its first socket (still open here, as a
    // half-open one would be) and reconnects, still running the job.
    let mut second = s.connect().await;
    let ack = second.handshake_running(&s, agent, &[&job]).await;
    assert!(ack.pending_dispatch, "its job is still bound");
    let (code, reason) = first.expect_close().await;
    assert_eq!(
        (code, reason.as_str()),
        (Some(4009), "Superseded by reconnect")
    );
    // The old connection's end destroyed nothing: the agent is busy with
    // its job, which is not dispatched a second time.
    assert_eq!(
        s.stack.runtime.agent(agent).unwrap().state,
        AgentState::Busy
    );
    assert_eq!(s.stack.gateway.connected(), 1);
    second.chunk(&job, 1, OutputStream::Stdout, "after\n").await;
    second
        .status(
            &job,
            JobProgress::Finished(JobEnd::Completed(JobResult::exited(0))),
        )
        .await;
    let (code, _) = second.expect_close().await;
    assert_eq!(code, Some(1000), "the job's end, on the new connection");
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.state, JobState::Succeeded);
    assert_eq!(s.output(&job).0, "before\nafter\n");
    s.agent_reaches(agent, AgentState::Gone).await;
}

#[tokio::test]
async fn a_reconnect_that_lost_its_running_job_ends_the_job_not_runs_it_twice() {
    let mut s = Setup::new().await;
    let (job, agent, mut first) = s.running_job().await;
    // Reconnects without the job (kici-agent-lite kills a job whose
    // connection dropped).
    let mut second = s.connect().await;
    second.handshake_running(&s, agent, &[]).await;
    assert_eq!(first.expect_close().await.0, Some(4009));
    let (code, reason) = second.expect_close().await;
    assert_eq!((code, reason.as_str()), (Some(1000), "job lost"));
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.end, Some(EndKind::Aborted));
    assert!(
        view.reason
            .as_deref()
            .unwrap()
            .contains("reconnected without its running job"),
        "{view:?}"
    );
    s.agent_reaches(agent, AgentState::Gone).await;
}

#[tokio::test]
async fn a_reconnect_before_the_job_started_gets_the_job() {
    let mut s = Setup::new().await;
    let (job, agent) = s.job(&["true"]).await;
    let mut first = s.connect().await;
    first.handshake(&s, agent).await;
    first.expect_dispatch().await;
    // Never acknowledged on the first connection: sent again.
    let mut second = s.connect().await;
    second.handshake(&s, agent).await;
    assert_eq!(first.expect_close().await.0, Some(4009));
    assert_eq!(second.expect_dispatch().await.job_id(), &job);
    second.ack(&job).await;
    second
        .status(
            &job,
            JobProgress::Finished(JobEnd::Completed(JobResult::exited(0))),
        )
        .await;
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.state, JobState::Succeeded);
}

#[tokio::test]
async fn kici_notifications_we_do_not_use_are_ignored_and_counted_not_a_close() {
    let mut s = Setup::new().await;
    let (job, agent) = s.job(&["true"]).await;
    let ignored = |s: &Setup, kind: &str| -> u64 {
        let text = s.stack.metrics.encode();
        let line = format!("kici_orch_scaler_agent_messages_ignored_total{{type=\"{kind}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .unwrap_or_else(|| panic!("no {line} in\n{text}"))
            .parse()
            .unwrap()
    };
    for kind in IGNORED_AGENT_MESSAGES {
        assert_eq!(ignored(&s, kind), 0, "{kind} exposed at 0 from the start");
    }
    let mut a = s.connect().await;
    a.auth(&s.token(agent)).await;
    assert!(matches!(a.recv().await, GatewayMessage::AuthSuccess(_)));
    a.register(agent, s.labels(agent)).await;
    assert!(matches!(a.recv().await, GatewayMessage::RegisterAck(_)));
    // Before config.ack too: KiCI's agent reports its status at once.
    a.send_raw(
        json!({"type":"agent.status","messageId":"s1","agentId":agent.to_string(),
                      "activeJobs":0,"memoryUsedMb":12}),
    )
    .await;
    a.send(AgentMessage::ConfigAck(ConfigAck {
        message_id: ConfigAck::message_id_for(agent, UnixMillis::now()),
        agent_id: agent,
    }))
    .await;
    assert_eq!(a.expect_dispatch().await.job_id(), &job);
    a.ack(&job).await;
    for msg in [
        json!({"type":"job.heartbeat","runId":"r","jobId":job.to_string(),"timestamp":1}),
        json!({"type":"agent.log","agentId":agent.to_string(),"source":"agent","lines":["x"],"timestamp":1}),
        json!({"type":"agent.metrics","metrics":[{"name":"cpu","value":0.5}]}),
        json!({"type":"agent.status","messageId":"s2","agentId":agent.to_string(),"activeJobs":1}),
        json!({"type":"step.status","runId":"r","jobId":job.to_string(),"stepIndex":0,"status":"running"}),
    ] {
        a.send_raw(msg).await;
    }
    a.status(
        &job,
        JobProgress::Finished(JobEnd::Completed(JobResult::exited(0))),
    )
    .await;
    assert_eq!(a.expect_close().await.0, Some(1000), "the job's own end");
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.state, JobState::Succeeded);
    assert_eq!(ignored(&s, "agent.status"), 2);
    for kind in ["job.heartbeat", "agent.log", "agent.metrics", "step.status"] {
        assert_eq!(ignored(&s, kind), 1, "{kind}");
    }
    assert_eq!(ignored(&s, "run.event"), 0);
}

#[tokio::test]
async fn a_message_type_nobody_knows_is_still_a_4003() {
    let mut s = Setup::new().await;
    let (_job, agent) = s.job(&["sleep", "100"]).await;
    let mut a = s.connect().await;
    a.handshake(&s, agent).await;
    a.expect_dispatch().await;
    a.send_raw(json!({"type":"made.up","x":1})).await;
    let (code, reason) = a.expect_close().await;
    assert_eq!((code, reason.as_str()), (Some(4003), "invalid message"));
    s.agent_reaches(agent, AgentState::Gone).await;
}

#[tokio::test]
async fn a_protocol_version_outside_the_supported_range_is_a_4005() {
    let mut s = Setup::new().await;
    let (_job, agent) = s.job(&["true"]).await;
    let token = s.token(agent);
    for version in [0, PROTOCOL_VERSION + 1] {
        let mut a = s.connect().await;
        a.send_raw(json!({"type":"auth.request","token":token,"protocolVersion":version}))
            .await;
        match a.recv().await {
            GatewayMessage::AuthFailure(f) => {
                assert_eq!(f.reason, "Unsupported protocol version")
            }
            other => panic!("expected auth.failure, got {other:?}"),
        }
        let (code, _) = a.expect_close().await;
        assert_eq!(code, Some(4005), "version {version}");
    }
    // The agent is untouched, and the supported version still works.
    assert_eq!(
        s.stack.runtime.agent(agent).unwrap().state,
        AgentState::Booted
    );
    let mut a = s.connect().await;
    a.handshake(&s, agent).await;
    a.expect_dispatch().await;
}

#[tokio::test]
async fn a_frame_above_the_limit_ends_the_connection() {
    let mut s = Setup::new().await;
    let (_job, agent) = s.job(&["true"]).await;
    let mut a = s.connect().await;
    a.handshake(&s, agent).await;
    a.expect_dispatch().await;
    let huge = format!(
        r#"{{"type":"heartbeat","timestamp":1,"pad":"{}"}}"#,
        "x".repeat(MAX_FRAME_BYTES)
    );
    // The gateway may close before the whole frame is written.
    let _ = a.ws.send(Message::text(huge)).await;
    let (code, _) = a.expect_close().await;
    assert!(matches!(code, Some(1009) | None), "{code:?}");
    s.agent_reaches(agent, AgentState::Gone).await;
}

// -------------------------------------------------------------- deadlines

#[tokio::test]
async fn no_auth_request_in_time_is_a_4002() {
    let settings = GatewaySettings {
        auth_timeout: Duration::from_millis(50),
        ..GatewaySettings::default()
    };
    let s = Setup::with(CONFIG, settings).await;
    let mut a = s.connect().await;
    let (code, reason) = a.expect_close().await;
    assert_eq!((code, reason.as_str()), (Some(4002), "auth timeout"));
}

#[tokio::test]
async fn a_silent_agent_is_dropped_with_4004_and_its_job_fails() {
    let settings = GatewaySettings {
        heartbeat_timeout: Duration::from_millis(200),
        ..GatewaySettings::default()
    };
    let mut s = Setup::with(CONFIG, settings).await;
    let (job, agent) = s.job(&["sleep", "100"]).await;
    let mut a = s.connect().await;
    a.handshake(&s, agent).await;
    a.expect_dispatch().await;
    a.ack(&job).await;
    let (code, _) = a.expect_close().await;
    assert_eq!(code, Some(4004));
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert_eq!(view.end, Some(EndKind::Aborted));
    s.agent_reaches(agent, AgentState::Gone).await;
}

#[tokio::test]
async fn a_dispatch_not_acknowledged_in_time_is_cancelled_with_4031() {
    let settings = GatewaySettings {
        dispatch_ack_timeout: Duration::from_millis(100),
        ..GatewaySettings::default()
    };
    let mut s = Setup::with(CONFIG, settings).await;
    let (job, agent) = s.job(&["true"]).await;
    let mut a = s.connect().await;
    a.handshake(&s, agent).await;
    a.expect_dispatch().await;
    match a.recv().await {
        GatewayMessage::JobCancel(c) => assert_eq!(c.job_id, job),
        other => panic!("expected job.cancel, got {other:?}"),
    }
    assert_eq!(a.expect_close().await.0, Some(4031));
    let view = s
        .job_until(&job, "the end", |v| v.state.is_terminal())
        .await;
    assert!(view.reason.unwrap().contains("did not acknowledge"));
    s.agent_reaches(agent, AgentState::Gone).await;
}
