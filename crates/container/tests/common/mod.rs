#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]
//! Fixtures for the tests against the real dockerd (started by
//! `scripts/dockerd.sh start`): a backend with its own instance id, its own
//! network (`kici-t-<instance>`, a random 10.x.y.0/24, bridge `kt<instance>`),
//! the SQLite store's address allocator, a recording egress hook, test images
//! built `FROM scratch` from busybox-static, and a sweep on drop that removes
//! every container, network and image the test created — also when it fails.

#[path = "../../src/test_support.rs"]
mod test_support;

pub use test_support::{scaler_from_yaml, spawn_spec};

use async_trait::async_trait;
use kici_container::{ContainerBackend, ContainerOptions, NetworkSettings};
use kici_model::{AgentId, InstanceId, NetworkPolicy};
use kici_netpolicy::{EgressRules, EgressTarget, NetPolicyError};
use kici_store::{IpAllocator, StateStore};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// Tests in one binary share dockerd and the global failpoint registry:
/// they run one at a time (nextest runs `serial_*` one at a time anyway).
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Records what the backend asks of the egress hook.
#[derive(Default)]
pub struct RecordingEgress {
    pub installed: Mutex<BTreeMap<AgentId, (EgressTarget, Option<NetworkPolicy>)>>,
    pub calls: Mutex<Vec<String>>,
}

#[async_trait]
impl EgressRules for RecordingEgress {
    async fn install(
        &self,
        target: &EgressTarget,
        policy: Option<&NetworkPolicy>,
    ) -> Result<(), NetPolicyError> {
        self.calls.lock().push(format!("install {}", target.agent));
        self.installed
            .lock()
            .insert(target.agent, (target.clone(), policy.cloned()));
        Ok(())
    }

    async fn remove(&self, agent: &AgentId) -> Result<(), NetPolicyError> {
        self.calls.lock().push(format!("remove {agent}"));
        self.installed.lock().remove(agent);
        Ok(())
    }

    async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, NetPolicyError> {
        let mut installed = self.installed.lock();
        let stale: Vec<AgentId> = installed
            .keys()
            .filter(|a| !live.contains(a))
            .copied()
            .collect();
        for agent in &stale {
            self.calls.lock().push(format!("sweep {agent}"));
            installed.remove(agent);
        }
        Ok(stale)
    }
}

pub fn docker(args: &[&str]) -> (bool, String) {
    let out = Command::new("docker").args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

pub fn docker_ok(args: &[&str]) -> String {
    let (ok, text) = docker(args);
    assert!(ok, "docker {args:?} failed: {text}");
    text
}

/// `docker inspect` of one object as JSON.
pub fn inspect(kind: &str, name: &str) -> Option<serde_json::Value> {
    let (ok, text) = docker(&[kind, "inspect", name]);
    if !ok {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_array().and_then(|a| a.first().cloned())
}

/// Names of every container (running or not) with `label`.
pub fn containers_with_label(label: &str) -> Vec<String> {
    let text = docker_ok(&[
        "ps",
        "-a",
        "--filter",
        &format!("label={label}"),
        "--format",
        "{{.Names}}",
    ]);
    text.lines()
        .map(str::to_owned)
        .filter(|l| !l.is_empty())
        .collect()
}

/// Builds `FROM scratch` with busybox-static as `/bin/busybox` (plus
/// `/bin/sh`), `cmd` as the image's command; extra files copied in by
/// (source, destination).
pub fn build_image(tag: &str, cmd: &[&str], extra: &[(&Path, &str)]) {
    build_image_with("docker", tag, cmd, extra)
}

/// [`build_image`] with another CLI (`podman`).
pub fn build_image_with(cli: &str, tag: &str, cmd: &[&str], extra: &[(&Path, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy("/bin/busybox", dir.path().join("busybox")).unwrap();
    let mut dockerfile = String::from("FROM scratch\nCOPY busybox /bin/busybox\n");
    for applet in ["sh", "sleep", "cat", "touch", "nc"] {
        dockerfile.push_str(&format!("COPY busybox /bin/{applet}\n"));
    }
    for (i, (src, dst)) in extra.iter().enumerate() {
        let name = format!("extra{i}");
        std::fs::copy(src, dir.path().join(&name)).unwrap();
        dockerfile.push_str(&format!("COPY {name} {dst}\n"));
    }
    dockerfile.push_str(&format!("CMD {}\n", serde_json::to_string(cmd).unwrap()));
    std::fs::write(dir.path().join("Dockerfile"), dockerfile).unwrap();
    let out = Command::new(cli)
        .env("DOCKER_BUILDKIT", "0")
        .args(["build", "-q", "-t", tag])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "docker build {tag}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub struct Fixture {
    pub instance: InstanceId,
    pub backend: ContainerBackend,
    pub options: ContainerOptions,
    /// The instance's SQLite store (its IP allocator is the backend's).
    pub allocator: Arc<dyn StateStore>,
    pub egress: Arc<RecordingEgress>,
    /// Images to remove on drop.
    pub images: Mutex<Vec<String>>,
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub async fn new() -> Self {
        Self::with(|_| {}).await
    }

    pub async fn with(adjust: impl FnOnce(&mut ContainerOptions)) -> Self {
        let instance = InstanceId::random();
        let network = test_network(instance);
        Self::on_network(instance, network, None, adjust).await
    }

    /// Another instance on `other`'s network and address store: two
    /// daemons on one dockerd.
    pub async fn sharing(other: &Fixture) -> Self {
        Self::on_network(
            InstanceId::random(),
            other.options.network.clone(),
            Some(other.dir.path().join("state.db")),
            |_| {},
        )
        .await
    }

    /// A fixture for `instance` on `network` (set up by the caller).
    pub async fn on(
        instance: InstanceId,
        network: NetworkSettings,
        adjust: impl FnOnce(&mut ContainerOptions),
    ) -> Self {
        Self::on_network(instance, network, None, adjust).await
    }

    /// `db`: another fixture's store file (one store, two instances).
    async fn on_network(
        instance: InstanceId,
        network: NetworkSettings,
        db: Option<PathBuf>,
        adjust: impl FnOnce(&mut ContainerOptions),
    ) -> Self {
        let egress = Arc::new(RecordingEgress::default());
        let dir = tempfile::Builder::new()
            .prefix("kici-container-test-")
            .tempdir()
            .unwrap();
        let db = db.unwrap_or_else(|| dir.path().join("state.db"));
        let allocator = open_store(&db, instance).await;
        let ip_allocator: Arc<dyn IpAllocator> = allocator.clone();
        let mut options = ContainerOptions::new(instance, ip_allocator, Vec::new());
        options.network = network;
        options.egress = egress.clone();
        // An empty credentials file: never the machine's own.
        options.registry_config = Some(dir.path().join("config.json"));
        adjust(&mut options);
        let backend = ContainerBackend::new(options.clone()).unwrap();
        Self {
            instance,
            backend,
            options,
            allocator,
            egress,
            images: Mutex::new(Vec::new()),
            dir,
        }
    }

    /// The same instance and settings: the daemon after a restart.
    pub fn restarted(&self) -> ContainerBackend {
        ContainerBackend::new(self.options.clone()).unwrap()
    }

    pub fn label(&self) -> String {
        format!("dev.kici.scaler.instance={}", self.instance)
    }

    /// A busybox image owned by this fixture, tagged with its instance.
    pub fn image(&self, name: &str, cmd: &[&str]) -> String {
        self.image_with(name, cmd, &[])
    }

    pub fn image_with(&self, name: &str, cmd: &[&str], extra: &[(&Path, &str)]) -> String {
        let tag = format!("kici-test-{name}:{}", self.instance);
        build_image(&tag, cmd, extra);
        self.images.lock().push(tag.clone());
        tag
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// This instance's leases, as (address, agent).
    pub async fn held(&self) -> Vec<(Ipv4Addr, AgentId)> {
        self.allocator
            .leases()
            .await
            .unwrap()
            .into_iter()
            .map(|l| (l.ip, l.agent))
            .collect()
    }

    /// Our containers (by the instance label).
    pub fn containers(&self) -> Vec<String> {
        containers_with_label(&self.label())
    }
}

/// The SQLite store at `db`, owned by `instance`.
async fn open_store(db: &Path, instance: InstanceId) -> Arc<dyn StateStore> {
    let url: kici_store::StoreUrl = format!("sqlite:{}", db.display()).parse().unwrap();
    kici_store::open(&url, instance, kici_store::StoreOptions::default())
        .await
        .unwrap()
}

/// `kici-t-<instance>` on a random 10.x.y.0/24 with bridge `kt<instance>`.
pub fn test_network(instance: InstanceId) -> NetworkSettings {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    let subnet = format!(
        "10.{}.{}.0/24",
        rng.gen_range(100..=250),
        rng.gen_range(0..=255)
    );
    NetworkSettings {
        name: format!("kici-t-{instance}"),
        pool: subnet.parse().unwrap(),
        bridge: format!("kt{instance}"),
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for name in self.containers() {
            let _ = docker(&["rm", "-f", "-v", &name]);
        }
        let _ = docker(&["network", "rm", &self.options.network.name]);
        for image in self.images.lock().drain(..) {
            let _ = docker(&["rmi", "-f", &image]);
        }
    }
}

/// Scaler YAML for one container label set with `image` and extra
/// label-set lines (indented by 8 spaces) and scaler lines (4 spaces).
pub fn scaler_yaml(name: &str, image: &str, scaler_extra: &str, set_extra: &str) -> String {
    format!(
        r#"
version: 1
scalers:
  - name: {name}
    type: container
    maxAgents: 4
    runtime: docker
{scaler_extra}
    labelSets:
      - labels: [linux, box]
        image: "{image}"
        imagePullPolicy: IfNotPresent
{set_extra}
"#
    )
}
