//! TAP devices and links: created with the tun ioctls (rtnetlink cannot make
//! a persistent TAP owned by a user), then attached, tagged and brought up
//! over rtnetlink.
//!
//! A VM's TAP is persistent (it outlives the descriptor we create it with,
//! until destroy deletes it) and owned by the jailer uid/gid, so only
//! Firecracker running as that user can attach to it (upstream's unowned
//! TAPs could be taken by any local user; docs/deviations.md, D-fc-tap-owner). It is a bridge port with
//! `isolated on` (no frames to other isolated ports: VM-to-VM traffic
//! never crosses the bridge) and carries the owner tag as its ifalias.

use futures_util::TryStreamExt;
use rtnetlink::packet_route::link::{
    InfoBridgePort, InfoPortData, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::{Handle, LinkBridge, LinkBridgePort, LinkUnspec};
use std::net::Ipv4Addr;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("cannot create TAP {name}: {step}: {source}")]
    Tun {
        name: String,
        step: &'static str,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Netlink {
        what: String,
        source: rtnetlink::Error,
    },
    #[error("no interface named {0}")]
    Missing(String),
    #[error("cannot open a netlink socket: {0}")]
    Socket(std::io::Error),
}

/// One link as the host reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub alias: Option<String>,
    pub up: bool,
    pub controller: Option<u32>,
    /// `Some(isolated)` for bridge ports.
    pub isolated: Option<bool>,
}

/// Creates the persistent TAP `name` owned by `uid:gid`, with the flags
/// Firecracker opens it with (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`).
pub fn create_tap(name: &str, uid: u32, gid: u32) -> Result<(), LinkError> {
    tun::create_persistent(name, uid, gid)
}

/// rtnetlink, on a connection driven by the current tokio runtime.
#[derive(Clone)]
pub struct Netlink {
    handle: Handle,
}

fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> LinkError {
    let what = what.into();
    move |source| LinkError::Netlink { what, source }
}

/// Is this the kernel saying "no such device"?
pub fn is_no_device(e: &LinkError) -> bool {
    match e {
        LinkError::Missing(_) => true,
        LinkError::Netlink {
            source: rtnetlink::Error::NetlinkError(m),
            ..
        } => m
            .code
            .is_some_and(|c| c.get() == -libc::ENODEV || c.get() == -libc::ENOENT),
        _ => false,
    }
}

fn is_exists(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.code.is_some_and(|c| c.get() == -libc::EEXIST))
}

impl Netlink {
    /// Opens a connection; must run inside a tokio runtime.
    pub fn connect() -> Result<Self, LinkError> {
        let (connection, handle, _) = rtnetlink::new_connection().map_err(LinkError::Socket)?;
        tokio::spawn(connection);
        Ok(Self { handle })
    }

    pub async fn get(&self, name: &str) -> Result<Option<Link>, LinkError> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        match links.try_next().await {
            Ok(Some(msg)) => Ok(Some(to_link(&msg))),
            Ok(None) => Ok(None),
            Err(e) => {
                let err = nl(format!("cannot read link {name}"))(e);
                if is_no_device(&err) {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    pub async fn list(&self) -> Result<Vec<Link>, LinkError> {
        let mut out = Vec::new();
        let mut links = self.handle.link().get().execute();
        while let Some(msg) = links.try_next().await.map_err(nl("cannot list links"))? {
            out.push(to_link(&msg));
        }
        Ok(out)
    }

    async fn index(&self, name: &str) -> Result<u32, LinkError> {
        self.get(name)
            .await?
            .map(|l| l.index)
            .ok_or_else(|| LinkError::Missing(name.to_owned()))
    }

    /// Makes `tap` an isolated port of `bridge`, tags it with `alias`, and
    /// brings it up.
    pub async fn attach_tap(&self, tap: &str, bridge: &str, alias: &str) -> Result<(), LinkError> {
        let bridge_index = self.index(bridge).await?;
        let index = self.index(tap).await?;
        self.handle
            .link()
            .set(
                LinkUnspec::new_with_index(index)
                    .alias(alias)
                    .controller(bridge_index)
                    .build(),
            )
            .execute()
            .await
            .map_err(nl(format!("cannot attach {tap} to {bridge}")))?;
        self.handle
            .link()
            .set_port(LinkBridgePort::new(index).isolated(true).build())
            .execute()
            .await
            .map_err(nl(format!("cannot isolate bridge port {tap}")))?;
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(nl(format!("cannot bring {tap} up")))
    }

    /// Deletes a link; `Ok(false)` when there was none.
    pub async fn delete(&self, name: &str) -> Result<bool, LinkError> {
        let index = match self.index(name).await {
            Ok(i) => i,
            Err(e) if is_no_device(&e) => return Ok(false),
            Err(e) => return Err(e),
        };
        match self.handle.link().del(index).execute().await {
            Ok(()) => Ok(true),
            Err(e) => {
                let err = nl(format!("cannot delete {name}"))(e);
                if is_no_device(&err) {
                    Ok(false)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Creates the bridge if missing (an existing one is kept as is).
    pub async fn ensure_bridge(&self, name: &str, alias: &str) -> Result<(), LinkError> {
        if self.get(name).await?.is_none() {
            if let Err(e) = self
                .handle
                .link()
                .add(LinkBridge::new(name).build())
                .execute()
                .await
            {
                if !is_exists(&e) {
                    return Err(nl(format!("cannot create bridge {name}"))(e));
                }
            }
        }
        let index = self.index(name).await?;
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(index).alias(alias).up().build())
            .execute()
            .await
            .map_err(nl(format!("cannot bring bridge {name} up")))
    }

    /// Adds `ip/prefix` to `name` unless already there.
    pub async fn ensure_address(
        &self,
        name: &str,
        ip: Ipv4Addr,
        prefix: u8,
    ) -> Result<(), LinkError> {
        if self.addresses(name).await?.contains(&(ip, prefix)) {
            return Ok(());
        }
        let index = self.index(name).await?;
        match self
            .handle
            .address()
            .add(index, ip.into(), prefix)
            .execute()
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if is_exists(&e) => Ok(()),
            Err(e) => Err(nl(format!("cannot add {ip}/{prefix} to {name}"))(e)),
        }
    }

    /// The IPv4 addresses on `name`.
    pub async fn addresses(&self, name: &str) -> Result<Vec<(Ipv4Addr, u8)>, LinkError> {
        use rtnetlink::packet_route::address::AddressAttribute;
        let index = self.index(name).await?;
        let mut out = Vec::new();
        let mut addrs = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute();
        while let Some(msg) = addrs
            .try_next()
            .await
            .map_err(nl(format!("cannot read addresses of {name}")))?
        {
            for attr in &msg.attributes {
                if let AddressAttribute::Local(std::net::IpAddr::V4(ip))
                | AddressAttribute::Address(std::net::IpAddr::V4(ip)) = attr
                {
                    let entry = (*ip, msg.header.prefix_len);
                    if !out.contains(&entry) {
                        out.push(entry);
                    }
                }
            }
        }
        Ok(out)
    }
}

fn to_link(msg: &LinkMessage) -> Link {
    let mut link = Link {
        index: msg.header.index,
        name: String::new(),
        alias: None,
        up: msg.header.flags.contains(LinkFlags::Up),
        controller: None,
        isolated: None,
    };
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::IfAlias(a) => link.alias = Some(a.clone()),
            LinkAttribute::Controller(c) => link.controller = Some(*c),
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    if let LinkInfo::PortData(InfoPortData::BridgePort(port)) = info {
                        link.isolated = port.iter().find_map(|p| match p {
                            InfoBridgePort::Isolated(v) => Some(*v),
                            _ => None,
                        });
                    }
                }
            }
            _ => {}
        }
    }
    link
}

/// The tun ioctls: the only unsafe code of the crate.
#[allow(unsafe_code)]
mod tun {
    use super::LinkError;
    use std::os::fd::AsRawFd;

    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
    const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;
    const TUNSETGROUP: libc::c_ulong = 0x4004_54ce;
    const IFF_TAP: libc::c_short = 0x0002;
    const IFF_NO_PI: libc::c_short = 0x1000;
    const IFF_VNET_HDR: libc::c_short = 0x4000;
    /// Fail with EBUSY instead of attaching to an existing device: root
    /// could otherwise silently take over another agent's TAP.
    const IFF_TUN_EXCL: libc::c_short = 0x8000u16 as libc::c_short;

    /// `struct ifreq` with the `ifr_flags` member of its union; padded to
    /// the kernel's 40 bytes.
    #[repr(C)]
    struct IfReqFlags {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }

    pub(super) fn create_persistent(name: &str, uid: u32, gid: u32) -> Result<(), LinkError> {
        let err = |step: &'static str, source: std::io::Error| LinkError::Tun {
            name: name.to_owned(),
            step,
            source,
        };
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
            return Err(err(
                "name",
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "bad interface name"),
            ));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(|e| err("open /dev/net/tun", e))?;
        let fd = file.as_raw_fd();
        let mut req = IfReqFlags {
            name: [0; libc::IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | IFF_TUN_EXCL,
            _pad: [0; 22],
        };
        req.name[..bytes.len()].copy_from_slice(bytes);
        let check = |rc: libc::c_int, step: &'static str| {
            if rc < 0 {
                Err(err(step, std::io::Error::last_os_error()))
            } else {
                Ok(())
            }
        };
        // SAFETY: `fd` is an open /dev/net/tun descriptor owned by `file`,
        // alive for the whole block; TUNSETIFF reads and writes one `struct
        // ifreq`, and `req` is a properly sized, initialised `#[repr(C)]`
        // ifreq (16-byte name, then the flags member of the 24-byte union).
        check(unsafe { libc::ioctl(fd, TUNSETIFF, &mut req) }, "TUNSETIFF")?;
        // SAFETY: TUNSETOWNER/TUNSETGROUP/TUNSETPERSIST take their argument
        // by value (an integer), not a pointer; `fd` is still open.
        check(
            unsafe { libc::ioctl(fd, TUNSETOWNER, libc::c_ulong::from(uid)) },
            "TUNSETOWNER",
        )?;
        // SAFETY: as above.
        check(
            unsafe { libc::ioctl(fd, TUNSETGROUP, libc::c_ulong::from(gid)) },
            "TUNSETGROUP",
        )?;
        // SAFETY: as above.
        check(
            unsafe { libc::ioctl(fd, TUNSETPERSIST, 1 as libc::c_ulong) },
            "TUNSETPERSIST",
        )?;
        // Closing the descriptor leaves the persistent device in place.
        drop(file);
        Ok(())
    }
}

/// TAPs and bridges are host-global; these tests use unique names and
/// delete what they create even when an assertion fails.
#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    struct Cleanup(Vec<String>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for name in &self.0 {
                let _ = std::process::Command::new("ip")
                    .args(["link", "del", name])
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }

    fn unique(prefix: &str) -> String {
        let n = std::process::id()
            ^ (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos());
        format!("{prefix}{:08x}", n)
    }

    #[tokio::test]
    async fn serial_firecracker_tap_is_owned_persistent_isolated_and_tagged() {
        let tap = unique("kici-");
        let bridge = unique("kt");
        let _cleanup = Cleanup(vec![tap.clone(), bridge.clone()]);
        let netlink = Netlink::connect().unwrap();
        netlink
            .ensure_bridge(&bridge, "kici-scaler-test")
            .await
            .unwrap();
        // Idempotent.
        netlink
            .ensure_bridge(&bridge, "kici-scaler-test")
            .await
            .unwrap();
        netlink
            .ensure_address(&bridge, Ipv4Addr::new(10, 231, 7, 1), 24)
            .await
            .unwrap();
        netlink
            .ensure_address(&bridge, Ipv4Addr::new(10, 231, 7, 1), 24)
            .await
            .unwrap();
        assert_eq!(
            netlink.addresses(&bridge).await.unwrap(),
            [(Ipv4Addr::new(10, 231, 7, 1), 24)]
        );

        create_tap(&tap, 10_000, 10_001).unwrap();
        let sys = format!("/sys/class/net/{tap}");
        assert_eq!(
            std::fs::read_to_string(format!("{sys}/owner"))
                .unwrap()
                .trim(),
            "10000"
        );
        assert_eq!(
            std::fs::read_to_string(format!("{sys}/group"))
                .unwrap()
                .trim(),
            "10001"
        );
        // IFF_TAP | IFF_NO_PI | IFF_VNET_HDR, and IFF_PERSIST
        assert_eq!(
            std::fs::read_to_string(format!("{sys}/tun_flags"))
                .unwrap()
                .trim(),
            "0x5802"
        );

        netlink
            .attach_tap(&tap, &bridge, "kici-scaler:0a0b0c0d:x")
            .await
            .unwrap();
        let link = netlink.get(&tap).await.unwrap().unwrap();
        let br = netlink.get(&bridge).await.unwrap().unwrap();
        assert_eq!(link.alias.as_deref(), Some("kici-scaler:0a0b0c0d:x"));
        assert_eq!(link.controller, Some(br.index));
        assert_eq!(link.isolated, Some(true));
        assert!(link.up);
        assert!(netlink.list().await.unwrap().iter().any(|l| l.name == tap));

        // An existing TAP is never taken over.
        assert!(matches!(
            create_tap(&tap, 10_000, 10_001),
            Err(LinkError::Tun { step: "TUNSETIFF", ref source, .. }) if source.raw_os_error() == Some(libc::EBUSY)
        ));
        assert!(netlink.delete(&tap).await.unwrap());
        assert!(!netlink.delete(&tap).await.unwrap());
        assert!(netlink.get(&tap).await.unwrap().is_none());
        assert!(matches!(
            netlink.attach_tap(&tap, &bridge, "x").await,
            Err(ref e) if is_no_device(e)
        ));
    }
}
