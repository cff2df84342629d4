//! WebSocket close codes of the agent protocol (KiCI's codes).

use std::fmt;

/// Why a connection was closed. The numbers are KiCI's; an agent treats
/// [`CloseCode::is_permanent`] codes as "do not reconnect".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseCode {
    /// 1000: an intentional close (agent shutdown; the gateway dismissing an
    /// agent whose work is done).
    Normal,
    /// 1001: the server is going away (or an ownership-violation escalation).
    GoingAway,
    /// 4002: no `auth.request` within 5 s, or no `agent.register` within
    /// 10 s of `auth.success`.
    HandshakeTimeout,
    /// 4003: a malformed or unexpected message, a message before
    /// registration, an agent-id collision, or rate-limit disconnect.
    InvalidMessage,
    /// 4004: no heartbeat for 180 s.
    HeartbeatTimeout,
    /// 4005: the agent's `protocolVersion` is outside the versions the
    /// gateway speaks ([`crate::SUPPORTED_PROTOCOL_VERSIONS`]).
    UnsupportedProtocolVersion,
    /// 4009: another connection of the same agent registered (a reconnect
    /// while this socket still looked open, e.g. half-open after a network
    /// blip): this one is retired, the agent lives on on the new one.
    SupersededByReconnect,
    /// 4010: bad, expired, revoked or foreign token, or a registration the
    /// token does not authorise (labels outside its scope, another agent id).
    AuthFailed,
    /// 4031: the agent did not acknowledge a `job.dispatch` in time.
    DispatchAckTimeout,
}

impl CloseCode {
    pub const ALL: [CloseCode; 9] = [
        Self::Normal,
        Self::GoingAway,
        Self::HandshakeTimeout,
        Self::InvalidMessage,
        Self::HeartbeatTimeout,
        Self::UnsupportedProtocolVersion,
        Self::SupersededByReconnect,
        Self::AuthFailed,
        Self::DispatchAckTimeout,
    ];

    pub const fn code(self) -> u16 {
        match self {
            Self::Normal => 1000,
            Self::GoingAway => 1001,
            Self::HandshakeTimeout => 4002,
            Self::InvalidMessage => 4003,
            Self::HeartbeatTimeout => 4004,
            Self::UnsupportedProtocolVersion => 4005,
            Self::SupersededByReconnect => 4009,
            Self::AuthFailed => 4010,
            Self::DispatchAckTimeout => 4031,
        }
    }

    pub fn from_code(code: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.code() == code)
    }

    /// Retrying cannot help: the token or the agent's own build is rejected
    /// (KiCI's agent stops reconnecting on 4010; 4005 and 4003 would repeat
    /// identically on every attempt).
    pub const fn is_permanent(self) -> bool {
        matches!(
            self,
            Self::AuthFailed | Self::UnsupportedProtocolVersion | Self::InvalidMessage
        )
    }
}

impl fmt::Display for CloseCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Normal => "normal",
            Self::GoingAway => "going away",
            Self::HandshakeTimeout => "auth/registration timeout",
            Self::InvalidMessage => "invalid message",
            Self::HeartbeatTimeout => "heartbeat timeout",
            Self::UnsupportedProtocolVersion => "unsupported protocol version",
            Self::SupersededByReconnect => "superseded by reconnect",
            Self::AuthFailed => "agent auth failed",
            Self::DispatchAckTimeout => "dispatch ack timeout",
        };
        write!(f, "{} ({name})", self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_the_contract() {
        let codes: Vec<u16> = CloseCode::ALL.iter().map(|c| c.code()).collect();
        assert_eq!(
            codes,
            [1000, 1001, 4002, 4003, 4004, 4005, 4009, 4010, 4031]
        );
        for c in CloseCode::ALL {
            assert_eq!(CloseCode::from_code(c.code()), Some(c));
        }
        assert_eq!(CloseCode::from_code(4000), None);
        assert!(CloseCode::AuthFailed.is_permanent());
        assert!(!CloseCode::HeartbeatTimeout.is_permanent());
        assert!(!CloseCode::Normal.is_permanent());
        // The retired socket's agent is already on its new one.
        assert!(!CloseCode::SupersededByReconnect.is_permanent());
        assert_eq!(
            CloseCode::AuthFailed.to_string(),
            "4010 (agent auth failed)"
        );
    }
}
