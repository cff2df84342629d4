//! Named failpoints of the runtime's provisioning and release steps (the
//! failpoint map is in docs/ARCHITECTURE.md), each right after its step's side effect: a crash there leaves exactly
//! that effect behind for recovery to find. No-ops unless built with
//! `--features failpoints`.

/// The agent's record is in the store; the backend was not asked yet.
pub const SPAWN_RECORDED: &str = "kici_engine::spawn::recorded";
/// The backend reports the resource up; the engine has not seen it.
pub const SPAWN_BACKEND_DONE: &str = "kici_engine::spawn::backend_done";
/// The backend removed everything; the agent is not yet `gone` (its
/// record and reservation remain).
pub const DESTROY_BACKEND_DONE: &str = "kici_engine::destroy::backend_done";

/// Every failpoint of the crate.
pub const FAILPOINTS: &[&str] = &[SPAWN_RECORDED, SPAWN_BACKEND_DONE, DESTROY_BACKEND_DONE];

/// Evaluates failpoint `name` (a callback configured on it runs here).
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub(crate) fn hit(name: &'static str) {
    fail::fail_point!(name);
}
