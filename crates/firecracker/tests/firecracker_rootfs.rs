//! `kici_firecracker::rootfs::build` with real static musl binaries (the
//! testkit's, as init and agent) and busybox-static, inspected with
//! `debugfs` and `e2fsck`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_firecracker::rootfs::{self, RootfsError, RootfsSpec, DEFAULT_BUSYBOX};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Static binaries standing in for the guest's init and agent: the
/// testkit's (built once per run and shared with every Firecracker test;
/// building the real guest binaries here too would double that nested
/// build). The real ones go through the same code in
/// `scripts/build-guest-musl.sh --rootfs` and `scripts/qemu-guest-smoke.sh`.
fn static_guest_binaries() -> (PathBuf, PathBuf) {
    let built = kici_testkit::fc::build_binaries().unwrap();
    (built.fc_sim, built.testkit_agent)
}

fn debugfs(image: &Path, request: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(request)
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs -R {request:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `Mode:` and the owner from `debugfs stat`.
fn mode_and_owner(image: &Path, path: &str) -> (String, String) {
    let stat = debugfs(image, &format!("stat {path}"));
    let mode = stat
        .split("Mode:")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no mode for {path}: {stat}"))
        .to_owned();
    let user = stat
        .split("User:")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no owner for {path}: {stat}"))
        .to_owned();
    (mode, user)
}

#[test]
fn firecracker_rootfs_holds_init_agent_busybox_and_etc_with_their_modes() {
    let (init, agent) = static_guest_binaries();
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("rootfs.ext4");
    let report = rootfs::build(&RootfsSpec {
        out: image.clone(),
        init: init.clone(),
        agent: agent.clone(),
        busybox: DEFAULT_BUSYBOX.into(),
        size_mib: 128,
    })
    .unwrap();
    assert_eq!(report.size_mib, 128);
    assert!(report.applets > 100, "{report:?}");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 128 * 1024 * 1024);
    // Nothing left beside the image but the image.
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("rootfs.ext4")]);

    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&image)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
    );

    let listing = debugfs(&image, "ls -l /");
    for name in [
        "init", "bin", "sbin", "dev", "proc", "sys", "run", "tmp", "etc", "root", "usr", "var",
    ] {
        assert!(
            listing.split_whitespace().any(|w| w == name),
            "/{name} missing:\n{listing}"
        );
    }
    for (path, mode) in [
        ("/init", "0755"),
        ("/usr/local/bin/kici-agent-lite", "0755"),
        ("/bin/busybox", "0755"),
        ("/etc/passwd", "0644"),
        ("/etc/resolv.conf", "0644"),
        ("/tmp", "01777"),
        ("/var/tmp", "01777"),
        ("/root", "0700"),
        ("/proc", "0555"),
        ("/dev", "0755"),
        ("/", "0755"),
    ] {
        assert_eq!(
            mode_and_owner(&image, path),
            (mode.to_owned(), "0".to_owned()),
            "{path}"
        );
    }
    // The binaries are byte-identical to their sources.
    for (inside, source) in [
        ("/init", init.as_path()),
        ("/usr/local/bin/kici-agent-lite", agent.as_path()),
        ("/bin/busybox", Path::new(DEFAULT_BUSYBOX)),
    ] {
        let dumped = dir.path().join("dumped");
        debugfs(&image, &format!("dump {inside} {}", dumped.display()));
        assert!(
            std::fs::read(&dumped).unwrap() == std::fs::read(source).unwrap(),
            "{inside} differs from {}",
            source.display()
        );
        std::fs::remove_file(&dumped).unwrap();
    }
    // Links: /sbin/init to our init (not busybox's), applets to busybox.
    let sbin_init = debugfs(&image, "stat /sbin/init");
    assert!(sbin_init.contains("Type: symlink"), "{sbin_init}");
    assert!(sbin_init.contains("\"/init\""), "{sbin_init}");
    for applet in ["/bin/sh", "/bin/mount", "/usr/bin/env"] {
        let stat = debugfs(&image, &format!("stat {applet}"));
        assert!(
            stat.contains("Type: symlink") && stat.contains("\"/bin/busybox\""),
            "{applet}: {stat}"
        );
    }
    assert_eq!(
        debugfs(&image, "cat /etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\n"
    );
}

#[test]
fn firecracker_rootfs_refuses_missing_dynamic_or_foreign_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("rootfs.ext4");
    let busybox = PathBuf::from(DEFAULT_BUSYBOX);
    let spec = |init: &Path, agent: &Path, busybox: &Path| RootfsSpec {
        out: image.clone(),
        init: init.to_owned(),
        agent: agent.to_owned(),
        busybox: busybox.to_owned(),
        size_mib: 64,
    };

    // This test binary is dynamically linked.
    let dynamic = std::env::current_exe().unwrap();
    let err = rootfs::build(&spec(&busybox, &dynamic, &busybox)).unwrap_err();
    assert!(
        matches!(&err, RootfsError::NotStatic { what: "agent", path } if *path == dynamic),
        "{err}"
    );
    assert!(err.to_string().contains("dynamically linked"), "{err}");

    let missing = dir.path().join("no-such-init");
    let err = rootfs::build(&spec(&missing, &busybox, &busybox)).unwrap_err();
    assert!(
        matches!(&err, RootfsError::Missing { what: "init", .. }),
        "{err}"
    );

    let script = dir.path().join("agent.sh");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    let err = rootfs::build(&spec(&busybox, &script, &busybox)).unwrap_err();
    assert!(
        matches!(&err, RootfsError::NotElf { what: "agent", .. }),
        "{err}"
    );

    // Too small for what it holds: refused before mkfs.
    let err = rootfs::build(&RootfsSpec {
        size_mib: 1,
        ..spec(&busybox, &busybox, &busybox)
    })
    .unwrap_err();
    assert!(matches!(&err, RootfsError::TooSmall { .. }), "{err}");

    // No image and no staging directory left behind by any refusal.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1); // agent.sh
}
