//! The agent's bearer token, kept out of logs by construction.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// An ephemeral agent token: `kat_` + 64 lowercase hex (256 bits), minted by
/// kici-scaler and bound to one agent id.
///
/// `Debug` prints `AgentToken(<redacted>)` and there is no `Display`, so a
/// token cannot reach a log line through formatting; parse errors never
/// echo the value either. [`AgentToken::expose`] is the one way to the text
/// (for the wire and for hashing).
#[derive(Clone, PartialEq, Eq)]
pub struct AgentToken(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The value is deliberately not part of the message.
    #[error("an agent token is `kat_` followed by 64 lowercase hex digits (value not shown)")]
    Malformed,
}

impl AgentToken {
    pub const PREFIX: &'static str = "kat_";
    const HEX_LEN: usize = 64;

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl FromStr for AgentToken {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex = s.strip_prefix(Self::PREFIX).ok_or(TokenError::Malformed)?;
        if hex.len() != Self::HEX_LEN
            || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(TokenError::Malformed);
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Debug for AgentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AgentToken(<redacted>)")
    }
}

impl Serialize for AgentToken {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for AgentToken {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "kat_00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    #[test]
    fn parses_the_minted_format_only() {
        let t: AgentToken = GOOD.parse().unwrap();
        assert_eq!(t.expose(), GOOD);
        for bad in [
            "",
            "kat_",
            &GOOD[..GOOD.len() - 1],
            &GOOD.to_uppercase(),
            &GOOD.replacen("kat_", "tok_", 1),
            &format!("{GOOD}0"),
        ] {
            assert_eq!(
                bad.parse::<AgentToken>(),
                Err(TokenError::Malformed),
                "{bad}"
            );
        }
    }

    #[test]
    fn never_formats_the_secret() {
        let t: AgentToken = GOOD.parse().unwrap();
        assert!(!format!("{t:?}").contains("0011"));
        let bad = format!("{}x", GOOD);
        let err = bad.parse::<AgentToken>().unwrap_err().to_string();
        assert!(!err.contains("0011"), "{err}");
        let json_err = serde_json::from_str::<AgentToken>(&format!("\"{bad}\""))
            .unwrap_err()
            .to_string();
        assert!(!json_err.contains("0011"), "{json_err}");
    }
}
