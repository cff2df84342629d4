//! Wall-clock instants as the events and claim records carry them: unix
//! milliseconds inside, RFC 3339 UTC with milliseconds on the wire
//! (`2026-12-02T01:15:00.000Z`, what a JavaScript `toISOString` or
//! `date -u +%Y-%m-%dT%H:%M:%S.%3NZ` produces, so provisioners in any
//! language can read it).
//!
//! Only that one shape is written, and only `Z` (UTC) is accepted back, so
//! a redelivered event is byte-for-byte the first one.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the unix epoch (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

/// Milliseconds in one day.
const DAY_MS: u64 = 86_400_000;

impl Timestamp {
    pub const fn from_unix_millis(ms: u64) -> Self {
        Self(ms)
    }

    pub const fn unix_millis(self) -> u64 {
        self.0
    }

    /// The current wall-clock time. A clock before 1970 reads as the epoch.
    pub fn now() -> Self {
        Self::from(SystemTime::now())
    }

    /// `self + d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Self {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Self(self.0.saturating_add(ms))
    }

    /// How long from `earlier` to `self` (zero when `earlier` is later).
    pub fn saturating_since(self, earlier: Self) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// Parses exactly `YYYY-MM-DDTHH:MM:SS.mmmZ` (the shape [`Display`](std::fmt::Display)
    /// writes; years 1970..=9999).
    pub fn parse_rfc3339(s: &str) -> Result<Self, TimestampError> {
        let bad = || TimestampError(s.to_owned());
        let b = s.as_bytes();
        if b.len() != 24
            || b[4] != b'-'
            || b[7] != b'-'
            || b[10] != b'T'
            || b[13] != b':'
            || b[16] != b':'
            || b[19] != b'.'
            || b[23] != b'Z'
        {
            return Err(bad());
        }
        let num = |from: usize, to: usize| -> Result<u64, TimestampError> {
            let part = &s[from..to];
            if !part.bytes().all(|c| c.is_ascii_digit()) {
                return Err(bad());
            }
            part.parse::<u64>().map_err(|_| bad())
        };
        let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
        let (hour, minute, second, milli) =
            (num(11, 13)?, num(14, 16)?, num(17, 19)?, num(20, 23)?);
        if year < 1970
            || !(1..=12).contains(&month)
            || day == 0
            || day > days_in_month(year, month)
            || hour > 23
            || minute > 59
            || second > 59
        {
            return Err(bad());
        }
        let days = days_from_civil(year, month, day);
        Ok(Self(
            days * DAY_MS + ((hour * 60 + minute) * 60 + second) * 1000 + milli,
        ))
    }
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Self {
        let ms = t
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self(ms)
    }
}

/// A timestamp that is not `YYYY-MM-DDTHH:MM:SS.mmmZ`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an RFC 3339 UTC timestamp with milliseconds (YYYY-MM-DDTHH:MM:SS.mmmZ)")]
pub struct TimestampError(String);

fn is_leap(year: u64) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (year ≥ 1970).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    // Shift the year to start in March so the leap day is the last day.
    let (y, m) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    // 719_468 = days from 0000-03-01 to 1970-01-01.
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (days, in_day) = (self.0 / DAY_MS, self.0 % DAY_MS);
        let (year, month, day) = civil_from_days(days);
        let (secs, milli) = (in_day / 1000, in_day % 1000);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{milli:03}Z",
            secs / 3600,
            secs / 60 % 60,
            secs % 60
        )
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse_rfc3339(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses_back() {
        for (ms, text) in [
            (0, "1970-01-01T00:00:00.000Z"),
            (951_782_400_000, "2000-02-29T00:00:00.000Z"),
            (1_764_638_100_123, "2025-12-02T01:15:00.123Z"),
            (4_107_542_399_999, "2100-02-28T23:59:59.999Z"),
        ] {
            let t = Timestamp::from_unix_millis(ms);
            assert_eq!(t.to_string(), text);
            assert_eq!(Timestamp::parse_rfc3339(text), Ok(t));
        }
    }

    #[test]
    fn round_trips_every_day_for_centuries() {
        for days in (0..150_000u64).step_by(7) {
            let t = Timestamp::from_unix_millis(days * DAY_MS + 45_296_789);
            assert_eq!(Timestamp::parse_rfc3339(&t.to_string()), Ok(t));
        }
    }

    #[test]
    fn refuses_other_shapes() {
        for bad in [
            "2025-12-02T01:15:00Z",
            "2025-12-02T01:15:00.000+00:00",
            "2025-02-29T00:00:00.000Z",
            "2025-13-01T00:00:00.000Z",
            "2025-12-02 01:15:00.000Z",
            "1969-12-31T23:59:59.999Z",
            "2025-12-02T24:00:00.000Z",
            "+025-12-02T01:15:00.000Z",
        ] {
            assert!(Timestamp::parse_rfc3339(bad).is_err(), "{bad}");
        }
    }
}
