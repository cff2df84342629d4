//! Wall-clock instants as they cross a boundary: the agent protocol's
//! `timestamp` fields and the store's columns.

use serde::{Deserialize, Deserializer, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A wall-clock instant as milliseconds since the Unix epoch: every
/// `timestamp` of the agent protocol and the only time representation in
/// the store (portable across both databases, sortable).
///
/// Signed because both databases store a 64-bit signed integer; never
/// negative when built from a clock (a clock before 1970 reads as the
/// epoch), and a negative value on the wire is refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct UnixMillis(pub i64);

impl UnixMillis {
    /// Now, from the system clock. A clock before 1970 reads as the epoch:
    /// a timestamp is informational and must not fail a send or a write.
    pub fn now() -> Self {
        Self::from(SystemTime::now())
    }

    /// As a [`SystemTime`] (negative values clamp to the epoch).
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(u64::try_from(self.0).unwrap_or(0))
    }
}

impl From<SystemTime> for UnixMillis {
    fn from(t: SystemTime) -> Self {
        let ms = t
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Self(ms)
    }
}

impl<'de> Deserialize<'de> for UnixMillis {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let ms = i64::deserialize(d)?;
        if ms < 0 {
            return Err(serde::de::Error::custom(format!(
                "a timestamp is milliseconds since 1970, got {ms}"
            )));
        }
        Ok(Self(ms))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn clock_before_1970_reads_as_the_epoch_and_negative_is_refused_on_the_wire() {
        assert_eq!(
            UnixMillis::from(UNIX_EPOCH - Duration::from_secs(1)),
            UnixMillis(0)
        );
        assert_eq!(UnixMillis(-5).to_system_time(), UNIX_EPOCH);
        let at: UnixMillis = serde_json::from_str("1700000000000").unwrap();
        assert_eq!(at, UnixMillis(1_700_000_000_000));
        assert!(serde_json::from_str::<UnixMillis>("-1").is_err());
        assert_eq!(serde_json::to_string(&at).unwrap(), "1700000000000");
    }
}
