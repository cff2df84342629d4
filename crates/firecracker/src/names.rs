//! Names and owner markers of everything a VM holds on the host
//! (docs/ARCHITECTURE.md, *Names and owners*), derived in exactly one place
//! so that spawn, destroy and the sweep can never disagree (see
//! docs/deviations.md, D-fc-names).
//!
//! - jailer id = agent id;
//! - chroot `<chrootBaseDir>/<exec name>/<agent id>/root`, where `<exec name>`
//!   is the basename of the *canonicalised* Firecracker binary, as the jailer
//!   computes it;
//! - owner marker `<chrootBaseDir>/<exec name>/<agent id>/.kici-owner`
//!   holding `kici-scaler:<instance>:<agent id>`;
//! - TAP `kici-<8 hex of the agent id>` with ifalias
//!   `kici-scaler:<instance>:<agent id>`.

use kici_model::{AgentId, InstanceId};
use std::path::{Path, PathBuf};

/// Prefix of every TAP name (and of the owner tag).
pub const TAP_PREFIX: &str = "kici-";
/// The owner marker file in a VM's directory (beside `root/`).
pub const OWNER_MARKER: &str = ".kici-owner";
/// The API socket inside the jail (Firecracker's default `--api-sock`).
pub const API_SOCKET_IN_JAIL: &str = "/run/firecracker.socket";
/// The serial console log (Firecracker's stdout and stderr) inside the jail.
pub const SERIAL_LOG: &str = "serial-console.log";
/// Firecracker's logger output inside the jail.
pub const VMM_LOG: &str = "vmm.log";
/// Firecracker's metrics output inside the jail.
pub const METRICS_FILE: &str = "metrics.json";
pub const KERNEL_FILE: &str = "kernel";
pub const ROOTFS_FILE: &str = "rootfs.ext4";
pub const OVERLAY_FILE: &str = "overlay.ext4";
/// Interfaces the sweep never deletes whatever their name or alias says
/// (upstream's list; the configured bridge is added at run time).
pub const PROTECTED_INTERFACES: [&str; 3] = ["kici-br0", "kici-br1", "kici-m01"];
/// `sizeof(sockaddr_un.sun_path)` on Linux, the terminating NUL included.
pub const SUN_PATH_MAX: usize = 108;

/// `kici-<8 hex>`: 13 bytes, within IFNAMSIZ - 1.
pub fn tap_name(agent: &AgentId) -> String {
    format!("{TAP_PREFIX}{}", agent.suffix_hex())
}

/// Does `name` have the shape of one of our TAPs (`kici-` + 8 lowercase hex)?
pub fn is_tap_shaped(name: &str) -> bool {
    name.strip_prefix(TAP_PREFIX).is_some_and(|hex| {
        hex.len() == 8 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// `kici-scaler:<instance>:<agent id>`: the ifalias of a TAP and the content
/// of a chroot's owner marker.
pub fn owner_tag(instance: InstanceId, agent: &AgentId) -> String {
    format!("kici-scaler:{instance}:{agent}")
}

/// The parsed owner tag, or `None` for anything that is not one.
pub fn parse_owner_tag(tag: &str) -> Option<(InstanceId, AgentId)> {
    let rest = tag.trim().strip_prefix("kici-scaler:")?;
    let (instance, agent) = rest.split_once(':')?;
    Some((instance.parse().ok()?, agent.parse().ok()?))
}

/// Where a scaler's VMs live on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailLayout {
    /// `<chrootBaseDir>/<exec name>`.
    exec_dir: PathBuf,
    exec_name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("cannot resolve the Firecracker binary {}: {reason}", path.display())]
    Binary { path: PathBuf, reason: String },
    #[error("the Firecracker binary's name {name:?} does not contain `firecracker` (the jailer refuses it)")]
    ExecName { name: String },
    #[error("chrootBaseDir {} must be an absolute path", .0.display())]
    RelativeBase(PathBuf),
    #[error("the API socket path {} is {len} bytes; a unix socket path must be under {SUN_PATH_MAX} bytes: shorten chrootBaseDir", path.display())]
    SocketPathTooLong { path: PathBuf, len: usize },
}

impl JailLayout {
    /// The layout the jailer will use for `firecracker_path` (canonicalised,
    /// symlinks resolved, as the jailer does) under `chroot_base`.
    pub fn resolve(chroot_base: &Path, firecracker_path: &Path) -> Result<Self, LayoutError> {
        let real = std::fs::canonicalize(firecracker_path).map_err(|e| LayoutError::Binary {
            path: firecracker_path.to_owned(),
            reason: e.to_string(),
        })?;
        let exec_name = real
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| LayoutError::Binary {
                path: firecracker_path.to_owned(),
                reason: "no UTF-8 file name".into(),
            })?
            .to_owned();
        Self::new(chroot_base, exec_name)
    }

    /// The layout for an already known exec name.
    pub fn new(chroot_base: &Path, exec_name: String) -> Result<Self, LayoutError> {
        if !chroot_base.is_absolute() {
            return Err(LayoutError::RelativeBase(chroot_base.to_owned()));
        }
        if !exec_name.contains("firecracker") {
            return Err(LayoutError::ExecName { name: exec_name });
        }
        let layout = Self {
            exec_dir: chroot_base.join(&exec_name),
            exec_name,
        };
        // Agent ids all have the same length, so any one checks them all.
        let probe = AgentId::new(kici_model::ScalerType::Firecracker, [0; 4]);
        layout.check_socket_path(&probe)?;
        Ok(layout)
    }

    pub fn exec_name(&self) -> &str {
        &self.exec_name
    }

    /// `<chrootBaseDir>/<exec name>`: every VM directory is directly below.
    pub fn exec_dir(&self) -> &Path {
        &self.exec_dir
    }

    /// `<chrootBaseDir>/<exec name>/<agent id>`: removed whole on destroy.
    pub fn vm_dir(&self, agent: &AgentId) -> PathBuf {
        self.exec_dir.join(agent.to_string())
    }

    /// The jail root, `<vm dir>/root`.
    pub fn root(&self, agent: &AgentId) -> PathBuf {
        self.vm_dir(agent).join("root")
    }

    pub fn owner_marker(&self, agent: &AgentId) -> PathBuf {
        self.vm_dir(agent).join(OWNER_MARKER)
    }

    /// The host path of the API socket.
    pub fn api_socket(&self, agent: &AgentId) -> PathBuf {
        self.root(agent)
            .join(API_SOCKET_IN_JAIL.trim_start_matches('/'))
    }

    /// `<root>/<exec name>.pid`, written by the jailer under `--new-pid-ns`.
    pub fn pid_file(&self, agent: &AgentId) -> PathBuf {
        self.root(agent).join(format!("{}.pid", self.exec_name))
    }

    pub fn in_root(&self, agent: &AgentId, file: &str) -> PathBuf {
        self.root(agent).join(file)
    }

    fn check_socket_path(&self, agent: &AgentId) -> Result<(), LayoutError> {
        let path = self.api_socket(agent);
        let len = path.as_os_str().len();
        if len >= SUN_PATH_MAX {
            return Err(LayoutError::SocketPathTooLong { path, len });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_model::ScalerType;

    fn agent(hex: [u8; 4]) -> AgentId {
        AgentId::new(ScalerType::Firecracker, hex)
    }

    #[test]
    fn firecracker_tap_name_is_the_last_8_hex_of_the_agent_id() {
        let a: AgentId = "scaler-firecracker-1d993749".parse().unwrap();
        assert_eq!(tap_name(&a), "kici-1d993749");
        assert!(is_tap_shaped(&tap_name(&a)));
        assert!(tap_name(&a).len() <= 15);
        for name in [
            "kici-br0",
            "kici-1D993749",
            "kici-1d99374",
            "kici-1d9937490",
            "eth0",
        ] {
            assert!(!is_tap_shaped(name), "{name}");
        }
    }

    #[test]
    fn firecracker_owner_tag_round_trips_and_rejects_others() {
        let instance: InstanceId = "0a0b0c0d".parse().unwrap();
        let a = agent([1, 2, 3, 4]);
        let tag = owner_tag(instance, &a);
        assert_eq!(tag, "kici-scaler:0a0b0c0d:scaler-firecracker-01020304");
        assert_eq!(parse_owner_tag(&tag), Some((instance, a)));
        assert_eq!(parse_owner_tag(&format!("{tag}\n")), Some((instance, a)));
        for bad in [
            "",
            "kici-scaler:zz:scaler-firecracker-01020304",
            "kici:0a0b0c0d:x",
            "other",
        ] {
            assert_eq!(parse_owner_tag(bad), None, "{bad}");
        }
    }

    #[test]
    fn firecracker_layout_paths_follow_the_jailer() {
        let layout = JailLayout::new(Path::new("/srv/jailer"), "firecracker".into()).unwrap();
        let a: AgentId = "scaler-firecracker-0000abcd".parse().unwrap();
        assert_eq!(
            layout.root(&a),
            Path::new("/srv/jailer/firecracker/scaler-firecracker-0000abcd/root")
        );
        assert_eq!(
            layout.api_socket(&a),
            Path::new(
                "/srv/jailer/firecracker/scaler-firecracker-0000abcd/root/run/firecracker.socket"
            )
        );
        assert_eq!(
            layout.pid_file(&a),
            Path::new("/srv/jailer/firecracker/scaler-firecracker-0000abcd/root/firecracker.pid")
        );
        assert_eq!(
            layout.owner_marker(&a),
            Path::new("/srv/jailer/firecracker/scaler-firecracker-0000abcd/.kici-owner")
        );
    }

    #[test]
    fn firecracker_layout_refuses_long_bases_bad_names_and_relative_paths() {
        let long = format!("/{}", "x".repeat(40));
        assert!(matches!(
            JailLayout::new(Path::new(&long), "firecracker".into()),
            Err(LayoutError::SocketPathTooLong { .. })
        ));
        let fits = format!("/{}", "x".repeat(20));
        assert!(JailLayout::new(Path::new(&fits), "firecracker".into()).is_ok());
        assert!(matches!(
            JailLayout::new(Path::new("/srv"), "vmm".into()),
            Err(LayoutError::ExecName { .. })
        ));
        assert!(matches!(
            JailLayout::new(Path::new("srv"), "firecracker".into()),
            Err(LayoutError::RelativeBase(_))
        ));
    }

    #[test]
    fn firecracker_layout_resolves_symlinked_binaries_like_the_jailer() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("firecracker-v1.16.1-x86_64");
        std::fs::write(&real, b"").unwrap();
        let link = dir.path().join("firecracker");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let layout = JailLayout::resolve(Path::new("/srv/jailer"), &link).unwrap();
        assert_eq!(layout.exec_name(), "firecracker-v1.16.1-x86_64");
        assert_eq!(
            layout.exec_dir(),
            Path::new("/srv/jailer/firecracker-v1.16.1-x86_64")
        );
    }
}
