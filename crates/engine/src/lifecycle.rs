//! The agent state machine: one enum, one [`transition`] function.
//!
//! Every change of an agent's state goes through [`transition`]; an event
//! that is not legal in the current state is an error, never a silent no-op,
//! so a bug in a caller shows up as a logged error instead of a leak.

use std::fmt;

/// Where an agent is in its life. `Gone` is terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AgentState {
    /// Admitted and recorded; the backend has not been asked yet.
    Requested,
    /// The backend is creating the resource (pull, create, boot).
    Provisioning,
    /// The resource is up; waiting for the agent to register.
    Booted,
    /// Registered with a valid token; a job-bound agent moves on to `Busy`.
    Registered,
    /// Registered, no job; a warm agent waiting to be taken.
    Idle,
    /// Running a job.
    Busy,
    /// Leaving: no new job will be given to it.
    Draining,
    /// Release steps in progress (backend destroy, rules, lease, reservation).
    Destroying,
    /// Everything released.
    Gone,
}

impl AgentState {
    pub const ALL: [AgentState; 9] = [
        Self::Requested,
        Self::Provisioning,
        Self::Booted,
        Self::Registered,
        Self::Idle,
        Self::Busy,
        Self::Draining,
        Self::Destroying,
        Self::Gone,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requested => "requested",
            Self::Provisioning => "provisioning",
            Self::Booted => "booted",
            Self::Registered => "registered",
            Self::Idle => "idle",
            Self::Busy => "busy",
            Self::Draining => "draining",
            Self::Destroying => "destroying",
            Self::Gone => "gone",
        }
    }

    /// Still being brought up (counts as "spawning" in status).
    pub fn is_spawning(self) -> bool {
        matches!(self, Self::Requested | Self::Provisioning | Self::Booted)
    }
}

impl std::str::FromStr for AgentState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| format!("unknown agent state `{s}`"))
    }
}

impl fmt::Display for AgentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an agent was destroyed early. Carried by failure events, never a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureReason {
    ProvisionError,
    ProvisionTimeout,
    RegistrationTimeout,
    BootFailure,
    ExitedEarly,
    LifetimeExceeded,
    PendingDispatchTimeout,
}

impl FailureReason {
    pub const ALL: [FailureReason; 7] = [
        Self::ProvisionError,
        Self::ProvisionTimeout,
        Self::RegistrationTimeout,
        Self::BootFailure,
        Self::ExitedEarly,
        Self::LifetimeExceeded,
        Self::PendingDispatchTimeout,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::ProvisionError => "provision-error",
            Self::ProvisionTimeout => "provision-timeout",
            Self::RegistrationTimeout => "registration-timeout",
            Self::BootFailure => "boot-failure",
            Self::ExitedEarly => "exited-early",
            Self::LifetimeExceeded => "lifetime-exceeded",
            Self::PendingDispatchTimeout => "pending-dispatch-timeout",
        }
    }

    /// Failures that can only happen before the agent could take a job
    /// (it never came up, or never registered): the job may go back to the
    /// queue. The others — the agent waited for a job past its timeout, or
    /// outlived its lifetime — mean its dispatcher had its chance.
    pub fn before_dispatch(self) -> bool {
        !matches!(self, Self::LifetimeExceeded | Self::PendingDispatchTimeout)
    }

    /// Failures that say something about the label set's health and so feed
    /// its backoff and circuit breaker. A lifetime overrun is the job's doing.
    pub fn counts_against_label_set(self) -> bool {
        !matches!(self, Self::LifetimeExceeded | Self::PendingDispatchTimeout)
    }
}

impl std::str::FromStr for FailureReason {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| format!("unknown failure reason `{s}`"))
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who owns the job queue for an agent (docs/ARCHITECTURE.md, *Two modes*).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// An orchestrator dispatches jobs; an agent may take further jobs in its
    /// idle window and is destroyed on disconnect.
    Orchestrator,
    /// kici-scaler dispatches; the agent is destroyed when its job ends.
    Standalone,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Orchestrator => "orchestrator",
            Self::Standalone => "standalone",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "orchestrator" => Ok(Self::Orchestrator),
            "standalone" => Ok(Self::Standalone),
            _ => Err(format!("unknown mode `{s}`")),
        }
    }
}

/// Why an agent is being destroyed without a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopCause {
    JobDone,
    Disconnected,
    Operator,
    Shutdown,
    IdleExpired,
    ScaleIn,
    Removed,
    Cancelled,
    /// Found alive after a restart but not resumable (a standalone job whose
    /// connection died with the old daemon).
    Recovered,
}

impl StopCause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::JobDone => "job-done",
            Self::Disconnected => "disconnected",
            Self::Operator => "operator",
            Self::Shutdown => "shutdown",
            Self::IdleExpired => "idle-expired",
            Self::ScaleIn => "scale-in",
            Self::Removed => "removed",
            Self::Cancelled => "cancelled",
            Self::Recovered => "recovered",
        }
    }
}

/// Everything that can happen to an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentEvent {
    /// The backend was asked to create the resource.
    ProvisionStarted,
    /// The backend reports the resource up.
    Booted,
    /// A failure (backend error, a deadline, the agent died early).
    Failed(FailureReason),
    /// The agent registered with a valid token.
    Registered,
    /// A job was handed to the agent (bound dispatch or taken from the pool).
    JobStarted,
    /// A registered agent has no bound job (warm spawn) and waits.
    NoJobBound,
    /// The job ended; what follows depends on the mode and on a drain.
    JobCompleted { mode: Mode, drain: bool },
    /// Idle TTL, scale-in or reload removal of an idle agent.
    Drain(StopCause),
    /// Stop now: disconnect, operator DELETE, shutdown, cancel, job done.
    Stop(StopCause),
    /// Every release step finished.
    Released,
    /// Taken back after a daemon restart, in the state recovery chose
    /// (see `Engine::recover`); legal only for a freshly rebuilt record.
    Recovered(AgentState),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal agent transition: {event:?} in state {from}")]
pub struct IllegalTransition {
    pub from: AgentState,
    pub event: AgentEvent,
}

/// The single transition function of the lifecycle table in
/// docs/ARCHITECTURE.md.
pub fn transition(from: AgentState, event: AgentEvent) -> Result<AgentState, IllegalTransition> {
    use AgentEvent as E;
    use AgentState as S;
    let to = match (from, event) {
        (S::Requested, E::ProvisionStarted) => S::Provisioning,
        (S::Requested | S::Provisioning, E::Booted) => S::Booted,
        (S::Requested | S::Provisioning | S::Booted, E::Failed(_)) => S::Destroying,
        // Registration may arrive before the backend's "up" report
        // (a fast agent); the agent is evidently up.
        (S::Provisioning | S::Booted, E::Registered) => S::Registered,
        (S::Registered, E::JobStarted) => S::Busy,
        (S::Registered, E::NoJobBound) => S::Idle,
        (S::Registered, E::Failed(FailureReason::PendingDispatchTimeout)) => S::Destroying,
        (S::Idle, E::JobStarted) => S::Busy,
        (S::Idle, E::Drain(_)) => S::Draining,
        (
            S::Busy,
            E::JobCompleted {
                mode: Mode::Orchestrator,
                drain: false,
            },
        ) => S::Idle,
        (S::Busy, E::JobCompleted { .. }) => S::Destroying,
        // Lifetime overruns end any live agent, busy included.
        (
            S::Registered | S::Idle | S::Busy | S::Draining,
            E::Failed(FailureReason::LifetimeExceeded),
        ) => S::Destroying,
        (
            S::Requested
            | S::Provisioning
            | S::Booted
            | S::Registered
            | S::Idle
            | S::Busy
            | S::Draining,
            E::Stop(_),
        ) => S::Destroying,
        (S::Destroying, E::Released) => S::Gone,
        (
            S::Requested,
            E::Recovered(to @ (S::Booted | S::Registered | S::Idle | S::Busy | S::Destroying)),
        ) => to,
        _ => return Err(IllegalTransition { from, event }),
    };
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use AgentEvent as E;
    use AgentState as S;

    fn run(events: &[AgentEvent]) -> Result<Vec<AgentState>, IllegalTransition> {
        let mut s = S::Requested;
        let mut path = vec![s];
        for e in events {
            s = transition(s, *e)?;
            path.push(s);
        }
        Ok(path)
    }

    #[test]
    fn recovery_rebuilds_only_fresh_records_into_resumable_states() {
        for to in [S::Booted, S::Registered, S::Idle, S::Busy, S::Destroying] {
            assert_eq!(transition(S::Requested, E::Recovered(to)), Ok(to));
            assert!(transition(S::Booted, E::Recovered(to)).is_err());
        }
        for to in [S::Requested, S::Provisioning, S::Draining, S::Gone] {
            assert!(transition(S::Requested, E::Recovered(to)).is_err());
        }
    }

    #[test]
    fn names_round_trip() {
        for s in AgentState::ALL {
            assert_eq!(s.as_str().parse::<AgentState>(), Ok(s));
        }
        for r in FailureReason::ALL {
            assert_eq!(r.as_str().parse::<FailureReason>(), Ok(r));
        }
        for m in [Mode::Orchestrator, Mode::Standalone] {
            assert_eq!(m.as_str().parse::<Mode>(), Ok(m));
        }
        assert!("busyish".parse::<AgentState>().is_err());
    }

    #[test]
    fn main_path_job_bound_standalone() {
        let path = run(&[
            E::ProvisionStarted,
            E::Booted,
            E::Registered,
            E::JobStarted,
            E::JobCompleted {
                mode: Mode::Standalone,
                drain: false,
            },
            E::Released,
        ])
        .unwrap();
        assert_eq!(
            path,
            [
                S::Requested,
                S::Provisioning,
                S::Booted,
                S::Registered,
                S::Busy,
                S::Destroying,
                S::Gone
            ]
        );
    }

    #[test]
    fn orchestrator_mode_returns_to_idle_then_leaves_on_disconnect() {
        let path = run(&[
            E::ProvisionStarted,
            E::Booted,
            E::Registered,
            E::JobStarted,
            E::JobCompleted {
                mode: Mode::Orchestrator,
                drain: false,
            },
            E::JobStarted,
            E::Stop(StopCause::Disconnected),
            E::Released,
        ])
        .unwrap();
        assert_eq!(path[5], S::Idle);
        assert_eq!(path[6], S::Busy);
        assert_eq!(path.last(), Some(&S::Gone));
        // A draining scaler's busy agent is destroyed after its job, even in orchestrator mode.
        assert_eq!(
            transition(
                S::Busy,
                E::JobCompleted {
                    mode: Mode::Orchestrator,
                    drain: true
                }
            ),
            Ok(S::Destroying)
        );
    }

    #[test]
    fn warm_agent_rests_in_idle_and_drains() {
        let path = run(&[
            E::ProvisionStarted,
            E::Booted,
            E::Registered,
            E::NoJobBound,
            E::Drain(StopCause::IdleExpired),
            E::Stop(StopCause::IdleExpired),
            E::Released,
        ])
        .unwrap();
        assert_eq!(&path[4..], [S::Idle, S::Draining, S::Destroying, S::Gone]);
    }

    #[test]
    fn failures_lead_to_destroying() {
        for (state, reason) in [
            (S::Requested, FailureReason::ProvisionError),
            (S::Provisioning, FailureReason::ProvisionTimeout),
            (S::Booted, FailureReason::RegistrationTimeout),
            (S::Booted, FailureReason::ExitedEarly),
            (S::Registered, FailureReason::PendingDispatchTimeout),
            (S::Busy, FailureReason::LifetimeExceeded),
        ] {
            assert_eq!(
                transition(state, E::Failed(reason)),
                Ok(S::Destroying),
                "{state} {reason}"
            );
        }
    }

    #[test]
    fn illegal_transitions_are_errors() {
        // A busy agent is never drained (scale-down never destroys busy agents).
        assert!(transition(S::Busy, E::Drain(StopCause::ScaleIn)).is_err());
        // A registration timeout cannot hit a registered agent.
        assert!(transition(S::Registered, E::Failed(FailureReason::RegistrationTimeout)).is_err());
        // Destroying is entered once and only ends in gone.
        for e in [
            E::Stop(StopCause::Operator),
            E::Failed(FailureReason::ProvisionError),
            E::Registered,
            E::JobStarted,
        ] {
            assert!(transition(S::Destroying, e).is_err(), "{e:?}");
        }
        // Gone is terminal.
        for e in [E::Released, E::Stop(StopCause::Operator), E::Booted] {
            assert!(transition(S::Gone, e).is_err());
        }
        assert!(transition(
            S::Idle,
            E::JobCompleted {
                mode: Mode::Orchestrator,
                drain: false
            }
        )
        .is_err());
    }

    #[test]
    fn every_state_but_gone_can_reach_gone() {
        for s in S::ALL {
            if s == S::Gone {
                continue;
            }
            let mut cur = s;
            // Any live state stops (or, when destroying/draining, releases).
            if cur != S::Destroying {
                cur = transition(cur, E::Stop(StopCause::Shutdown)).unwrap();
            }
            assert_eq!(transition(cur, E::Released), Ok(S::Gone), "from {s}");
        }
    }
}
