//! The simulator's API, launched directly (no jailer): every spec violation is a
//! 400 with a fault message, boot gating, MMDS semantics and limits, guest
//! failure modes, Firecracker's command line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kici_testkit::fc::{GuestMode, GuestSetup, SimClient, Simulator};
use serde_json::{json, Value};
use support::{paths, touch, Tap};

const POST_BOOT: &str = "The requested operation is not supported after starting the microVM.";
const PRE_BOOT: &str = "The requested operation is not supported before starting the microVM.";

fn files(dir: &Path) {
    for f in [
        "kernel",
        "rootfs.ext4",
        "overlay.ext4",
        "vmm.log",
        "metrics.fifo",
    ] {
        touch(&dir.join(f));
    }
}

fn start(dir: &Path, args: &[&str], mode: GuestMode) -> Simulator {
    files(dir);
    Simulator::start(
        &paths(),
        dir,
        args,
        &GuestSetup {
            mode,
            agent: None,
            ..Default::default()
        },
    )
    .unwrap()
}

fn assert_fault(c: &SimClient, method: &str, path: &str, body: Option<&str>, expect: &str) {
    let r = c.request_raw(method, path, body).unwrap();
    assert_eq!(r.status, 400, "{method} {path} {body:?}: {}", r.body);
    let msg = r.fault_message().unwrap_or_default();
    assert!(
        msg.contains(expect),
        "{method} {path} {body:?}: fault {msg:?} lacks {expect:?}"
    );
}

fn boot_minimal(c: &SimClient, dir: &Path) {
    let kernel = dir.join("kernel");
    let r = c
        .put(
            "/boot-source",
            &json!({"kernel_image_path": kernel, "boot_args": "console=ttyS0 reboot=k panic=1"}),
        )
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let r = c
        .put("/actions", &json!({"action_type": "InstanceStart"}))
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
}

#[test]
fn firecracker_sim_every_spec_violation_is_a_400_with_a_fault_message() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(dir.path(), &[], GuestMode::Normal);
    let c = &sim.client;
    let d = dir.path().display().to_string();
    let cases: Vec<(&str, &str, Option<String>, &str)> = vec![
        (
            "GET",
            "/nope",
            None,
            "Invalid request method and/or path: GET nope.",
        ),
        (
            "PUT",
            "/nope",
            Some("{}".into()),
            "Invalid request method and/or path: PUT nope.",
        ),
        (
            "PATCH",
            "/boot-source",
            Some("{}".into()),
            "Invalid request method and/or path: PATCH boot-source.",
        ),
        (
            "GET",
            "/machine-config",
            Some("{}".into()),
            "GET request cannot have a body.",
        ),
        ("PUT", "/boot-source", None, "Empty PUT request."),
        (
            "PUT",
            "/boot-source",
            Some("{not json".into()),
            "An error occurred when deserializing the json body of a request",
        ),
        (
            "PUT",
            "/boot-source",
            Some(r#"{"boot_args":"x"}"#.into()),
            "missing field `kernel_image_path`",
        ),
        (
            "PUT",
            "/boot-source",
            Some(format!(r#"{{"kernel_image_path":"{d}/kernel","bogus":1}}"#)),
            "unknown field `bogus`",
        ),
        (
            "PUT",
            "/boot-source",
            Some(r#"{"kernel_image_path":5}"#.into()),
            "invalid type: integer `5`, expected a string",
        ),
        (
            "PUT",
            "/boot-source",
            Some(format!(r#"{{"kernel_image_path":"{d}/missing"}}"#)),
            "Boot source error: The kernel file cannot be opened",
        ),
        (
            "PUT",
            "/drives/rootfs",
            Some(format!(
                r#"{{"drive_id":"other","path_on_host":"{d}/rootfs.ext4","is_root_device":true,"is_read_only":true}}"#
            )),
            "The id from the path does not match the id from the body!",
        ),
        (
            "PUT",
            "/drives/root-fs",
            Some(format!(
                r#"{{"drive_id":"root-fs","path_on_host":"{d}/rootfs.ext4","is_root_device":true,"is_read_only":true}}"#
            )),
            "API Resource IDs can only contain alphanumeric characters and underscores.",
        ),
        (
            "PUT",
            "/drives/",
            Some("{}".into()),
            "The ID cannot be empty.",
        ),
        (
            "PUT",
            "/drives/rootfs",
            Some(r#"{"drive_id":"rootfs","is_read_only":true}"#.into()),
            "missing field `is_root_device`",
        ),
        (
            "PUT",
            "/drives/rootfs",
            Some(format!(
                r#"{{"drive_id":"rootfs","path_on_host":"{d}/missing","is_root_device":true,"is_read_only":true}}"#
            )),
            "Drive config error",
        ),
        (
            "PUT",
            "/drives/rootfs",
            Some(format!(
                r#"{{"drive_id":"rootfs","path_on_host":"{d}/rootfs.ext4","is_root_device":true,"is_read_only":true,"cache_type":"Fast"}}"#
            )),
            "unknown variant `Fast`, expected `Unsafe` or `Writeback`",
        ),
        (
            "PUT",
            "/machine-config",
            Some(r#"{"vcpu_count":0,"mem_size_mib":128}"#.into()),
            "expected an integer between 1 and 32",
        ),
        (
            "PUT",
            "/machine-config",
            Some(r#"{"vcpu_count":33,"mem_size_mib":128}"#.into()),
            "expected an integer between 1 and 32",
        ),
        (
            "PUT",
            "/machine-config",
            Some(r#"{"vcpu_count":2,"mem_size_mib":0}"#.into()),
            "The memory size (MiB) is invalid.",
        ),
        (
            "PUT",
            "/machine-config",
            Some(r#"{"vcpu_count":3,"mem_size_mib":128,"smt":true}"#.into()),
            "The vCPU number is invalid!",
        ),
        (
            "PUT",
            "/machine-config",
            Some(r#"{"vcpu_count":2}"#.into()),
            "missing field `mem_size_mib`",
        ),
        (
            "PATCH",
            "/machine-config",
            Some("{}".into()),
            "Empty PATCH request.",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            Some(r#"{"iface_id":"eth1","host_dev_name":"x"}"#.into()),
            "The id from the path does not match the id from the body!",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            Some(r#"{"iface_id":"eth0"}"#.into()),
            "missing field `host_dev_name`",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            Some(r#"{"iface_id":"eth0","host_dev_name":"kt-no-such-tap"}"#.into()),
            "Invalid TUN/TAP Backend provided by kt-no-such-tap",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            Some(r#"{"iface_id":"eth0","host_dev_name":"lo"}"#.into()),
            "Invalid TUN/TAP Backend provided by lo",
        ),
        (
            "PUT",
            "/network-interfaces/eth0",
            Some(r#"{"iface_id":"eth0","host_dev_name":"x","mtu":10}"#.into()),
            "expected an integer between 68 and 65535",
        ),
        (
            "PUT",
            "/mmds/config",
            Some(r#"{"network_interfaces":["eth0"]}"#.into()),
            "does not correspond to any existing network interface",
        ),
        (
            "PUT",
            "/mmds/config",
            Some(r#"{"network_interfaces":[]}"#.into()),
            "is empty",
        ),
        (
            "PUT",
            "/mmds/config",
            Some(r#"{"version":"V2"}"#.into()),
            "missing field `network_interfaces`",
        ),
        (
            "PUT",
            "/mmds/config",
            Some(r#"{"network_interfaces":["eth0"],"version":"V3"}"#.into()),
            "unknown variant `V3`, expected `V1` or `V2`",
        ),
        (
            "PUT",
            "/mmds/other",
            Some("{}".into()),
            "Unrecognized PUT request path `other`.",
        ),
        (
            "PUT",
            "/mmds",
            Some(r#""a string""#.into()),
            "invalid type: string \"a string\"",
        ),
        (
            "PUT",
            "/logger",
            Some(format!(r#"{{"log_path":"{d}/missing.log"}}"#)),
            "Logger error: Failed to open target file",
        ),
        (
            "PUT",
            "/logger",
            Some(format!(r#"{{"log_path":"{d}/vmm.log","level":"Loud"}}"#)),
            "unknown variant `Loud`",
        ),
        (
            "PUT",
            "/metrics",
            Some("{}".into()),
            "missing field `metrics_path`",
        ),
        (
            "PUT",
            "/actions",
            Some(r#"{"action_type":"Reboot"}"#.into()),
            "unknown variant `Reboot`",
        ),
        (
            "PUT",
            "/actions",
            Some(r#"{"action_type":"SendCtrlAltDel"}"#.into()),
            PRE_BOOT,
        ),
        (
            "PUT",
            "/actions",
            Some(r#"{"action_type":"InstanceStart"}"#.into()),
            "Cannot start microvm without kernel configuration.",
        ),
        (
            "PATCH",
            "/drives/rootfs",
            Some(r#"{"drive_id":"rootfs"}"#.into()),
            PRE_BOOT,
        ),
        (
            "PATCH",
            "/network-interfaces/eth0",
            Some(r#"{"iface_id":"eth0"}"#.into()),
            PRE_BOOT,
        ),
        (
            "PATCH",
            "/mmds",
            Some(r#"{"a":"b"}"#.into()),
            "The MMDS data store is not initialized.",
        ),
    ];
    for (method, path, body, expect) in &cases {
        assert_fault(c, method, path, body.as_deref(), expect);
    }
    let st = c.state().unwrap();
    assert_eq!(st.vm_state(), "Not started");
    // The log holds the readiness probes (`GET /`) and then every refused request, in order.
    let log: Vec<_> = st
        .request_log()
        .into_iter()
        .filter(|(m, p, _)| !(m == "GET" && p == "/"))
        .collect();
    assert_eq!(log.len(), cases.len());
    for ((method, path, status), (want_method, want_path, _, _)) in log.iter().zip(&cases) {
        assert_eq!(
            (method.as_str(), path.as_str(), *status),
            (*want_method, *want_path, 400)
        );
    }
    // Valid pre-boot configuration is accepted and visible.
    let r = c
        .put("/logger", &json!({"log_path": dir.path().join("vmm.log"), "level": "warning", "show_level": true}))
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let r = c
        .put(
            "/machine-config",
            &json!({"vcpu_count": 2, "mem_size_mib": 256}),
        )
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let r = c
        .patch("/machine-config", &json!({"mem_size_mib": 512}))
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let mc = c.get("/machine-config").unwrap().json();
    assert_eq!(
        (mc["vcpu_count"].clone(), mc["mem_size_mib"].clone()),
        (json!(2), json!(512))
    );
    // The VMM log got the refusals, in Firecracker's line format.
    let vmm_log = std::fs::read_to_string(dir.path().join("vmm.log")).unwrap();
    assert_eq!(
        vmm_log, "",
        "the logger was configured after the refusals, at warning level"
    );
    assert_fault(
        c,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count":2,"mem_size_mib":0}"#),
        "invalid",
    );
    let vmm_log = std::fs::read_to_string(dir.path().join("vmm.log")).unwrap();
    assert!(
        vmm_log.contains(
            ":ERROR] Received Error. Status code: 400 Bad Request. Message: Machine config error"
        ),
        "{vmm_log}"
    );
}

#[test]
fn firecracker_sim_pre_boot_resources_are_refused_after_instance_start() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(dir.path(), &[], GuestMode::Normal);
    let c = &sim.client;
    let d = dir.path().display().to_string();
    let r = c
        .put("/drives/rootfs", &json!({"drive_id": "rootfs", "path_on_host": format!("{d}/rootfs.ext4"), "is_root_device": true, "is_read_only": true}))
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let r = c
        .put("/mmds", &json!({"latest": {"meta-data": {"k": "v"}}}))
        .unwrap();
    assert_eq!(r.status, 204);
    boot_minimal(c, dir.path());
    assert_eq!(c.instance_info().unwrap()["state"], "Running");
    for (path, body) in [
        (
            "/boot-source",
            format!(r#"{{"kernel_image_path":"{d}/kernel"}}"#),
        ),
        (
            "/drives/rootfs",
            format!(
                r#"{{"drive_id":"rootfs","path_on_host":"{d}/rootfs.ext4","is_root_device":true,"is_read_only":true}}"#
            ),
        ),
        (
            "/machine-config",
            r#"{"vcpu_count":1,"mem_size_mib":128}"#.to_string(),
        ),
        (
            "/network-interfaces/eth0",
            r#"{"iface_id":"eth0","host_dev_name":"x"}"#.to_string(),
        ),
        (
            "/mmds/config",
            r#"{"network_interfaces":["eth0"],"version":"V2"}"#.to_string(),
        ),
        ("/logger", format!(r#"{{"log_path":"{d}/vmm.log"}}"#)),
        (
            "/metrics",
            format!(r#"{{"metrics_path":"{d}/metrics.fifo"}}"#),
        ),
        ("/actions", r#"{"action_type":"InstanceStart"}"#.to_string()),
    ] {
        assert_fault(c, "PUT", path, Some(&body), POST_BOOT);
    }
    assert_fault(
        c,
        "PATCH",
        "/machine-config",
        Some(r#"{"vcpu_count":2}"#),
        POST_BOOT,
    );
    // Post-boot operations now work; MMDS stays writable.
    let r = c
        .patch(
            "/drives/rootfs",
            &json!({"drive_id": "rootfs", "path_on_host": format!("{d}/overlay.ext4")}),
        )
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let r = c
        .patch("/mmds", &json!({"latest": {"meta-data": {"k": null}}}))
        .unwrap();
    assert_eq!(r.status, 204);
    assert_eq!(
        c.get("/mmds").unwrap().json(),
        json!({"latest": {"meta-data": {}}})
    );
    let r = c.put("/mmds", &json!({})).unwrap();
    assert_eq!(r.status, 204);
    assert_eq!(c.state().unwrap().mmds(), &json!({}));
}

#[test]
fn firecracker_sim_mmds_size_limit_is_enforced_on_put_and_patch() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(dir.path(), &[], GuestMode::Normal);
    let c = &sim.client;
    // Default limit = 51200 bytes of serialized store; the request itself must
    // also fit the 51200-byte API payload limit.
    let big = "x".repeat(51_200);
    let r = c.put("/mmds", &json!({ "k": big })).unwrap();
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.fault_message()
            .unwrap()
            .contains("is larger than the limit of 51200"),
        "{}",
        r.body
    );
    let fits = "x".repeat(51_200 - 12);
    let r = c.put("/mmds", &json!({ "k": fits })).unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let r = c.patch("/mmds", &json!({ "k2": "y" })).unwrap();
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(
        r.fault_message().unwrap(),
        "MMDS limit exceeded error: The MMDS patch request doesn't fit."
    );
    assert_eq!(
        c.get("/mmds").unwrap().json()["k2"],
        Value::Null,
        "a refused PATCH changes nothing"
    );

    let dir2 = tempfile::tempdir().unwrap();
    let small = start(dir2.path(), &["--mmds-size-limit", "64"], GuestMode::Normal);
    let c2 = &small.client;
    let r = c2.put("/mmds", &json!({"latest": {"meta-data": {"kici-agent-id": "scaler-firecracker-0123abcd", "pad": "xxxxxxxxxxxx"}}})).unwrap();
    assert_eq!(r.status, 413, "{}", r.body);
    let r = c2
        .put("/mmds", &json!({"latest": {"meta-data": {}}}))
        .unwrap();
    assert_eq!(r.status, 204);
}

#[test]
fn firecracker_sim_guest_failure_modes_show_on_the_serial_console() {
    for (mode, needle) in [
        (
            GuestMode::KernelPanic,
            "Kernel panic - not syncing: VFS: Unable to mount root fs",
        ),
        (GuestMode::InitFailure, "Failed to execute /init"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let sim = start(dir.path(), &[], mode);
        boot_minimal(&sim.client, dir.path());
        let (code, serial) = sim.wait_exit().unwrap();
        let stderr = std::fs::read_to_string(dir.path().join("fc-sim.stderr")).unwrap_or_default();
        assert_eq!(
            code,
            Some(0),
            "the VMM exits after the guest reboots: {stderr}"
        );
        assert!(serial.contains(needle), "{mode:?}: {serial} / {stderr}");
    }
}

#[test]
fn firecracker_sim_ctrl_alt_del_ends_a_booted_vm_unless_the_guest_ignores_it() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(dir.path(), &[], GuestMode::Normal);
    boot_minimal(&sim.client, dir.path());
    let r = sim
        .client
        .put("/actions", &json!({"action_type": "SendCtrlAltDel"}))
        .unwrap();
    assert_eq!(r.status, 204);
    let (code, serial) = sim.wait_exit().unwrap();
    assert_eq!(code, Some(0));
    assert!(serial.contains("reboot: Restarting system"), "{serial}");

    for mode in [GuestMode::IgnoreCtrlAltDel, GuestMode::NeverBoots] {
        let dir = tempfile::tempdir().unwrap();
        let sim = start(dir.path(), &[], mode);
        boot_minimal(&sim.client, dir.path());
        let r = sim
            .client
            .put("/actions", &json!({"action_type": "SendCtrlAltDel"}))
            .unwrap();
        assert_eq!(r.status, 204);
        // Still serving: the guest did not react.
        let st = sim.client.state().unwrap();
        assert_eq!(st.vm_state(), "Running");
        assert_eq!(st.0["ctrl_alt_del_count"], 1);
        assert_ne!(st.guest_phase(), "rebooted", "{mode:?}");
    }
}

#[test]
fn firecracker_sim_command_line_is_firecrackers() {
    let p = paths();
    let out = Command::new(&p.fc_sim).arg("--bogus").output().unwrap();
    assert_eq!(out.status.code(), Some(153));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("Found argument '--bogus' which wasn't expected"));
    let out = Command::new(&p.fc_sim)
        .args(["--id", "bad_id"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(153));
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(&p.fc_sim)
        .args(["--api-sock"])
        .arg(dir.path().join("s"))
        .args(["--config-file", "/config.json"])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--config-file"));
    let out = Command::new(&p.fc_sim)
        .args(["--api-sock"])
        .arg(dir.path().join("s"))
        .args(["--log-path"])
        .arg(dir.path().join("missing.log"))
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0), "a missing --log-path is fatal");
    assert!(
        !dir.path().join("missing.log").exists(),
        "Firecracker never creates its log file"
    );
}

/// MMDS V2 through the simulated guest: token-less reads get 401, the guest's
/// token session reads `latest/meta-data`, the agent gets the contract's env,
/// its exit powers the VM off. Needs a TAP in the root namespace.
#[test]
fn serial_firecracker_sim_mmds_v2_guest_flow_runs_the_agent() {
    let p = paths();
    let tap = Tap::new("v2", 0, 0);
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let sim = Simulator::start(
        &p,
        dir.path(),
        &["--id", "scaler-firecracker-0123abcd"],
        &GuestSetup {
            mode: GuestMode::Normal,
            agent: Some(p.testkit_agent.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let c = &sim.client;
    let d = dir.path().display().to_string();
    let r = c.put("/network-interfaces/eth0", &json!({"iface_id": "eth0", "guest_mac": "06:00:AC:10:00:02", "host_dev_name": tap.name})).unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    // A second interface cannot attach the same TAP.
    let r = c
        .put(
            "/network-interfaces/eth1",
            &json!({"iface_id": "eth1", "host_dev_name": tap.name}),
        )
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.body);
    let r = c
        .put(
            "/mmds/config",
            &json!({"network_interfaces": ["eth0"], "version": "V2", "ipv4_address": "10.0.0.9"}),
        )
        .unwrap();
    assert_eq!(
        r.fault_message().unwrap(),
        "MMMDS config error: The MMDS IPv4 address is not link local."
    );
    let r = c
        .put(
            "/mmds/config",
            &json!({"network_interfaces": ["eth0"], "version": "V2"}),
        )
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    let meta = json!({"latest": {"meta-data": {
        "kici-orchestrator-url": "ws://10.0.0.1:4000/ws",
        "kici-agent-id": "scaler-firecracker-0123abcd",
        "kici-labels": "linux,kici:agent:firecracker",
        "kici-scaler-managed": "1",
        "kici-gateway-ip": "10.0.0.1",
        "kici-env": {"FOO": "bar", "TESTKIT_AGENT_EXIT": "0"}
    }}});
    let r = c.put("/mmds", &meta).unwrap();
    assert_eq!(r.status, 204);
    let r = c.put("/boot-source", &json!({"kernel_image_path": format!("{d}/kernel"), "boot_args": "console=ttyS0 reboot=k panic=1 ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off"})).unwrap();
    assert_eq!(r.status, 204);
    let r = c
        .put("/actions", &json!({"action_type": "InstanceStart"}))
        .unwrap();
    assert_eq!(r.status, 204);
    let (code, serial) = sim.wait_exit().unwrap();
    assert_eq!(code, Some(0), "{serial}");
    assert!(
        serial.contains("testkit-agent: started as scaler-firecracker-0123abcd"),
        "{serial}"
    );
    assert!(serial.contains("reboot: Power down"), "{serial}");
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("agent-report.json")).unwrap(),
    )
    .unwrap();
    let env = &report["env"];
    assert_eq!(env["KICI_ORCHESTRATOR_URL"], "ws://10.0.0.1:4000/ws");
    assert_eq!(env["KICI_AGENT_ID"], "scaler-firecracker-0123abcd");
    assert_eq!(env["KICI_LABELS"], "linux,kici:agent:firecracker");
    assert_eq!(env["KICI_SCALER_MANAGED"], "1");
    assert_eq!(env["FOO"], "bar");
    assert_eq!(env.get("KICI_AGENT_TOKEN"), None);
}

/// Under V1 (the upstream defect) the guest's /init cannot get a session token and never starts the agent.
#[test]
fn serial_firecracker_sim_guest_refuses_mmds_v1() {
    let p = paths();
    let tap = Tap::new("v1", 0, 0);
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let sim = Simulator::start(
        &p,
        dir.path(),
        &[],
        &GuestSetup {
            mode: GuestMode::Normal,
            agent: Some(p.testkit_agent.clone()),
            ..Default::default()
        },
    )
    .unwrap();
    let c = &sim.client;
    assert_eq!(
        c.put(
            "/network-interfaces/eth0",
            &json!({"iface_id": "eth0", "host_dev_name": tap.name})
        )
        .unwrap()
        .status,
        204
    );
    assert_eq!(
        c.put("/mmds/config", &json!({"network_interfaces": ["eth0"]}))
            .unwrap()
            .status,
        204
    );
    assert_eq!(
        c.put(
            "/mmds",
            &json!({"latest": {"meta-data": {"kici-agent-id": "a"}}})
        )
        .unwrap()
        .status,
        204
    );
    boot_minimal(c, dir.path());
    let st = c
        .wait_state(Duration::from_secs(10), |s| {
            s.guest_phase() == "mmds-token-refused"
        })
        .unwrap();
    assert_eq!(
        st.guest()["tokenless_read_status"],
        200,
        "V1 serves token-less reads"
    );
    assert_eq!(st.guest()["token_status"], 405);
    assert_eq!(st.0["mmds_version"], "V1");
}

/// The guest namespace: MMDS V2 at 169.254.169.254 answered by the VMM (401
/// without a token), and guest traffic reaching the host through the VM's TAP.
#[test]
fn serial_firecracker_guestnet_serves_mmds_and_carries_traffic_over_the_tap() {
    use kici_testkit::guestnet::{GuestNet, GuestNetConfig};
    use std::io::{Read, Write};
    use std::net::{Ipv4Addr, TcpListener};

    let p = paths();
    let third = (std::process::id() % 200) as u8 + 20;
    let host_ip = Ipv4Addr::new(10, 254, third, 1);
    let guest_ip = Ipv4Addr::new(10, 254, third, 2);
    let tap = Tap::new("gn", 0, 0).with_addr(&format!("{host_ip}/30"));
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let sim = Simulator::start(&p, dir.path(), &[], &GuestSetup::default()).unwrap();
    let c = &sim.client;
    let mac = "06:00:AC:FE:00:02";
    assert_eq!(
        c.put(
            "/network-interfaces/eth0",
            &json!({"iface_id": "eth0", "guest_mac": mac, "host_dev_name": tap.name})
        )
        .unwrap()
        .status,
        204
    );
    assert_eq!(
        c.put(
            "/mmds/config",
            &json!({"network_interfaces": ["eth0"], "version": "V2"})
        )
        .unwrap()
        .status,
        204
    );
    assert_eq!(
        c.put(
            "/mmds",
            &json!({"latest": {"meta-data": {"kici-agent-id": "scaler-firecracker-feedbeef"}}})
        )
        .unwrap()
        .status,
        204
    );
    boot_minimal(c, dir.path());

    let guest = GuestNet::attach(
        &dir.path().join(kici_testkit::guestlink::GUEST_LINK_SOCKET),
        &GuestNetConfig {
            netns: format!("ktgn{}", std::process::id()),
            iface_id: "eth0".into(),
            mac: mac.into(),
            ip: guest_ip,
            prefix_len: 30,
            gateway: Some(host_ip),
            mmds_address: Ipv4Addr::new(169, 254, 169, 254),
        },
    )
    .unwrap();
    let curl = |args: &[&str]| {
        let out = guest
            .command("curl")
            .args(["-s", "--max-time", "10"])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let status = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "http://169.254.169.254/latest/meta-data/kici-agent-id",
    ]);
    assert_eq!(status, "401", "V2 refuses token-less reads");
    let token = curl(&[
        "-X",
        "PUT",
        "-H",
        "X-metadata-token-ttl-seconds: 60",
        "http://169.254.169.254/latest/api/token",
    ]);
    assert_eq!(token.len(), 64, "{token}");
    let id = curl(&[
        "-H",
        &format!("X-metadata-token: {token}"),
        "http://169.254.169.254/latest/meta-data/kici-agent-id",
    ]);
    assert_eq!(id, "scaler-firecracker-feedbeef");

    // Guest → host over the TAP.
    let listener = TcpListener::bind((host_ip, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().unwrap();
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf).unwrap();
        s.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 15\r\n\r\nhello-from-host")
            .unwrap();
        peer.ip()
    });
    let body = curl(&[&format!("http://{host_ip}:{port}/")]);
    assert_eq!(body, "hello-from-host");
    assert_eq!(
        server.join().unwrap(),
        std::net::IpAddr::V4(guest_ip),
        "the guest's source address crossed the TAP"
    );
    drop(guest);
    assert!(
        !String::from_utf8_lossy(
            &Command::new("ip")
                .args(["netns", "list"])
                .output()
                .unwrap()
                .stdout
        )
        .contains(&format!("ktgn{}", std::process::id())),
        "the guest namespace is removed"
    );
}

/// VMM failure modes the backend's timeouts and cleanup must survive.
#[test]
fn firecracker_sim_vmm_failure_modes() {
    let p = paths();
    // exit-at-start: the process ends with status 1 before any socket exists.
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(&p.fc_sim)
        .arg("--api-sock")
        .arg(dir.path().join("api.sock"))
        .env("KICI_TESTKIT_VMM_MODE", "exit-at-start")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(!dir.path().join("api.sock").exists());

    // hang-api: connections are accepted, requests never answered.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let mut child = Command::new(&p.fc_sim)
        .arg("--api-sock")
        .arg(&sock)
        .env("KICI_TESTKIT_VMM_MODE", "hang-api")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let client = SimClient {
        socket: sock.clone(),
        timeout: Duration::from_millis(300),
    };
    let err = client.wait_ready(Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(err, kici_testkit::fc::TestkitError::NotReady(..)),
        "{err}"
    );
    assert!(sock.exists(), "the socket exists, the API never answers");
    child.kill().unwrap();
    child.wait().unwrap();

    // fail-instance-start: configuration works, InstanceStart is refused.
    let dir = tempfile::tempdir().unwrap();
    files(dir.path());
    let sim = Simulator::start(
        &p,
        dir.path(),
        &[],
        &GuestSetup {
            vmm: kici_testkit::fc::VmmMode::FailInstanceStart,
            ..Default::default()
        },
    )
    .unwrap();
    let kernel = dir.path().join("kernel");
    assert_eq!(
        sim.client
            .put("/boot-source", &json!({"kernel_image_path": kernel}))
            .unwrap()
            .status,
        204
    );
    let r = sim
        .client
        .put("/actions", &json!({"action_type": "InstanceStart"}))
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(r
        .fault_message()
        .unwrap()
        .starts_with("Start microvm error: Cannot create the KVM object"));
    assert_eq!(sim.client.instance_info().unwrap()["state"], "Not started");
}

/// The serial console: silent without `console=ttyS0` on the kernel command
/// line, redirected by `PUT /serial`, and bounded by its rate limiter.
#[test]
fn firecracker_sim_serial_console_follows_cmdline_and_serial_config() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start(dir.path(), &[], GuestMode::KernelPanic);
    let kernel = dir.path().join("kernel");
    let r = sim
        .client
        .put(
            "/boot-source",
            &json!({"kernel_image_path": kernel, "boot_args": "reboot=k panic=1"}),
        )
        .unwrap();
    assert_eq!(r.status, 204);
    assert_eq!(
        sim.client
            .put("/actions", &json!({"action_type": "InstanceStart"}))
            .unwrap()
            .status,
        204
    );
    let (code, serial) = sim.wait_exit().unwrap();
    assert_eq!(code, Some(0));
    assert_eq!(
        serial, "",
        "no console=ttyS0: nothing reaches the serial device"
    );

    let dir = tempfile::tempdir().unwrap();
    let sim = start(dir.path(), &[], GuestMode::KernelPanic);
    let c = &sim.client;
    let out = dir.path().join("guest-serial.log");
    let r = c.put("/serial", &json!({"serial_out_path": out})).unwrap();
    assert_eq!(
        r.status, 400,
        "the serial output file must exist: {}",
        r.body
    );
    std::fs::write(&out, b"").unwrap();
    let limiter = json!({"size": 64, "refill_time": 3_600_000});
    let r = c
        .put(
            "/serial",
            &json!({"serial_out_path": out, "rate_limiter": limiter}),
        )
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    boot_minimal(c, dir.path());
    let (code, stdout) = sim.wait_exit().unwrap();
    assert_eq!(code, Some(0));
    assert_eq!(stdout, "", "serial output went to serial_out_path");
    let written = std::fs::read(&out).unwrap();
    assert_eq!(
        written.len(),
        64,
        "the token bucket let exactly its size through"
    );
    assert!(written.starts_with(b"[    0.000000] Linux version"));
}

#[test]
fn firecracker_sim_start_reports_an_early_exit() {
    let dir = tempfile::tempdir().unwrap();
    let err =
        Simulator::start(&paths(), dir.path(), &["--bogus"], &GuestSetup::default()).unwrap_err();
    match err {
        kici_testkit::fc::TestkitError::Exited(code, stderr) => {
            assert_eq!(code, Some(153));
            assert!(stderr.contains("--bogus"), "{stderr}");
        }
        other => panic!("unexpected {other}"),
    }
}
