//! `kici-scaler doctor` through the real binary, on this host's cgroups.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");

fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kici-scaler-test-")
        .tempdir()
        .unwrap()
}

fn quickstart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/quickstart.yaml")
}

/// A copy of kici-scaler with an executable `kici-agent-lite` beside it, so
/// the bare name resolves next to the running binary (not through PATH).
fn install(dir: &Path) -> PathBuf {
    let bin_dir = dir.join("bin");
    fs::create_dir(&bin_dir).unwrap();
    let bin = bin_dir.join("kici-scaler");
    if fs::hard_link(BIN, &bin).is_err() {
        fs::copy(BIN, &bin).unwrap();
    }
    let agent = bin_dir.join("kici-agent-lite");
    fs::write(&agent, "#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&agent, fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

fn doctor(bin: &Path, config: &Path, state: &Path, json: bool) -> Output {
    let mut cmd = Command::new(bin);
    cmd.arg("doctor")
        .arg("--config")
        .arg(config)
        .arg("--state-dir")
        .arg(state)
        .env("PATH", "/usr/bin:/bin")
        .env_remove("KICI_SCALER_STATE_DIR")
        .env_remove("KICI_SCALER_CONFIG_DIR");
    if json {
        cmd.arg("--json");
    }
    cmd.output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn the_quickstart_is_healthy_with_the_agent_next_to_the_binary() {
    let dir = temp_dir();
    let bin = install(dir.path());
    let out = doctor(&bin, &quickstart(), &dir.path().join("state"), false);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.iter().all(|l| !l.starts_with("fail ")), "{text}");
    let binary = lines
        .iter()
        .find(|l| l.contains("binaryPath scalers[name=local].labelSets[0]"))
        .expect("a binaryPath row");
    assert!(binary.starts_with("ok "), "{binary}");
    assert!(
        binary.contains(
            &bin.parent()
                .unwrap()
                .join("kici-agent-lite")
                .display()
                .to_string()
        ),
        "{binary}"
    );
    for check in [
        "config",
        "cgroup v2 tracking",
        "state dir",
        "machine-pool ledger",
    ] {
        assert!(
            lines.iter().any(|l| l
                .split_once(' ')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(&format!("{check}:")))),
            "no {check} row in {text}"
        );
    }
    assert!(
        dir.path().join("state").is_dir(),
        "the state dir was created"
    );
    let leftovers: Vec<_> = fs::read_dir(dir.path().join("state")).unwrap().collect();
    assert!(leftovers.is_empty(), "the probe file was removed");
}

#[test]
fn a_missing_binary_path_is_a_fail_row_naming_it() {
    let dir = temp_dir();
    let config = dir.path().join("scalers.yaml");
    fs::write(
        &config,
        "version: 1\nscalers:\n  - name: gone\n    type: bare-metal\n    maxAgents: 1\n    \
         labelSets:\n      - labels: [linux]\n        binaryPath: /nonexistent/kici-agent-missing\n",
    )
    .unwrap();
    let out = doctor(Path::new(BIN), &config, &dir.path().join("state"), false);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let row = text
        .lines()
        .find(|l| l.contains("binaryPath scalers[name=gone].labelSets[0]"))
        .expect("a binaryPath row");
    assert!(row.starts_with("fail "), "{row}");
    assert!(row.contains("/nonexistent/kici-agent-missing"), "{row}");
}

#[test]
fn json_is_one_document_of_rows() {
    let dir = temp_dir();
    let bin = install(dir.path());
    let out = doctor(&bin, &quickstart(), &dir.path().join("state"), true);
    assert_eq!(out.status.code(), Some(0));
    let doc: Value = serde_json::from_str(&stdout(&out)).expect("exactly one JSON document");
    assert_eq!(doc["ok"], Value::Bool(true));
    let checks = doc["checks"].as_array().unwrap();
    assert!(checks.len() >= 5, "{doc}");
    for row in checks {
        let obj = row.as_object().unwrap();
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["check", "detail", "status"]);
        assert!(matches!(
            row["status"].as_str().unwrap(),
            "ok" | "warn" | "fail"
        ));
    }
    assert_eq!(checks[0]["check"], "config");
}

#[test]
fn a_broken_config_fails_in_json_too() {
    let dir = temp_dir();
    let config = dir.path().join("scalers.yaml");
    fs::write(&config, "version: 1\nscalers: 3\n").unwrap();
    let out = doctor(Path::new(BIN), &config, &dir.path().join("state"), true);
    assert_eq!(out.status.code(), Some(1));
    let doc: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(doc["ok"], Value::Bool(false));
    assert_eq!(doc["checks"][0]["check"], "config");
    assert_eq!(doc["checks"][0]["status"], "fail");
}
