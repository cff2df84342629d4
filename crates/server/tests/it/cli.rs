//! The real `kici-scaler` binary against configuration files on disk.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");

const MAIN_OK: &str = "\
version: 1
scalers:
  - name: linux
    type: container
    maxAgents: 4
    labelSets:
      - labels: [linux, x64]
        image: kici/agent:1
      - labels: [linux, arm64]
        image: kici/agent:1-arm64
";

const DROP_IN_GPU: &str = "\
scalers:
  - name: gpu
    type: bare-metal
    maxAgents: 1
    mandatoryLabels: [gpu]
    labelSets:
      - labels: [linux, x64, gpu]
        binaryPath: /nonexistent/kici-agent-lite
";

/// A config in a temp dir (swept by .ci/run if a killed run leaves it).
struct ConfigDir {
    root: tempfile::TempDir,
}

impl ConfigDir {
    fn new(main: &str, drop_ins: &[(&str, &str)]) -> Self {
        let root = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        fs::write(root.path().join("scalers.yaml"), main).unwrap();
        fs::create_dir(root.path().join("scalers.d")).unwrap();
        for (name, text) in drop_ins {
            fs::write(root.path().join("scalers.d").join(name), text).unwrap();
        }
        ConfigDir { root }
    }

    fn main(&self) -> PathBuf {
        self.root.path().join("scalers.yaml")
    }

    fn drop_in_dir(&self) -> PathBuf {
        self.root.path().join("scalers.d")
    }

    /// Runs `kici-scaler <command> --config <main> --config-dir <dir> <args>`.
    fn run(&self, command: &str, args: &[&str]) -> Output {
        run_with_config(command, &self.main(), Some(&self.drop_in_dir()), args)
    }
}

fn run_with_config(command: &str, main: &Path, dir: Option<&Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg(command).arg("--config").arg(main);
    if let Some(dir) = dir {
        cmd.arg("--config-dir").arg(dir);
    }
    cmd.args(args)
        .env_remove("KICI_SCALER_CONFIG_PATH")
        .env_remove("KICI_SCALER_CONFIG_DIR")
        .env_remove("KICI_SCALER_LOG")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

/// Parses stdout as exactly one JSON document (and nothing else but
/// whitespace).
fn one_json_document(o: &Output) -> Value {
    let docs: Vec<Value> = serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", stdout(o)));
    assert_eq!(docs.len(), 1, "stdout: {}", stdout(o));
    docs.into_iter().next().unwrap()
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

#[test]
fn validate_prints_a_one_line_summary() {
    let cfg = ConfigDir::new(MAIN_OK, &[("10-gpu.yaml", DROP_IN_GPU)]);
    let out = cfg.run("validate", &[]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!(
            "ok: 2 scalers, 3 label sets, 1 warning ({}, {})\n",
            cfg.main().display(),
            cfg.drop_in_dir().join("10-gpu.yaml").display()
        )
    );
    // The drop-in's bare-metal scaler names no agent user.
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("scalers[1]: bare-metal agents of this scaler run as the daemon's own user"),
        "{err}"
    );
}

#[test]
fn validate_without_a_drop_in_dir_reads_only_the_main_file() {
    let cfg = ConfigDir::new(MAIN_OK, &[("10-gpu.yaml", DROP_IN_GPU)]);
    let out = run_with_config("validate", &cfg.main(), None, &[]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert_eq!(
        stdout(&out),
        format!(
            "ok: 1 scaler, 2 label sets, 0 warnings ({})\n",
            cfg.main().display()
        )
    );
}

#[test]
fn validate_sends_warnings_to_stderr() {
    let main = format!("{MAIN_OK}someFutureKey: true\n");
    let cfg = ConfigDir::new(&main, &[]);
    let out = cfg.run("validate", &[]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert!(stdout(&out).starts_with("ok: 1 scaler, 2 label sets, 1 warning ("));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("warning: "), "{err}");
    assert!(err.contains("someFutureKey"), "{err}");
    assert!(err.contains(&format!("{}:", cfg.main().display())), "{err}");
}

/// Three errors, two in the main file and one in a drop-in.
fn three_errors_in_two_files() -> ConfigDir {
    let main = "\
version: 1
globalMaxAgents: many
scalers:
  - name: linux
    type: container
    maxAgents: 4
    labelSets:
      - labels: [linux]
        image: kici/agent:1
        resources: { cpus: 1, memory: 4 gigs }
";
    let drop_in = "\
scalers:
  - name: linux
    type: bare-metal
    maxAgents: 1
    labelSets:
      - labels: [mac]
        binaryPath: /opt/agent
";
    ConfigDir::new(main, &[("01-extra.yaml", drop_in)])
}

#[test]
fn validate_reports_every_error_of_every_file_and_prints_nothing_on_stdout() {
    let cfg = three_errors_in_two_files();
    let out = cfg.run("validate", &[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "");
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    let main = cfg.main().display().to_string();
    let drop_in = cfg
        .drop_in_dir()
        .join("01-extra.yaml")
        .display()
        .to_string();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(
        lines[0].starts_with(&format!("{main}:2:18: globalMaxAgents: ")),
        "{err}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "{main}:10:39: scalers[0].labelSets[0].resources.memory: "
        )),
        "{err}"
    );
    assert!(
        lines[2].starts_with(&format!("{drop_in}:2:11: scalers[1].name: ")),
        "{err}"
    );
    assert!(lines[2].contains("duplicate scaler name"), "{err}");
}

#[test]
fn validate_json_reports_errors_in_one_document() {
    let cfg = three_errors_in_two_files();
    let out = cfg.run("validate", &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let doc = one_json_document(&out);
    assert_eq!(doc["valid"], false);
    let errors = doc["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 3);
    assert_eq!(errors[0]["path"], "globalMaxAgents");
    assert_eq!(errors[0]["line"], 2);
    assert_eq!(errors[0]["col"], 18);
    assert_eq!(errors[2]["path"], "scalers[1].name");
    // stderr still lists them for a human.
    assert_eq!(stderr(&out).lines().count(), 3);
}

#[test]
fn validate_json_summarises_a_valid_config() {
    let cfg = ConfigDir::new(MAIN_OK, &[("10-gpu.yaml", DROP_IN_GPU)]);
    let out = cfg.run("validate", &["--json"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let doc = one_json_document(&out);
    assert_eq!(doc["valid"], true);
    assert_eq!(doc["scalers"], 2);
    assert_eq!(doc["labelSets"], 3);
    assert_eq!(doc["files"].as_array().unwrap().len(), 2);
    assert_eq!(doc["errors"].as_array().unwrap().len(), 0);
}

#[test]
fn route_json_names_the_chosen_scaler_and_explains_every_candidate() {
    let cfg = ConfigDir::new(MAIN_OK, &[("10-gpu.yaml", DROP_IN_GPU)]);
    let out = cfg.run("route", &["--labels", "linux,GPU", "--json"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let doc = one_json_document(&out);
    let obj = doc.as_object().unwrap();
    let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    assert_eq!(keys.len(), 3, "{doc}");
    assert_eq!(doc["scaler"], "gpu");
    assert_eq!(doc["labelSetIndex"], 0);
    let candidates = doc["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 3, "{doc}");
    for c in candidates {
        let c = c.as_object().unwrap();
        assert_eq!(c.len(), 3, "{c:?}");
        assert!(c["scaler"].is_string() && c["labelSetIndex"].is_u64() && c["reason"].is_string());
    }
    assert_eq!(candidates[0]["scaler"], "linux");
    assert_eq!(candidates[0]["reason"], "not-superset:gpu");
    assert_eq!(candidates[2]["scaler"], "gpu");
    assert_eq!(candidates[2]["reason"], "selected");
}

/// `--labels ''` is a job with no labels, which upstream routes to the first
/// label set without a gate (the gated gpu pool is skipped).
#[test]
fn route_with_no_labels_picks_the_first_ungated_label_set() {
    let cfg = ConfigDir::new(MAIN_OK, &[("10-gpu.yaml", DROP_IN_GPU)]);
    let out = cfg.run("route", &["--labels", "", "--json"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let doc = one_json_document(&out);
    assert_eq!(doc["scaler"], "linux", "{doc}");
    assert_eq!(doc["labelSetIndex"], 0, "{doc}");
}

#[test]
fn route_text_shows_the_choice_and_each_reason() {
    let cfg = ConfigDir::new(MAIN_OK, &[("10-gpu.yaml", DROP_IN_GPU)]);
    let out = cfg.run("route", &["--labels", "linux", "--exclude", "arm64"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(
        lines[0].starts_with("scaler linux, label set 0 [linux, x64]"),
        "{text}"
    );
    assert_eq!(lines[1], "  linux[0] [linux, x64]: selected");
    assert_eq!(lines[2], "  linux[1] [arm64, linux]: excluded:arm64");
    assert_eq!(lines[3], "  gpu[0] [gpu, linux, x64]: gated-missing:gpu");
}

#[test]
fn route_without_a_backend_exits_2_with_a_null_scaler() {
    let cfg = ConfigDir::new(MAIN_OK, &[]);
    let out = cfg.run("route", &["--labels", "windows", "--json"]);
    assert_eq!(out.status.code(), Some(2), "stderr: {}", stderr(&out));
    let doc = one_json_document(&out);
    assert!(doc.as_object().unwrap().contains_key("scaler"));
    assert_eq!(doc["scaler"], Value::Null);
    assert_eq!(doc["labelSetIndex"], Value::Null);
    let reasons: Vec<&str> = doc["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, ["not-superset:windows", "not-superset:windows"]);

    let text = cfg.run("route", &["--labels", "windows"]);
    assert_eq!(text.status.code(), Some(2));
    assert!(
        stdout(&text).starts_with("no-backend: "),
        "{}",
        stdout(&text)
    );
}

#[test]
fn route_rejects_a_bad_label_by_name() {
    let cfg = ConfigDir::new(MAIN_OK, &[]);
    let out = cfg.run("route", &["--labels", "linux,has space"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "");
    let err = stderr(&out);
    assert!(err.contains("--labels"), "{err}");
    assert!(err.contains("\"has space\""), "{err}");

    let out = cfg.run("route", &["--labels", "linux", "--exclude", "a,,b"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--exclude"), "{}", stderr(&out));
}

#[test]
fn route_on_an_invalid_config_exits_1_with_the_errors() {
    let cfg = three_errors_in_two_files();
    let out = cfg.run("route", &["--labels", "linux", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "");
    assert_eq!(stderr(&out).lines().count(), 3, "{}", stderr(&out));
}

#[test]
fn a_bad_command_line_is_a_usage_error_not_no_backend() {
    let cfg = ConfigDir::new(MAIN_OK, &[]);
    let out = cfg.run("route", &[]); // --labels missing
    assert_eq!(out.status.code(), Some(64));
    assert_eq!(stdout(&out), "");
    assert!(stderr(&out).contains("--labels"));

    let help = Command::new(BIN).arg("--help").output().unwrap();
    assert_eq!(help.status.code(), Some(0));
    assert!(stdout(&help).contains("validate"));
}

#[test]
fn logs_are_json_lines_on_stderr_and_stdout_stays_one_document() {
    let cfg = ConfigDir::new(MAIN_OK, &[]);
    let out = Command::new(BIN)
        .args(["route", "--json", "--labels", "linux,x64", "--config"])
        .arg(cfg.main())
        .env("KICI_SCALER_LOG", "debug")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    assert_eq!(one_json_document(&out)["scaler"], "linux");
    let err = stderr(&out);
    let events: Vec<Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(!events.is_empty(), "no log event at debug level");
    for e in &events {
        assert!(
            e["level"].is_string() && e["fields"]["message"].is_string(),
            "{e}"
        );
    }
    assert!(events
        .iter()
        .any(|e| e["fields"]["message"] == "configuration loaded"));
}

#[test]
fn the_shipped_examples_are_valid_and_route() {
    let ex = examples();
    let quick = run_with_config("validate", &ex.join("quickstart.yaml"), None, &[]);
    assert_eq!(quick.status.code(), Some(0), "{}", stderr(&quick));
    // Its agents run as whoever runs `run`: the one warning says so.
    assert!(stdout(&quick).starts_with("ok: 1 scaler, 1 label set, 1 warning ("));

    let routed = run_with_config(
        "route",
        &ex.join("quickstart.yaml"),
        None,
        &["--labels", "linux", "--json"],
    );
    assert_eq!(routed.status.code(), Some(0), "{}", stderr(&routed));
    assert_eq!(one_json_document(&routed)["scaler"], "local");

    // Paths in these files do not exist here: validate reads only the config.
    let full = run_with_config(
        "validate",
        &ex.join("scalers.yaml"),
        Some(&ex.join("scalers.d")),
        &["--json"],
    );
    assert_eq!(full.status.code(), Some(0), "{}", stderr(&full));
    let doc = one_json_document(&full);
    assert_eq!(doc["scalers"], 3);
    assert_eq!(doc["warnings"].as_array().unwrap().len(), 0, "{doc}");
    assert_eq!(stderr(&full), "");

    for (labels, scaler) in [
        ("linux,x64", "containers"),
        ("linux,docker", "containers"),
        ("linux,isolated", "microvms"),
        ("linux,gpu", "gpu-box"),
    ] {
        let out = run_with_config(
            "route",
            &ex.join("scalers.yaml"),
            Some(&ex.join("scalers.d")),
            &["--labels", labels, "--json"],
        );
        assert_eq!(out.status.code(), Some(0), "{labels}: {}", stderr(&out));
        assert_eq!(one_json_document(&out)["scaler"], scaler, "{labels}");
    }
}

/// `firecracker provision|verify|teardown` on a bridge of our own name
/// (host network namespace: serial): the bridge, IP forwarding, NAT and
/// forward accepts (and `DOCKER-USER` accepts where dockerd runs); verify
/// names a missing piece, provision restores it, teardown leaves nothing of
/// ours (read back with `nft -j list ruleset` and `ip -j link`).
#[test]
fn serial_firecracker_bridge_provision_verify_teardown() {
    let dir = tempfile::tempdir().unwrap();
    let r = rand::random::<u32>();
    let bridge = format!("kbt{r:08x}");
    let cfg = dir.path().join("fc.yaml");
    std::fs::write(
        &cfg,
        format!(
            "version: 1\nfirecracker:\n  cidr: 10.213.{third}.0/24\n  gateway: 10.213.{third}.1\n  bridgeName: {bridge}\nscalers: []\n",
            third = r % 250
        ),
    )
    .unwrap();
    let run_as = |action: &str, json: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kici-scaler"));
        cmd.args(["firecracker", action, "--config"]).arg(&cfg);
        if json {
            cmd.arg("--json");
        }
        cmd.output().unwrap()
    };
    let run = |action: &str| run_as(action, true);
    let doc = |o: &std::process::Output| -> serde_json::Value {
        serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
    };
    let tag = format!("kici-scaler:host:{bridge}");
    // Our rules in the ruleset: (chain, handle, comment).
    let ours_in_ruleset = || -> Vec<(String, u64, String)> {
        let out = std::process::Command::new("nft")
            .args(["-j", "list", "ruleset"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|o| o.get("rule"))
            .filter_map(|r| {
                let comment = r["comment"].as_str()?;
                comment.contains(&tag).then(|| {
                    (
                        r["chain"].as_str().unwrap().to_owned(),
                        r["handle"].as_u64().unwrap(),
                        comment.to_owned(),
                    )
                })
            })
            .collect()
    };
    let bridge_listed = || {
        let out = std::process::Command::new("ip")
            .args(["-j", "link", "show"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .any(|l| l["ifname"].as_str() == Some(bridge.as_str()))
    };

    let before = run("verify");
    assert_eq!(before.status.code(), Some(1));
    assert_eq!(doc(&before)["exists"], false);
    let made = run("provision");
    let guard = scopeguard_bridge(&bridge);
    // Rules too, if an assertion fails half-way.
    struct TeardownOnDrop(std::path::PathBuf);
    impl Drop for TeardownOnDrop {
        fn drop(&mut self) {
            let _ = std::process::Command::new(env!("CARGO_BIN_EXE_kici-scaler"))
                .args(["firecracker", "teardown", "--config"])
                .arg(&self.0)
                .output();
        }
    }
    let _rules_guard = TeardownOnDrop(cfg.clone());
    assert_eq!(
        made.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&made.stdout),
        String::from_utf8_lossy(&made.stderr)
    );
    let verified = run("verify");
    let v = doc(&verified);
    assert_eq!(verified.status.code(), Some(0), "{v}");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["ours"], true);
    assert_eq!(v["gatewayAssigned"], true);
    assert_eq!(v["ipForward"], true);
    assert_eq!(v["nat"], true);
    assert_eq!(v["forwardAccepts"], true);
    assert_ne!(v["dockerUser"], "missing");
    let rules = ours_in_ruleset();
    assert_eq!(rules.len(), 3, "{rules:?}");
    assert!(bridge_listed());

    // One piece removed (the NAT rule): verify fails and names it.
    let (chain, handle, _) = rules
        .iter()
        .find(|(_, _, c)| c.contains(" nat "))
        .unwrap()
        .clone();
    let deleted = std::process::Command::new("nft")
        .args(["delete", "rule", "inet", "kici_scaler", &chain, "handle"])
        .arg(handle.to_string())
        .status()
        .unwrap();
    assert!(deleted.success());
    let broken = run_as("verify", false);
    assert_eq!(broken.status.code(), Some(1));
    let text = String::from_utf8_lossy(&broken.stdout);
    assert!(text.contains("NAT missing"), "{text}");
    assert_eq!(text.lines().count(), 1, "only the NAT is missing: {text}");
    assert_eq!(doc(&run("verify"))["nat"], false);

    // Provision again restores it (and only it).
    assert_eq!(run("provision").status.code(), Some(0));
    assert_eq!(run("verify").status.code(), Some(0));
    assert_eq!(ours_in_ruleset().len(), 3);

    let gone = run("teardown");
    let g = doc(&gone);
    assert_eq!(gone.status.code(), Some(0), "{g}");
    assert_eq!(g["removed"], true);
    assert!(g["rulesRemoved"].as_u64().unwrap() >= 3, "{g}");
    assert!(ours_in_ruleset().is_empty(), "{:?}", ours_in_ruleset());
    assert!(!bridge_listed());
    let docker_user = std::process::Command::new("iptables")
        .args(["-w", "-S", "DOCKER-USER"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&docker_user.stdout).contains(&tag));
    assert_eq!(doc(&run("verify"))["exists"], false);
    drop(guard);
}

/// Removes the test bridge even if the test fails half-way.
fn scopeguard_bridge(name: &str) -> impl Drop {
    struct Guard(String);
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip")
                .args(["link", "delete", &self.0])
                .output();
        }
    }
    Guard(name.to_owned())
}

/// `simulate` replays a trace file under the configuration: one JSON
/// document with the hand-checked numbers of a two-job trace, a per-backend
/// spawn time from the command line, and a bad trace line named with its
/// file, line and field.
#[test]
fn simulate_replays_a_trace_and_names_a_bad_line() {
    let cfg = ConfigDir::new(MAIN_OK, &[]);
    let trace = cfg.root.path().join("trace.csv");
    // Two jobs of 60 s at 0 and 10 s; containers register 12 s after their
    // spawn: waits 12 and 12, no warm pool, both agents alive at once.
    fs::write(
        &trace,
        "at,labels,durationSeconds\n0,linux x64,60\n10,linux,60\n",
    )
    .unwrap();
    let trace_arg = trace.to_str().unwrap();
    let out = cfg.run(
        "simulate",
        &[
            "--trace",
            trace_arg,
            "--spawn-seconds",
            "container=12",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    let doc = one_json_document(&out);
    let overall = &doc["overall"];
    assert_eq!(overall["jobs"], 2);
    assert_eq!(overall["zeroWait"], 0);
    assert_eq!(overall["wait"]["p90"], 12.0);
    assert_eq!(overall["wait"]["max"], 12.0);
    assert_eq!(overall["idleAgentSeconds"], 0.0);
    assert_eq!(overall["peakAgents"], 2);
    assert_eq!(doc["scalers"]["linux"]["jobs"], 2);

    fs::write(
        &trace,
        "at,labels,durationSeconds\n0,linux,60\n5,linux,soon\n",
    )
    .unwrap();
    let out = cfg.run("simulate", &["--trace", trace_arg]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        format!(
            "error: simulate: {trace_arg}:3: durationSeconds: expected a number of seconds >= 0\n"
        )
    );
    let out = cfg.run(
        "simulate",
        &["--trace", trace_arg, "--spawn-seconds", "vm=3"],
    );
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("expected a backend type"),
        "{}",
        stderr(&out)
    );
}
