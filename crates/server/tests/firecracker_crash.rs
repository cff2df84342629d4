//! `kill -9` of the real daemon at every Firecracker spawn and destroy
//! failpoint, then restart, recovery and reconcile passes: no VM directory,
//! TAP, nftables rule, IP lease or row is left that no live agent owns, and
//! a clean shutdown then leaves none at all. The VMM and jailer are the
//! kici-firecracker tests' stand-ins (a Python Firecracker API and a shell
//! jailer); the bridge, TAPs, rules, chroots and store are real.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::daemon::{agents_with_rules, rows, tool, wait_until, Daemon, Dir, FAST_RECONCILE};
use kici_model::InstanceId;
use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;

const FAKE_FIRECRACKER: &str = include_str!("../../firecracker/tests/support/fake_firecracker.py");
const FAKE_JAILER: &str = include_str!("../../firecracker/tests/support/fake_jailer.sh");

/// One test directory: stand-in binaries, images, a provisioned bridge of
/// its own, and on drop every VMM it started killed and the host setup
/// torn down.
struct World {
    dir: Dir,
    subnet: String,
    bridge: String,
}

impl World {
    fn new() -> Self {
        let dir = Dir::with_config("");
        let bin = dir.path("bin");
        let pids = dir.path("pids");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&pids).unwrap();
        // The jail directory is named after the exec file: "firecracker".
        let firecracker = dir.write_script("bin/firecracker", FAKE_FIRECRACKER);
        let jailer = dir.write_script(
            "bin/jailer",
            &FAKE_JAILER.replace("@PIDS@", pids.to_str().unwrap()),
        );
        std::fs::write(dir.path("vmlinux"), b"kernel image").unwrap();
        std::fs::write(dir.path("rootfs.ext4"), b"rootfs image").unwrap();
        let r = rand::random::<u32>();
        let subnet = format!("10.{}.{}.0/24", 150 + r % 40, (r >> 8) as u8);
        let bridge = format!("kfx{r:08x}");
        let yaml = format!(
            "version: 1
firecracker:
  cidr: {subnet}
  bridgeName: {bridge}
scalers:
  - name: vm
    type: firecracker
    maxAgents: 4
    firecrackerPath: {fc}
    jailerPath: {jailer}
    kernelPath: {kernel}
    chrootBaseDir: {base}
    uid: 10000
    gid: 10000
    labelSets:
      - labels: [linux, vm]
        rootfsPath: {rootfs}
        overlayDriveSizeMib: 16
",
            fc = firecracker.display(),
            jailer = jailer.display(),
            kernel = dir.path("vmlinux").display(),
            base = dir.path("jail").display(),
            rootfs = dir.path("rootfs.ext4").display(),
        );
        std::fs::write(dir.path("scalers.yaml"), yaml).unwrap();
        let world = World {
            dir,
            subnet,
            bridge,
        };
        let out = world.firecracker("provision");
        assert!(out.status.success(), "provision: {out:?}");
        world
    }

    fn firecracker(&self, action: &str) -> std::process::Output {
        self.dir
            .command(&["firecracker", action, "--config"])
            .arg(self.dir.path("scalers.yaml"))
            .output()
            .unwrap()
    }

    /// Pids of the stand-in VMMs the jailer started that still run (a
    /// zombie counts as gone).
    fn running_vmms(&self) -> Vec<String> {
        std::fs::read_dir(self.dir.path("pids"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .map(|pid| pid.trim().to_owned())
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                    stat.rsplit(')')
                        .next()
                        .is_some_and(|r| !r.trim_start().starts_with('Z'))
                })
            })
            .collect()
    }

    /// VM directories under the chroot base.
    fn vm_dirs(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.dir.path("jail/firecracker"))
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(self.dir.path("pids")) {
            for pid in entries.flatten() {
                if let Ok(pid) = std::fs::read_to_string(pid.path()) {
                    let _ = tool("kill", &["-9", pid.trim()]);
                }
            }
        }
        // A daemon leaves its instance's subnet rules for its successor;
        // no successor comes for a test's instance.
        if let Ok(instance) = std::fs::read_to_string(self.dir.path("state/instance-id")) {
            if let Ok(instance) = instance.trim().parse::<InstanceId>() {
                let (subnet, bridge) = (self.subnet.parse().unwrap(), self.bridge.clone());
                let _ = std::thread::spawn(move || {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap()
                        .block_on(async {
                            let table = kici_netpolicy::EgressTable::ensure(
                                instance,
                                subnet,
                                kici_netpolicy::TableOptions {
                                    agent_bridge: Some(bridge),
                                    docker_user: kici_netpolicy::DockerUserMode::Leave,
                                    ..kici_netpolicy::TableOptions::default()
                                },
                            )
                            .await;
                            if let Ok(table) = table {
                                let _ = table.sweep_stale(&[]).await;
                                let _ = table.teardown().await;
                            }
                        })
                })
                .join();
            }
        }
        let _ = self.firecracker("teardown");
    }
}

/// Agents of `instance` with a TAP (its ifalias is the owner tag
/// `kici-scaler:<instance>:<agent>`).
fn agents_with_taps(instance: InstanceId) -> BTreeSet<String> {
    let links: serde_json::Value =
        serde_json::from_str(&tool("ip", &["-j", "link", "show"])).unwrap_or_default();
    let tag = format!("kici-scaler:{instance}:");
    links
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["ifalias"].as_str()?.strip_prefix(&tag).map(str::to_owned))
        .collect()
}

/// After restart and reconcile: VM directories, TAPs, leases and rows are
/// exactly the live agents'; rules belong to live agents only.
fn assert_consistent(d: &mut Daemon, world: &World, context: &str) {
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    for _ in 0..3 {
        d.expect_log("reconcile pass");
    }
    wait_until(&format!("{context}: agents settle"), || {
        let (_, body) = d.http("GET", "/v1/agents", None);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["agents"].as_array().is_some_and(|a| {
            a.iter().all(|a| {
                !matches!(
                    a["state"].as_str(),
                    Some("requested" | "provisioning" | "destroying")
                )
            })
        })
    });
    let live = d.agents();
    assert_eq!(
        world.vm_dirs(),
        live,
        "{context}: VM directories vs live agents"
    );
    assert_eq!(
        agents_with_taps(instance),
        live,
        "{context}: TAPs vs live agents"
    );
    let r = rows(&world.dir.sqlite_url(), &world.dir.instance());
    let recorded: BTreeSet<String> = r.agents.iter().map(|a| a.agent_id.to_string()).collect();
    assert_eq!(recorded, live, "{context}: rows vs live agents");
    let leased: Vec<String> = r.leases.iter().map(|l| l.agent.to_string()).collect();
    assert_eq!(
        leased.iter().cloned().collect::<BTreeSet<_>>(),
        live,
        "{context}: leases vs live agents"
    );
    assert_eq!(leased.len(), live.len(), "{context}: one lease per agent");
    let ruled = agents_with_rules(instance);
    assert!(
        ruled.is_subset(&live),
        "{context}: rules of agents that are gone: {:?}",
        ruled.difference(&live).collect::<Vec<_>>()
    );
}

/// The steps of other crates a Firecracker spawn goes through.
const SPAWN_SHARED_STEPS: &[&str] = &["store::ip::after_claim", "netpolicy::install::applied"];

const DESTROY_STEPS: &[&str] = &[
    "store::ip::after_release",
    "netpolicy::remove::deleted",
    "firecracker::destroy::stop",
    "firecracker::destroy::rules",
    "firecracker::destroy::tap",
    "firecracker::destroy::lease",
    "firecracker::destroy::chroot",
];

/// Reached only by the backend's own 15-minute sweep: proven in
/// kici-firecracker's failpoint tests (`return` at each), not by a daemon
/// crash here. (The MMDS clear after a guest agent's `config.ack` needs a
/// real guest agent: `firecracker_testkit_e2e.rs` crashes there.)
const NOT_CRASHED_HERE: &[&str] = &["firecracker::sweep::tap", "firecracker::sweep::leases"];

fn scale(d: &Daemon, job: &str) -> Option<String> {
    let (status, body) = d.scale(job, &["linux", "vm"]);
    (status == 202).then(|| body["agentId"].as_str().unwrap().to_owned())
}

fn start(dir: &Dir, crash_at: Option<&str>) -> Result<Daemon, std::process::ExitStatus> {
    let env: Vec<(&str, &str)> = crash_at
        .map(|fp| ("KICI_SCALER_CRASH_AT", fp))
        .into_iter()
        .collect();
    Daemon::try_start(dir, FAST_RECONCILE, &env)
}

/// Crash at `fp` while `trigger` runs, restart, check, shut down cleanly.
fn crash_then_recover(fp: &str, trigger: impl FnOnce(&Daemon) -> Vec<String>) {
    let world = World::new();
    let mut d =
        start(&world.dir, Some(fp)).unwrap_or_else(|s| panic!("{fp}: died at start: {s:?}"));
    let survivors = trigger(&d);
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to die there"
    );
    let mut d = start(&world.dir, None).unwrap();
    assert_consistent(&mut d, &world, fp);
    let live = d.agents();
    for s in &survivors {
        assert!(live.contains(s), "{fp}: {s} was not re-adopted");
    }
    d.terminate();
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    assert!(world.vm_dirs().is_empty(), "{fp}: VM directories left");
    assert_eq!(
        world.running_vmms(),
        Vec::<String>::new(),
        "{fp}: VMMs left"
    );
    assert!(agents_with_taps(instance).is_empty(), "{fp}: TAPs left");
    assert!(agents_with_rules(instance).is_empty(), "{fp}: rules left");
    let r = rows(&world.dir.sqlite_url(), &world.dir.instance());
    assert!(r.leases.is_empty(), "{fp}: leases left");
    assert!(r.agents.is_empty(), "{fp}: rows left");
}

#[test]
fn serial_firecracker_crash_at_each_spawn_step_leaks_nothing() {
    for fp in kici_firecracker::fp::SPAWN.iter().chain(SPAWN_SHARED_STEPS) {
        crash_then_recover(fp, |d| {
            scale(d, "crashing");
            vec![]
        });
    }
}

#[test]
fn serial_firecracker_crash_at_each_destroy_step_leaks_nothing() {
    for fp in DESTROY_STEPS {
        crash_then_recover(fp, |d| {
            let keep = scale(d, "keep").unwrap();
            let victim = scale(d, "victim").unwrap();
            for agent in [&keep, &victim] {
                wait_until(&format!("{agent} is up"), || {
                    d.state_of(agent).as_str() == "booted"
                });
            }
            let (status, body) = d.http("DELETE", &format!("/v1/agents/{victim}"), None);
            assert!(status == 202 || status == 0, "{status} {body}");
            vec![keep]
        });
    }
}

/// The daemon dies while it creates its rules table at start-up (before
/// any agent): the next start completes the table and works normally.
#[test]
fn serial_firecracker_crash_while_ensuring_the_rules_table_at_start_up_leaks_nothing() {
    let world = World::new();
    let fp = "netpolicy::ensure::table";
    // Backends start after the API is up: the daemon may answer first.
    let status = match start(&world.dir, Some(fp)) {
        Err(status) => status,
        Ok(mut d) => d.wait_exit(),
    };
    assert_eq!(status.signal(), Some(9), "{fp}");
    let mut d = start(&world.dir, None).unwrap();
    assert_consistent(&mut d, &world, fp);
    let agent = scale(&d, "after").unwrap();
    wait_until(&format!("{agent} is up"), || {
        d.state_of(&agent).as_str() == "booted"
    });
    assert_consistent(&mut d, &world, fp);
    d.terminate();
    let instance: InstanceId = world.dir.instance().parse().unwrap();
    assert!(world.vm_dirs().is_empty() && world.running_vmms().is_empty());
    assert!(agents_with_taps(instance).is_empty() && agents_with_rules(instance).is_empty());
}

#[test]
fn every_firecracker_step_has_a_daemon_crash_test_or_says_why_not() {
    let out = Command::new(common::daemon::BIN)
        .arg("failpoints")
        .output()
        .unwrap();
    assert!(out.status.success());
    let listed = String::from_utf8(out.stdout).unwrap();
    let covered: BTreeSet<&str> = kici_firecracker::fp::SPAWN
        .iter()
        .chain(SPAWN_SHARED_STEPS)
        .chain(DESTROY_STEPS)
        .chain(["netpolicy::ensure::table"].iter())
        .chain(NOT_CRASHED_HERE)
        .chain(common::firecracker::CRASHED_IN_TESTKIT_E2E)
        .copied()
        .collect();
    for fp in &covered {
        assert!(listed.lines().any(|l| l == *fp), "no failpoint {fp}");
    }
    for fp in listed
        .lines()
        .filter(|l| l.starts_with("firecracker::") || l.starts_with("store::ip::"))
    {
        assert!(covered.contains(fp), "{fp} has no crash test");
    }
}
