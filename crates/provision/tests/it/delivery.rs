//! Delivery against real provisioners: shell scripts run as commands, and a
//! loopback HTTP receiver (hyper) that checks signatures the way an
//! operator's receiver would, with [`verify_signature`].

#![allow(clippy::unwrap_used, clippy::expect_used)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kici_provision::command::{self, CommandEnv, EventEnv};
use kici_provision::config::{CommandTarget, WebhookTarget};
use kici_provision::signature::{verify_signature, SignatureError, REPLAY_WINDOW};
use kici_provision::webhook::WebhookTls;
use kici_provision::{
    ClaimCode, Deliverer, EventKind, EventResources, ProvisionEvent, ProvisionerConfig, RequestId,
    RetryPolicy, ScaleDown, ScaleDownReason, ScaleUp, TargetKind, Timestamp,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;

/// State the receiver shares with the test (held only briefly).
type Shared<T> = Arc<std::sync::Mutex<T>>;

const SECRET: &str = "receiver-shared-secret";

fn scale_up(agent: &str) -> ProvisionEvent {
    ProvisionEvent::ScaleUp(ScaleUp {
        request_id: RequestId::derive("0a1b2c3d", agent, EventKind::ScaleUp),
        agent_id: agent.into(),
        scaler: "cloud".into(),
        labels: vec!["linux".into(), "x64".into()],
        resources: EventResources::default(),
        claim_code: ClaimCode::generate(),
        claim_url: "http://127.0.0.1:9/v1/claims".into(),
        expires_at: Timestamp::now().saturating_add(Duration::from_secs(300)),
        job_id: Some("job-1".into()),
    })
}

fn scale_down(agent: &str) -> ProvisionEvent {
    ProvisionEvent::ScaleDown(ScaleDown {
        request_id: RequestId::derive("0a1b2c3d", agent, EventKind::ScaleDown),
        agent_id: agent.into(),
        scaler: "cloud".into(),
        reason: ScaleDownReason::JobEnd,
    })
}

fn fast_retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        initial_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(40),
    }
}

/// Writes an executable `sh` script into `dir`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn command_config(argv: Vec<String>, timeout: Duration, retry: RetryPolicy) -> ProvisionerConfig {
    ProvisionerConfig {
        command: Some(CommandTarget { argv }),
        webhook: None,
        env: Default::default(),
        pass_env: Vec::new(),
        timeout,
        retry,
    }
}

fn no_env(_: &str) -> Option<String> {
    None
}

/// What a command gets from a daemon with an empty environment (`PATH`'s
/// default).
fn base_env() -> CommandEnv {
    CommandEnv::resolve(
        &command_config(Vec::new(), Duration::from_secs(1), fast_retry(1)),
        no_env,
    )
}

/// Whether `pid` is gone (or a zombie waiting for a reaper that is not us).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

async fn wait_gone(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !process_gone(pid) {
        assert!(Instant::now() < deadline, "process {pid} is still alive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn command_gets_the_event_on_stdin_and_exit_zero_delivers() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("stdin.json");
    let env_out = dir.path().join("env.txt");
    let s = script(
        dir.path(),
        "provision",
        &format!(
            "cat > {out}\necho \"$PROVISION_EVENT $PROVISION_REQUEST_ID $PROVISION_AGENT_ID\" > {env}\necho booted",
            out = out.display(),
            env = env_out.display()
        ),
    );
    let d = Deliverer::new(
        &command_config(
            vec![s.display().to_string()],
            Duration::from_secs(10),
            fast_retry(3),
        ),
        no_env,
    )
    .unwrap();
    for event in [
        scale_up("scaler-event-00000001"),
        scale_down("scaler-event-00000001"),
    ] {
        let outcome = d.deliver(&event).await;
        assert!(outcome.delivered(), "{outcome:?}");
        assert_eq!(outcome.reports.len(), 1);
        assert_eq!(outcome.reports[0].target, TargetKind::Command);
        assert_eq!(outcome.reports[0].attempts, 1);
        let recorded = std::fs::read(&out).unwrap();
        assert_eq!(recorded, event.to_json().unwrap());
        assert_eq!(ProvisionEvent::from_json(&recorded).unwrap(), event);
        assert_eq!(
            std::fs::read_to_string(&env_out).unwrap().trim(),
            format!(
                "{} {} scaler-event-00000001",
                event.kind(),
                event.request_id()
            )
        );
    }
}

#[tokio::test]
async fn command_failing_twice_is_retried_until_it_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let count = dir.path().join("count");
    let s = script(
        dir.path(),
        "flaky",
        &format!(
            "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}\ncat >/dev/null\n[ $n -ge 3 ] || {{ echo \"attempt $n fails\" >&2; exit 1; }}",
            c = count.display()
        ),
    );
    let d = Deliverer::new(
        &command_config(
            vec![s.display().to_string()],
            Duration::from_secs(10),
            fast_retry(5),
        ),
        no_env,
    )
    .unwrap();
    let outcome = d.deliver(&scale_up("scaler-event-00000002")).await;
    assert!(outcome.delivered(), "{outcome:?}");
    assert_eq!(outcome.reports[0].attempts, 3);
    assert_eq!(std::fs::read_to_string(&count).unwrap().trim(), "3");
}

#[tokio::test]
async fn command_failing_every_time_is_a_final_failure_after_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let count = dir.path().join("count");
    let s = script(
        dir.path(),
        "broken",
        &format!("echo x >> {c}\nexit 3", c = count.display()),
    );
    let d = Deliverer::new(
        &command_config(
            vec![s.display().to_string()],
            Duration::from_secs(10),
            fast_retry(2),
        ),
        no_env,
    )
    .unwrap();
    let outcome = d.deliver(&scale_up("scaler-event-00000003")).await;
    assert!(!outcome.delivered());
    assert_eq!(outcome.reports[0].attempts, 2);
    assert_eq!(
        outcome.reports[0].failure.as_deref(),
        Some("exited with status 3")
    );
    assert_eq!(std::fs::read_to_string(&count).unwrap().lines().count(), 2);
    assert!(outcome
        .failure_summary()
        .unwrap()
        .contains("command after 2 attempt(s)"));

    let missing = Deliverer::new(
        &command_config(
            vec![dir.path().join("nope").display().to_string()],
            Duration::from_secs(10),
            fast_retry(1),
        ),
        no_env,
    )
    .unwrap();
    let outcome = missing.deliver(&scale_up("scaler-event-00000003")).await;
    assert!(outcome.reports[0]
        .failure
        .as_deref()
        .unwrap()
        .starts_with("could not start"));
}

#[tokio::test]
async fn a_hanging_command_is_killed_with_its_whole_process_group() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    // The script and a child of it both hang; the child ignores SIGTERM.
    let s = script(
        dir.path(),
        "hang",
        &format!(
            "trap '' TERM\nsleep 300 &\necho \"$$ $!\" > {p}\nwait",
            p = pids.display()
        ),
    );
    let d = Deliverer::new(
        &command_config(
            vec![s.display().to_string()],
            Duration::from_millis(700),
            fast_retry(1),
        ),
        no_env,
    )
    .unwrap();
    let started = Instant::now();
    let outcome = d.deliver(&scale_up("scaler-event-00000004")).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!outcome.delivered());
    assert!(
        outcome.reports[0]
            .failure
            .as_deref()
            .unwrap()
            .starts_with("timed out; its process group was killed"),
        "{outcome:?}"
    );
    let text = std::fs::read_to_string(&pids).unwrap();
    let ids: Vec<u32> = text
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 2);
    for pid in ids {
        wait_gone(pid).await;
    }
}

#[tokio::test]
async fn output_is_captured_up_to_the_bound_with_a_marker() {
    let dir = tempfile::tempdir().unwrap();
    // 200 KiB on stdout, a short line on stderr.
    let s = script(
        dir.path(),
        "loud",
        "head -c 204800 /dev/zero | tr '\\0' 'a'\necho 'something on stderr' >&2",
    );
    let attempt = command::run_once(
        &[s.display().to_string()],
        b"{}",
        EventEnv {
            event: "scale-up",
            request_id: "r",
            agent_id: "a",
            base: &base_env(),
        },
        Duration::from_secs(10),
        64 * 1024,
    )
    .await;
    assert!(attempt.delivered(), "{:?}", attempt.end);
    assert_eq!(attempt.stdout.bytes.len(), 64 * 1024);
    assert_eq!(attempt.stdout.truncated, 204_800 - 64 * 1024);
    assert!(attempt
        .stdout
        .text()
        .ends_with(&format!("…[{} bytes truncated]", 204_800 - 64 * 1024)));
    assert_eq!(attempt.stderr.text(), "something on stderr\n");
}

#[tokio::test]
async fn a_detached_child_holding_the_pipes_does_not_hold_up_delivery() {
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("pid");
    let s = script(
        dir.path(),
        "detach",
        &format!(
            "echo started\nsleep 30 &\necho $! > {p}\nexit 0",
            p = pid_file.display()
        ),
    );
    let started = Instant::now();
    let attempt = command::run_once(
        &[s.display().to_string()],
        b"{}",
        EventEnv {
            event: "scale-up",
            request_id: "r",
            agent_id: "a",
            base: &base_env(),
        },
        Duration::from_secs(10),
        1024,
    )
    .await;
    assert!(attempt.delivered());
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(attempt.stdout.still_open);
    assert!(attempt.stdout.text().starts_with("started\n"));
    // A command that exited 0 is not chased; the test cleans up its child.
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _ = std::process::Command::new("kill")
        .arg(pid.to_string())
        .status();
}

/// One request as the receiver saw it.
#[derive(Debug, Clone)]
struct Received {
    timestamp: String,
    signature: String,
    event_header: String,
    request_id_header: String,
    body: Vec<u8>,
}

/// A loopback webhook receiver: verifies each request with its secret,
/// answers 401 to a bad signature, `fail_first` × 500, then 200 — or never
/// answers when `hang`.
struct Receiver {
    url: String,
    seen: Shared<Vec<Received>>,
}

impl Receiver {
    async fn start(secret: &'static str, fail_first: usize, hang: bool) -> Self {
        Self::start_with(secret, fail_first, hang, None).await
    }

    /// With `tls`, an https receiver.
    async fn start_with(
        secret: &'static str,
        fail_first: usize,
        hang: bool,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "{}://{}/hooks/kici?src=test",
            if tls.is_some() { "https" } else { "http" },
            listener.local_addr().unwrap()
        );
        let seen: Shared<Vec<Received>> = Arc::default();
        let seen2 = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let seen = seen2.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let seen = seen.clone();
                        async move {
                            assert_eq!(req.method(), hyper::Method::POST);
                            assert_eq!(req.uri().path(), "/hooks/kici");
                            assert_eq!(req.uri().query(), Some("src=test"));
                            let h = |name: &str| {
                                req.headers()
                                    .get(name)
                                    .and_then(|v| v.to_str().ok())
                                    .unwrap_or_default()
                                    .to_owned()
                            };
                            assert_eq!(h("content-type"), "application/json");
                            let got = Received {
                                timestamp: h("x-kici-timestamp"),
                                signature: h("x-kici-signature"),
                                event_header: h("x-kici-event"),
                                request_id_header: h("x-kici-request-id"),
                                body: Vec::new(),
                            };
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let got = Received {
                                body: body.to_vec(),
                                ..got
                            };
                            let n = {
                                let mut s = seen.lock().unwrap();
                                s.push(got.clone());
                                s.len()
                            };
                            if hang {
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                            }
                            let now = SystemTime::now()
                                .duration_since(UNIX_EPOCH)
                                .unwrap()
                                .as_secs();
                            let status = match verify_signature(
                                secret.as_bytes(),
                                &got.timestamp,
                                &got.signature,
                                &got.body,
                                now,
                                REPLAY_WINDOW,
                            ) {
                                Err(_) => 401,
                                Ok(()) if n <= fail_first => 500,
                                Ok(()) => 200,
                            };
                            Ok::<_, std::convert::Infallible>(
                                hyper::Response::builder()
                                    .status(status)
                                    .body(Full::new(Bytes::from(format!("status {status}"))))
                                    .unwrap(),
                            )
                        }
                    });
                    let http = hyper::server::conn::http1::Builder::new();
                    match tls {
                        None => {
                            let _ = http.serve_connection(TokioIo::new(tcp), service).await;
                        }
                        Some(acceptor) => {
                            // A client that refuses our certificate ends here.
                            let Ok(stream) = acceptor.accept(tcp).await else {
                                return;
                            };
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                    }
                });
            }
        });
        Self { url, seen }
    }

    fn seen(&self) -> Vec<Received> {
        self.seen.lock().unwrap().clone()
    }
}

fn webhook_config(url: &str, timeout: Duration, retry: RetryPolicy) -> ProvisionerConfig {
    ProvisionerConfig {
        command: None,
        webhook: Some(WebhookTarget {
            url: url.parse().unwrap(),
            secret_env: "HOOK_SECRET".into(),
        }),
        env: Default::default(),
        pass_env: Vec::new(),
        timeout,
        retry,
    }
}

fn secret_env(value: &'static str) -> impl Fn(&str) -> Option<String> {
    move |name| (name == "HOOK_SECRET").then(|| value.to_owned())
}

#[tokio::test]
async fn webhook_is_signed_and_the_receiver_verifies_it() {
    let rx = Receiver::start(SECRET, 0, false).await;
    let d = Deliverer::new(
        &webhook_config(&rx.url, Duration::from_secs(5), fast_retry(3)),
        secret_env(SECRET),
    )
    .unwrap();
    let event = scale_up("scaler-event-00000005");
    let outcome = d.deliver(&event).await;
    assert!(outcome.delivered(), "{outcome:?}");
    assert_eq!(outcome.reports[0].target, TargetKind::Webhook);
    assert_eq!(outcome.reports[0].attempts, 1);
    let seen = rx.seen();
    assert_eq!(seen.len(), 1);
    let got = &seen[0];
    assert_eq!(got.body, event.to_json().unwrap());
    assert_eq!(ProvisionEvent::from_json(&got.body).unwrap(), event);
    assert_eq!(got.event_header, "scale-up");
    assert_eq!(got.request_id_header, event.request_id().as_str());
    // The signature is real: the same request fails the check under any
    // other secret, or with its body or timestamp changed.
    let ts: u64 = got.timestamp.parse().unwrap();
    assert_eq!(
        verify_signature(
            SECRET.as_bytes(),
            &got.timestamp,
            &got.signature,
            &got.body,
            ts,
            REPLAY_WINDOW
        ),
        Ok(())
    );
    assert_eq!(
        verify_signature(
            b"wrong-secret",
            &got.timestamp,
            &got.signature,
            &got.body,
            ts,
            REPLAY_WINDOW
        ),
        Err(SignatureError::Mismatch)
    );
    let mut tampered = got.body.clone();
    tampered.push(b' ');
    assert_eq!(
        verify_signature(
            SECRET.as_bytes(),
            &got.timestamp,
            &got.signature,
            &tampered,
            ts,
            REPLAY_WINDOW
        ),
        Err(SignatureError::Mismatch)
    );
    assert_eq!(
        verify_signature(
            SECRET.as_bytes(),
            &(ts + 1).to_string(),
            &got.signature,
            &got.body,
            ts,
            REPLAY_WINDOW
        ),
        Err(SignatureError::Mismatch)
    );
    assert_eq!(
        verify_signature(
            SECRET.as_bytes(),
            &got.timestamp,
            &got.signature,
            &got.body,
            ts + REPLAY_WINDOW.as_secs() + 1,
            REPLAY_WINDOW
        ),
        Err(SignatureError::Stale)
    );
}

#[tokio::test]
async fn a_deliverer_with_the_wrong_secret_is_rejected_by_the_receiver() {
    let rx = Receiver::start(SECRET, 0, false).await;
    let d = Deliverer::new(
        &webhook_config(&rx.url, Duration::from_secs(5), fast_retry(2)),
        secret_env("not-the-receivers-secret"),
    )
    .unwrap();
    let outcome = d.deliver(&scale_down("scaler-event-00000006")).await;
    assert!(!outcome.delivered());
    assert_eq!(outcome.reports[0].attempts, 2);
    assert_eq!(
        outcome.reports[0].failure.as_deref(),
        Some("answered 401: status 401")
    );
    assert_eq!(rx.seen().len(), 2);
}

#[tokio::test]
async fn webhook_errors_are_retried_and_each_attempt_signed_afresh() {
    let rx = Receiver::start(SECRET, 2, false).await;
    let d = Deliverer::new(
        &webhook_config(&rx.url, Duration::from_secs(5), fast_retry(5)),
        secret_env(SECRET),
    )
    .unwrap();
    let event = scale_down("scaler-event-00000007");
    let outcome = d.deliver(&event).await;
    assert!(outcome.delivered(), "{outcome:?}");
    assert_eq!(outcome.reports[0].attempts, 3);
    let seen = rx.seen();
    assert_eq!(seen.len(), 3);
    // Every attempt carries the same body, so the same requestId.
    assert!(seen.iter().all(|r| r.body == seen[0].body));
}

#[tokio::test]
async fn webhook_that_never_answers_times_out_and_a_closed_port_fails() {
    let rx = Receiver::start(SECRET, 0, true).await;
    let d = Deliverer::new(
        &webhook_config(&rx.url, Duration::from_millis(500), fast_retry(1)),
        secret_env(SECRET),
    )
    .unwrap();
    let started = Instant::now();
    let outcome = d.deliver(&scale_up("scaler-event-00000008")).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(outcome.reports[0]
        .failure
        .as_deref()
        .unwrap()
        .starts_with("no answer within the timeout"));

    // A port nobody listens on.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", closed.local_addr().unwrap());
    drop(closed);
    let d = Deliverer::new(
        &webhook_config(&url, Duration::from_secs(2), fast_retry(2)),
        secret_env(SECRET),
    )
    .unwrap();
    let outcome = d.deliver(&scale_up("scaler-event-00000008")).await;
    assert_eq!(outcome.reports[0].attempts, 2);
    assert!(outcome.reports[0]
        .failure
        .as_deref()
        .unwrap()
        .starts_with("no answer: connect to 127.0.0.1:"));
}

#[tokio::test]
async fn a_missing_secret_refuses_to_build_a_deliverer() {
    let err = Deliverer::new(
        &webhook_config("http://127.0.0.1:9/", Duration::from_secs(1), fast_retry(1)),
        no_env,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "webhook secret: environment variable HOOK_SECRET is not set or empty"
    );
}

#[tokio::test]
async fn both_targets_get_the_event_and_both_must_take_it() {
    let rx = Receiver::start(SECRET, 0, false).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("stdin.json");
    let s = script(dir.path(), "provision", &format!("cat > {}", out.display()));
    let mut config = webhook_config(&rx.url, Duration::from_secs(5), fast_retry(2));
    config.command = Some(CommandTarget {
        argv: vec![s.display().to_string()],
    });
    let d = Deliverer::new(&config, secret_env(SECRET)).unwrap();
    let event = scale_up("scaler-event-00000009");
    let outcome = d.deliver(&event).await;
    assert!(outcome.delivered(), "{outcome:?}");
    let targets: Vec<_> = outcome.reports.iter().map(|r| r.target).collect();
    assert_eq!(targets, [TargetKind::Command, TargetKind::Webhook]);
    assert_eq!(std::fs::read(&out).unwrap(), event.to_json().unwrap());
    assert_eq!(rx.seen()[0].body, event.to_json().unwrap());

    // The command failing fails the delivery even though the webhook took it.
    let bad = script(dir.path(), "bad", "exit 1");
    config.command = Some(CommandTarget {
        argv: vec![bad.display().to_string()],
    });
    let d = Deliverer::new(&config, secret_env(SECRET)).unwrap();
    let outcome = d.deliver(&event).await;
    assert!(!outcome.delivered());
    assert!(outcome.reports[1].failure.is_none());
}

/// A self-signed certificate for 127.0.0.1 and a TLS acceptor serving it.
fn self_signed() -> (
    rustls::pki_types::CertificateDer<'static>,
    tokio_rustls::TlsAcceptor,
) {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
        ck.key_pair.serialize_der(),
    ));
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![cert.clone()], key)
    .unwrap();
    (cert, tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

#[tokio::test]
async fn an_https_webhook_is_verified_against_its_roots() {
    let (cert, acceptor) = self_signed();
    let rx = Receiver::start_with(SECRET, 0, false, Some(acceptor)).await;
    assert!(rx.url.starts_with("https://127.0.0.1:"));
    let config = webhook_config(&rx.url, Duration::from_secs(5), fast_retry(1));

    let trusting = Deliverer::new(&config, secret_env(SECRET))
        .unwrap()
        .with_webhook_tls(WebhookTls::with_roots([cert]).unwrap());
    let event = scale_up("scaler-event-0000000a");
    let outcome = trusting.deliver(&event).await;
    assert!(outcome.delivered(), "{outcome:?}");
    assert_eq!(rx.seen()[0].body, event.to_json().unwrap());

    // Roots without its certificate refuse it before anything is sent.
    let (other_cert, _) = self_signed();
    let distrusting = Deliverer::new(&config, secret_env(SECRET))
        .unwrap()
        .with_webhook_tls(WebhookTls::with_roots([other_cert]).unwrap());
    let outcome = distrusting.deliver(&event).await;
    assert!(!outcome.delivered());
    let failure = outcome.reports[0].failure.clone().unwrap();
    assert!(
        failure.starts_with("no answer: TLS with 127.0.0.1"),
        "{failure}"
    );
    assert_eq!(rx.seen().len(), 1, "nothing reached the receiver");
}
