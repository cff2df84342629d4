//! What the agent reports about its host at registration.

use kici_protocol::bootstrap::HostFacts;

pub fn facts() -> HostFacts {
    let uname = rustix::system::uname();
    let hostname = uname
        .nodename()
        .to_str()
        .ok()
        .filter(|h| !h.is_empty())
        .map(str::to_owned);
    HostFacts {
        os: std::env::consts::OS.to_owned(),
        arch: std::env::consts::ARCH.to_owned(),
        hostname,
    }
}

pub fn os_release() -> Option<String> {
    rustix::system::uname()
        .release()
        .to_str()
        .ok()
        .map(str::to_owned)
}

pub fn cpu_count() -> Option<u32> {
    std::thread::available_parallelism()
        .ok()
        .and_then(|n| u32::try_from(n.get()).ok())
}

pub fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}
