//! Bare-metal agents running as the user their scaler names
//! (`x-kici-scaler.user`): a real `serve` as root, a real host user, a real
//! job that tries to read what the daemon keeps to itself.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::daemon::{agent_lite_dir, wait_until, Daemon, Dir, BIN};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::common::users::LocalUser as TestUser;

/// A test dir others may traverse (not list): the agents' work root lives
/// beside the state dir, and the agent's user must reach it. The state dir
/// itself stays the daemon's (0700).
fn traversable_dir(config: &str) -> Dir {
    let dir = Dir::with_config(config);
    std::fs::set_permissions(dir.0.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    dir
}

fn metal_config(ext: &str) -> String {
    format!(
        "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 2\n{ext}    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
        agent_lite_dir().join("kici-agent-lite").display()
    )
}

/// The job's stdout from `GET /v1/jobs/{id}/logs` (read to its end).
fn job_stdout(d: &Daemon, id: &str) -> String {
    let (status, body) = d.http("GET", &format!("/v1/jobs/{id}/logs"), None);
    assert_eq!(status, 200, "{body}");
    let mut out = Vec::new();
    for block in body.split("\n\n") {
        let mut event = "";
        let mut data = String::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                event = if v.trim() == "output" { "output" } else { "" };
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        if event == "output" {
            let v: Value = serde_json::from_str(&data).unwrap();
            if v["stream"] == "stdout" {
                let chunk: kici_protocol::ChunkData =
                    serde_json::from_value(v["data"].clone()).unwrap();
                out.extend(chunk.into_bytes());
            }
        }
    }
    String::from_utf8(out).unwrap()
}

/// What the job tries: each line says `read:<what>` or `denied:<what>`;
/// whatever it managed to read is printed too, so a leaked secret shows.
const PROBE: &str = r#"
echo "uid=$(id -u)"
echo "cwd=$(pwd)"
echo "cwd-stat=$(stat -c '%u %a' .)"
try() { what=$1; shift; if "$@" >/dev/null 2>&1; then echo "read:$what"; "$@" 2>/dev/null | tr '\0' '\n'; else echo "denied:$what"; fi; }
try state.db cat "$STATE/state.db"
try claim-key cat "$STATE/provision-claim.key"
try state-dir ls -a "$STATE"
try environ cat "/proc/$DAEMON/environ"
try signal kill -0 "$DAEMON"
env
echo done
"#;

const SECRET_TOKEN: &str = "kst_secret_0123456789abcdef0123456789abcdef";
const SECRET_PG: &str = "pg-secret-password-4711";

#[test]
fn bare_metal_jobs_run_as_the_named_user_and_cannot_read_the_daemons_secrets() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test runs as root (it creates a user)"
    );
    let user = TestUser::create("kici-t-");
    let dir = traversable_dir(&metal_config(&format!(
        "    x-kici-scaler:\n      user: {}\n",
        user.name
    )));
    let state = dir.path("state");
    let d = Daemon::start(
        &dir,
        &["--listen", "127.0.0.1:0"],
        &[
            ("KICI_SCALER_TEST_SECRET", SECRET_TOKEN),
            ("PGPASSWORD", SECRET_PG),
        ],
    );
    let daemon_pid = d.child.id();
    // The secrets really are in the daemon's environment.
    let environ = std::fs::read(format!("/proc/{daemon_pid}/environ")).unwrap();
    assert!(String::from_utf8_lossy(&environ).contains(SECRET_PG));
    // Something a provisioner key would be, for the job to try.
    std::fs::write(state.join("provision-claim.key"), SECRET_TOKEN).unwrap();

    let body = serde_json::json!({
        "labels": ["local"],
        "command": ["sh", "-c", PROBE],
        "env": {"STATE": state.display().to_string(), "DAEMON": daemon_pid.to_string()},
    })
    .to_string();
    let (status, accepted) = d.http("POST", "/v1/jobs", Some(&body));
    assert_eq!(status, 202, "{accepted}");
    let accepted: Value = serde_json::from_str(&accepted).unwrap();
    let id = accepted["jobId"].as_str().unwrap().to_owned();
    let out = job_stdout(&d, &id);
    assert!(out.contains("\ndone\n"), "the probe did not finish:\n{out}");

    assert!(
        out.contains(&format!("uid={}\n", user.uid)),
        "not the test user's uid {}:\n{out}",
        user.uid
    );
    for what in ["state.db", "claim-key", "state-dir", "environ", "signal"] {
        assert!(
            out.contains(&format!("denied:{what}\n")),
            "{what} was not denied:\n{out}"
        );
        assert!(!out.contains(&format!("read:{what}\n")), "{out}");
    }
    for secret in [SECRET_TOKEN, SECRET_PG] {
        assert!(!out.contains(secret), "a daemon secret leaked:\n{out}");
    }
    assert!(!out.contains("KICI_SCALER_TEST_SECRET"), "{out}");
    assert!(!out.contains("PGPASSWORD"), "{out}");
    // Its own login, not the daemon's.
    assert!(out.contains(&format!("\nUSER={}\n", user.name)), "{out}");

    // Its working directory: outside the state dir, its user's, 0700.
    let cwd = out
        .lines()
        .find_map(|l| l.strip_prefix("cwd="))
        .unwrap()
        .to_owned();
    assert!(
        !std::path::Path::new(&cwd).starts_with(&state),
        "the work dir {cwd} is inside the state dir"
    );
    assert!(
        out.contains(&format!("cwd-stat={} 700\n", user.uid)),
        "{out}"
    );
    // Gone with the agent once the job ended.
    wait_until("the work dir is removed", || {
        !std::path::Path::new(&cwd).exists()
    });
    let (_, job) = d.http("GET", &format!("/v1/jobs/{id}"), None);
    let job: Value = serde_json::from_str(&job).unwrap();
    assert_eq!(job["exitCode"], 0, "{job}");
}

#[test]
fn serve_refuses_a_user_that_does_not_exist_naming_the_scaler_and_field() {
    let dir = Dir::with_config(&metal_config(
        "    x-kici-scaler:\n      user: kici-no-such-user-here\n",
    ));
    let out = dir
        .serve_command(&["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "scalers[name=local]: x-kici-scaler.user: no user \\\"kici-no-such-user-here\\\" on this host"
        ) || err.contains(
            "scalers[name=local]: x-kici-scaler.user: no user \"kici-no-such-user-here\" on this host"
        ),
        "{err}"
    );
}

#[test]
fn validate_and_doctor_warn_about_a_bare_metal_scaler_without_a_user() {
    let dir = traversable_dir(&metal_config(""));
    let out = Command::new(BIN)
        .arg("validate")
        .arg("--config")
        .arg(dir.path("scalers.yaml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("scalers[0]: bare-metal agents of this scaler run as the daemon's own user"),
        "{err}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 warning"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    let doctor = |config: &str| {
        std::fs::write(dir.path("scalers.yaml"), config).unwrap();
        let out = Command::new(BIN)
            .arg("doctor")
            .arg("--json")
            .arg("--config")
            .arg(dir.path("scalers.yaml"))
            .arg("--state-dir")
            .arg(dir.path("state"))
            .output()
            .unwrap();
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
        doc["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "agent user (local)")
            .cloned()
            .unwrap_or_else(|| panic!("no agent user row: {doc}"))
    };
    let row = doctor(&metal_config(""));
    assert_eq!(row["status"], "warn", "{row}");
    let row = doctor(&metal_config(
        "    x-kici-scaler:\n      user: kici-no-such-user-here\n",
    ));
    assert_eq!(row["status"], "fail", "{row}");
    assert!(
        row["detail"]
            .as_str()
            .unwrap()
            .contains("no user \"kici-no-such-user-here\""),
        "{row}"
    );
    let row = doctor(&metal_config("    x-kici-scaler:\n      user: nobody\n"));
    assert_eq!(row["status"], "ok", "{row}");
}
