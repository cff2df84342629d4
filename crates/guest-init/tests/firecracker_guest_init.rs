//! The real `kici-guest-init` as PID 1 of throwaway mount, PID and UTS
//! namespaces (`unshare`, root only), chrooted into a staged root: it
//! mounts the API filesystems, stacks a tmpfs overlay over the staged root
//! and pivots into it, reads MMDS V2 from an in-test server (the testkit's
//! MMDS behind the testkit's HTTP reader), sets the hostname and writes
//! `/etc`, runs a busybox "agent" that reports what it sees, reaps the
//! orphan that agent leaves behind, and ends its "VM" with `reboot()` —
//! which, in a PID namespace, the kernel turns into SIGHUP for the
//! namespace's init.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_testkit::http::{read_request, write_response, HttpError, HttpResponse};
use kici_testkit::mmds::{GuestMethod, GuestRequest, Mmds, MmdsVersion, DEFAULT_MMDS_SIZE_LIMIT};
use serde_json::json;
use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

/// MMDS V2 over HTTP on 127.0.0.1 (the namespaces share the test's network).
fn serve_mmds(doc: serde_json::Value) -> SocketAddr {
    let mut mmds = Mmds::new(DEFAULT_MMDS_SIZE_LIMIT);
    mmds.set_version(MmdsVersion::V2, false);
    mmds.put(doc).unwrap();
    let mmds = Arc::new(Mutex::new(mmds));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let mmds = mmds.clone();
            std::thread::spawn(move || serve_connection(tcp, &mmds));
        }
    });
    addr
}

fn serve_connection(tcp: TcpStream, mmds: &Mutex<Mmds>) {
    let mut writer = tcp.try_clone().unwrap();
    let mut reader = BufReader::new(tcp);
    loop {
        let req = match read_request(&mut reader, &mut std::io::sink(), 4096) {
            Ok(r) => r,
            Err(HttpError::Closed) | Err(_) => return,
        };
        let method = match req.method.as_str() {
            "GET" => GuestMethod::Get,
            "PUT" => GuestMethod::Put,
            _ => GuestMethod::Other,
        };
        let answer = mmds.lock().unwrap().guest_request(&GuestRequest {
            method,
            path: req.path.clone(),
            headers: req.headers.clone(),
        });
        let resp = HttpResponse {
            status: answer.status,
            content_type: Some(answer.content_type),
            body: answer.body.into_bytes(),
        };
        if write_response(&mut writer, &resp).is_err() {
            return;
        }
    }
}

/// Copies `file` (following links) to the same path under `root`.
fn install(root: &Path, file: &Path) {
    let dst = root.join(file.strip_prefix("/").unwrap());
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    std::fs::copy(file, &dst).unwrap();
}

/// The shared libraries `ldd` lists for a dynamically linked test build.
fn libraries(binary: &Path) -> Vec<std::path::PathBuf> {
    let out = Command::new("ldd").arg(binary).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .find(|w| w.starts_with('/'))
                .map(std::path::PathBuf::from)
        })
        .collect()
}

const AGENT: &str = r#"#!/bin/busybox sh
bb=/bin/busybox
echo "agent: hostname=$($bb hostname)"
$bb env | $bb sort | $bb sed 's/^/agent-env: /'
$bb sed 's/^/resolv: /' /etc/resolv.conf
$bb sed 's/^/hosts: /' /etc/hosts
$bb awk '$2 == "/" { print "agent: root fs " $3 }' /proc/mounts
$bb awk '$2 == "/tmp" || $2 == "/run" || $2 == "/dev/pts" { print "agent: mounted " $2 " " $3 }' /proc/mounts
echo data > /usr/written-by-agent && echo "agent: root writable"
echo "agent: pid $$"
# An orphan PID 1 has to end and reap.
$bb sleep 1000 &
exit 7
"#;

#[test]
fn serial_firecracker_guest_init_runs_the_agent_in_an_overlay_root_and_ends_the_vm() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test makes namespaces and mounts: run it as root"
    );
    let mmds = serve_mmds(json!({"latest": {"meta-data": {
        "kici-orchestrator-url": "ws://10.0.0.1:7879/ws",
        "kici-agent-id": "scaler-firecracker-0a1b2c3d",
        "kici-labels": "linux,kici:agent:firecracker",
        "kici-scaler-managed": "1",
        "kici-gateway-ip": "10.0.0.1",
        "kici-env": {"HTTP_PROXY": "http://proxy:3128", "bad-name": "x"}
    }}}));

    let tmp = tempfile::tempdir().unwrap();
    let stage = tmp.path().join("root");
    for dir in [
        "dev", "proc", "sys", "run", "tmp", "etc", "root", "bin", "usr",
    ] {
        std::fs::create_dir_all(stage.join(dir)).unwrap();
    }
    let init = Path::new(env!("CARGO_BIN_EXE_kici-guest-init"));
    std::fs::copy(init, stage.join("init")).unwrap();
    for lib in libraries(init) {
        install(&stage, &lib);
    }
    std::fs::copy("/bin/busybox", stage.join("bin/busybox")).unwrap();
    let agent = stage.join("agent.sh");
    std::fs::write(&agent, AGENT).unwrap();
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();

    let cmdline = format!(
        "console=ttyS0 reboot=k init=/init ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off \
         kici.overlay=tmpfs kici.mmds={mmds} kici.mmds_timeout=30 kici.agent=/agent.sh"
    );
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--uts",
            "--pid",
            "--fork",
            "--propagation",
            "private",
            "sh",
            "-c",
            r#"mount --bind "$1" "$1" && exec chroot "$1" /init --cmdline "$2""#,
            "sh",
        ])
        .arg(&stage)
        .arg(&cmdline)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let all = format!("--- stdout\n{stdout}\n--- stderr\n{stderr}");

    for line in [
        "agent: hostname=scaler-firecracker-0a1b2c3d",
        "agent-env: HOME=/root",
        "agent-env: HTTP_PROXY=http://proxy:3128",
        "agent-env: KICI_AGENT_ID=scaler-firecracker-0a1b2c3d",
        "agent-env: KICI_LABELS=linux,kici:agent:firecracker",
        "agent-env: KICI_ORCHESTRATOR_URL=ws://10.0.0.1:7879/ws",
        "agent-env: KICI_SCALER_MANAGED=1",
        "resolv: nameserver 1.1.1.1",
        "hosts: 127.0.1.1\tscaler-firecracker-0a1b2c3d",
        "hosts: 10.0.0.1\tkici-gateway",
        "agent: root fs overlay",
        "agent: mounted /tmp tmpfs",
        "agent: mounted /run tmpfs",
        "agent: mounted /dev/pts devpts",
        "agent: root writable",
    ] {
        assert!(stdout.lines().any(|l| l == line), "missing {line:?}\n{all}");
    }
    // Only the contract's variables and the basics: nothing of init's own
    // environment, no skipped entry.
    assert!(!stdout.contains("bad-name"), "{all}");
    assert!(
        stdout
            .lines()
            .filter(|l| l.starts_with("agent-env: "))
            .all(|l| [
                "HOME=",
                "HTTP_PROXY=",
                "KICI_",
                "LANG=",
                "PATH=",
                "PWD=",
                "SHELL=",
                "USER=",
                "SHLVL="
            ]
            .iter()
            .any(|p| l["agent-env: ".len()..].starts_with(p))),
        "{all}"
    );
    assert!(
        stderr.contains("kici-init: root is writable: overlay on tmpfs"),
        "{all}"
    );
    assert!(
        stderr.contains("kici-init: agent exited with 7; stopping the VM"),
        "{all}"
    );
    // The VM ended by reboot(): SIGHUP for the namespace's init, re-raised by unshare.
    assert_eq!(out.status.signal(), Some(libc_sighup()), "{all}");
    // Writes went to the overlay, not to the (lower) staged root.
    assert!(!stage.join("usr/written-by-agent").exists());
    assert!(!stage.join("etc/resolv.conf").exists());
}

fn libc_sighup() -> i32 {
    nix::sys::signal::Signal::SIGHUP as i32
}
