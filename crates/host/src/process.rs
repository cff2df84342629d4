//! Process identity: a pid is only ours while its start time matches.
//!
//! Pids are reused. Before any signal, destroy checks that the pid still
//! names the process we started, by the start time the kernel records for it
//! (`/proc/<pid>/stat` field 22, clock ticks since boot), recorded at spawn
//! in the handle id `pid:<pid>:<start time>`.

use rustix::process::Pid;
use std::fmt;
use std::io;
use std::str::FromStr;

/// A process as pid + start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub pid: Pid,
    pub start_time: u64,
}

/// What `/proc/<pid>/stat` says about a pid now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub state: char,
    pub session: i32,
    pub start_time: u64,
}

impl ProcStat {
    pub fn read(pid: Pid) -> io::Result<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero()))?;
        Self::parse(&stat).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected /proc/{pid:?}/stat: {stat:?}"),
            )
        })
    }

    /// Fields after the command name (which may hold spaces and parentheses,
    /// hence the last `)`): state is field 3, session 6, start time 22.
    fn parse(stat: &str) -> Option<Self> {
        let rest = &stat[stat.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        Some(Self {
            state: fields.first()?.chars().next()?,
            session: fields.get(3)?.parse().ok()?,
            start_time: fields.get(19)?.parse().ok()?,
        })
    }

    /// Dead but not yet reaped.
    pub fn is_zombie(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

impl ProcessIdentity {
    pub fn of(pid: Pid) -> io::Result<Self> {
        Ok(Self {
            pid,
            start_time: ProcStat::read(pid)?.start_time,
        })
    }

    /// Does the pid still name this process (alive or a zombie)?
    pub fn is_current(&self) -> bool {
        ProcStat::read(self.pid).is_ok_and(|s| s.start_time == self.start_time)
    }

    /// Is this process still running (not gone, not a zombie)?
    pub fn is_running(&self) -> bool {
        ProcStat::read(self.pid).is_ok_and(|s| s.start_time == self.start_time && !s.is_zombie())
    }
}

impl fmt::Display for ProcessIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid:{}:{}", self.pid.as_raw_nonzero(), self.start_time)
    }
}

impl FromStr for ProcessIdentity {
    type Err = ();

    /// `pid:<pid>:<start time>`.
    fn from_str(s: &str) -> Result<Self, ()> {
        let mut parts = s.trim().split(':');
        let (Some("pid"), Some(pid), Some(start), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(());
        };
        let pid = Pid::from_raw(pid.parse().map_err(|_| ())?).ok_or(())?;
        Ok(Self {
            pid,
            start_time: start.parse().map_err(|_| ())?,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn stat_parsing_survives_odd_command_names() {
        let stat =
            "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 100";
        let parsed = ProcStat::parse(stat).unwrap();
        assert_eq!(parsed.state, 'S');
        assert_eq!(parsed.session, 1234);
        assert_eq!(parsed.start_time, 987654);
        assert!(ProcStat::parse("garbage").is_none());
    }

    #[test]
    fn identity_round_trips_and_matches_this_process() {
        let me = ProcessIdentity::of(rustix::process::getpid()).unwrap();
        assert!(me.is_current() && me.is_running());
        let text = me.to_string();
        assert!(text.starts_with("pid:"));
        assert_eq!(text.parse::<ProcessIdentity>(), Ok(me));
        let other = ProcessIdentity {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!other.is_current());
        for bad in ["", "pid:1", "pid:0:1", "pid:x:1", "cgroup:/x", "pid:1:2:3"] {
            assert!(bad.parse::<ProcessIdentity>().is_err(), "{bad}");
        }
    }
}
