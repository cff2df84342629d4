//! The simulator's side of the guest network (test-only, no real counterpart):
//! a unix socket `testkit-guest.sock` next to the API socket (inside the jail:
//! `/run/testkit-guest.sock`) through which a privileged test helper
//! ([`crate::guestnet`]) obtains
//! - `TAP <iface_id>`: a duplicate of the TAP descriptor the VMM attached for
//!   that interface (passed with SCM_RIGHTS), so guest frames enter the host
//!   through the very TAP the backend created;
//! - `MMDS <iface_id>`: an HTTP session answered by this VMM's MMDS, exactly
//!   as the device model answers guest requests to the MMDS address — only
//!   after boot and only on interfaces named in the MMDS config.

use std::io::{BufRead, BufReader, IoSlice, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};

use crate::http::{read_request, write_response, HttpError, HttpResponse};
use crate::mmds::{GuestMethod, GuestRequest};
use crate::vmm::Shared;

/// File name of the guest-link socket, in the API socket's directory.
pub const GUEST_LINK_SOCKET: &str = "testkit-guest.sock";

/// Where the guest-link socket goes for a given API socket path.
pub fn socket_path(api_sock: &Path) -> PathBuf {
    api_sock
        .parent()
        .unwrap_or_else(|| Path::new("/"))
        .join(GUEST_LINK_SOCKET)
}

/// Serve the guest link on its own thread. A bind failure only disables the link.
pub fn spawn(shared: Arc<Shared>, api_sock: &Path) {
    let path = socket_path(api_sock);
    let Ok(listener) = UnixListener::bind(&path) else {
        eprintln!(
            "kici-testkit fc-sim: cannot bind the guest link at {}",
            path.display()
        );
        return;
    };
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(stream) = conn else { continue };
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || serve(shared, stream));
        }
    });
}

fn serve(shared: Arc<Shared>, stream: UnixStream) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some("TAP"), Some(iface)) => {
            let tap = shared.lock().tap_for(iface);
            match tap {
                Some(Ok(file)) => {
                    let fds = [file.as_raw_fd()];
                    let cmsg = [ControlMessage::ScmRights(&fds)];
                    let iov = [IoSlice::new(b"OK\n")];
                    let _ = sendmsg::<UnixAddr>(
                        writer.as_raw_fd(),
                        &iov,
                        &cmsg,
                        MsgFlags::empty(),
                        None,
                    );
                }
                Some(Err(e)) => {
                    let _ = writeln!(writer, "ERR {e}");
                }
                None => {
                    let _ = writeln!(writer, "ERR no network interface {iface}");
                }
            }
        }
        (Some("MMDS"), Some(iface)) => {
            let iface = iface.to_string();
            loop {
                let req = match read_request(&mut reader, &mut writer, 64 * 1024) {
                    Ok(r) => r,
                    Err(HttpError::Closed) | Err(_) => return,
                };
                let resp = {
                    let mut st = shared.lock();
                    if !st.mmds_on(&iface) {
                        // The device model does not intercept: nothing answers.
                        return;
                    }
                    let guest_req = GuestRequest {
                        method: match req.method.as_str() {
                            "GET" => GuestMethod::Get,
                            "PUT" => GuestMethod::Put,
                            _ => GuestMethod::Other,
                        },
                        path: req.path.clone(),
                        headers: req.headers.clone(),
                    };
                    st.mmds.guest_request(&guest_req)
                };
                let http = HttpResponse {
                    status: resp.status,
                    content_type: Some(resp.content_type),
                    body: resp.body.into_bytes(),
                };
                if write_response(&mut writer, &http).is_err() || req.wants_close() {
                    return;
                }
            }
        }
        _ => {
            let _ = writeln!(writer, "ERR unknown command");
        }
    }
}
