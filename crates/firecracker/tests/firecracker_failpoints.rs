//! Failpoints (global to the process, hence a test binary of their own):
//! every spawn step's failure releases what was taken; destroy steps that
//! fail leave something a second destroy (or the sweep) removes.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kici_engine::Backend;
use std::collections::HashSet;
use std::time::Duration;
use support::{random_agent, Harness};

/// Each spawn step's failpoint: the spawn fails and leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_every_spawn_failpoint_releases_what_was_taken() {
    let h = Harness::new("").await;
    let scenario = fail::FailScenario::setup();
    for name in kici_firecracker::fp::SPAWN {
        fail::cfg(*name, "return").unwrap();
        let agent = random_agent();
        let (spec, _rx) = h.spec(agent);
        let err = h.backend.spawn(spec).await.unwrap_err();
        assert!(err.to_string().contains(name), "{name}: {err}");
        fail::remove(*name);
        h.assert_nothing_left(&agent).await;
    }
    scenario.teardown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_destroy_failpoints_leave_what_a_retry_or_the_sweep_removes() {
    let h = Harness::new("").await;
    let scenario = fail::FailScenario::setup();
    let steps = [
        kici_firecracker::fp::DESTROY_STOP,
        kici_firecracker::fp::DESTROY_RULES,
        kici_firecracker::fp::DESTROY_TAP,
        kici_firecracker::fp::DESTROY_LEASE,
        kici_firecracker::fp::DESTROY_CHROOT,
    ];
    for (i, name) in steps.iter().enumerate() {
        let agent = random_agent();
        let (spec, _rx) = h.spec(agent);
        let handle = h.backend.spawn(spec).await.unwrap();
        fail::cfg(*name, "return").unwrap();
        let err = h
            .backend
            .destroy(&agent, Some(&handle), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(err.to_string().contains(name), "{name}: {err}");
        fail::remove(*name);
        if i % 2 == 0 {
            // The engine retries destroy.
            h.backend
                .destroy(&agent, Some(&handle), Duration::from_secs(5))
                .await
                .unwrap();
        } else {
            // Or the daemon restarted and the sweep finds what is left.
            let report = h.backend.sweep(&HashSet::new()).await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
        }
        h.assert_nothing_left(&agent).await;
    }
    scenario.teardown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_mmds_clear_failpoint_reports_the_failure() {
    let h = Harness::new("").await;
    let scenario = fail::FailScenario::setup();
    let agent = random_agent();
    let (spec, _rx) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    fail::cfg(kici_firecracker::fp::MMDS_CLEAR, "return").unwrap();
    assert!(h
        .backend
        .clear_mmds(&agent, Duration::from_secs(5))
        .await
        .is_err());
    fail::remove(kici_firecracker::fp::MMDS_CLEAR);
    h.backend
        .clear_mmds(&agent, Duration::from_secs(5))
        .await
        .unwrap();
    h.backend
        .destroy(&agent, Some(&handle), Duration::from_secs(5))
        .await
        .unwrap();
    h.assert_nothing_left(&agent).await;
    scenario.teardown();
}
