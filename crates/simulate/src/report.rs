//! What a replay measured, per scaler and overall, as text or JSON.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

/// Wait percentiles, seconds (nearest rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct WaitStats {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl WaitStats {
    /// Nearest-rank percentiles of `waits` (sorted here).
    pub fn of(waits: &mut [f64]) -> Self {
        if waits.is_empty() {
            return Self::default();
        }
        waits.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            let i = (p * waits.len() as f64).ceil() as usize;
            waits[i.clamp(1, waits.len()) - 1]
        };
        Self {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: waits[waits.len() - 1],
        }
    }
}

/// One scaler's (or every scaler's) numbers.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    /// Jobs that got an agent.
    pub jobs: u64,
    /// Jobs whose agent was ready when they arrived (a warm agent).
    pub zero_wait: u64,
    /// Arrival → an agent ready for the job.
    pub wait: WaitStats,
    /// Agents up without a job (registered or idle), summed: the cost.
    pub idle_agent_seconds: f64,
    /// Most agents alive at once (spawning, up, busy or being destroyed).
    pub peak_agents: u64,
    /// Waiting requests refused, by cap (each request counted once per
    /// cap that held it back).
    pub refusals: BTreeMap<String, u64>,
    /// Jobs that never got an agent (expired in the queue, too large, no
    /// scaler), with why.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub lost: BTreeMap<String, u64>,
}

/// A replay's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    pub overall: Stats,
    pub scalers: BTreeMap<String, Stats>,
    /// Seconds of virtual time replayed (the trace's start → the last
    /// job's end).
    #[serde(rename = "simulatedSeconds")]
    pub simulated_seconds: f64,
}

fn row(f: &mut fmt::Formatter<'_>, name: &str, s: &Stats) -> fmt::Result {
    let refusals: Vec<String> = s.refusals.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let lost: Vec<String> = s.lost.iter().map(|(k, v)| format!("{k}={v}")).collect();
    writeln!(
        f,
        "{:<16} {:>7} {:>9} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>12.0} {:>6}  {}{}",
        name,
        s.jobs,
        s.zero_wait,
        s.wait.p50,
        s.wait.p90,
        s.wait.p99,
        s.wait.max,
        s.idle_agent_seconds,
        s.peak_agents,
        if refusals.is_empty() {
            "-".to_owned()
        } else {
            refusals.join(",")
        },
        if lost.is_empty() {
            String::new()
        } else {
            format!("  lost: {}", lost.join(","))
        }
    )
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<16} {:>7} {:>9} {:>8} {:>8} {:>8} {:>8} {:>12} {:>6}  refusals by cap",
            "scaler",
            "jobs",
            "zero-wait",
            "p50 s",
            "p90 s",
            "p99 s",
            "max s",
            "idle agent-s",
            "peak"
        )?;
        for (name, s) in &self.scalers {
            row(f, name, s)?;
        }
        row(f, "(overall)", &self.overall)?;
        write!(
            f,
            "simulated {:.0} s ({:.1} h)",
            self.simulated_seconds,
            self.simulated_seconds / 3600.0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut w: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = WaitStats::of(&mut w);
        assert_eq!((s.p50, s.p90, s.p99, s.max), (5.0, 9.0, 10.0, 10.0));
        assert_eq!(WaitStats::of(&mut []), WaitStats::default());
    }
}
