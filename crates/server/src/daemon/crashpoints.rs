//! Turning named failpoints into real crashes, for the kill -9 tests.
//!
//! Every crate with provisioning, release or reconcile steps exports its
//! failpoint names (`FAILPOINTS`); [`all`] lists them for the binary. In a
//! build with the `failpoints` feature, `KICI_SCALER_CRASH_AT=<name>[,…]`
//! makes the daemon send itself SIGKILL the moment a step reaches that
//! point: the crash leaves exactly that step's side effect behind, which is
//! what recovery and the reconciler must then clean up. Without the feature
//! the variable is refused, so a production binary cannot be told to crash.
//!
//! `KICI_SCALER_FAIL_AT=<name>=<actions>[;…]` arms failpoints with the `fail`
//! crate's actions instead (e.g. `1*return`: the first pass fails as the
//! step's error, later ones go through), for the tests of a step that must
//! survive an error — a database error exactly at a registration, say.

/// The environment variable naming the failpoints to crash at.
pub const CRASH_AT_ENV: &str = "KICI_SCALER_CRASH_AT";
/// The environment variable arming failpoints with actions.
pub const FAIL_AT_ENV: &str = "KICI_SCALER_FAIL_AT";

/// Every failpoint the binary has, by crate.
pub fn all() -> Vec<&'static str> {
    let mut v = Vec::new();
    v.extend_from_slice(kici_engine::failpoints::FAILPOINTS);
    v.extend_from_slice(kici_bare_metal::failpoints::FAILPOINTS);
    v.extend_from_slice(kici_store::FAILPOINTS);
    v.extend_from_slice(kici_netpolicy::FAILPOINTS);
    v.extend_from_slice(kici_container::FAILPOINTS);
    v.extend_from_slice(kici_firecracker::FAILPOINTS);
    v.extend_from_slice(crate::durable::reconcile::FAILPOINTS);
    v.extend_from_slice(crate::fleet::FAILPOINTS);
    v
}

#[derive(Debug, thiserror::Error)]
pub enum CrashpointError {
    #[error("{CRASH_AT_ENV}/{FAIL_AT_ENV}: unknown failpoint `{0}` (`kici-scaler failpoints` lists them)")]
    Unknown(String),
    #[error("{CRASH_AT_ENV} or {FAIL_AT_ENV} is set but this binary was built without the `failpoints` feature")]
    NotBuiltIn,
    #[error(
        "{FAIL_AT_ENV}: `{0}` is not NAME=ACTIONS (e.g. kici_scaler::registration::record=1*return)"
    )]
    Malformed(String),
    #[error("{FAIL_AT_ENV}: the actions of `{name}` are not valid: {reason}")]
    Actions { name: String, reason: String },
}

/// Arms the failpoints `KICI_SCALER_FAIL_AT` asks for; returns their names.
pub fn arm_failures_from_env() -> Result<Vec<String>, CrashpointError> {
    let Ok(raw) = std::env::var(FAIL_AT_ENV) else {
        return Ok(Vec::new());
    };
    let known = all();
    let mut armed = Vec::new();
    for item in raw.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, actions) = item
            .split_once('=')
            .ok_or_else(|| CrashpointError::Malformed(item.to_owned()))?;
        if !known.contains(&name) {
            return Err(CrashpointError::Unknown(name.to_owned()));
        }
        configure(name, actions)?;
        armed.push(name.to_owned());
    }
    Ok(armed)
}

#[cfg(feature = "failpoints")]
fn configure(name: &str, actions: &str) -> Result<(), CrashpointError> {
    fail::cfg(name, actions).map_err(|reason| CrashpointError::Actions {
        name: name.to_owned(),
        reason,
    })
}

#[cfg(not(feature = "failpoints"))]
fn configure(_: &str, _: &str) -> Result<(), CrashpointError> {
    Err(CrashpointError::NotBuiltIn)
}

/// Arms the crashes `KICI_SCALER_CRASH_AT` asks for; returns their names.
pub fn arm_from_env() -> Result<Vec<String>, CrashpointError> {
    let Ok(raw) = std::env::var(CRASH_AT_ENV) else {
        return Ok(Vec::new());
    };
    let names: Vec<String> = raw
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    let known = all();
    if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
        return Err(CrashpointError::Unknown(bad.clone()));
    }
    arm(&names)?;
    Ok(names)
}

#[cfg(feature = "failpoints")]
fn arm(names: &[String]) -> Result<(), CrashpointError> {
    for name in names {
        let point = name.clone();
        // Err only for an invalid action string; a callback has none.
        let _ = fail::cfg_callback(name.clone(), move || {
            tracing::warn!(failpoint = %point, "crashing here (kill -9 of ourselves)");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        });
    }
    Ok(())
}

#[cfg(not(feature = "failpoints"))]
fn arm(names: &[String]) -> Result<(), CrashpointError> {
    if names.is_empty() {
        Ok(())
    } else {
        Err(CrashpointError::NotBuiltIn)
    }
}
