//! The same flow on a real Firecracker host: ignored unless
//! `KICI_SCALER_TEST_FIRECRACKER=firecracker=<path>,jailer=<path>,kernel=<path>,rootfs=<path>`
//! names real binaries, a guest kernel and a kici rootfs (its `/init` reads
//! MMDS v2). Needs root and `/dev/kvm`. Run with
//! `cargo test -p kici-firecracker --test firecracker_real -- --ignored`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kici_engine::Backend;
use std::time::Duration;
use support::{process_running, random_agent, Binaries, Harness, RealFirecracker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real Firecracker host: set KICI_SCALER_TEST_FIRECRACKER"]
async fn serial_firecracker_real_host_spawn_clear_mmds_destroy() {
    let real = RealFirecracker::from_env().unwrap_or_else(|| {
        panic!(
            "{} must be firecracker=<path>,jailer=<path>,kernel=<path>,rootfs=<path>",
            RealFirecracker::ENV
        )
    });
    let h = Harness::with("", Binaries::Real(real)).await;
    h.backend.validate(&h.scaler).await.unwrap();
    let agent = random_agent();
    let (spec, _reports) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    h.remember(&agent, &handle);
    let api = kici_firecracker::api::ApiClient::new(
        h.root(&agent).join("run/firecracker.socket"),
        Duration::from_secs(5),
    );
    assert_eq!(api.describe_instance().await.unwrap().state, "Running");
    // The guest kernel prints on the serial console we follow.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !h.serial(&agent).contains("Linux version") {
        assert!(
            std::time::Instant::now() < deadline,
            "no kernel output:\n{}",
            h.serial(&agent)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.backend
        .clear_mmds(&agent, Duration::from_secs(5))
        .await
        .unwrap();
    let pid = h.vmm_pid(&agent).unwrap();
    h.backend
        .destroy(&agent, Some(&handle), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(!process_running(pid));
    h.assert_nothing_left(&agent).await;
}
