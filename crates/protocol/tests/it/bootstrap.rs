//! The agent bootstrap contract: what parses, what is refused and how the
//! error reads.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_model::{BackpressureMode, Role, Roles};
use kici_protocol::bootstrap::*;
use std::collections::BTreeMap;
use std::time::Duration;

const TOKEN: &str = "kat_00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn minimal() -> Vec<(&'static str, &'static str)> {
    vec![
        ("KICI_ORCHESTRATOR_URL", "ws://127.0.0.1:7879/ws"),
        ("KICI_AGENT_ID", "scaler-container-0a1b2c3d"),
    ]
}

fn with(extra: &[(&'static str, &'static str)]) -> BTreeMap<String, String> {
    let mut pairs = minimal();
    pairs.extend_from_slice(extra);
    env(&pairs)
}

fn problems(env: &BTreeMap<String, String>) -> Vec<BootstrapProblem> {
    Bootstrap::from_env(env).unwrap_err().problems
}

#[test]
fn minimal_bootstrap_takes_the_contract_defaults() {
    let b = Bootstrap::from_env(&with(&[("PATH", "/bin"), ("HOME", "/root")])).unwrap();
    assert_eq!(b.orchestrator_url.as_str(), "ws://127.0.0.1:7879/ws");
    assert_eq!(b.orchestrator_url.scheme(), WsScheme::Ws);
    assert_eq!(b.agent_id.to_string(), "scaler-container-0a1b2c3d");
    assert!(b.labels.is_empty());
    assert!(b.token.is_none());
    assert!(!b.scaler_managed);
    assert_eq!(b.roles, Roles::All);
    assert_eq!(b.idle_timeout, Duration::from_millis(5000));
    assert_eq!(b.pending_dispatch_timeout, Duration::from_millis(60000));
    assert_eq!(b.max_reconnect_delay, Duration::from_millis(60000));
    assert_eq!(b.backpressure, BackpressureMode::Pause);
    assert!(b.tolerated_unknown.is_empty());
}

#[test]
fn full_bootstrap_parses_every_contract_variable() {
    let b = Bootstrap::from_env(&with(&[
        (
            "KICI_LABELS",
            "linux, GPU,,kici:agent:container,kici:scaler:s1",
        ),
        ("KICI_AGENT_TOKEN", TOKEN),
        ("KICI_SCALER_MANAGED", "1"),
        ("KICI_ROLES", "builder"),
        ("KICI_SCALER_IDLE_TIMEOUT", "300000"),
        ("KICI_SCALER_PENDING_DISPATCH_TIMEOUT", "250"),
        ("KICI_BACKPRESSURE_MODE", "drop"),
        ("KICI_AGENT_MAX_RECONNECT_DELAY_MS", "20"),
        ("KICI_EXECUTION_MODE", "bare-metal"),
        ("KICI_PORT", "0"),
        ("KICI_LOG_LEVEL", "debug"),
        ("KICI_E2E_SOMETHING", "x"),
        ("KICI_AGENT_ENV_FOO", "x"),
    ]))
    .unwrap();
    assert_eq!(
        b.labels.key(),
        "gpu,kici:agent:container,kici:scaler:s1,linux"
    );
    assert_eq!(b.token.as_ref().unwrap().expose(), TOKEN);
    assert!(b.scaler_managed);
    assert_eq!(b.roles, Roles::Only(vec![Role::Builder]));
    assert_eq!(b.idle_timeout, Duration::from_secs(300));
    assert_eq!(b.pending_dispatch_timeout, Duration::from_millis(250));
    assert_eq!(b.max_reconnect_delay, Duration::from_millis(20));
    assert_eq!(b.backpressure, BackpressureMode::Drop);
    assert_eq!(b.log_level.as_deref(), Some("debug"));
}

#[test]
fn unknown_kici_variables_are_named_in_the_error() {
    let e = Bootstrap::from_env(&with(&[
        ("KICI_BOGUS", "1"),
        ("KICI_MAX_CONCURRENT_JOBS", "2"),
        ("KICIX", "fine"),
        ("NOT_KICI_BOGUS", "fine"),
    ]))
    .unwrap_err();
    assert_eq!(
        e.problems,
        [BootstrapProblem::UnknownVariables(vec![
            "KICI_BOGUS".into(),
            "KICI_MAX_CONCURRENT_JOBS".into()
        ])]
    );
    let msg = e.to_string();
    assert!(
        msg.contains("unknown KICI_* variable(s) KICI_BOGUS, KICI_MAX_CONCURRENT_JOBS"),
        "{msg}"
    );
}

#[test]
fn kici_dev_downgrades_unknown_names_to_a_tolerated_list() {
    let b = Bootstrap::from_env(&with(&[("KICI_DEV", "true"), ("KICI_BOGUS", "1")])).unwrap();
    assert_eq!(b.tolerated_unknown, ["KICI_BOGUS"]);
    // Only the literal `true`.
    assert!(Bootstrap::from_env(&with(&[("KICI_DEV", "1"), ("KICI_BOGUS", "1")])).is_err());
}

#[test]
fn every_problem_is_reported_at_once() {
    let e = Bootstrap::from_env(&env(&[
        ("KICI_AGENT_ID", "myhost-1234"),
        ("KICI_LABELS", "a b"),
        ("KICI_AGENT_TOKEN", "not-a-token"),
        ("KICI_ROLES", "builder,cook"),
        ("KICI_SCALER_IDLE_TIMEOUT", "5s"),
        ("KICI_BACKPRESSURE_MODE", "block"),
        ("KICI_AGENT_MAX_RECONNECT_DELAY_MS", "0"),
        ("KICI_UNHEARD_OF", "1"),
    ]))
    .unwrap_err();
    let msgs: Vec<String> = e.problems.iter().map(|p| p.to_string()).collect();
    assert_eq!(msgs.len(), 9, "{msgs:#?}");
    let all = e.to_string();
    for needle in [
        "KICI_UNHEARD_OF",
        "KICI_ORCHESTRATOR_URL is required",
        "KICI_AGENT_ID: agent id \"myhost-1234\"",
        "KICI_LABELS: label \"a b\"",
        "KICI_AGENT_TOKEN: an agent token is",
        "unknown role \"cook\"",
        "KICI_SCALER_IDLE_TIMEOUT must be an integer number of milliseconds, got \"5s\"",
        "expected pause or drop, got \"block\"",
        "KICI_AGENT_MAX_RECONNECT_DELAY_MS: must be positive",
    ] {
        assert!(all.contains(needle), "missing {needle:?} in {all}");
    }
    assert!(
        !all.contains("not-a-token"),
        "the token value leaked: {all}"
    );
}

#[test]
fn urls_must_be_websocket_urls_with_a_host() {
    for (raw, needle) in [
        ("http://127.0.0.1:7879/ws", "scheme \"http\""),
        ("127.0.0.1:7879", ""),
        ("ws://", ""),
        ("unix:/run/gw.sock", "scheme"),
        ("ws://user:pw@127.0.0.1/ws", "credentials"),
        ("", "is required"),
    ] {
        let mut e = with(&[]);
        e.insert("KICI_ORCHESTRATOR_URL".into(), raw.into());
        let p = problems(&e);
        assert_eq!(p.len(), 1, "{raw}: {p:?}");
        assert!(p[0].to_string().contains(needle), "{raw}: {}", p[0]);
        assert!(
            p[0].to_string().contains("KICI_ORCHESTRATOR_URL"),
            "{}",
            p[0]
        );
    }
    let mut e = with(&[]);
    e.insert(
        "KICI_ORCHESTRATOR_URL".into(),
        "wss://gw.example:443/ws".into(),
    );
    assert_eq!(
        Bootstrap::from_env(&e).unwrap().orchestrator_url.scheme(),
        WsScheme::Wss
    );
}

#[test]
fn agent_id_is_required_and_in_the_scaler_format() {
    let e = env(&[("KICI_ORCHESTRATOR_URL", "ws://h/ws")]);
    assert_eq!(problems(&e), [BootstrapProblem::Missing("KICI_AGENT_ID")]);
}

#[test]
fn reserved_labels_need_scaler_management() {
    let p = problems(&with(&[("KICI_LABELS", "linux,kici:agent:container")]));
    assert_eq!(
        p,
        [BootstrapProblem::ReservedLabel(
            "kici:agent:container".into()
        )]
    );
    // Only the literal `1` counts.
    let p = problems(&with(&[
        ("KICI_LABELS", "kici:agent:container"),
        ("KICI_SCALER_MANAGED", "true"),
    ]));
    assert_eq!(p.len(), 1);
}

#[test]
fn roles_follow_the_contract() {
    let roles = |raw: &'static str| {
        Bootstrap::from_env(&with(&[("KICI_ROLES", raw)]))
            .unwrap()
            .roles
    };
    assert_eq!(roles(""), Roles::Only(vec![]));
    assert_eq!(roles("all"), Roles::All);
    assert_eq!(roles("builder,all"), Roles::All);
    assert_eq!(
        roles("init-runner, builder,builder"),
        Roles::Only(vec![Role::InitRunner, Role::Builder])
    );
}

#[test]
fn non_positive_windows_mean_leave_at_once() {
    let b = Bootstrap::from_env(&with(&[
        ("KICI_SCALER_IDLE_TIMEOUT", "0"),
        ("KICI_SCALER_PENDING_DISPATCH_TIMEOUT", "-5"),
    ]))
    .unwrap();
    assert_eq!(b.idle_timeout, Duration::ZERO);
    assert_eq!(b.pending_dispatch_timeout, Duration::ZERO);
}

#[test]
fn register_labels_add_host_and_role_labels() {
    let b = Bootstrap::from_env(&with(&[
        ("KICI_LABELS", "linux,kici:agent:container,kici:scaler:s1"),
        ("KICI_SCALER_MANAGED", "1"),
        ("KICI_ROLES", "builder"),
    ]))
    .unwrap();
    let host = HostFacts {
        os: "linux".into(),
        arch: "x86_64".into(),
        hostname: Some("Box-7".into()),
    };
    assert_eq!(host.platform(), "linux");
    assert_eq!(host.node_arch(), "x64");
    assert_eq!(
        b.register_labels(&host).key(),
        "kici:agent:container,kici:arch:amd64,kici:arch:x64,kici:host:box-7,\
         kici:os:linux,kici:role:builder,kici:scaler:s1,linux"
    );

    let mac = HostFacts {
        os: "macos".into(),
        arch: "aarch64".into(),
        hostname: Some("bad host".into()),
    };
    assert_eq!(mac.platform(), "darwin");
    let labels: Vec<String> = mac.labels().iter().map(|l| l.to_string()).collect();
    // An unusable hostname is left out rather than failing registration.
    assert_eq!(
        labels,
        ["kici:os:macos", "kici:os:darwin", "kici:arch:arm64"]
    );
    let win = HostFacts {
        os: "windows".into(),
        arch: "x86_64".into(),
        hostname: None,
    };
    assert_eq!(win.platform(), "win32");
    assert_eq!(win.labels().len(), 4);

    let all_roles = Bootstrap::from_env(&with(&[])).unwrap();
    let key = all_roles.register_labels(&host).key();
    assert!(key.contains("kici:role:builder") && key.contains("kici:role:init-runner"));
    let no_roles = Bootstrap::from_env(&with(&[("KICI_ROLES", "")])).unwrap();
    assert!(!no_roles.register_labels(&host).key().contains("kici:role:"));
}

#[test]
fn debug_output_never_shows_the_token() {
    let b = Bootstrap::from_env(&with(&[("KICI_AGENT_TOKEN", TOKEN)])).unwrap();
    let debug = format!("{b:?}");
    assert!(!debug.contains(&TOKEN[4..]), "{debug}");
}
