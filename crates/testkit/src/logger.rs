//! The VMM logger: Firecracker's line format
//! (`<RFC 3339 ns timestamp> [<instance id>:<thread>(:<LEVEL>)] <message>`),
//! its level filter, and its refusal to create the log file (the file or FIFO
//! must exist beforehand).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Log levels, in increasing verbosity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off,
    Error,
    Warning,
    Info,
    Debug,
    Trace,
}

impl Level {
    /// Case-insensitive, like Firecracker's deserializer.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "off" => Self::Off,
            "error" => Self::Error,
            "warning" | "warn" => Self::Warning,
            "info" => Self::Info,
            "debug" => Self::Debug,
            "trace" => Self::Trace,
            _ => return None,
        })
    }

    fn label(self) -> &'static str {
        match self {
            Self::Off => "OFF",
            Self::Error => "ERROR",
            Self::Warning => "WARN",
            Self::Info => "INFO",
            Self::Debug => "DEBUG",
            Self::Trace => "TRACE",
        }
    }
}

/// Where log lines go and how they look.
#[derive(Debug)]
pub struct VmmLogger {
    instance_id: String,
    level: Level,
    show_level: bool,
    show_origin: bool,
    target: Option<File>,
}

impl VmmLogger {
    /// Before a log path is configured Firecracker writes warnings and errors to stderr
    /// (which the jailer's caller usually sends to the serial log file).
    pub fn new(instance_id: &str) -> Self {
        Self {
            instance_id: instance_id.to_string(),
            level: Level::Warning,
            show_level: false,
            show_origin: false,
            target: None,
        }
    }

    /// Point the logger at an existing file or FIFO (`--log-path` / `PUT /logger`).
    pub fn configure(
        &mut self,
        path: Option<&Path>,
        level: Option<Level>,
        show_level: Option<bool>,
        show_origin: Option<bool>,
    ) -> std::io::Result<()> {
        if let Some(p) = path {
            // No `create`: Firecracker refuses a missing log path.
            let f = OpenOptions::new().append(true).open(p)?;
            self.target = Some(f);
        }
        if let Some(l) = level {
            self.level = l;
        }
        if let Some(s) = show_level {
            self.show_level = s;
        }
        if let Some(s) = show_origin {
            self.show_origin = s;
        }
        Ok(())
    }

    pub fn is_configured(&self) -> bool {
        self.target.is_some()
    }

    /// Write one line if `level` passes the filter.
    pub fn log(&mut self, level: Level, thread: &str, message: &str) {
        if level == Level::Off || level > self.level {
            return;
        }
        let mut prefix = format!("{} [{}:{}", rfc3339_now(), self.instance_id, thread);
        if self.show_level {
            prefix.push(':');
            prefix.push_str(level.label());
        }
        if self.show_origin {
            prefix.push_str(":kici_testkit");
        }
        let line = format!("{prefix}] {message}\n");
        // A failing log write must not take the VMM down (Firecracker counts it in a metric).
        match self.target.as_mut() {
            Some(f) => {
                let _ = f.write_all(line.as_bytes());
            }
            None => {
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS.nnnnnnnnn` in UTC, like Firecracker's log timestamps.
pub fn rfc3339_now() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:09}",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        now.subsec_nanos()
    )
}

// Howard Hinnant's days-to-civil algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod firecracker_tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(Level::parse("WARNING"), Some(Level::Warning));
        assert!(Level::Info > Level::Warning);
    }
}
