//! The web console in a real browser: Debian's headless Chromium, driven
//! over the Chrome DevTools Protocol, against the real daemon (bare-metal
//! backend, the real `kici-agent-lite`). What a person would do: open the
//! link, look at the scaler, watch an agent come, run a job and read its
//! output, cancel it, cordon the scaler, use a wrong token. Screenshots of
//! the main views go to `target/ui-shots/`.
//!
//! The protocol client is the few commands these tests need (a page,
//! navigate, evaluate, screenshot) over the WebSocket client the gateway
//! tests already use; a full CDP crate would add a large generated API and
//! minutes of build on small CI machines for no more than this.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::daemon::{agent_lite_dir, Daemon, Dir, BIN, TEST_API_TOKEN};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Longest a page may take to show what a test waits for; only a safety
/// net against a hang (nothing waits for it on success).
const PATIENCE: Duration = Duration::from_secs(30);

/// Where the screenshots go: `target/ui-shots/` beside the binary's
/// profile directory.
fn shots_dir() -> PathBuf {
    let dir = std::path::Path::new(BIN)
        .parent()
        .and_then(|p| p.parent())
        .unwrap()
        .join("ui-shots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Headless Chromium with a private profile; killed when dropped.
struct Browser {
    child: Child,
    ws: WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>,
    session: String,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    /// Starts Chromium and opens one page of 1400×1000.
    async fn start() -> Browser {
        let profile = tempfile::Builder::new()
            .prefix("kici-scaler-chromium-")
            .tempdir()
            .unwrap();
        let child = Command::new("chromium")
            .args([
                "--headless",
                // Tests run as root, where Chromium's sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromium (scripts/install-deps.sh installs it)");
        // Chromium writes its DevTools port and browser path here once it
        // listens.
        let active = profile.path().join("DevToolsActivePort");
        let deadline = Instant::now() + PATIENCE;
        let url = loop {
            if let Ok(text) = std::fs::read_to_string(&active) {
                let mut lines = text.lines();
                if let (Some(port), Some(path)) = (lines.next(), lines.next()) {
                    break format!("ws://127.0.0.1:{port}{path}");
                }
            }
            assert!(Instant::now() < deadline, "chromium did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let (ws, _) = tokio_tungstenite::connect_async(url.as_str())
            .await
            .unwrap();
        let mut b = Browser {
            child,
            ws,
            session: String::new(),
            next_id: 0,
            _profile: profile,
        };
        let target = b
            .call("Target.createTarget", json!({"url": "about:blank"}))
            .await;
        let attached = b
            .call(
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            )
            .await;
        b.session = attached["sessionId"].as_str().unwrap().to_owned();
        b.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": false}),
        )
        .await;
        b
    }

    /// One protocol command (on the page once attached); its result.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            msg["sessionId"] = json!(self.session);
        }
        self.ws.send(Message::text(msg.to_string())).await.unwrap();
        loop {
            let frame = tokio::time::timeout(PATIENCE, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("{method}: no answer"))
                .expect("the DevTools connection closed")
                .unwrap();
            let Message::Text(text) = frame else { continue };
            let v: Value = serde_json::from_str(text.as_str()).unwrap();
            // Events (no id) and other answers are not ours.
            if v["id"] != json!(id) {
                continue;
            }
            assert!(v["error"].is_null(), "{method}: {}", v["error"]);
            return v["result"].clone();
        }
    }

    async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
    }

    /// The value of a script expression (awaited when a promise); a thrown
    /// exception fails the test.
    async fn eval(&mut self, expression: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "awaitPromise": true, "returnByValue": true}),
            )
            .await;
        assert!(
            r["exceptionDetails"].is_null(),
            "{expression}: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    /// Evaluates `expression` until it is truthy; that value, and how long
    /// it took.
    async fn wait_for(&mut self, what: &str, expression: &str) -> (Value, Duration) {
        let start = Instant::now();
        loop {
            let v = self
                .eval(&format!(
                    "(() => {{ try {{ return {expression}; }} catch (_) {{ return null; }} }})()"
                ))
                .await;
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::String(s) => !s.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return (v, start.elapsed());
            }
            if start.elapsed() > PATIENCE {
                let page = self
                    .eval("document.body ? document.body.innerText : ''")
                    .await;
                panic!(
                    "never: {what}\n--- the page:\n{}",
                    page.as_str().unwrap_or("")
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Clicks the element `selector` names (it must exist).
    async fn click(&mut self, selector: &str) {
        let found = self
            .eval(&format!(
                "(() => {{ const e = document.querySelector({}); if (!e) return false; e.click(); return true; }})()",
                json!(selector)
            ))
            .await;
        assert_eq!(found, json!(true), "no element {selector}");
    }

    /// Clicks `selector`, then the confirmation dialog's Confirm.
    async fn click_confirmed(&mut self, selector: &str) {
        self.click(selector).await;
        self.wait_for(
            "the confirmation dialog",
            "document.getElementById('confirm').open",
        )
        .await;
        self.click("#confirm-ok").await;
    }

    /// A PNG of the page, written to `target/ui-shots/<name>.png`.
    async fn screenshot(&mut self, name: &str) -> PathBuf {
        use base64::Engine as _;
        let r = self
            .call(
                "Page.captureScreenshot",
                json!({"format": "png", "captureBeyondViewport": true}),
            )
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .unwrap();
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        let path = shots_dir().join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        println!("screenshot: {}", path.display());
        path
    }
}

/// One bare-metal scaler `local` of at most 4 agents running the real
/// agent, on a TCP listener (so with the token).
fn daemon() -> (Dir, Daemon) {
    daemon_of(4)
}

/// [`daemon`] with `local` capped at `max_agents`.
fn daemon_of(max_agents: u32) -> (Dir, Daemon) {
    let dir = Dir::with_config("");
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: {max_agents}\n    resourceCap: {{ maxCpu: 8 }}\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
            agent_lite_dir().join("kici-agent-lite").display()
        ),
    )
    .unwrap();
    let d = Daemon::start(&dir, &["--listen", "127.0.0.1:0"], &[]);
    (dir, d)
}

/// The link `kici-scaler ui` prints for this daemon.
fn ui_link(dir: &Dir, d: &Daemon) -> String {
    let out = dir
        .command(&["ui", "--server", &d.server()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_the_daemon_live_and_acts_on_it() {
    let (dir, d) = daemon();
    let link = ui_link(&dir, &d);
    assert_eq!(
        link,
        format!("http://{}/ui/#token={TEST_API_TOKEN}", d.addr),
        "the link carries the token in its fragment"
    );
    let mut b = Browser::start().await;
    b.navigate(&link).await;

    // It loads, strips the token from the address, shows the scaler and
    // its caps.
    b.wait_for(
        "the live stream",
        "window.kiciConsole.state.ready && window.kiciConsole.state.connected",
    )
    .await;
    let href = b.eval("location.href").await;
    assert_eq!(
        href,
        json!(format!("http://{}/ui/", d.addr)),
        "token left in the address bar"
    );
    let caps = b
        .wait_for(
            "the scaler's caps",
            "document.querySelector('[data-scaler=local] .caps').innerText",
        )
        .await
        .0;
    let caps = caps.as_str().unwrap();
    assert!(caps.contains("0 / 4, free 4"), "agents cap: {caps}");
    assert!(caps.contains("0 / 8, free 8"), "cpus cap: {caps}");

    // An agent appears within a second of POST /v1/scale.
    let posted = Instant::now();
    let (status, answer) = d.scale("ui-job-1", &["local"]);
    assert_eq!(status, 202, "{answer}");
    let agent = answer["agentId"].as_str().unwrap().to_owned();
    let row = format!("#agents tbody tr[data-id={}]", json!(agent));
    b.wait_for(
        "the agent's row",
        &format!("document.querySelector({})", json!(row)),
    )
    .await;
    let seen_after = posted.elapsed();
    println!("the agent's row appeared {seen_after:?} after POST /v1/scale");
    assert!(
        seen_after < Duration::from_secs(1),
        "the agent appeared after {seen_after:?}"
    );
    // Its state follows the events: it registers (and waits for the
    // orchestrator's job).
    b.wait_for(
        "the agent registered in the table",
        &format!(
            "document.querySelector({}).children[3].textContent === 'registered'",
            json!(row)
        ),
    )
    .await;
    b.click(&row).await;
    b.wait_for(
        "the agent's transitions",
        "document.querySelectorAll('#agent-detail .transitions tr').length >= 2",
    )
    .await;
    b.screenshot("console").await;

    // A standalone job: its output streams, then cancel stops it.
    b.eval(
        r#"(() => {
            document.getElementById('job-labels').value = 'local';
            document.getElementById('job-command').value =
                '["sh", "-c", "echo first-line; sleep 0.3; echo second-line; exec sleep 1000"]';
            document.querySelector('#job-form button').click();
            return true;
        })()"#,
    )
    .await;
    b.wait_for(
        "the job's output",
        "document.getElementById('job-output').textContent.includes('second-line')",
    )
    .await;
    let output = b
        .eval("document.getElementById('job-output').textContent")
        .await;
    assert_eq!(output, json!("first-line\nsecond-line\n"));
    let job = b
        .eval("document.getElementById('job-output-id').textContent")
        .await;
    let job = job.as_str().unwrap().to_owned();
    let (_, view) = d.http("GET", &format!("/v1/jobs/{job}"), None);
    assert!(view.contains("\"state\":\"running\""), "{view}");
    b.wait_for(
        "the job listed as running",
        &format!(
            "document.querySelector('#jobs tr[data-job={}] .state').textContent === 'running'",
            json!(job)
        ),
    )
    .await;
    b.screenshot("job-output").await;
    b.click_confirmed(&format!(
        "button[data-action=cancel-job][data-job={}]",
        json!(job)
    ))
    .await;
    b.wait_for(
        "the job cancelled",
        "document.getElementById('job-output-state').textContent.startsWith('cancelled')",
    )
    .await;
    let (_, view) = d.http("GET", &format!("/v1/jobs/{job}"), None);
    assert!(view.contains("\"state\":\"cancelled\""), "{view}");

    // Cordon changes the scaler's state, in the daemon and on the page.
    b.click_confirmed("button[data-action=cordon][data-scaler=local]")
        .await;
    b.wait_for(
        "the scaler cordoned",
        "document.querySelector('[data-scaler=local] .flags').textContent.includes('cordoned')",
    )
    .await;
    let (_, status) = d.http("GET", "/v1/status", None);
    assert!(status.contains("\"cordoned\":true"), "{status}");
    b.screenshot("cordoned").await;

    // The render budget: 1,000 rows, then every one of them changed.
    let mut updates = Vec::new();
    let mut firsts = Vec::new();
    for _ in 0..5 {
        let m = b.eval("window.kiciConsole.bench(1000)").await;
        firsts.push(m["firstMs"].as_f64().unwrap());
        updates.push(m["updateMs"].as_f64().unwrap());
    }
    updates.sort_by(f64::total_cmp);
    firsts.sort_by(f64::total_cmp);
    let (first, update) = (firsts[2], updates[2]);
    println!(
        "render budget: 1000 rows drawn in {first:.1} ms, updated in {update:.1} ms (medians of 5: {firsts:?} / {updates:?})"
    );
    assert!(update < 50.0, "an update of 1,000 rows took {update} ms");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_with_the_apis_words() {
    let (_dir, d) = daemon();
    let mut b = Browser::start().await;
    b.navigate(&format!("http://{}/ui/#token=not-the-token", d.addr))
        .await;
    let (shown, _) = b
        .wait_for(
            "the refusal",
            "!document.getElementById('error').hidden && document.getElementById('error-text').textContent",
        )
        .await;
    let (_, answer) = crate::common::daemon::http(
        &d.addr,
        "GET",
        "/v1/status",
        &[("Authorization", "Bearer not-the-token")],
        None,
    );
    let message: Value = serde_json::from_str(&answer).unwrap();
    let message = message["error"]["message"].as_str().unwrap();
    assert!(
        shown.as_str().unwrap().contains(message),
        "shown {shown}, the API said {message:?}"
    );
    assert_eq!(
        b.eval("document.getElementById('login').hidden").await,
        json!(false),
        "the token form is offered again"
    );
    b.screenshot("wrong-token").await;

    // The right one, typed into the form, opens the console.
    b.eval(&format!(
        "(() => {{ document.getElementById('token').value = {}; document.querySelector('#login-form button').click(); return true; }})()",
        json!(TEST_API_TOKEN)
    ))
    .await;
    b.wait_for(
        "the console after the right token",
        "window.kiciConsole.state.ready && document.querySelector('[data-scaler=local]')",
    )
    .await;
    assert_eq!(
        b.eval("sessionStorage.getItem('kici-scaler-token')").await,
        json!(TEST_API_TOKEN)
    );
}

/// `GET /v1/status` as JSON: (the global `oldestPendingSeconds`, scaler
/// `local`'s).
fn oldest_pending_of(d: &Daemon) -> (Value, Value) {
    let (code, body) = d.http("GET", "/v1/status", None);
    assert_eq!(code, 200, "{body}");
    let status: Value = serde_json::from_str(&body).unwrap();
    let local = status["scalers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "local")
        .unwrap()
        .clone();
    (
        status["oldestPendingSeconds"].clone(),
        local["oldestPendingSeconds"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_how_long_the_oldest_pending_request_has_waited() {
    let (dir, d) = daemon_of(1);
    let link = ui_link(&dir, &d);
    let mut b = Browser::start().await;
    b.navigate(&link).await;
    b.wait_for(
        "the live stream",
        "window.kiciConsole.state.ready && window.kiciConsole.state.connected",
    )
    .await;
    // Nothing waits: no age, in the API or on the page.
    assert_eq!(oldest_pending_of(&d), (Value::Null, Value::Null));
    assert_eq!(
        b.eval("document.querySelector('[data-scaler=local] .pending').textContent")
            .await,
        json!("0")
    );

    // The one agent `local` may have takes the first request; the second
    // waits.
    let (code, answer) = d.scale("ui-first", &["local"]);
    assert_eq!(code, 202, "{answer}");
    let (code, answer) = d.scale("ui-waits", &["local"]);
    assert_eq!((code, answer["result"].as_str()), (200, Some("pending")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (global, local) = oldest_pending_of(&d);
    let (global, local) = (global.as_f64().unwrap(), local.as_f64().unwrap());
    assert!(local >= 0.3, "local's oldest pending: {local} s");
    assert!(global >= local, "global {global} s, local {local} s");
    // The same age as a gauge, for dashboards and alerts.
    let (code, metrics) = d.http("GET", "/metrics", None);
    assert_eq!(code, 200);
    let gauge: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kici_orch_scaler_pending_oldest_seconds{scaler=\"local\"} "))
        .unwrap_or_else(|| panic!("no pending_oldest gauge for local:\n{metrics}"))
        .parse()
        .unwrap();
    assert!(gauge >= 0.3, "the gauge says {gauge} s");

    // The page shows the count and the age, and the age moves on between
    // two reads of the status (the same status object, an older age).
    let age = "document.querySelector('[data-scaler=local] .pending .age')";
    b.wait_for("the pending age", age).await;
    let text = b
        .eval("document.querySelector('[data-scaler=local] .pending').textContent")
        .await;
    let text = text.as_str().unwrap().to_owned();
    assert!(
        text.starts_with("1, oldest ") && text.ends_with('s'),
        "{text}"
    );
    let mut ticked = None;
    for _ in 0..5 {
        let before = b
            .eval(&format!(
                "(() => {{ window.seen = window.kiciConsole.state.status; return [Number({age}.dataset.age), {age}.textContent]; }})()"
            ))
            .await;
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let after = b
            .eval(&format!(
                "[Number({age}.dataset.age), {age}.textContent, window.seen === window.kiciConsole.state.status]"
            ))
            .await;
        if after[2] == json!(true) {
            ticked = Some((before, after));
            break;
        }
    }
    let (before, after) = ticked.expect("the status was re-read within every 2 s window");
    let (a0, a1) = (before[0].as_f64().unwrap(), after[0].as_f64().unwrap());
    assert!(a0 > 0.0, "age shown {a0} s");
    assert!(
        a1 >= a0 + 1.0,
        "the age did not move on without a refresh: {before} then {after}"
    );
    assert_ne!(before[1], after[1], "the age shown did not change");
    // The global pending line shows it too.
    b.wait_for(
        "the global pending age",
        "document.querySelector('#global .pending .age')",
    )
    .await;

    // Not highlighted while young; highlighted past the threshold (lowered
    // here: the default is a minute).
    assert_eq!(
        b.eval(&format!("{age}.classList.contains('warn')")).await,
        json!(false)
    );
    b.eval("window.kiciConsole.state.pendingWarnS = 1").await;
    b.wait_for(
        "the old pending request highlighted",
        "document.querySelector('[data-scaler=local] .pending .age.warn')",
    )
    .await;
    b.screenshot("pending-age").await;

    // Cancelled: nothing waits, no age.
    let (code, body) = d.http("DELETE", "/v1/scale/ui-waits", None);
    assert_eq!(code, 204, "{body}");
    assert_eq!(oldest_pending_of(&d), (Value::Null, Value::Null));
    b.wait_for(
        "the age gone",
        "document.querySelector('[data-scaler=local] .pending').textContent === '0'",
    )
    .await;
}
