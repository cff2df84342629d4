//! Following a VM for its whole life: serial console and VMM log forwarded
//! as wrapped log events (sources `firecracker-serial`, `firecracker-vmm`,
//! through [`kici_host::logs::LogContext`]), boot failures recognised on
//! the serial console, and Firecracker's exit seen through a pidfd.
//!
//! Under `--new-pid-ns` the jailer exits as soon as the VM starts (upstream
//! stopped tailing then and so never forwarded anything the guest printed;
//! see docs/deviations.md, D-fc-vm-watch): here the watch ends only when Firecracker itself exits or
//! destroy stops it, after a final drain.
//!
//! The guest controls the serial console, so its file is bounded: Firecracker
//! writes it through one `O_APPEND` descriptor, and once more than
//! [`SERIAL_FILE_CAP`] bytes have been read (and forwarded) the file is
//! truncated to zero; Firecracker's next write lands at the new end. Bytes
//! written between the last read and the truncation are lost: the price of a
//! bound the guest cannot defeat. The serial device's rate limiter bounds
//! how fast it can fill.

use kici_engine::backend::ReportSender;
use kici_engine::BackendReport;
use kici_host::logs::{LineSplitter, LogContext, Stream};
use kici_model::AgentId;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const SERIAL_SOURCE: &str = "firecracker-serial";
pub const VMM_SOURCE: &str = "firecracker-vmm";
/// Serial bytes read before the file is truncated.
pub const SERIAL_FILE_CAP: u64 = 8 * 1024 * 1024;
const POLL: Duration = Duration::from_millis(200);
const READ_CHUNK: usize = 64 * 1024;

/// What a serial line says about the boot, most specific first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootFailureKind {
    RootfsMount,
    Init,
    KernelPanic,
}

impl BootFailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RootfsMount => "rootfs-mount-failure",
            Self::Init => "init-failure",
            Self::KernelPanic => "kernel-panic",
        }
    }

    /// Upstream's patterns (case-insensitive), classified so that
    /// "Kernel panic - not syncing: VFS: Unable to mount root fs" names the
    /// root cause rather than the panic.
    pub fn classify(line: &str) -> Option<Self> {
        let lower = line.to_ascii_lowercase();
        if lower.contains("vfs: unable to mount root fs") {
            Some(Self::RootfsMount)
        } else if lower.contains("failed to execute /init")
            || lower.contains("systemd[1]: failed")
            || lower.contains("failed to start")
            || lower.contains("no working init found")
        {
            Some(Self::Init)
        } else if lower.contains("kernel panic") || lower.contains("not syncing") {
            Some(Self::KernelPanic)
        } else {
            None
        }
    }
}

/// Where following a log file starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailFrom {
    /// The whole file (a VM this daemon just spawned).
    Start,
    /// Its end at the time the watch starts (a VM adopted after a daemon
    /// restart: the daemon that spawned it already forwarded what is there
    /// and reported any boot failure in it; reading it again would report
    /// that failure twice).
    End,
}

/// One followed file.
struct Source {
    stream: Stream,
    ctx: LogContext,
    path: PathBuf,
    file: Option<std::fs::File>,
    offset: u64,
    splitter: LineSplitter,
    /// Truncate after this many bytes read (serial only).
    cap: Option<u64>,
}

impl Source {
    fn new(ctx: LogContext, path: PathBuf, cap: Option<u64>) -> Self {
        Self {
            stream: Stream::Stdout,
            ctx,
            path,
            file: None,
            offset: 0,
            splitter: LineSplitter::default(),
            cap,
        }
    }

    /// Opens the file now and skips what it holds ([`TailFrom::End`]); a
    /// file not there yet is read from its start once it appears.
    fn skip_existing(&mut self) {
        let Ok(mut file) = std::fs::OpenOptions::new()
            .read(true)
            .write(self.cap.is_some())
            .open(&self.path)
        else {
            return;
        };
        if let Ok(end) = file.seek(SeekFrom::End(0)) {
            self.offset = end;
            self.file = Some(file);
        }
    }

    /// Reads what was appended; calls `line` for each complete line.
    fn drain(&mut self, line: &mut impl FnMut(&LogContext, Stream, &str)) {
        if self.file.is_none() {
            self.file = std::fs::OpenOptions::new()
                .read(true)
                .write(self.cap.is_some())
                .open(&self.path)
                .ok();
        }
        let Some(file) = self.file.as_mut() else {
            return;
        };
        if file.metadata().is_ok_and(|m| m.len() < self.offset) {
            // Truncated (by us or anyone): start over.
            self.offset = 0;
            if file.seek(SeekFrom::Start(0)).is_err() {
                return;
            }
        }
        let mut buf = vec![0u8; READ_CHUNK];
        let (ctx, stream) = (&self.ctx, self.stream);
        loop {
            match file.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    self.offset += n as u64;
                    self.splitter
                        .push(&buf[..n], &mut |l| line(ctx, stream, &l));
                }
            }
        }
        if let Some(cap) = self.cap {
            if self.offset > cap && file.set_len(0).is_ok() && file.seek(SeekFrom::Start(0)).is_ok()
            {
                self.offset = 0;
            }
        }
    }

    fn finish(&mut self, line: &mut impl FnMut(&LogContext, Stream, &str)) {
        self.drain(line);
        let (ctx, stream) = (&self.ctx, self.stream);
        self.splitter.finish(&mut |l| line(ctx, stream, &l));
    }
}

/// Shared between the watch task and destroy.
#[derive(Debug, Default)]
pub struct WatchState {
    /// Set by destroy before it signals: the exit is then not reported.
    pub destroying: AtomicBool,
    /// Set once Firecracker exited (its pid may be reused from then on).
    pub exited: AtomicBool,
}

/// The running watch of one VM.
pub struct VmWatch {
    pub state: Arc<WatchState>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    exited: tokio::sync::watch::Receiver<bool>,
}

/// What the watch needs.
pub struct WatchSpec {
    pub agent: AgentId,
    pub serial: LogContext,
    pub vmm: LogContext,
    pub serial_path: PathBuf,
    pub vmm_path: PathBuf,
    /// Firecracker's pidfd; `None` when it could not be opened (the process
    /// is then treated as gone).
    pub pidfd: Option<OwnedFd>,
    pub reports: ReportSender,
    pub from: TailFrom,
}

impl VmWatch {
    /// Starts following; must run inside a tokio runtime.
    pub fn start(spec: WatchSpec) -> Self {
        let state = Arc::new(WatchState::default());
        let (stop, stopped) = oneshot::channel();
        let (exited_tx, exited) = tokio::sync::watch::channel(false);
        // Opened here, not in the task: the offset of an adopted VM's logs
        // is their end now, whatever the guest writes before the task runs.
        let mut sources = [
            Source::new(
                spec.serial.clone(),
                spec.serial_path.clone(),
                Some(SERIAL_FILE_CAP),
            ),
            Source::new(spec.vmm.clone(), spec.vmm_path.clone(), None),
        ];
        if spec.from == TailFrom::End {
            for source in &mut sources {
                source.skip_existing();
            }
        }
        let task = tokio::spawn(run(spec, sources, state.clone(), stopped, exited_tx));
        Self {
            state,
            stop: Some(stop),
            task,
            exited,
        }
    }

    /// Waits until Firecracker exits, at most `limit`; whether it did.
    pub async fn wait_exit(&self, limit: Duration) -> bool {
        let mut exited = self.exited.clone();
        tokio::time::timeout(limit, exited.wait_for(|e| *e))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Stops following after forwarding everything written so far.
    pub async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

async fn run(
    spec: WatchSpec,
    mut sources: [Source; 2],
    state: Arc<WatchState>,
    mut stopped: oneshot::Receiver<()>,
    exited_tx: tokio::sync::watch::Sender<bool>,
) {
    let WatchSpec {
        agent,
        pidfd,
        reports,
        ..
    } = spec;
    let mut failure_reported = false;
    let mut on_line = |ctx: &LogContext, stream: Stream, line: &str| {
        ctx.emit(stream, line);
        if ctx.source == SERIAL_SOURCE && !failure_reported {
            if let Some(kind) = BootFailureKind::classify(line) {
                failure_reported = true;
                tracing::warn!(agent_id = %agent, failure = kind.as_str(), line, "VM boot failure");
                let _ = reports.send(BackendReport::BootFailure {
                    agent,
                    detail: format!("{}: {line}", kind.as_str()),
                });
            }
        }
    };
    let pidfd = pidfd.and_then(|fd| crate::pidfd::register(fd).ok());
    let mut gone = pidfd.is_none();
    loop {
        for source in &mut sources {
            source.drain(&mut on_line);
        }
        if gone {
            break;
        }
        tokio::select! {
            _ = &mut stopped => break,
            _ = readable(pidfd.as_ref()) => { gone = true; }
            () = tokio::time::sleep(POLL) => {}
        }
    }
    for source in &mut sources {
        source.finish(&mut on_line);
    }
    if gone {
        state.exited.store(true, Ordering::SeqCst);
        exited_tx.send_replace(true);
        if !state.destroying.load(Ordering::SeqCst) {
            tracing::info!(agent_id = %agent, "Firecracker exited");
            let _ = reports.send(BackendReport::Exited {
                agent,
                detail: "the Firecracker process exited".into(),
            });
        }
    }
}

async fn readable(fd: Option<&AsyncFd<OwnedFd>>) {
    match fd {
        // Readable = the process exited; an error means the same to us.
        Some(fd) => {
            let _ = fd.readable().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn firecracker_boot_failures_are_classified_most_specific_first() {
        let c = BootFailureKind::classify;
        assert_eq!(c("[    1.2] Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)"), Some(BootFailureKind::RootfsMount));
        assert_eq!(
            c("Kernel panic - not syncing: Attempted to kill init!"),
            Some(BootFailureKind::KernelPanic)
        );
        assert_eq!(
            c("Failed to execute /init (error -2)"),
            Some(BootFailureKind::Init)
        );
        assert_eq!(
            c("systemd[1]: Failed to mount /proc"),
            Some(BootFailureKind::Init)
        );
        assert_eq!(c("random: crng init done"), None);
        assert_eq!(BootFailureKind::Init.as_str(), "init-failure");
    }

    fn ctx(source: &'static str) -> LogContext {
        LogContext {
            agent: AgentId::new(kici_model::ScalerType::Firecracker, [9; 4]),
            scaler: kici_model::ScalerName::new("fc"),
            job: None,
            source,
        }
    }

    #[test]
    fn firecracker_serial_file_is_truncated_past_its_cap_without_losing_read_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial");
        let mut writer = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let mut source = Source::new(ctx(SERIAL_SOURCE), path.clone(), Some(100));
        let mut lines = Vec::new();
        use std::io::Write;
        for i in 0..30 {
            writeln!(writer, "line {i:02}").unwrap();
            source.drain(&mut |_, _, l| lines.push(l.to_owned()));
        }
        assert_eq!(lines.len(), 30);
        assert_eq!(lines[29], "line 29");
        assert!(std::fs::metadata(&path).unwrap().len() <= 100 + 8);
        // The appending writer keeps working after the truncation.
        writeln!(writer, "after").unwrap();
        source.finish(&mut |_, _, l| lines.push(l.to_owned()));
        assert_eq!(lines.last().unwrap(), "after");
    }

    #[tokio::test]
    async fn firecracker_watch_reports_boot_failure_and_exit_and_forwards_late_lines() {
        let dir = tempfile::tempdir().unwrap();
        let serial = dir.path().join("serial");
        let vmm = dir.path().join("vmm");
        std::fs::write(
            &serial,
            b"booting\nKernel panic - not syncing: VFS: Unable to mount root fs\n",
        )
        .unwrap();
        std::fs::write(&vmm, b"").unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap();
        let (reports, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let agent = AgentId::new(kici_model::ScalerType::Firecracker, [9; 4]);
        let watch = VmWatch::start(WatchSpec {
            agent,
            serial: ctx(SERIAL_SOURCE),
            vmm: ctx(VMM_SOURCE),
            serial_path: serial,
            vmm_path: vmm,
            pidfd: Some(pidfd),
            reports,
            from: TailFrom::Start,
        });
        match rx.recv().await.unwrap() {
            BackendReport::BootFailure { agent: a, detail } => {
                assert_eq!(a, agent);
                assert!(detail.starts_with("rootfs-mount-failure: "), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(watch.wait_exit(Duration::from_secs(30)).await);
        assert!(matches!(
            rx.recv().await.unwrap(),
            BackendReport::Exited { .. }
        ));
        watch.finish().await;
    }

    /// An adopted VM (daemon restart): the boot failure the previous daemon
    /// already reported is not reported again; a new one is.
    #[tokio::test]
    async fn firecracker_adopted_watch_tails_from_the_end_and_reports_only_new_failures() {
        let dir = tempfile::tempdir().unwrap();
        let serial = dir.path().join("serial");
        let vmm = dir.path().join("vmm");
        std::fs::write(
            &serial,
            b"booting\nKernel panic - not syncing: VFS: Unable to mount root fs\npartial",
        )
        .unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap();
        let (reports, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let agent = AgentId::new(kici_model::ScalerType::Firecracker, [7; 4]);
        let watch = VmWatch::start(WatchSpec {
            agent,
            serial: ctx(SERIAL_SOURCE),
            vmm: ctx(VMM_SOURCE),
            serial_path: serial.clone(),
            vmm_path: vmm.clone(),
            pidfd: Some(pidfd),
            reports,
            from: TailFrom::End,
        });
        // The VMM log appears only now: read from its start.
        std::fs::write(&vmm, b"vmm says hi\n").unwrap();
        {
            use std::io::Write;
            let mut w = std::fs::OpenOptions::new()
                .append(true)
                .open(&serial)
                .unwrap();
            writeln!(w, "\nFailed to execute /init (error -2)").unwrap();
        }
        let next = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("a report within 30 s");
        match next.unwrap() {
            BackendReport::BootFailure { agent: a, detail } => {
                assert_eq!(a, agent);
                assert!(detail.starts_with("init-failure: "), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(watch.wait_exit(Duration::from_secs(30)).await);
        assert!(matches!(
            rx.recv().await.unwrap(),
            BackendReport::Exited { .. }
        ));
        watch.finish().await;
        assert!(rx.try_recv().is_err(), "the old panic was not reported");
    }

    #[test]
    fn firecracker_tail_from_end_skips_existing_bytes_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial");
        std::fs::write(&path, b"old 1\nold 2\n").unwrap();
        let mut source = Source::new(ctx(SERIAL_SOURCE), path.clone(), Some(1 << 20));
        source.skip_existing();
        {
            use std::io::Write;
            let mut w = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .unwrap();
            writeln!(w, "new").unwrap();
        }
        let mut lines = Vec::new();
        source.finish(&mut |_, _, l| lines.push(l.to_owned()));
        assert_eq!(lines, ["new"]);
        // A file that does not exist yet is read whole once it appears.
        let later = dir.path().join("vmm");
        let mut source = Source::new(ctx(VMM_SOURCE), later.clone(), None);
        source.skip_existing();
        std::fs::write(&later, b"first\n").unwrap();
        let mut lines = Vec::new();
        source.finish(&mut |_, _, l| lines.push(l.to_owned()));
        assert_eq!(lines, ["first"]);
    }
}
