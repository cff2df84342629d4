//! A second local user for the attacker's side of the security tests: made
//! with `useradd` (no home, no login shell), removed with `userdel` when
//! the test ends, whether it passed or not.

use std::process::{Command, Output};

/// A local user that exists for one test.
pub struct LocalUser {
    pub name: String,
    pub uid: u32,
}

impl LocalUser {
    /// `useradd`s a new system user named `<prefix><random>` (at most 32
    /// characters, as `useradd` requires).
    pub fn create(prefix: &str) -> Self {
        let name = format!("{prefix}{:06x}", rand::random::<u32>() & 0xff_ffff);
        assert!(name.len() <= 32, "{name}: user names are at most 32 bytes");
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                &name,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "useradd {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Removed on drop from here on, whatever fails next.
        let mut user = Self { name, uid: 0 };
        let id = Command::new("id")
            .args(["-u", &user.name])
            .output()
            .unwrap();
        user.uid = String::from_utf8_lossy(&id.stdout).trim().parse().unwrap();
        assert_ne!(user.uid, 0);
        user
    }

    /// Runs `script` as this user with `sh -e`, `args` as `$1`…; panics if
    /// it fails.
    pub fn sh(&self, script: &str, args: &[&str]) {
        let out = Command::new("runuser")
            .args(["-u", &self.name, "--", "sh", "-ec", script, "sh"])
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "as {}: {script}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `program args…` run as this user (`runuser -u`, no shell, no
    /// inherited `KICI_*` variable), its output.
    pub fn run(&self, program: &str, args: &[&str]) -> Output {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", &self.name, "--", program]).args(args);
        for (k, _) in std::env::vars() {
            if k.starts_with("KICI_") {
                cmd.env_remove(k);
            }
        }
        cmd.output().unwrap()
    }
}

impl Drop for LocalUser {
    fn drop(&mut self) {
        // Processes the test left running as the user would make userdel
        // refuse; none should exist, but a failing test may leave some.
        let _ = Command::new("pkill")
            .args(["-9", "-u", &self.name])
            .status();
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}
