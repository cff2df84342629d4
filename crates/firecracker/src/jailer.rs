//! The jailer's command line (Firecracker `docs/jailer.md`).
//!
//! `<jailer> --id <agent id> --exec-file <firecracker> --uid <uid> --gid <gid>
//! --chroot-base-dir <base> [--cgroup-version N --parent-cgroup P --cgroup k=v …]
//! --new-pid-ns -- --api-sock /run/firecracker.socket`
//!
//! No `--config-file`: the VM is configured and started over the API, so MMDS
//! is populated before the guest runs. No `--daemonize`: stdout and stderr
//! carry the serial console into the log file we follow. Under
//! `--new-pid-ns` the jailer writes Firecracker's pid to
//! `<root>/<exec name>.pid` and exits at once; the VM is followed by that
//! pid (with its start time), never by the jailer's lifetime.

use crate::names::API_SOCKET_IN_JAIL;
use kici_model::AgentId;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Cgroup placement the jailer applies to each VM (optional).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailerCgroups {
    pub version: CgroupVersion,
    /// `--parent-cgroup`; the jailer defaults it to the exec file name.
    pub parent: Option<String>,
    /// `--cgroup <file>=<value>`, e.g. `cpu.max=100000 100000`.
    pub settings: Vec<String>,
    /// Where the hierarchy is mounted (v2: the unified mount; v1: the
    /// directory holding one mount per controller), so destroy can remove
    /// the VM's cgroup directories, which the jailer never does.
    pub mount: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

impl CgroupVersion {
    fn as_arg(self) -> &'static str {
        match self {
            Self::V1 => "1",
            Self::V2 => "2",
        }
    }
}

impl JailerCgroups {
    /// The VM's cgroup directories the jailer created: v2
    /// `<mount>/<parent>/<id>`, v1 `<mount>/<controller>/<parent>/<id>` for
    /// each controller named in the settings.
    pub fn vm_dirs(&self, exec_name: &str, agent: &AgentId) -> Vec<PathBuf> {
        let parent = self.parent.as_deref().unwrap_or(exec_name);
        let leaf = |base: PathBuf| base.join(parent).join(agent.to_string());
        match self.version {
            CgroupVersion::V2 => vec![leaf(self.mount.clone())],
            CgroupVersion::V1 => {
                let mut controllers: Vec<&str> = self
                    .settings
                    .iter()
                    .filter_map(|s| s.split_once('.').map(|(c, _)| c))
                    .collect();
                controllers.sort_unstable();
                controllers.dedup();
                controllers
                    .into_iter()
                    .map(|c| leaf(self.mount.join(c)))
                    .collect()
            }
        }
    }
}

/// Everything the jailer is told about one VM.
#[derive(Debug, Clone)]
pub struct JailerArgs<'a> {
    pub agent: &'a AgentId,
    pub firecracker: &'a Path,
    pub uid: u32,
    pub gid: u32,
    pub chroot_base: &'a Path,
    pub cgroups: Option<&'a JailerCgroups>,
}

impl JailerArgs<'_> {
    /// The argv after the program name.
    pub fn argv(&self) -> Vec<OsString> {
        let mut argv: Vec<OsString> = vec![
            "--id".into(),
            self.agent.to_string().into(),
            "--exec-file".into(),
            self.firecracker.as_os_str().to_owned(),
            "--uid".into(),
            self.uid.to_string().into(),
            "--gid".into(),
            self.gid.to_string().into(),
            "--chroot-base-dir".into(),
            self.chroot_base.as_os_str().to_owned(),
        ];
        if let Some(cg) = self.cgroups {
            argv.push("--cgroup-version".into());
            argv.push(cg.version.as_arg().into());
            if let Some(parent) = &cg.parent {
                argv.push("--parent-cgroup".into());
                argv.push(parent.into());
            }
            for setting in &cg.settings {
                argv.push("--cgroup".into());
                argv.push(setting.into());
            }
        }
        argv.push("--new-pid-ns".into());
        argv.push("--".into());
        argv.push("--api-sock".into());
        argv.push(API_SOCKET_IN_JAIL.into());
        argv
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn firecracker_jailer_argv_is_exact() {
        let agent: AgentId = "scaler-firecracker-1d993749".parse().unwrap();
        let args = JailerArgs {
            agent: &agent,
            firecracker: Path::new("/usr/bin/firecracker"),
            uid: 10000,
            gid: 10001,
            chroot_base: Path::new("/srv/jailer"),
            cgroups: None,
        };
        let argv: Vec<String> = args
            .argv()
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            argv,
            [
                "--id",
                "scaler-firecracker-1d993749",
                "--exec-file",
                "/usr/bin/firecracker",
                "--uid",
                "10000",
                "--gid",
                "10001",
                "--chroot-base-dir",
                "/srv/jailer",
                "--new-pid-ns",
                "--",
                "--api-sock",
                "/run/firecracker.socket"
            ]
        );
        assert!(!argv
            .iter()
            .any(|a| a == "--config-file" || a == "--daemonize"));
    }

    #[test]
    fn firecracker_jailer_cgroup_options_and_their_directories() {
        let agent: AgentId = "scaler-firecracker-1d993749".parse().unwrap();
        let cg = JailerCgroups {
            version: CgroupVersion::V1,
            parent: Some("kici".into()),
            settings: vec![
                "cpu.shares=512".into(),
                "memory.limit_in_bytes=1073741824".into(),
                "cpu.cfs_quota_us=100000".into(),
            ],
            mount: PathBuf::from("/sys/fs/cgroup"),
        };
        let args = JailerArgs {
            agent: &agent,
            firecracker: Path::new("/usr/bin/firecracker"),
            uid: 1,
            gid: 1,
            chroot_base: Path::new("/srv/jailer"),
            cgroups: Some(&cg),
        };
        let argv: Vec<String> = args
            .argv()
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        let at = argv.iter().position(|a| a == "--cgroup-version").unwrap();
        assert_eq!(
            &argv[at..at + 10],
            [
                "--cgroup-version",
                "1",
                "--parent-cgroup",
                "kici",
                "--cgroup",
                "cpu.shares=512",
                "--cgroup",
                "memory.limit_in_bytes=1073741824",
                "--cgroup",
                "cpu.cfs_quota_us=100000"
            ]
        );
        assert!(at < argv.iter().position(|a| a == "--").unwrap());
        assert_eq!(
            cg.vm_dirs("firecracker", &agent),
            [
                PathBuf::from("/sys/fs/cgroup/cpu/kici/scaler-firecracker-1d993749"),
                PathBuf::from("/sys/fs/cgroup/memory/kici/scaler-firecracker-1d993749"),
            ]
        );
        let v2 = JailerCgroups {
            version: CgroupVersion::V2,
            parent: None,
            settings: vec![],
            mount: PathBuf::from("/sys/fs/cgroup/unified"),
        };
        assert_eq!(
            v2.vm_dirs("firecracker", &agent),
            [PathBuf::from(
                "/sys/fs/cgroup/unified/firecracker/scaler-firecracker-1d993749"
            )]
        );
    }
}
