//! The caps admission enforces, and the answers it gives when one is in the
//! way: a [`Refusal`] (not now: wait for a release) or [`TooLarge`] (never:
//! the request exceeds the cap's total).

use kici_model::{MemoryBytes, MilliCpu};
use serde::{Serialize, Serializer};
use std::fmt;

/// One cap. The declaration order is the order in which admission checks
/// them, so the first cap in the way is the one reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cap {
    /// `globalMaxAgents`: live reservations across every scaler.
    GlobalCount,
    /// A scaler's `maxAgents`.
    ScalerCount,
    /// A scaler's `resourceCap.maxCpu`.
    ScalerCpu,
    /// A scaler's `resourceCap.maxMemory`.
    ScalerMemory,
    /// `globalResourceCap.maxCpu`.
    GlobalCpu,
    /// `globalResourceCap.maxMemory`.
    GlobalMemory,
    /// The machine pool's `cap.maxCpu` (summed over every process sharing it).
    PoolCpu,
    /// The machine pool's `cap.maxMemory`.
    PoolMemory,
}

/// What a cap counts, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapUnit {
    Agents,
    MilliCpu,
    Bytes,
}

impl Cap {
    /// Every cap, in check order.
    pub const ALL: [Cap; 8] = [
        Cap::GlobalCount,
        Cap::ScalerCount,
        Cap::ScalerCpu,
        Cap::ScalerMemory,
        Cap::GlobalCpu,
        Cap::GlobalMemory,
        Cap::PoolCpu,
        Cap::PoolMemory,
    ];

    /// The API's name for the cap (`"result":"too-large","cap":…`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Cap::GlobalCount => "global-count",
            Cap::ScalerCount => "scaler-count",
            Cap::ScalerCpu => "scaler-cpu",
            Cap::ScalerMemory => "scaler-memory",
            Cap::GlobalCpu => "global-cpu",
            Cap::GlobalMemory => "global-memory",
            Cap::PoolCpu => "pool-cpu",
            Cap::PoolMemory => "pool-memory",
        }
    }

    pub const fn unit(self) -> CapUnit {
        match self {
            Cap::GlobalCount | Cap::ScalerCount => CapUnit::Agents,
            Cap::ScalerCpu | Cap::GlobalCpu | Cap::PoolCpu => CapUnit::MilliCpu,
            Cap::ScalerMemory | Cap::GlobalMemory | Cap::PoolMemory => CapUnit::Bytes,
        }
    }
}

impl fmt::Display for Cap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Cap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl CapUnit {
    /// An amount in this unit as an operator reads it: `3 agents`, `1500m`,
    /// `2g`.
    pub fn format(self, amount: u64) -> String {
        match self {
            CapUnit::Agents if amount == 1 => "1 agent".to_owned(),
            CapUnit::Agents => format!("{amount} agents"),
            CapUnit::MilliCpu => format!("{amount}m"),
            CapUnit::Bytes => MemoryBytes::from_bytes(amount).to_string(),
        }
    }
}

/// A request refused for now: `used + held + requested > limit` on `cap`.
/// Every amount is in the cap's unit (agents, milli-CPU, bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Refusal {
    pub cap: Cap,
    pub requested: u64,
    /// Reserved by live reservations (for a pool: by every process).
    pub used: u64,
    /// Set aside for older, starved pending requests.
    pub held: u64,
    pub limit: u64,
}

impl Refusal {
    /// How much must be released before the request fits.
    pub fn short_by(&self) -> u64 {
        let needed = u128::from(self.used) + u128::from(self.held) + u128::from(self.requested);
        u64::try_from(needed.saturating_sub(u128::from(self.limit))).unwrap_or(u64::MAX)
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let u = self.cap.unit();
        // "50 of 50 agents used" but "1500m of 2000m used": a count's unit
        // is said once, after the limit.
        let used = match u {
            CapUnit::Agents => self.used.to_string(),
            _ => u.format(self.used),
        };
        write!(
            f,
            "{}: needs {}, {used} of {} used",
            self.cap,
            u.format(self.requested),
            u.format(self.limit),
        )?;
        if self.held > 0 {
            write!(f, ", {} held for older requests", u.format(self.held))?;
        }
        let short = self.short_by();
        match u {
            CapUnit::Agents => write!(f, ", short by {short}"),
            _ => write!(f, ", short by {}", u.format(short)),
        }
    }
}

/// A request that can never fit: it alone exceeds the total of `cap`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TooLarge {
    pub cap: Cap,
    pub detail: String,
}

impl fmt::Display for TooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.cap, self.detail)
    }
}

/// The limits of one scope (global, a scaler, a pool); `None` = uncapped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Caps {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_agents: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cpu: Option<MilliCpu>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory: Option<MemoryBytes>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_api_strings() {
        let names: Vec<_> = Cap::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            names,
            [
                "global-count",
                "scaler-count",
                "scaler-cpu",
                "scaler-memory",
                "global-cpu",
                "global-memory",
                "pool-cpu",
                "pool-memory"
            ]
        );
        assert_eq!(
            serde_json::to_string(&Cap::PoolMemory).ok().as_deref(),
            Some("\"pool-memory\"")
        );
        let mut sorted = Cap::ALL;
        sorted.sort();
        assert_eq!(sorted, Cap::ALL, "declaration order is check order");
    }

    #[test]
    fn refusal_says_which_cap_and_by_how_much() {
        let r = Refusal {
            cap: Cap::ScalerCpu,
            requested: 1000,
            used: 1500,
            held: 0,
            limit: 2000,
        };
        assert_eq!(
            r.to_string(),
            "scaler-cpu: needs 1000m, 1500m of 2000m used, short by 500m"
        );
        let r = Refusal {
            cap: Cap::GlobalMemory,
            requested: 1 << 30,
            used: 3 << 29,
            held: 1 << 29,
            limit: 2 << 30,
        };
        assert_eq!(
            r.to_string(),
            "global-memory: needs 1g, 1536m of 2g used, 512m held for older requests, short by 1g"
        );
        let r = Refusal {
            cap: Cap::GlobalCount,
            requested: 1,
            used: 50,
            held: 0,
            limit: 50,
        };
        assert_eq!(
            r.to_string(),
            "global-count: needs 1 agent, 50 of 50 agents used, short by 1"
        );
    }
}
