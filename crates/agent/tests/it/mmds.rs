//! The MMDS V2 bootstrap against a real HTTP server (hyper, on
//! 127.0.0.1:0) whose answers come from the testkit's MMDS — the same
//! token authority and V2 rules the Firecracker simulator serves at
//! 169.254.169.254 — and the real agent binary taking its bootstrap from it.
//!
//! Every wait is on an event (an answered request, a connection, a
//! message); [`GUARD`] only turns a hang into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kici_agent_lite::mmds::{self, FetchPolicy, MmdsClient, MmdsError};
use kici_testkit::mmds::{GuestMethod, GuestRequest, Mmds, MmdsVersion, DEFAULT_MMDS_SIZE_LIMIT};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Notify;

const TOKEN: &str = "kat_9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0";
const GUARD: Duration = Duration::from_secs(60);

async fn guard<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(GUARD, f)
        .await
        .unwrap_or_else(|_| panic!("hung waiting for {what}"))
}

#[derive(Default)]
struct Counters {
    token_puts: u32,
    not_found: u32,
    unauthorized: u32,
}

struct State {
    mmds: Mmds,
    counters: Counters,
    /// Forget every token before the next GET (a VMM that lost its token
    /// authority, or tokens that expired).
    revoke_before_next_get: bool,
}

/// MMDS V2 over real HTTP on 127.0.0.1.
struct MmdsServer {
    address: SocketAddr,
    state: Arc<Mutex<State>>,
    answered: Arc<Notify>,
}

fn v2_mmds() -> Mmds {
    let mut m = Mmds::new(DEFAULT_MMDS_SIZE_LIMIT);
    m.set_version(MmdsVersion::V2, false);
    m
}

impl MmdsServer {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            mmds: v2_mmds(),
            counters: Counters::default(),
            revoke_before_next_get: false,
        }));
        let answered = Arc::new(Notify::new());
        let (st, notify) = (state.clone(), answered.clone());
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (st, notify) = (st.clone(), notify.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let answer = answer(&st, &req);
                        notify.notify_waiters();
                        async move { Ok::<_, Infallible>(answer) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        Self {
            address,
            state,
            answered,
        }
    }

    fn populate(&self, doc: Value) {
        self.state.lock().unwrap().mmds.put(doc).unwrap();
    }

    fn policy(&self, deadline: Duration) -> FetchPolicy {
        FetchPolicy {
            address: self.address,
            deadline,
            ..FetchPolicy::default()
        }
    }

    /// Waits until `done` holds for the counters, re-checking after every
    /// answered request.
    async fn wait_for(&self, what: &str, done: impl Fn(&Counters) -> bool) {
        guard(what, async {
            loop {
                let notified = self.answered.notified();
                if done(&self.state.lock().unwrap().counters) {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }
}

fn answer(
    state: &Mutex<State>,
    req: &hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let method = match *req.method() {
        hyper::Method::GET => GuestMethod::Get,
        hyper::Method::PUT => GuestMethod::Put,
        _ => GuestMethod::Other,
    };
    let guest = GuestRequest {
        method,
        path: req.uri().path().to_owned(),
        headers: req
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
            .collect(),
    };
    let mut st = state.lock().unwrap();
    if method == GuestMethod::Get && st.revoke_before_next_get {
        st.revoke_before_next_get = false;
        let data = st.mmds.value();
        st.mmds = v2_mmds();
        st.mmds.put(data).unwrap();
    }
    let resp = st.mmds.guest_request(&guest);
    match (method, resp.status) {
        (GuestMethod::Put, 200) => st.counters.token_puts += 1,
        (GuestMethod::Get, 404) => st.counters.not_found += 1,
        (GuestMethod::Get, 401) => st.counters.unauthorized += 1,
        _ => {}
    }
    hyper::Response::builder()
        .status(resp.status)
        .header("content-type", resp.content_type)
        .body(Full::new(Bytes::from(resp.body)))
        .unwrap()
}

fn document(url: &str) -> Value {
    json!({"latest": {"meta-data": {
        "kici-orchestrator-url": url,
        "kici-agent-id": "scaler-firecracker-0a1b2c3d",
        "kici-labels": "linux,kici:agent:firecracker",
        "kici-scaler-managed": "1",
        "kici-agent-token": TOKEN,
        "kici-gateway-ip": "10.0.0.1",
        "kici-env": {"KICI_SCALER_IDLE_TIMEOUT": "0", "HTTP_PROXY": "http://proxy:3128"}
    }}})
}

#[tokio::test]
async fn firecracker_mmds_v2_get_is_401_without_a_token_and_200_with_one() {
    let server = MmdsServer::start().await;
    server.populate(document("ws://10.0.0.1:7879/ws"));
    let client = MmdsClient::new(server.address, Duration::from_secs(5));

    let refused = client.get_json(mmds::META_DATA_PATH, None).await.unwrap();
    assert_eq!(refused.status, 401, "{}", refused.body);
    let forged = client
        .get_json(mmds::META_DATA_PATH, Some("not-a-token"))
        .await
        .unwrap();
    assert_eq!(forged.status, 401);

    let token = client.put_token(60).await.unwrap();
    assert_eq!(token.status, 200);
    let meta = client
        .get_json(mmds::META_DATA_PATH, Some(token.body.trim()))
        .await
        .unwrap();
    assert_eq!(meta.status, 200);
    let value: Value = serde_json::from_str(&meta.body).unwrap();
    assert_eq!(
        value,
        document("ws://10.0.0.1:7879/ws")["latest"]["meta-data"]
    );
}

#[tokio::test]
async fn firecracker_mmds_fetch_retries_until_the_host_populates_the_store() {
    let server = MmdsServer::start().await;
    let policy = server.policy(GUARD);
    let fetch = tokio::spawn(async move { mmds::fetch(&policy).await });

    // The guest asked before the host wrote anything: 404, retried.
    server
        .wait_for("a 404 from the empty store", |c| c.not_found >= 2)
        .await;
    assert!(!fetch.is_finished());
    server.populate(document("ws://10.0.0.1:7879/ws"));

    let meta = guard("the fetch", fetch).await.unwrap().unwrap();
    assert_eq!(
        Value::Object(meta.clone()),
        document("ws://10.0.0.1:7879/ws")["latest"]["meta-data"]
    );
    // One session token served every attempt.
    assert_eq!(server.state.lock().unwrap().counters.token_puts, 1);
    let boot = mmds::GuestBootstrap::from_meta(&meta).unwrap();
    assert_eq!(boot.env["KICI_AGENT_TOKEN"], TOKEN);
    assert_eq!(boot.env["HTTP_PROXY"], "http://proxy:3128");
}

#[tokio::test]
async fn firecracker_mmds_fetch_treats_a_cleared_store_as_not_populated() {
    let server = MmdsServer::start().await;
    server.populate(json!({"latest": {"meta-data": {}}}));
    let policy = server.policy(GUARD);
    let fetch = tokio::spawn(async move { mmds::fetch(&policy).await });
    // Answers 200 with `{}` do not end the wait; the next PUT does.
    server.wait_for("the token", |c| c.token_puts >= 1).await;
    server.populate(document("ws://10.0.0.1:7879/ws"));
    let meta = guard("the fetch", fetch).await.unwrap().unwrap();
    assert_eq!(meta["kici-agent-id"], "scaler-firecracker-0a1b2c3d");
}

#[tokio::test]
async fn firecracker_mmds_fetch_mints_a_new_token_after_a_401() {
    let server = MmdsServer::start().await;
    server.populate(document("ws://10.0.0.1:7879/ws"));
    server.state.lock().unwrap().revoke_before_next_get = true;
    let meta = guard("the fetch", mmds::fetch(&server.policy(GUARD)))
        .await
        .unwrap();
    assert_eq!(meta["kici-agent-token"], TOKEN);
    let st = server.state.lock().unwrap();
    assert_eq!(st.counters.unauthorized, 1);
    assert_eq!(st.counters.token_puts, 2);
}

#[tokio::test]
async fn firecracker_mmds_fetch_gives_up_at_its_deadline() {
    let server = MmdsServer::start().await;
    let err = guard(
        "the deadline",
        mmds::fetch(&server.policy(Duration::from_millis(300))),
    )
    .await
    .unwrap_err();
    match err {
        MmdsError::Deadline { last, address, .. } => {
            assert_eq!(address, server.address);
            assert!(last.contains("404"), "{last}");
        }
        other => panic!("expected a deadline error, got {other}"),
    }
    assert!(server.state.lock().unwrap().counters.not_found >= 1);

    // Nothing listening at all: the deadline, not a hang or an early error.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = closed.local_addr().unwrap();
    drop(closed);
    let policy = FetchPolicy {
        address,
        deadline: Duration::from_millis(200),
        ..FetchPolicy::default()
    };
    let err = guard("the deadline", mmds::fetch(&policy))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, MmdsError::Deadline { last, .. } if last.contains("connect")),
        "{err}"
    );
}

/// The agent binary with `--bootstrap mmds`: it waits for MMDS, takes the
/// orchestrator URL and token from it and authenticates with that token.
#[tokio::test]
async fn firecracker_agent_takes_its_bootstrap_from_mmds() {
    let gateway = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}/ws", gateway.local_addr().unwrap());
    let server = MmdsServer::start().await;

    let mut agent = tokio::process::Command::new(env!("CARGO_BIN_EXE_kici-agent-lite"))
        .args([
            "--bootstrap",
            "mmds",
            "--mmds-address",
            &server.address.to_string(),
            "--mmds-timeout-secs",
            "60",
        ])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    server
        .wait_for("the agent's first MMDS attempt", |c| c.not_found >= 1)
        .await;
    server.populate(document(&url));

    let (tcp, _) = guard("the agent's connection", async {
        tokio::select! {
            conn = gateway.accept() => conn.unwrap(),
            status = agent.wait() => panic!("the agent exited first: {status:?}"),
        }
    })
    .await;
    let mut ws = tokio_tungstenite::accept_async(tcp).await.unwrap();
    let first = guard("the first frame", ws.next()).await.unwrap().unwrap();
    let first: Value = serde_json::from_str(first.to_text().unwrap()).unwrap();
    assert_eq!(first["type"], "auth.request", "{first}");
    assert!(first.to_string().contains(TOKEN), "{first}");
    agent.kill().await.unwrap();
}

#[tokio::test]
async fn firecracker_agent_exits_with_bad_bootstrap_when_mmds_never_answers() {
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = closed.local_addr().unwrap();
    drop(closed);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kici-agent-lite"))
        .args([
            "--bootstrap",
            "mmds",
            "--mmds-address",
            &address.to_string(),
            "--mmds-timeout-secs",
            "1",
        ])
        .env_clear()
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no bootstrap from MMDS"), "{stderr}");
    // AgentExit::BadBootstrap.
    assert_eq!(out.status.code(), Some(2));
}
