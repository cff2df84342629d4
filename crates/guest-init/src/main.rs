//! `kici-guest-init`: the `/init` (PID 1) of a kici-scaler Firecracker
//! guest (it reads KiCI's MMDS bootstrap keys).
//!
//! In order: mount `/dev` (devtmpfs), `/proc`, `/sys`; make the root
//! writable with the overlay drive (see [`plan`] for the choice); mount
//! `/run`, `/tmp`, `/dev/pts`, `/dev/shm`; bring `lo` up; wait for the MMDS
//! V2 bootstrap (the agent's own client, `kici_agent_lite::mmds`); set the
//! hostname (the agent id), `/etc/hosts` (with `kici-gateway`) and
//! `/etc/resolv.conf`; run the agent with the bootstrap as its environment
//! (and nothing else of this process's); reap every orphan while it runs;
//! when it exits, end the other processes, sync and end the VM.
//!
//! Every failure ends the VM too (a PID 1 that exits panics the kernel,
//! which the backend would report as a boot failure without the reason):
//! the reason is on the serial console, prefixed `kici-init:`.
//!
//! Settings come from the kernel command line ([`cmdline`]); `--cmdline
//! STRING` replaces it (tests run this init in throwaway namespaces).
//! It refuses to run unless it is PID 1.

mod cmdline;
mod plan;
mod sys;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use kici_agent_lite::mmds::{self, FetchPolicy, GuestBootstrap};

/// How long the other processes get after the agent exits.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// The hostname when neither MMDS nor `ip=` names one.
const FALLBACK_HOSTNAME: &str = "kici-guest";
/// The agent's environment before the bootstrap is laid over it.
const BASE_ENV: [(&str, &str); 5] = [
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
    ("USER", "root"),
    ("SHELL", "/bin/sh"),
    ("LANG", "C.UTF-8"),
];

macro_rules! log {
    ($($arg:tt)*) => {
        eprintln!("kici-init: {}", format_args!($($arg)*))
    };
}

#[derive(Debug, thiserror::Error)]
enum InitError {
    #[error("{0}")]
    Sys(#[from] sys::SysError),
    #[error("{0}")]
    Cmdline(#[from] cmdline::CmdlineError),
    #[error("reading /proc/cmdline: {0}")]
    ReadCmdline(std::io::Error),
    #[error("no bootstrap: {0}")]
    Mmds(#[from] mmds::MmdsError),
    #[error("async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("starting the agent {path}: {err}")]
    Spawn { path: String, err: std::io::Error },
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut cmdline_override = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--cmdline" => cmdline_override = args.next(),
            "--version" | "-V" => {
                println!("kici-guest-init {}", env!("CARGO_PKG_VERSION"));
                return;
            }
            // The kernel hands unknown boot parameters to init as arguments.
            _ => {}
        }
    }
    if nix::unistd::getpid().as_raw() != 1 {
        log!("not PID 1; refusing to run (this is a guest /init)");
        std::process::exit(1);
    }
    match run(cmdline_override) {
        Ok(code) => log!("agent exited with {code}; stopping the VM"),
        Err(e) => log!("{e}; stopping the VM"),
    }
    let err = sys::end_vm();
    log!("{err}");
    // PID 1 must not exit (the kernel would panic): wait to be killed.
    loop {
        std::thread::park();
    }
}

fn run(cmdline_override: Option<String>) -> Result<i32, InitError> {
    for m in plan::early() {
        sys::apply(&m)?;
    }
    let raw = match cmdline_override {
        Some(c) => c,
        None => std::fs::read_to_string("/proc/cmdline").map_err(InitError::ReadCmdline)?,
    };
    let cfg = cmdline::parse(&raw)?;
    if let Some([backing, root]) = plan::overlay(&cfg.overlay) {
        sys::switch_to_overlay(&backing, &root)?;
        log!("root is writable: overlay on {}", backing.source);
    }
    for m in plan::late() {
        sys::apply(&m)?;
    }
    if let Err(e) = sys::loopback_up() {
        log!("warning: {e}");
    }

    log!("waiting for the MMDS bootstrap at {}", cfg.mmds);
    let policy = FetchPolicy {
        address: cfg.mmds,
        deadline: cfg.mmds_timeout,
        ..FetchPolicy::default()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(InitError::Runtime)?;
    let meta = runtime.block_on(mmds::fetch(&policy))?;
    drop(runtime);
    let bootstrap = GuestBootstrap::from_meta(&meta)?;
    if !bootstrap.skipped.is_empty() {
        log!(
            "warning: kici-env entries not exported: {}",
            bootstrap.skipped.join(",")
        );
    }

    let hostname = bootstrap
        .agent_id()
        .or(cfg.hostname.as_deref())
        .unwrap_or(FALLBACK_HOSTNAME)
        .to_owned();
    if let Err(e) = sys::set_hostname(&hostname) {
        log!("warning: {e}");
    }
    for (path, content) in [
        ("/etc/hostname", format!("{hostname}\n")),
        ("/etc/hosts", hosts(&hostname, &bootstrap)),
        ("/etc/resolv.conf", resolv_conf(&cfg.dns)),
    ] {
        if let Err(e) = std::fs::write(path, content) {
            log!("warning: writing {path}: {e}");
        }
    }

    let env = agent_env(&bootstrap);
    let home = if Path::new("/root").is_dir() {
        "/root"
    } else {
        "/"
    };
    let child = std::process::Command::new(&cfg.agent)
        .env_clear()
        .envs(&env)
        .current_dir(home)
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(|err| InitError::Spawn {
            path: cfg.agent.display().to_string(),
            err,
        })?;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    log!("started {} (pid {pid}) as {hostname}", cfg.agent.display());
    let code = sys::wait_for(pid);
    sys::terminate_all(STOP_GRACE);
    Ok(code)
}

/// The agent's environment: the basics, then the bootstrap.
fn agent_env(bootstrap: &GuestBootstrap) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = BASE_ENV
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    env.extend(bootstrap.env.clone());
    env
}

fn hosts(hostname: &str, bootstrap: &GuestBootstrap) -> String {
    let mut out = format!("127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{hostname}\n");
    if let Some(gw) = bootstrap.gateway_ip {
        out.push_str(&format!("{gw}\tkici-gateway\n"));
    }
    out
}

fn resolv_conf(servers: &[std::net::Ipv4Addr]) -> String {
    servers
        .iter()
        .map(|s| format!("nameserver {s}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_agent_env_is_the_basics_under_the_bootstrap() {
        let mut b = GuestBootstrap::default();
        b.env
            .insert("KICI_AGENT_ID".into(), "scaler-firecracker-01020304".into());
        b.env.insert("HOME".into(), "/work".into());
        let env = agent_env(&b);
        assert_eq!(env["HOME"], "/work");
        assert_eq!(env["KICI_AGENT_ID"], "scaler-firecracker-01020304");
        assert!(env["PATH"].contains("/usr/local/bin"));
        assert_eq!(env.len(), BASE_ENV.len() + 1);
    }

    #[test]
    fn hosts_and_resolv_conf() {
        let mut b = GuestBootstrap::default();
        assert_eq!(
            hosts("vm", &b),
            "127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\tvm\n"
        );
        b.gateway_ip = Some(std::net::Ipv4Addr::new(10, 0, 0, 1));
        assert!(hosts("vm", &b).ends_with("10.0.0.1\tkici-gateway\n"));
        assert_eq!(
            resolv_conf(&cmdline::DEFAULT_DNS),
            "nameserver 1.1.1.1\nnameserver 8.8.8.8\n"
        );
    }
}
