//! The real `kici-scaler serve` process: start-up refusals, the API over
//! TCP, a unix socket and TLS, the CLI clients, SIGHUP and SIGTERM. Backends
//! are the in-memory ones (`--memory-backends`, a test-build flag); ports are
//! chosen by the kernel (`127.0.0.1:0`) and read from the start-up log.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{http, log_message, Daemon, Dir, BIN, PATIENCE};
use common::take_sse_events;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, Output};

const CONFIG: &str = "\
version: 1
globalMaxAgents: 10
scalers:
  - name: local
    type: bare-metal
    maxAgents: 2
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

/// The CLI against `server`.
fn cli(server: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).arg("--server").arg(server);
    for (k, _) in std::env::vars() {
        if k.starts_with("KICI_") {
            cmd.env_remove(k);
        }
    }
    cmd.env(
        "KICI_SCALER_API_TOKEN",
        crate::common::daemon::TEST_API_TOKEN,
    )
    .envs(env.iter().copied())
    .output()
    .unwrap()
}

fn stdout_json(o: &Output) -> Value {
    let text = String::from_utf8(o.stdout.clone()).unwrap();
    let docs: Vec<Value> = serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {text}"));
    assert_eq!(docs.len(), 1, "exactly one document: {text}");
    docs.into_iter().next().unwrap()
}

// --------------------------------------------------------------- start-up

#[test]
fn start_up_refuses_a_bad_config_with_every_error() {
    let dir = Dir::with_config(CONFIG);
    std::fs::write(
        dir.path("scalers.yaml"),
        "version: 1\nscalers:\n  - name: a\n    type: nope\n    maxAgents: -1\n    labelSets: []\n",
    )
    .unwrap();
    let out = dir
        .serve_command(&["--memory-backends", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let located: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with(&format!("{}:", dir.path("scalers.yaml").display())))
        .collect();
    assert!(located.len() >= 2, "every error, one per line:\n{err}");
}

#[test]
fn start_up_refuses_a_backend_that_cannot_start_here() {
    // Every scaler type has a backend now; what can still be missing is
    // the host side of one — here the Firecracker bridge, which start-up
    // only checks when told not to provision it.
    let dir = Dir::with_config(CONFIG);
    let bridge = format!("kbn{:08x}", rand::random::<u32>());
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nfirecracker:\n  cidr: 10.214.0.0/24\n  bridgeName: {bridge}\n  autoProvisionHost: false\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [local]\n        binaryPath: /bin/true\n  - name: vm\n    type: firecracker\n    maxAgents: 1\n    firecrackerPath: /nonexistent/firecracker\n    jailerPath: /nonexistent/jailer\n    kernelPath: /nonexistent/vmlinux\n    chrootBaseDir: /srv/jailer\n    uid: 10000\n    gid: 10000\n    labelSets:\n      - labels: [vm]\n        rootfsPath: /nonexistent/rootfs.ext4\n"
        ),
    )
    .unwrap();
    let out = dir
        .serve_command(&["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("scalers[name=vm]: the firecracker backend cannot start on this host")
            && err.contains(&format!("bridge {bridge}: {bridge} does not exist"))
            && err.contains("kici-scaler firecracker provision"),
        "{err}"
    );
    assert!(
        !err.contains("scalers[name=local]"),
        "bare-metal starts fine: {err}"
    );
}

#[test]
fn start_up_refuses_what_the_bare_metal_backend_rejects() {
    let dir = Dir::with_config(CONFIG);
    std::fs::write(
        dir.path("scalers.yaml"),
        "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [local]\n        binaryPath: /nonexistent/kici-agent\n",
    )
    .unwrap();
    let out = dir
        .serve_command(&["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("scalers[name=local]") && err.contains("/nonexistent/kici-agent"),
        "{err}"
    );
}

/// A real bare-metal agent: a script that hands its id, pid and token to
/// the test through a FIFO (the test blocks on it, no polling), then waits.
#[test]
fn a_real_bare_metal_agent_registers_with_its_token_and_sigterm_kills_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = Dir::with_config(CONFIG);
    let fifo = dir.path("agent.fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let script = dir.path("agent.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nprintf '%s %s %s\\n' \"$KICI_AGENT_ID\" \"$$\" \"$KICI_AGENT_TOKEN\" > {}\nexec sleep 1000\n",
            fifo.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
            script.display()
        ),
    )
    .unwrap();
    let mut d = Daemon::start(&dir, &["--listen", "127.0.0.1:0"], &[]);
    let (status, body) = http(
        &d.addr,
        "POST",
        "/v1/scale",
        &[],
        Some(r#"{"jobId":"j1","labels":["local"]}"#),
    );
    assert_eq!(status, 202, "{body}");
    let agent = serde_json::from_str::<Value>(&body).unwrap()["agentId"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut line = String::new();
    BufReader::new(std::fs::File::open(&fifo).unwrap())
        .read_line(&mut line)
        .unwrap();
    let parts: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(parts.len(), 3, "{line}");
    assert_eq!(parts[0], agent);
    let pid: i32 = parts[1].parse().unwrap();
    let token = parts[2];
    assert!(token.starts_with("kat_") && token.len() == 68);

    let path = format!("/v1/agents/{agent}/registered");
    let (status, body) = http(&d.addr, "POST", &path, &[], Some(r#"{"token":"kat_0000"}"#));
    assert_eq!(status, 401, "{body}");
    let (status, body) = http(
        &d.addr,
        "POST",
        &path,
        &[],
        Some(&format!(r#"{{"token":"{token}"}}"#)),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["boundJobId"],
        "j1"
    );

    d.signal(rustix::process::Signal::TERM);
    assert_eq!(d.wait_exit().code(), Some(0));
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .next();
    assert!(
        matches!(state, None | Some("Z")),
        "agent process {pid} still runs: {stat}"
    );
    let log: Vec<String> = d.rest_of_log();
    assert!(
        !log.iter().any(|l| l.contains(token)),
        "the token reached the log"
    );
}

#[test]
fn agent_output_in_upstreams_shape_keeps_its_fields_and_never_its_forged_attribution() {
    let dir = Dir::with_config("");
    let script = dir.write_script(
        "agent.sh",
        "#!/bin/sh\n\
         printf '%s\\n' '{\"level\":\"warn\",\"msg\":\"from the agent\",\"step\":2,\"agentId\":\"scaler-bare-metal-deadbeef\",\"scaler\":\"other\",\"jobId\":\"job-x\",\"runId\":\"run-x\",\"logsSource\":\"docker\",\"service\":\"orchestrator\"}'\n\
         echo 'plain words' >&2\n\
         exec sleep 1000\n",
    );
    std::fs::write(
        dir.path("scalers.yaml"),
        format!(
            "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
            script.display()
        ),
    )
    .unwrap();
    let mut d = Daemon::start(
        &dir,
        &["--listen", "127.0.0.1:0", "--agent-log-format", "upstream"],
        &[],
    );
    let (status, body) = d.scale("j1", &["local"]);
    assert_eq!(status, 202, "{body}");
    let agent = body["agentId"].as_str().unwrap().to_owned();

    // stdout and stderr are two pipes, read apart: either line may come
    // first.
    let (mut json, mut plain) = (None, None);
    while json.is_none() || plain.is_none() {
        let v = d.expect_line("the agent's JSON and plain lines", |v| {
            v["msg"] == "from the agent" || v["message"] == "plain words"
        });
        if v["msg"] == "from the agent" {
            json = Some(v);
        } else {
            plain = Some(v);
        }
    }
    let (json, plain) = (json.unwrap(), plain.unwrap());
    assert_eq!(json["level"], "warn");
    assert_eq!(json["step"], 2);
    assert_eq!(json["agentId"], agent.as_str());
    assert_eq!(json["scaler"], "local");
    assert_eq!(json["jobId"], "j1");
    assert_eq!(json["logsSource"], "bare-metal");
    assert_eq!(json["service"], "agent");
    assert_eq!(json["stream"], "stdout");
    assert!(json.get("runId").is_none(), "{json}");
    assert_eq!(plain["level"], "info");
    assert_eq!(plain["agentId"], agent.as_str());
    assert_eq!(plain["stream"], "stderr");
    // The daemon's own lines keep their shape.
    d.signal(rustix::process::Signal::TERM);
    assert_eq!(d.wait_exit().code(), Some(0));
    let rest = d.rest_of_log();
    assert!(
        rest.iter().any(|l| log_message(l).is_some()),
        "daemon lines in the tracing shape: {rest:?}"
    );
}

/// Any TCP listener, loopback included, needs an API token of at least 32
/// bytes: every local user can reach a loopback port. Refused before the
/// state dir is touched, with what to set.
#[test]
fn a_tcp_listener_needs_an_api_token_loopback_included() {
    let dir = Dir::with_config(CONFIG);
    for listen in ["0.0.0.0:0", "127.0.0.1:0", "[::1]:0", "localhost:0"] {
        let out = dir
            .serve_command(&["--memory-backends", "--listen", listen])
            .env_remove("KICI_SCALER_API_TOKEN")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{listen}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("KICI_SCALER_API_TOKEN") && err.contains("unix:"),
            "{listen}: {err}"
        );
    }
    let out = dir
        .serve_command(&["--memory-backends", "--listen", "127.0.0.1:0"])
        .env("KICI_SCALER_API_TOKEN", "too-short-a-token")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at least 32 bytes"), "{err}");
    assert!(
        !dir.path("state").join("instance-id").exists(),
        "refused before the state dir"
    );

    let token = "a-long-random-api-token-for-this-test-only";
    let d = Daemon::start(
        &dir,
        &["--memory-backends", "--listen", "0.0.0.0:0"],
        &[("KICI_SCALER_API_TOKEN", token)],
    );
    let port = d.addr.rsplit(':').next().unwrap();
    let local = format!("127.0.0.1:{port}");
    let (status, body) = http(&local, "GET", "/v1/status", &[], None);
    assert_eq!(status, 401, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["code"],
        "unauthorized"
    );
    let (status, _) = http(
        &local,
        "GET",
        "/healthz",
        &[("Authorization", "Bearer nope")],
        None,
    );
    assert_eq!(status, 401);
    let auth = format!("Bearer {token}");
    let (status, _) = http(
        &local,
        "GET",
        "/v1/status",
        &[("Authorization", &auth)],
        None,
    );
    assert_eq!(status, 200);
    // The CLI sends the same variable as its bearer token.
    let server = format!("http://{local}");
    let denied = cli(&server, &["status"], &[]);
    assert_eq!(denied.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&denied.stderr).contains("unauthorized"));
    let ok = cli(
        &server,
        &["status", "--json"],
        &[("KICI_SCALER_API_TOKEN", token)],
    );
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // The token is never logged.
    drop(d);
}

// ------------------------------------------------------------- the API

#[test]
fn metrics_at_start_up_carry_every_series() {
    let dir = Dir::with_config(CONFIG);
    let d = Daemon::start(&dir, &["--memory-backends", "--listen", "127.0.0.1:0"], &[]);
    let (status, text) = http(&d.addr, "GET", "/metrics", &[], None);
    assert_eq!(status, 200);
    for name in kici_scaler::events::metrics::SERIES {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing:\n{text}"
        );
    }
    for line in [
        "kici_orch_scaler_agents{scaler=\"local\",state=\"busy\"} 0",
        "kici_orch_scaler_spawn_failures_total{backend=\"firecracker\",reason=\"boot-failure\"} 0",
        "kici_orch_scaler_breaker_open{scaler=\"docker\",label_set=\"0\"} 0",
        "kici_orch_scaler_orphans_reaped_total{kind=\"tap\"} 0",
        "kici_orch_scaler_warm_target{scaler=\"local\"} 0",
    ] {
        assert!(text.contains(line), "{line} missing");
    }
    let (status, body) = http(&d.addr, "GET", "/readyz", &[], None);
    assert_eq!((status, body.as_str()), (200, r#"{"ready":true}"#));
}

#[test]
fn the_cli_over_a_unix_socket() {
    let dir = Dir::with_config(CONFIG);
    let sock = format!("unix:{}", dir.path("api.sock").display());
    let d = Daemon::start(&dir, &["--memory-backends", "--listen", &sock], &[]);
    assert_eq!(d.addr, sock);
    let server = d.server();

    let status = cli(&server, &["status", "--json"], &[]);
    assert_eq!(
        status.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let doc = stdout_json(&status);
    assert_eq!(doc["scalers"][0]["name"], "local");
    let text = cli(&server, &["status"], &[]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("local (bare-metal): 0 active"));

    let req = cli(
        &server,
        &[
            "request", "--labels", "docker", "--job-id", "j1", "--cpus", "0.5", "--memory", "256m",
            "--json",
        ],
        &[],
    );
    assert_eq!(
        req.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&req.stderr)
    );
    let answer = stdout_json(&req);
    assert_eq!(answer["result"], "spawning");
    let agent = answer["agentId"].as_str().unwrap().to_owned();

    let agents = stdout_json(&cli(&server, &["agents", "--json"], &[]));
    assert_eq!(agents["agents"][0]["agentId"], agent.as_str());
    assert_eq!(
        agents["agents"][0]["resources"],
        serde_json::json!({"cpus": 0.5, "memoryBytes": 268435456})
    );
    let table = cli(&server, &["agents"], &[]);
    assert!(String::from_utf8_lossy(&table.stdout).contains(&agent));

    let none = cli(&server, &["request", "--labels", "gpu"], &[]);
    assert_eq!(none.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&none.stdout).starts_with("no-backend"));
    let bad = cli(
        &server,
        &["request", "--labels", "docker", "--memory", "lots"],
        &[],
    );
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid-value"));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("(field: resources.requests.memory)"));

    for (verb, expect) in [
        ("cordon", "cordoned"),
        ("uncordon", "uncordoned"),
        ("drain", "draining"),
    ] {
        let out = cli(&server, &[verb, "docker", "--json"], &[]);
        assert_eq!(out.status.code(), Some(0), "{verb}");
        assert_eq!(
            stdout_json(&out),
            serde_json::json!({"scaler": "docker", "result": expect})
        );
    }
    let missing = cli(&server, &["cordon", "nope"], &[]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("scaler-not-found"));

    let destroy = cli(&server, &["destroy", &agent], &[]);
    assert_eq!(destroy.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&destroy.stdout),
        format!("destroying {agent}\n")
    );
    let unknown = cli(
        &server,
        &["destroy", "scaler-container-00000000", "--json"],
        &[],
    );
    assert_eq!(unknown.status.code(), Some(1));
    assert_eq!(stdout_json(&unknown)["error"]["code"], "agent-not-found");
}

/// A CA and a certificate for `localhost` it signed, as PEM files.
fn tls_files(dir: &Dir) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let paths = (
        dir.path("ca.pem"),
        dir.path("cert.pem"),
        dir.path("key.pem"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

#[test]
fn tls_with_rustls() {
    let dir = Dir::with_config(CONFIG);
    let (ca, cert, key) = tls_files(&dir);
    let d = Daemon::start(
        &dir,
        &[
            "--memory-backends",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
        &[],
    );
    let port = d.addr.rsplit(':').next().unwrap();
    let server = format!("https://localhost:{port}");
    let out = cli(
        &server,
        &["status", "--json", "--ca-cert", ca.to_str().unwrap()],
        &[],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout_json(&out)["scalers"][1]["name"], "docker");
    // Without trusting the CA there is no talking to it.
    let untrusted = cli(
        &server,
        &["status", "--ca-cert", cert.to_str().unwrap()],
        &[],
    );
    assert_eq!(untrusted.status.code(), Some(1));
    let no_ca = cli(&server, &["status"], &[]);
    assert!(String::from_utf8_lossy(&no_ca.stderr).contains("--ca-cert"));
    // Plain HTTP to a TLS port gets nothing useful.
    let plain = cli(&format!("http://127.0.0.1:{port}"), &["status"], &[]);
    assert_eq!(plain.status.code(), Some(1));
}

// ---------------------------------------------------------------- signals

#[test]
fn sighup_reloads_and_a_broken_config_changes_nothing() {
    let dir = Dir::with_config(CONFIG);
    let mut d = Daemon::start(&dir, &["--memory-backends", "--listen", "127.0.0.1:0"], &[]);
    std::fs::write(dir.path("scalers.yaml"), "version: 1\nscalers: {}\n").unwrap();
    d.signal(rustix::process::Signal::HUP);
    d.expect_log("configuration reload refused; nothing changed");
    let (_, status) = http(&d.addr, "GET", "/v1/status", &[], None);
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["scalers"][1]["usage"]["maxAgents"], 4);

    std::fs::write(
        dir.path("scalers.yaml"),
        CONFIG.replace("maxAgents: 4", "maxAgents: 7"),
    )
    .unwrap();
    d.signal(rustix::process::Signal::HUP);
    let fields = d.expect_log("configuration field changed");
    assert!(
        fields["change"].as_str().unwrap().contains("maxAgents"),
        "{fields}"
    );
    d.expect_log("configuration reloaded");
    let (_, status) = http(&d.addr, "GET", "/v1/status", &[], None);
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["scalers"][1]["usage"]["maxAgents"], 7);
    let (_, metrics) = http(&d.addr, "GET", "/metrics", &[], None);
    assert!(metrics.contains("kici_orch_scaler_config_reloads_total{result=\"success\"} 1"));
    assert!(metrics.contains("kici_orch_scaler_config_reloads_total{result=\"failed\"} 1"));
    assert!(metrics.contains("kici_orch_scaler_config_reloads_total{result=\"attempted\"} 2"));
}

/// A reload cannot start a backend the daemon did not start with: it is
/// refused, naming the scaler and its file, saying why and what to do.
#[test]
fn a_reload_that_adds_a_backend_type_says_to_restart() {
    let bare_metal_only = &CONFIG[..CONFIG.find("  - name: docker").unwrap()];
    let dir = Dir::with_config(bare_metal_only);
    let d = Daemon::start(&dir, &["--memory-backends", "--listen", "127.0.0.1:0"], &[]);
    std::fs::write(dir.path("scalers.yaml"), CONFIG).unwrap();
    let (status, body) = http(&d.addr, "POST", "/v1/reload", &[], None);
    assert_eq!(status, 422, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    let errors = answer["error"]["errors"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let text = if errors.is_empty() {
        body.clone()
    } else {
        format!("{errors:?}")
    };
    for needle in [
        "scalers.yaml",
        "scalers[name=docker]",
        "the container backend was not started",
        "restart the daemon",
    ] {
        assert!(text.contains(needle), "{needle} missing: {text}");
    }
    let (_, status) = http(&d.addr, "GET", "/v1/status", &[], None);
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["scalers"].as_array().unwrap().len(),
        1,
        "nothing changed"
    );
}

#[test]
fn sigterm_destroys_every_agent_and_exits_0() {
    let dir = Dir::with_config(CONFIG);
    let mut d = Daemon::start(&dir, &["--memory-backends", "--listen", "127.0.0.1:0"], &[]);
    let mut agents = Vec::new();
    for (job, label) in [("j1", "local"), ("j2", "docker"), ("j3", "docker")] {
        let (status, body) = http(
            &d.addr,
            "POST",
            "/v1/scale",
            &[],
            Some(&format!(r#"{{"jobId":"{job}","labels":["{label}"]}}"#)),
        );
        assert_eq!(status, 202, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        agents.push(v["agentId"].as_str().unwrap().to_owned());
    }

    // Follow the event stream from the start (HTTP/1.0: the body is the
    // stream until the daemon closes it).
    let mut s = std::net::TcpStream::connect(&d.addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        s,
        "GET /v1/events HTTP/1.0\r\nAuthorization: Bearer {}\r\nLast-Event-ID: 0\r\n\r\n",
        crate::common::daemon::TEST_API_TOKEN
    )
    .unwrap();
    let mut raw = String::new();
    let mut events = Vec::new();
    let mut buf = [0u8; 4096];
    let booted = |events: &[common::SseEvent]| {
        events
            .iter()
            .filter(|e| e.event == "agent-transition" && e.data["to"] == "booted")
            .count()
    };
    while booted(&events) < agents.len() {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        raw.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        if let Some(i) = raw.find("\r\n\r\n") {
            assert!(
                raw.starts_with("HTTP/1.0 200") || raw.starts_with("HTTP/1.1 200"),
                "{raw}"
            );
            raw.drain(..i + 4);
        }
        if !raw.starts_with("HTTP/") {
            events.extend(take_sse_events(&mut raw));
        }
    }

    d.signal(rustix::process::Signal::TERM);
    // The stream ends once every agent is gone.
    loop {
        let n = s.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        events.extend(take_sse_events(&mut raw));
    }
    let status = d.wait_exit();
    assert_eq!(status.code(), Some(0));
    let ids: Vec<u64> = events.iter().map(|e| e.id.unwrap()).collect();
    assert!(
        ids.windows(2).all(|w| w[1] == w[0] + 1),
        "ids increase without gaps: {ids:?}"
    );
    for agent in &agents {
        let gone = events
            .iter()
            .any(|e| e.data["agentId"] == agent.as_str() && e.data["to"] == "gone");
        assert!(gone, "{agent} was not destroyed: {events:#?}");
        let cause = events
            .iter()
            .find(|e| e.data["agentId"] == agent.as_str() && e.data["to"] == "destroying");
        assert_eq!(cause.unwrap().data["cause"], "shutdown");
    }
    // Logs: one JSON object per line, events with their ids as fields, and
    // never a token.
    // The reader thread ends at EOF, after the exit.
    let log: Vec<String> = d.rest_of_log();
    assert!(
        log.iter().all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "{log:#?}"
    );
    assert!(
        !log.iter().any(|l| l.contains("kat_")),
        "a token reached the log"
    );
    let logged = log.iter().filter_map(|l| log_message(l)).any(|(m, f)| {
        m == "agent state changed"
            && f["agent_id"] == agents[0].as_str()
            && f["scaler"] == "local"
            && f["job_id"] == "j1"
    });
    assert!(logged, "{log:#?}");
    // The state dir's lock is free again: a new daemon can start on it.
    let again = Daemon::start(&dir, &["--memory-backends", "--listen", "127.0.0.1:0"], &[]);
    drop(again);
}

#[test]
fn a_second_daemon_on_the_same_state_dir_is_refused() {
    let dir = Dir::with_config(CONFIG);
    let _d = Daemon::start(&dir, &["--memory-backends", "--listen", "127.0.0.1:0"], &[]);
    let out = dir
        .serve_command(&["--memory-backends", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use by another kici-scaler process"));
}

#[test]
fn daemon_settings_come_from_a_file_under_flags_and_env() {
    let dir = Dir::with_config(CONFIG);
    let sock = dir.path("from-file.sock");
    std::fs::write(
        dir.path("daemon.toml"),
        format!(
            "listen = \"unix:{}\"\nshutdown-grace-seconds = 5\n",
            sock.display()
        ),
    )
    .unwrap();
    let d = Daemon::start(
        &dir,
        &[
            "--memory-backends",
            "--daemon-config",
            dir.path("daemon.toml").to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(d.addr, format!("unix:{}", sock.display()));
    drop(d);
    // The environment beats the file; a flag beats both.
    let d = Daemon::start(
        &dir,
        &[
            "--memory-backends",
            "--daemon-config",
            dir.path("daemon.toml").to_str().unwrap(),
        ],
        &[("KICI_SCALER_LISTEN", "127.0.0.1:0")],
    );
    assert!(d.addr.starts_with("127.0.0.1:"), "{}", d.addr);
    drop(d);
    let yaml = dir.path("daemon.yaml");
    std::fs::write(&yaml, "listen: 127.0.0.1:0\nbogus: 1\n").unwrap();
    let out = dir
        .serve_command(&[
            "--memory-backends",
            "--daemon-config",
            yaml.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));
}

#[test]
fn a_firecracker_sweep_interval_out_of_bounds_is_refused_naming_the_setting() {
    let dir = Dir::with_config(CONFIG);
    std::fs::write(
        dir.path("daemon.toml"),
        "firecracker-sweep-interval-seconds = 0\n",
    )
    .unwrap();
    let daemon_config = dir.path("daemon.toml");
    let from_file = dir
        .serve_command(&[
            "--memory-backends",
            "--listen",
            "127.0.0.1:0",
            "--daemon-config",
            daemon_config.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let from_flag = dir
        .serve_command(&[
            "--memory-backends",
            "--listen",
            "127.0.0.1:0",
            "--firecracker-sweep-interval-seconds",
            "100000000",
        ])
        .output()
        .unwrap();
    let from_env = dir
        .serve_command(&["--memory-backends", "--listen", "127.0.0.1:0"])
        .env("KICI_SCALER_FIRECRACKER_SWEEP_INTERVAL_SECONDS", "0")
        .output()
        .unwrap();
    for (out, says) in [
        (from_file, "at least 1"),
        (from_flag, "at most 86400"),
        (from_env, "at least 1"),
    ] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("firecracker-sweep-interval-seconds") && stderr.contains(says),
            "{stderr}"
        );
    }
}

// ------------------------------------------------------ stalled clients

/// Opens `n` connections to `addr` that each send `prefix` and then stall.
fn stalled(addr: &str, n: usize, prefix: &str) -> Vec<std::net::TcpStream> {
    (0..n)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(prefix.as_bytes()).unwrap();
            s
        })
        .collect()
}

/// What a stalled connection got before the daemon closed it.
fn answer_then_close(mut s: std::net::TcpStream) -> String {
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .expect("the daemon closes a stalled connection");
    answer
}

/// Stalled clients — connections that send nothing, half a request head
/// or half a body, more of them than the daemon has descriptors for — no
/// longer take the control API or the agent gateway down: each is closed
/// at its deadline (a half body answered 408 in the error shape), each
/// listener caps its connections (logged and counted), and once the
/// stalled ones are gone `/healthz`, `POST /v1/jobs` and a WebSocket
/// upgrade on the gateway are served.
#[test]
fn stalled_connections_cannot_take_the_daemon_down() {
    let dir = Dir::with_config(CONFIG);
    let serve = dir.serve_command(&[
        "--memory-backends",
        "--listen",
        "127.0.0.1:0",
        "--http-header-timeout-seconds",
        "2",
        "--http-body-timeout-seconds",
        "2",
    ]);
    // The hard limit too: the daemon cannot raise its way out of it.
    let mut cmd = Command::new("prlimit");
    cmd.arg("--nofile=256:256")
        .arg("--")
        .arg(serve.get_program())
        .args(serve.get_args());
    for (k, v) in serve.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let mut d = Daemon::spawn(cmd).unwrap();
    // Logged during start-up, before the API listened.
    let limits = d
        .seen
        .iter()
        .filter_map(|l| log_message(l))
        .find(|(m, _)| m == "connection limits")
        .map(|(_, fields)| fields)
        .expect("the start-up log names the connection limits");
    assert_eq!(limits["open_files"], 256, "{limits}");
    assert_eq!(limits["api_max_connections"], 64, "{limits}");

    // More stalled clients than the daemon has descriptors: 140 on the API
    // (nothing, half a head, half a body), 120 on the gateway (nothing).
    let mut api = stalled(&d.addr, 50, "");
    api.extend(stalled(&d.addr, 50, "GET /healthz HTTP/1.1\r\nHost: x\r\n"));
    // With the token: an unauthenticated body is refused 401 before it is
    // read, and this is about a body that never finishes.
    let half_body = format!(
        "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"labels\":",
        common::daemon::TEST_API_TOKEN
    );
    let half_bodies = stalled(&d.addr, 40, &half_body);
    let gateway = stalled(&d.gateway, 120, "");

    // Behind them all, real clients are served.
    let (status, body) = http(&d.addr, "GET", "/healthz", &[], None);
    assert_eq!(status, 200, "/healthz: {body}");
    let (status, body) = http(
        &d.addr,
        "POST",
        "/v1/jobs",
        &[],
        Some(r#"{"labels":["local"],"command":["true"]}"#),
    );
    assert_eq!(status, 202, "POST /v1/jobs: {body}");
    let mut ws = std::net::TcpStream::connect(&d.gateway).unwrap();
    ws.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        ws,
        "GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    .unwrap();
    let mut head = [0u8; 12];
    ws.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 101", "the gateway's upgrade");

    // Every stalled connection was closed by the daemon; a half body got
    // its 408 first.
    for s in api.into_iter().chain(gateway) {
        let answer = answer_then_close(s);
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
            "{answer}"
        );
    }
    for s in half_bodies {
        let answer = answer_then_close(s);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains(r#""code":"body-timeout""#), "{answer}");
    }

    let open_of = |text: &str, listener: &str| {
        common::daemon::metric(
            text,
            "kici_orch_scaler_connections",
            &format!("listener=\"{listener}\""),
        )
    };
    // The daemon learns of a close when its connection task next runs: give
    // it a moment (bounded) before reading the gauges.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut text = d.metrics();
    while ["api", "gateway"].iter().any(|l| open_of(&text, l) > 1.0)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(100));
        text = d.metrics();
    }
    for listener in ["api", "gateway"] {
        // Every closed connection left the gauge: at most the scrape itself
        // is open.
        let open = open_of(&text, listener);
        assert!(open <= 1.0, "{listener}: {open} open\n{text}");
        let reached = common::daemon::metric(
            &text,
            "kici_orch_scaler_connection_limit_reached_total",
            &format!("listener=\"{listener}\""),
        );
        assert!(reached >= 1.0, "{listener}: {reached}\n{text}");
    }
    let reached = d
        .wait_for_log("connection limit reached: new connections wait until one ends")
        .expect("logged");
    assert_eq!(reached["max_connections"], 64, "{reached}");
    d.terminate();
}

/// What the daemon answers to raw `request` bytes (status, body).
fn raw_answer(addr: &str, request: Vec<u8>) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut writer = s.try_clone().unwrap();
    // The daemon may answer (and close) before it read everything.
    let sender = std::thread::spawn(move || {
        let _ = writer.write_all(&request);
    });
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let _ = sender.join();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.split(' ').nth(1).unwrap_or("0").parse().unwrap_or(0);
    (status, body.to_owned())
}

/// Requests the HTTP parser refuses before any handler runs still get the
/// API's error shape.
#[test]
fn requests_http_itself_refuses_get_the_error_shape() {
    let dir = Dir::with_config(CONFIG);
    let d = Daemon::start(&dir, &["--memory-backends", "--listen", "127.0.0.1:0"], &[]);
    let long_uri = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000));
    let huge_head = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(600_000)
    );
    let cases: [(&str, Vec<u8>, u16, &str); 5] = [
        ("a URI too long", long_uri.into_bytes(), 414, "uri-too-long"),
        ("a head too large", huge_head.into_bytes(), 431, "headers-too-large"),
        (
            "two Content-Lengths",
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"
                .to_vec(),
            400,
            "bad-request",
        ),
        (
            "a negative Content-Length",
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n".to_vec(),
            400,
            "bad-request",
        ),
        ("HTTP/0.9", b"GET /healthz\r\n\r\n".to_vec(), 400, "bad-request"),
    ];
    for (what, request, status, code) in cases {
        let (got, body) = raw_answer(&d.addr, request);
        assert_eq!(got, status, "{what}: {body}");
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: {e}: {body:?}"));
        assert_eq!(v["error"]["code"], code, "{what}: {body}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}"
        );
    }
    // The daemon serves on.
    assert_eq!(http(&d.addr, "GET", "/healthz", &[], None).0, 200);
}
