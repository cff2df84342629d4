//! Warm pools whose size changes with time: `x-kici-scaler.warmPool`.
//!
//! Upstream's `warmPool` has one fixed size. This module owns our
//! extension's vocabulary — a weekly schedule of periods and a forecast's
//! bounds — and the one pure question a schedule answers: which period is
//! active at a given wall-clock instant. The engine decides what to do with
//! the answer (and computes the forecast).

use serde::{Serialize, Serializer};

/// A day of the week, as `days:` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Weekday {
    Mon,
    Tue,
    Wed,
    Thu,
    Fri,
    Sat,
    Sun,
}

impl Weekday {
    pub const ALL: [Weekday; 7] = [
        Self::Mon,
        Self::Tue,
        Self::Wed,
        Self::Thu,
        Self::Fri,
        Self::Sat,
        Self::Sun,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mon => "mon",
            Self::Tue => "tue",
            Self::Wed => "wed",
            Self::Thu => "thu",
            Self::Fri => "fri",
            Self::Sat => "sat",
            Self::Sun => "sun",
        }
    }

    fn from_jiff(day: jiff::civil::Weekday) -> Self {
        use jiff::civil::Weekday as J;
        match day {
            J::Monday => Self::Mon,
            J::Tuesday => Self::Tue,
            J::Wednesday => Self::Wed,
            J::Thursday => Self::Thu,
            J::Friday => Self::Fri,
            J::Saturday => Self::Sat,
            J::Sunday => Self::Sun,
        }
    }

    /// The day before (a period that crosses midnight started then).
    fn previous(self) -> Self {
        let i = Self::ALL.iter().position(|d| *d == self).unwrap_or(0);
        Self::ALL[(i + 6) % 7]
    }
}

/// A time of day in minutes since midnight, `0..=1440` (`"24:00"` is the
/// end of the day, allowed as a period's `to`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TimeOfDay(u16);

impl TimeOfDay {
    pub const END_OF_DAY: TimeOfDay = TimeOfDay(24 * 60);

    /// `"HH:MM"`, 00:00 to 24:00; `None` otherwise.
    pub fn parse(text: &str) -> Option<Self> {
        let (h, m) = text.split_once(':')?;
        if h.len() != 2 || m.len() != 2 {
            return None;
        }
        let h: u16 = h.parse().ok()?;
        let m: u16 = m.parse().ok()?;
        if m >= 60 || h > 24 || (h == 24 && m != 0) {
            return None;
        }
        Some(Self(h * 60 + m))
    }

    pub fn minutes(self) -> u16 {
        self.0
    }
}

impl std::fmt::Display for TimeOfDay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:02}:{:02}", self.0 / 60, self.0 % 60)
    }
}

impl Serialize for TimeOfDay {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An IANA time zone, resolved when the configuration is loaded (an unknown
/// name is a configuration error, not a surprise at 9:00).
#[derive(Debug, Clone)]
pub struct Timezone {
    name: String,
    zone: jiff::tz::TimeZone,
}

impl Timezone {
    /// Looks `name` up in the host's time zone database.
    pub fn get(name: &str) -> Result<Self, jiff::Error> {
        Ok(Self {
            name: name.to_owned(),
            zone: jiff::tz::TimeZone::get(name)?,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn zone(&self) -> &jiff::tz::TimeZone {
        &self.zone
    }
}

impl PartialEq for Timezone {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Serialize for Timezone {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

/// One `schedule[]` period: on `days`, from `from` to `to` local time in
/// `timezone`, the warm pool holds `size` agents per label set. A period
/// whose `to` is not after its `from` crosses midnight: it starts on a
/// listed day and ends on the next day.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmPeriod {
    pub days: Vec<Weekday>,
    pub from: TimeOfDay,
    pub to: TimeOfDay,
    pub timezone: Timezone,
    pub size: u32,
}

impl WarmPeriod {
    /// Whether the period covers `at`.
    pub fn covers(&self, at: jiff::Timestamp) -> bool {
        let local = self.timezone.zone().to_datetime(at);
        let day = Weekday::from_jiff(local.weekday());
        let minute =
            u16::try_from(i32::from(local.hour()) * 60 + i32::from(local.minute())).unwrap_or(0);
        let minute = TimeOfDay(minute);
        if self.from < self.to {
            self.days.contains(&day) && self.from <= minute && minute < self.to
        } else {
            // Crosses midnight: the evening part on a listed day, the
            // morning part on the day after one.
            (self.days.contains(&day) && minute >= self.from)
                || (self.days.contains(&day.previous()) && minute < self.to)
        }
    }

    /// `mon-fri 08:00-18:00 Europe/Paris`, for status and logs.
    pub fn describe(&self) -> String {
        let days: Vec<&str> = self.days.iter().map(|d| d.as_str()).collect();
        format!(
            "{} {}-{} {}",
            days.join(","),
            self.from,
            self.to,
            self.timezone.name()
        )
    }
}

/// `forecast: {minSize, maxSize}`: the warm pool follows a forecast of the
/// label set's demand, bounded by these and by the scaler's caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmForecast {
    pub min_size: u32,
    pub max_size: u32,
}

/// `x-kici-scaler.warmPool`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmPolicy {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub schedule: Vec<WarmPeriod>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forecast: Option<WarmForecast>,
}

impl WarmPolicy {
    /// The index of the first period covering `at` (the first match wins).
    pub fn active_period(&self, at: jiff::Timestamp) -> Option<usize> {
        self.schedule.iter().position(|p| p.covers(at))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn period(days: &[Weekday], from: &str, to: &str, tz: &str) -> WarmPeriod {
        WarmPeriod {
            days: days.to_vec(),
            from: TimeOfDay::parse(from).unwrap(),
            to: TimeOfDay::parse(to).unwrap(),
            timezone: Timezone::get(tz).unwrap(),
            size: 1,
        }
    }

    fn at(text: &str) -> jiff::Timestamp {
        text.parse().unwrap()
    }

    #[test]
    fn times_of_day() {
        assert_eq!(TimeOfDay::parse("08:30").unwrap().minutes(), 510);
        assert_eq!(TimeOfDay::parse("24:00"), Some(TimeOfDay::END_OF_DAY));
        for bad in ["8:30", "24:01", "12:60", "ab:cd", "0830", "08:30:00", ""] {
            assert_eq!(TimeOfDay::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_period_in_its_own_time_zone() {
        use Weekday::*;
        // 2026-01-05 is a Monday; Paris is UTC+1 in winter, UTC+2 in summer.
        let p = period(&[Mon, Tue, Wed, Thu, Fri], "08:00", "18:00", "Europe/Paris");
        assert!(!p.covers(at("2026-01-05T06:59:00Z")));
        assert!(p.covers(at("2026-01-05T07:00:00Z")));
        assert!(p.covers(at("2026-01-05T16:59:00Z")));
        assert!(!p.covers(at("2026-01-05T17:00:00Z")));
        // Saturday.
        assert!(!p.covers(at("2026-01-10T10:00:00Z")));
        // Summer time: 08:00 in Paris is 06:00 UTC.
        assert!(p.covers(at("2026-07-06T06:00:00Z")));
        assert!(!p.covers(at("2026-07-06T16:00:00Z")));
    }

    #[test]
    fn a_period_across_midnight_ends_the_next_day() {
        use Weekday::*;
        let p = period(&[Fri], "22:00", "02:00", "UTC");
        // Friday 2026-01-09 23:00, Saturday 01:59: covered.
        assert!(p.covers(at("2026-01-09T23:00:00Z")));
        assert!(p.covers(at("2026-01-10T01:59:00Z")));
        assert!(!p.covers(at("2026-01-10T02:00:00Z")));
        // Friday's early morning belongs to Thursday's night, not listed.
        assert!(!p.covers(at("2026-01-09T01:00:00Z")));
        let policy = WarmPolicy {
            schedule: vec![period(&[Sat], "00:00", "24:00", "UTC"), p],
            forecast: None,
        };
        // The first match wins.
        assert_eq!(policy.active_period(at("2026-01-10T01:00:00Z")), Some(0));
        assert_eq!(policy.active_period(at("2026-01-09T23:00:00Z")), Some(1));
        assert_eq!(policy.active_period(at("2026-01-08T23:00:00Z")), None);
    }
}
