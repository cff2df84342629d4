//! `kill -9` of the real daemon at every failpoint of the container
//! backend (and its egress rules) on the real dockerd, then restart,
//! recovery and reconcile passes: no container, nftables rule, IP lease or
//! row is left that no live agent owns, and every live agent has exactly
//! one of each. The image is the FROM scratch test image
//! (`scripts/build-test-image.sh`); dockerd comes from `scripts/dockerd.sh`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{
    agents_with_rules, remove_instance_rules, rows, tool, wait_until, Daemon, Dir, FAST_RECONCILE,
};
use kici_model::InstanceId;
use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const OWNER_LABEL: &str = "dev.kici.scaler.instance";
const AGENT_LABEL: &str = "dev.kici.scaler.agent";
/// The daemon's agent network (its default).
const SUBNET: &str = "172.29.0.0/16";
const BRIDGE: &str = "kici-scaler0";

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// The test image, and on drop the removal of everything the test's
/// instances left: containers, egress rules, the image.
struct World {
    image: String,
    instances: Vec<InstanceId>,
}

impl World {
    fn new() -> Self {
        let image = format!("kici-scaler-test-agent:{:08x}", rand::random::<u32>());
        let out = Command::new(repo_file("scripts/build-test-image.sh"))
            .arg(&image)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "build-test-image.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        World {
            image,
            instances: Vec::new(),
        }
    }

    fn dir(&self) -> Dir {
        Dir::with_config(&format!(
            "version: 1\nscalers:\n  - name: box\n    type: container\n    maxAgents: 4\n    runtime: docker\n    labelSets:\n      - labels: [linux, box]\n        image: \"{}\"\n        imagePullPolicy: IfNotPresent\n",
            self.image
        ))
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for instance in &self.instances {
            for (name, _) in containers_of(*instance) {
                let _ = tool("docker", &["rm", "-f", "-v", &name]);
            }
            let instance = *instance;
            remove_instance_rules(
                instance,
                SUBNET,
                BRIDGE,
                kici_netpolicy::DockerUserMode::AcceptSubnet,
            );
        }
        let _ = tool("docker", &["rmi", "-f", &self.image]);
    }
}

/// `docker ps -a` of the instance: (name, agent label).
fn containers_of(instance: InstanceId) -> Vec<(String, String)> {
    tool(
        "docker",
        &[
            "ps",
            "-a",
            "--filter",
            &format!("label={OWNER_LABEL}={instance}"),
            "--format",
            &format!("{{{{.Names}}}} {{{{.Label \"{AGENT_LABEL}\"}}}}"),
        ],
    )
    .lines()
    .filter_map(|l| l.split_once(' '))
    .map(|(n, a)| (n.to_owned(), a.to_owned()))
    .collect()
}

/// After restart and reconcile: containers, rules, leases and rows are
/// exactly the live agents'.
fn assert_consistent(d: &mut Daemon, dir: &Dir, context: &str) {
    let instance: InstanceId = dir.instance().parse().unwrap();
    d.settle(context);
    let live = d.agents();
    let containers: BTreeSet<String> = containers_of(instance)
        .into_iter()
        .map(|(_, agent)| agent)
        .collect();
    assert_eq!(containers, live, "{context}: containers vs live agents");
    assert_eq!(
        containers_of(instance).len(),
        live.len(),
        "{context}: one container per agent"
    );
    let r = rows(&dir.sqlite_url(), &dir.instance());
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

const SPAWN_STEPS: &[&str] = &[
    "kici_container::spawn::lease",
    "kici_container::spawn::pull",
    "kici_container::spawn::create",
    "kici_container::spawn::rules",
    "kici_netpolicy::install::applied",
    "kici_container::spawn::start",
];
const DESTROY_STEPS: &[&str] = &[
    "kici_container::destroy::stop",
    "kici_container::destroy::remove",
    "kici_container::destroy::rules",
    "kici_netpolicy::remove::deleted",
    "kici_container::destroy::lease",
];

fn scale(d: &Daemon, job: &str) -> Option<String> {
    let (status, body) = d.scale(job, &["linux", "box"]);
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
fn crash_then_recover(world: &mut World, fp: &str, trigger: impl FnOnce(&Daemon) -> Vec<String>) {
    let dir = world.dir();
    let mut d = start(&dir, Some(fp)).unwrap_or_else(|s| panic!("{fp}: died at start: {s:?}"));
    world.instances.push(dir.instance().parse().unwrap());
    let survivors = trigger(&d);
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to die there"
    );
    let mut d = start(&dir, None).unwrap();
    assert_consistent(&mut d, &dir, fp);
    let live = d.agents();
    for s in &survivors {
        assert!(live.contains(s), "{fp}: {s} was not re-adopted");
    }
    d.terminate();
    let instance: InstanceId = dir.instance().parse().unwrap();
    assert!(containers_of(instance).is_empty(), "{fp}: containers left");
    assert!(agents_with_rules(instance).is_empty(), "{fp}: rules left");
    assert!(
        rows(&dir.sqlite_url(), &dir.instance()).leases.is_empty(),
        "{fp}: leases left"
    );
}

#[test]
fn serial_crash_at_each_container_step_leaks_nothing() {
    let mut world = World::new();
    for fp in SPAWN_STEPS {
        crash_then_recover(&mut world, fp, |d| {
            scale(d, "crashing");
            vec![]
        });
    }
    for fp in DESTROY_STEPS {
        crash_then_recover(&mut world, fp, |d| {
            let keep = scale(d, "keep").unwrap();
            let victim = scale(d, "victim").unwrap();
            for agent in [&keep, &victim] {
                wait_until(&format!("{agent} is up"), || {
                    matches!(d.state_of(agent).as_str(), "booted" | "registered" | "idle")
                });
            }
            let (status, body) = d.http("DELETE", &format!("/v1/agents/{victim}"), None);
            assert!(status == 202 || status == 0, "{status} {body}");
            vec![keep]
        });
    }
}

#[test]
fn every_container_step_has_a_crash_test() {
    let listed = listed_failpoints();
    let covered: BTreeSet<&str> = SPAWN_STEPS.iter().chain(DESTROY_STEPS).copied().collect();
    for fp in covered.iter() {
        assert!(listed.lines().any(|l| l == *fp), "no failpoint {fp}");
    }
    for fp in listed.lines().filter(|l| l.starts_with("kici_container::")) {
        assert!(covered.contains(fp), "{fp} has no crash test");
    }
}

/// `kici-scaler failpoints`: one name a line.
fn listed_failpoints() -> String {
    let out = Command::new(common::daemon::BIN)
        .arg("failpoints")
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// Crashed at by the start-up test below.
const ENSURE_DOCKER_USER: &str = "kici_netpolicy::ensure::docker_user";
/// Crashed at by the sweep test below.
const SWEEP_DELETED: &str = "kici_netpolicy::sweep::deleted";

/// kici-netpolicy's failpoints a daemon crash test of this file hits: the
/// spawn and destroy steps above, and the start-up and sweep tests below.
fn netpolicy_crashed_here() -> BTreeSet<&'static str> {
    SPAWN_STEPS
        .iter()
        .chain(DESTROY_STEPS)
        .copied()
        .filter(|fp| fp.starts_with("kici_netpolicy::"))
        .chain([ENSURE_DOCKER_USER, SWEEP_DELETED])
        .collect()
}

/// kici-netpolicy's failpoints crash-tested in `firecracker_crash.rs`
/// (checked against that file's text below).
const NETPOLICY_CRASHED_IN_FIRECRACKER_CRASH: &[&str] = &["kici_netpolicy::ensure::table"];

/// kici-netpolicy's failpoints no daemon crash test hits, each with why
/// (none today: the daemon reaches every one, and each is crash-tested).
const NETPOLICY_NOT_CRASHED: &[(&str, &str)] = &[];

/// Every `netpolicy::` failpoint the binary lists has a daemon crash test
/// here or in `firecracker_crash.rs`, or a named reason why not; and every
/// name these lists claim is a real failpoint.
#[test]
fn every_netpolicy_step_has_a_daemon_crash_test_or_says_why_not() {
    let listed = listed_failpoints();
    let firecracker_crash = include_str!("firecracker_crash.rs");
    for fp in NETPOLICY_CRASHED_IN_FIRECRACKER_CRASH {
        assert!(
            firecracker_crash.contains(&format!("\"{fp}\"")),
            "firecracker_crash.rs does not crash at {fp}"
        );
    }
    let covered: BTreeSet<&str> = netpolicy_crashed_here()
        .into_iter()
        .chain(NETPOLICY_CRASHED_IN_FIRECRACKER_CRASH.iter().copied())
        .chain(NETPOLICY_NOT_CRASHED.iter().map(|(fp, _)| *fp))
        .collect();
    for fp in &covered {
        assert!(listed.lines().any(|l| l == *fp), "no failpoint {fp}");
    }
    let netpolicy: Vec<&str> = listed
        .lines()
        .filter(|l| l.starts_with("kici_netpolicy::"))
        .collect();
    assert_eq!(
        netpolicy.iter().copied().collect::<BTreeSet<_>>(),
        kici_netpolicy::FAILPOINTS.iter().copied().collect(),
        "the binary lists kici-netpolicy's failpoints"
    );
    for fp in netpolicy {
        assert!(covered.contains(fp), "{fp} has no daemon crash test");
    }
}

/// `DOCKER-USER` rules of `instance` (`iptables -S`).
fn docker_user_rules(instance: InstanceId) -> Vec<String> {
    let tag = format!("kici-scaler:{instance}:");
    tool("iptables", &["-w", "-S", "DOCKER-USER"])
        .lines()
        .filter(|l| l.contains(&tag))
        .map(str::to_owned)
        .collect()
}

/// The instance's subnet-level nftables rules (default drops), one
/// `family table chain comment` each, from `nft -j list ruleset`.
fn subnet_rules(instance: InstanceId) -> Vec<String> {
    let doc: serde_json::Value =
        serde_json::from_str(&tool("nft", &["-j", "list", "ruleset"])).unwrap();
    let tag = format!("kici-scaler:{instance}:subnet ");
    let mut rules: Vec<String> = doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["comment"].as_str().is_some_and(|c| c.starts_with(&tag)))
        .map(|r| {
            format!(
                "{} {} {} {}",
                r["family"].as_str().unwrap(),
                r["table"].as_str().unwrap(),
                r["chain"].as_str().unwrap(),
                r["comment"].as_str().unwrap()
            )
        })
        .collect();
    rules.sort();
    rules
}

/// Waits for the daemon to die of its armed crash (at start-up, or just
/// after it answered), and checks that it did.
fn died_of(fp: &str, started: Result<Daemon, std::process::ExitStatus>) {
    let status = match started {
        Err(status) => status,
        Ok(mut d) => d.wait_exit(),
    };
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the daemon was to die there"
    );
}

fn is_up(d: &Daemon, agent: &str) -> bool {
    matches!(d.state_of(agent).as_str(), "booted" | "registered" | "idle")
}

/// The daemon dies right after adding its subnet's accepts to dockerd's
/// `DOCKER-USER` at start-up (the container backend's egress table): the
/// next start finds them and the subnet's drops in place and adds neither
/// again, and the backend then works and leaves nothing.
#[test]
fn serial_crash_after_adding_docker_user_accepts_at_start_up_leaks_nothing() {
    let fp = ENSURE_DOCKER_USER;
    let mut world = World::new();
    let dir = world.dir();
    let crashed = start(&dir, Some(fp));
    // The identity exists before any backend starts.
    let instance: InstanceId = dir.instance().parse().unwrap();
    world.instances.push(instance);
    died_of(fp, crashed);
    // Exactly the step's side effects: the accepts (traffic from the
    // subnet, replies to it) and the subnet's default drops; nothing else.
    let accepts = docker_user_rules(instance);
    assert_eq!(accepts.len(), 2, "{fp}: {accepts:?}");
    assert!(accepts.iter().any(|r| r.contains(&format!("-s {SUBNET}"))));
    assert!(accepts.iter().any(|r| r.contains(&format!("-d {SUBNET}"))));
    let drops = subnet_rules(instance);
    assert!(!drops.is_empty(), "{fp}: no default drop");
    assert!(containers_of(instance).is_empty());
    assert!(agents_with_rules(instance).is_empty());

    let mut d = start(&dir, None).unwrap();
    assert_eq!(docker_user_rules(instance), accepts, "{fp}: added once");
    assert_eq!(subnet_rules(instance), drops, "{fp}: added once");
    assert_consistent(&mut d, &dir, fp);
    let agent = scale(&d, "after").unwrap();
    wait_until(&format!("{agent} is up"), || is_up(&d, &agent));
    assert_consistent(&mut d, &dir, fp);
    assert_eq!(agents_with_rules(instance), BTreeSet::from([agent.clone()]));
    d.terminate();
    assert!(containers_of(instance).is_empty(), "{fp}: containers left");
    assert!(agents_with_rules(instance).is_empty(), "{fp}: rules left");
    let r = rows(&dir.sqlite_url(), &dir.instance());
    assert!(r.leases.is_empty() && r.agents.is_empty(), "{fp}: {r:?}");
    // The instance keeps its subnet rules across restarts (World removes them).
    assert_eq!(docker_user_rules(instance), accepts, "{fp}");
}

/// The daemon dies right after its stale-rule sweep deleted a dead
/// container's rules, once in the start-up sweep and once in a reconcile
/// pass beside a live agent: the rules are gone, the live agent's stay,
/// and the next daemon has nothing left to sweep (the work was done once).
#[test]
fn serial_crash_after_sweeping_a_dead_containers_rules_leaks_nothing() {
    const REAPED: &str = "kici_orch_scaler_orphans_reaped_total";
    let fp = SWEEP_DELETED;
    let mut world = World::new();
    let dir = world.dir();
    let d = start(&dir, None).unwrap();
    let instance: InstanceId = dir.instance().parse().unwrap();
    world.instances.push(instance);
    d.terminate();
    let swept_rules =
        |d: &Daemon| common::daemon::metric(&d.metrics(), REAPED, "kind=\"nftables-rule\"");

    // At start-up, before the API listens.
    let dead = plant_rule(instance, "172.29.250.78".parse().unwrap()).to_string();
    assert!(agents_with_rules(instance).contains(&dead));
    died_of(fp, start(&dir, Some(fp)));
    assert!(
        agents_with_rules(instance).is_empty(),
        "{fp}: swept before the crash"
    );
    let mut d = start(&dir, None).unwrap();
    assert_consistent(&mut d, &dir, fp);
    assert_eq!(swept_rules(&d), 0.0, "{fp}: nothing swept twice");
    assert_eq!(docker_user_rules(instance).len(), 2, "{fp}: accepts once");
    d.terminate();

    // In a reconcile pass, with a live agent beside the dead one.
    let mut d = start(&dir, Some(fp)).unwrap();
    let keep = scale(&d, "keep").unwrap();
    wait_until(&format!("{keep} is up"), || is_up(&d, &keep));
    let dead = plant_rule(instance, "172.29.250.79".parse().unwrap()).to_string();
    let status = d.wait_exit();
    assert_eq!(
        status.signal(),
        Some(9),
        "{fp}: the reconciler was to die there"
    );
    assert_eq!(
        agents_with_rules(instance),
        BTreeSet::from([keep.clone()]),
        "{fp}: {dead}'s rules swept, the live agent's kept"
    );
    let mut d = start(&dir, None).unwrap();
    assert_consistent(&mut d, &dir, fp);
    assert!(
        d.agents().contains(&keep),
        "{fp}: {keep} was not re-adopted"
    );
    assert_eq!(agents_with_rules(instance), BTreeSet::from([keep.clone()]));
    assert_eq!(swept_rules(&d), 0.0, "{fp}: nothing swept twice");
    assert_eq!(docker_user_rules(instance).len(), 2, "{fp}: accepts once");
    d.terminate();
    assert!(containers_of(instance).is_empty(), "{fp}: containers left");
    assert!(agents_with_rules(instance).is_empty(), "{fp}: rules left");
    let r = rows(&dir.sqlite_url(), &dir.instance());
    assert!(r.leases.is_empty() && r.agents.is_empty(), "{fp}: {r:?}");
}

/// Installs default-policy egress rules for an agent that has no
/// container (what a crash between a container's removal and its rules'
/// leaves).
fn plant_rule(instance: InstanceId, ip: std::net::Ipv4Addr) -> kici_model::AgentId {
    let agent = kici_model::AgentId::random(kici_model::ScalerType::Container);
    let [a, b, c, d] = ip.octets();
    block_on(async {
        kici_netpolicy::EgressTable::ensure(
            instance,
            SUBNET.parse().unwrap(),
            kici_netpolicy::TableOptions {
                agent_bridge: Some(BRIDGE.to_owned()),
                docker_user: kici_netpolicy::DockerUserMode::AcceptSubnet,
                ..kici_netpolicy::TableOptions::default()
            },
        )
        .await
        .unwrap()
        .install(
            &agent,
            &kici_netpolicy::AgentMatch {
                ip,
                mac: [0x02, 0x42, a, b, c, d],
                port: None,
            },
            &kici_netpolicy::EgressPolicy::from_config(None),
        )
        .await
        .unwrap();
    });
    agent
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// The reconciler's container kinds: a container with our owner label but
/// no row (its lease with it) and the nftables rules of a container that
/// is gone are each reaped once, counted by kind.
#[test]
fn serial_reconcile_reaps_an_orphan_container_and_a_dead_containers_rules_once() {
    const REAPED: &str = "kici_orch_scaler_orphans_reaped_total";
    let mut world = World::new();
    let dir = world.dir();
    let mut d = start(&dir, None).unwrap();
    let instance: InstanceId = dir.instance().parse().unwrap();
    world.instances.push(instance);
    let orphan = scale(&d, "orphan").unwrap();
    wait_until("the orphan's container runs", || {
        matches!(
            d.state_of(&orphan).as_str(),
            "booted" | "registered" | "idle"
        )
    });
    d.kill9();
    block_on(async {
        let url: kici_store::StoreUrl = dir.sqlite_url().parse().unwrap();
        let s = kici_store::open(&url, instance, kici_store::StoreOptions::default())
            .await
            .unwrap();
        assert!(s.delete_agent(&orphan.parse().unwrap()).await.unwrap());
        s.close().await;
    });
    let mut d = start(&dir, None).unwrap();
    // Planted once the daemon runs (start-up sweeps stale rules on its own,
    // uncounted): the reconciler's pass is what removes it.
    let dead = plant_rule(instance, "172.29.250.77".parse().unwrap());
    assert!(agents_with_rules(instance).contains(&dead.to_string()));
    wait_until(
        "the orphan container and the dead one's rules are gone",
        || containers_of(instance).is_empty() && agents_with_rules(instance).is_empty(),
    );
    let counts = |d: &Daemon| {
        let m = d.metrics();
        [
            "container",
            "nftables-rule",
            "ip-lease",
            "process",
            "cgroup",
        ]
        .map(|k| common::daemon::metric(&m, REAPED, &format!("kind=\"{k}\"")))
    };
    let first = counts(&d);
    d.expect_log("reconcile pass");
    d.expect_log("reconcile pass");
    assert_eq!(counts(&d), first, "nothing is reaped twice");
    assert_eq!(first, [1.0, 1.0, 1.0, 0.0, 0.0], "container, rules, lease");
    let r = rows(&dir.sqlite_url(), &dir.instance());
    assert!(r.agents.is_empty() && r.leases.is_empty(), "{r:?}");
    assert!(d.agents().is_empty());
    d.terminate();
}
