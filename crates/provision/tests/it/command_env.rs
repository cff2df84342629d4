//! The provisioner command's environment: nothing of the daemon's but
//! `PATH`, `HOME`, `LANG`, `LC_ALL`, the scaler's `passEnv` and `env`, and
//! the event variables. Each test sets variables in this process (the
//! daemon's side), which is only sound because nextest runs every test in a
//! process of its own, and sets them before anything here starts a thread
//! that could read the environment.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_provision::{
    parse_provisioner, ClaimCode, Deliverer, EventKind, EventResources, ProvisionEvent, RequestId,
    ScaleUp, TargetKind, Timestamp,
};
use std::collections::BTreeMap;
use std::time::Duration;

/// What a daemon's environment typically holds besides its settings:
/// credentials of other parts of the deployment, and another scaler's
/// webhook key.
const DAEMON_ENV: [(&str, &str); 8] = [
    ("KICI_SCALER_API_TOKEN", "kst_must_not_leak"),
    ("PGPASSWORD", "database-password-must-not-leak"),
    ("OTHER_SCALER_HOOK_SECRET", "other-scalers-webhook-key"),
    ("HOOK_SIGNING_SECRET", "this-scalers-webhook-key"),
    ("KICI_PROVISIONER_SECRET", "a-kici-named-secret"),
    ("HOME", "/var/lib/kici-scaler"),
    ("LANG", "C.UTF-8"),
    ("LC_ALL", "C"),
];

fn set_daemon_env(extra: &[(&str, &str)]) {
    for (k, v) in DAEMON_ENV.iter().chain(extra) {
        std::env::set_var(k, v);
    }
}

fn scale_up() -> ProvisionEvent {
    let agent = "scaler-event-0a0b0c0d";
    ProvisionEvent::ScaleUp(ScaleUp {
        request_id: RequestId::derive("0a1b2c3d", agent, EventKind::ScaleUp),
        agent_id: agent.into(),
        scaler: "cloud".into(),
        labels: vec!["linux".into()],
        resources: EventResources::default(),
        claim_code: ClaimCode::generate(),
        claim_url: "http://127.0.0.1:9/v1/claims".into(),
        expires_at: Timestamp::now().saturating_add(Duration::from_secs(300)),
        job_id: None,
    })
}

/// Delivers a scale-up, through the daemon's path (the block parsed, the
/// deliverer built from the process environment), to a command that dumps
/// its environment; the variables it saw.
async fn command_environment(block: serde_json::Value) -> BTreeMap<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("env.txt");
    let mut block = block;
    block["command"] = serde_json::json!([
        "/bin/sh",
        "-c",
        "exec /usr/bin/env >\"$0\"",
        dump.display().to_string()
    ]);
    let config = parse_provisioner(&block).unwrap();
    let deliverer = Deliverer::new(&config, |n| std::env::var(n).ok()).unwrap();
    let outcome = deliverer.deliver(&scale_up()).await;
    // A webhook in the block (only there for its secretEnv) has no
    // receiver: the command's report is what counts.
    assert!(
        outcome
            .reports
            .iter()
            .any(|r| r.target == TargetKind::Command && r.failure.is_none()),
        "{:?}",
        outcome.failure_summary()
    );
    let text = std::fs::read_to_string(&dump).unwrap();
    let mut vars: BTreeMap<String, String> = text
        .lines()
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect();
    // The shell's own: dash sets it for what it runs.
    vars.remove("PWD");
    vars
}

fn names(vars: &BTreeMap<String, String>) -> Vec<&str> {
    vars.keys().map(String::as_str).collect()
}

#[tokio::test]
async fn the_command_gets_only_the_allowlist_of_the_daemon_environment() {
    set_daemon_env(&[]);
    let vars = command_environment(serde_json::json!({
        "webhook": {"url": "http://127.0.0.1:9/hook", "secretEnv": "HOOK_SIGNING_SECRET"},
        "maxAttempts": 1
    }))
    .await;
    // Exactly the allowlist: no other scaler's key, no database password,
    // no daemon setting, not this scaler's own webhook secret.
    assert_eq!(
        names(&vars),
        [
            "HOME",
            "LANG",
            "LC_ALL",
            "PATH",
            "PROVISION_AGENT_ID",
            "PROVISION_EVENT",
            "PROVISION_REQUEST_ID"
        ],
        "{vars:?}"
    );
    assert_eq!(vars["PATH"], std::env::var("PATH").unwrap());
    assert_eq!(vars["HOME"], "/var/lib/kici-scaler");
    assert_eq!(vars["LANG"], "C.UTF-8");
    assert_eq!(vars["LC_ALL"], "C");
    assert_eq!(vars["PROVISION_EVENT"], "scale-up");
    assert_eq!(vars["PROVISION_AGENT_ID"], "scaler-event-0a0b0c0d");
    assert_eq!(
        vars["PROVISION_REQUEST_ID"],
        "0a1b2c3d.scaler-event-0a0b0c0d.scale-up"
    );
    // Not a single KICI_* name: the agent a script starts would refuse it.
    assert!(!vars.keys().any(|k| k.starts_with("KICI_")), "{vars:?}");
}

#[tokio::test]
async fn env_and_pass_env_reach_the_command_and_nothing_else_does() {
    set_daemon_env(&[
        ("CLOUD_TOKEN", "passed-on-purpose"),
        ("CLOUD_REGION", "not-passed"),
    ]);
    std::env::remove_var("UNSET_IN_THE_DAEMON");
    std::env::remove_var("PATH");
    let vars = command_environment(serde_json::json!({
        "env": {"CLOUD_ZONE": "eu-west-1a", "LANG": "en_GB.UTF-8"},
        "passEnv": ["CLOUD_TOKEN", "UNSET_IN_THE_DAEMON", "PGPASSWORD"],
    }))
    .await;
    assert_eq!(
        names(&vars),
        [
            "CLOUD_TOKEN",
            "CLOUD_ZONE",
            "HOME",
            "LANG",
            "LC_ALL",
            "PATH",
            "PGPASSWORD",
            "PROVISION_AGENT_ID",
            "PROVISION_EVENT",
            "PROVISION_REQUEST_ID"
        ],
        "{vars:?}"
    );
    assert_eq!(vars["CLOUD_TOKEN"], "passed-on-purpose");
    assert_eq!(vars["PGPASSWORD"], "database-password-must-not-leak");
    assert_eq!(vars["CLOUD_ZONE"], "eu-west-1a");
    // `env` is over what is inherited.
    assert_eq!(vars["LANG"], "en_GB.UTF-8");
    // A daemon without PATH: the command still finds programs.
    assert_eq!(
        vars["PATH"],
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    );
}
