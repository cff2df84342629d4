//! The agent bootstrap contract's environment names (the `KICI_*` variables
//! the KiCI agent reads at start-up). The KiCI agent refuses to start when it finds a `KICI_*` variable
//! outside its schema, so every layer that builds an agent environment (the
//! config loader for label-set `env`, the backends, the reference agent)
//! checks names against this one list.

/// Variables kici-scaler itself sets for an agent.
pub const SET_BY_SCALER: [&str; 10] = [
    "KICI_ORCHESTRATOR_URL",
    "KICI_AGENT_ID",
    "KICI_LABELS",
    "KICI_SCALER_MANAGED",
    "KICI_AGENT_TOKEN",
    "KICI_EXECUTION_MODE",
    "KICI_PORT",
    "KICI_BACKPRESSURE_MODE",
    "KICI_ROLES",
    "KICI_SCALER_IDLE_TIMEOUT",
];

/// Other names in the agent's schema (knobs an operator may set through a
/// label set's `env`, and the logger's own settings).
pub const AGENT_KNOBS: [&str; 15] = [
    "KICI_SCALER_PENDING_DISPATCH_TIMEOUT",
    "KICI_JOB_HEARTBEAT_INTERVAL_MS",
    "KICI_SANDBOX",
    "KICI_SANDBOX_NETWORK",
    "KICI_LOG_LEVEL",
    "KICI_LOG_DIR",
    "KICI_LOG_MAX_SIZE",
    "KICI_LOG_RETENTION_DAYS",
    "KICI_LOG_FORMAT",
    "KICI_CLUSTER_INSTANCE_ID",
    "KICI_PLATFORM_INSTANCE_ID",
    "KICI_PROPERTIES",
    "KICI_AGENT_MAX_RECONNECT_DELAY_MS",
    "KICI_CACHE",
    "KICI_DEV",
];

/// Names the scaler sets that configuration must never override: they bind
/// the agent to its token.
pub const NOT_OVERRIDABLE: [&str; 4] = [
    "KICI_AGENT_ID",
    "KICI_AGENT_TOKEN",
    "KICI_LABELS",
    "KICI_SCALER_MANAGED",
];

/// Host variables a bare-metal agent inherits from the daemon (nothing else
/// of the daemon's environment leaks).
pub const BARE_METAL_SYSTEM_ALLOWLIST: [&str; 10] = [
    "PATH",
    "HOME",
    "USER",
    "SHELL",
    "LANG",
    "LC_ALL",
    "TERM",
    "TMPDIR",
    "NODE_PATH",
    "TZ",
];

/// The prefix of daemon variables forwarded to agents with the prefix
/// stripped (`KICI_AGENT_ENV_FOO=1` → `FOO=1`).
pub const FORWARD_PREFIX: &str = "KICI_AGENT_ENV_";

/// Would the KiCI agent accept a variable of this name in its environment?
pub fn agent_accepts(name: &str) -> bool {
    if !name.starts_with("KICI_") {
        return true;
    }
    SET_BY_SCALER.contains(&name)
        || AGENT_KNOBS.contains(&name)
        || name.starts_with("KICI_E2E_")
        || name.starts_with(FORWARD_PREFIX)
        || name.ends_with("_ENV_PROBE")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_contract_names_only() {
        assert!(agent_accepts("PATH"));
        assert!(agent_accepts("KICI_ROLES"));
        assert!(agent_accepts("KICI_LOG_LEVEL"));
        assert!(agent_accepts("KICI_E2E_X"));
        assert!(!agent_accepts("KICI_SCALER_MADE_UP"));
        assert!(!agent_accepts("KICI_MAX_CONCURRENT_JOBS"));
        for n in NOT_OVERRIDABLE {
            assert!(SET_BY_SCALER.contains(&n));
        }
    }
}
