//! A guest network namespace wired to a running simulator (root only, test
//! helper): the namespace gets a TAP `eth0` with the VM's MAC and IP (and a
//! default route via the gateway), frames are relayed between it and the host
//! TAP the VMM attached (so guest traffic crosses the real TAP, bridge and
//! nftables rules the backend set up), and the MMDS address is answered inside
//! the namespace by the VMM's own MMDS — intercepted before the TAP, as
//! Firecracker's device model does. Run guest-side programs with
//! [`GuestNet::command`].
#![allow(unsafe_code)]

use std::fs::File;
use std::io::{BufRead, BufReader, IoSliceMut, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, UnixAddr};

use crate::tap::{create_plain, VNET_HDR_LEN};

/// Errors wiring a guest namespace.
#[derive(Debug, thiserror::Error)]
pub enum GuestNetError {
    #[error("guest link {0}: {1}")]
    Link(PathBuf, String),
    #[error("`{0}` failed: {1}")]
    Command(String, String),
    #[error("guest namespace setup: {0}")]
    Setup(String),
}

/// How the guest side looks.
#[derive(Debug, Clone)]
pub struct GuestNetConfig {
    /// Name of the network namespace to create (`ip netns add`).
    pub netns: String,
    /// The VMM's interface id whose TAP carries the guest's frames (e.g. `eth0`).
    pub iface_id: String,
    /// Guest MAC (the `guest_mac` the backend configured).
    pub mac: String,
    pub ip: Ipv4Addr,
    pub prefix_len: u8,
    pub gateway: Option<Ipv4Addr>,
    /// The MMDS address (`169.254.169.254` unless the MMDS config says otherwise).
    pub mmds_address: Ipv4Addr,
}

/// A wired guest namespace; dropping it stops the relay and deletes the namespace.
#[derive(Debug)]
pub struct GuestNet {
    netns: String,
    stop: Arc<AtomicBool>,
    listener: Arc<TcpListener>,
    threads: Vec<JoinHandle<()>>,
}

fn run(cmd: &mut Command) -> Result<(), GuestNetError> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| GuestNetError::Command(shown.clone(), e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(GuestNetError::Command(
            shown,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }
}

/// Ask the simulator for a duplicate of its TAP descriptor for `iface_id`.
pub fn fetch_tap(guest_link: &Path, iface_id: &str) -> Result<File, GuestNetError> {
    let link_err = |e: String| GuestNetError::Link(guest_link.to_path_buf(), e);
    let mut stream = UnixStream::connect(guest_link).map_err(|e| link_err(e.to_string()))?;
    writeln!(stream, "TAP {iface_id}").map_err(|e| link_err(e.to_string()))?;
    let mut buf = [0u8; 256];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<UnixAddr>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::empty(),
    )
    .map_err(|e| link_err(e.to_string()))?;
    let mut received = None;
    for c in msg.cmsgs().map_err(|e| link_err(e.to_string()))? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(fd) = fds.first() {
                // SAFETY: the descriptor was just created for this process by
                // SCM_RIGHTS and nothing else owns it.
                received = Some(unsafe { OwnedFd::from_raw_fd(*fd) });
            }
        }
    }
    let bytes = msg.bytes;
    match received {
        Some(fd) => Ok(File::from(fd)),
        None => Err(link_err(
            String::from_utf8_lossy(&buf[..bytes]).trim().to_string(),
        )),
    }
}

/// Wait until `fd` is readable or `stop` is set; false when stopping.
fn readable(fd: &File, stop: &AtomicBool) -> bool {
    loop {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(100u16)) {
            Ok(0) => continue,
            Ok(_) => return true,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return false,
        }
    }
}

impl GuestNet {
    /// Create the namespace and start relaying. `guest_link` is the simulator's
    /// guest-link socket (`<jail>/run/testkit-guest.sock` for a jailed VMM).
    pub fn attach(guest_link: &Path, cfg: &GuestNetConfig) -> Result<Self, GuestNetError> {
        let host_tap = fetch_tap(guest_link, &cfg.iface_id)?;
        run(Command::new("ip").args(["netns", "add", &cfg.netns]))?;
        match Self::wire(guest_link, cfg, host_tap) {
            Ok(g) => Ok(g),
            Err(e) => {
                let _ = run(Command::new("ip").args(["netns", "del", &cfg.netns]));
                Err(e)
            }
        }
    }

    fn wire(
        guest_link: &Path,
        cfg: &GuestNetConfig,
        host_tap: File,
    ) -> Result<Self, GuestNetError> {
        let ns_cfg = cfg.clone();
        // setns affects only the calling thread: do the namespace work on a
        // thread of its own; the TAP and the listener stay in the namespace.
        let (guest_tap, listener) =
            std::thread::spawn(move || -> Result<(File, TcpListener), GuestNetError> {
                let ns = File::open(format!("/run/netns/{}", ns_cfg.netns))
                    .map_err(|e| GuestNetError::Setup(format!("opening the namespace: {e}")))?;
                nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| GuestNetError::Setup(format!("setns: {e}")))?;
                let tap = create_plain("eth0").map_err(|e| GuestNetError::Setup(e.to_string()))?;
                // Child processes inherit this thread's namespace.
                run(Command::new("ip").args(["link", "set", "lo", "up"]))?;
                run(Command::new("ip").args(["link", "set", "eth0", "address", &ns_cfg.mac]))?;
                run(Command::new("ip").args([
                    "addr",
                    "add",
                    &format!("{}/{}", ns_cfg.ip, ns_cfg.prefix_len),
                    "dev",
                    "eth0",
                ]))?;
                run(Command::new("ip").args(["link", "set", "eth0", "up"]))?;
                run(Command::new("ip").args([
                    "addr",
                    "add",
                    &format!("{}/32", ns_cfg.mmds_address),
                    "dev",
                    "lo",
                ]))?;
                if let Some(gw) = ns_cfg.gateway {
                    run(Command::new("ip").args([
                        "route",
                        "add",
                        "default",
                        "via",
                        &gw.to_string(),
                        "dev",
                        "eth0",
                    ]))?;
                }
                let listener = TcpListener::bind(SocketAddrV4::new(ns_cfg.mmds_address, 80))
                    .map_err(|e| GuestNetError::Setup(format!("binding the MMDS address: {e}")))?;
                Ok((tap, listener))
            })
            .join()
            .map_err(|_| GuestNetError::Setup("the namespace thread panicked".into()))??;

        let stop = Arc::new(AtomicBool::new(false));
        let listener = Arc::new(listener);
        let mut threads = Vec::new();

        let (host_rx, guest_tx) = (
            host_tap
                .try_clone()
                .map_err(|e| GuestNetError::Setup(e.to_string()))?,
            guest_tap
                .try_clone()
                .map_err(|e| GuestNetError::Setup(e.to_string()))?,
        );
        let s = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            relay(host_rx, guest_tx, &s, Direction::HostToGuest)
        }));
        let s = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            relay(guest_tap, host_tap, &s, Direction::GuestToHost)
        }));

        let l = Arc::clone(&listener);
        let s = Arc::clone(&stop);
        let link = guest_link.to_path_buf();
        let iface = cfg.iface_id.clone();
        threads.push(std::thread::spawn(move || {
            for conn in l.incoming() {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(tcp) = conn else { return };
                let link = link.clone();
                let iface = iface.clone();
                std::thread::spawn(move || proxy_mmds(tcp, &link, &iface));
            }
        }));
        Ok(Self {
            netns: cfg.netns.clone(),
            stop,
            listener,
            threads,
        })
    }

    /// The namespace name.
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// A command run inside the guest namespace (`ip netns exec <ns> <program>`).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns, program]);
        c
    }
}

enum Direction {
    HostToGuest,
    GuestToHost,
}

fn relay(mut from: File, mut to: File, stop: &AtomicBool, dir: Direction) {
    let mut buf = vec![0u8; 65_536 + VNET_HDR_LEN];
    while readable(&from, stop) {
        match dir {
            Direction::HostToGuest => {
                let Ok(n) = from.read(&mut buf) else { return };
                if n > VNET_HDR_LEN {
                    // A guest link that is down refuses frames; the wire drops them.
                    let _ = to.write(&buf[VNET_HDR_LEN..n]);
                }
            }
            Direction::GuestToHost => {
                let Ok(n) = from.read(&mut buf[VNET_HDR_LEN..]) else {
                    return;
                };
                buf[..VNET_HDR_LEN].fill(0);
                let _ = to.write(&buf[..VNET_HDR_LEN + n]);
            }
        }
    }
}

fn proxy_mmds(tcp: TcpStream, link: &Path, iface: &str) {
    let Ok(mut unix) = UnixStream::connect(link) else {
        return;
    };
    if writeln!(unix, "MMDS {iface}").is_err() {
        return;
    }
    let (Ok(mut tcp_rx), Ok(mut unix_rx)) = (tcp.try_clone(), unix.try_clone()) else {
        return;
    };
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut tcp_rx, &mut unix);
        let _ = unix.shutdown(Shutdown::Write);
    });
    let mut tcp_tx = tcp;
    let mut reader = BufReader::new(&mut unix_rx);
    loop {
        let chunk = match reader.fill_buf() {
            Ok([]) | Err(_) => break,
            Ok(c) => c.to_vec(),
        };
        reader.consume(chunk.len());
        if tcp_tx.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = tcp_tx.shutdown(Shutdown::Both);
    let _ = up.join();
}

impl Drop for GuestNet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the blocked accept (Linux returns EINVAL from accept on a shut-down listener).
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = run(Command::new("ip").args(["netns", "del", &self.netns]));
    }
}
