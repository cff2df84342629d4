//! End to end against crates/testkit: the spec-enforcing `fc-sim` behind the
//! faithful `fake-jailer` (real chroot, new PID namespace, uid drop), a
//! simulated guest that reads MMDS V2 and runs a guest agent; real TAP,
//! bridge and ext4 overlay. Host-global: every test is `serial_*`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kici_engine::{Backend, BackendReport};
use kici_testkit::fc::{GuestMode, GuestSetup, SimClient};
use std::time::Duration;
use support::{process_running, random_agent, Binaries, Harness};

async fn recv(rx: &mut tokio::sync::mpsc::UnboundedReceiver<BackendReport>) -> BackendReport {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("no report within 60 s")
        .expect("report channel closed")
}

fn sim(h: &Harness, agent: &kici_model::AgentId) -> SimClient {
    SimClient::new(h.root(agent).join("run/firecracker.socket"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_testkit_guest_agent_runs_with_the_mmds_env_and_destroy_leaves_nothing()
{
    let h = Harness::with(
        "        env:\n          FOO: bar",
        Binaries::Testkit(GuestSetup::default()),
    )
    .await;
    let agent = random_agent();
    let (spec, mut reports) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    h.remember(&agent, &handle);
    let client = sim(&h, &agent);
    // Running, and the guest agent has written its report (it does so
    // right after it starts).
    let report_path = h.root(&agent).join("agent-report.json");
    let st = tokio::task::spawn_blocking({
        let client = client.clone();
        let report_path = report_path.clone();
        move || {
            client.wait_state(Duration::from_secs(30), |s| {
                s.guest_phase() == "agent-running"
                    && std::fs::read_to_string(&report_path)
                        .is_ok_and(|t| serde_json::from_str::<serde_json::Value>(&t).is_ok())
            })
        }
    })
    .await
    .unwrap()
    .unwrap();
    // Every call the backend made was accepted by the spec-enforcing VMM,
    // in an order it accepts.
    let log: Vec<_> = st
        .request_log()
        .into_iter()
        .filter(|(m, p, _)| !(m == "GET" && (p == "/" || p.starts_with("/testkit"))))
        .collect();
    for (m, p, status) in &log {
        assert!(
            (200..300).contains(status),
            "{m} {p} -> {status}: {:?}",
            st.0
        );
    }
    assert_eq!(log.last().unwrap().1, "/actions");
    assert_eq!(st.uid(), Some(10000));
    // MMDS V2: the guest needed a session token; token-less reads got 401.
    let guest = st.guest();
    assert_eq!(guest["tokenless_read_status"], 401, "{guest}");
    assert_eq!(guest["token_status"], 200, "{guest}");
    assert_eq!(guest["metadata"]["kici-agent-id"], agent.to_string());
    // The guest agent ran with the contract env from MMDS.
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    let text = report.to_string();
    for needle in [
        agent.to_string(),
        "kat_test_token".into(),
        "FOO".into(),
        "HTTP_PROXY".into(),
    ] {
        assert!(text.contains(&needle), "{needle} missing from {text}");
    }

    // config.ack → MMDS cleared and verified.
    h.backend
        .clear_mmds(&agent, Duration::from_secs(5))
        .await
        .unwrap();
    let st = tokio::task::spawn_blocking(move || client.state())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(st.mmds(), &serde_json::json!({"latest": {"meta-data": {}}}));

    let pid = h.vmm_pid(&agent).unwrap();
    assert!(process_running(pid));
    h.backend
        .destroy(&agent, Some(&handle), Duration::from_secs(10))
        .await
        .unwrap();
    h.assert_nothing_left(&agent).await;
    assert!(
        reports.try_recv().is_err(),
        "destroy's own exit is not reported"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_testkit_kernel_panic_is_a_boot_failure_then_an_exit() {
    let h = Harness::with(
        "",
        Binaries::Testkit(GuestSetup {
            mode: GuestMode::KernelPanic,
            ..Default::default()
        }),
    )
    .await;
    let agent = random_agent();
    let (spec, mut reports) = h.spec(agent);
    // The VMM may die before or after InstanceStart returns: either the
    // spawn fails (and releases everything) or the watch reports it.
    match h.backend.spawn(spec).await {
        Ok(handle) => {
            h.remember(&agent, &handle);
            match recv(&mut reports).await {
                BackendReport::BootFailure { detail, .. } => {
                    assert!(
                        detail.starts_with("kernel-panic")
                            || detail.starts_with("rootfs-mount-failure"),
                        "{detail}"
                    )
                }
                other => panic!("{other:?}"),
            }
            assert!(matches!(
                recv(&mut reports).await,
                BackendReport::Exited { .. }
            ));
            h.backend
                .destroy(&agent, Some(&handle), Duration::from_secs(1))
                .await
                .unwrap();
        }
        Err(e) => assert!(
            e.to_string().contains("Kernel panic") || e.to_string().contains("exited"),
            "{e}"
        ),
    }
    h.assert_nothing_left(&agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_testkit_guest_ignoring_ctrl_alt_del_is_killed_after_the_grace() {
    let h = Harness::with(
        "",
        Binaries::Testkit(GuestSetup {
            mode: GuestMode::IgnoreCtrlAltDel,
            ..Default::default()
        }),
    )
    .await;
    let agent = random_agent();
    let (spec, _reports) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    h.remember(&agent, &handle);
    let pid = h.vmm_pid(&agent).unwrap();
    h.backend
        .destroy(&agent, Some(&handle), Duration::from_millis(300))
        .await
        .unwrap();
    assert!(!process_running(pid));
    h.assert_nothing_left(&agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_testkit_destroy_removes_the_jailers_cgroup() {
    let h = Harness::with_cgroups("", Binaries::Testkit(GuestSetup::default()), |dir| {
        Some(kici_firecracker::JailerCgroups {
            version: kici_firecracker::CgroupVersion::V2,
            parent: Some("kici-test".into()),
            settings: vec!["pids.max=512".into()],
            mount: dir.join("cgroup"),
        })
    })
    .await;
    let agent = random_agent();
    let (spec, _reports) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    h.remember(&agent, &handle);
    let cgroup = h
        .dir
        .path()
        .join("cgroup/kici-test")
        .join(agent.to_string());
    assert!(cgroup.is_dir(), "the jailer made {}", cgroup.display());
    h.backend
        .destroy(&agent, Some(&handle), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        !cgroup.exists(),
        "the jailer never removes it; destroy does"
    );
    h.assert_nothing_left(&agent).await;
}
