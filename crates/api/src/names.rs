//! Every enumerated name on the wire — agent states, job states, failure
//! reasons, backends, caps, breaker states, modes — each spelled once,
//! here.
//!
//! A name's spelling is its variant's `serde` name, [`as_str`] and
//! [`FromStr`](std::str::FromStr) all at once, from a single literal.
//!
//! [`as_str`]: AgentStateName::as_str

use serde::{Deserialize, Serialize};
use std::fmt;

/// Declares a unit enum whose variants are named on the wire by the given
/// literals (serde, `as_str`, `Display`, `FromStr`).
macro_rules! wire_names {
    ($(
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $wire:tt, )*
        }
    )*) => {$(
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $wire)] $variant, )*
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            /// The wire name.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $wire, )*
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, UnknownName> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.as_str() == s)
                    .ok_or_else(|| UnknownName {
                        kind: stringify!($name),
                        name: s.to_owned(),
                    })
            }
        }
    )*};
}

/// A name that is not one of an enum's wire names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} `{name}`")]
pub struct UnknownName {
    /// The enum's Rust name.
    pub kind: &'static str,
    pub name: String,
}

wire_names! {
    /// A scaler type.
    pub enum BackendName {
        Container = "container",
        BareMetal = "bare-metal",
        Firecracker = "firecracker",
        Event = "event",
    }

    /// A cap admission enforces.
    pub enum CapName {
        GlobalCount = "global-count",
        ScalerCount = "scaler-count",
        ScalerCpu = "scaler-cpu",
        ScalerMemory = "scaler-memory",
        GlobalCpu = "global-cpu",
        GlobalMemory = "global-memory",
        PoolCpu = "pool-cpu",
        PoolMemory = "pool-memory",
    }

    /// Where an agent is in its life.
    pub enum AgentStateName {
        Requested = "requested",
        Provisioning = "provisioning",
        Booted = "booted",
        Registered = "registered",
        Idle = "idle",
        Busy = "busy",
        Draining = "draining",
        Destroying = "destroying",
        Gone = "gone",
    }

    /// Why an agent was destroyed early.
    pub enum FailureReasonName {
        ProvisionError = "provision-error",
        ProvisionTimeout = "provision-timeout",
        RegistrationTimeout = "registration-timeout",
        BootFailure = "boot-failure",
        ExitedEarly = "exited-early",
        LifetimeExceeded = "lifetime-exceeded",
        PendingDispatchTimeout = "pending-dispatch-timeout",
    }

    /// Who dispatches the agent's jobs.
    pub enum ModeName {
        Orchestrator = "orchestrator",
        Standalone = "standalone",
    }

    /// A label set's spawn circuit breaker.
    pub enum BreakerName {
        Closed = "closed",
        Open = "open",
        HalfOpen = "half-open",
    }

    /// How a scale request left the pending queue (`pending-ended` events).
    pub enum PendingEndName {
        Admitted = "admitted",
        Cancelled = "cancelled",
        Expired = "expired",
        NoBackend = "no-backend",
        TooLarge = "too-large",
    }

    /// Where a job is.
    pub enum JobState {
        /// Waiting for capacity (the engine's pending queue).
        Pending = "pending",
        /// An agent is being provisioned for it, or has registered and is
        /// about to receive it.
        Spawning = "spawning",
        /// The agent acknowledged it and runs the command.
        Running = "running",
        /// The command exited 0.
        Succeeded = "succeeded",
        /// The command failed, timed out, could not start, or kici-scaler could
        /// not run it to its end (`end`, `reason` say which).
        Failed = "failed",
        /// Cancelled through the API, or by the agent on request.
        Cancelled = "cancelled",
    }

    /// How a finished job ended.
    pub enum EndKind {
        /// The command ended on its own (`exitCode` or `signal`).
        Exited = "exited",
        /// The agent killed it at `timeoutSeconds` (`exitCode` or `signal` say
        /// how the killed process ended).
        TimedOut = "timed-out",
        /// Cancelled (through the API, or by the agent on request).
        Cancelled = "cancelled",
        /// The command could not be started (not found, not executable).
        StartFailed = "start-failed",
        /// kici-scaler could not run the job to its end: no capacity in time,
        /// the agent failed, never registered, disconnected or was destroyed.
        Aborted = "aborted",
    }
}

impl AgentStateName {
    /// Still being brought up (counts as "spawning" in status).
    pub fn is_spawning(self) -> bool {
        matches!(self, Self::Requested | Self::Provisioning | Self::Booted)
    }
}

impl JobState {
    /// Succeeded, failed or cancelled: the job will not change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn serde_as_str_and_from_str_agree() {
        fn check<T>(all: &[T])
        where
            T: Copy + Serialize + fmt::Display + std::str::FromStr + PartialEq + fmt::Debug,
        {
            for v in all {
                let json = serde_json::to_value(v).unwrap();
                assert_eq!(json, serde_json::Value::String(v.to_string()));
                assert_eq!(v.to_string().parse::<T>().ok(), Some(*v));
            }
        }
        check(BackendName::ALL);
        check(CapName::ALL);
        check(AgentStateName::ALL);
        check(FailureReasonName::ALL);
        check(ModeName::ALL);
        check(BreakerName::ALL);
        check(PendingEndName::ALL);
        check(JobState::ALL);
        check(EndKind::ALL);
        assert!("sleeping".parse::<AgentStateName>().is_err());
    }
}
