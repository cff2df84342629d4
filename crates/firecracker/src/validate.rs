//! What a Firecracker scaler entry needs on this host, checked before a
//! config is applied: binaries, images readable by the jailer user, a
//! non-root jailer user, a chroot base whose API socket paths fit
//! `sun_path`, sizes Firecracker accepts.

use crate::backend::FirecrackerBackend;
use crate::vmconfig::MAX_VCPUS;
use kici_model::{BackendSettings, LabelSetBackend, ScalerEntry};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

pub(crate) fn validate(
    backend: &FirecrackerBackend,
    scaler: &ScalerEntry,
) -> Result<(), Vec<String>> {
    let name = &scaler.name;
    let BackendSettings::Firecracker(settings) = &scaler.backend else {
        return Err(vec![format!("scaler {name:?} is not a Firecracker scaler")]);
    };
    let mut errors = Vec::new();
    match backend.layout_for(settings) {
        Ok(_) => {}
        Err(e) => errors.push(format!("scaler {name:?}: {e}")),
    }
    executable(&settings.jailer_path, "jailerPath", &mut errors);
    executable(&settings.firecracker_path, "firecrackerPath", &mut errors);
    if settings.uid == 0 || settings.gid == 0 {
        errors.push(format!(
            "scaler {name:?}: uid and gid must not be root (Firecracker runs as them inside the jail)"
        ));
    }
    readable(
        &settings.kernel_path,
        "kernelPath",
        settings.uid,
        settings.gid,
        &mut errors,
    );
    if scaler.vcpu_count > MAX_VCPUS {
        errors.push(format!(
            "scaler {name:?}: vcpuCount {} exceeds Firecracker's {MAX_VCPUS}",
            scaler.vcpu_count
        ));
    }
    for (i, set) in scaler.label_sets.iter().enumerate() {
        let LabelSetBackend::Firecracker(fc) = &set.backend else {
            errors.push(format!("scaler {name:?} label set [{i}] has no rootfsPath"));
            continue;
        };
        readable(
            &fc.rootfs_path,
            &format!("label set [{i}] rootfsPath"),
            settings.uid,
            settings.gid,
            &mut errors,
        );
        if let Some(kernel) = &fc.kernel_path {
            readable(
                kernel,
                &format!("label set [{i}] kernelPath"),
                settings.uid,
                settings.gid,
                &mut errors,
            );
        }
        if fc.vcpu_count.is_some_and(|v| v == 0 || v > MAX_VCPUS) {
            errors.push(format!(
                "scaler {name:?} label set [{i}]: vcpuCount must be 1..={MAX_VCPUS}"
            ));
        }
        if fc.overlay_drive_size_mib == Some(0) {
            errors.push(format!(
                "scaler {name:?} label set [{i}]: overlayDriveSizeMib must be positive"
            ));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn executable(path: &Path, field: &str, errors: &mut Vec<String>) {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
        Ok(_) => errors.push(format!(
            "{field} {} is not an executable file",
            path.display()
        )),
        Err(e) => errors.push(format!("{field} {}: {e}", path.display())),
    }
}

/// The image is attached as is (never chowned: it is hard-linked), so the
/// jailer user must be able to read it through its mode.
fn readable(path: &Path, field: &str, uid: u32, gid: u32, errors: &mut Vec<String>) {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => errors.push(format!("{field} {} is not a file", path.display())),
        Ok(m) => {
            let mode = m.mode();
            let ok = mode & 0o004 != 0
                || (m.gid() == gid && mode & 0o040 != 0)
                || (m.uid() == uid && mode & 0o400 != 0);
            if !ok {
                errors.push(format!(
                    "{field} {} is not readable by the jailer user {uid}:{gid} (mode {:o}); make it world- or group-readable — kici-scaler never changes an image it hard-links",
                    path.display(),
                    mode & 0o7777
                ));
            }
        }
        Err(e) => errors.push(format!("{field} {}: {e}", path.display())),
    }
}
