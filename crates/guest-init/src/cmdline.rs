//! What `/init` takes from the kernel command line.
//!
//! The scaler boots guests with `ip=<vm ip>::<gateway>:<netmask>::eth0:off`
//! (the kernel configures `eth0` itself); the kernel's `ip=` syntax
//! `client:server:gateway:netmask:hostname:device:autoconf:dns0:dns1:ntp0`
//! can also carry a hostname and resolvers. `kici.*` parameters tune the
//! init for other hosts and for tests:
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | `kici.overlay=/dev/vdX\|tmpfs\|none` | the writable layer over the read-only root | `/dev/vdb` (the scaler's overlay drive) |
//! | `kici.overlay_fstype=T` | filesystem of a block-device overlay | `ext4` |
//! | `kici.dns=IP[,IP…]` | resolvers for `/etc/resolv.conf` | `ip=` dns fields, else 1.1.1.1, 8.8.8.8 |
//! | `kici.mmds=IP:PORT` | where MMDS answers | `169.254.169.254:80` |
//! | `kici.mmds_timeout=S` | how long to wait for the bootstrap | 60 |
//! | `kici.agent=PATH` | the agent binary | `/usr/local/bin/kici-agent-lite` |

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// The agent's path in the rootfs `kici-scaler firecracker rootfs` builds.
pub const DEFAULT_AGENT: &str = "/usr/local/bin/kici-agent-lite";
/// The scaler attaches the overlay as the second virtio-blk drive.
pub const DEFAULT_OVERLAY_DEVICE: &str = "/dev/vdb";
/// The resolvers the upstream guest `/init` writes when none are given.
pub const DEFAULT_DNS: [Ipv4Addr; 2] = [Ipv4Addr::new(1, 1, 1, 1), Ipv4Addr::new(8, 8, 8, 8)];

/// Where the writable layer over the read-only root lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OverlaySource {
    /// A block device formatted with `fstype` (the scaler's overlay drive).
    Block { device: PathBuf, fstype: String },
    /// Memory: writes vanish with the VM (no overlay drive).
    Tmpfs,
    /// No overlay: the root stays as the kernel mounted it.
    None,
}

/// The init's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitConfig {
    pub overlay: OverlaySource,
    pub dns: Vec<Ipv4Addr>,
    /// From `ip=`; the agent id from MMDS wins.
    pub hostname: Option<String>,
    pub mmds: SocketAddr,
    pub mmds_timeout: Duration,
    pub agent: PathBuf,
}

/// A parameter `/init` cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kernel command line: {param}: {reason}")]
pub struct CmdlineError {
    pub param: String,
    pub reason: String,
}

fn bad(param: &str, reason: impl Into<String>) -> CmdlineError {
    CmdlineError {
        param: param.to_owned(),
        reason: reason.into(),
    }
}

/// Splits a command line into parameters the way the kernel does:
/// whitespace separates, double quotes group (and are dropped).
pub fn split(cmdline: &str) -> Vec<String> {
    let mut params = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut started = false;
    for c in cmdline.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                started = true;
            }
            c if c.is_whitespace() && !quoted => {
                if started {
                    params.push(std::mem::take(&mut current));
                    started = false;
                }
            }
            c => {
                current.push(c);
                started = true;
            }
        }
    }
    if started {
        params.push(current);
    }
    params
}

/// Parses the settings out of a command line.
pub fn parse(cmdline: &str) -> Result<InitConfig, CmdlineError> {
    let mut overlay_device: Option<String> = None;
    let mut overlay_fstype = "ext4".to_owned();
    let mut dns_from_kici: Option<Vec<Ipv4Addr>> = None;
    let mut dns_from_ip: Vec<Ipv4Addr> = Vec::new();
    let mut hostname = None;
    let mut mmds = kici_agent_lite::mmds::DEFAULT_ADDRESS;
    let mut mmds_timeout = Duration::from_secs(60);
    let mut agent = PathBuf::from(DEFAULT_AGENT);
    for param in split(cmdline) {
        let Some((key, value)) = param.split_once('=') else {
            continue;
        };
        match key {
            "ip" => {
                let fields: Vec<&str> = value.split(':').collect();
                if let Some(h) = fields.get(4).filter(|h| !h.is_empty()) {
                    hostname = Some((*h).to_owned());
                }
                for field in fields.iter().skip(7).take(2).filter(|f| !f.is_empty()) {
                    dns_from_ip.push(field.parse().map_err(|_| {
                        bad(
                            &param,
                            format!("dns field {field:?} is not an IPv4 address"),
                        )
                    })?);
                }
            }
            "kici.overlay" => overlay_device = Some(value.to_owned()),
            "kici.overlay_fstype" if !value.is_empty() => overlay_fstype = value.to_owned(),
            "kici.dns" => {
                let servers = value
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse::<Ipv4Addr>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| bad(&param, "expected IPv4 addresses separated by commas"))?;
                dns_from_kici = Some(servers);
            }
            "kici.mmds" => {
                mmds = value.parse().map_err(|_| bad(&param, "expected IP:PORT"))?;
            }
            "kici.mmds_timeout" => {
                let secs = value
                    .parse::<u64>()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or_else(|| bad(&param, "expected a positive number of seconds"))?;
                mmds_timeout = Duration::from_secs(secs);
            }
            "kici.agent" => {
                if !value.starts_with('/') {
                    return Err(bad(&param, "expected an absolute path"));
                }
                agent = PathBuf::from(value);
            }
            _ => {}
        }
    }
    let overlay = match overlay_device.as_deref() {
        None => OverlaySource::Block {
            device: PathBuf::from(DEFAULT_OVERLAY_DEVICE),
            fstype: overlay_fstype,
        },
        Some("none") => OverlaySource::None,
        Some("tmpfs") => OverlaySource::Tmpfs,
        Some(dev) if dev.starts_with("/dev/") => OverlaySource::Block {
            device: PathBuf::from(dev),
            fstype: overlay_fstype,
        },
        Some(other) => {
            return Err(bad(
                &format!("kici.overlay={other}"),
                "expected /dev/<device>, tmpfs or none",
            ))
        }
    };
    let dns = match dns_from_kici {
        Some(servers) if !servers.is_empty() => servers,
        _ if !dns_from_ip.is_empty() => dns_from_ip,
        _ => DEFAULT_DNS.to_vec(),
    };
    Ok(InitConfig {
        overlay,
        dns,
        hostname,
        mmds,
        mmds_timeout,
        agent,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_scalers_boot_args_give_the_defaults() {
        let cfg = parse(
            "console=ttyS0 reboot=k panic=1 pci=off i8042.noaux init=/init \
             ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off root=/dev/vda ro",
        )
        .unwrap();
        assert_eq!(
            cfg,
            InitConfig {
                overlay: OverlaySource::Block {
                    device: "/dev/vdb".into(),
                    fstype: "ext4".into()
                },
                dns: DEFAULT_DNS.to_vec(),
                hostname: None,
                mmds: "169.254.169.254:80".parse().unwrap(),
                mmds_timeout: Duration::from_secs(60),
                agent: DEFAULT_AGENT.into(),
            }
        );
    }

    #[test]
    fn ip_hostname_and_dns_fields_are_used_and_kici_dns_wins() {
        let cfg = parse("ip=10.0.0.2::10.0.0.1:255.255.255.0:vm1:eth0:off:9.9.9.9:149.112.112.112")
            .unwrap();
        assert_eq!(cfg.hostname.as_deref(), Some("vm1"));
        assert_eq!(
            cfg.dns,
            [Ipv4Addr::new(9, 9, 9, 9), Ipv4Addr::new(149, 112, 112, 112)]
        );
        let cfg =
            parse("ip=10.0.0.2::10.0.0.1:255.255.255.0:vm1:eth0:off:9.9.9.9 kici.dns=10.0.0.1")
                .unwrap();
        assert_eq!(cfg.dns, [Ipv4Addr::new(10, 0, 0, 1)]);
    }

    #[test]
    fn kici_parameters_override_and_bad_values_are_errors() {
        let cfg = parse(
            "kici.overlay=tmpfs kici.mmds=127.0.0.1:8080 kici.mmds_timeout=5 \
             kici.agent=/bin/agent",
        )
        .unwrap();
        assert_eq!(cfg.overlay, OverlaySource::Tmpfs);
        assert_eq!(cfg.mmds, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(cfg.mmds_timeout, Duration::from_secs(5));
        assert_eq!(cfg.agent, PathBuf::from("/bin/agent"));
        assert_eq!(
            parse("kici.overlay=none").unwrap().overlay,
            OverlaySource::None
        );
        assert_eq!(
            parse("kici.overlay=/dev/vdc kici.overlay_fstype=xfs")
                .unwrap()
                .overlay,
            OverlaySource::Block {
                device: "/dev/vdc".into(),
                fstype: "xfs".into()
            }
        );
        for bad in [
            "kici.overlay=vdb",
            "kici.dns=1.1.1",
            "kici.mmds=169.254.169.254",
            "kici.mmds_timeout=0",
            "kici.agent=relative",
            "ip=1.2.3.4::::::off:nope",
        ] {
            assert!(parse(bad).is_err(), "{bad} should be refused");
        }
    }

    #[test]
    fn quotes_group_and_whitespace_separates() {
        assert_eq!(
            split("  a=1 \"b=x y\"\tc=\"\"  d"),
            ["a=1", "b=x y", "c=", "d"]
        );
        assert!(split("").is_empty());
    }
}
