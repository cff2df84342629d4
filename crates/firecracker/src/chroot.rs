//! A VM's directory: owner marker, jail root, images, overlay, log files.
//!
//! ```text
//! <chrootBaseDir>/<exec name>/<agent id>/     ours (root, 0700)
//! ├── .kici-owner                             kici-scaler:<instance>:<agent id>
//! └── root/                                   the jail (jailer uid:gid, 0700)
//!     ├── kernel, rootfs.ext4                 hard links (copies across filesystems)
//!     ├── overlay.ext4                        sparse ext4, jailer uid:gid, 0600
//!     ├── serial-console.log                  Firecracker's stdout+stderr (ours)
//!     ├── vmm.log, metrics.json               Firecracker's logger/metrics (jailer uid:gid)
//!     └── (jailer) firecracker, firecracker.pid, dev/, run/firecracker.socket
//! ```
//!
//! The images are never chowned or chmodded: a hard link shares the inode,
//! so that would change the golden image every later VM boots from
//! (docs/deviations.md, D-fc-golden-images). They are attached read-only and must be readable by the
//! jailer user as they are.

use crate::names::{
    JailLayout, KERNEL_FILE, METRICS_FILE, OVERLAY_FILE, ROOTFS_FILE, SERIAL_LOG, VMM_LOG,
};
use kici_model::AgentId;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ChrootError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("mkfs.ext4 {}: {detail}", path.display())]
    Mkfs { path: PathBuf, detail: String },
    #[error("the VM directory {} already exists (owned by: {owner})", path.display())]
    Exists { path: PathBuf, owner: String },
    #[error(
        "only {} MiB free under {} (at least {} MiB needed: each VM's overlay grows as its job writes)",
        free / (1024 * 1024), path.display(), needed / (1024 * 1024)
    )]
    LowSpace {
        path: PathBuf,
        free: u64,
        needed: u64,
    },
}

/// Upstream's guard: below this much free space under the chroot base a
/// spawn is refused instead of letting overlays fill the disk mid-job.
pub const MIN_FREE_BYTES: u64 = 1 << 30;

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> ChrootError {
    let path = path.to_owned();
    move |source| ChrootError::Io { what, path, source }
}

/// Creates `<vm dir>` and its owner marker (the first thing a spawn does,
/// so every TAP and lease of ours has a dated marker until destroy's very
/// last step).
pub fn create_vm_dir(layout: &JailLayout, agent: &AgentId, tag: &str) -> Result<(), ChrootError> {
    let exec_dir = layout.exec_dir();
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(exec_dir)
        .map_err(io_err("cannot create", exec_dir))?;
    let dir = layout.vm_dir(agent);
    match fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let owner = fs::read_to_string(layout.owner_marker(agent))
                .unwrap_or_else(|_| "no owner marker".into());
            return Err(ChrootError::Exists {
                path: dir,
                owner: owner.trim().to_owned(),
            });
        }
        Err(e) => return Err(io_err("cannot create", &dir)(e)),
    }
    let marker = layout.owner_marker(agent);
    fs::write(&marker, format!("{tag}\n")).map_err(io_err("cannot write", &marker))
}

/// Removes the VM's whole directory; nothing there is not a no-op.
pub fn remove_vm_dir(layout: &JailLayout, agent: &AgentId) -> Result<(), ChrootError> {
    let dir = layout.vm_dir(agent);
    match fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("cannot remove", &dir)(e)),
    }
}

/// What goes into the jail before the jailer runs.
#[derive(Debug, Clone)]
pub struct JailFiles<'a> {
    pub kernel: &'a Path,
    pub rootfs: &'a Path,
    pub overlay_mib: u32,
    pub uid: u32,
    pub gid: u32,
    pub mkfs_timeout: Duration,
    /// [`MIN_FREE_BYTES`] in the backend; [`prepare_root`] refuses below it.
    pub min_free_bytes: u64,
}

/// How an image got into the jail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    HardLinked,
    Copied,
}

/// Creates `root/` with the images, the log files and the jail-owned files.
pub fn prepare_root(
    layout: &JailLayout,
    agent: &AgentId,
    files: &JailFiles<'_>,
) -> Result<(), ChrootError> {
    let dir = layout.vm_dir(agent);
    let st = rustix::fs::statvfs(&dir).map_err(|e| io_err("cannot statvfs", &dir)(e.into()))?;
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    if free < files.min_free_bytes {
        return Err(ChrootError::LowSpace {
            path: dir,
            free,
            needed: files.min_free_bytes,
        });
    }
    let root = layout.root(agent);
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&root)
        .map_err(io_err("cannot create", &root))?;
    chown(&root, files.uid, files.gid)?;
    link_or_copy(files.kernel, &root.join(KERNEL_FILE))?;
    link_or_copy(files.rootfs, &root.join(ROOTFS_FILE))?;
    // Firecracker refuses to create its logger and metrics targets.
    for name in [VMM_LOG, METRICS_FILE] {
        let path = root.join(name);
        create_private(&path)?;
        chown(&path, files.uid, files.gid)?;
    }
    create_private(&root.join(SERIAL_LOG))?;
    Ok(())
}

/// Formats the sparse overlay (a separate step: it is the slow one).
pub async fn create_overlay(
    layout: &JailLayout,
    agent: &AgentId,
    files: &JailFiles<'_>,
) -> Result<(), ChrootError> {
    let path = layout.in_root(agent, OVERLAY_FILE);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_err("cannot create", &path))?;
    file.set_len(u64::from(files.overlay_mib) * 1024 * 1024)
        .map_err(io_err("cannot size", &path))?;
    drop(file);
    let mut mkfs = tokio::process::Command::new("mkfs.ext4");
    mkfs.args(["-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1"])
        .arg(&path)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(files.mkfs_timeout, mkfs.output())
        .await
        .map_err(|_| ChrootError::Mkfs {
            path: path.clone(),
            detail: format!("timed out after {:?}", files.mkfs_timeout),
        })?
        .map_err(|e| ChrootError::Mkfs {
            path: path.clone(),
            detail: e.to_string(),
        })?;
    if !output.status.success() {
        return Err(ChrootError::Mkfs {
            path,
            detail: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    chown(&path, files.uid, files.gid)
}

/// Opens the serial log once with `O_APPEND` for Firecracker's stdout and
/// stderr (one open file description: neither overwrites the other, and
/// the tailer may truncate it to bound its size).
pub fn open_serial(layout: &JailLayout, agent: &AgentId) -> Result<File, ChrootError> {
    let path = layout.in_root(agent, SERIAL_LOG);
    OpenOptions::new()
        .append(true)
        .open(&path)
        .map_err(io_err("cannot open", &path))
}

/// The hard link, or a copy when the image is on another filesystem.
pub fn link_or_copy(from: &Path, to: &Path) -> Result<Placed, ChrootError> {
    match fs::hard_link(from, to) {
        Ok(()) => Ok(Placed::HardLinked),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            fs::copy(from, to).map_err(io_err("cannot copy", from))?;
            Ok(Placed::Copied)
        }
        Err(e) => Err(io_err("cannot link", from)(e)),
    }
}

fn create_private(path: &Path) -> Result<(), ChrootError> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map(drop)
        .map_err(io_err("cannot create", path))
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), ChrootError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_err("cannot chown", path))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_model::ScalerType;
    use std::os::unix::fs::MetadataExt;

    #[tokio::test]
    async fn firecracker_jail_links_images_without_touching_them_and_formats_a_sparse_overlay() {
        let dir = tempfile::tempdir().unwrap();
        let images = dir.path().join("images");
        fs::create_dir(&images).unwrap();
        let kernel = images.join("vmlinux");
        let rootfs = images.join("rootfs.ext4");
        fs::write(&kernel, b"kernel").unwrap();
        fs::write(&rootfs, b"rootfs").unwrap();
        let before = fs::metadata(&rootfs).unwrap();

        let base = dir.path().join("jail");
        let layout = JailLayout::new(&base, "firecracker".into()).unwrap();
        let agent = AgentId::new(ScalerType::Firecracker, [1, 2, 3, 4]);
        create_vm_dir(
            &layout,
            &agent,
            "kici-scaler:0a0b0c0d:scaler-firecracker-01020304",
        )
        .unwrap();
        assert!(matches!(
            create_vm_dir(&layout, &agent, "x"),
            Err(ChrootError::Exists { ref owner, .. }) if owner.starts_with("kici-scaler:0a0b0c0d")
        ));
        let files = JailFiles {
            kernel: &kernel,
            rootfs: &rootfs,
            overlay_mib: 64,
            uid: 10_000,
            gid: 10_001,
            mkfs_timeout: Duration::from_secs(60),
            min_free_bytes: 0,
        };
        // Upstream's guard, made impossible to meet: refused, nothing made.
        let greedy = JailFiles {
            min_free_bytes: u64::MAX,
            ..files.clone()
        };
        let refused = prepare_root(&layout, &agent, &greedy).unwrap_err();
        assert!(matches!(refused, ChrootError::LowSpace { .. }), "{refused}");
        assert!(refused.to_string().contains("MiB free"), "{refused}");
        assert!(!layout.root(&agent).exists());
        prepare_root(&layout, &agent, &files).unwrap();
        create_overlay(&layout, &agent, &files).await.unwrap();

        let root = layout.root(&agent);
        let linked = fs::metadata(root.join(ROOTFS_FILE)).unwrap();
        assert_eq!(linked.ino(), before.ino(), "hard link");
        let after = fs::metadata(&rootfs).unwrap();
        assert_eq!(
            (after.uid(), after.gid(), after.mode()),
            (before.uid(), before.gid(), before.mode())
        );
        assert_eq!(fs::metadata(&root).unwrap().uid(), 10_000);
        let overlay = fs::metadata(root.join(OVERLAY_FILE)).unwrap();
        assert_eq!((overlay.uid(), overlay.gid()), (10_000, 10_001));
        assert_eq!(overlay.len(), 64 * 1024 * 1024);
        assert!(overlay.blocks() * 512 < overlay.len() / 4, "sparse");
        let magic = {
            use std::io::{Read, Seek, SeekFrom};
            let mut f = File::open(root.join(OVERLAY_FILE)).unwrap();
            f.seek(SeekFrom::Start(1024 + 0x38)).unwrap();
            let mut m = [0u8; 2];
            f.read_exact(&mut m).unwrap();
            u16::from_le_bytes(m)
        };
        assert_eq!(magic, 0xEF53, "ext4 superblock");
        assert_eq!(fs::metadata(root.join(VMM_LOG)).unwrap().uid(), 10_000);
        assert_eq!(fs::metadata(root.join(SERIAL_LOG)).unwrap().uid(), 0);

        remove_vm_dir(&layout, &agent).unwrap();
        assert!(!layout.vm_dir(&agent).exists());
        remove_vm_dir(&layout, &agent).unwrap();
        assert_eq!(fs::read(&rootfs).unwrap(), b"rootfs");
    }

    #[test]
    fn firecracker_link_or_copy_copies_across_filesystems() {
        // /dev/shm is tmpfs; the temp dir is usually not.
        let src_dir = tempfile::tempdir().unwrap();
        let Ok(dst_dir) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        let src = src_dir.path().join("img");
        fs::write(&src, b"image").unwrap();
        let same_fs = fs::metadata(src_dir.path()).unwrap().dev()
            == fs::metadata(dst_dir.path()).unwrap().dev();
        let placed = link_or_copy(&src, &dst_dir.path().join("img")).unwrap();
        assert_eq!(
            placed,
            if same_fs {
                Placed::HardLinked
            } else {
                Placed::Copied
            }
        );
        assert_eq!(fs::read(dst_dir.path().join("img")).unwrap(), b"image");
        assert!(matches!(
            link_or_copy(&src_dir.path().join("missing"), &dst_dir.path().join("x")),
            Err(ChrootError::Io {
                what: "cannot link",
                ..
            })
        ));
    }
}
