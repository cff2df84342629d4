//! Why the agent exits, and the process exit code for each reason.

use std::fmt;

/// | code | reason |
/// |---|---|
/// | 0 | done: the idle or pending-dispatch window passed, the gateway closed the connection normally (1000), or SIGTERM/SIGINT |
/// | 1 | internal error (the runtime could not start) |
/// | 2 | bad bootstrap or command line (nothing was attempted) |
/// | 3 | rejected for good: `auth.failure`, or close 4010 / 4005 / 4003 (retrying cannot help) |
/// | 4 | gave up reconnecting (attempt or time budget spent, see `backoff`) |
/// | 5 | claim failed: the claim code was refused (`unknown`, `consumed`, `expired`) or could not be redeemed in time (nothing was connected) |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentExit {
    Done(DoneReason),
    Internal,
    BadBootstrap,
    Rejected,
    GaveUp,
    ClaimFailed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DoneReason {
    IdleTimeout,
    PendingDispatchTimeout,
    ClosedByGateway,
    Signal,
}

impl AgentExit {
    pub fn code(self) -> u8 {
        match self {
            Self::Done(_) => 0,
            Self::Internal => 1,
            Self::BadBootstrap => 2,
            Self::Rejected => 3,
            Self::GaveUp => 4,
            Self::ClaimFailed => 5,
        }
    }
}

impl fmt::Display for AgentExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Done(DoneReason::IdleTimeout) => "idle-timeout",
            Self::Done(DoneReason::PendingDispatchTimeout) => "scaler-pending-dispatch-timeout",
            Self::Done(DoneReason::ClosedByGateway) => "closed-by-gateway",
            Self::Done(DoneReason::Signal) => "signal",
            Self::Internal => "internal-error",
            Self::BadBootstrap => "bad-bootstrap",
            Self::Rejected => "rejected",
            Self::GaveUp => "gave-up-reconnecting",
            Self::ClaimFailed => "claim-failed",
        })
    }
}

impl From<AgentExit> for std::process::ExitCode {
    fn from(e: AgentExit) -> Self {
        std::process::ExitCode::from(e.code())
    }
}
