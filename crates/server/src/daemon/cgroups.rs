//! Where this process puts its bare-metal agents' cgroups, for `serve` and
//! `run` alike: discovery ([`kici_bare_metal::cgroup::discover`]), then, when
//! the process runs in a cgroup systemd delegated to it, the move into its
//! own leaf (`<own>/daemon`), which cgroup v2 requires before controllers
//! can be enabled for the agents' subtree (`<own>/agents`).

use kici_bare_metal::cgroup::discover::{self, DiscoveryError, Placement};
use std::path::Path;

/// Discovers the placement (`override_root` is `--cgroup-root`) and enters
/// the daemon leaf where there is one. The outer error (the move failed) is
/// fatal; the inner one (no cgroup v2 place for agents on this host) is the
/// bare-metal backend's to report, only if a bare-metal scaler needs it.
pub fn place_self(
    override_root: Option<&Path>,
) -> Result<Result<Placement, DiscoveryError>, String> {
    let placement = discover::host_placement(override_root);
    match &placement {
        Ok(p) => {
            let left = p.enter_daemon_leaf().map_err(|e| e.to_string())?;
            tracing::info!(
                case = %p.case,
                agents = %p.tree_dir().display(),
                daemon_cgroup = p.daemon_leaf.as_ref().map(|l| l.display().to_string()),
                reason = %p.reason,
                "cgroup placement"
            );
            if let Some(advice) = &p.advice {
                tracing::warn!(advice = %advice, "cgroup placement");
            }
            if !left.is_empty() {
                tracing::warn!(
                    pids = ?left,
                    cgroup = %p.top.display(),
                    "other processes remain in the delegated cgroup: cgroup v2 enables no \
                     controller for the agents while they are there (start kici-scaler \
                     directly, or exec it from a wrapper)"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "no cgroup v2 placement for bare-metal agents"),
    }
    Ok(placement)
}
