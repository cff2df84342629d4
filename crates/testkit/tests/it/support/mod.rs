//! Helpers shared by the testkit's integration tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kici_testkit::fc::{build_binaries, Paths};

pub fn paths() -> Paths {
    build_binaries().expect("building the static testkit binaries")
}

pub fn touch(path: &Path) {
    std::fs::write(path, b"").unwrap();
}

/// A TAP device owned by `uid:gid`, deleted on drop.
pub struct Tap {
    pub name: String,
}

impl Tap {
    pub fn new(tag: &str, uid: u32, gid: u32) -> Self {
        let name = format!("kt{tag}{:x}", std::process::id() & 0x00ff_ffff);
        let name: String = name.chars().take(15).collect();
        let st = Command::new("ip")
            .args([
                "tuntap",
                "add",
                "dev",
                &name,
                "mode",
                "tap",
                "user",
                &uid.to_string(),
                "group",
                &gid.to_string(),
            ])
            .status()
            .unwrap();
        assert!(st.success(), "creating TAP {name}");
        Self { name }
    }
}

impl Tap {
    /// Give the host side an address and bring it up (a TAP without a bridge).
    pub fn with_addr(self, cidr: &str) -> Self {
        for args in [
            vec!["addr", "add", cidr, "dev", &self.name],
            vec!["link", "set", &self.name, "up"],
        ] {
            let st = Command::new("ip").args(&args).status().unwrap();
            assert!(st.success(), "ip {args:?}");
        }
        self
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .status();
    }
}

/// Whether a pid is gone (or a zombie nobody reaps yet).
pub fn pid_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
    }
}

/// Bounded wait for a process that is not our child to end.
pub fn wait_pid_gone(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if pid_gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    pid_gone(pid)
}

/// Kill a leftover VMM (cleanup on failure).
pub struct KillOnDrop(pub Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            if !pid_gone(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}
