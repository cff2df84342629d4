//! Attaching to a host TAP device the way Firecracker's net device does:
//! open `/dev/net/tun` (inside the jail: the node the jailer created) and
//! `TUNSETIFF` with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`. The kernel then
//! enforces what the real VMM meets: the device must be a TAP, an unprivileged
//! process may only attach to a persistent TAP owned by its uid or gid, and a
//! single-queue TAP accepts one attachment at a time.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;

use nix::libc;

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// `struct ifreq` restricted to the name and flags union member (40 bytes on 64-bit Linux).
#[repr(C)]
pub struct IfReqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

nix::ioctl_write_ptr_bad!(
    tun_set_iff,
    nix::request_code_write!(b'T', 202, std::mem::size_of::<libc::c_int>()),
    IfReqFlags
);

/// Why a TAP could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("Could not open /dev/net/tun: {0}")]
    OpenTun(std::io::Error),
    #[error("The tap name {0:?} is not a valid interface name")]
    BadName(String),
    #[error("{0}")]
    Ioctl(nix::Error),
    #[error("the interface {0} does not exist")]
    Missing(String),
}

/// Attach to the existing TAP `name`; the returned file keeps the attachment alive.
/// Frames read from it carry a 10-byte `virtio_net_hdr` (IFF_VNET_HDR).
pub fn attach(name: &str) -> Result<File, TapError> {
    check_name(name)?;
    // Refuse to let a privileged simulator create the interface on the fly
    // (TUNSETIFF creates a missing TAP when CAP_NET_ADMIN is held; the jailed
    // VMM never holds it).
    nix::net::if_::if_nametoindex(name).map_err(|_| TapError::Missing(name.to_string()))?;
    set_iff(name, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
}

/// Create (or attach to) TAP `name` in the calling thread's network namespace,
/// without a vnet header: the guest side of [`crate::guestnet`]. Needs CAP_NET_ADMIN.
pub fn create_plain(name: &str) -> Result<File, TapError> {
    check_name(name)?;
    set_iff(name, IFF_TAP | IFF_NO_PI)
}

/// Size of the `virtio_net_hdr` prefixed to frames of an [`attach`]ed TAP.
pub const VNET_HDR_LEN: usize = 10;

fn check_name(name: &str) -> Result<(), TapError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', ' ', '\0']) {
        return Err(TapError::BadName(name.to_string()));
    }
    Ok(())
}

fn set_iff(name: &str, flags: libc::c_short) -> Result<File, TapError> {
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(TapError::OpenTun)?;
    let mut req = IfReqFlags {
        name: [0; libc::IFNAMSIZ],
        flags,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: `tun` is an open /dev/net/tun descriptor and `req` is a properly
    // sized, initialised `ifreq` that outlives the call; TUNSETIFF only reads
    // and writes within those 40 bytes.
    unsafe { tun_set_iff(tun.as_raw_fd(), &req) }.map_err(TapError::Ioctl)?;
    Ok(tun)
}
