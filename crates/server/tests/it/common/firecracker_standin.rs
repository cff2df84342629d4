//! The Firecracker world of the daemon's crash and reconcile tests: the
//! kici-firecracker tests' stand-in VMM (a Python Firecracker API) and jailer (a shell script), real
//! images on disk, a bridge provisioned with `kici-scaler firecracker
//! provision`, and everything torn down on drop (VMMs killed, the
//! instance's subnet rules and the bridge removed).

use super::daemon::{remove_instance_rules, tool, Dir};
use super::firecracker::write_scalers;
use kici_model::InstanceId;
use std::collections::BTreeSet;

const FAKE_FIRECRACKER: &str =
    include_str!("../../../../firecracker/tests/support/fake_firecracker.py");
const FAKE_JAILER: &str = include_str!("../../../../firecracker/tests/support/fake_jailer.sh");

/// One test directory: stand-in binaries, images, a provisioned bridge of
/// its own, and on drop every VMM it started killed and the host setup
/// torn down.
pub struct World {
    pub dir: Dir,
    pub subnet: String,
    pub bridge: String,
}

impl World {
    pub fn new() -> Self {
        Self::build(false)
    }

    /// A world whose bridge has the shape of one of our TAP names
    /// (`kici-<8 hex>`): the sweep must spare it by name, the backend's
    /// protected interfaces.
    pub fn with_tap_shaped_bridge() -> Self {
        Self::build(true)
    }

    fn build(tap_shaped_bridge: bool) -> Self {
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
        let bridge = if tap_shaped_bridge {
            format!("kici-{r:08x}")
        } else {
            format!("kfx{r:08x}")
        };
        write_scalers(&dir, &subnet, &bridge, &firecracker, &jailer);
        let world = World {
            dir,
            subnet,
            bridge,
        };
        let out = world.firecracker("provision");
        assert!(out.status.success(), "provision: {out:?}");
        world
    }

    pub fn firecracker(&self, action: &str) -> std::process::Output {
        self.dir
            .command(&["firecracker", action, "--config"])
            .arg(self.dir.path("scalers.yaml"))
            .output()
            .unwrap()
    }

    /// Pids of the stand-in VMMs the jailer started that still run (a
    /// zombie counts as gone).
    pub fn running_vmms(&self) -> Vec<String> {
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
    pub fn vm_dirs(&self) -> BTreeSet<String> {
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
                remove_instance_rules(
                    instance,
                    &self.subnet,
                    &self.bridge,
                    kici_netpolicy::DockerUserMode::Leave,
                );
            }
        }
        // TAPs of this test's instance a failed test may have left (the
        // instance id is this test's own: nothing else carries its tag).
        if let Ok(instance) = std::fs::read_to_string(self.dir.path("state/instance-id")) {
            if let Ok(instance) = instance.trim().parse::<InstanceId>() {
                for (name, _) in links_tagged(instance) {
                    let _ = tool("ip", &["link", "delete", &name]);
                }
            }
        }
        let _ = self.firecracker("teardown");
    }
}

/// `(interface name, agent)` of every link whose ifalias is an owner tag
/// of `instance`.
pub fn links_tagged(instance: InstanceId) -> Vec<(String, String)> {
    let links: serde_json::Value =
        serde_json::from_str(&tool("ip", &["-j", "link", "show"])).unwrap_or_default();
    let tag = format!("kici-scaler:{instance}:");
    links
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| {
            let agent = l["ifalias"].as_str()?.strip_prefix(&tag)?;
            Some((l["ifname"].as_str()?.to_owned(), agent.to_owned()))
        })
        .collect()
}

/// Runs `f` on a current-thread runtime of its own.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// A TAP this test made exactly as the backend makes one (the backend's
/// own tun ioctl and netlink calls: `kici-<last 8 hex>`, jailer uid/gid,
/// an isolated port of `bridge`, ifalias `alias`, up); deleted on drop if
/// it is still there and still carries that alias (never anything else).
pub struct PlantedTap {
    pub name: String,
    alias: String,
}

impl PlantedTap {
    pub fn new(agent: &kici_model::AgentId, bridge: &str, alias: &str) -> Self {
        let name = kici_firecracker::names::tap_name(agent);
        kici_firecracker::tap::create_tap(&name, 10000, 10000).unwrap();
        let tap = PlantedTap {
            name,
            alias: alias.to_owned(),
        };
        block_on(async {
            kici_firecracker::tap::Netlink::connect()
                .unwrap()
                .attach_tap(&tap.name, bridge, alias)
                .await
                .unwrap()
        });
        assert!(tap.exists(), "{} was not created", tap.name);
        tap
    }

    /// The link exists with the alias it was given.
    pub fn exists(&self) -> bool {
        block_on(async {
            kici_firecracker::tap::Netlink::connect()
                .unwrap()
                .get(&self.name)
                .await
                .unwrap()
                .is_some_and(|l| l.alias.as_deref() == Some(self.alias.as_str()))
        })
    }
}

impl Drop for PlantedTap {
    fn drop(&mut self) {
        if self.exists() {
            let _ = tool("ip", &["link", "delete", &self.name]);
        }
    }
}

/// Leases `agent` an address of the world's pool in the store at `url`,
/// as `owner` (the test's second handle on the store: SQLite allows it
/// beside the daemon).
pub fn plant_lease(
    url: &str,
    owner: InstanceId,
    subnet: &str,
    agent: &kici_model::AgentId,
) -> kici_store::Lease {
    block_on(async {
        let url: kici_store::StoreUrl = url.parse().unwrap();
        let store = kici_store::open(&url, owner, kici_store::StoreOptions::default())
            .await
            .unwrap();
        let pool = kici_store::Ipv4Pool::new(subnet.parse().unwrap()).unwrap();
        let lease = store.allocate(&pool, agent).await.unwrap();
        store.close().await;
        lease
    })
}
