//! The host platform, and the `kici:os:*` / `kici:arch:*` labels it implies.

use kici_model::{Label, ScalerType};

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

    /// `kici:os:*` labels for an agent of `kind` started from this host:
    /// bare-metal agents run on the host itself; containers and microVMs are
    /// always Linux guests.
    pub fn os_labels(&self, kind: ScalerType) -> Vec<Label> {
        let os = match kind {
            ScalerType::BareMetal => self.os.as_str(),
            ScalerType::Container | ScalerType::Firecracker => "linux",
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
    fn current_uses_std_consts() {
        let host = HostPlatform::current();
        assert_eq!(host.os, std::env::consts::OS);
        assert_eq!(host.arch, std::env::consts::ARCH);
    }
}
