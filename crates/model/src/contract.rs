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

/// Other names in the KiCI agent's schema: the settings it reads (an
/// operator may set them through a label set's `env`), its logger's
/// settings, and the two names its unknown-variable check always lets
/// through (`KICI_CACHE`, `KICI_DEV`). This is the KiCI agent's list
/// (0.9), no more: a name outside it makes that agent refuse to start.
pub const AGENT_KNOBS: [&str; 43] = [
    "KICI_PROPERTIES",
    "KICI_AGENT_IS_ORCHESTRATOR_HOST",
    "KICI_GITHUB_TOKEN",
    "KICI_MAX_LOG_SIZE_BYTES",
    "KICI_DEFAULT_STEP_TIMEOUT_MS",
    "KICI_DOCKER_KEEP_FAILED",
    "KICI_JOB_HEARTBEAT_INTERVAL_MS",
    "KICI_AGENT_PAYLOAD_DIR",
    "KICI_AGENT_COMMAND",
    "KICI_SANDBOX",
    "KICI_TRUSTED_ENV",
    "KICI_IN_PLACE",
    "KICI_SANDBOX_NETWORK",
    "KICI_SANDBOX_HARDENED",
    "KICI_SANDBOX_READONLY_ROOTFS",
    "KICI_SANDBOX_USER",
    "KICI_SANDBOX_PIDS_LIMIT",
    "KICI_SANDBOX_MEMORY_BYTES",
    "KICI_SANDBOX_NANO_CPUS",
    "KICI_JOB_IMAGE_AGENT",
    "KICI_RUNTIME_IMAGE",
    "KICI_RUNTIME_NODE_SOURCE",
    "KICI_CONTAINER_BUILD_CLI",
    "KICI_SCALER_CLAIM_CODE",
    "KICI_SCALER_PENDING_DISPATCH_TIMEOUT",
    "KICI_CONCURRENCY_WAIT_TIMEOUT_MS",
    "KICI_AGENT_BETWEEN_JOBS_RESET_COMMAND",
    "KICI_AGENT_BETWEEN_JOBS_RESET_TIMEOUT_MS",
    "KICI_AGENT_BETWEEN_JOBS_RESET_RUN_ON",
    "KICI_AGENT_ORPHAN_CLEANUP",
    "KICI_AGENT_DRAIN_ON_RESET_FAILURE",
    // Its logger's.
    "KICI_LOG_LEVEL",
    "KICI_LOG_DIR",
    "KICI_LOG_MAX_SIZE",
    "KICI_LOG_RETENTION_DAYS",
    "KICI_LOG_FORMAT",
    "KICI_CLUSTER_INSTANCE_ID",
    "KICI_PLATFORM_INSTANCE_ID",
    // Always let through by its check.
    "KICI_CACHE",
    "KICI_DEV",
    // Set by kici-scaler too, listed for completeness of the agent's side.
    "KICI_ROLES",
    "KICI_PORT",
    "KICI_EXECUTION_MODE",
];

/// Name prefixes the KiCI agent's check lets through whatever follows:
/// its test framework's, and the forwarding prefix.
pub const AGENT_ACCEPTED_PREFIXES: [&str; 2] = ["KICI_E2E_", "KICI_AGENT_ENV_"];

/// The diagnostic-probe marker the KiCI agent's check lets through, at the
/// end of a name or followed by `_`.
pub const AGENT_PROBE_SUFFIX: &str = "_ENV_PROBE";

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
        || AGENT_ACCEPTED_PREFIXES.iter().any(|p| name.starts_with(p))
        || name.ends_with(AGENT_PROBE_SUFFIX)
        || name.contains(&format!("{AGENT_PROBE_SUFFIX}_"))
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
        // The KiCI agent's own names, 0.9's included.
        for name in [
            "KICI_RUNTIME_IMAGE",
            "KICI_JOB_IMAGE_AGENT",
            "KICI_SCALER_CLAIM_CODE",
            "KICI_SANDBOX_USER",
            "KICI_FC_ENV_PROBE",
            "KICI_X_ENV_PROBE_2",
            "KICI_AGENT_ENV_ANY",
        ] {
            assert!(agent_accepts(name), "{name}");
        }
        // An orchestrator setting, not the agent's: the agent refuses it.
        assert!(!agent_accepts("KICI_AGENT_MAX_RECONNECT_DELAY_MS"));
        assert!(!agent_accepts("KICI_ENV_PROBES"));
        for n in NOT_OVERRIDABLE {
            assert!(SET_BY_SCALER.contains(&n));
        }
    }
}
