//! Embeds the kici-scaler engine with the bare-metal backend and runs one job
//! without the daemon.
//!
//! ```text
//! cargo run -p kici-embed-example      # as root (or in a delegated cgroup)
//! ```
//!
//! What it does, printing each step and every agent transition:
//!
//! 1. loads a `scalers.yaml` held in this file (`kici-config`);
//! 2. routes the job's labels and prints why each label set was or was not
//!    chosen (`kici-routing`);
//! 3. checks every scaler with the bare-metal backend (`kici-bare-metal`), then
//!    starts the engine (`kici-engine`) over the admission layer
//!    (`kici-admission`) and that backend;
//! 4. asks for an agent for the job: it is admitted and spawned as a real
//!    process, in its own session and tracking cgroup, with exactly the
//!    `KICI_*` bootstrap environment and a freshly minted token;
//! 5. does what the daemon's agent gateway does: the agent connects back to
//!    `KICI_ORCHESTRATOR_URL` and presents its token; the program checks it,
//!    registers the agent with the engine, acknowledges its configuration,
//!    hands it the job's command, marks the job started, relays its output,
//!    reads its exit code and completes the job;
//! 6. the engine then destroys the agent (an agent runs one job); the
//!    program waits for `gone` and checks that the process, its cgroup, its
//!    token and its reservation are all gone;
//! 7. shuts the engine down and removes its state directory.
//!
//! It exits 0 only when all of that happened and the job exited 0.
//!
//! The daemon's gateway speaks the KiCI WebSocket protocol (`kici-protocol`)
//! to `kici-agent-lite`; both live in binary crates. To need nothing but the
//! library crates, the agent here is a bash script, and the program stands in
//! for the gateway with one text line per message over loopback TCP
//! (`register <agent> <token>`, `job <job> <command>`, `out <line>`,
//! `exit <code>`). Everything on the engine's side — the calls, their order,
//! the lifecycle — is the daemon's.
//!
//! This is a workspace member rather than an example target of kici-engine:
//! it needs kici-bare-metal, which depends on kici-engine, so kici-engine would
//! need kici-bare-metal as a dev-dependency — a cycle that could not be
//! published (each would have to be on the registry before the other), and a
//! backend compiled into every engine test build.

use kici_admission::Admission;
use kici_bare_metal::{BareMetalBackend, BareMetalOptions};
use kici_engine::runtime::{Bootstrap, Bootstrapper, Runtime, SequencedEvent};
use kici_engine::{
    AgentState, Backend, Engine, EngineEvent, EngineSettings, Mode, ScaleOutcome, ScaleRequest,
    SpawnOrder,
};
use kici_host::process::ProcessIdentity;
use kici_model::{AgentId, Config, InstanceId, JobId, LabelSet, Secret};
use kici_routing::{CordonSet, HostPlatform, Router};
use std::collections::HashMap;
use std::fmt::Display;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};

/// The configuration: `{agent}` becomes the agent script's path. Two label
/// sets and a gated scaler, so that routing has something to explain.
const SCALERS_YAML: &str = r#"
version: 1
scalers:
  - name: metal
    type: bare-metal
    maxAgents: 2
    labelSets:
      - labels: [linux, embed]
        binaryPath: {agent}
      - labels: [linux, embed, gpu]
        binaryPath: {agent}
  - name: metal-big
    type: bare-metal
    maxAgents: 1
    mandatoryLabels: [big]
    labelSets:
      - labels: [linux, embed, big]
        binaryPath: {agent}
"#;

/// The agent: what the bare-metal backend execs, with nothing but the
/// `KICI_*` contract and the host allowlist (`PATH`, ...) in its
/// environment. It connects back, registers with its token, runs the job it
/// is given and reports its output and exit code.
const AGENT_SCRIPT: &str = r#"#!/bin/bash
set -u
# ws://HOST:PORT/ws -> HOST and PORT
hostport=${KICI_ORCHESTRATOR_URL#*://}
hostport=${hostport%%/*}
exec 3<>"/dev/tcp/${hostport%:*}/${hostport##*:}" || exit 90
printf 'register %s %s\n' "$KICI_AGENT_ID" "$KICI_AGENT_TOKEN" >&3
read -r verb job command <&3 || exit 91
[ "$verb" = job ] || exit 92
bash -c "$command" 2>&1 | while IFS= read -r line; do printf 'out %s\n' "$line" >&3; done
printf 'exit %d\n' "${PIPESTATUS[0]}" >&3
# Leaves when the gateway closes the connection (or the backend stops it).
read -r _ <&3
"#;

/// The job: its command runs in the agent, as the agent's user.
const JOB_COMMAND: &str =
    r#"echo "hello from $KICI_AGENT_ID (labels $KICI_LABELS)"; echo "working in $PWD"; uname -sr"#;
const JOB_LABELS: [&str; 2] = ["linux", "embed"];

/// How long each step may take.
const STEP: Duration = Duration::from_secs(30);

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let started = Instant::now();
    let tokio = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("embed: FAILED: cannot start tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    match tokio.block_on(run(started)) {
        Ok(()) => {
            say(started, "embed: OK");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("embed: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn say(started: Instant, what: impl Display) {
    println!("[{:7.3}s] {what}", started.elapsed().as_secs_f64());
}

fn fail(what: impl Into<String>) -> Error {
    what.into().into()
}

/// The state directory of this run, removed however the run ends.
struct StateDir(PathBuf);

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn run(started: Instant) -> Result<(), Error> {
    let instance = InstanceId::random();
    let state = StateDir(std::env::temp_dir().join(format!("kici-scaler-embed-{instance}")));
    std::fs::create_dir_all(&state.0)?;
    let agent_path = state.0.join("agent.sh");
    std::fs::write(&agent_path, AGENT_SCRIPT)?;
    std::fs::set_permissions(&agent_path, std::fs::Permissions::from_mode(0o755))?;
    say(
        started,
        format!("instance {instance}, state in {}", state.0.display()),
    );

    // 1. The configuration.
    let yaml = SCALERS_YAML.replace("{agent}", &agent_path.display().to_string());
    let loaded = kici_config::load_documents(&[("scalers.yaml", yaml.as_str())])
        .map_err(|e| fail(format!("scalers.yaml:\n{e}")))?;
    let config = Arc::new(loaded.config);
    say(
        started,
        format!(
            "config: {} scaler(s): {}",
            config.scalers.len(),
            names(&config)
        ),
    );

    // 2. Routing, explained (the engine routes the request again itself).
    let labels = LabelSet::parse(JOB_LABELS)?;
    let platform = HostPlatform::current();
    let router = Router::new(&config, &platform);
    let why = router.explain(&labels, &LabelSet::default(), &CordonSet::none());
    for c in &why.candidates {
        say(
            started,
            format!(
                "route [{labels}]: {}[{}] {}",
                c.scaler_name, c.label_set, c.reason
            ),
        );
    }
    let route = why
        .chosen
        .ok_or_else(|| fail(format!("no label set takes [{labels}]")))?;
    let scaler = &config.scalers[route.scaler];

    // 3. The bare-metal backend, checked against every scaler as `serve`
    //    does at start-up, then the engine over it.
    let options = BareMetalOptions::new(instance, state.0.clone(), std::env::vars().collect());
    let backend = Arc::new(BareMetalBackend::new(options)?);
    for s in &config.scalers {
        backend
            .validate(s)
            .await
            .map_err(|problems| fail(format!("scaler {}: {}", s.name, problems)))?;
    }
    say(
        started,
        format!(
            "bare-metal backend ready (cgroups under {})",
            backend.layout().instance_dir().display()
        ),
    );
    let gateway = TcpListener::bind("127.0.0.1:0").await?;
    let bootstrap = Arc::new(LoopbackGateway {
        url: format!("ws://{}/ws", gateway.local_addr()?),
        tokens: Mutex::new(HashMap::new()),
        started,
    });
    let admission = Admission::new(&config, None)?;
    let engine = Engine::new(
        Arc::clone(&config),
        admission,
        platform,
        EngineSettings::default(),
    );
    let runtime = Runtime::start(
        engine,
        vec![backend.clone() as Arc<dyn Backend>],
        bootstrap.clone(),
    );
    // Subscribed before anything can happen.
    let mut transitions = follow(runtime.subscribe(), started);

    let outcome = job_on(&runtime, &bootstrap, &mut transitions, gateway, started).await;
    // Whatever happened, nothing stays behind.
    let all_gone = runtime.shutdown(STEP).await;
    backend.prune_empty_cgroups();
    say(
        started,
        format!("engine shut down (every agent gone: {all_gone})"),
    );
    let exit_code = outcome?;
    if !all_gone {
        return Err(fail("agents were left at shutdown"));
    }
    let instance_dir = backend.layout().instance_dir();
    if instance_dir.exists() {
        return Err(fail(format!("{} is still there", instance_dir.display())));
    }
    if exit_code != 0 {
        return Err(fail(format!(
            "the job on {} exited with {exit_code}",
            scaler.name
        )));
    }
    Ok(())
}

/// Steps 4 to 6; returns the job's exit code.
async fn job_on(
    runtime: &Runtime,
    gateway_tokens: &LoopbackGateway,
    transitions: &mut mpsc::UnboundedReceiver<(AgentId, AgentState, String)>,
    gateway: TcpListener,
    started: Instant,
) -> Result<i32, Error> {
    // 4. The request: standalone mode (the agent's end is the job's end).
    let job: JobId = format!("embed-{}", std::process::id()).parse()?;
    let outcome = runtime.request_scale(ScaleRequest {
        job: job.clone(),
        run_id: None,
        labels: LabelSet::parse(JOB_LABELS)?,
        exclude: LabelSet::default(),
        resources: None,
        mode: Mode::Standalone,
    })?;
    let agent = match outcome {
        ScaleOutcome::Spawning {
            agent_id,
            scaler,
            backend,
            ..
        } => {
            say(
                started,
                format!("job {job}: admitted, agent {agent_id} on {scaler} ({backend})"),
            );
            agent_id
        }
        other => return Err(fail(format!("job {job} not admitted: {other:?}"))),
    };

    // 5. The agent connects back (or dies trying: its exit is reported).
    let (stream, peer) = tokio::select! {
        accepted = tokio::time::timeout(STEP, gateway.accept()) => accepted
            .map_err(|_| fail("the agent did not connect back in time"))??,
        gone = wait_for(transitions, agent, AgentState::Destroying) => {
            return Err(fail(format!("the agent ended before it connected: {}", gone?)));
        }
    };
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let hello = next_line(&mut lines).await?;
    let mut words = hello.splitn(3, ' ');
    let (Some("register"), Some(id), Some(token)) = (words.next(), words.next(), words.next())
    else {
        return Err(fail(format!("expected `register`, got {hello:?}")));
    };
    // The daemon keeps only a hash and compares in constant time.
    if id != agent.to_string() || !gateway_tokens.accepts(agent, token) {
        return Err(fail(format!("{peer}: wrong agent id or token for {id}")));
    }
    say(started, format!("gateway: {id} authenticated from {peer}"));
    let registration = runtime.agent_registered(agent)?;
    if registration.bound_job_id.as_ref() != Some(&job) {
        return Err(fail(format!(
            "agent bound to {:?}, not {job}",
            registration.bound_job_id
        )));
    }
    runtime.agent_configured(agent).await?;
    write
        .write_all(format!("job {job} {JOB_COMMAND}\n").as_bytes())
        .await?;
    runtime.job_started(agent, job.clone())?;
    say(started, format!("gateway: job {job} dispatched to {agent}"));
    // What the backend created (a fast agent may register before the
    // backend's spawn call has returned it).
    let handle = tokio::time::timeout(STEP, async {
        loop {
            if let Some(h) = runtime.call(|e, _| e.handle_of(agent).cloned()) {
                return h;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .map_err(|_| fail("the backend never reported the agent's resource"))?;
    let exit_code = loop {
        let line = next_line(&mut lines).await?;
        if let Some(output) = line.strip_prefix("out ") {
            say(started, format!("job output: {output}"));
        } else if let Some(code) = line.strip_prefix("exit ") {
            break code.parse::<i32>()?;
        } else {
            return Err(fail(format!("unexpected line from the agent: {line:?}")));
        }
    };
    say(started, format!("gateway: job {job} exited {exit_code}"));
    runtime.job_completed(agent, &job, Some(exit_code))?;
    drop((lines, write));

    // 6. Released: the agent is destroyed and everything it held goes.
    wait_for(transitions, agent, AgentState::Gone).await?;
    let process: ProcessIdentity = handle
        .id
        .parse()
        .map_err(|e| fail(format!("handle {}: {e:?}", handle.id)))?;
    if process.is_current() {
        return Err(fail(format!("agent process {} still exists", handle.id)));
    }
    if let Some(cgroup) = handle.extra.get("cgroup") {
        if Path::new(cgroup).exists() {
            return Err(fail(format!("agent cgroup {cgroup} still exists")));
        }
    }
    if gateway_tokens.accepts(agent, token) {
        return Err(fail("the agent's token was not revoked"));
    }
    let usage = runtime.call(|e, _| e.admission().usage());
    if usage.global.agents != 0 {
        return Err(fail(format!(
            "{} reservation(s) still held",
            usage.global.agents
        )));
    }
    say(
        started,
        format!(
            "checked: process {} gone, cgroup gone, token revoked, no capacity held",
            handle.id
        ),
    );
    Ok(exit_code)
}

/// The agent-facing half of a spawn: where the agent connects, with a token
/// minted for it alone (as the daemon does: `kat_` + 64 hex).
struct LoopbackGateway {
    url: String,
    tokens: Mutex<HashMap<AgentId, Secret>>,
    started: Instant,
}

impl LoopbackGateway {
    fn accepts(&self, agent: AgentId, token: &str) -> bool {
        let tokens = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        tokens.get(&agent).is_some_and(|t| t.expose() == token)
    }
}

impl Bootstrapper for LoopbackGateway {
    fn bootstrap(&self, order: &SpawnOrder) -> Bootstrap {
        let token = Secret::new(format!("kat_{}", hex::encode(rand::random::<[u8; 32]>())));
        self.tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(order.agent, token.clone());
        say(
            self.started,
            format!("bootstrap: {} connects to {}", order.agent, self.url),
        );
        Bootstrap {
            orchestrator_url: self.url.clone(),
            token: Some(token),
        }
    }

    fn revoke(&self, agent: AgentId) {
        let removed = self
            .tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&agent);
        if removed.is_some() {
            say(self.started, format!("bootstrap: token of {agent} revoked"));
        }
    }
}

/// Prints every agent transition as it happens and passes it on.
fn follow(
    mut events: broadcast::Receiver<Arc<SequencedEvent>>,
    started: Instant,
) -> mpsc::UnboundedReceiver<(AgentId, AgentState, String)> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let event = match events.recv().await {
                Ok(event) => event,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    say(started, format!("({n} events missed)"));
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => break,
            };
            if let EngineEvent::AgentTransition {
                agent_id,
                from,
                to,
                failure_reason,
                cause,
                detail,
                ..
            } = &event.event
            {
                let mut why = Vec::new();
                if let Some(r) = failure_reason {
                    why.push(format!("failure {r}"));
                }
                if let Some(c) = cause {
                    why.push(format!("cause {c:?}"));
                }
                if let Some(d) = detail {
                    why.push(d.clone());
                }
                let why = why.join(", ");
                say(
                    started,
                    format!("agent {agent_id}: {from} -> {to}  {why}").trim_end(),
                );
                if tx.send((*agent_id, *to, why)).is_err() {
                    break;
                }
            }
        }
    });
    rx
}

/// Waits until `agent` reaches `state` (or goes past it to `gone`); returns
/// what the transition said.
async fn wait_for(
    transitions: &mut mpsc::UnboundedReceiver<(AgentId, AgentState, String)>,
    agent: AgentId,
    state: AgentState,
) -> Result<String, Error> {
    let deadline = tokio::time::Instant::now() + STEP;
    loop {
        let next = tokio::time::timeout_at(deadline, transitions.recv())
            .await
            .map_err(|_| fail(format!("agent {agent} did not reach {state} in time")))?
            .ok_or_else(|| fail("the engine's event stream ended"))?;
        if next.0 == agent && (next.1 == state || next.1 == AgentState::Gone) {
            return Ok(next.2);
        }
    }
}

async fn next_line(lines: &mut Lines<BufReader<OwnedReadHalf>>) -> Result<String, Error> {
    tokio::time::timeout(STEP, lines.next_line())
        .await
        .map_err(|_| fail("the agent went quiet"))??
        .ok_or_else(|| fail("the agent closed its connection"))
}

fn names(config: &Config) -> String {
    config
        .scalers
        .iter()
        .map(|s| s.name.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
