#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]
//! Fixtures for the bare-metal tests: a backend on the real cgroup roots
//! with its own instance id and state dir, executable scripts, spawn specs,
//! and a sweep on drop (so a failing test leaves no process or cgroup).

use kici_bare_metal::cgroup::{self, CgroupLayout};
use kici_bare_metal::{BareMetalBackend, BareMetalOptions};
use kici_engine::{BackendReport, SpawnSpec};
use kici_model::{AgentId, EffectiveResources, InstanceId, ScalerEntry};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

pub struct Fixture {
    pub backend: BareMetalBackend,
    pub options: BareMetalOptions,
    pub dir: tempfile::TempDir,
}

impl Fixture {
    /// A backend on the host's real cgroup roots.
    pub fn new() -> Self {
        Self::with(|_| {})
    }

    pub fn with(adjust: impl FnOnce(&mut BareMetalOptions)) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        let mut options =
            BareMetalOptions::new(InstanceId::random(), dir.path().join("state"), Vec::new());
        adjust(&mut options);
        let backend = BareMetalBackend::new(options.clone()).unwrap();
        Self {
            backend,
            options,
            dir,
        }
    }

    /// Another backend on the same state and instance: the daemon after a
    /// restart.
    pub fn restarted(&self) -> BareMetalBackend {
        BareMetalBackend::new(self.options.clone()).unwrap()
    }

    pub fn layout(&self) -> &CgroupLayout {
        self.backend.layout()
    }

    /// An executable `/bin/sh` script.
    pub fn script(&self, name: &str, body: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A named pipe: the test blocks reading it until an agent writes.
    pub fn fifo(&self, name: &str) -> PathBuf {
        let path = self.path(name);
        let status = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success());
        path
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        sweep(self.layout());
    }
}

/// Kills and removes every cgroup of the layout's instance (v2 and v1).
pub fn sweep(layout: &CgroupLayout) {
    let leaves = layout.tracking_leaves().unwrap_or_default();
    for leaf in &leaves {
        let deadline = Instant::now() + Duration::from_secs(10);
        while cgroup::populated(leaf).unwrap_or(false) && Instant::now() < deadline {
            let _ = cgroup::kill_all(leaf);
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(agent) = leaf
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<AgentId>().ok())
        {
            let _ = layout.find_agent(agent).remove();
        }
        let _ = std::fs::remove_dir(leaf);
    }
    layout.prune_empty();
}

#[path = "../../src/test_support.rs"]
mod test_support;

pub use test_support::scaler_from_yaml as scaler;

/// A bare-metal scaler `metal` with one label set running `binary`.
pub fn simple_scaler(binary: &Path) -> Arc<ScalerEntry> {
    scaler(
        &format!(
            r#"
version: 1
scalers:
  - name: metal
    type: bare-metal
    maxAgents: 4
    labelSets:
      - labels: [linux, metal]
        binaryPath: {}
"#,
            binary.display()
        ),
        "metal",
    )
}

/// A spawn spec for a job-bound agent, with the label set's resources.
pub fn spec(
    scaler: &Arc<ScalerEntry>,
    label_set_index: usize,
) -> (SpawnSpec, mpsc::UnboundedReceiver<BackendReport>) {
    let (mut spec, rx) = test_support::spawn_spec(scaler, label_set_index);
    spec.resources = EffectiveResources::resolve(&[spec.label_set.resources.as_ref()]);
    spec.job = Some("job-1".parse().unwrap());
    (spec, rx)
}

/// The next report; the timeout only guards against a hang.
pub async fn next_report(rx: &mut mpsc::UnboundedReceiver<BackendReport>) -> BackendReport {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("a report within a minute")
        .expect("report channel open")
}

/// Blocks (off the runtime) until someone writes the fifo and closes it.
pub async fn read_fifo(path: PathBuf) -> String {
    let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(path).unwrap());
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("the agent wrote the fifo within a minute")
        .unwrap()
}
