//! The daemon's side of running as a systemd service (`Type=notify`).
//!
//! systemd considers a `Type=notify` unit started when the service sends
//! `READY=1` to the datagram socket named by `$NOTIFY_SOCKET`: `serve` sends
//! it once the control API listens and `/readyz` answers ready, so
//! `systemctl start` returns only when the API is usable (and fails when
//! start-up fails). Around a SIGHUP reload it sends `RELOADING=1` then
//! `READY=1` again, and on SIGTERM `STOPPING=1`, so `systemctl status` shows
//! what the daemon is doing. Each message carries a `STATUS=` line too.
//!
//! Outside systemd (`$NOTIFY_SOCKET` unset) every call does nothing. A
//! failure to notify is logged, never fatal: the daemon works the same
//! whether or not anybody listens. The variable is left set (unsetting the
//! environment of a multi-threaded process is unsound); agents never see it,
//! since they get an allowlisted environment only.

use sd_notify::NotifyState;

fn send(what: &str, states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!(error = %e, message = what, "cannot notify systemd");
    }
}

/// The control API listens and the daemon is ready.
pub fn ready(status: &str) {
    send(
        "READY=1",
        &[NotifyState::Ready, NotifyState::Status(status)],
    );
}

/// A configuration reload begins (`READY=1` follows through [`ready`]).
pub fn reloading() {
    let mut states = vec![NotifyState::Reloading, NotifyState::Status("reloading")];
    // systemd 253+ wants the reload's start time with RELOADING=1; older
    // versions ignore it.
    if let Ok(now) = NotifyState::monotonic_usec_now() {
        states.push(now);
    }
    send("RELOADING=1", &states);
}

/// Shutdown begins: every agent is being destroyed.
pub fn stopping(status: &str) {
    send(
        "STOPPING=1",
        &[NotifyState::Stopping, NotifyState::Status(status)],
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixDatagram;

    #[test]
    fn the_messages_reach_the_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&path).unwrap();
        // The only test in this binary that sets NOTIFY_SOCKET.
        std::env::set_var("NOTIFY_SOCKET", &path);
        ready("listening on 127.0.0.1:7878");
        reloading();
        stopping("destroying 2 agent(s)");
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 512];
        let mut next = || {
            let n = socket.recv(&mut buf).unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        };
        assert_eq!(next(), "READY=1\nSTATUS=listening on 127.0.0.1:7878\n");
        let reload = next();
        assert!(
            reload.starts_with("RELOADING=1\nSTATUS=reloading\nMONOTONIC_USEC="),
            "{reload}"
        );
        assert_eq!(next(), "STOPPING=1\nSTATUS=destroying 2 agent(s)\n");
        // Without the variable nothing is sent and nothing fails.
        ready("unheard");
    }
}
