//! The mounts `/init` makes, as data (so they can be checked without
//! being root), in the order they are made.
//!
//! The overlay choice: the scaler attaches the rootfs read-only (it is
//! shared by every VM of a label set, hard-linked into each chroot) and a
//! per-VM ext4 overlay drive. `/init` makes the whole root writable rather
//! than only the agent's work directory, because jobs write anywhere (tool
//! caches under `$HOME`, package installs under `/usr`, `/etc`): it mounts
//! the overlay drive on a tmpfs-backed staging directory, stacks
//! `overlay(lowerdir=/, upperdir, workdir)` over the read-only root, moves
//! `/dev`, `/proc` and `/sys` into it and `pivot_root`s into it. Staging
//! lives under a tmpfs on `/run` so the rootfs needs no extra directories.

use std::path::PathBuf;

use crate::cmdline::OverlaySource;

/// What a mount is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub source: String,
    pub target: PathBuf,
    pub fstype: String,
    pub options: MountOptions,
    /// Filesystem-specific data (`mode=1777`, overlay dirs, …).
    pub data: Option<String>,
    /// Already mounted (`EBUSY`) is fine: the kernel may have mounted
    /// `devtmpfs` itself (`CONFIG_DEVTMPFS_MOUNT`), and a distribution
    /// kernel's initramfs moves its `/dev`, `/proc` and `/sys` into the root
    /// before it runs `/init`.
    pub may_exist: bool,
}

/// The mount flags `/init` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MountOptions {
    pub nosuid: bool,
    pub nodev: bool,
    pub noexec: bool,
}

impl MountOptions {
    const SECURE: Self = Self {
        nosuid: true,
        nodev: true,
        noexec: true,
    };
    const NOSUID_NODEV: Self = Self {
        nosuid: true,
        nodev: true,
        noexec: false,
    };
}

/// The backing filesystem of the writable layer.
pub const OVERLAY_BACKING: &str = "/run/kici-init/overlay";
/// The assembled root before `pivot_root`.
pub const NEW_ROOT: &str = "/run/kici-init/root";
/// API filesystems moved into the new root.
pub const MOVED_INTO_NEW_ROOT: [&str; 3] = ["/dev", "/proc", "/sys"];

fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    options: MountOptions,
    data: Option<&str>,
) -> Mount {
    Mount {
        source: source.to_owned(),
        target: PathBuf::from(target),
        fstype: fstype.to_owned(),
        options,
        data: data.map(str::to_owned),
        may_exist: false,
    }
}

/// Before anything else: devices, proc, sys, and a tmpfs for staging.
pub fn early() -> Vec<Mount> {
    let api = |m: Mount| Mount {
        may_exist: true,
        ..m
    };
    vec![
        api(mount(
            "devtmpfs",
            "/dev",
            "devtmpfs",
            MountOptions {
                nosuid: true,
                ..MountOptions::default()
            },
            Some("mode=0755"),
        )),
        api(mount("proc", "/proc", "proc", MountOptions::SECURE, None)),
        api(mount("sysfs", "/sys", "sysfs", MountOptions::SECURE, None)),
        mount(
            "tmpfs",
            "/run",
            "tmpfs",
            MountOptions::NOSUID_NODEV,
            Some("mode=0755"),
        ),
    ]
}

/// The writable root: the backing mount, then the overlay on [`NEW_ROOT`].
/// `None` when the root stays as it is.
pub fn overlay(source: &OverlaySource) -> Option<[Mount; 2]> {
    let backing = match source {
        OverlaySource::None => return None,
        OverlaySource::Tmpfs => mount(
            "tmpfs",
            OVERLAY_BACKING,
            "tmpfs",
            MountOptions::default(),
            Some("mode=0755"),
        ),
        OverlaySource::Block { device, fstype } => Mount {
            source: device.display().to_string(),
            ..mount("", OVERLAY_BACKING, fstype, MountOptions::default(), None)
        },
    };
    let data =
        format!("lowerdir=/,upperdir={OVERLAY_BACKING}/upper,workdir={OVERLAY_BACKING}/work");
    Some([
        backing,
        mount(
            "overlay",
            NEW_ROOT,
            "overlay",
            MountOptions::default(),
            Some(&data),
        ),
    ])
}

/// After the root is final: fresh `/run`, `/tmp`, `/dev/pts`, `/dev/shm`.
pub fn late() -> Vec<Mount> {
    vec![
        mount(
            "tmpfs",
            "/run",
            "tmpfs",
            MountOptions::NOSUID_NODEV,
            Some("mode=0755"),
        ),
        mount(
            "tmpfs",
            "/tmp",
            "tmpfs",
            MountOptions::NOSUID_NODEV,
            Some("mode=1777"),
        ),
        mount(
            "devpts",
            "/dev/pts",
            "devpts",
            MountOptions {
                nosuid: true,
                noexec: true,
                nodev: false,
            },
            Some("mode=0620,ptmxmode=0666"),
        ),
        mount(
            "tmpfs",
            "/dev/shm",
            "tmpfs",
            MountOptions::NOSUID_NODEV,
            Some("mode=1777"),
        ),
    ]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn early_mounts_devices_first_and_staging_on_run() {
        let early = early();
        let targets: Vec<_> = early.iter().map(|m| m.target.to_str().unwrap()).collect();
        assert_eq!(targets, ["/dev", "/proc", "/sys", "/run"]);
        // The kernel or an initramfs may have mounted the API filesystems.
        assert!(early[..3].iter().all(|m| m.may_exist));
        assert!(!early[3].may_exist);
        // Staging lives on the early /run tmpfs: no directories needed in the rootfs.
        assert!(OVERLAY_BACKING.starts_with("/run/") && NEW_ROOT.starts_with("/run/"));
    }

    #[test]
    fn overlay_stacks_the_drive_over_the_read_only_root() {
        let [backing, root] = overlay(&OverlaySource::Block {
            device: "/dev/vdb".into(),
            fstype: "ext4".into(),
        })
        .unwrap();
        assert_eq!(
            (backing.source.as_str(), backing.fstype.as_str()),
            ("/dev/vdb", "ext4")
        );
        assert_eq!(backing.target, PathBuf::from(OVERLAY_BACKING));
        assert_eq!(root.fstype, "overlay");
        assert_eq!(root.target, PathBuf::from(NEW_ROOT));
        assert_eq!(
            root.data.as_deref(),
            Some("lowerdir=/,upperdir=/run/kici-init/overlay/upper,workdir=/run/kici-init/overlay/work")
        );
        let [backing, _] = overlay(&OverlaySource::Tmpfs).unwrap();
        assert_eq!(backing.fstype, "tmpfs");
        assert!(overlay(&OverlaySource::None).is_none());
    }

    #[test]
    fn late_mounts_are_the_writable_scratch_areas() {
        let late = late();
        let targets: Vec<_> = late.iter().map(|m| m.target.to_str().unwrap()).collect();
        assert_eq!(targets, ["/run", "/tmp", "/dev/pts", "/dev/shm"]);
        assert_eq!(late[1].data.as_deref(), Some("mode=1777"));
        // Moved API filesystems are never mounted twice.
        assert!(late
            .iter()
            .all(|m| !MOVED_INTO_NEW_ROOT.contains(&m.target.to_str().unwrap())));
    }
}
