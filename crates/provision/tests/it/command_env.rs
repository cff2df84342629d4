//! The provisioner command's environment leaves out the daemon's own
//! `KICI_SCALER_*` settings and the webhook's secret (its own test binary: it sets a variable in
//! this process, which no other test may observe).

#![allow(clippy::unwrap_used)]

use kici_provision::command::{run_once, EventEnv};
use std::time::Duration;

#[tokio::test]
async fn daemon_settings_are_not_passed_to_the_command() {
    // Set before any thread of this binary spawns a process.
    std::env::set_var("KICI_SCALER_API_TOKEN", "kst_must_not_leak");
    std::env::set_var("PROVISION_TEST_CLOUD_REGION", "eu-west-1");
    std::env::set_var("HOOK_SIGNING_SECRET", "must-not-leak-either");
    let attempt = run_once(
        &[
            "/bin/sh".into(),
            "-c".into(),
            "echo \"token=${KICI_SCALER_API_TOKEN:-unset} secret=${HOOK_SIGNING_SECRET:-unset} region=$PROVISION_TEST_CLOUD_REGION event=$KICI_PROVISION_EVENT\"".into(),
        ],
        b"{}",
        EventEnv {
            event: "scale-down",
            request_id: "r",
            agent_id: "a",
            remove: &["HOOK_SIGNING_SECRET".to_owned()],
        },
        Duration::from_secs(10),
        1024,
    )
    .await;
    assert!(attempt.delivered());
    assert_eq!(
        attempt.stdout.text(),
        "token=unset secret=unset region=eu-west-1 event=scale-down\n"
    );
}
