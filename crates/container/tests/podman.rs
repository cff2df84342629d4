//! The same backend code against Podman's Docker-compatible socket
//! (`podman system service`, rootful, `/run/podman/podman.sock`). The test
//! starts the service when the socket does not answer, and removes every
//! container, network and image it created.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kici_container::RuntimeKind;
use kici_engine::{Backend, BackendReport};
use kici_model::{EffectiveResources, InstanceId};
use std::process::{Command, Stdio};
use std::time::Duration;

const SOCKET: &str = "/run/podman/podman.sock";
const GRACE: Duration = Duration::from_secs(1);
const PATIENCE: Duration = Duration::from_secs(60);

fn podman(args: &[&str]) -> (bool, String) {
    let out = Command::new("podman").args(args).output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn answers() -> bool {
    Command::new("curl")
        .args(["-fsS", "--unix-socket", SOCKET, "http://d/_ping"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts `podman system service` in the background (its own session, so it
/// outlives the test) unless the socket answers; waits for it.
async fn ensure_service() {
    if answers() {
        return;
    }
    std::fs::create_dir_all("/run/podman").unwrap();
    // `setsid -f` forks the service into its own session and returns.
    let started = Command::new("setsid")
        .args([
            "-f",
            "podman",
            "system",
            "service",
            "--time=0",
            &format!("unix://{SOCKET}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(started.success(), "cannot start podman system service");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !answers() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "podman system service did not answer on {SOCKET}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct PodmanFixture {
    fx: Fixture,
    image: String,
}

impl Drop for PodmanFixture {
    fn drop(&mut self) {
        let (_, names) = podman(&[
            "ps",
            "-a",
            "--filter",
            &format!("label=dev.kici.scaler.instance={}", self.fx.instance),
            "--format",
            "{{.Names}}",
        ]);
        for name in names.lines().filter(|l| !l.is_empty()) {
            let _ = podman(&["rm", "-f", "-v", name]);
        }
        let _ = podman(&["network", "rm", "-f", &self.fx.options.network.name]);
        let _ = podman(&["rmi", "-f", &self.image]);
    }
}

#[tokio::test]
async fn serial_podman_runs_agents_through_its_docker_compatible_socket() {
    let _serial = SERIAL.lock().await;
    ensure_service().await;
    let instance = InstanceId::random();
    let mut network = test_network(instance);
    network.name = format!("kici-tp-{instance}");
    network.bridge = format!("kp{instance}");
    let fx = Fixture::on(instance, network, |o| {
        // Root cannot raise hard rlimits on these machines: Podman's
        // defaults (nofile 1048576) fail without these.
        o.ulimits = vec![
            "nofile=20000:20000".parse().unwrap(),
            "nproc=4096:4096".parse().unwrap(),
        ];
    })
    .await;
    let image = format!("localhost/kici-test-podman:{instance}");
    build_image_with(
        "podman",
        &image,
        &["sh", "-c", "echo podman-says-hi; exec sleep 3600"],
        &[],
    );
    let fixture = PodmanFixture { fx, image };
    let fx = &fixture.fx;
    let yaml = scaler_yaml(
        "pods",
        &fixture.image,
        &format!("    socketPath: {SOCKET}"),
        "        resources: {cpus: 0.5, memory: 64m}",
    )
    .replace("runtime: docker", "runtime: podman");
    let scaler = scaler_from_yaml(&yaml, "pods");
    let check = fx.backend.check_host(&scaler).await;
    assert_eq!(check.runtime, Some(RuntimeKind::Podman), "{check:?}");
    assert!(check.is_ok(), "{check:?}");

    let (mut spec, mut reports) = spawn_spec(&scaler, 0);
    spec.resources = EffectiveResources::resolve(&[spec.label_set.resources.as_ref()]);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    assert_eq!(handle.extra["runtime"], "podman");
    let (ok, text) = podman(&["inspect", &format!("kici-{agent}")]);
    assert!(ok, "{text}");
    let c: serde_json::Value = serde_json::from_str::<serde_json::Value>(&text).unwrap()[0].clone();
    assert_eq!(c["State"]["Running"], true, "{c}");
    assert_eq!(
        c["Config"]["Labels"]["dev.kici.scaler.instance"],
        instance.to_string()
    );
    assert_eq!(c["HostConfig"]["Memory"], 64 * 1024 * 1024);
    assert_eq!(c["HostConfig"]["NanoCpus"], 500_000_000);
    let ip = handle.extra["ip"].clone();
    let net = &c["NetworkSettings"]["Networks"][&fx.options.network.name];
    assert_eq!(net["IPAddress"], ip.as_str(), "{net}");
    assert_eq!(
        net["MacAddress"],
        kici_container::agent_mac(ip.parse().unwrap()).to_string(),
        "{net}"
    );
    let owned = fx.backend.list_owned().await.unwrap();
    assert_eq!(owned.len(), 1);
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    let (exists, _) = podman(&["container", "exists", &format!("kici-{agent}")]);
    assert!(!exists);
    assert!(fx.held().await.is_empty());
    assert!(reports.try_recv().is_err());

    // An exit is reported through the same wait call.
    let (spec, mut reports) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    podman(&["kill", &format!("kici-{agent}")]);
    match tokio::time::timeout(PATIENCE, reports.recv())
        .await
        .unwrap()
    {
        Some(BackendReport::Exited { agent: a, detail }) => {
            assert_eq!(a, agent);
            assert!(detail.starts_with("exit status"), "{detail}");
        }
        other => panic!("unexpected {other:?}"),
    }
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(fx.held().await.is_empty());
}

/// The host's hard limit on open files (`ulimit -Hn`).
fn hard_nofile() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let fields: Vec<&str> = line.split_whitespace().collect();
    // "Max open files <soft> <hard> files"
    fields[fields.len() - 2].parse().unwrap_or(u64::MAX)
}

/// Podman's own default `nofile` for containers (containers.conf).
const PODMAN_DEFAULT_NOFILE: u64 = 1_048_576;

#[tokio::test]
async fn serial_podman_without_ulimits_fails_clearly_where_root_cannot_raise_them() {
    let _serial = SERIAL.lock().await;
    ensure_service().await;
    let instance = InstanceId::random();
    let mut network = test_network(instance);
    network.name = format!("kici-tp-{instance}");
    network.bridge = format!("kp{instance}");
    let fx = Fixture::on(instance, network, |o| o.ulimits.clear()).await;
    let image = format!("localhost/kici-test-podman:{instance}");
    build_image_with("podman", &image, &["sleep", "3600"], &[]);
    let fixture = PodmanFixture { fx, image };
    let fx = &fixture.fx;
    let yaml = scaler_yaml(
        "pods",
        &fixture.image,
        &format!("    socketPath: {SOCKET}"),
        "",
    )
    .replace("runtime: docker", "runtime: podman");
    let scaler = scaler_from_yaml(&yaml, "pods");
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let result = fx.backend.spawn(spec).await;
    if hard_nofile() < PODMAN_DEFAULT_NOFILE {
        // These machines: evidence that the ulimits are needed, and that
        // the failure says what to do and leaves nothing behind.
        let err = result.unwrap_err().to_string();
        assert!(err.contains("POST /containers/{id}/start"), "{err}");
        assert!(err.contains("rlimit"), "{err}");
        assert!(err.contains("nofile=20000:20000"), "{err}");
    } else {
        let handle = result.unwrap();
        fx.backend
            .destroy(&agent, Some(&handle), GRACE)
            .await
            .unwrap();
    }
    let (exists, _) = podman(&["container", "exists", &format!("kici-{agent}")]);
    assert!(!exists);
    assert!(fx.held().await.is_empty());
}

/// A `podman system service` on loopback TCP, killed on drop.
struct TcpService(std::process::Child);

impl Drop for TcpService {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn serial_a_tcp_host_is_reached_and_a_remote_runtime_refuses_isolation() {
    let _serial = SERIAL.lock().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let service = TcpService(
        Command::new("podman")
            .args([
                "system",
                "service",
                "--time=0",
                &format!("tcp://127.0.0.1:{port}"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(tokio::time::Instant::now() < deadline, "no TCP service");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let instance = InstanceId::random();
    let mut network = test_network(instance);
    network.name = format!("kici-tp-{instance}");
    network.bridge = format!("kp{instance}");
    let fx = Fixture::on(instance, network, |o| {
        o.ulimits = vec![
            "nofile=20000:20000".parse().unwrap(),
            "nproc=4096:4096".parse().unwrap(),
        ];
    })
    .await;
    let image = format!("localhost/kici-test-podman:{instance}");
    build_image_with("podman", &image, &["sleep", "3600"], &[]);
    let fixture = PodmanFixture { fx, image };
    let fx = &fixture.fx;
    let host = format!("tcp://127.0.0.1:{port}");
    // Isolation on (the default) with a TCP endpoint: our rules would be
    // installed on this host, not where the containers run.
    let isolated = scaler_from_yaml(
        &scaler_yaml("tcp", &fixture.image, &format!("    host: {host}"), "")
            .replace("runtime: docker", "runtime: podman"),
        "tcp",
    );
    let errors = fx.backend.validate(&isolated).await.unwrap_err().messages();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("networkIsolation is on but the runtime") && e.contains(&host)),
        "{errors:?}"
    );
    let scaler = scaler_from_yaml(
        &scaler_yaml(
            "tcp",
            &fixture.image,
            &format!("    host: {host}\n    networkIsolation: false"),
            "",
        )
        .replace("runtime: docker", "runtime: podman"),
        "tcp",
    );
    let check = fx.backend.check_host(&scaler).await;
    assert!(check.is_ok(), "{check:?}");
    assert_eq!(check.endpoint.as_deref(), Some(host.as_str()));
    assert_eq!(check.runtime, Some(RuntimeKind::Podman));
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    assert_eq!(handle.extra["endpoint"], host);
    // Isolation off: no rules were asked for.
    assert!(fx.egress.calls.lock().is_empty());
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    let (exists, _) = podman(&["container", "exists", &format!("kici-{agent}")]);
    assert!(!exists);
    drop(fixture);
    drop(service);
}
