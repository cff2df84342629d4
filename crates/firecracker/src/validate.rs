//! What a Firecracker scaler entry needs on this host, checked before a
//! config is applied: binaries, images readable by the jailer user, a
//! non-root jailer user, a chroot base whose API socket paths fit
//! `sun_path`, sizes Firecracker accepts.

use crate::backend::FirecrackerBackend;
use crate::names::LayoutError;
use crate::vmconfig::MAX_VCPUS;
use kici_engine::{ProblemKind, ScalerProblem, ScalerProblems};
use kici_model::{BackendSettings, LabelSetBackend, ScalerEntry, ScalerName};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a scaler entry cannot run on this host's Firecracker backend.
#[derive(Debug, thiserror::Error)]
pub enum FirecrackerProblem {
    #[error("scaler {0:?} is not a Firecracker scaler")]
    NotFirecracker(ScalerName),
    /// The jail layout (chroot base, API socket path) does not fit.
    #[error("scaler {scaler:?}: {source}")]
    Layout {
        scaler: ScalerName,
        #[source]
        source: LayoutError,
    },
    #[error("{field} {} is not an executable file", path.display())]
    NotExecutable { field: String, path: PathBuf },
    #[error("{field} {} is not a file", path.display())]
    NotAFile { field: String, path: PathBuf },
    #[error("{field} {}: {source}", path.display())]
    Unreadable {
        field: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{field} {} is not readable by the jailer user {uid}:{gid} (mode {mode:o}); make it world- or group-readable — kici-scaler never changes an image it hard-links",
        path.display()
    )]
    NotReadableByJailer {
        field: String,
        path: PathBuf,
        uid: u32,
        gid: u32,
        mode: u32,
    },
    #[error(
        "scaler {0:?}: uid and gid must not be root (Firecracker runs as them inside the jail)"
    )]
    RootJailerUser(ScalerName),
    #[error("scaler {scaler:?}: vcpuCount {count} exceeds Firecracker's {MAX_VCPUS}")]
    TooManyVcpus { scaler: ScalerName, count: u32 },
    #[error("scaler {0:?} label set [{1}] has no rootfsPath")]
    NoRootfs(ScalerName, usize),
    #[error("scaler {0:?} label set [{1}]: vcpuCount must be 1..={MAX_VCPUS}")]
    LabelSetVcpus(ScalerName, usize),
    #[error("scaler {0:?} label set [{1}]: overlayDriveSizeMib must be positive")]
    OverlaySize(ScalerName, usize),
}

impl FirecrackerProblem {
    pub fn kind(&self) -> ProblemKind {
        match self {
            Self::NotExecutable { .. }
            | Self::NotAFile { .. }
            | Self::Unreadable { .. }
            | Self::NotReadableByJailer { .. } => ProblemKind::Host,
            Self::NotFirecracker(_)
            | Self::Layout { .. }
            | Self::RootJailerUser(_)
            | Self::TooManyVcpus { .. }
            | Self::NoRootfs(..)
            | Self::LabelSetVcpus(..)
            | Self::OverlaySize(..) => ProblemKind::Setting,
        }
    }
}

impl From<FirecrackerProblem> for ScalerProblem {
    fn from(p: FirecrackerProblem) -> Self {
        ScalerProblem::new(p.kind(), p)
    }
}

pub(crate) fn validate(
    backend: &FirecrackerBackend,
    scaler: &ScalerEntry,
) -> Result<(), ScalerProblems> {
    let name = &scaler.name;
    let BackendSettings::Firecracker(settings) = &scaler.backend else {
        return Err(ScalerProblem::from(FirecrackerProblem::NotFirecracker(name.clone())).into());
    };
    let mut errors = Vec::new();
    if let Err(source) = backend.layout_for(settings) {
        errors.push(FirecrackerProblem::Layout {
            scaler: name.clone(),
            source,
        });
    }
    executable(&settings.jailer_path, "jailerPath", &mut errors);
    executable(&settings.firecracker_path, "firecrackerPath", &mut errors);
    if settings.uid == 0 || settings.gid == 0 {
        errors.push(FirecrackerProblem::RootJailerUser(name.clone()));
    }
    readable(
        &settings.kernel_path,
        "kernelPath",
        settings.uid,
        settings.gid,
        &mut errors,
    );
    if scaler.vcpu_count > MAX_VCPUS {
        errors.push(FirecrackerProblem::TooManyVcpus {
            scaler: name.clone(),
            count: scaler.vcpu_count,
        });
    }
    for (i, set) in scaler.label_sets.iter().enumerate() {
        let LabelSetBackend::Firecracker(fc) = &set.backend else {
            errors.push(FirecrackerProblem::NoRootfs(name.clone(), i));
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
            errors.push(FirecrackerProblem::LabelSetVcpus(name.clone(), i));
        }
        if fc.overlay_drive_size_mib == Some(0) {
            errors.push(FirecrackerProblem::OverlaySize(name.clone(), i));
        }
    }
    ScalerProblems::check(errors.into_iter().map(Into::into).collect())
}

fn executable(path: &Path, field: &str, errors: &mut Vec<FirecrackerProblem>) {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
        Ok(_) => errors.push(FirecrackerProblem::NotExecutable {
            field: field.to_owned(),
            path: path.to_owned(),
        }),
        Err(source) => errors.push(FirecrackerProblem::Unreadable {
            field: field.to_owned(),
            path: path.to_owned(),
            source,
        }),
    }
}

/// The image is attached as is (never chowned: it is hard-linked), so the
/// jailer user must be able to read it through its mode.
fn readable(path: &Path, field: &str, uid: u32, gid: u32, errors: &mut Vec<FirecrackerProblem>) {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => errors.push(FirecrackerProblem::NotAFile {
            field: field.to_owned(),
            path: path.to_owned(),
        }),
        Ok(m) => {
            let mode = m.mode();
            let ok = mode & 0o004 != 0
                || (m.gid() == gid && mode & 0o040 != 0)
                || (m.uid() == uid && mode & 0o400 != 0);
            if !ok {
                errors.push(FirecrackerProblem::NotReadableByJailer {
                    field: field.to_owned(),
                    path: path.to_owned(),
                    uid,
                    gid,
                    mode: mode & 0o7777,
                });
            }
        }
        Err(source) => errors.push(FirecrackerProblem::Unreadable {
            field: field.to_owned(),
            path: path.to_owned(),
            source,
        }),
    }
}
