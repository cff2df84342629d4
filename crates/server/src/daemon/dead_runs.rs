//! What a `kici-scaler run` killed with SIGKILL left behind, and sweeping it.
//!
//! `run` keeps its whole life in a temporary state dir
//! (`kici-scaler-run-*` in a private parent, see
//! [`crate::daemon::run_dirs`]) holding, like a daemon's, the
//! instance id its agents' resources are tagged with and the lock it holds
//! while it lives (the lock file names its pid). Beside them it keeps a
//! snapshot of the configuration it ran ([`RunDir::record`]), so that
//! whoever finds the dir later can bring up the same backends and tear down
//! what they own without guessing.
//!
//! A run dir whose lock can be taken belongs to a dead `run`: SIGKILL is
//! the one signal `run` cannot handle. [`sweep`] — called by the next `run`
//! and by `serve` at start-up — takes the lock, destroys every resource the
//! dead instance owns (agent processes and their cgroups, containers,
//! microVMs) through the same backends that made them, and removes the dir.
//! A dir whose lock is held is alive; a dir without an instance id is still
//! being created (the id is written only once the lock is held) and is left
//! alone.
//!
//! The sweep acts with this process's privileges on what it finds, so it
//! trusts a run dir only when it is ours beyond doubt: every parent
//! [`Location::all`] names is verified first, and a run dir is opened
//! without following a symbolic link and must be owned by us with mode 0700
//! ([`DirRule::Private`]); the files it reads or locks inside (instance id,
//! lock, configuration snapshot) must be regular files of ours, opened
//! without following a link. Anything else is left alone and logged.

use crate::daemon::backends::{BackendContext, BackendRegistry};
use crate::daemon::identity::{IdentityError, StateDir, INSTANCE_ID_FILE, LOCK_FILE};
use crate::daemon::run_dirs::{self, DirRule, Location, Parent, Untrusted};
use crate::daemon::settings::BackendTuning;
use kici_model::InstanceId;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use crate::daemon::run_dirs::RUN_DIR_PREFIX;
/// The configuration snapshot inside a run dir.
const CONFIG_DIR: &str = "config";
const MAIN_FILE: &str = "scalers.yaml";
const DROP_IN_DIR: &str = "scalers.d";
/// How long each dead agent gets to stop before it is killed.
const DESTROY_GRACE: Duration = Duration::from_secs(5);

/// A run dir, seen from the `run` that owns it.
pub struct RunDir;

impl RunDir {
    /// Keeps a copy of the configuration `run` is about to use in its state
    /// dir (the main file and the drop-ins as they are now).
    pub fn record(state_dir: &Path, main: &Path, drop_ins: Option<&Path>) -> io::Result<()> {
        let dir = state_dir.join(CONFIG_DIR);
        private_dir(&dir)?;
        std::fs::copy(main, dir.join(MAIN_FILE))?;
        if let Some(drop_ins) = drop_ins {
            let target = dir.join(DROP_IN_DIR);
            private_dir(&target)?;
            for entry in std::fs::read_dir(drop_ins)? {
                let entry = entry?;
                let path = entry.path();
                let yaml = matches!(
                    path.extension().and_then(|e| e.to_str()),
                    Some("yaml" | "yml")
                );
                if yaml && entry.file_type()?.is_file() {
                    std::fs::copy(&path, target.join(entry.file_name()))?;
                }
            }
        }
        Ok(())
    }
}

/// Creates a dir of the snapshot 0700, whatever the umask: the sweep
/// refuses one that others may write.
fn private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(dir)
}

/// What was swept of one dead `run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweptRun {
    pub dir: PathBuf,
    pub instance: InstanceId,
    /// Resources destroyed (agents and unattributed leftovers).
    pub resources: usize,
    /// What could not be done (the dir is kept for the next sweep then).
    pub errors: Vec<String>,
}

/// Sweeps every dead run dir of this user, wherever a `run` of this user
/// keeps them ([`Location::all`]). Never fails: what it cannot do is
/// reported per dir (and logged), and the next sweep tries again.
pub async fn sweep(tuning: &BackendTuning) -> Vec<SweptRun> {
    let mut swept = Vec::new();
    for location in Location::all() {
        match location.existing() {
            Ok(Some(parent)) => swept.extend(sweep_in(&parent, tuning).await),
            Ok(None) => {}
            Err(e) => tracing::warn!(
                dir = %location.parent().display(),
                error = %e,
                "not sweeping dead `kici-scaler run`s there: the dir cannot be trusted"
            ),
        }
    }
    swept
}

/// Sweeps every dead run dir in a verified parent.
pub async fn sweep_in(parent: &Parent, tuning: &BackendTuning) -> Vec<SweptRun> {
    let Ok(entries) = std::fs::read_dir(&parent.path) else {
        return Vec::new();
    };
    let mut swept = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with(RUN_DIR_PREFIX)) else {
            continue;
        };
        let dir = parent.path.join(name);
        match trusted_run_dir(parent, name) {
            Ok(true) => {}
            // Still being created: its id comes once its lock is held.
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(
                    dir = %dir.display(),
                    error = %e,
                    "not a run dir of ours; left alone"
                );
                continue;
            }
        }
        if let Some(run) = sweep_one(&dir, tuning).await {
            if run.errors.is_empty() {
                tracing::info!(
                    dir = %run.dir.display(),
                    instance = %run.instance,
                    resources = run.resources,
                    "swept what a killed `kici-scaler run` left behind"
                );
            } else {
                tracing::warn!(
                    dir = %run.dir.display(),
                    instance = %run.instance,
                    errors = %run.errors.join("; "),
                    "cannot sweep all that a killed `kici-scaler run` left behind; the next sweep tries again"
                );
            }
            swept.push(run);
        }
    }
    swept
}

/// Whether the run dir `name` in `parent` is ours to sweep: the dir itself
/// ([`DirRule::Private`]) and everything the sweep reads or writes in it.
/// `Ok(false)`: ours, but without an instance id yet.
fn trusted_run_dir(parent: &Parent, name: &str) -> Result<bool, Untrusted> {
    let path = parent.path.join(name);
    let dir = parent.open_run_dir(name)?;
    if run_dirs::open_file(&dir, &path, INSTANCE_ID_FILE)?.is_none() {
        return Ok(false);
    }
    run_dirs::open_file(&dir, &path, LOCK_FILE)?;
    let config_path = path.join(CONFIG_DIR);
    let Some(config) = open_subdir(&dir, &path, CONFIG_DIR)? else {
        return Ok(true);
    };
    run_dirs::open_file(&config, &config_path, MAIN_FILE)?;
    let drop_ins_path = config_path.join(DROP_IN_DIR);
    if let Some(drop_ins) = open_subdir(&config, &config_path, DROP_IN_DIR)? {
        // The fd was verified; the listing reads the same, private, dir.
        for entry in std::fs::read_dir(&drop_ins_path)
            .map_err(|source| Untrusted::Open {
                path: drop_ins_path.clone(),
                source,
            })?
            .flatten()
        {
            if let Some(file) = entry.file_name().to_str() {
                run_dirs::open_file(&drop_ins, &drop_ins_path, file)?;
            } else {
                return Err(Untrusted::WrongType {
                    path: entry.path(),
                    expected: "file with a UTF-8 name",
                });
            }
        }
    }
    Ok(true)
}

/// A subdirectory of a verified run dir, itself ours and not writable by
/// others (`None` if missing).
fn open_subdir(dir: &OwnedFd, dir_path: &Path, name: &str) -> Result<Option<OwnedFd>, Untrusted> {
    match run_dirs::open_dir_in(dir.as_fd(), dir_path, name, DirRule::Owned) {
        Ok(fd) => Ok(Some(fd)),
        Err(Untrusted::Open { source, .. }) if source.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `None`: the dir is alive (or not ours to judge).
async fn sweep_one(dir: &Path, tuning: &BackendTuning) -> Option<SweptRun> {
    let state = match StateDir::open(dir, false) {
        Ok(state) => state,
        Err(IdentityError::InUse { .. }) => return None,
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "not a run dir that can be swept");
            return None;
        }
    };
    let instance = state.instance_id();
    let mut run = SweptRun {
        dir: dir.to_owned(),
        instance,
        resources: 0,
        errors: Vec::new(),
    };
    match destroy_owned(&state, tuning).await {
        Ok(n) => run.resources = n,
        Err(errors) => run.errors = errors,
    }
    drop(state);
    if run.errors.is_empty() {
        // The bare-metal agents' work dirs are gone with their agents;
        // what held them goes too (empty, or nothing is removed).
        let work_root = tuning
            .bare_metal_work_dir
            .clone()
            .unwrap_or_else(|| kici_bare_metal::BareMetalOptions::default_work_root(dir));
        let _ = std::fs::remove_dir(work_root.join(instance.to_string()));
        let _ = std::fs::remove_dir(&work_root);
        if let Err(e) = std::fs::remove_dir_all(dir) {
            run.errors
                .push(format!("cannot remove {}: {e}", dir.display()));
        }
    }
    Some(run)
}

/// Brings up the backends of the dead run's configuration under its
/// instance id and destroys everything they list as owned by it.
async fn destroy_owned(state: &StateDir, tuning: &BackendTuning) -> Result<usize, Vec<String>> {
    let config_dir = state.path().join(CONFIG_DIR);
    let main = config_dir.join(MAIN_FILE);
    if !main.is_file() {
        // A run that died before it recorded its configuration had started
        // no agent yet.
        return Ok(0);
    }
    let drop_ins = config_dir.join(DROP_IN_DIR);
    let loaded =
        crate::daemon::stack::load_config(&main, drop_ins.is_dir().then_some(drop_ins.as_path()))
            .map_err(|e| vec![format!("its configuration snapshot: {e}")])?;
    let store = kici_store::open(
        &kici_store::StoreUrl::default_in(state.path()),
        state.instance_id(),
        kici_store::StoreOptions::default(),
    )
    .await
    .map_err(|e| vec![format!("its state store: {e}")])?;
    let ctx = BackendContext {
        config: None,
        instance: state.instance_id(),
        state_dir: state.path().to_path_buf(),
        store: Some(Arc::clone(&store)),
        tuning: tuning.clone(),
        // The dead instance never comes back: what it kept for itself goes.
        ephemeral: true,
        gateway_port: 0,
    };
    let result = destroy_with(&loaded.config, &ctx).await;
    // Closed before the dir (its database file with it) is removed.
    store.close().await;
    result
}

async fn destroy_with(
    config: &kici_model::Config,
    ctx: &BackendContext,
) -> Result<usize, Vec<String>> {
    let built = BackendRegistry::builtin().build(config, ctx).await?;
    let mut destroyed = 0;
    let mut errors = Vec::new();
    for backend in &built.backends {
        let owned = match backend.list_owned().await {
            Ok(owned) => owned,
            Err(e) => {
                errors.push(format!("{} backend: {e}", backend.kind()));
                continue;
            }
        };
        for resource in owned {
            let Some(agent) = resource.agent else {
                // Every backend names what it creates after the agent id;
                // what carries our owner marker without one was not made by
                // this version, and is left for an operator, as the
                // reconciler does.
                errors.push(format!(
                    "{} carries the dead run's owner marker but no agent id; not removed",
                    resource.handle.id
                ));
                continue;
            };
            let result = backend
                .destroy(&agent, Some(&resource.handle), DESTROY_GRACE)
                .await;
            match result {
                Ok(()) => destroyed += 1,
                Err(e) => errors.push(format!("{}: {e}", resource.handle.id)),
            }
        }
    }
    if errors.is_empty() {
        for hook in built.after_shutdown {
            hook();
        }
        Ok(destroyed)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The snapshot's dirs are private whatever the umask left, so the
    /// sweep (which refuses dirs others may write) can trust them.
    #[test]
    fn the_recorded_configuration_is_private() {
        let src = tempfile::tempdir().unwrap();
        let main = src.path().join("scalers.yaml");
        std::fs::write(&main, "version: 1\n").unwrap();
        let drop_ins = src.path().join("scalers.d");
        std::fs::create_dir(&drop_ins).unwrap();
        std::fs::write(drop_ins.join("10-x.yaml"), "version: 1\n").unwrap();
        let state = tempfile::tempdir().unwrap();

        RunDir::record(state.path(), &main, Some(&drop_ins)).unwrap();
        for dir in [CONFIG_DIR.to_owned(), format!("{CONFIG_DIR}/{DROP_IN_DIR}")] {
            let mode = std::fs::metadata(state.path().join(&dir))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "{dir}: {mode:o}");
        }
        assert!(state.path().join("config/scalers.d/10-x.yaml").is_file());
    }
}
