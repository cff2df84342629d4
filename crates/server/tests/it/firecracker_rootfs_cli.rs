//! `kici-scaler firecracker rootfs`: the real binary writes an ext4 image
//! from static inputs (busybox-static stands in for all three here; the
//! layout itself is checked in kici-firecracker's `firecracker_rootfs`
//! test) and refuses a dynamically linked input with a clear message.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");
const BUSYBOX: &str = "/bin/busybox";

#[test]
fn firecracker_rootfs_cli_builds_an_image_and_refuses_a_dynamic_agent() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("rootfs.ext4");
    let out = Command::new(BIN)
        .args(["firecracker", "rootfs", "--out"])
        .arg(&image)
        .args(["--agent", BUSYBOX, "--init", BUSYBOX, "--busybox", BUSYBOX])
        .args(["--size-mib", "32"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with(&format!("rootfs {}: 32 MiB", image.display())),
        "{stdout}"
    );
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 32 * 1024 * 1024);
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&image)
        .output()
        .unwrap();
    assert!(fsck.status.success());

    let dynamic = dir.path().join("dynamic.ext4");
    let out = Command::new(BIN)
        .args(["firecracker", "rootfs", "--out"])
        .arg(&dynamic)
        .args(["--agent", BIN, "--init", BUSYBOX, "--busybox", BUSYBOX])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rootfs: agent") && stderr.contains("dynamically linked"),
        "{stderr}"
    );
    assert!(!dynamic.exists());
}
