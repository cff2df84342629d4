//! The fake jailer and the simulator together, the way the backend drives the
//! real ones: jailer → chroot → `firecracker` (fc-sim) as the jailer uid in a
//! new PID namespace, the API over the socket inside the jail, the guest
//! running the agent, Ctrl+Alt+Del ending it. Root only (chroot, mknod, TAP).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::fs::{self, File};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kici_testkit::fc::{GuestMode, GuestSetup, Kit, SimClient};
use serde_json::{json, Value};
use support::{paths, wait_pid_gone, KillOnDrop, Tap};

const UID: u32 = 64_123;
const GID: u32 = 64_124;
const POST_BOOT: &str = "The requested operation is not supported after starting the microVM.";

struct Jail {
    _tmp: tempfile::TempDir,
    kit: Kit,
    base: PathBuf,
    cgroups: PathBuf,
}

impl Jail {
    fn new(agent: bool) -> Self {
        let p = paths();
        let tmp = tempfile::tempdir().unwrap();
        let kit = p.kit(&tmp.path().join("kit")).unwrap();
        kit.set_guest(&GuestSetup {
            mode: GuestMode::Normal,
            agent: agent.then(|| p.testkit_agent.clone()),
            ..Default::default()
        })
        .unwrap();
        let base = tmp.path().join("jailer");
        fs::create_dir_all(&base).unwrap();
        let cgroups = tmp.path().join("cgroup");
        kit.set_cgroup_root(&cgroups).unwrap();
        Self {
            _tmp: tmp,
            kit,
            base,
            cgroups,
        }
    }

    fn root(&self, id: &str) -> PathBuf {
        self.base.join("firecracker").join(id).join("root")
    }

    /// What the backend prepares before the jailer runs: the jail root with the
    /// kernel, images and log files, the writable ones owned by the jailer user.
    fn prepare(&self, id: &str) -> PathBuf {
        let root = self.root(id);
        fs::create_dir_all(&root).unwrap();
        for (name, owned) in [
            ("kernel", false),
            ("rootfs.ext4", false),
            ("overlay.ext4", true),
            ("vmm.log", true),
        ] {
            let f = root.join(name);
            fs::write(&f, b"").unwrap();
            fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
            if owned {
                nix::unistd::chown(
                    &f,
                    Some(nix::unistd::Uid::from_raw(UID)),
                    Some(nix::unistd::Gid::from_raw(GID)),
                )
                .unwrap();
            }
        }
        root
    }

    fn jailer(&self, id: &str, extra: &[&str], fc_args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.kit.jailer);
        cmd.args(["--id", id, "--exec-file"])
            .arg(&self.kit.firecracker)
            .args([
                "--uid",
                &UID.to_string(),
                "--gid",
                &GID.to_string(),
                "--chroot-base-dir",
            ])
            .arg(&self.base)
            .args(extra)
            .arg("--")
            .args(fc_args)
            .env_clear()
            .stdin(Stdio::null());
        cmd
    }
}

fn pid_file(root: &Path) -> u32 {
    fs::read_to_string(root.join("firecracker.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn proc_status(pid: u32, key: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{key}:"))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default()
}

fn put_ok(c: &SimClient, path: &str, body: Value) {
    let r = c.put(path, &body).unwrap();
    assert_eq!(r.status, 204, "PUT {path}: {}", r.body);
}

#[test]
fn serial_firecracker_jailer_boots_the_simulator_in_a_chroot_as_the_jailer_user() {
    let jail = Jail::new(true);
    let id = "scaler-firecracker-0a1b2c3d";
    let root = jail.prepare(id);
    let tap = Tap::new("jb", UID, GID);
    let serial_path = root.join("serial-console.log");
    let serial = File::create(&serial_path).unwrap();
    let mut jailer = jail
        .jailer(
            id,
            &[
                "--new-pid-ns",
                "--cgroup-version",
                "2",
                "--cgroup",
                "cpu.weight=50",
            ],
            &[
                "--api-sock",
                "/run/firecracker.socket",
                "--log-path",
                "/vmm.log",
                "--level",
                "Info",
                "--show-level",
            ],
        )
        .stdout(serial.try_clone().unwrap())
        .stderr(serial)
        .spawn()
        .unwrap();
    let jailer_pid = jailer.id();
    // The jailer exits at once (code 0) and leaves the VMM running.
    let status = jailer.wait().unwrap();
    assert!(
        status.success(),
        "{}",
        fs::read_to_string(&serial_path).unwrap()
    );
    let pid = pid_file(&root);
    let _guard = KillOnDrop(Some(pid));
    assert!(!support::pid_gone(pid), "the VMM outlives the jailer");
    assert_eq!(
        proc_status(pid, "Uid").split_whitespace().next(),
        Some(UID.to_string().as_str())
    );
    assert_eq!(
        proc_status(pid, "Gid").split_whitespace().next(),
        Some(GID.to_string().as_str())
    );
    let nspid: Vec<String> = proc_status(pid, "NSpid")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_eq!(
        nspid,
        vec![pid.to_string(), "1".to_string()],
        "pid 1 of a new PID namespace"
    );
    assert_eq!(
        fs::read_link(format!("/proc/{pid}/root")).unwrap(),
        root.canonicalize().unwrap()
    );

    // The jail the real jailer leaves behind.
    let kvm = fs::metadata(root.join("dev/kvm")).unwrap();
    assert!(kvm.file_type().is_char_device());
    assert_eq!((kvm.rdev() >> 8 & 0xfff, kvm.rdev() & 0xff), (10, 232));
    assert_eq!(
        (kvm.uid(), kvm.gid(), kvm.mode() & 0o777),
        (UID, GID, 0o600)
    );
    let tun = fs::metadata(root.join("dev/net/tun")).unwrap();
    assert!(tun.file_type().is_char_device());
    for dir in ["", "dev", "dev/net", "run"] {
        let m = fs::metadata(root.join(dir)).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (UID, 0o700), "{dir}");
    }
    assert!(
        root.join("firecracker").is_file(),
        "the exec file is put into the jail"
    );
    let cg = jail.cgroups.join("firecracker").join(id);
    assert_eq!(fs::read_to_string(cg.join("cpu.weight")).unwrap(), "50");
    assert_eq!(
        fs::read_to_string(cg.join("cgroup.procs")).unwrap(),
        jailer_pid.to_string()
    );

    // The backend's sequence, paths relative to the jail.
    let c = SimClient::new(jail.kit.api_socket(&jail.base, id));
    c.wait_ready(Duration::from_secs(10)).unwrap();
    let r = c.put("/drives/rootfs", &json!({"drive_id": "rootfs", "path_on_host": root.join("rootfs.ext4"), "is_root_device": true, "is_read_only": true})).unwrap();
    assert_eq!(
        r.status, 400,
        "host paths are not visible inside the jail: {}",
        r.body
    );
    put_ok(
        &c,
        "/boot-source",
        json!({"kernel_image_path": "/kernel", "boot_args": "console=ttyS0 reboot=k panic=1 i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off"}),
    );
    put_ok(
        &c,
        "/drives/rootfs",
        json!({"drive_id": "rootfs", "path_on_host": "/rootfs.ext4", "is_root_device": true, "is_read_only": true}),
    );
    put_ok(
        &c,
        "/drives/overlay",
        json!({"drive_id": "overlay", "path_on_host": "/overlay.ext4", "is_root_device": false, "is_read_only": false}),
    );
    let r = c.put("/drives/scratch", &json!({"drive_id": "scratch", "path_on_host": "/kernel", "is_root_device": false, "is_read_only": false})).unwrap();
    assert_eq!(
        r.status, 400,
        "a read-write drive needs a file the jailer user may write: {}",
        r.body
    );
    put_ok(
        &c,
        "/machine-config",
        json!({"vcpu_count": 1, "mem_size_mib": 256, "smt": false}),
    );
    put_ok(
        &c,
        "/network-interfaces/eth0",
        json!({"iface_id": "eth0", "guest_mac": "06:00:AC:0A:00:02", "host_dev_name": tap.name}),
    );
    put_ok(
        &c,
        "/mmds/config",
        json!({"network_interfaces": ["eth0"], "version": "V2", "ipv4_address": "169.254.169.254"}),
    );
    put_ok(
        &c,
        "/mmds",
        json!({"latest": {"meta-data": {
            "kici-orchestrator-url": "ws://10.0.0.1:4000/ws",
            "kici-agent-id": id,
            "kici-labels": "linux,kici:agent:firecracker",
            "kici-scaler-managed": "1",
            "kici-gateway-ip": "10.0.0.1",
            "kici-agent-token": "tok-123"
        }}}),
    );
    put_ok(&c, "/actions", json!({"action_type": "InstanceStart"}));

    // Running, and the guest agent has written its report (right after it
    // starts: the phase alone can be seen a moment before the file).
    let report_path = root.join("agent-report.json");
    let st = c
        .wait_state(Duration::from_secs(10), |s| {
            s.guest_phase() == "agent-running"
                && fs::read_to_string(&report_path)
                    .is_ok_and(|t| serde_json::from_str::<Value>(&t).is_ok())
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e}\nserial:\n{}",
                fs::read_to_string(&serial_path).unwrap_or_default()
            )
        });
    assert_eq!(
        st.uid(),
        Some(u64::from(UID)),
        "the simulator runs as the jailer uid"
    );
    assert_eq!(
        st.guest()["tokenless_read_status"],
        401,
        "V2 refuses token-less reads"
    );
    assert_eq!(st.guest()["token_status"], 200);
    assert_eq!(st.guest()["metadata_status"], 200);
    let report: Value = serde_json::from_str(&fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(report["env"]["KICI_AGENT_ID"], id);
    assert_eq!(report["env"]["KICI_AGENT_TOKEN"], "tok-123");
    assert_eq!(report["uid"], UID);

    // The guest namespace reads MMDS through the jailed VMM: 401 without a token.
    let guest = kici_testkit::guestnet::GuestNet::attach(
        &jail.kit.guest_link(&jail.base, id),
        &kici_testkit::guestnet::GuestNetConfig {
            netns: format!("ktjb{}", std::process::id()),
            iface_id: "eth0".into(),
            mac: "06:00:AC:0A:00:02".into(),
            ip: "10.0.0.2".parse().unwrap(),
            prefix_len: 24,
            gateway: None,
            mmds_address: "169.254.169.254".parse().unwrap(),
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
    let no_token = [
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "http://169.254.169.254/latest/meta-data/",
    ];
    assert_eq!(curl(&no_token), "401");
    let token = curl(&[
        "-X",
        "PUT",
        "-H",
        "X-metadata-token-ttl-seconds: 30",
        "http://169.254.169.254/latest/api/token",
    ]);
    let auth = format!("X-metadata-token: {token}");
    assert_eq!(
        curl(&[
            "-H",
            &auth,
            "http://169.254.169.254/latest/meta-data/kici-agent-token"
        ]),
        "tok-123"
    );

    // config.ack: the backend clears MMDS; the store is empty afterwards, for the guest too.
    put_ok(&c, "/mmds", json!({"latest": {"meta-data": {}}}));
    assert_eq!(
        c.state().unwrap().mmds(),
        &json!({"latest": {"meta-data": {}}})
    );
    let after = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-H",
        &auth,
        "http://169.254.169.254/latest/meta-data/kici-agent-token",
    ]);
    assert_eq!(after, "404", "the token is gone from MMDS");
    drop(guest);
    let r = c
        .put("/boot-source", &json!({"kernel_image_path": "/kernel"}))
        .unwrap();
    assert_eq!(r.fault_message().as_deref(), Some(POST_BOOT));

    let vmm_log = fs::read_to_string(root.join("vmm.log")).unwrap();
    assert!(
        vmm_log.contains(&format!("[{id}:main:INFO] Running Firecracker v1.16.1")),
        "{vmm_log}"
    );

    // Destroy: Ctrl+Alt+Del ends the guest and the VMM.
    put_ok(&c, "/actions", json!({"action_type": "SendCtrlAltDel"}));
    assert!(
        wait_pid_gone(pid, Duration::from_secs(10)),
        "the VMM exits after Ctrl+Alt+Del"
    );
    let serial = fs::read_to_string(&serial_path).unwrap();
    assert!(
        serial.contains(&format!("testkit-agent: started as {id}")),
        "{serial}"
    );
    assert!(serial.contains("reboot: Restarting system"), "{serial}");
}

#[test]
fn serial_firecracker_jailer_refuses_bad_arguments_and_reused_chroots() {
    let jail = Jail::new(false);
    let run = |id: &str, extra: &[&str]| {
        let out = jail
            .jailer(id, extra, &["--api-sock", "/run/firecracker.socket"])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run("bad_id", &["--new-pid-ns"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("Invalid instance ID"), "{err}");
    let (code, err) = run(&"a".repeat(65), &["--new-pid-ns"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("Invalid instance ID"), "{err}");
    let (code, err) = run("vm-1", &["--new-pid-ns", "--no-such-flag"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("Found argument '--no-such-flag'"), "{err}");
    assert!(
        !jail.base.join("firecracker").exists(),
        "refused runs create nothing"
    );

    // An exec file whose name lacks "firecracker" is refused.
    let vmm = jail.kit.firecracker.with_file_name("vmm");
    fs::copy(&jail.kit.firecracker, &vmm).unwrap();
    let out = Command::new(&jail.kit.jailer)
        .args(["--id", "vm-1", "--exec-file"])
        .arg(&vmm)
        .args(["--uid", "1", "--gid", "1", "--chroot-base-dir"])
        .arg(&jail.base)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("must contain \"firecracker\""));

    // First start works; a second jailer on the same chroot is refused.
    let id = "vm-reuse";
    let root = jail.prepare(id);
    // The VMM inherits the jailer's stdio: keep it off the pipes `output()` waits on.
    let status = jail
        .jailer(
            id,
            &["--new-pid-ns"],
            &["--api-sock", "/run/firecracker.socket"],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let pid = pid_file(&root);
    let _guard = KillOnDrop(Some(pid));
    let (code, err) = run(id, &["--new-pid-ns"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("mknod"), "{err}");
    assert_eq!(
        pid_file(&root),
        pid,
        "the running VMM's pid file is untouched"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_pid_gone(pid, Duration::from_secs(10)));
}

#[test]
fn serial_firecracker_jailer_without_new_pid_ns_execs_the_vmm_in_place() {
    let jail = Jail::new(false);
    let id = "vm-inplace";
    let root = jail.prepare(id);
    let mut child = jail
        .jailer(id, &[], &["--api-sock", "/run/firecracker.socket"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _guard = KillOnDrop(Some(child.id()));
    let c = SimClient::new(root.join("run/firecracker.socket"));
    c.wait_ready(Duration::from_secs(10)).unwrap();
    let st = c.state().unwrap();
    assert_eq!(st.0["pid"], child.id(), "the jailer became the VMM");
    assert_eq!(st.uid(), Some(u64::from(UID)));
    assert!(
        !root.join("firecracker.pid").exists(),
        "no pid file without --new-pid-ns"
    );
    put_ok(&c, "/boot-source", json!({"kernel_image_path": "/kernel"}));
    put_ok(&c, "/actions", json!({"action_type": "InstanceStart"}));
    put_ok(&c, "/actions", json!({"action_type": "SendCtrlAltDel"}));
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn serial_firecracker_jailer_joins_the_netns_and_daemonizes() {
    let jail = Jail::new(false);
    let id = "vm-netns";
    let root = jail.prepare(id);
    let ns = format!("ktjn{}", std::process::id());
    assert!(Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .unwrap()
        .success());
    struct DelNs(String);
    impl Drop for DelNs {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let _ns_guard = DelNs(ns.clone());
    let netns_path = format!("/run/netns/{ns}");
    let status = jail
        .jailer(
            id,
            &[
                "--new-pid-ns",
                "--daemonize",
                "--netns",
                &netns_path,
                "--resource-limit",
                "no-file=512",
            ],
            &["--api-sock", "/run/firecracker.socket"],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let pid = pid_file(&root);
    let _guard = KillOnDrop(Some(pid));
    let ns_inode = fs::metadata(&netns_path).unwrap().ino();
    let vmm_ns = fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    assert_eq!(
        vmm_ns.to_string_lossy(),
        format!("net:[{ns_inode}]"),
        "the VMM runs in --netns"
    );
    assert_eq!(
        fs::read_link(format!("/proc/{pid}/fd/1")).unwrap(),
        Path::new("/dev/null"),
        "--daemonize: stdio on /dev/null"
    );
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let session: u32 = fields[3].parse().unwrap();
    assert_ne!(
        session,
        nix::unistd::getsid(None).unwrap().as_raw() as u32,
        "--daemonize: a new session"
    );
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let nofile = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    assert_eq!(nofile.split_whitespace().nth(3), Some("512"), "{nofile}");
    let st = SimClient::new(root.join("run/firecracker.socket"));
    st.wait_ready(Duration::from_secs(10)).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_pid_gone(pid, Duration::from_secs(10)));
}
