//! Where the ledger lives: an explicit directory, else
//! `KICI_MACHINE_LEDGER_DIR`, else the first creatable and writable default.

use super::LedgerError;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Upstream's variable, honoured as is: every process that shares pools on a
/// host must resolve the same directory.
pub const LEDGER_DIR_ENV: &str = "KICI_MACHINE_LEDGER_DIR";

/// The system-wide default (first candidate).
pub const SYSTEM_LEDGER_DIR: &str = "/var/lib/kici/scaler-ledger";

/// Resolves the ledger directory from the real environment.
pub fn resolve_dir(explicit: Option<&Path>) -> Result<PathBuf, LedgerError> {
    let env = |k: &str| std::env::var_os(k);
    resolve_dir_with(explicit, env, &default_candidates(env))
}

/// The fallback candidates, in order: the system directory, the XDG state
/// directory, the temporary directory.
pub(crate) fn default_candidates(env: impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut out = vec![PathBuf::from(SYSTEM_LEDGER_DIR)];
    let state_home = env("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            env("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".local/state"))
        });
    if let Some(state_home) = state_home {
        out.push(state_home.join("kici/scaler-ledger"));
    }
    out.push(std::env::temp_dir().join("kici-scaler-ledger"));
    out
}

/// [`resolve_dir`] with the environment and the candidates injected (tests
/// must not create `/var/lib/kici`).
pub(crate) fn resolve_dir_with(
    explicit: Option<&Path>,
    env: impl Fn(&str) -> Option<OsString>,
    candidates: &[PathBuf],
) -> Result<PathBuf, LedgerError> {
    let chosen = explicit.map(Path::to_path_buf).or_else(|| {
        env(LEDGER_DIR_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    if let Some(dir) = chosen {
        // Named by the operator: it must work, no silent fallback (two
        // processes falling back differently would stop sharing the pool).
        return usable(&dir)
            .map(|()| dir.clone())
            .map_err(|source| LedgerError::Dir { path: dir, source });
    }
    let mut tried = Vec::new();
    for dir in candidates {
        match usable(dir) {
            Ok(()) => return Ok(dir.clone()),
            Err(e) => tried.push(format!("{}: {e}", dir.display())),
        }
    }
    Err(LedgerError::NoUsableDir { tried })
}

/// Creates `dir` (and parents) and proves it writable with a probe file.
fn usable(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&probe)?;
    fs::remove_file(&probe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_then_env_then_first_usable_candidate() {
        let tmp = tempfile::tempdir().unwrap();
        let explicit = tmp.path().join("explicit");
        let from_env = tmp.path().join("env");
        let env_set = |k: &str| (k == LEDGER_DIR_ENV).then(|| from_env.clone().into_os_string());
        let no_env = |_: &str| None;

        assert_eq!(
            resolve_dir_with(Some(&explicit), env_set, &[]).unwrap(),
            explicit
        );
        assert!(explicit.is_dir());
        assert_eq!(resolve_dir_with(None, env_set, &[]).unwrap(), from_env);

        // A path below a regular file can never be created.
        let file = tmp.path().join("a-file");
        fs::write(&file, b"x").unwrap();
        let blocked = file.join("ledger");
        let fallback = tmp.path().join("fallback");
        assert_eq!(
            resolve_dir_with(None, no_env, &[blocked.clone(), fallback.clone()]).unwrap(),
            fallback
        );
        let err = resolve_dir_with(None, no_env, std::slice::from_ref(&blocked)).unwrap_err();
        assert!(
            matches!(&err, LedgerError::NoUsableDir { tried } if tried.len() == 1),
            "{err}"
        );
        // An unusable explicit dir is an error naming it, not a fallback.
        let err = resolve_dir_with(Some(&blocked), no_env, &[fallback]).unwrap_err();
        assert!(err.to_string().contains("a-file/ledger"), "{err}");
        // No probe file is left behind.
        assert_eq!(fs::read_dir(&explicit).unwrap().count(), 0);
    }

    #[test]
    fn candidates_follow_xdg_then_home() {
        let xdg = |k: &str| match k {
            "XDG_STATE_HOME" => Some("/x/state".into()),
            "HOME" => Some("/home/u".into()),
            _ => None,
        };
        let c = default_candidates(xdg);
        assert_eq!(c[0], Path::new(SYSTEM_LEDGER_DIR));
        assert_eq!(c[1], Path::new("/x/state/kici/scaler-ledger"));
        assert_eq!(c[2], std::env::temp_dir().join("kici-scaler-ledger"));
        let home = |k: &str| (k == "HOME").then(|| "/home/u".into());
        assert_eq!(
            default_candidates(home)[1],
            Path::new("/home/u/.local/state/kici/scaler-ledger")
        );
        assert_eq!(default_candidates(|_| None).len(), 2);
    }
}
