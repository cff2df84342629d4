//! The control API in process: the real router, engine runtime, token store,
//! event pump and metrics, with in-memory backends. Every answer is checked
//! against the OpenAPI document the router serves.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use common::{check_against_doc, take_sse_events, template_of, DESIGN_ROUTES, EXTRA_ROUTES};
use http_body_util::BodyExt;
use kici_admission::Admission;
use kici_engine::memory_backend::MemoryBackend;
use kici_engine::runtime::Runtime;
use kici_engine::{AgentState, Backend, Engine, EngineSettings};
use kici_model::{AgentId, InstanceId, ScalerType};
use kici_routing::HostPlatform;
use kici_scaler::api::{self, AppState};
use kici_scaler::daemon::reload::{ConfigReloader, Reload};
use kici_scaler::events::metrics::{Metrics, SERIES};
use kici_scaler::events::pump::Pump;
use kici_scaler::events::EventLog;
use kici_scaler::gateway::token::{Clock, Secret, TokenBootstrapper, TokenStore};
use kici_scaler::jobs::JobBook;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

const CONFIG: &str = "\
version: 1
globalMaxAgents: 10
scalers:
  - name: local
    type: bare-metal
    maxAgents: 1
    mandatoryLabels: [local]
    labelSets:
      - labels: [linux, local]
        binaryPath: /bin/true
  - name: docker
    type: container
    maxAgents: 4
    labelSets:
      - labels: [linux, docker]
        image: kici/agent:1
";

struct Harness {
    router: Router,
    state: AppState,
    rt: Runtime,
    bare: Arc<MemoryBackend>,
    docker: Arc<MemoryBackend>,
    /// Seconds added to the token store's clock.
    clock: Arc<AtomicU64>,
    doc: Value,
    dir: tempfile::TempDir,
    _pump: Pump,
}

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// `(code, field)` of an error answer.
    fn error(&self) -> (String, Option<String>) {
        let e = &self.json()["error"];
        (
            e["code"].as_str().unwrap().to_owned(),
            e["field"].as_str().map(str::to_owned),
        )
    }
}

impl Harness {
    async fn new() -> Self {
        Self::with(CONFIG, 10_000, None).await
    }

    async fn with(yaml: &str, replay: usize, api_token: Option<&str>) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        let main = dir.path().join("scalers.yaml");
        std::fs::write(&main, yaml).unwrap();
        let config = Arc::new(kici_config::load(&main, None).unwrap().config);
        let admission = Admission::new(&config, None).unwrap();
        let engine = Engine::new(
            Arc::clone(&config),
            admission,
            HostPlatform::new("linux", "x86_64"),
            EngineSettings::default(),
        );
        let bare = Arc::new(MemoryBackend::new(ScalerType::BareMetal));
        let docker = Arc::new(MemoryBackend::new(ScalerType::Container));
        let backends: Vec<Arc<dyn Backend>> = vec![bare.clone(), docker.clone()];
        let start = Instant::now();
        let offset = Arc::new(AtomicU64::new(0));
        let o = offset.clone();
        let clock: Clock = Arc::new(move || start + Duration::from_secs(o.load(Ordering::SeqCst)));
        let tokens = Arc::new(TokenStore::with_clock(clock));
        let boot = Arc::new(TokenBootstrapper::new(
            tokens.clone(),
            "127.0.0.1:7879".parse().unwrap(),
        ));
        let rt = Runtime::start(engine, backends, boot);
        let metrics = Arc::new(Metrics::new(&config));
        let events = Arc::new(EventLog::new(replay));
        let pump = Pump::start(&rt, events.clone(), metrics.clone());
        let reloader: Arc<dyn Reload> =
            Arc::new(ConfigReloader::new(main, None, rt.clone(), metrics.clone()));
        let state = AppState::new(
            rt.clone(),
            InstanceId::random(),
            tokens,
            events,
            Arc::new(JobBook::new()),
            metrics,
            reloader,
            api_token.map(|t| Secret::new(t.to_owned())),
        );
        state.set_ready(true);
        let router = api::router(state.clone());
        let doc = serde_json::to_value(api::openapi()).unwrap();
        Self {
            router,
            state,
            rt,
            bare,
            docker,
            clock: offset,
            doc,
            dir,
            _pump: pump,
        }
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("scalers.yaml")
    }

    async fn send(&self, request: Request<Body>) -> Answer {
        let method = request.method().as_str().to_owned();
        let path = request.uri().to_string();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        check_against_doc(&self.doc, &method, &path, status.as_u16(), &body);
        Answer {
            status,
            headers,
            body,
        }
    }

    /// A request with a JSON body (or none).
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Answer {
        let mut b = Request::builder().method(method).uri(path);
        let body = match body {
            Some(v) => {
                b = b.header("content-type", "application/json");
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        self.send(b.body(body).unwrap()).await
    }

    /// A request with a raw JSON body.
    async fn raw(&self, method: &str, path: &str, body: &str) -> Answer {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap();
        self.send(request).await
    }

    async fn scale(&self, job: &str, labels: &[&str]) -> Answer {
        self.call(
            "POST",
            "/v1/scale",
            Some(json!({"jobId": job, "labels": labels})),
        )
        .await
    }

    fn state_of(&self, agent: AgentId) -> Option<AgentState> {
        self.rt.agent(agent).map(|v| v.state)
    }

    /// Lets the runtime's tasks run until `cond` holds (no sleeping: the
    /// in-memory backend answers as soon as its task is polled).
    async fn settle_until(&self, what: &str, mut cond: impl FnMut() -> bool) {
        for _ in 0..10_000 {
            if cond() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("never happened: {what}");
    }

    async fn booted(&self, agent: AgentId) {
        self.settle_until("agent booted", || {
            self.state_of(agent) == Some(AgentState::Booted)
        })
        .await;
    }

    fn token_of(&self, agent: AgentId) -> String {
        let spec = self
            .bare
            .spec(agent)
            .or_else(|| self.docker.spec(agent))
            .expect("agent is live in a backend");
        spec.token.expect("a token was minted").expose().to_owned()
    }
}

fn agent_of(answer: &Answer) -> AgentId {
    answer.json()["agentId"].as_str().unwrap().parse().unwrap()
}

// ------------------------------------------------------------------ scale

#[tokio::test]
async fn an_orchestrator_drives_an_agent_through_its_life() {
    let h = Harness::new().await;
    let a = h.scale("job-1", &["local"]).await;
    assert_eq!(a.status, StatusCode::ACCEPTED);
    let body = a.json();
    assert_eq!(body["result"], "spawning");
    assert_eq!(body["scaler"], "local");
    assert_eq!(body["backend"], "bare-metal");
    assert_eq!(body["warm"], false);
    let agent = agent_of(&a);
    h.booted(agent).await;
    let while_live = h
        .call("GET", &format!("/v1/agents/{agent}"), None)
        .await
        .json();

    let spec = h.bare.spec(agent).unwrap();
    assert_eq!(spec.orchestrator_url, "ws://127.0.0.1:7879/ws");
    let token = spec.token.unwrap().expose().to_owned();
    assert!(token.starts_with("kat_") && token.len() == 68);

    let path = |what: &str| format!("/v1/agents/{agent}/{what}");
    let r = h
        .call("POST", &path("registered"), Some(json!({"token": token})))
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.json(),
        json!({"boundJobId": "job-1", "mandatoryLabels": ["local"]})
    );
    // Retried: same answer.
    let again = h
        .call("POST", &path("registered"), Some(json!({"token": token})))
        .await;
    assert_eq!(again.json(), r.json());

    assert_eq!(
        h.call("POST", &path("config-ack"), None).await.status,
        StatusCode::NO_CONTENT
    );
    for _ in 0..2 {
        let r = h
            .call(
                "POST",
                &path("job-started"),
                Some(json!({"jobId": "job-1"})),
            )
            .await;
        assert_eq!(r.status, StatusCode::NO_CONTENT);
    }
    assert_eq!(h.state_of(agent), Some(AgentState::Busy));
    let wrong = h
        .call(
            "POST",
            &path("job-started"),
            Some(json!({"jobId": "job-2"})),
        )
        .await;
    assert_eq!(wrong.status, StatusCode::CONFLICT);
    assert_eq!(wrong.error(), ("wrong-job".into(), Some("jobId".into())));

    let one = h.call("GET", &format!("/v1/agents/{agent}"), None).await;
    assert_eq!(one.json()["state"], "busy");
    assert_eq!(one.json()["jobId"], "job-1");

    let done = h
        .call(
            "POST",
            &path("job-complete"),
            Some(json!({"jobId": "job-1", "exitCode": 0})),
        )
        .await;
    assert_eq!(done.status, StatusCode::NO_CONTENT);
    // Orchestrator mode: the agent may take another job.
    assert_eq!(h.state_of(agent), Some(AgentState::Idle));

    assert_eq!(
        h.call("POST", &path("disconnected"), None).await.status,
        StatusCode::NO_CONTENT
    );
    h.settle_until("agent gone", || h.state_of(agent) == Some(AgentState::Gone))
        .await;
    assert_eq!(h.bare.destroyed(), [agent]);
    // Every report is idempotent once the agent is gone.
    for (what, body) in [
        ("disconnected", None),
        ("config-ack", None),
        ("job-complete", Some(json!({"jobId": "job-1"}))),
    ] {
        let r = h.call("POST", &path(what), body).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT, "{what}");
    }
    let late = h
        .call(
            "POST",
            &path("job-started"),
            Some(json!({"jobId": "job-1"})),
        )
        .await;
    assert_eq!(late.error(), ("agent-gone".into(), Some("id".into())));

    // Gone agents are listed only with ?all=true.
    let live = h.call("GET", "/v1/agents", None).await;
    assert_eq!(live.json(), json!({"agents": []}));
    let all = h.call("GET", "/v1/agents?all=true", None).await;
    assert_eq!(all.json()["agents"][0]["agentId"], agent.to_string());
    assert_eq!(all.json()["agents"][0]["state"], "gone");
    // A gone agent is listed with what it had (its job ended before it
    // went): the job it served, its resources and its age, not zeros.
    let gone = &all.json()["agents"][0];
    assert_eq!(gone["jobId"], "job-1", "{gone}");
    assert!(gone["ageSeconds"].as_f64().unwrap() > 0.0, "{gone}");
    assert_eq!(gone["resources"], while_live["resources"], "{gone}");
    // The token died with the agent.
    let r = h
        .call("POST", &path("registered"), Some(json!({"token": token})))
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

/// An agent destroyed with its job bound is listed, once gone, with that
/// job and the resources it held, its age still counting.
#[tokio::test]
async fn a_gone_agent_keeps_its_job_and_resources() {
    let h = Harness::new().await;
    let r = h
        .call(
            "POST",
            "/v1/scale",
            Some(json!({"jobId": "job-9", "labels": ["docker"],
                        "resources": {"requests": {"cpus": 0.5, "memory": "256m"}}})),
        )
        .await;
    let agent = agent_of(&r);
    h.booted(agent).await;
    h.call("DELETE", &format!("/v1/agents/{agent}"), None).await;
    h.settle_until("gone", || h.state_of(agent) == Some(AgentState::Gone))
        .await;
    let first = h
        .call("GET", &format!("/v1/agents/{agent}"), None)
        .await
        .json();
    assert_eq!(first["state"], "gone", "{first}");
    assert_eq!(first["jobId"], "job-9", "{first}");
    assert_eq!(first["resources"]["cpus"], 0.5, "{first}");
    assert_eq!(first["resources"]["memoryBytes"], 256 << 20, "{first}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let later = h.call("GET", "/v1/agents?all=true", None).await.json();
    let later = &later["agents"][0];
    assert!(
        later["ageSeconds"].as_f64() > first["ageSeconds"].as_f64(),
        "{first} then {later}"
    );
}

#[tokio::test]
async fn the_same_job_id_and_body_is_one_spawn_a_different_body_is_409() {
    let h = Harness::new().await;
    let first = h.scale("job-1", &["docker"]).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let second = h.scale("job-1", &["docker"]).await;
    assert_eq!(second.status, StatusCode::ACCEPTED);
    assert_eq!(first.json(), second.json());
    h.booted(agent_of(&first)).await;
    let third = h.scale("job-1", &["docker"]).await;
    assert_eq!(third.json(), first.json());
    assert_eq!(h.docker.spawned().len(), 1);

    let other = h
        .call(
            "POST",
            "/v1/scale",
            Some(json!({"jobId": "job-1", "labels": ["docker"], "runId": "r2"})),
        )
        .await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.error(), ("job-conflict".into(), Some("jobId".into())));
    assert_eq!(h.docker.spawned().len(), 1);
}

#[tokio::test]
async fn a_full_scaler_answers_pending_and_spawns_when_capacity_frees() {
    let h = Harness::new().await;
    // `local` has maxAgents 1.
    let a = h.scale("job-1", &["local"]).await;
    let first = agent_of(&a);
    let p2 = h.scale("job-2", &["local"]).await;
    assert_eq!(p2.status, StatusCode::OK);
    assert_eq!(p2.json(), json!({"result": "pending", "position": 1}));
    let p3 = h.scale("job-3", &["local"]).await;
    assert_eq!(p3.json(), json!({"result": "pending", "position": 2}));
    let status = h.call("GET", "/v1/status", None).await.json();
    assert_eq!(status["pending"], 2);
    assert_eq!(status["scalers"][0]["pending"], 2);

    // Cancelling job-1 (its agent has not registered) frees the slot for
    // job-2, the oldest waiting.
    h.booted(first).await;
    // Its spawn is done: the spawn throttle (upstream's default limit) is
    // free again.
    let status = h.call("GET", "/v1/status", None).await.json();
    assert_eq!(
        status["scalers"][0]["spawns"],
        json!({"maxConcurrent": 8, "inFlight": 0, "waiting": 0})
    );
    let c = h.call("DELETE", "/v1/scale/job-1", None).await;
    assert_eq!(c.status, StatusCode::NO_CONTENT);
    h.settle_until("job-2 spawned", || h.bare.spawned().len() == 2)
        .await;
    let retry = h.scale("job-2", &["local"]).await;
    assert_eq!(retry.status, StatusCode::ACCEPTED);
    let second = agent_of(&retry);
    assert_ne!(second, first);

    // An operator DELETE frees it again for job-3.
    h.booted(second).await;
    let d = h
        .call("DELETE", &format!("/v1/agents/{second}"), None)
        .await;
    assert_eq!(d.status, StatusCode::ACCEPTED);
    h.settle_until("job-3 spawned", || h.bare.spawned().len() == 3)
        .await;
    assert_eq!(
        h.scale("job-3", &["local"]).await.status,
        StatusCode::ACCEPTED
    );

    // A pending request can be cancelled too, and cancelling twice is fine.
    assert_eq!(
        h.scale("job-4", &["local"]).await.json()["result"],
        "pending"
    );
    for _ in 0..2 {
        let c = h.call("DELETE", "/v1/scale/job-4", None).await;
        assert_eq!(c.status, StatusCode::NO_CONTENT);
    }
    assert_eq!(h.call("GET", "/v1/status", None).await.json()["pending"], 0);
}

#[tokio::test]
async fn too_large_and_no_backend_are_answers_not_errors() {
    let h = Harness::new().await;
    let none = h.scale("job-1", &["gpu"]).await;
    assert_eq!(none.status, StatusCode::OK);
    assert_eq!(none.json()["result"], "no-backend");
    assert!(none.json()["explanation"].as_str().unwrap().contains("gpu"));

    let yaml = CONFIG.replace(
        "maxAgents: 4\n",
        "maxAgents: 4\n    resourceCap:\n      maxCpu: 2\n",
    );
    let h = Harness::with(&yaml, 100, None).await;
    let big = h
        .call(
            "POST",
            "/v1/scale",
            Some(json!({"jobId": "big", "labels": ["docker"], "resources": {"requests": {"cpus": 4}}})),
        )
        .await;
    assert_eq!(big.status, StatusCode::OK);
    assert_eq!(big.json()["result"], "too-large");
    assert_eq!(big.json()["cap"], "scaler-cpu");
}

/// Labels as upstream reads them on a request: none at all routes to the
/// first label set without a gate (here past the gated `local`), and a label
/// is trimmed and lower-cased before it is matched.
#[tokio::test]
async fn no_labels_and_untrimmed_labels_route_as_upstream_does() {
    let h = Harness::new().await;
    let none = h.scale("job-none", &[]).await;
    assert_eq!(none.status, StatusCode::ACCEPTED, "{}", none.json());
    assert_eq!(none.json()["result"], "spawning");
    assert_eq!(none.json()["scaler"], "docker");

    let padded = h.scale("job-padded", &[" Local", "LINUX "]).await;
    assert_eq!(padded.status, StatusCode::ACCEPTED, "{}", padded.json());
    assert_eq!(padded.json()["scaler"], "local");

    let job = h
        .call(
            "POST",
            "/v1/jobs",
            Some(json!({"labels": [], "command": ["true"]})),
        )
        .await;
    assert_eq!(job.status, StatusCode::ACCEPTED, "{}", job.json());
}

/// Resource amounts an operator would never mean: a blank inside a memory
/// size, less memory than a page, and a number whose plain spelling runs to
/// hundreds of digits (the error shows it as written, not expanded).
#[tokio::test]
async fn odd_resource_amounts_are_refused_readably() {
    let h = Harness::new().await;
    for (resources, field, needle) in [
        (
            json!({"requests": {"memory": "1 g"}}),
            "resources.requests.memory",
            "space",
        ),
        (
            json!({"limits": {"memory": "1k"}}),
            "resources.limits.memory",
            "below one page",
        ),
        (
            json!({"requests": {"cpus": 1e308}}),
            "resources.requests.cpus",
            "got 1e308",
        ),
    ] {
        let r = h
            .call(
                "POST",
                "/v1/scale",
                Some(json!({"jobId": "j", "labels": ["docker"], "resources": resources})),
            )
            .await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{resources}");
        assert_eq!(r.error(), ("invalid-value".into(), Some(field.into())));
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains(needle), "{message}");
        assert!(message.len() < 200, "{message}");
    }
    assert!(h.rt.agents(true).is_empty(), "nothing was spawned");
}

#[tokio::test]
async fn bad_input_is_a_clear_4xx_naming_the_field_and_changes_nothing() {
    let h = Harness::new().await;
    let cases: &[(&str, u16, &str, Option<&str>)] = &[
        (
            r#"{"jobId":"j","labels":["docker"]"#,
            400,
            "malformed-json",
            None,
        ),
        (
            r#"{"jobId":"j","labels":["docker"]} x"#,
            400,
            "malformed-json",
            None,
        ),
        // Broken after an unknown key: still a syntax error first.
        (
            r#"{"bogus": "x", "jobId": "j", labels"#,
            400,
            "malformed-json",
            None,
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"bogus":1}"#,
            422,
            "unknown-field",
            Some("bogus"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"gpus":1}}}"#,
            422,
            "unknown-field",
            Some("resources.requests.gpus"),
        ),
        (
            r#"{"labels":["docker"]}"#,
            422,
            "missing-field",
            Some("jobId"),
        ),
        (
            r#"{"jobId":"j","labels":"docker"}"#,
            422,
            "invalid-type",
            Some("labels"),
        ),
        (
            r#"{"jobId":"j","labels":["docker",7]}"#,
            422,
            "invalid-type",
            Some("labels[1]"),
        ),
        (
            r#"{"jobId":7,"labels":["docker"]}"#,
            422,
            "invalid-type",
            Some("jobId"),
        ),
        (
            r#"{"jobId":"","labels":["docker"]}"#,
            422,
            "invalid-value",
            Some("jobId"),
        ),
        (
            r#"{"jobId":"a b","labels":["docker"]}"#,
            422,
            "invalid-value",
            Some("jobId"),
        ),
        (
            r#"{"jobId":"j","runId":"","labels":["docker"]}"#,
            422,
            "invalid-value",
            Some("runId"),
        ),
        (
            r#"{"jobId":"j","labels":["docker","has space"]}"#,
            422,
            "invalid-value",
            Some("labels[1]"),
        ),
        (
            r#"{"jobId":"j","labels":["bell\u0007"]}"#,
            422,
            "invalid-value",
            Some("labels[0]"),
        ),
        (
            r#"{"jobId":"j","labels":["a,b"]}"#,
            422,
            "invalid-value",
            Some("labels[0]"),
        ),
        (
            r#"{"jobId":"j","labels":[""]}"#,
            422,
            "invalid-value",
            Some("labels[0]"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"excludeLabels":["ok","\t"]}"#,
            422,
            "invalid-value",
            Some("excludeLabels[1]"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"cpus":-1}}}"#,
            422,
            "invalid-value",
            Some("resources.requests.cpus"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"limits":{"cpus":100000}}}"#,
            422,
            "invalid-value",
            Some("resources.limits.cpus"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"cpus":0.0001}}}"#,
            422,
            "invalid-value",
            Some("resources.requests.cpus"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"memory":"99999999999999999g"}}}"#,
            422,
            "invalid-value",
            Some("resources.requests.memory"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"memory":"1gb"}}}"#,
            422,
            "invalid-value",
            Some("resources.requests.memory"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"memory":"0m"}}}"#,
            422,
            "invalid-value",
            Some("resources.requests.memory"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"memory":512}}}"#,
            422,
            "invalid-type",
            Some("resources.requests.memory"),
        ),
        (
            r#"{"jobId":"j","labels":["docker"],"resources":{"requests":{"cpus":2},"limits":{"cpus":1}}}"#,
            422,
            "invalid-value",
            Some("resources.requests"),
        ),
    ];
    for (body, status, code, field) in cases {
        let a = h.raw("POST", "/v1/scale", body).await;
        assert_eq!(
            a.status.as_u16(),
            *status,
            "{body}: {}",
            String::from_utf8_lossy(&a.body)
        );
        let (c, f) = a.error();
        assert_eq!((c.as_str(), f.as_deref()), (*code, *field), "{body}");
        assert!(!a.json()["error"]["message"].as_str().unwrap().is_empty());
    }

    // Not JSON at all, and too large.
    let plain = h
        .send(
            Request::builder()
                .method("POST")
                .uri("/v1/scale")
                .header("content-type", "text/plain")
                .body(Body::from(r#"{"jobId":"j","labels":["docker"]}"#))
                .unwrap(),
        )
        .await;
    assert_eq!(plain.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let huge = format!(
        r#"{{"jobId":"j","labels":["{}"]}}"#,
        "x".repeat(kici_scaler::api::error::MAX_BODY_BYTES)
    );
    let big = h.raw("POST", "/v1/scale", &huge).await;
    assert_eq!(big.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(big.error().0, "payload-too-large");

    // Path parameters.
    let bad_id = h.call("GET", "/v1/agents/not-an-agent", None).await;
    assert_eq!(bad_id.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        bad_id.error(),
        ("invalid-agent-id".into(), Some("id".into()))
    );
    let unknown = h
        .call("GET", "/v1/agents/scaler-bare-metal-00000000", None)
        .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(
        unknown.error(),
        ("agent-not-found".into(), Some("id".into()))
    );
    for what in ["config-ack", "disconnected"] {
        let r = h
            .call(
                "POST",
                &format!("/v1/agents/scaler-bare-metal-00000000/{what}"),
                None,
            )
            .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{what}");
    }
    let r = h
        .call("DELETE", "/v1/agents/scaler-container-0000000g", None)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h.call("GET", "/v1/agents?all=maybe", None).await;
    assert_eq!(r.error(), ("invalid-value".into(), Some("all".into())));
    let r = h.call("GET", "/v1/nothing", None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error().0, "no-route");
    let r = h.call("PUT", "/v1/scale", None).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.error().0, "method-not-allowed");

    // Nothing happened.
    assert!(h.rt.agents(true).is_empty());
    assert!(h.docker.spawned().is_empty() && h.bare.spawned().is_empty());
    assert_eq!(h.rt.status().pending, 0);
}

// ----------------------------------------------------------------- tokens

#[tokio::test]
async fn registration_needs_the_agents_own_live_token() {
    let h = Harness::new().await;
    let a = agent_of(&h.scale("job-a", &["docker"]).await);
    let b = agent_of(&h.scale("job-b", &["docker"]).await);
    h.booted(a).await;
    h.booted(b).await;
    let (ta, tb) = (h.token_of(a), h.token_of(b));
    let register = |agent: AgentId, token: String| {
        let h = &h;
        async move {
            h.call(
                "POST",
                &format!("/v1/agents/{agent}/registered"),
                Some(json!({ "token": token })),
            )
            .await
        }
    };

    let wrong = register(a, format!("kat_{}", "0".repeat(64))).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        wrong.error(),
        ("invalid-agent-token".into(), Some("token".into()))
    );
    assert_eq!(wrong.headers["www-authenticate"], "Bearer");
    let foreign = register(a, tb.clone()).await;
    assert_eq!(foreign.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        register(a, String::new()).await.status,
        StatusCode::UNAUTHORIZED
    );
    let unknown = register("scaler-container-00000000".parse().unwrap(), ta.clone()).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    // No message ever echoes a token.
    for answer in [&wrong, &foreign] {
        let text = String::from_utf8_lossy(&answer.body);
        assert!(!text.contains(&ta) && !text.contains(&tb));
    }
    assert_eq!(h.state_of(a), Some(AgentState::Booted), "nothing changed");

    assert_eq!(register(a, ta).await.status, StatusCode::OK);
    // The TTL is the scaler's maxLifetime (24 h by default).
    h.clock.store(24 * 3600, Ordering::SeqCst);
    let expired = register(b, tb).await;
    assert_eq!(expired.status, StatusCode::UNAUTHORIZED);
    assert_eq!(h.state_of(b), Some(AgentState::Booted));
}

// ----------------------------------------------------------------- scalers

#[tokio::test]
async fn cordon_uncordon_and_drain() {
    let h = Harness::new().await;
    for verb in ["cordon", "uncordon", "drain"] {
        let r = h
            .call("POST", &format!("/v1/scalers/nope/{verb}"), None)
            .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{verb}");
        assert_eq!(r.error(), ("scaler-not-found".into(), Some("name".into())));
    }
    let c = h.call("POST", "/v1/scalers/docker/cordon", None).await;
    assert_eq!(c.status, StatusCode::NO_CONTENT);
    assert_eq!(
        h.scale("j1", &["docker"]).await.json()["result"],
        "no-backend"
    );
    let status = h.call("GET", "/v1/status", None).await.json();
    assert_eq!(status["scalers"][1]["cordoned"], true);
    let u = h.call("POST", "/v1/scalers/docker/uncordon", None).await;
    assert_eq!(u.status, StatusCode::NO_CONTENT);
    let a = agent_of(&h.scale("j1", &["docker"]).await);
    h.booted(a).await;
    let d = h.call("POST", "/v1/scalers/docker/drain", None).await;
    assert_eq!(d.status, StatusCode::NO_CONTENT);
    let status = h.call("GET", "/v1/status", None).await.json();
    assert_eq!(status["scalers"][1]["draining"], true);
    assert_eq!(
        h.scale("j2", &["docker"]).await.json()["result"],
        "no-backend"
    );
}

// ------------------------------------------------------------------ reload

#[tokio::test]
async fn reload_is_all_or_nothing() {
    let h = Harness::new().await;
    std::fs::write(
        h.config_path(),
        "version: 1\nscalers:\n  - name: x\n    type: nope\n",
    )
    .unwrap();
    let bad = h.call("POST", "/v1/reload", None).await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY);
    let body = bad.json();
    assert_eq!(body["error"]["code"], "invalid-config");
    let errors = body["errors"].as_array().unwrap();
    assert!(!errors.is_empty());
    assert!(errors
        .iter()
        .all(|e| e.as_str().unwrap().contains("scalers.yaml")));
    let status = h.call("GET", "/v1/status", None).await.json();
    let names: Vec<&str> = status["scalers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["local", "docker"], "nothing changed");

    // A firecracker scaler has no backend in this harness: refused by the
    // runtime's backend validation, nothing changed either.
    let fc = format!(
        "{CONFIG}  - name: vm\n    type: firecracker\n    maxAgents: 1\n    labelSets:\n      - labels: [vm]\n        kernelImagePath: /k\n        rootfsPath: /r\n"
    );
    std::fs::write(h.config_path(), &fc).unwrap();
    let refused = h.call("POST", "/v1/reload", None).await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        String::from_utf8_lossy(&refused.body)
    );
    assert!(refused.json()["errors"][0]
        .as_str()
        .unwrap()
        .contains("firecracker"));
    assert_eq!(h.scale("j", &["vm"]).await.json()["result"], "no-backend");

    std::fs::write(
        h.config_path(),
        CONFIG.replace("maxAgents: 4", "maxAgents: 6"),
    )
    .unwrap();
    let ok = h.call("POST", "/v1/reload", None).await;
    assert_eq!(ok.status, StatusCode::OK);
    let changes = ok.json()["diff"]["changes"].clone();
    assert!(
        changes
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c.as_str().unwrap().contains("maxAgents")),
        "{changes}"
    );
    let metrics = String::from_utf8(h.call("GET", "/metrics", None).await.body).unwrap();
    for line in [
        "kici_orch_scaler_config_reloads_total{result=\"attempted\"} 3",
        "kici_orch_scaler_config_reloads_total{result=\"failed\"} 2",
        "kici_orch_scaler_config_reloads_total{result=\"success\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
}

// ------------------------------------------------------------------ events

/// Reads SSE events from `GET /v1/events` until `n` have arrived.
async fn read_events(h: &Harness, last_event_id: Option<&str>, n: usize) -> Vec<common::SseEvent> {
    let mut request = Request::builder().method("GET").uri("/v1/events");
    if let Some(id) = last_event_id {
        request = request.header("last-event-id", id);
    }
    let response = h
        .router
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while events.len() < n {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("an event within 10 s (the stream is live)")
            .expect("the stream is open")
            .unwrap();
        if let Ok(data) = frame.into_data() {
            buffer.push_str(std::str::from_utf8(&data).unwrap());
            events.extend(take_sse_events(&mut buffer));
        }
    }
    events.truncate(n);
    events
}

#[tokio::test]
async fn events_have_increasing_ids_and_last_event_id_resumes() {
    let h = Harness::new().await;
    let a = agent_of(&h.scale("job-1", &["docker"]).await);
    h.booted(a).await;
    h.call("DELETE", &format!("/v1/agents/{a}"), None).await;
    h.settle_until("gone", || h.state_of(a) == Some(AgentState::Gone))
        .await;
    h.settle_until("logged", || {
        h.state.events.newest_id() >= 4
            && h.rt.agent(a).is_some_and(|v| v.state == AgentState::Gone)
    })
    .await;
    let newest = h.state.events.newest_id();
    let all = read_events(&h, Some("0"), newest as usize).await;
    let ids: Vec<u64> = all.iter().map(|e| e.id.unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
    assert_eq!(ids[0], 1);
    for e in &all {
        assert_eq!(e.data["type"], e.event.as_str());
        assert_eq!(Some(e.data["id"].as_u64().unwrap()), e.id);
    }
    assert!(all
        .iter()
        .any(|e| e.event == "pending-ended" && e.data["end"] == "admitted"));
    let transitions: Vec<_> = all
        .iter()
        .filter(|e| e.event == "agent-transition")
        .collect();
    assert!(transitions
        .iter()
        .all(|e| e.data["agentId"] == a.to_string()));
    let states: Vec<&str> = transitions
        .iter()
        .map(|e| e.data["to"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["provisioning", "booted", "destroying", "gone"]);

    // Resuming after id 2 starts at 3.
    let resumed = read_events(&h, Some("2"), all.len() - 2).await;
    assert_eq!(resumed[0].id, Some(3));
    assert_eq!(resumed, all[2..]);

    // A live reader (no Last-Event-ID) gets only what happens next.
    let live = {
        let h = &h;
        let reader = read_events(h, None, 1);
        let act = async {
            // Let the reader subscribe first.
            tokio::task::yield_now().await;
            h.scale("job-2", &["docker"]).await;
        };
        let (events, ()) = tokio::join!(reader, act);
        events
    };
    assert_eq!(live[0].id, Some(ids[ids.len() - 1] + 1));

    let bad = h
        .send(
            Request::builder()
                .uri("/v1/events")
                .header("last-event-id", "x")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(
        bad.error(),
        ("invalid-last-event-id".into(), Some("Last-Event-ID".into()))
    );
}

#[tokio::test]
async fn a_reader_too_far_behind_gets_a_reset() {
    let h = Harness::with(CONFIG, 2, None).await;
    let a = agent_of(&h.scale("job-1", &["docker"]).await);
    h.booted(a).await;
    h.call("DELETE", &format!("/v1/agents/{a}"), None).await;
    h.settle_until("gone", || h.state_of(a) == Some(AgentState::Gone))
        .await;
    h.settle_until("logged", || h.state.events.newest_id() >= 5)
        .await;
    let newest = h.state.events.newest_id();
    let events = read_events(&h, Some("1"), 3).await;
    assert_eq!(events[0].event, "reset");
    assert_eq!(events[0].data["missedFrom"], 2);
    assert_eq!(events[0].data["missedTo"], newest - 2);
    assert_eq!(events[0].id, Some(newest - 2));
    assert_eq!(events[1].id, Some(newest - 1));
    assert_eq!(events[2].id, Some(newest));
}

/// A client resuming against a new or reset state dir asks for ids this
/// daemon never had: it gets a `reset` at once, then live events.
#[tokio::test]
async fn a_last_event_id_ahead_of_the_newest_gets_a_reset_at_once() {
    let h = Harness::new().await;
    let a = agent_of(&h.scale("job-1", &["docker"]).await);
    h.booted(a).await;
    h.settle_until("logged", || h.state.events.newest_id() >= 2)
        .await;
    let newest = h.state.events.newest_id();
    let ahead = (newest + 1000).to_string();
    let reset = read_events(&h, Some(&ahead), 1).await;
    assert_eq!(reset[0].event, "reset");
    assert_eq!(reset[0].data["missedFrom"], 1);
    assert_eq!(reset[0].data["missedTo"], newest);
    assert_eq!(reset[0].id, Some(newest));
    assert!(
        reset[0].data["reason"].as_str().unwrap().contains(&ahead),
        "{}",
        reset[0].data
    );
    // After the reset it follows live events from the newest id.
    let (events, ()) = tokio::join!(read_events(&h, Some(&ahead), 2), async {
        tokio::task::yield_now().await;
        h.scale("job-2", &["docker"]).await;
    });
    assert_eq!(events[0].event, "reset");
    assert_eq!(events[1].id, Some(newest + 1));
}

// ------------------------------------------------------------ operations

#[tokio::test]
async fn metrics_status_health_and_readiness() {
    let h = Harness::new().await;
    let text = String::from_utf8(h.call("GET", "/metrics", None).await.body).unwrap();
    for name in SERIES {
        assert!(text.contains(name), "{name} missing");
    }
    let a = agent_of(&h.scale("job-1", &["docker"]).await);
    h.booted(a).await;
    h.settle_until("provision observed", || {
        h.state.metrics.encode().contains(
            "kici_orch_scaler_provision_seconds_count{backend=\"container\",phase=\"provision\"} 1",
        )
    })
    .await;
    let text = String::from_utf8(h.call("GET", "/metrics", None).await.body).unwrap();
    assert!(
        text.contains("kici_orch_scaler_agents{scaler=\"docker\",state=\"booted\"} 1"),
        "{text}"
    );
    assert!(text.contains("kici_orch_scaler_agents{scaler=\"local\",state=\"booted\"} 0"));
    assert!(
        text.contains(
            "kici_orch_scaler_provision_seconds_count{backend=\"container\",phase=\"provision\"} 1"
        ),
        "{text}"
    );
    let r = h
        .call(
            "POST",
            &format!("/v1/agents/{a}/registered"),
            Some(json!({"token": h.token_of(a)})),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    // Histograms follow the event stream: let the pump catch up.
    h.settle_until("registration observed", || {
        h.state.metrics.encode().contains(
            "kici_orch_scaler_provision_seconds_count{backend=\"container\",phase=\"registration\"} 1",
        )
    })
    .await;

    let status = h.call("GET", "/v1/status", None).await.json();
    assert_eq!(status["instanceId"], h.state.instance.to_string());
    assert_eq!(status["globalMaxAgents"], 10);
    assert_eq!(status["global"]["agents"], 1);
    assert_eq!(status["global"]["free"]["agents"], 9);
    let docker = &status["scalers"][1];
    assert_eq!(docker["name"], "docker");
    assert_eq!(docker["agents"]["active"], 1);
    assert_eq!(docker["usage"]["free"]["agents"], 3);
    assert_eq!(docker["labelSets"][0]["breaker"], "closed");

    assert_eq!(
        h.call("GET", "/healthz", None).await.json(),
        json!({"status": "ok"})
    );
    assert_eq!(h.call("GET", "/readyz", None).await.status, StatusCode::OK);
    h.state.set_ready(false);
    let not = h.call("GET", "/readyz", None).await;
    assert_eq!(not.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(not.json()["ready"], false);
}

#[tokio::test]
async fn a_shutting_down_engine_refuses_scale_requests() {
    let h = Harness::new().await;
    assert!(h.rt.shutdown(Duration::from_secs(5)).await);
    let r = h.scale("job-1", &["docker"]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.error().0, "shutting-down");
}

#[tokio::test]
async fn the_bearer_token_guards_every_route_and_web_pages_are_refused() {
    let h = Harness::with(CONFIG, 100, Some("s3cret-token")).await;
    for (method, template) in DESIGN_ROUTES {
        let path = template
            .replace("{jobId}", "j")
            .replace("{id}", "scaler-container-00000000")
            .replace("{name}", "docker");
        let r = h.call(&method.to_uppercase(), &path, None).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{method} {path}");
    }
    let with = |token: &str| {
        Request::builder()
            .uri("/v1/status")
            .header("authorization", format!("Bearer {token}"))
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(h.send(with("wrong")).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(h.send(with("s3cret-token")).await.status, StatusCode::OK);

    let h = Harness::new().await;
    let from_page = h
        .send(
            Request::builder()
                .method("POST")
                .uri("/v1/scalers/docker/drain")
                .header("origin", "http://evil.example")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(from_page.status, StatusCode::FORBIDDEN);
    assert_eq!(from_page.error().0, "cross-origin");
    assert!(!h.rt.status().scalers[1].draining);
}

// -------------------------------------------------------------------- jobs

fn job_body(labels: &[&str], command: &[&str]) -> Value {
    json!({"labels": labels, "command": command})
}

/// Reads `GET /v1/jobs/{id}/logs` to the end of the stream.
async fn read_job_logs(h: &Harness, id: &str) -> Vec<common::SseEvent> {
    let response = h
        .router
        .clone()
        .oneshot(
            Request::builder()
                .uri(format!("/v1/jobs/{id}/logs"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the stream ends once the job has")
    {
        if let Ok(data) = frame.unwrap().into_data() {
            buffer.push_str(std::str::from_utf8(&data).unwrap());
            events.extend(take_sse_events(&mut buffer));
        }
    }
    events
}

#[tokio::test]
async fn jobs_are_accepted_queued_shown_and_cancelled() {
    let h = Harness::new().await;
    // `local` has maxAgents 1: the second job waits.
    let first = h
        .call("POST", "/v1/jobs", Some(job_body(&["local"], &["true"])))
        .await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert_eq!(first.json()["state"], "spawning");
    let first = first.json()["jobId"].as_str().unwrap().to_owned();
    let second = h
        .call(
            "POST",
            "/v1/jobs",
            Some(json!({"labels": ["local"], "command": ["sh", "-c", "echo $X"], "env": {"X": "1"}, "timeoutSeconds": 5})),
        )
        .await;
    assert_eq!(second.status, StatusCode::ACCEPTED);
    assert_eq!(second.json()["state"], "pending");
    let second = second.json()["jobId"].as_str().unwrap().to_owned();
    assert_ne!(first, second);

    let shown = h
        .call("GET", &format!("/v1/jobs/{first}"), None)
        .await
        .json();
    assert_eq!(shown["state"], "spawning");
    assert!(shown["agentId"]
        .as_str()
        .unwrap()
        .starts_with("scaler-bare-metal-"));
    assert_eq!(shown["command"], json!(["true"]));
    assert_eq!(shown["labels"], json!(["local"]));
    let shown = h
        .call("GET", &format!("/v1/jobs/{second}"), None)
        .await
        .json();
    assert_eq!(shown["state"], "pending");
    assert!(shown.get("agentId").is_none());

    for _ in 0..2 {
        let cancelled = h.call("DELETE", &format!("/v1/jobs/{second}"), None).await;
        assert_eq!(cancelled.status, StatusCode::ACCEPTED);
        assert_eq!(cancelled.json()["state"], "cancelled");
    }
    let events = read_job_logs(&h, &second).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].event, "end");
    assert_eq!(events[0].data["state"], "cancelled");
    assert_eq!(events[0].data["end"], "cancelled");
    assert_eq!(h.rt.status().pending, 0, "the scale request left the queue");

    // Cancelling a job whose agent exists destroys the agent.
    let agent: AgentId = h
        .call("GET", &format!("/v1/jobs/{first}"), None)
        .await
        .json()["agentId"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    h.booted(agent).await;
    let cancelled = h.call("DELETE", &format!("/v1/jobs/{first}"), None).await;
    assert_eq!(cancelled.json()["state"], "cancelled");
    h.settle_until("the agent is gone", || {
        h.state_of(agent) == Some(AgentState::Gone)
    })
    .await;

    let missing = h.call("GET", "/v1/jobs/job-nope", None).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.error(), ("job-not-found".into(), Some("id".into())));
    for method in ["GET", "DELETE"] {
        let r = h.call(method, "/v1/jobs/job-nope", None).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
    }
    let r = h.call("GET", "/v1/jobs/job-nope/logs", None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h.call("GET", "/v1/jobs/a%20b", None).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
}

#[tokio::test]
async fn bad_job_bodies_are_a_clear_4xx_naming_the_field_and_change_nothing() {
    let h = Harness::new().await;
    let cases: &[(Value, u16, &str, Option<&str>)] = &[
        (
            json!({"labels": ["lo cal"], "command": ["true"]}),
            422,
            "invalid-value",
            Some("labels[0]"),
        ),
        (
            json!({"labels": ["local"], "command": []}),
            422,
            "invalid-value",
            Some("command"),
        ),
        (
            json!({"labels": ["local"], "command": ["a\u{0}b"]}),
            422,
            "invalid-value",
            Some("command[0]"),
        ),
        (
            json!({"labels": ["local"], "command": ["true"], "env": {"1X": "a"}}),
            422,
            "invalid-value",
            Some("env.1X"),
        ),
        (
            json!({"labels": ["local"], "command": ["true"], "timeoutSeconds": 0}),
            422,
            "invalid-value",
            Some("timeoutSeconds"),
        ),
        (
            json!({"labels": ["local"], "command": ["true"], "timeoutSeconds": -1}),
            422,
            "invalid-value",
            Some("timeoutSeconds"),
        ),
        (
            json!({"labels": ["local"], "command": ["true"], "cwd": "/"}),
            422,
            "unknown-field",
            Some("cwd"),
        ),
        (
            json!({"labels": ["local"], "command": "true"}),
            422,
            "invalid-type",
            Some("command"),
        ),
        (
            json!({"labels": ["local"]}),
            422,
            "missing-field",
            Some("command"),
        ),
        (
            json!({"labels": ["gpu"], "command": ["true"]}),
            422,
            "no-backend",
            Some("labels"),
        ),
        (
            json!({"labels": ["local"], "command": ["true"], "resources": {"requests": {"memory": "lots"}}}),
            422,
            "invalid-value",
            Some("resources.requests.memory"),
        ),
    ];
    for (body, status, code, field) in cases {
        let r = h.call("POST", "/v1/jobs", Some(body.clone())).await;
        assert_eq!(r.status.as_u16(), *status, "{body}");
        let (c, f) = r.error();
        assert_eq!((c.as_str(), f.as_deref()), (*code, *field), "{body}");
    }
    let r = h.raw("POST", "/v1/jobs", r#"{"labels":["local"],"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(h.state.jobs.is_empty(), "nothing was recorded");
    assert!(h.rt.agents(true).is_empty(), "nothing was spawned");

    let yaml = CONFIG.replace(
        "maxAgents: 4\n",
        "maxAgents: 4\n    resourceCap:\n      maxCpu: 2\n",
    );
    let h = Harness::with(&yaml, 100, None).await;
    let big = h
        .call(
            "POST",
            "/v1/jobs",
            Some(json!({"labels": ["docker"], "command": ["true"], "resources": {"requests": {"cpus": 4}}})),
        )
        .await;
    assert_eq!(big.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(big.error(), ("too-large".into(), Some("resources".into())));
    assert!(big.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("scaler-cpu"));
}

// ----------------------------------------------------------------- openapi

#[tokio::test]
async fn the_router_and_the_openapi_document_agree_in_both_directions() {
    let h = Harness::new().await;
    let served: Value = h.call("GET", "/openapi.json", None).await.json();
    assert_eq!(served, h.doc);
    let mut documented: Vec<(String, String)> = Vec::new();
    for (path, item) in h.doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                documented.push((method.clone(), path.clone()));
            }
        }
    }
    documented.sort();
    let mut expected: Vec<(String, String)> = DESIGN_ROUTES
        .iter()
        .chain(EXTRA_ROUTES)
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    expected.sort();
    assert_eq!(
        documented, expected,
        "the document is the contract's route table (plus the documented extras)"
    );

    // Every documented route is served (the router's fallback answers
    // `no-route` / `method-not-allowed` for anything else).
    for (method, template) in &documented {
        let path = template
            .replace("{jobId}", "j")
            .replace("{id}", "scaler-container-00000000")
            .replace("{name}", "docker");
        if path == "/v1/events" {
            continue; // streams forever; served, see the events tests
        }
        let r = h.call(&method.to_uppercase(), &path, None).await;
        let code = serde_json::from_slice::<Value>(&r.body)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
        assert!(
            !matches!(code.as_deref(), Some("no-route" | "method-not-allowed")),
            "{method} {path} is documented but not routed"
        );
        assert_eq!(
            template_of(&h.doc, &path).as_deref(),
            Some(template.as_str())
        );
    }
    // And the other way: nothing outside the document is routed.
    for (method, path) in [
        ("GET", "/v1/scale"),
        ("GET", "/ws"),
        ("POST", "/v1/status"),
        ("GET", "/v1/reload"),
    ] {
        let r = h
            .router
            .clone()
            .oneshot(
                Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert!(
            r.status() == StatusCode::NOT_FOUND || r.status() == StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}"
        );
    }
}

#[test]
fn the_schema_check_rejects_a_body_that_does_not_match() {
    let doc = serde_json::to_value(api::openapi()).unwrap();
    let wrong = br#"{"agents":[{"agentId":"x","state":"sleeping"}]}"#;
    let caught = std::panic::catch_unwind(|| {
        check_against_doc(&doc, "GET", "/v1/agents", 200, wrong);
    });
    assert!(caught.is_err(), "an invalid state must not validate");
    let undocumented = std::panic::catch_unwind(|| {
        check_against_doc(&doc, "GET", "/v1/agents", 418, b"{}");
    });
    assert!(
        undocumented.is_err(),
        "an undocumented status must be caught"
    );
    check_against_doc(&doc, "GET", "/v1/agents", 200, br#"{"agents":[]}"#);
}

/// The typed client's route table is the served document's: every route
/// the daemon documents has a client method, and the client calls no
/// route the daemon does not document.
#[tokio::test]
async fn the_served_document_covers_every_route_of_the_typed_client() {
    let h = Harness::new().await;
    let served: Value = h.call("GET", "/openapi.json", None).await.json();
    let mut documented: Vec<(String, String)> = Vec::new();
    for (path, item) in served["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                documented.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    documented.sort();
    let mut client: Vec<(String, String)> = kici_api::ROUTES
        .iter()
        .map(|r| (r.method.to_owned(), r.path.to_owned()))
        .collect();
    client.sort();
    assert_eq!(documented, client);
    // Every schema the document references is in it.
    let text = served.to_string();
    for (at, _) in text.match_indices("#/components/schemas/") {
        let name: String = text[at + 21..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        assert!(
            served["components"]["schemas"][&name].is_object(),
            "{name} is referenced but not defined"
        );
    }
}

// ---------------------------------------------------------- typed client

/// The router on a loopback listener, for [`kici_api::Client`].
async fn serve_on_loopback(h: &Harness) -> (kici_api::Client, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = h.router.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    (
        kici_api::Client::new(&format!("http://{addr}")).unwrap(),
        server,
    )
}

/// An orchestrator's whole exchange through the typed client, over a
/// socket: typed bodies in, typed answers and events out, error codes as
/// an enum.
#[tokio::test]
async fn the_typed_client_drives_an_agent_and_a_job_over_a_socket() {
    use kici_api::{
        AgentStateName, BackendName, ErrorCode, Event, JobCompleteBody, JobLogEvent,
        JobStartedBody, JobState, RegisteredBody, ScaleAnswer, ScaleBody, StreamEvent,
    };
    let h = Harness::new().await;
    let (client, server) = serve_on_loopback(&h).await;
    let mut events = client.events(None).await.unwrap();

    assert_eq!(client.healthz().await.unwrap().status, "ok");
    assert!(client.readyz().await.unwrap().ready);
    let body = ScaleBody {
        job_id: "typed-1".into(),
        labels: vec!["local".into()],
        ..ScaleBody::default()
    };
    let ScaleAnswer::Spawning {
        agent_id,
        scaler,
        backend,
        warm,
        ..
    } = client.scale(&body).await.unwrap()
    else {
        panic!("not spawning");
    };
    assert_eq!(
        (scaler.as_str(), backend, warm),
        ("local", BackendName::BareMetal, false)
    );
    let agent: AgentId = agent_id.parse().unwrap();
    h.booted(agent).await;

    let token = h.token_of(agent);
    let registered = client
        .registered(&agent_id, &RegisteredBody { token })
        .await
        .unwrap();
    assert_eq!(registered.bound_job_id.as_deref(), Some("typed-1"));
    assert_eq!(registered.mandatory_labels, ["local"]);
    client.config_ack(&agent_id).await.unwrap();
    let started = JobStartedBody {
        job_id: "typed-1".into(),
    };
    client.job_started(&agent_id, &started).await.unwrap();
    let view = client.agent(&agent_id).await.unwrap();
    assert_eq!(view.state, AgentStateName::Busy);
    assert_eq!(view.job_id.as_deref(), Some("typed-1"));

    let wrong = JobStartedBody {
        job_id: "typed-2".into(),
    };
    let e = client.job_started(&agent_id, &wrong).await.unwrap_err();
    assert_eq!(e.code(), Some(&ErrorCode::WrongJob));
    assert_eq!(e.answer().unwrap().status, 409);
    assert_eq!(e.answer().unwrap().error.field.as_deref(), Some("jobId"));
    let e = client.cordon("nope").await.unwrap_err();
    assert_eq!(e.code(), Some(&ErrorCode::ScalerNotFound));

    let complete = JobCompleteBody {
        job_id: "typed-1".into(),
        exit_code: Some(0),
    };
    client.job_complete(&agent_id, &complete).await.unwrap();
    client.disconnected(&agent_id).await.unwrap();
    h.settle_until("agent gone", || h.state_of(agent) == Some(AgentState::Gone))
        .await;
    assert!(client.agents(false).await.unwrap().agents.is_empty());
    let all = client.agents(true).await.unwrap();
    assert_eq!(all.agents[0].state, AgentStateName::Gone);

    // The agent's life as typed events, in order.
    let mut path = Vec::new();
    while path.last() != Some(&AgentStateName::Gone) {
        let next = tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .expect("an event within 10 s")
            .expect("the stream is open")
            .unwrap();
        if let StreamEvent::Event(e) = next {
            if let Event::AgentTransition {
                agent_id: a, to, ..
            } = e.event
            {
                if a == agent_id {
                    path.push(to);
                }
            }
        }
    }
    assert_eq!(path.first(), Some(&AgentStateName::Provisioning));
    assert!(path.contains(&AgentStateName::Busy), "{path:?}");

    // A standalone job: accepted, shown, cancelled, its log stream ends.
    let job = kici_api::JobBody {
        labels: vec!["local".into()],
        command: vec!["true".into()],
        ..kici_api::JobBody::default()
    };
    let accepted = client.submit_job(&job).await.unwrap();
    assert_eq!(accepted.state, JobState::Spawning);
    let shown = client.job(&accepted.job_id).await.unwrap();
    assert_eq!(shown.command, ["true"]);
    let cancelled = client.cancel_job(&accepted.job_id).await.unwrap();
    assert_eq!(cancelled.state, JobState::Cancelled);
    let mut logs = client.job_logs(&accepted.job_id, None).await.unwrap();
    let Some(Ok(JobLogEvent::End(end))) = logs.next().await else {
        panic!("the log stream ends with the job's end");
    };
    assert_eq!(end.state, JobState::Cancelled);
    let e = client.job("job-nope").await.unwrap_err();
    assert_eq!(e.code(), Some(&ErrorCode::JobNotFound));

    let status = client.status().await.unwrap();
    assert_eq!(status.scalers[1].name, "docker");
    server.abort();
}

#[tokio::test]
async fn the_fleet_view_is_refused_by_name_outside_a_fleet() {
    let h = Harness::new().await;
    let r = h.call("GET", "/v1/fleet", None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.error().0, "not-a-fleet");
}

/// A schedule period in force shows in `GET /v1/status` (where the target
/// comes from) and in the metrics (its index and the target).
#[tokio::test]
async fn status_and_metrics_show_the_warm_pool_period_in_force() {
    let yaml = CONFIG.replace(
        "    maxAgents: 4\n",
        "    maxAgents: 4\n    x-kici-scaler:\n      warmPool:\n        schedule:\n          - {days: [sat, sun], from: \"00:00\", to: \"24:00\", timezone: UTC, size: 1}\n          - {days: [mon, tue, wed, thu, fri, sat, sun], from: \"00:00\", to: \"24:00\", timezone: Europe/Paris, size: 2}\n",
    );
    let h = Harness::with(&yaml, 10_000, None).await;
    h.settle_until("the first plan", || {
        h.rt.status().scalers[1].warm_target == 2 || h.rt.status().scalers[1].warm_target == 1
    })
    .await;
    let status = h.call("GET", "/v1/status", None).await.json();
    let docker = &status["scalers"][1];
    assert_eq!(docker["name"], "docker");
    let weekend = docker["warmSource"]["period"] == 0;
    let (period, target, description) = if weekend {
        (0, 1, "sat,sun 00:00-24:00 UTC")
    } else {
        (1, 2, "mon,tue,wed,thu,fri,sat,sun 00:00-24:00 Europe/Paris")
    };
    assert_eq!(
        docker["warmSource"],
        json!({"kind": "schedule", "period": period, "description": description})
    );
    assert_eq!(docker["warmTarget"], target);
    // A scaler without the extension has no source.
    assert!(status["scalers"][0].get("warmSource").is_none());
    let text = String::from_utf8(h.call("GET", "/metrics", None).await.body).unwrap();
    assert!(
        text.contains(&format!(
            "kici_orch_scaler_warm_period{{scaler=\"docker\"}} {period}"
        )),
        "{text}"
    );
    assert!(
        text.contains("kici_orch_scaler_warm_period{scaler=\"local\"} -1"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "kici_orch_scaler_warm_target{{scaler=\"docker\"}} {target}"
        )),
        "{text}"
    );
}
