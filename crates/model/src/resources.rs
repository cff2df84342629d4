//! Resource amounts in integer units.
//!
//! CPU is counted in milli-CPUs and memory in bytes so that sums are exact:
//! upstream adds floating-point cores and can refuse at the exact cap
//! (`0.1 + 0.2 > 0.3`). Parsing happens once, at the edge (config load, API
//! body); the admission layer only adds and compares integers.

use serde::{Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// Most cores a single request may name (upstream's schema bound).
pub const MAX_CPUS_PER_REQUEST: f64 = 256.0;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    #[error("Invalid memory format {0:?}: expected a number followed by k, m or g (e.g. \"512m\", \"1.5g\")")]
    InvalidMemory(String),
    #[error("memory {0:?} is too large")]
    MemoryOverflow(String),
    #[error("cpus must be a number greater than 0 and at most {MAX_CPUS_PER_REQUEST}, got {0}")]
    InvalidCpus(String),
    #[error(
        "memory {0:?} has a space in it: write the number and its unit together (e.g. \"1g\")"
    )]
    MemorySpace(String),
    #[error("memory {0:?} is below one page (4k): nothing can run in it")]
    MemoryBelowPage(String),
    #[error("cpus {0} is below the 0.001 (1 milli-CPU) resolution")]
    CpusTooSmall(String),
}

/// A number as a person reads it in an error: plain while it is short,
/// in scientific notation when plain would run to dozens of digits
/// (`1e308`, `1e-300`).
pub fn readable(value: f64) -> String {
    let plain = value.to_string();
    if plain.len() <= 16 {
        plain
    } else {
        format!("{value:e}")
    }
}

/// CPU in thousandths of a core.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MilliCpu(u64);

impl MilliCpu {
    pub const ZERO: Self = Self(0);

    pub const fn from_millis(m: u64) -> Self {
        Self(m)
    }

    pub const fn millis(self) -> u64 {
        self.0
    }

    /// Fractional cores as written in YAML/JSON (`0.5`, `2`): must be > 0 and
    /// ≤ 256. Rounded to the nearest milli-CPU; a value that rounds to 0 is an
    /// error rather than a silent "no request".
    pub fn from_cores(cores: f64) -> Result<Self, ResourceError> {
        if !cores.is_finite() || cores <= 0.0 || cores > MAX_CPUS_PER_REQUEST {
            return Err(ResourceError::InvalidCpus(readable(cores)));
        }
        let millis = (cores * 1000.0).round();
        if millis < 1.0 {
            return Err(ResourceError::CpusTooSmall(readable(cores)));
        }
        // In range: 1 ..= 256_000, exactly representable.
        Ok(Self(millis as u64))
    }

    /// A cap's `maxCpu`: > 0, no upper bound (a host pool may be large).
    pub fn cap_from_cores(cores: f64) -> Result<Self, ResourceError> {
        if !cores.is_finite() || cores <= 0.0 || cores > 1e12 {
            return Err(ResourceError::InvalidCpus(readable(cores)));
        }
        let millis = (cores * 1000.0).round();
        if millis < 1.0 {
            return Err(ResourceError::CpusTooSmall(readable(cores)));
        }
        Ok(Self(millis as u64))
    }

    pub fn as_cores(self) -> f64 {
        self.0 as f64 / 1000.0
    }

    pub fn saturating_sub(self, o: Self) -> Self {
        Self(self.0.saturating_sub(o.0))
    }

    pub fn checked_add(self, o: Self) -> Option<Self> {
        self.0.checked_add(o.0).map(Self)
    }
}

impl fmt::Display for MilliCpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_multiple_of(1000) {
            write!(f, "{}", self.0 / 1000)
        } else {
            write!(f, "{}m", self.0)
        }
    }
}

impl Serialize for MilliCpu {
    /// Serialised as cores (a JSON number), the unit operators write.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.as_cores())
    }
}

/// Memory in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemoryBytes(u64);

impl MemoryBytes {
    pub const ZERO: Self = Self(0);

    pub const fn from_bytes(b: u64) -> Self {
        Self(b)
    }

    pub const fn bytes(self) -> u64 {
        self.0
    }

    pub fn saturating_sub(self, o: Self) -> Self {
        Self(self.0.saturating_sub(o.0))
    }

    pub fn checked_add(self, o: Self) -> Option<Self> {
        self.0.checked_add(o.0).map(Self)
    }

    /// Whole MiB, rounded down (Firecracker's `mem_size_mib`).
    pub fn mib_floor(self) -> u64 {
        self.0 / (1024 * 1024)
    }
}

impl MemoryBytes {
    /// One page: the least memory a process can be given.
    pub const PAGE: Self = Self(4096);

    /// A job's memory request or limit as an API client or the command line
    /// gives it: the configuration grammar without its tolerance of blanks
    /// before the unit (`"1 g"` is a typo there, not a size), and at least
    /// one page.
    pub fn parse_request(s: &str) -> Result<Self, ResourceError> {
        if s.chars().any(char::is_whitespace) {
            return Err(ResourceError::MemorySpace(s.to_owned()));
        }
        let bytes: Self = s.parse()?;
        if bytes < Self::PAGE {
            return Err(ResourceError::MemoryBelowPage(s.to_owned()));
        }
        Ok(bytes)
    }
}

impl FromStr for MemoryBytes {
    type Err = ResourceError;

    /// Upstream's grammar, exactly: `DIGITS [ "." DIGITS ] WS* UNIT`, UNIT one
    /// of `k`, `m`, `g` (any case), bytes = floor(value × 1024^n). Computed in
    /// integers so `1.5g` is exact.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ResourceError::InvalidMemory(s.to_owned());
        let unit = s.chars().last().ok_or_else(bad)?;
        let multiplier: u128 = match unit.to_ascii_lowercase() {
            'k' => 1024,
            'm' => 1024 * 1024,
            'g' => 1024 * 1024 * 1024,
            _ => return Err(bad()),
        };
        let number = s[..s.len() - 1].trim_end_matches([' ', '\t']);
        let (int, frac) = match number.split_once('.') {
            Some((i, f)) => (i, Some(f)),
            None => (number, None),
        };
        let digits = |d: &str| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit());
        if !digits(int) || !frac.is_none_or(digits) {
            return Err(bad());
        }
        let overflow = || ResourceError::MemoryOverflow(s.to_owned());
        let int: u128 = int.parse().map_err(|_| overflow())?;
        let mut bytes = int.checked_mul(multiplier).ok_or_else(overflow)?;
        if let Some(frac) = frac {
            // Only the first 30 fractional digits can matter below 1 byte at
            // 1024^3; more would overflow 10^len.
            let frac = &frac[..frac.len().min(30)];
            let scale = 10u128.pow(frac.len() as u32);
            let f: u128 = frac.parse().map_err(|_| overflow())?;
            bytes = bytes
                .checked_add(f * multiplier / scale)
                .ok_or_else(overflow)?;
        }
        u64::try_from(bytes).map(Self).map_err(|_| overflow())
    }
}

impl fmt::Display for MemoryBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const G: u64 = 1 << 30;
        const M: u64 = 1 << 20;
        const K: u64 = 1 << 10;
        match self.0 {
            0 => write!(f, "0"),
            b if b % G == 0 => write!(f, "{}g", b / G),
            b if b % M == 0 => write!(f, "{}m", b / M),
            b if b % K == 0 => write!(f, "{}k", b / K),
            b => write!(f, "{b}B"),
        }
    }
}

impl Serialize for MemoryBytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// An amount of CPU and memory (a request, a usage sum, a free amount).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Resources {
    pub cpu: MilliCpu,
    pub memory: MemoryBytes,
}

impl Resources {
    pub const ZERO: Self = Self {
        cpu: MilliCpu::ZERO,
        memory: MemoryBytes::ZERO,
    };

    pub fn new(cpu: MilliCpu, memory: MemoryBytes) -> Self {
        Self { cpu, memory }
    }

    pub fn is_zero(&self) -> bool {
        *self == Self::ZERO
    }

    pub fn checked_add(self, o: Self) -> Option<Self> {
        Some(Self {
            cpu: self.cpu.checked_add(o.cpu)?,
            memory: self.memory.checked_add(o.memory)?,
        })
    }

    pub fn saturating_sub(self, o: Self) -> Self {
        Self {
            cpu: self.cpu.saturating_sub(o.cpu),
            memory: self.memory.saturating_sub(o.memory),
        }
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} cpu, {} memory", self.cpu, self.memory)
    }
}

/// One side (`requests` or `limits`) of a resource request; a missing
/// dimension falls through to the next layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<MilliCpu>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryBytes>,
}

impl ResourceSpec {
    pub fn is_empty(&self) -> bool {
        self.cpus.is_none() && self.memory.is_none()
    }
}

/// `requests` feed admission; `limits` feed kernel enforcement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<ResourceSpec>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<ResourceSpec>,
}

impl ResourceRequest {
    /// The flat shorthand `{cpus, memory}` means the same on both sides.
    pub fn flat(spec: ResourceSpec) -> Self {
        if spec.is_empty() {
            return Self::default();
        }
        Self {
            requests: Some(spec),
            limits: Some(spec),
        }
    }

    /// Upstream's mirroring rule: only requests → limits := requests; only
    /// limits → requests := limits; both → as is; neither → nothing.
    pub fn mirrored(&self) -> (Option<ResourceSpec>, Option<ResourceSpec>) {
        let req = self.requests.filter(|s| !s.is_empty());
        let lim = self.limits.filter(|s| !s.is_empty());
        match (req, lim) {
            (Some(r), None) => (Some(r), Some(r)),
            (None, Some(l)) => (Some(l), Some(l)),
            other => other,
        }
    }

    /// Requests must not exceed limits on any dimension both sides name.
    pub fn check_requests_within_limits(&self) -> Result<(), String> {
        let (Some(r), Some(l)) = (self.requests, self.limits) else {
            return Ok(());
        };
        if let (Some(rc), Some(lc)) = (r.cpus, l.cpus) {
            if rc > lc {
                return Err(format!("requests.cpus ({rc}) exceeds limits.cpus ({lc})"));
            }
        }
        if let (Some(rm), Some(lm)) = (r.memory, l.memory) {
            if rm > lm {
                return Err(format!(
                    "requests.memory ({rm}) exceeds limits.memory ({lm})"
                ));
            }
        }
        Ok(())
    }
}

/// A cap on summed requests; an unset dimension is uncapped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceCap {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cpu: Option<MilliCpu>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory: Option<MemoryBytes>,
}

/// What an agent reserves (`requests`, for caps) and what the backend enforces
/// (`limits`; zero on a dimension = no limit from the engine).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EffectiveResources {
    pub requests: Resources,
    pub limits: Resources,
}

impl EffectiveResources {
    /// Resolves job → label set → defaults, per side and per dimension, each
    /// layer mirrored first (upstream `resolveEffective`). Nothing anywhere → 0.
    pub fn resolve(layers: &[Option<&ResourceRequest>]) -> Self {
        type Sides = (Option<ResourceSpec>, Option<ResourceSpec>);
        let mirrored: Vec<Sides> = layers.iter().flatten().map(|r| r.mirrored()).collect();
        let pick = |side: fn(&Sides) -> Option<ResourceSpec>| {
            let cpu = mirrored
                .iter()
                .find_map(|m| side(m).and_then(|s| s.cpus))
                .unwrap_or_default();
            let memory = mirrored
                .iter()
                .find_map(|m| side(m).and_then(|s| s.memory))
                .unwrap_or_default();
            Resources { cpu, memory }
        };
        Self {
            requests: pick(|m| m.0),
            limits: pick(|m| m.1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn request_memory_refuses_blanks_and_less_than_a_page() {
        assert_eq!(
            MemoryBytes::parse_request("1 g"),
            Err(ResourceError::MemorySpace("1 g".into()))
        );
        assert_eq!(
            MemoryBytes::parse_request("1k"),
            Err(ResourceError::MemoryBelowPage("1k".into()))
        );
        assert_eq!(MemoryBytes::parse_request("4k"), Ok(MemoryBytes::PAGE));
        assert_eq!(
            MemoryBytes::parse_request("1g"),
            Ok(MemoryBytes::from_bytes(1 << 30))
        );
        // The configuration grammar is unchanged.
        assert_eq!("1 g".parse(), Ok(MemoryBytes::from_bytes(1 << 30)));
    }

    #[test]
    fn huge_and_tiny_numbers_in_errors_are_readable() {
        let e = MilliCpu::from_cores(1e308).unwrap_err().to_string();
        assert!(e.ends_with("got 1e308"), "{e}");
        let e = MilliCpu::from_cores(1e-300).unwrap_err().to_string();
        assert!(e.contains("1e-300"), "{e}");
        assert_eq!(readable(0.5), "0.5");
        assert_eq!(readable(512.0), "512");
    }

    fn mem(s: &str) -> Result<u64, ResourceError> {
        s.parse::<MemoryBytes>().map(MemoryBytes::bytes)
    }

    #[test]
    fn memory_grammar_matches_upstream() {
        assert_eq!(mem("512m"), Ok(536_870_912));
        assert_eq!(mem("512M"), Ok(536_870_912));
        assert_eq!(mem("2g"), Ok(2_147_483_648));
        assert_eq!(mem("2G"), Ok(2_147_483_648));
        assert_eq!(mem("1024k"), Ok(1_048_576));
        assert_eq!(mem("1.5g"), Ok(1_610_612_736));
        assert_eq!(mem("0m"), Ok(0));
        assert_eq!(mem("512 m"), Ok(536_870_912));
        for bad in [
            "512", "abc", "", "512b", "1Gi", "1t", " 1g", "1g ", "-1g", "1.g", ".5g", "+1g",
        ] {
            let err = mem(bad).unwrap_err();
            assert!(
                err.to_string().contains("Invalid memory format"),
                "{bad}: {err}"
            );
        }
        assert!(matches!(
            mem("99999999999999999999g"),
            Err(ResourceError::MemoryOverflow(_))
        ));
    }

    #[test]
    fn cpus_are_integer_millis() {
        assert_eq!(MilliCpu::from_cores(0.5).unwrap().millis(), 500);
        assert_eq!(
            MilliCpu::from_cores(0.1).unwrap().millis()
                + MilliCpu::from_cores(0.2).unwrap().millis(),
            300
        );
        assert!(MilliCpu::from_cores(0.0).is_err());
        assert!(MilliCpu::from_cores(-1.0).is_err());
        assert!(MilliCpu::from_cores(257.0).is_err());
        assert!(MilliCpu::from_cores(f64::NAN).is_err());
        assert!(matches!(
            MilliCpu::from_cores(0.0001),
            Err(ResourceError::CpusTooSmall(_))
        ));
        assert_eq!(MilliCpu::from_millis(1500).to_string(), "1500m");
        assert_eq!(MilliCpu::from_millis(2000).to_string(), "2");
    }

    fn spec(cpu: Option<u64>, mem: Option<u64>) -> ResourceSpec {
        ResourceSpec {
            cpus: cpu.map(MilliCpu::from_millis),
            memory: mem.map(MemoryBytes::from_bytes),
        }
    }

    #[test]
    fn resolution_mirrors_and_mixes_per_field() {
        // Job gives requests.cpus only ⇒ mirrored to limits.cpus; memory from the label set.
        let job = ResourceRequest {
            requests: Some(spec(Some(500), None)),
            limits: None,
        };
        let ls = ResourceRequest::flat(spec(Some(2000), Some(1 << 30)));
        let eff = EffectiveResources::resolve(&[Some(&job), Some(&ls), None]);
        assert_eq!(
            eff.requests,
            Resources::new(MilliCpu::from_millis(500), MemoryBytes::from_bytes(1 << 30))
        );
        assert_eq!(eff.limits, eff.requests);
        // Limits-only reserves the limits.
        let job = ResourceRequest {
            requests: None,
            limits: Some(spec(Some(2000), None)),
        };
        let eff = EffectiveResources::resolve(&[Some(&job)]);
        assert_eq!(eff.requests.cpu.millis(), 2000);
        // Nothing anywhere ⇒ zero.
        assert_eq!(
            EffectiveResources::resolve(&[None, None, None]),
            EffectiveResources::default()
        );
    }

    #[test]
    fn requests_within_limits() {
        let ok = ResourceRequest {
            requests: Some(spec(Some(1000), None)),
            limits: Some(spec(Some(2000), None)),
        };
        assert!(ok.check_requests_within_limits().is_ok());
        let bad = ResourceRequest {
            requests: Some(spec(None, Some(2))),
            limits: Some(spec(None, Some(1))),
        };
        assert!(bad
            .check_requests_within_limits()
            .unwrap_err()
            .contains("requests.memory"));
    }

    proptest! {
        #[test]
        fn memory_parse_never_panics(s in "\\PC{0,24}") {
            let _ = s.parse::<MemoryBytes>();
        }

        #[test]
        fn memory_integer_parse_is_exact(n in 0u64..1_000_000, unit in prop::sample::select(vec![('k', 10u32), ('m', 20), ('g', 30)])) {
            let parsed = format!("{n}{}", unit.0).parse::<MemoryBytes>().unwrap();
            prop_assert_eq!(parsed.bytes(), n << unit.1);
        }
    }
}
