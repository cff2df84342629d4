//! The simulated guest: after `InstanceStart` it "boots" (a kernel-like log on
//! the serial console, i.e. the simulator's stdout), then acts as the guest
//! `/init` of the kici contract: it reads MMDS through a V2 token session
//! (in-process, through the same MMDS handler, so V2's rules apply), turns
//! `latest/meta-data` into the agent environment and runs the guest agent.
//! The agent's exit powers the VM off; Ctrl+Alt+Del kills the agent and
//! reboots, which ends the Firecracker process (`reboot=k`).
//!
//! Failure modes for tests ([`GuestMode`]) come from `KICI_TESTKIT_GUEST_MODE`
//! or a file `testkit-guest-mode` in the VMM's working directory (the jail
//! root); the agent from `KICI_TESTKIT_GUEST_AGENT` or a file `guest-agent`
//! there.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::logger::Level;
use crate::mmds::{GuestRequest, TOKEN_PATH};
use crate::vmm::Shared;

/// Env var naming the guest failure mode.
pub const GUEST_MODE_ENV: &str = "KICI_TESTKIT_GUEST_MODE";
/// Env var naming the guest agent binary.
pub const GUEST_AGENT_ENV: &str = "KICI_TESTKIT_GUEST_AGENT";
/// File (in the VMM's working directory) holding the guest failure mode.
pub const GUEST_MODE_FILE: &str = "testkit-guest-mode";
/// File (in the VMM's working directory) that is the guest agent binary.
pub const GUEST_AGENT_FILE: &str = "guest-agent";
/// Env var naming the VMM failure mode ([`VmmMode`]).
pub const VMM_MODE_ENV: &str = "KICI_TESTKIT_VMM_MODE";
/// File (in the VMM's working directory) holding the VMM failure mode.
pub const VMM_MODE_FILE: &str = "testkit-vmm-mode";

/// Failures of the VMM process itself, for the backend's timeout and cleanup paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VmmMode {
    #[default]
    Normal,
    /// Exits with status 1 right after start-up (like a VMM refusing its arguments).
    ExitAtStart,
    /// Keeps running but never creates its API socket.
    NoSocket,
    /// Accepts API connections and never answers.
    HangApi,
    /// `InstanceStart` fails the way it does on a host without usable KVM.
    FailInstanceStart,
}

impl VmmMode {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "normal" | "" => Self::Normal,
            "exit-at-start" => Self::ExitAtStart,
            "no-socket" => Self::NoSocket,
            "hang-api" => Self::HangApi,
            "fail-instance-start" => Self::FailInstanceStart,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::ExitAtStart => "exit-at-start",
            Self::NoSocket => "no-socket",
            Self::HangApi => "hang-api",
            Self::FailInstanceStart => "fail-instance-start",
        }
    }
}

/// How long the guest gives its agent to stop after Ctrl+Alt+Del before killing it.
const AGENT_STOP_GRACE: Duration = Duration::from_secs(2);

/// What the simulated guest does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GuestMode {
    /// Boots, runs /init and the agent, honours Ctrl+Alt+Del.
    #[default]
    Normal,
    /// Prints a kernel panic on the serial console and the VMM exits.
    KernelPanic,
    /// The kernel cannot execute /init: panic text, VMM exits.
    InitFailure,
    /// Nothing after "Starting kernel": the VMM keeps running, silent.
    NeverBoots,
    /// Boots normally but ignores Ctrl+Alt+Del (only a kill ends it).
    IgnoreCtrlAltDel,
}

impl GuestMode {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim() {
            "normal" | "" => Self::Normal,
            "kernel-panic" => Self::KernelPanic,
            "init-failure" => Self::InitFailure,
            "never-boots" => Self::NeverBoots,
            "ignore-ctrl-alt-del" => Self::IgnoreCtrlAltDel,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::KernelPanic => "kernel-panic",
            Self::InitFailure => "init-failure",
            Self::NeverBoots => "never-boots",
            Self::IgnoreCtrlAltDel => "ignore-ctrl-alt-del",
        }
    }
}

/// An unknown mode name in the environment or a mode file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuestConfigError {
    #[error("unknown guest mode {0:?}")]
    GuestMode(String),
    #[error("unknown VMM mode {0:?}")]
    VmmMode(String),
}

/// Guest configuration resolved at simulator start.
#[derive(Debug, Clone, Default)]
pub struct GuestConfig {
    pub mode: GuestMode,
    pub agent: Option<PathBuf>,
    pub vmm: VmmMode,
}

impl GuestConfig {
    /// From the environment, falling back to files in the working directory.
    pub fn from_env_and_cwd() -> Result<Self, GuestConfigError> {
        let mode_text = std::env::var(GUEST_MODE_ENV)
            .ok()
            .or_else(|| std::fs::read_to_string(GUEST_MODE_FILE).ok());
        let mode = match mode_text {
            Some(t) => GuestMode::parse(&t).ok_or(GuestConfigError::GuestMode(t))?,
            None => GuestMode::Normal,
        };
        let agent = std::env::var_os(GUEST_AGENT_ENV)
            .map(PathBuf::from)
            .or_else(|| {
                let p = PathBuf::from(GUEST_AGENT_FILE);
                p.exists().then(|| PathBuf::from("./").join(p))
            });
        let vmm_text = std::env::var(VMM_MODE_ENV)
            .ok()
            .or_else(|| std::fs::read_to_string(VMM_MODE_FILE).ok());
        let vmm = match vmm_text {
            Some(t) => VmmMode::parse(&t).ok_or(GuestConfigError::VmmMode(t))?,
            None => VmmMode::Normal,
        };
        Ok(Self { mode, agent, vmm })
    }
}

/// Guest progress, for introspection.
#[derive(Debug, Clone, Default)]
pub struct GuestStatus {
    pub phase: &'static str,
    pub mode: &'static str,
    /// Status of the token-less MMDS read the guest attempts first (401 under V2).
    pub tokenless_read_status: Option<u16>,
    /// Status of the token request.
    pub token_status: Option<u16>,
    /// Status of the metadata read with the token.
    pub metadata_status: Option<u16>,
    /// The `latest/meta-data` document the guest used.
    pub metadata: Option<Value>,
    /// Names of the variables exported to the agent.
    pub agent_env_keys: Vec<String>,
    pub agent_pid: Option<u32>,
    pub agent_exit_code: Option<i32>,
    pub agent_error: Option<String>,
}

impl GuestStatus {
    pub fn to_json(&self) -> Value {
        json!({
            "phase": if self.phase.is_empty() { "not-started" } else { self.phase },
            "mode": self.mode,
            "tokenless_read_status": self.tokenless_read_status,
            "token_status": self.token_status,
            "metadata_status": self.metadata_status,
            "metadata": self.metadata,
            "agent_env_keys": self.agent_env_keys,
            "agent_pid": self.agent_pid,
            "agent_exit_code": self.agent_exit_code,
            "agent_error": self.agent_error,
        })
    }
}

/// Where the guest's serial console goes: nowhere when the kernel command line
/// has no `console=ttyS0` (Firecracker's serial device only sees what the guest
/// writes to it), the `PUT /serial` `serial_out_path` file, or the VMM's stdout;
/// optionally through the `PUT /serial` token bucket (excess bytes dropped).
#[derive(Debug)]
pub struct SerialOut {
    enabled: bool,
    file: Option<std::fs::File>,
    bucket: Option<TokenBucket>,
    /// Bytes the rate limiter dropped (Firecracker's `uart.rate_limiter_dropped_bytes`).
    pub dropped_bytes: u64,
}

/// Firecracker's token bucket (bytes): `size` per `refill_time` ms, plus a one-time burst.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    size: u64,
    refill_ms: u64,
    budget: u64,
    burst: u64,
    last: std::time::Instant,
}

impl TokenBucket {
    pub fn from_json(v: &Value) -> Option<Self> {
        let size = v.get("size")?.as_u64()?;
        let refill_ms = v.get("refill_time")?.as_u64()?;
        if size == 0 || refill_ms == 0 {
            return None;
        }
        Some(Self {
            size,
            refill_ms,
            budget: size,
            burst: v.get("one_time_burst").and_then(Value::as_u64).unwrap_or(0),
            last: std::time::Instant::now(),
        })
    }

    /// How many of `n` bytes may pass now.
    fn take(&mut self, n: u64) -> u64 {
        let elapsed = self.last.elapsed().as_millis() as u64;
        if elapsed > 0 {
            let refill = self.size.saturating_mul(elapsed) / self.refill_ms;
            if refill > 0 {
                self.budget = (self.budget + refill).min(self.size);
                self.last = std::time::Instant::now();
            }
        }
        let from_burst = n.min(self.burst);
        self.burst -= from_burst;
        let from_budget = (n - from_burst).min(self.budget);
        self.budget -= from_budget;
        from_burst + from_budget
    }
}

static SERIAL: std::sync::Mutex<Option<SerialOut>> = std::sync::Mutex::new(None);

/// Configure the serial sink at boot from the kernel command line and the `/serial` config.
pub fn configure_serial(cmdline: &str, serial_config: Option<&Value>) -> std::io::Result<()> {
    let enabled = cmdline
        .split_whitespace()
        .any(|a| a.starts_with("console=ttyS"));
    let file = match serial_config
        .and_then(|c| c.get("serial_out_path"))
        .and_then(Value::as_str)
    {
        Some(path) => Some(std::fs::OpenOptions::new().append(true).open(path)?),
        None => None,
    };
    let bucket = serial_config
        .and_then(|c| c.get("rate_limiter"))
        .and_then(TokenBucket::from_json);
    let mut guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    *guard = Some(SerialOut {
        enabled,
        file,
        bucket,
        dropped_bytes: 0,
    });
    Ok(())
}

/// Bytes dropped by the serial rate limiter so far.
pub fn serial_dropped_bytes() -> u64 {
    SERIAL
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map_or(0, |s| s.dropped_bytes)
}

/// Write raw bytes to the serial console.
pub fn serial_bytes(bytes: &[u8]) {
    let mut guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(out) = guard.as_mut() else {
        return;
    };
    if !out.enabled {
        return;
    }
    let allowed = match out.bucket.as_mut() {
        Some(b) => b.take(bytes.len() as u64) as usize,
        None => bytes.len(),
    };
    out.dropped_bytes += (bytes.len() - allowed) as u64;
    let chunk = &bytes[..allowed];
    match out.file.as_mut() {
        Some(f) => {
            let _ = f.write_all(chunk);
        }
        None => {
            let mut stdout = std::io::stdout().lock();
            let _ = stdout.write_all(chunk);
            let _ = stdout.flush();
        }
    }
}

fn serial(line: &str) {
    let mut bytes = line.as_bytes().to_vec();
    bytes.push(b'\n');
    serial_bytes(&bytes);
}

/// Copy a guest process's output to the serial console.
fn pump(mut from: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            serial_bytes(&buf[..n]);
        }
    })
}

/// How long an exited agent's last output may take to reach the console.
const OUTPUT_DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Waits (up to [`OUTPUT_DRAIN_GRACE`]) until the agent's output has been
/// copied to the console: a real guest's console writes are synchronous, so
/// what the agent printed comes before the kernel's power-down line. A
/// process the agent left behind may keep its pipe open; it is not awaited
/// past the grace.
fn drain(pumps: &[std::thread::JoinHandle<()>]) {
    let deadline = std::time::Instant::now() + OUTPUT_DRAIN_GRACE;
    while !pumps.iter().all(std::thread::JoinHandle::is_finished)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// How long an exiting VMM lets in-flight API responses go out.
const RESPONSE_FLUSH_GRACE: Duration = Duration::from_secs(1);

/// The VMM exits once the guest has rebooted or powered off.
fn vmm_exit(shared: &Shared, phase: &'static str) -> ! {
    {
        let mut st = shared.lock();
        st.guest.phase = phase;
        st.logger.log(Level::Info, "main", "Vmm is stopping.");
        // Let the response to the request that ended the guest (Ctrl+Alt+Del) reach its client.
        let _ = shared
            .events
            .wait_timeout_while(st, RESPONSE_FLUSH_GRACE, |s| s.in_flight > 0);
    }
    let _ = std::io::stdout().flush();
    std::process::exit(0);
}

/// Run the guest (called on its own thread after `InstanceStart`).
pub fn run(shared: Arc<Shared>) {
    let (mode, agent, cmdline, drives, machine) = {
        let mut st = shared.lock();
        st.guest.phase = "booting";
        st.guest.mode = st.config.guest.mode.as_str();
        let cmdline = st.kernel_cmdline();
        if let Err(e) = configure_serial(&cmdline, st.serial_config()) {
            st.logger.log(
                Level::Error,
                "main",
                &format!("Failed to open the serial output: {e}"),
            );
        }
        (
            st.config.guest.mode,
            st.config.guest.agent.clone(),
            cmdline,
            st.drive_ids(),
            st.machine().clone(),
        )
    };
    serial("[    0.000000] Linux version 6.1.102 (kici-testkit@fc-sim) (simulated guest) #1 SMP");
    serial(&format!("[    0.000000] Command line: {cmdline}"));
    serial(&format!(
        "[    0.000000] Memory: {}MiB, {} vCPU(s)",
        machine
            .get("mem_size_mib")
            .and_then(Value::as_i64)
            .unwrap_or(0),
        machine
            .get("vcpu_count")
            .and_then(Value::as_i64)
            .unwrap_or(0)
    ));
    if mode == GuestMode::NeverBoots {
        let mut st = shared.lock();
        st.guest.phase = "hung";
        loop {
            st = shared.events.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
    for (i, d) in drives.iter().enumerate() {
        let letter = char::from(b'a' + (i as u8 % 26));
        serial(&format!(
            "[    0.110000] virtio_blk virtio{i}: [vd{letter}] ({d})"
        ));
    }
    if let Some(ip) = cmdline
        .split_whitespace()
        .find_map(|a| a.strip_prefix("ip="))
        .and_then(|v| v.split(':').next())
    {
        serial(&format!(
            "[    0.200000] IP-Config: Complete: device=eth0, addr={ip}"
        ));
    }
    match mode {
        GuestMode::KernelPanic => {
            serial("[    0.300000] VFS: Cannot open root device \"vda\" or unknown-block(0,0): error -6");
            serial("[    0.300000] Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)");
            serial("[    0.310000] Rebooting in 1 seconds..");
            vmm_exit(&shared, "panicked");
        }
        GuestMode::InitFailure => {
            serial("[    0.300000] Run /init as init process");
            serial("[    0.300000] Failed to execute /init (error -2)");
            serial("[    0.300000] Kernel panic - not syncing: No working init found.  Try passing init= option to kernel. See Linux Documentation/admin-guide/init.rst for guidance.");
            vmm_exit(&shared, "panicked");
        }
        _ => {}
    }
    serial("[    0.300000] Run /init as init process");
    init(&shared, mode, agent);
}

/// Wait for Ctrl+Alt+Del (honoured unless the mode ignores it) and reboot.
fn idle_until_ctrl_alt_del(shared: &Shared, mode: GuestMode, phase: &'static str) -> ! {
    let mut st = shared.lock();
    st.guest.phase = phase;
    loop {
        if st.ctrl_alt_del_count > 0 && mode != GuestMode::IgnoreCtrlAltDel {
            drop(st);
            serial("[   10.000000] reboot: Restarting system");
            vmm_exit(shared, "rebooted");
        }
        st = shared.events.wait(st).unwrap_or_else(|p| p.into_inner());
    }
}

fn init(shared: &Arc<Shared>, mode: GuestMode, agent: Option<PathBuf>) {
    serial("kici-init: waiting for MMDS");
    let meta = {
        let mut st = shared.lock();
        st.guest.phase = "waiting-for-mmds";
        loop {
            // Ctrl+Alt+Del is refused before boot, so any count means "received since boot".
            if st.ctrl_alt_del_count > 0 && mode != GuestMode::IgnoreCtrlAltDel {
                drop(st);
                serial("[   10.000000] reboot: Restarting system");
                vmm_exit(shared, "rebooted");
            }
            if st.mmds_reachable() {
                let tokenless = st
                    .mmds
                    .guest_request(&GuestRequest::get("/latest/meta-data"));
                st.guest.tokenless_read_status = Some(tokenless.status);
                let token = st.mmds.guest_request(
                    &GuestRequest::put(TOKEN_PATH)
                        .with_header("X-metadata-token-ttl-seconds", "21600"),
                );
                st.guest.token_status = Some(token.status);
                if token.status != 200 {
                    drop(st);
                    serial(&format!(
                        "kici-init: MMDS session token refused ({}): {}",
                        token.status, token.body
                    ));
                    idle_until_ctrl_alt_del(shared, mode, "mmds-token-refused");
                }
                let read = st.mmds.guest_request(
                    &GuestRequest::get("/latest/meta-data")
                        .with_header("X-metadata-token", &token.body)
                        .with_header("Accept", "application/json"),
                );
                st.guest.metadata_status = Some(read.status);
                if read.status == 200 {
                    if let Ok(v) = serde_json::from_str::<Value>(&read.body) {
                        if v.get("kici-agent-id").is_some() {
                            st.guest.metadata = Some(v.clone());
                            break v;
                        }
                    }
                }
            }
            st = shared.events.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    };
    let env = agent_env(&meta);
    {
        let mut st = shared.lock();
        st.guest.agent_env_keys = env.iter().map(|(k, _)| k.clone()).collect();
    }
    let Some(agent) = agent else {
        serial("kici-init: no guest agent configured (testkit); idling");
        idle_until_ctrl_alt_del(shared, mode, "idle-without-agent");
    };
    serial(&format!("kici-init: exec {}", agent.display()));
    let child = Command::new(&agent)
        .env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .envs(env)
        // Inherited: there is no /dev/null inside the jail to open.
        .stdin(Stdio::inherit())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            {
                let mut st = shared.lock();
                st.guest.agent_error = Some(e.to_string());
            }
            serial(&format!("kici-init: cannot start the agent: {e}"));
            serial("[    1.000000] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100");
            vmm_exit(shared, "panicked");
        }
    };
    let pumps: Vec<_> = [child.stdout.take().map(pump), child.stderr.take().map(pump)]
        .into_iter()
        .flatten()
        .collect();
    let pid = child.id();
    {
        let mut st = shared.lock();
        st.guest.agent_pid = Some(pid);
        st.guest.phase = "agent-running";
    }
    // The waiter reports the agent's exit through the shared state.
    let waiter_shared = Arc::clone(shared);
    std::thread::spawn(move || {
        let code = child.wait().ok().and_then(|s| s.code()).unwrap_or(-1);
        let mut st = waiter_shared.lock();
        st.guest.agent_exit_code = Some(code);
        waiter_shared.events.notify_all();
    });
    let mut st = shared.lock();
    loop {
        if let Some(code) = st.guest.agent_exit_code {
            drop(st);
            drain(&pumps);
            serial(&format!(
                "kici-init: agent exited with {code}; powering off"
            ));
            serial("[   10.000000] reboot: Power down");
            vmm_exit(shared, "powered-off");
        }
        if st.ctrl_alt_del_count > 0 && mode != GuestMode::IgnoreCtrlAltDel {
            st.guest.phase = "stopping";
            drop(st);
            serial("kici-init: Ctrl+Alt+Del: stopping the agent");
            stop_agent(shared, pid);
            serial("[   10.000000] reboot: Restarting system");
            vmm_exit(shared, "rebooted");
        }
        st = shared.events.wait(st).unwrap_or_else(|p| p.into_inner());
    }
}

fn stop_agent(shared: &Shared, pid: u32) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let Ok(raw) = i32::try_from(pid) else { return };
    let _ = kill(Pid::from_raw(raw), Signal::SIGTERM);
    let st = shared.lock();
    let (st, _) = shared
        .events
        .wait_timeout_while(st, AGENT_STOP_GRACE, |s| s.guest.agent_exit_code.is_none())
        .unwrap_or_else(|p| p.into_inner());
    if st.guest.agent_exit_code.is_none() {
        let _ = kill(Pid::from_raw(raw), Signal::SIGKILL);
    }
}

/// The contract's mapping of `latest/meta-data` to the agent environment.
pub fn agent_env(meta: &Value) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for (key, var) in [
        ("kici-orchestrator-url", "KICI_ORCHESTRATOR_URL"),
        ("kici-agent-id", "KICI_AGENT_ID"),
        ("kici-labels", "KICI_LABELS"),
        ("kici-scaler-managed", "KICI_SCALER_MANAGED"),
        ("kici-agent-token", "KICI_AGENT_TOKEN"),
        ("kici-backpressure-mode", "KICI_BACKPRESSURE_MODE"),
    ] {
        if let Some(v) = meta.get(key).and_then(Value::as_str) {
            env.push((var.to_string(), v.to_string()));
        }
    }
    if let Some(extra) = meta.get("kici-env").and_then(Value::as_object) {
        for (k, v) in extra {
            if let Some(v) = v.as_str() {
                env.push((k.clone(), v.to_string()));
            }
        }
    }
    env
}
