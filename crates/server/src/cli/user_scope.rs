//! `kici-scaler run` for users who are not root, on hosts where systemd owns
//! the cgroup tree.
//!
//! Such a user may create cgroups only inside a cgroup their user manager
//! delegated to them. `run` (with `--config`: it starts agents itself)
//! therefore re-executes itself, before anything else happens, as
//! `systemd-run --user --scope -p Delegate=yes -- <this binary> <same
//! arguments>`: the user manager creates a transient scope, delegates it,
//! and `systemd-run` execs `run` inside it — the same process id, so
//! signals, the terminal and the exit code are the caller's as before. There
//! `run` moves itself into `<scope>/daemon` and its agents get
//! `<scope>/agents/…`, with the containment and `cgroup.kill` guarantees a
//! root daemon has.
//!
//! It does so only when discovery says the user's cgroup is not delegated
//! ([`DiscoveryError::NotDelegated`]), `--cgroup-root` is not given, and the
//! marker variable is unset (it is set for the re-executed `run`, so a scope
//! that still is not delegated is reported, not re-entered forever). When
//! `systemd-run` is missing or cannot be executed, or no user manager is
//! reachable, `run` says why and goes on, and its bare-metal backend refuses
//! with the discovery's message, which says what to do.

use crate::cli::run::RunArgs;
use kici_bare_metal::cgroup::discover::{self, DiscoveryError};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;

/// Set for the `run` re-executed inside the scope.
pub const IN_SCOPE_ENV: &str = "KICI_SCALER_RUN_IN_SCOPE";

/// Should this `run` re-execute itself in a delegated user scope?
pub fn wanted(args: &RunArgs) -> bool {
    args.config.is_some()
        && args.backend.cgroup_root.is_none()
        && std::env::var_os(IN_SCOPE_ENV).is_none()
        && !rustix::process::geteuid().is_root()
        && matches!(
            discover::host_placement(None),
            Err(DiscoveryError::NotDelegated { .. })
        )
}

/// Replaces this process with `systemd-run --user --scope -p Delegate=yes
/// -- <argv>`. Returns only when that could not be done, with the reason.
pub fn reexec(argv: &[OsString]) -> String {
    // systemd-run would only fail with its own terse error: say why first.
    if !user_bus_reachable() {
        return format!(
            "no user service manager to ask (neither $DBUS_SESSION_BUS_ADDRESS nor \
             $XDG_RUNTIME_DIR/bus): log in through a session, or start your manager \
             without one with `loginctl enable-linger {}`",
            std::env::var("USER").unwrap_or_else(|_| "$USER".to_owned())
        );
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return format!("cannot find this executable: {e}"),
    };
    let mut cmd = std::process::Command::new("systemd-run");
    cmd.args([
        "--user",
        "--scope",
        "--quiet",
        "--collect",
        "-p",
        "Delegate=yes",
        "--",
    ])
    .arg(exe)
    .args(argv.iter().skip(1))
    .env(IN_SCOPE_ENV, "1");
    let err = cmd.exec();
    format!("cannot run systemd-run --user --scope -p Delegate=yes: {err}")
}

/// Is the user's service manager reachable over its bus?
fn user_bus_reachable() -> bool {
    if std::env::var_os("DBUS_SESSION_BUS_ADDRESS").is_some_and(|v| !v.is_empty()) {
        return true;
    }
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .is_some_and(|dir| dir.join("bus").exists())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    #[test]
    fn only_a_config_run_without_a_cgroup_root_is_a_candidate() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["run", "--labels", "linux"];
            argv.extend_from_slice(extra);
            argv.extend_from_slice(&["--", "true"]);
            Cli::try_parse_from(argv).unwrap().run
        };
        // As root (these tests) or on a hybrid host nothing is re-executed.
        assert!(!wanted(&parse(&["--config", "x.yaml"])));
        assert!(!wanted(&parse(&["--server", "http://127.0.0.1:1"])));
        assert!(!wanted(&parse(&[
            "--config",
            "x.yaml",
            "--cgroup-root",
            "/sys/fs/cgroup/x"
        ])));
    }
}
