//! Where a bare-metal label set's `binaryPath` points.
//!
//! `binaryPath` may be written three ways, resolved once when the
//! configuration is loaded (start-up, `run`, every reload), before any
//! backend sees it:
//!
//! - an absolute path: used as is;
//! - a relative path with a `/` (`target/debug/kici-agent-lite`): relative
//!   to kici-scaler's current directory, as a shell would read it;
//! - a bare name (`kici-agent-lite`): looked up on `PATH`, then in the
//!   directory of the running `kici-scaler` executable — so a `cargo build`
//!   of the workspace, which puts both binaries side by side, works without
//!   installing anything.
//!
//! A bare name found nowhere is a configuration error naming both places
//! searched, reported like every other start-up problem.

use kici_model::{Config, LabelSetBackend};
use rustix::fs::Access;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Where bare names are searched.
#[derive(Debug, Clone, Default)]
pub struct SearchPath {
    /// `PATH`'s entries, in order.
    pub path: Vec<PathBuf>,
    /// The directory holding the running `kici-scaler`.
    pub exe_dir: Option<PathBuf>,
    /// Relative paths with a `/` are joined to this.
    pub cwd: Option<PathBuf>,
}

impl SearchPath {
    /// This process's `PATH`, executable directory and current directory.
    pub fn current() -> Self {
        Self::from_parts(
            std::env::var_os("PATH"),
            std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(Path::to_path_buf)),
            std::env::current_dir().ok(),
        )
    }

    pub fn from_parts(
        path: Option<OsString>,
        exe_dir: Option<PathBuf>,
        cwd: Option<PathBuf>,
    ) -> Self {
        Self {
            path: path
                .map(|p| {
                    std::env::split_paths(&p)
                        .filter(|d| !d.as_os_str().is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            exe_dir,
            cwd,
        }
    }

    /// The file `binary` names, or why none.
    pub fn resolve(&self, binary: &Path) -> Result<PathBuf, String> {
        if binary.is_absolute() {
            return Ok(binary.to_path_buf());
        }
        let is_bare = binary.components().count() == 1
            && !binary.as_os_str().as_encoded_bytes().contains(&b'/');
        if !is_bare {
            return match &self.cwd {
                Some(cwd) => Ok(cwd.join(binary)),
                None => Ok(binary.to_path_buf()),
            };
        }
        let candidates = self.path.iter().chain(self.exe_dir.iter());
        for dir in candidates {
            let candidate = dir.join(binary);
            if is_executable_file(&candidate) {
                return Ok(candidate);
            }
        }
        let path: Vec<String> = self.path.iter().map(|d| d.display().to_string()).collect();
        Err(format!(
            "{}: not found on PATH ({}) nor next to kici-scaler ({}); give an absolute path, or build it (cargo build --workspace)",
            binary.display(),
            if path.is_empty() {
                "empty".to_owned()
            } else {
                path.join(":")
            },
            self.exe_dir
                .as_ref()
                .map_or_else(|| "unknown".to_owned(), |d| d.display().to_string()),
        ))
    }
}

fn is_executable_file(path: &Path) -> bool {
    path.is_file() && rustix::fs::access(path, Access::EXEC_OK).is_ok()
}

/// Rewrites every bare-metal `binaryPath` of `config` to the file it names.
/// Every problem is returned, in the `file:line:col: scalers[name=…]:
/// labelSets[i].binaryPath: …` form of the other start-up errors.
pub fn resolve_all(config: &mut Config, search: &SearchPath) -> Result<(), Vec<String>> {
    let mut errors = Vec::new();
    for scaler in &mut config.scalers {
        for (i, label_set) in scaler.label_sets.iter_mut().enumerate() {
            let LabelSetBackend::BareMetal { binary_path } = &mut label_set.backend else {
                continue;
            };
            match search.resolve(binary_path) {
                Ok(found) => *binary_path = found,
                Err(why) => errors.push(format!(
                    "{}: scalers[name={}]: labelSets[{i}].binaryPath: {why}",
                    label_set.origin, scaler.name
                )),
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn executable(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    #[test]
    fn bare_names_search_path_then_the_executable_directory() {
        let root = tempfile::tempdir().unwrap();
        let (a, b, exe) = (
            root.path().join("a"),
            root.path().join("b"),
            root.path().join("exe"),
        );
        for d in [&a, &b, &exe] {
            std::fs::create_dir(d).unwrap();
        }
        let in_b = executable(&b, "agent");
        let beside = executable(&exe, "agent");
        let only_beside = executable(&exe, "other");
        // Not executable: skipped.
        std::fs::write(a.join("agent"), "").unwrap();
        let search = SearchPath::from_parts(
            Some(std::env::join_paths([&a, &b]).unwrap()),
            Some(exe.clone()),
            Some(root.path().to_path_buf()),
        );
        assert_eq!(search.resolve(Path::new("agent")).unwrap(), in_b);
        assert_eq!(search.resolve(Path::new("other")).unwrap(), only_beside);
        let no_path = SearchPath::from_parts(None, Some(exe.clone()), None);
        assert_eq!(no_path.resolve(Path::new("agent")).unwrap(), beside);
        let err = search.resolve(Path::new("missing")).unwrap_err();
        assert!(err.contains("not found on PATH"), "{err}");
        assert!(err.contains(&exe.display().to_string()), "{err}");
    }

    #[test]
    fn paths_are_absolute_or_relative_to_the_current_directory() {
        let search = SearchPath::from_parts(None, None, Some(PathBuf::from("/srv/kici")));
        assert_eq!(
            search.resolve(Path::new("/opt/agent")).unwrap(),
            PathBuf::from("/opt/agent")
        );
        assert_eq!(
            search
                .resolve(Path::new("target/debug/kici-agent-lite"))
                .unwrap(),
            PathBuf::from("/srv/kici/target/debug/kici-agent-lite")
        );
        assert_eq!(
            search.resolve(Path::new("./agent")).unwrap(),
            PathBuf::from("/srv/kici/./agent")
        );
    }
}
