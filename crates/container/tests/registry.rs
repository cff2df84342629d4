//! Pull policies and registry credentials against a real registry: Debian's
//! `docker-registry` on 127.0.0.1 (dockerd allows plain HTTP there) with
//! htpasswd (bcrypt) basic auth. The credentials reach the backend the way
//! operators write them: `docker login` into a `config.json`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kici_engine::Backend;
use std::process::{Command, Stdio};
use std::time::Duration;

const GRACE: Duration = Duration::from_secs(1);

/// A registry process, killed on drop.
struct Registry {
    child: std::process::Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bcrypt(password: &str) -> String {
    // Debian 12's python3 `crypt` (libxcrypt) makes `$2b$` hashes, the one
    // format the registry's htpasswd accepts.
    let out = Command::new("python3")
        .args([
            "-W",
            "ignore",
            "-c",
            "import crypt,sys; print(crypt.crypt(sys.argv[1], crypt.mksalt(crypt.METHOD_BLOWFISH)))",
            password,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

async fn start_registry(user: &str, password: &str) -> Registry {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    std::fs::write(
        dir.path().join("htpasswd"),
        format!("{user}:{}\n", bcrypt(password)),
    )
    .unwrap();
    let config = format!(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}\nhttp:\n  addr: {addr}\nauth:\n  htpasswd:\n    realm: kici\n    path: {htpasswd}\n",
        root = dir.path().join("data").display(),
        htpasswd = dir.path().join("htpasswd").display(),
    );
    std::fs::write(dir.path().join("config.yml"), config).unwrap();
    let child = Command::new("docker-registry")
        .arg("serve")
        .arg(dir.path().join("config.yml"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let registry = Registry {
        child,
        addr,
        _dir: dir,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(&registry.addr)
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "docker-registry did not listen on {}",
            registry.addr
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    registry
}

/// `docker --config <dir> …` (never the machine's own credentials).
fn docker_with(config: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = Command::new("docker")
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Spawns an agent of `scaler` on `fx` (which must succeed) and destroys it.
async fn spawn_and_destroy(fx: &Fixture, scaler: &std::sync::Arc<kici_model::ScalerEntry>) {
    let (spec, _rx) = spawn_spec(scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
}

#[tokio::test]
async fn serial_pull_policies_and_credentials_against_a_local_registry() {
    let _serial = SERIAL.lock().await;
    let registry = start_registry("kici", "s3cret").await;
    let good = tempfile::tempdir().unwrap();
    // The test's own throwaway credentials, written by the real CLI.
    let (ok, text) = docker_with(
        good.path(),
        &["login", "-u", "kici", "-p", "s3cret", &registry.addr],
    );
    assert!(ok, "docker login: {text}");
    let bad = tempfile::tempdir().unwrap();
    std::fs::write(
        bad.path().join("config.json"),
        serde_json::json!({"auths": {registry.addr.clone(): {"auth": "a2ljaTp3cm9uZw=="}}})
            .to_string(),
    )
    .unwrap();

    let fx = Fixture::with(|o| o.registry_config = Some(good.path().join("config.json"))).await;
    let local = fx.image("pushed", &["sleep", "3600"]);
    let remote = format!("{}/kici/agent:{}", registry.addr, fx.instance);
    docker_ok(&["tag", &local, &remote]);
    fx.images.lock().push(remote.clone());
    let (ok, text) = docker_with(good.path(), &["push", &remote]);
    assert!(ok, "docker push: {text}");
    docker_ok(&["rmi", &remote]);
    assert!(inspect("image", &remote).is_none());

    let with_policy = |policy: &str| {
        scaler_from_yaml(
            &scaler_yaml("boxes", &remote, "", "").replace("IfNotPresent", policy),
            "boxes",
        )
    };

    // Always, good credentials: pulled, then runs.
    let scaler = with_policy("Always");
    spawn_and_destroy(&fx, &scaler).await;
    assert!(inspect("image", &remote).is_some(), "pulled");

    // Wrong credentials from here on.
    let wrong = Fixture::with(|o| o.registry_config = Some(bad.path().join("config.json"))).await;
    // IfNotPresent, present: no pull, so the wrong credentials never matter.
    let scaler = with_policy("IfNotPresent");
    spawn_and_destroy(&wrong, &scaler).await;
    // Always pulls: the registry refuses, the spawn fails cleanly.
    let scaler = with_policy("Always");
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let err = wrong.backend.spawn(spec).await.unwrap_err().to_string();
    assert!(err.starts_with(&format!("pull {remote}")), "{err}");
    assert!(
        err.contains("unauthorized") || err.contains("authentication required"),
        "{err}"
    );
    assert!(wrong.containers().is_empty());
    assert!(wrong.held().await.is_empty());
    // No credentials at all: refused too (the registry requires auth).
    docker_ok(&["rmi", &remote]);
    let anonymous = Fixture::new().await;
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let err = anonymous.backend.spawn(spec).await.unwrap_err().to_string();
    assert!(err.starts_with(&format!("pull {remote}")), "{err}");
    assert!(anonymous.containers().is_empty());
    assert!(anonymous.held().await.is_empty());

    // No policy written: IfNotPresent, upstream 0.9's default. Absent, the
    // image is pulled (good credentials)...
    let yaml = scaler_yaml("boxes", &remote, "", "")
        .replace("        imagePullPolicy: IfNotPresent\n", "");
    assert!(!yaml.contains("imagePullPolicy"), "{yaml}");
    let default = scaler_from_yaml(&yaml, "boxes");
    assert!(inspect("image", &remote).is_none());
    spawn_and_destroy(&fx, &default).await;
    assert!(inspect("image", &remote).is_some(), "pulled by default");
    // ...present, it is not (the wrong credentials never matter).
    spawn_and_destroy(&wrong, &default).await;
}
