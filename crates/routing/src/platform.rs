//! The host platform, the `kici:os:*` / `kici:arch:*` labels it implies, and
//! platform taints.
//!
//! A pool is *tainted* by a platform that is not the default one (Linux on
//! x64): only jobs whose labels name every taint token (`macos`, `windows`,
//! `arm64`) land on it, so that a generic job never ends up on an exotic
//! machine. Upstream 0.9 resolves a pool's platform as: the declared
//! `platform` field; else, for a bare-metal pool, the host's own platform (its
//! agents run on the host); else none (containers and microVMs are Linux
//! guests and are not tainted). Independently, a label set that names one of
//! the plain platform labels is tainted by it (the legacy rule, from before
//! `platform` existed).

use kici_model::{
    Label, LabelSet, PlatformArch, PlatformOs, ScalerEntry, ScalerPlatform, ScalerType,
    LEGACY_PLATFORM_TAINT_LABELS,
};
use serde::{Serialize, Serializer};
use std::fmt;

/// The platform routing derives os/arch auto labels from. Values use Rust's
/// `std::env::consts` names (`linux`, `macos`, `windows`, `x86_64`,
/// `aarch64`); upstream's Node names (`darwin`, `win32`, `x64`, `arm64`) are
/// accepted as aliases so either vocabulary gives the same labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPlatform {
    pub os: String,
    pub arch: String,
}

impl HostPlatform {
    pub fn new(os: impl Into<String>, arch: impl Into<String>) -> Self {
        Self {
            os: os.into(),
            arch: arch.into(),
        }
    }

    /// The platform this process runs on.
    pub fn current() -> Self {
        Self::new(std::env::consts::OS, std::env::consts::ARCH)
    }

    /// This host as a `platform` value, when upstream's vocabulary can name
    /// it (Linux, macOS or Windows on x64 or arm64); `None` otherwise, and a
    /// bare-metal pool on such a host is then not tainted.
    pub fn scaler_platform(&self) -> Option<ScalerPlatform> {
        let os = match self.os.to_ascii_lowercase().as_str() {
            "linux" => PlatformOs::Linux,
            "macos" | "darwin" => PlatformOs::Macos,
            "windows" | "win32" => PlatformOs::Windows,
            _ => return None,
        };
        let arch = match self.arch.to_ascii_lowercase().as_str() {
            "x86_64" | "x64" | "amd64" => PlatformArch::X64,
            "aarch64" | "arm64" => PlatformArch::Arm64,
            _ => return None,
        };
        Some(ScalerPlatform { os, arch })
    }

    /// `kici:os:*` labels for an agent of `kind` started from this host:
    /// bare-metal agents run on the host itself; containers and microVMs are
    /// always Linux guests.
    pub fn os_labels(&self, kind: ScalerType) -> Vec<Label> {
        let os = match kind {
            ScalerType::BareMetal => self.os.as_str(),
            ScalerType::Container | ScalerType::Firecracker => "linux",
            // Not started from this host; `os_arch_labels` gives none.
            ScalerType::Event => return Vec::new(),
        };
        // Linux (and any other OS) maps to the one label `kici:os:<os>`.
        let names: &[&str] = match os.to_ascii_lowercase().as_str() {
            "macos" | "darwin" => &["macos", "darwin"],
            "windows" | "win32" => &["windows", "win32"],
            _ => return vec![Label::auto("os", os)],
        };
        names.iter().map(|n| Label::auto("os", n)).collect()
    }

    /// `kici:arch:*` labels: guests share the host's architecture whatever
    /// the backend.
    pub fn arch_labels(&self) -> Vec<Label> {
        let names: &[&str] = match self.arch.to_ascii_lowercase().as_str() {
            "x86_64" | "x64" | "amd64" => &["x64", "amd64"],
            "aarch64" | "arm64" => &["arm64"],
            _ => return vec![Label::auto("arch", &self.arch)],
        };
        names.iter().map(|n| Label::auto("arch", n)).collect()
    }
}

/// Where a label set's platform taint comes from, for `route` to explain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TaintSource {
    /// The scaler's declared `platform` field.
    Platform,
    /// A bare-metal scaler without `platform`: its agents run on this host,
    /// whose platform it takes.
    Host,
    /// The label set names a plain platform label (`macos`, `windows`,
    /// `arm64`) itself.
    Label,
}

impl TaintSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Platform => "platform",
            Self::Host => "host",
            Self::Label => "label",
        }
    }
}

impl fmt::Display for TaintSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for TaintSource {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// A scaler's platform and where it comes from: declared, or (bare metal
/// only) this host's; `None` when neither applies.
pub(crate) fn resolve(
    scaler: &ScalerEntry,
    host: &HostPlatform,
) -> Option<(ScalerPlatform, TaintSource)> {
    match (scaler.platform, scaler.kind) {
        (Some(p), _) => Some((p, TaintSource::Platform)),
        (None, ScalerType::BareMetal) => host.scaler_platform().map(|p| (p, TaintSource::Host)),
        (None, _) => None,
    }
}

/// The `kici:os:*` and `kici:arch:*` labels of a scaler's agents: from its
/// declared platform (the agents' own, whatever the backend), else from the
/// host: the host's OS for bare metal, Linux for guests, on the host's
/// architecture.
pub(crate) fn os_arch_labels(scaler: &ScalerEntry, host: &HostPlatform) -> Vec<Label> {
    let declared;
    let (from, kind) = match scaler.platform {
        Some(p) => {
            declared = HostPlatform::new(p.os.as_str(), p.arch.as_str());
            (&declared, ScalerType::BareMetal)
        }
        // An event scaler's instances run elsewhere: this host says nothing
        // about them, and without a declared platform they carry no
        // platform labels.
        None if scaler.kind == ScalerType::Event => return Vec::new(),
        None => (host, scaler.kind),
    };
    let mut labels = from.os_labels(kind);
    labels.extend(from.arch_labels());
    labels
}

/// The legacy taints of one label set: the plain platform labels it names.
pub(crate) fn legacy_taints(labels: &LabelSet) -> impl Iterator<Item = &Label> {
    labels
        .iter()
        .filter(|l| LEGACY_PLATFORM_TAINT_LABELS.contains(&l.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(labels: Vec<Label>) -> Vec<String> {
        labels.into_iter().map(|l| l.to_string()).collect()
    }

    #[test]
    fn os_mapping() {
        let bm = ScalerType::BareMetal;
        assert_eq!(
            strings(HostPlatform::new("linux", "x86_64").os_labels(bm)),
            ["kici:os:linux"]
        );
        assert_eq!(
            strings(HostPlatform::new("macos", "aarch64").os_labels(bm)),
            ["kici:os:macos", "kici:os:darwin"]
        );
        assert_eq!(
            strings(HostPlatform::new("darwin", "arm64").os_labels(bm)),
            ["kici:os:macos", "kici:os:darwin"]
        );
        assert_eq!(
            strings(HostPlatform::new("windows", "x86_64").os_labels(bm)),
            ["kici:os:windows", "kici:os:win32"]
        );
        assert_eq!(
            strings(HostPlatform::new("FreeBSD", "x86_64").os_labels(bm)),
            ["kici:os:freebsd"]
        );
    }

    #[test]
    fn guests_are_linux_with_host_arch() {
        let mac = HostPlatform::new("macos", "aarch64");
        for kind in [ScalerType::Container, ScalerType::Firecracker] {
            assert_eq!(strings(mac.os_labels(kind)), ["kici:os:linux"]);
        }
        assert_eq!(strings(mac.arch_labels()), ["kici:arch:arm64"]);
    }

    #[test]
    fn arch_mapping() {
        let arch = |a: &str| strings(HostPlatform::new("linux", a).arch_labels());
        assert_eq!(arch("x86_64"), ["kici:arch:x64", "kici:arch:amd64"]);
        assert_eq!(arch("x64"), ["kici:arch:x64", "kici:arch:amd64"]);
        assert_eq!(arch("aarch64"), ["kici:arch:arm64"]);
        assert_eq!(arch("riscv64"), ["kici:arch:riscv64"]);
    }

    #[test]
    fn host_as_a_platform_value() {
        let p = |os: &str, arch: &str| {
            HostPlatform::new(os, arch)
                .scaler_platform()
                .map(|p| p.to_string())
        };
        assert_eq!(p("linux", "x86_64").as_deref(), Some("linux/x64"));
        assert_eq!(p("macos", "aarch64").as_deref(), Some("macos/arm64"));
        assert_eq!(p("darwin", "arm64").as_deref(), Some("macos/arm64"));
        assert_eq!(p("win32", "x64").as_deref(), Some("windows/x64"));
        assert_eq!(p("freebsd", "x86_64"), None);
        assert_eq!(p("linux", "riscv64"), None);
    }

    #[test]
    fn current_uses_std_consts() {
        let host = HostPlatform::current();
        assert_eq!(host.os, std::env::consts::OS);
        assert_eq!(host.arch, std::env::consts::ARCH);
    }
}
