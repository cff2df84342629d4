//! Named failpoints of the bare-metal backend (docs/ARCHITECTURE.md), each placed right
//! after its step's side effect, so a crash there leaves exactly that side
//! effect behind, and `return` there proves the step's caller releases what
//! was taken. No-ops unless the crate is built with `--features failpoints`.

/// The agent directory exists (log files, `context`).
pub const SPAWN_DIR: &str = "kici_bare_metal::spawn::dir";
/// The tracking cgroup exists (no limits yet).
pub const SPAWN_CGROUP: &str = "kici_bare_metal::spawn::cgroup";
/// Limits are written (v2 files, or v1 leaves created and written).
pub const SPAWN_LIMITS: &str = "kici_bare_metal::spawn::limits";
/// The agent process runs in its cgroups (not yet recorded or watched).
pub const SPAWN_PROCESS: &str = "kici_bare_metal::spawn::process";
/// The `process` marker (`pid:<pid>:<start>`) is written.
pub const SPAWN_MARKER: &str = "kici_bare_metal::spawn::marker";
/// The exit watch and log tailer run; the agent is tracked.
pub const SPAWN_WATCH: &str = "kici_bare_metal::spawn::watch";
/// SIGTERM was sent to the process group and every cgroup member.
pub const DESTROY_SIGNAL: &str = "kici_bare_metal::destroy::signal";
/// Nothing lives in the agent's cgroup any more.
pub const DESTROY_KILL: &str = "kici_bare_metal::destroy::kill";
/// The agent's cgroups (and emptied parents) are removed.
pub const DESTROY_CGROUP: &str = "kici_bare_metal::destroy::cgroup";
/// The agent directory is gone (logs retired).
pub const DESTROY_FILES: &str = "kici_bare_metal::destroy::files";
/// `list_owned` read the cgroup tree and the agents directory.
pub const LIST_SCAN: &str = "kici_bare_metal::list::scan";
/// `adopt` verified the pid + start time and holds a pidfd.
pub const ADOPT_CHECK: &str = "kici_bare_metal::adopt::check";
/// `adopt` started the exit watch and the tailer; the agent is tracked.
pub const ADOPT_WATCH: &str = "kici_bare_metal::adopt::watch";

/// Every failpoint of the crate.
pub const FAILPOINTS: &[&str] = &[
    SPAWN_DIR,
    SPAWN_CGROUP,
    SPAWN_LIMITS,
    SPAWN_PROCESS,
    SPAWN_MARKER,
    SPAWN_WATCH,
    DESTROY_SIGNAL,
    DESTROY_KILL,
    DESTROY_CGROUP,
    DESTROY_FILES,
    LIST_SCAN,
    ADOPT_CHECK,
    ADOPT_WATCH,
];

/// The spawn failpoints, in step order.
pub const SPAWN: &[&str] = &[
    SPAWN_DIR,
    SPAWN_CGROUP,
    SPAWN_LIMITS,
    SPAWN_PROCESS,
    SPAWN_MARKER,
    SPAWN_WATCH,
];

/// The destroy failpoints, in step order.
pub const DESTROY: &[&str] = &[DESTROY_SIGNAL, DESTROY_KILL, DESTROY_CGROUP, DESTROY_FILES];

/// `Err(error(name))` when the failpoint `name` is configured to `return`.
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub(crate) fn check<E>(name: &'static str, error: impl FnOnce(&'static str) -> E) -> Result<(), E> {
    fail::fail_point!(name, |_| Err(error(name)));
    Ok(())
}
