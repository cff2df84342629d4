#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Every failpoint of the bare-metal backend configured to `return`: the
//! failing step's caller releases everything taken so far (spawn), or can
//! be retried to the end (destroy). Run with `--features failpoints`. Each
//! test holds a `fail::FailScenario` (a global lock), so they run one at a
//! time and never see each other's configuration.

mod common;

use common::{read_fifo, scaler, spec as spawn_spec, Fixture};
use kici_bare_metal::cgroup::{self, V1Controller};
use kici_bare_metal::failpoints;
use kici_engine::{Adoption, Backend};
use kici_host::process::ProcessIdentity;
use kici_model::AgentId;
use std::path::Path;
use std::time::Duration;

const GRACE: Duration = Duration::from_millis(200);

/// A scaler whose agents get v1 memory and cpu limits, so every spawn step
/// (v2 tracking leaf, v1 leaves, limits) has something to undo.
fn limited_scaler(binary: &Path) -> std::sync::Arc<kici_model::ScalerEntry> {
    scaler(
        &format!(
            r#"
version: 1
scalers:
  - name: limited
    type: bare-metal
    maxAgents: 4
    enforceCgroups: true
    labelSets:
      - labels: [x]
        binaryPath: {}
        resources: {{ cpus: 0.5, memory: 64m }}
"#,
            binary.display()
        ),
        "limited",
    )
}

/// Processes whose environment names `agent` (reading others' environ needs
/// root, which these tests run as).
fn processes_of(agent: AgentId) -> Vec<String> {
    let needle = format!("KICI_AGENT_ID={agent}");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| {
            let environ = std::fs::read(e.path().join("environ")).ok()?;
            environ
                .split(|b| *b == 0)
                .any(|v| v == needle.as_bytes())
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

/// Nothing of the instance remains: no cgroup in any hierarchy, no agent
/// directory, no process; and retired logs only after a real destroy.
async fn assert_nothing_left(fx: &Fixture, agent: AgentId, context: &str, destroyed: bool) {
    let instance = fx.options.instance.to_string();
    for root in [
        fx.layout().v2_root().to_owned(),
        fx.layout().v1_dir(V1Controller::Memory),
        fx.layout().v1_dir(V1Controller::Cpu),
    ] {
        let dir = root.join(cgroup::TREE).join(&instance);
        assert!(!dir.exists(), "{context}: {} remains", dir.display());
    }
    assert!(
        !fx.backend.agent_dir(agent).exists(),
        "{context}: agent dir remains"
    );
    assert_eq!(
        fx.backend.retired_dir().join(agent.to_string()).exists(),
        destroyed,
        "{context}: retired logs"
    );
    assert_eq!(
        processes_of(agent),
        Vec::<String>::new(),
        "{context}: processes remain"
    );
    assert!(
        fx.backend.list_owned().await.unwrap().is_empty(),
        "{context}"
    );
}

#[test]
fn failpoints_are_listed_once_each() {
    let mut names = kici_bare_metal::FAILPOINTS.to_vec();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), kici_bare_metal::FAILPOINTS.len());
    for name in failpoints::SPAWN.iter().chain(failpoints::DESTROY) {
        assert!(kici_bare_metal::FAILPOINTS.contains(name), "{name}");
    }
    assert!(names.iter().all(|n| n.starts_with("kici_bare_metal::")));
}

#[tokio::test]
async fn serial_every_failing_spawn_step_leaves_nothing() {
    let scenario = fail::FailScenario::setup();
    let fx = Fixture::new();
    let binary = fx.script("agent.sh", "exec sleep 1000");
    let scaler = limited_scaler(&binary);
    for name in failpoints::SPAWN {
        fail::cfg(*name, "return").unwrap();
        let (spec, mut rx) = spawn_spec(&scaler, 0);
        let agent = spec.agent;
        let err = fx.backend.spawn(spec).await.unwrap_err();
        assert_eq!(err.to_string(), format!("injected failure at {name}"));
        assert_nothing_left(&fx, agent, name, false).await;
        // A spawn that failed reports no exit.
        assert!(rx.try_recv().is_err(), "{name}: exit reported");
        fail::remove(*name);
    }
    // With no failpoint set, the same spawn works and is destroyed cleanly.
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    assert!(handle.extra.contains_key("cgroup-v1-memory"));
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert_nothing_left(&fx, agent, "after a clean spawn", true).await;
    scenario.teardown();
}

#[tokio::test]
async fn serial_every_failing_destroy_step_can_be_retried_to_the_end() {
    let scenario = fail::FailScenario::setup();
    let fx = Fixture::new();
    let ready = fx.fifo("ready");
    let binary = fx.script(
        "agent.sh",
        &format!(
            "setsid sh -c 'echo $$ > {}; exec sleep 1000' </dev/null >/dev/null 2>&1 &\nexec sleep 1000",
            ready.display()
        ),
    );
    let scaler = limited_scaler(&binary);
    for name in failpoints::DESTROY {
        let (spec, mut rx) = spawn_spec(&scaler, 0);
        let agent = spec.agent;
        let handle = fx.backend.spawn(spec).await.unwrap();
        let grandchild: i32 = read_fifo(ready.clone()).await.trim().parse().unwrap();
        let grandchild =
            ProcessIdentity::of(rustix::process::Pid::from_raw(grandchild).unwrap()).unwrap();
        fail::cfg(*name, "return").unwrap();
        let err = fx
            .backend
            .destroy(&agent, Some(&handle), GRACE)
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .ends_with(&format!("injected failure at {name}")),
            "{err}"
        );
        fail::remove(*name);
        fx.backend
            .destroy(&agent, Some(&handle), GRACE)
            .await
            .unwrap();
        assert!(!grandchild.is_running(), "{name}: the grandchild survived");
        assert!(!fx.backend.agent_dir(agent).exists(), "{name}");
        assert!(!fx.layout().instance_dir().exists(), "{name}");
        assert!(processes_of(agent).is_empty(), "{name}");
        assert!(
            rx.try_recv().is_err(),
            "{name}: a destroy-caused exit was reported"
        );
    }
    scenario.teardown();
}

#[tokio::test]
async fn serial_failing_adopt_and_list_steps_take_nothing() {
    let scenario = fail::FailScenario::setup();
    let fx = Fixture::new();
    let ready = fx.fifo("ready");
    let binary = fx.script(
        "agent.sh",
        &format!("echo up > {}\nexec sleep 1000", ready.display()),
    );
    let (spec, _rx) = spawn_spec(&common::simple_scaler(&binary), 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    read_fifo(ready).await;

    fail::cfg(failpoints::LIST_SCAN, "return").unwrap();
    let err = fx.backend.list_owned().await.unwrap_err();
    assert!(err.to_string().contains(failpoints::LIST_SCAN));
    fail::remove(failpoints::LIST_SCAN);
    assert_eq!(fx.backend.list_owned().await.unwrap().len(), 1);

    let restarted = fx.restarted();
    for name in [failpoints::ADOPT_CHECK, failpoints::ADOPT_WATCH] {
        fail::cfg(name, "return").unwrap();
        let (reports, _rx) = tokio::sync::mpsc::unbounded_channel();
        let err = restarted.adopt(&agent, &handle, reports).await.unwrap_err();
        assert!(
            err.to_string()
                .ends_with(&format!("injected failure at {name}")),
            "{err}"
        );
        fail::remove(name);
    }
    // Nothing was kept of the failed adoptions: this one watches afresh.
    let (reports, _rx) = tokio::sync::mpsc::unbounded_channel();
    assert_eq!(
        restarted.adopt(&agent, &handle, reports).await.unwrap(),
        Adoption::Alive
    );
    restarted
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert_nothing_left(&fx, agent, "after adopt", true).await;
    scenario.teardown();
}
