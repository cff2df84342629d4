//! Identifiers: agents, jobs, scalers, daemon instances.

use rand::RngCore;
use serde::{Serialize, Serializer};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("agent id {0:?} is not of the form scaler-<container|bare-metal|firecracker>-<8 lowercase hex>")]
    AgentId(String),
    #[error("job id must be 1 to {max} printable characters without whitespace, got {0:?}", max = JobId::MAX_LEN)]
    JobId(String),
    #[error("instance id {0:?} is not 8 lowercase hex characters")]
    InstanceId(String),
    #[error("unknown scaler type {0:?}: expected container, bare-metal or firecracker")]
    ScalerType(String),
}

/// The three backends. `kubernetes` is reserved upstream and rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScalerType {
    Container,
    BareMetal,
    Firecracker,
    /// No local compute: an operator's provisioner boots the agent elsewhere.
    Event,
}

impl ScalerType {
    pub const ALL: [ScalerType; 4] = [
        Self::Container,
        Self::BareMetal,
        Self::Firecracker,
        Self::Event,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Container => "container",
            Self::BareMetal => "bare-metal",
            Self::Firecracker => "firecracker",
            Self::Event => "event",
        }
    }
}

impl fmt::Display for ScalerType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ScalerType {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| IdError::ScalerType(s.to_owned()))
    }
}

impl Serialize for ScalerType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// `scaler-<type>-<8 hex>`: KiCI's agent id format. The Firecracker backend
/// derives TAP names from the 8 hex digits, so they are kept as bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentId {
    kind: ScalerType,
    suffix: [u8; 4],
}

impl AgentId {
    pub fn new(kind: ScalerType, suffix: [u8; 4]) -> Self {
        Self { kind, suffix }
    }

    /// A fresh random id. Only 32 random bits (the contract's format), so the
    /// engine checks collisions against every live id at admission.
    pub fn random(kind: ScalerType) -> Self {
        let mut suffix = [0u8; 4];
        rand::thread_rng().fill_bytes(&mut suffix);
        Self { kind, suffix }
    }

    pub fn kind(&self) -> ScalerType {
        self.kind
    }

    /// The 8 lowercase hex digits (TAP names use them).
    pub fn suffix_hex(&self) -> String {
        hex::encode(self.suffix)
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "scaler-{}-{}", self.kind, hex::encode(self.suffix))
    }
}

impl FromStr for AgentId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || IdError::AgentId(s.to_owned());
        let rest = s.strip_prefix("scaler-").ok_or_else(bad)?;
        let (kind, hex8) = rest.rsplit_once('-').ok_or_else(bad)?;
        let kind: ScalerType = kind.parse().map_err(|_| bad())?;
        if hex8.len() != 8 || !hex8.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(bad());
        }
        let mut suffix = [0u8; 4];
        hex::decode_to_slice(hex8, &mut suffix).map_err(|_| bad())?;
        Ok(Self { kind, suffix })
    }
}

impl Serialize for AgentId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// The caller's job identifier (the orchestrator's queue id, or ours in
/// standalone mode). Opaque, bounded, printable.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(Arc<str>);

impl JobId {
    pub const MAX_LEN: usize = 256;

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for JobId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty()
            || s.len() > Self::MAX_LEN
            || s.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(IdError::JobId(s.to_owned()));
        }
        Ok(Self(Arc::from(s)))
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for JobId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// A scaler entry's `name` (unique within a config).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScalerName(Arc<str>);

impl ScalerName {
    pub fn new(s: &str) -> Self {
        Self(Arc::from(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ScalerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for ScalerName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl std::borrow::Borrow<str> for ScalerName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// A daemon instance: 8 lowercase hex, persisted in the state dir. Every
/// resource and row kici-scaler creates carries it as its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId([u8; 4]);

impl InstanceId {
    pub fn random() -> Self {
        let mut b = [0u8; 4];
        rand::thread_rng().fill_bytes(&mut b);
        Self(b)
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl FromStr for InstanceId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || IdError::InstanceId(s.to_owned());
        if s.len() != 8 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(bad());
        }
        let mut b = [0u8; 4];
        hex::decode_to_slice(s, &mut b).map_err(|_| bad())?;
        Ok(Self(b))
    }
}

impl Serialize for InstanceId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_id_round_trips() {
        for kind in ScalerType::ALL {
            let id = AgentId::random(kind);
            let s = id.to_string();
            assert!(s.starts_with(&format!("scaler-{kind}-")));
            assert_eq!(s.parse::<AgentId>().unwrap(), id);
            assert_eq!(id.suffix_hex().len(), 8);
        }
        assert_eq!(
            "scaler-bare-metal-0a1b2c3d"
                .parse::<AgentId>()
                .unwrap()
                .suffix_hex(),
            "0a1b2c3d"
        );
        for bad in [
            "scaler-docker-0a1b2c3d",
            "scaler-container-0A1B2C3D",
            "scaler-container-0a1b2c3",
            "container-0a1b2c3d",
            "",
        ] {
            assert!(bad.parse::<AgentId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn job_and_instance_ids() {
        assert!("job-1".parse::<JobId>().is_ok());
        assert!("".parse::<JobId>().is_err());
        assert!("a b".parse::<JobId>().is_err());
        assert!("x".repeat(257).parse::<JobId>().is_err());
        let i = InstanceId::random();
        assert_eq!(i.to_string().parse::<InstanceId>().unwrap(), i);
        assert!("ABCDEF01".parse::<InstanceId>().is_err());
    }
}
