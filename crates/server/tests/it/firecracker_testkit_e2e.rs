//! The real daemon end to end on crates/testkit (see `common::firecracker`):
//! `POST /v1/scale` → the Firecracker backend's API calls, every one
//! accepted by the spec-enforcing `fc-sim` behind the fake jailer, ending
//! with `InstanceStart` → the simulated `/init` reads MMDS V2 (401 without a
//! token, 200 with one) → in a guest network namespace on the VM's real TAP
//! the real static `kici-agent-lite --bootstrap mmds` reads the same MMDS,
//! connects to the daemon's agent gateway on the bridge's gateway address
//! (through the TAP, the isolated bridge port and its own gateway-port rule),
//! registers and acknowledges its configuration → the daemon clears the
//! MMDS and reads it back empty; the guest then reads an empty document →
//! `DELETE /v1/agents/{id}`, a clean shutdown, and a standalone job's end
//! each leave nothing (chroot and overlay, VMM, TAP, rules, lease, rows,
//! cgroups). The standalone job itself reads the MMDS from the guest: the
//! clear is done before any job is dispatched. Also the daemon's kill -9
//! right after the MMDS clear took effect: restart, recovery, reconcile, the
//! agent reconnects and is tracked once.
//!
//! Everything here is host-global (bridges, TAPs, nftables): `serial_*`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{rows, wait_until, Daemon, FAST_RECONCILE};
use common::firecracker::{
    assert_consistent, cleared_mmds, gateway_port_hits, process_running, Guest, TestkitWorld,
    CRASHED_IN_TESTKIT_E2E,
};
use kici_testkit::fc::SimState;
use serde_json::Value;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;

fn scale(d: &Daemon, job: &str) -> String {
    let (status, body) = d.scale(job, &["linux", "vm"]);
    assert_eq!(status, 202, "{body}");
    body["agentId"].as_str().unwrap().to_owned()
}

/// Waits for the daemon's `MMDS cleared` line for `agent` (the clear comes
/// only after the agent's `config.ack`).
fn expect_mmds_cleared(d: &mut Daemon, agent: &str) {
    loop {
        let fields = d.expect_log("MMDS cleared");
        if fields["agent_id"] == agent {
            return;
        }
    }
}

/// The requests the daemon made (the readiness probes `GET /` and the
/// testkit's own introspection left out).
fn daemon_requests(st: &SimState) -> Vec<Value> {
    st.0["requests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            let (m, p) = (r["method"].as_str().unwrap(), r["path"].as_str().unwrap());
            !(m == "GET" && (p == "/" || p.starts_with("/testkit")))
        })
        .cloned()
        .collect()
}

/// Every request was accepted by the spec-enforcing simulator; the spawn's
/// end with `InstanceStart`, and after it come only the MMDS clear and its
/// read-back (each `clears` times).
fn assert_spec_valid_spawn_then_clear(st: &SimState, clears: usize) {
    let requests = daemon_requests(st);
    for r in &requests {
        let status = r["status"].as_u64().unwrap();
        assert!(
            (200..300).contains(&status),
            "refused by the simulator: {r}\nall: {requests:#?}"
        );
    }
    let start = requests
        .iter()
        .position(|r| r["path"] == "/actions")
        .unwrap_or_else(|| panic!("no InstanceStart: {requests:#?}"));
    assert_eq!(requests[start]["method"], "PUT");
    assert_eq!(requests[start]["body"]["action_type"], "InstanceStart");
    for needed in [
        "/boot-source",
        "/drives/rootfs",
        "/drives/overlay",
        "/machine-config",
        "/mmds/config",
        "/mmds",
    ] {
        assert!(
            requests[..start].iter().any(|r| r["path"] == needed),
            "{needed} not configured before InstanceStart: {requests:#?}"
        );
    }
    let after: Vec<String> = requests[start + 1..]
        .iter()
        .map(|r| {
            format!(
                "{} {}",
                r["method"].as_str().unwrap(),
                r["path"].as_str().unwrap()
            )
        })
        .collect();
    let one_clear = ["PUT /mmds", "GET /mmds"];
    assert_eq!(after, one_clear.repeat(clears), "after InstanceStart");
    assert_eq!(st.0["mmds_config"]["version"], "V2");
}

/// The simulated `/init` read MMDS V2 like the contract's: token-less 401,
/// the token 200, the document with the agent's id and token.
fn assert_init_read_mmds_v2(st: &SimState, agent: &str) {
    let guest = st.guest();
    assert_eq!(guest["tokenless_read_status"], 401, "{guest}");
    assert_eq!(guest["token_status"], 200, "{guest}");
    assert_eq!(guest["metadata_status"], 200, "{guest}");
    assert_eq!(guest["metadata"]["kici-agent-id"], agent, "{guest}");
    assert!(
        guest["metadata"]["kici-agent-token"]
            .as_str()
            .is_some_and(|t| t.starts_with("kat_")),
        "{guest}"
    );
}

/// MMDS from the guest namespace (the address answered by the VMM, on the
/// interface the MMDS config names): 401 without a token, and with one the
/// `latest/meta-data` document.
fn guest_reads_mmds(guest: &Guest) -> Value {
    const MMDS: &str = "169.254.169.254:80";
    let path = "/latest/meta-data";
    let (status, body) = guest.http(MMDS, "GET", path, &[]);
    assert_eq!(status, 401, "token-less MMDS read under V2: {body}");
    let (status, token) = guest.http(
        MMDS,
        "PUT",
        "/latest/api/token",
        &[("X-metadata-token-ttl-seconds", "60")],
    );
    assert_eq!(status, 200, "{token}");
    let (status, body) = guest.http(
        MMDS,
        "GET",
        path,
        &[("X-metadata-token", &token), ("Accept", "application/json")],
    );
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// `agent` is registered with the daemon (its gateway reached from the
/// guest namespace through the VM's TAP, bridge port and rules), its
/// `config.ack` made the daemon clear the MMDS, verified: the simulator
/// holds the cleared document, every request the daemon made was valid, and
/// the guest now reads an empty document.
fn assert_configured(d: &mut Daemon, world: &TestkitWorld, guest: &mut Guest, agent: &str) {
    if d.wait_for_log("MMDS cleared").is_none() {
        panic!("the daemon died; the agent's log:\n{}", guest.log());
    }
    // (Only one agent at a time reaches config.ack here.)
    let st = world.sim_state(agent);
    assert_eq!(st.mmds(), &cleared_mmds(), "{}", guest.log());
    assert_spec_valid_spawn_then_clear(&st, 1);
    assert_eq!(st.uid(), Some(10000));
    assert_eq!(st.vm_state(), "Running");
    assert_init_read_mmds_v2(&st, agent);
    // Ready for its job: registered, waiting for the job's dispatcher.
    d.wait_state(agent, "registered");
    assert!(guest.agent_running(), "{}", guest.log());
    assert_eq!(guest_reads_mmds(guest), serde_json::json!({}));
    let instance = world.dir.instance().parse().unwrap();
    assert!(
        gateway_port_hits(instance, agent, world.gateway_port) > 0,
        "the agent's connection did not cross its gateway-port rule"
    );
}

#[test]
fn serial_firecracker_testkit_daemon_spawn_to_config_ack_clears_mmds_and_delete_and_shutdown_leave_nothing(
) {
    let world = TestkitWorld::new();
    let mut d = world.start(&["--listen", "127.0.0.1:0"], &[]).unwrap();

    // --- spawn → boot → the guest's agent bootstraps from MMDS V2,
    // registers, acknowledges → the daemon clears the MMDS
    let agent = scale(&d, "e2e-delete");
    let mut guest = world.guest(&agent);
    assert_configured(&mut d, &world, &mut guest, &agent);
    let r = rows(&world.dir.sqlite_url(), &world.dir.instance());
    assert_eq!(
        r.agents
            .iter()
            .map(|a| a.agent_id.to_string())
            .collect::<Vec<_>>(),
        [agent.as_str()]
    );
    assert_eq!(r.leases.len(), 1);
    // The overlay is a real ext4 image (magic 0xEF53 at 1080).
    let overlay = kici_testkit::fc::jail_root(&world.chroot_base(), &agent).join("overlay.ext4");
    let image = std::fs::read(&overlay).unwrap();
    assert_eq!(&image[1080..1082], &[0x53, 0xef], "{}", overlay.display());
    drop(image);
    let pid = world.vmm_pid(&agent).unwrap();
    assert!(process_running(pid));

    // --- DELETE leaves nothing
    let (status, body) = d.http("DELETE", &format!("/v1/agents/{agent}"), None);
    assert_eq!(status, 202, "{body}");
    wait_until(&format!("{agent} is gone"), || !d.agents().contains(&agent));
    wait_until("its rows are gone", || {
        rows(&world.dir.sqlite_url(), &world.dir.instance())
            .agents
            .is_empty()
    });
    drop(guest);
    world.assert_nothing_left("after DELETE", &[pid]);

    // --- a clean shutdown leaves nothing either
    let second = scale(&d, "e2e-shutdown");
    let mut guest = world.guest(&second);
    assert_configured(&mut d, &world, &mut guest, &second);
    let pid = world.vmm_pid(&second).unwrap();
    d.terminate();
    drop(guest);
    world.assert_nothing_left("after shutdown", &[pid]);
}

/// `firecracker.autoProvisionHost` (on by default): on a host where nobody
/// ran `kici-scaler firecracker provision`, `serve` provisions the bridge
/// and its forwarding itself, as that command does, and its VMs run on it.
#[test]
fn serial_firecracker_testkit_serve_provisions_the_host_network_it_finds_missing() {
    let world = TestkitWorld::unprovisioned();
    let verify = |world: &TestkitWorld| {
        let out = world
            .dir
            .command(&["firecracker", "verify", "--json", "--config"])
            .arg(world.dir.path("scalers.yaml"))
            .output()
            .unwrap();
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("verify --json: {e}: {out:?}"));
        (out.status.success(), report)
    };
    let (ok, report) = verify(&world);
    assert!(!ok, "nothing provisioned yet: {report}");
    assert_eq!(report["exists"], false, "{report}");

    let mut d = world.start(&["--listen", "127.0.0.1:0"], &[]).unwrap();
    let (ok, report) = verify(&world);
    assert!(
        ok,
        "serve provisioned it as `firecracker provision` does: {report}"
    );
    assert_eq!(report["ours"], true, "{report}");
    // And its VMs use it: spawn → boot → the guest's agent registers over
    // the provisioned bridge.
    let agent = scale(&d, "auto-provisioned");
    let mut guest = world.guest(&agent);
    assert_configured(&mut d, &world, &mut guest, &agent);
    let pid = world.vmm_pid(&agent).unwrap();
    d.terminate();
    drop(guest);
    world.assert_nothing_left("after shutdown", &[pid]);
    // A second start finds it in place and leaves it as it is.
    let d = world.start(&["--listen", "127.0.0.1:0"], &[]).unwrap();
    assert!(verify(&world).0);
    d.terminate();
}

/// The daemon dies right after its MMDS clear took effect (before reading
/// it back): the restarted daemon adopts the VM, the guest agent reconnects
/// to the same gateway, registers and acknowledges again, the MMDS is
/// cleared (again) before it is ready, nothing leaked and the survivor is
/// tracked once; a clean shutdown then leaves nothing.
#[test]
fn serial_firecracker_testkit_daemon_crash_at_mmds_clear_recovers_and_leaks_nothing() {
    let fp = "kici_firecracker::mmds::clear";
    assert!(CRASHED_IN_TESTKIT_E2E.contains(&fp));
    let world = TestkitWorld::new();
    let mut d = world
        .start(FAST_RECONCILE, &[("KICI_SCALER_CRASH_AT", fp)])
        .unwrap_or_else(|s| panic!("{fp}: died at start: {s:?}"));
    let agent = scale(&d, "crash-at-clear");
    let guest = world.guest(&agent);
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to die there"
    );
    // Exactly the step's side effect: the MMDS is cleared, not yet read back.
    let st = world.sim_state(&agent);
    assert_eq!(st.mmds(), &cleared_mmds());
    let requests = daemon_requests(&st);
    assert_eq!(requests.last().unwrap()["method"], "PUT");
    assert_eq!(requests.last().unwrap()["path"], "/mmds");
    let pid = world.vmm_pid(&agent).unwrap();
    assert!(process_running(pid), "the VM outlives the daemon");

    // The agent reconnects to the restarted daemon (same gateway port).
    let mut d = world.start(FAST_RECONCILE, &[]).unwrap();
    expect_mmds_cleared(&mut d, &agent);
    assert_consistent(&mut d, &world, fp);
    assert_eq!(
        d.agents().into_iter().collect::<Vec<_>>(),
        [agent.as_str()],
        "{fp}: the survivor is tracked (once)"
    );
    d.wait_state(&agent, "registered");
    let st = world.sim_state(&agent);
    assert_eq!(st.mmds(), &cleared_mmds());
    // The first clear's PUT, then the new daemon's PUT and read-back.
    let requests = daemon_requests(&st);
    let start = requests
        .iter()
        .position(|r| r["path"] == "/actions")
        .unwrap();
    let after: Vec<String> = requests[start + 1..]
        .iter()
        .map(|r| {
            format!(
                "{} {}",
                r["method"].as_str().unwrap(),
                r["path"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(after, ["PUT /mmds", "PUT /mmds", "GET /mmds"], "{fp}");
    assert!(requests
        .iter()
        .all(|r| (200..300).contains(&r["status"].as_u64().unwrap())));
    assert_eq!(world.vmm_pid(&agent), Some(pid), "{fp}: the same VM");
    assert_eq!(guest_reads_mmds(&guest), serde_json::json!({}));

    d.terminate();
    drop(guest);
    world.assert_nothing_left(fp, &[pid]);
}

/// What a standalone job sees of the MMDS from inside its guest: the job
/// (bash, over `/dev/tcp`) takes a V2 token and reads `latest/meta-data`
/// into `$1`. The daemon clears and verifies the MMDS before it dispatches
/// any job, so the job finds an empty document, not the agent's token.
/// Then it waits for a line on the FIFO `$2` (the VM goes with the job).
const JOB_READS_MMDS: &str = r#"
set -eu
mmds() {
    exec 3<>/dev/tcp/169.254.169.254/80
    printf '%b' "$1" >&3
    sed -e '1,/^\r$/d' <&3
    exec 3<&-
}
token=$(mmds 'PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\nX-metadata-token-ttl-seconds: 60\r\nConnection: close\r\n\r\n')
mmds "GET /latest/meta-data HTTP/1.1\r\nHost: 169.254.169.254\r\nX-metadata-token: $token\r\nAccept: application/json\r\nConnection: close\r\n\r\n" > "$1.tmp"
mv "$1.tmp" "$1"
read -r _ < "$2"
"#;

/// Releases a job blocked on its FIFO when a test ends early (its agent is
/// killed, its command would wait forever).
struct Release(std::path::PathBuf);

impl Drop for Release {
    fn drop(&mut self) {
        use std::os::unix::fs::OpenOptionsExt;
        // Non-blocking: no reader left is fine (ENXIO).
        if let Ok(mut fifo) = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(&self.0)
        {
            let _ = fifo.write_all(b"go\n");
        }
    }
}

#[test]
fn serial_firecracker_testkit_daemon_standalone_job_finds_the_mmds_cleared_and_its_end_leaves_nothing(
) {
    let world = TestkitWorld::new();
    let mut d = world.start(&["--listen", "127.0.0.1:0"], &[]).unwrap();
    let seen = world.dir.path("job-saw-mmds.json");
    let gate = world.dir.path("job-gate");
    let mkfifo = std::process::Command::new("mkfifo")
        .arg(&gate)
        .status()
        .unwrap();
    assert!(mkfifo.success());
    let _release = Release(gate.clone());
    let body = serde_json::json!({
        "labels": ["linux", "vm"],
        "command": [
            "bash", "-c", JOB_READS_MMDS, "job", seen.to_str().unwrap(), gate.to_str().unwrap(),
        ],
    })
    .to_string();
    let (status, accepted) = d.http("POST", "/v1/jobs", Some(&body));
    assert_eq!(status, 202, "{accepted}");
    let job = serde_json::from_str::<Value>(&accepted).unwrap()["jobId"]
        .as_str()
        .unwrap()
        .to_owned();
    let job_state = |d: &Daemon| {
        let (status, body) = d.http("GET", &format!("/v1/jobs/{job}"), None);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<Value>(&body).unwrap()
    };
    let mut agent = String::new();
    wait_until(&format!("{job} has an agent"), || {
        agent = job_state(&d)["agentId"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        !agent.is_empty()
    });
    let mut guest = world.guest(&agent);
    // The clear comes before the dispatch (the log is read in order).
    if d.wait_for_log("MMDS cleared").is_none() {
        panic!("the daemon died; the agent's log:\n{}", guest.log());
    }
    wait_until(&format!("{job} read the MMDS"), || seen.exists());
    let saw: Value = serde_json::from_str(&std::fs::read_to_string(&seen).unwrap()).unwrap();
    assert_eq!(saw, serde_json::json!({}), "the job saw bootstrap data");
    assert_eq!(job_state(&d)["state"], "running");
    let st = world.sim_state(&agent);
    assert_eq!(st.mmds(), &cleared_mmds());
    assert_spec_valid_spawn_then_clear(&st, 1);
    assert_init_read_mmds_v2(&st, &agent);
    assert!(guest.agent_running(), "{}", guest.log());
    let pid = world.vmm_pid(&agent).unwrap();

    std::fs::OpenOptions::new()
        .write(true)
        .open(&gate)
        .unwrap()
        .write_all(b"go\n")
        .unwrap();
    wait_until(&format!("{job} ends"), || {
        matches!(
            job_state(&d)["state"].as_str(),
            Some("succeeded" | "failed" | "cancelled")
        )
    });
    let end = job_state(&d);
    assert_eq!(end["state"], "succeeded", "{end}\n{}", guest.log());

    // A standalone job's agent leaves with its job: nothing is left.
    wait_until(&format!("{agent} is gone"), || !d.agents().contains(&agent));
    wait_until("its rows are gone", || {
        rows(&world.dir.sqlite_url(), &world.dir.instance())
            .agents
            .is_empty()
    });
    drop(guest);
    world.assert_nothing_left("after the job", &[pid]);
    d.terminate();
}
