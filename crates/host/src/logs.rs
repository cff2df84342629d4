//! Agent output: files on disk, forwarded line by line as wrapped log events.
//!
//! Agents write their stdout and stderr straight into files (never a pipe
//! the daemon must drain: a daemon crash would SIGPIPE them). A [`Tailer`]
//! follows both files and emits every line as one `tracing` event with the
//! daemon's own fields (`agent_id`, `scaler`, `job_id`, `stream`, `source`)
//! and the agent's text as the *string* field `line`. Nothing in the line is
//! parsed, so an agent cannot forge attribution (upstream could): a line
//! `{"agentId":"evil"}` stays a string inside our event.
//!
//! Where upstream's tailer went wrong (docs/deviations.md, D-log-forwarding):
//! the offset is the bytes consumed, not a later `stat`; a file that shrank
//! is re-read from the start; one task reads each file; at stop everything
//! written is drained before the task ends, the incomplete last line
//! included; lines are decoded whole, so a multi-byte character split
//! between reads survives; lines are capped at [`MAX_LINE_BYTES`] with a
//! marker.
//!
//! Resuming after a daemon restart ([`Tailer::start_resumable`]): the
//! offset of the last *forwarded whole line* of each file is kept beside it
//! (`<file>.offset`, rewritten in place after every batch — a page-cache
//! write, so it survives a daemon crash, which is what it is for). A new
//! daemon resumes there: output the agent wrote while no daemon ran is
//! forwarded, nothing is lost, and at most the last batch before a crash is
//! forwarded twice (at-least-once). Starting from the current end instead
//! would silently drop everything written while the daemon was down — the
//! output of a job that ran through the restart.
//!
//! Bounded while the agent runs ([`TailerOptions::keep_bytes`]): once more
//! than the kept amount of a file was forwarded, the forwarded head is
//! punched out (`fallocate(PUNCH_HOLE | KEEP_SIZE)`), in steps of a quarter
//! of the kept amount, and a marker line at offset 0 says how many bytes
//! went. The agent keeps appending (its descriptor and `O_APPEND` position
//! are untouched), offsets stay valid for a resumed tailer, and nothing
//! unforwarded is ever dropped — which truncating or rotating under a
//! writer that is not ours could not promise. The file's apparent size
//! keeps growing; its disk use stays near the kept amount plus whatever is
//! not yet forwarded (while no daemon runs, nothing is bounded). The holes
//! read as NUL bytes.
//!
//! Retention: after destroy an agent's directory is reduced to the last
//! [`RETAINED_BYTES_PER_FILE`] of each log file under `retired/<agent id>`,
//! and only the newest [`RETAINED_AGENTS`] retired directories are kept —
//! enough to read why a recent agent failed, bounded on disk.

use kici_model::{AgentId, JobId, ScalerName};
use std::io::{self, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::notify::FileWatch;

/// Longest forwarded line; longer lines are cut and marked.
pub const MAX_LINE_BYTES: usize = 16 * 1024;
/// Bytes of each log file kept after an agent is destroyed.
pub const RETAINED_BYTES_PER_FILE: u64 = 64 * 1024;
/// Retired agents whose logs are kept.
pub const RETAINED_AGENTS: usize = 32;
/// The `tracing` target of forwarded agent lines.
pub const TARGET: &str = "kici_host::agent_output";

/// How often files are re-read when no inotify event came (inotify may be
/// unavailable, or an event lost: that must cost latency, never lines).
const FALLBACK_POLL: Duration = Duration::from_millis(500);
const READ_CHUNK: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
        }
    }

    pub fn file_name(self) -> &'static str {
        match self {
            Self::Stdout => "stdout.log",
            Self::Stderr => "stderr.log",
        }
    }
}

/// The daemon-side fields of every forwarded line.
#[derive(Debug, Clone)]
pub struct LogContext {
    pub agent: AgentId,
    pub scaler: ScalerName,
    pub job: Option<JobId>,
    /// `bare-metal`, `docker`, `firecracker-serial`, … (upstream's `logsSource` values).
    pub source: &'static str,
}

impl LogContext {
    pub fn emit(&self, stream: Stream, line: &str) {
        tracing::info!(
            target: TARGET,
            agent_id = %self.agent,
            scaler = self.scaler.as_str(),
            job_id = self.job.as_ref().map(JobId::as_str),
            stream = stream.as_str(),
            source = self.source,
            line,
            "agent output"
        );
    }
}

/// Cuts a byte stream into lines of at most [`MAX_LINE_BYTES`].
#[derive(Debug, Default)]
pub struct LineSplitter {
    line: Vec<u8>,
    /// Bytes of the current line beyond the cap.
    dropped: usize,
}

impl LineSplitter {
    /// Feeds `bytes`; calls `emit` for every line they complete.
    pub fn push(&mut self, mut bytes: &[u8], emit: &mut impl FnMut(String)) {
        while !bytes.is_empty() {
            let (part, rest, ends) = match bytes.iter().position(|b| *b == b'\n') {
                Some(i) => (&bytes[..i], &bytes[i + 1..], true),
                None => (bytes, &bytes[bytes.len()..], false),
            };
            let room = MAX_LINE_BYTES.saturating_sub(self.line.len());
            let take = part.len().min(room);
            self.line.extend_from_slice(&part[..take]);
            self.dropped += part.len() - take;
            if ends {
                emit(self.take_line());
            }
            bytes = rest;
        }
    }

    /// Bytes consumed that belong to the current, incomplete line (what a
    /// resumed reader must read again to see that line whole).
    pub fn pending_bytes(&self) -> usize {
        self.line.len() + self.dropped
    }

    /// The incomplete last line, if any.
    pub fn finish(&mut self, emit: &mut impl FnMut(String)) {
        if !self.line.is_empty() || self.dropped > 0 {
            emit(self.take_line());
        }
    }

    fn take_line(&mut self) -> String {
        let mut bytes = std::mem::take(&mut self.line);
        let dropped = std::mem::take(&mut self.dropped);
        if dropped == 0 && bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
        if dropped == 0 {
            return String::from_utf8_lossy(&bytes).into_owned();
        }
        // Cut at a character boundary, so the cap does not forge a U+FFFD.
        let kept = complete_utf8_prefix(&bytes);
        let cut = bytes.len() - kept.len() + dropped;
        format!("{}…[truncated {cut} bytes]", String::from_utf8_lossy(kept))
    }
}

/// `bytes` without a trailing incomplete UTF-8 sequence.
fn complete_utf8_prefix(bytes: &[u8]) -> &[u8] {
    let n = bytes.len();
    for back in 1..=n.min(4) {
        let b = bytes[n - back];
        if b & 0xC0 == 0x80 {
            continue;
        }
        let needed = match b {
            0xF0..=0xFF => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if needed > back {
            &bytes[..n - back]
        } else {
            bytes
        };
    }
    bytes
}

/// Width of an offset file's content: fixed, so an in-place rewrite never
/// leaves digits of a longer previous value behind.
const OFFSET_WIDTH: usize = 20;

/// `<file>.offset` beside a followed file.
pub fn offset_path(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".offset");
    PathBuf::from(name)
}

/// The persisted offset of `log` (0 when none was recorded or it is unreadable).
pub fn read_offset(log: &Path) -> u64 {
    std::fs::read_to_string(offset_path(log))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Rewrites the offset file in place when `forwarded` moved.
fn record_offset(file: Option<&std::fs::File>, forwarded: u64, persisted: &mut u64) {
    use std::os::unix::fs::FileExt;
    let Some(file) = file else {
        return;
    };
    if forwarded == *persisted {
        return;
    }
    let text = format!("{forwarded:0OFFSET_WIDTH$}\n");
    // Best effort: a lost update costs duplicates after a restart.
    if file.write_at(text.as_bytes(), 0).is_ok() {
        *persisted = forwarded;
    }
}

/// Holes are freed in whole filesystem blocks: punch block-aligned ranges.
const PUNCH_ALIGN: u64 = 4096;

/// Keeps a followed file's forwarded head from using disk.
struct Bound {
    keep: u64,
    /// Bytes from offset 0 already punched out.
    punched: u64,
    /// Write access for the punch and the marker (opened on first use).
    writer: Option<std::fs::File>,
    /// The filesystem cannot punch holes (or the file cannot be opened for
    /// writing): stop trying, after one warning.
    disabled: bool,
}

impl Bound {
    fn new(keep: std::num::NonZeroU64) -> Self {
        Self {
            // Never less than the retired tail, so that tail is never a hole.
            keep: keep.get().max(RETAINED_BYTES_PER_FILE),
            punched: 0,
            writer: None,
            disabled: false,
        }
    }

    /// Punches out what lies more than `keep` bytes before `forwarded`.
    fn apply(&mut self, path: &Path, forwarded: u64) {
        use std::os::unix::fs::FileExt;
        if self.disabled {
            return;
        }
        let end = forwarded.saturating_sub(self.keep) / PUNCH_ALIGN * PUNCH_ALIGN;
        if end < self.punched + (self.keep / 4).max(PUNCH_ALIGN) {
            return;
        }
        if self.writer.is_none() {
            match std::fs::OpenOptions::new().write(true).open(path) {
                Ok(f) => self.writer = Some(f),
                Err(e) => return self.disable(path, &e),
            }
        }
        let Some(writer) = &self.writer else {
            return;
        };
        let punch = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        if let Err(e) = rustix::fs::fallocate(writer, punch, 0, end) {
            return self.disable(path, &e.into());
        }
        self.punched = end;
        // Within the forwarded head, so never under the agent's appends.
        let marker = truncation_marker(end);
        if let Err(e) = writer.write_at(marker.as_bytes(), 0) {
            tracing::debug!(file = %path.display(), error = %e, "cannot mark the removed log head");
        }
    }

    fn disable(&mut self, path: &Path, error: &io::Error) {
        self.disabled = true;
        tracing::warn!(
            file = %path.display(),
            error = %error,
            "cannot bound the agent's log file (punching holes failed): it grows until the agent is destroyed"
        );
    }
}

/// The line at offset 0 of a file whose first `removed` bytes were punched.
pub fn truncation_marker(removed: u64) -> String {
    format!("[kici-scaler: the first {removed} bytes of this file were forwarded and removed to bound it]\n")
}

/// How a [`Tailer`] treats the files it follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TailerOptions {
    /// Keep each file's forwarded offset beside it and start from a
    /// previous tailer's ([`Tailer::start_resumable`]).
    pub resumable: bool,
    /// Bound each file's disk use while following it: forwarded bytes more
    /// than this far behind are punched out (at least
    /// [`RETAINED_BYTES_PER_FILE`]). `None`: files grow freely.
    pub keep_bytes: Option<std::num::NonZeroU64>,
}

/// One followed file.
struct Source {
    stream: Stream,
    path: PathBuf,
    file: Option<tokio::fs::File>,
    /// Bytes of the file consumed (whole lines and the pending partial one).
    offset: u64,
    splitter: LineSplitter,
    /// Where the offset of the last forwarded whole line is kept, when the
    /// tailer is resumable.
    offset_file: Option<std::fs::File>,
    /// The last value written there.
    persisted: u64,
    bound: Option<Bound>,
}

impl Source {
    fn new(stream: Stream, dir: &Path, options: TailerOptions) -> Self {
        let path = dir.join(stream.file_name());
        let (offset, offset_file) = if options.resumable {
            let offset = read_offset(&path);
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(offset_path(&path))
                .map_err(|e| tracing::warn!(file = %path.display(), error = %e, "cannot keep the log offset: a restart will forward from the beginning"))
                .ok();
            (offset, file)
        } else {
            (0, None)
        };
        Self {
            stream,
            path,
            file: None,
            offset,
            splitter: LineSplitter::default(),
            offset_file,
            persisted: offset,
            bound: options.keep_bytes.map(Bound::new),
        }
    }

    /// Records the end of the last forwarded whole line.
    fn persist(&mut self) {
        record_offset(
            self.offset_file.as_ref(),
            self.offset
                .saturating_sub(self.splitter.pending_bytes() as u64),
            &mut self.persisted,
        );
    }

    /// Reads everything appended since the last call and emits whole lines.
    async fn drain(&mut self, ctx: &LogContext) {
        if self.file.is_none() {
            let Ok(mut file) = tokio::fs::File::open(&self.path).await else {
                return;
            };
            // Resuming: continue after what was already forwarded (a file
            // shorter than that was replaced: the check below restarts it).
            let len = file.metadata().await.map(|m| m.len()).unwrap_or(0);
            if self.offset > 0
                && self.offset <= len
                && file.seek(SeekFrom::Start(self.offset)).await.is_err()
            {
                return;
            }
            self.file = Some(file);
        }
        let Some(file) = self.file.as_mut() else {
            return;
        };
        if let Ok(meta) = file.metadata().await {
            if meta.len() < self.offset {
                // Truncated underneath us: start over, not mid-line.
                self.offset = 0;
                self.splitter = LineSplitter::default();
                if file.seek(SeekFrom::Start(0)).await.is_err() {
                    return;
                }
            }
        }
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            match file.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    self.offset += n as u64;
                    let stream = self.stream;
                    self.splitter
                        .push(&buf[..n], &mut |line| ctx.emit(stream, &line));
                    // Before the next await: only a crash can come between
                    // forwarding a chunk's lines and recording them.
                    let forwarded = self
                        .offset
                        .saturating_sub(self.splitter.pending_bytes() as u64);
                    record_offset(self.offset_file.as_ref(), forwarded, &mut self.persisted);
                    if let Some(bound) = &mut self.bound {
                        bound.apply(&self.path, forwarded);
                    }
                }
            }
        }
    }

    fn finish(&mut self, ctx: &LogContext) {
        let stream = self.stream;
        self.splitter.finish(&mut |line| ctx.emit(stream, &line));
        self.persist();
    }
}

/// Follows an agent's stdout and stderr files until [`Tailer::finish`].
pub struct Tailer {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Tailer {
    /// Starts following `<dir>/stdout.log` and `<dir>/stderr.log` from their
    /// beginning (they are created empty before the agent starts).
    pub fn start(ctx: LogContext, dir: &Path) -> Self {
        Self::start_with_options(ctx, dir, TailerOptions::default())
    }

    /// Like [`Tailer::start`], but keeps each file's forwarded offset beside
    /// it and starts from the offsets a previous tailer (of an earlier
    /// daemon) kept: see the module docs for why.
    pub fn start_resumable(ctx: LogContext, dir: &Path) -> Self {
        Self::start_with_options(
            ctx,
            dir,
            TailerOptions {
                resumable: true,
                keep_bytes: None,
            },
        )
    }

    /// Follows `<dir>/stdout.log` and `<dir>/stderr.log` as `options` say.
    pub fn start_with_options(ctx: LogContext, dir: &Path, options: TailerOptions) -> Self {
        let sources: Vec<Source> = [Stream::Stdout, Stream::Stderr]
            .into_iter()
            .map(|stream| Source::new(stream, dir, options))
            .collect();
        let watch = FileWatch::new(sources.iter().map(|s| s.path.as_path()))
            .map_err(|e| tracing::warn!(agent_id = %ctx.agent, error = %e, "no inotify for agent logs; polling"))
            .ok();
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(run(ctx, sources, watch, stopped));
        Self {
            stop: Some(stop),
            task,
        }
    }

    /// Stops following after forwarding everything written so far.
    pub async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // A panicked tailer has nothing left to flush.
        let _ = (&mut self.task).await;
    }
}

async fn run(
    ctx: LogContext,
    mut sources: Vec<Source>,
    watch: Option<FileWatch>,
    mut stopped: oneshot::Receiver<()>,
) {
    loop {
        for source in &mut sources {
            source.drain(&ctx).await;
        }
        tokio::select! {
            _ = &mut stopped => break,
            Some(()) = changed(watch.as_ref()) => {}
            () = tokio::time::sleep(FALLBACK_POLL) => {}
        }
    }
    for source in &mut sources {
        source.drain(&ctx).await;
        source.finish(&ctx);
    }
}

/// `Some` when a watched file changed; never resolves without a watch or
/// when the watch failed (the fallback tick takes over).
async fn changed(watch: Option<&FileWatch>) -> Option<()> {
    match watch {
        Some(w) => match w.changed().await {
            Ok(()) => Some(()),
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// Moves an agent's logs to `<retired>/<agent id>` (the last
/// [`RETAINED_BYTES_PER_FILE`] of each file), removes the agent's directory,
/// and keeps only the newest [`RETAINED_AGENTS`] retired directories.
pub fn retire(agent_dir: &Path, retired: &Path) -> io::Result<()> {
    let Some(name) = agent_dir.file_name() else {
        return Ok(());
    };
    if !agent_dir.exists() {
        return Ok(());
    }
    let target = retired.join(name);
    if target.exists() {
        std::fs::remove_dir_all(&target)?;
    }
    std::fs::create_dir_all(&target)?;
    for stream in [Stream::Stdout, Stream::Stderr] {
        let from = agent_dir.join(stream.file_name());
        if from.exists() {
            copy_tail(
                &from,
                &target.join(stream.file_name()),
                RETAINED_BYTES_PER_FILE,
            )?;
        }
    }
    match std::fs::remove_dir_all(agent_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    prune_retired(retired, RETAINED_AGENTS)
}

fn copy_tail(from: &Path, to: &Path, keep: u64) -> io::Result<()> {
    use std::io::{Read, Seek};
    let mut src = std::fs::File::open(from)?;
    let len = src.metadata()?.len();
    src.seek(SeekFrom::Start(len.saturating_sub(keep)))?;
    let mut dst = std::fs::File::create(to)?;
    std::io::copy(&mut src.take(keep), &mut dst)?;
    Ok(())
}

fn prune_retired(retired: &Path, keep: usize) -> io::Result<()> {
    let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(retired)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if dirs.len() <= keep {
        return Ok(());
    }
    dirs.sort();
    for (_, dir) in &dirs[..dirs.len() - keep] {
        std::fs::remove_dir_all(dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn split(chunks: &[&[u8]]) -> Vec<String> {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut |l| out.push(l));
        }
        s.finish(&mut |l| out.push(l));
        out
    }

    #[test]
    fn lines_split_across_reads_and_crlf() {
        assert_eq!(split(&[b"a\r\nb", b"c\n\nd"]), vec!["a", "bc", "", "d"]);
        // A multi-byte character split between two reads survives.
        let e = "é".as_bytes();
        assert_eq!(split(&[&[b'x', e[0]], &[e[1], b'\n']]), vec!["xé"]);
    }

    #[test]
    fn long_lines_are_cut_with_a_marker_at_a_char_boundary() {
        let mut long = vec![b'a'; MAX_LINE_BYTES - 1];
        long.extend_from_slice("é".as_bytes());
        long.extend_from_slice(&[b'b'; 100]);
        long.push(b'\n');
        long.extend_from_slice(b"next\n");
        let lines = split(&[&long]);
        assert_eq!(lines.len(), 2);
        let expected = format!("{}…[truncated 102 bytes]", "a".repeat(MAX_LINE_BYTES - 1));
        assert_eq!(lines[0], expected);
        assert_eq!(lines[1], "next");
    }

    #[test]
    fn newline_free_output_is_bounded() {
        let mut s = LineSplitter::default();
        let chunk = vec![b'z'; 1 << 20];
        for _ in 0..8 {
            s.push(&chunk, &mut |_| panic!("no line yet"));
        }
        assert!(s.line.len() <= MAX_LINE_BYTES);
        let mut out = Vec::new();
        s.finish(&mut |l| out.push(l));
        assert!(out[0].ends_with(&format!(
            "…[truncated {} bytes]",
            (8 << 20) - MAX_LINE_BYTES
        )));
    }

    /// Forwarded `line` fields, as they are emitted.
    struct Lines(tokio::sync::mpsc::UnboundedSender<String>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Lines {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            struct Visit(Option<String>);
            impl tracing::field::Visit for Visit {
                fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                    if field.name() == "line" {
                        self.0 = Some(value.to_owned());
                    }
                }
                fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
            }
            let mut visit = Visit(None);
            event.record(&mut visit);
            if let Some(line) = visit.0 {
                let _ = self.0.send(line);
            }
        }
    }

    async fn next_lines(
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
        n: usize,
    ) -> Vec<String> {
        let mut lines = Vec::new();
        while lines.len() < n {
            let line = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                .await
                .expect("a forwarded line within a minute")
                .unwrap();
            lines.push(line);
        }
        lines
    }

    #[tokio::test]
    async fn a_resumed_tailer_forwards_what_was_written_while_none_ran() {
        use tracing_subscriber::layer::SubscriberExt;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(Lines(tx)));
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("stdout.log");
        std::fs::write(&log, "one\ntwo\npar").unwrap();
        let ctx = LogContext {
            agent: AgentId::random(kici_model::ScalerType::BareMetal),
            scaler: ScalerName::new("metal"),
            job: None,
            source: "test",
        };

        let first = Tailer::start_resumable(ctx.clone(), dir.path());
        assert_eq!(next_lines(&mut rx, 2).await, ["one", "two"]);
        // The daemon dies (no drain, no finish): the partial line is not
        // counted as forwarded.
        first.task.abort();
        let _ = first.task.await;
        assert_eq!(read_offset(&log), 8);
        assert_eq!(
            std::fs::read_to_string(offset_path(&log)).unwrap(),
            format!("{:020}\n", 8)
        );

        // Written while no daemon ran.
        let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        std::io::Write::write_all(&mut file, b"tial\nthree\n").unwrap();
        let second = Tailer::start_resumable(ctx.clone(), dir.path());
        assert_eq!(next_lines(&mut rx, 2).await, ["partial", "three"]);
        second.finish().await;
        assert!(rx.try_recv().is_err(), "nothing forwarded twice");
        assert_eq!(read_offset(&log), 22);

        // A plain tailer neither reads nor keeps offsets.
        std::fs::remove_file(offset_path(&log)).unwrap();
        let plain = Tailer::start(ctx, dir.path());
        assert_eq!(
            next_lines(&mut rx, 4).await,
            ["one", "two", "partial", "three"]
        );
        plain.finish().await;
        assert!(!offset_path(&log).exists());
    }

    #[tokio::test]
    async fn a_bounded_tailer_punches_out_the_forwarded_head_and_marks_it() {
        use std::os::unix::fs::MetadataExt;
        use tracing_subscriber::layer::SubscriberExt;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(Lines(tx)));
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("stdout.log");
        // 10,240 lines of 100 bytes: 1,024,000 bytes.
        let lines: Vec<String> = (0..10_240).map(|i| format!("{i:099}")).collect();
        std::fs::write(
            &log,
            lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
        )
        .unwrap();
        let keep = RETAINED_BYTES_PER_FILE;
        let ctx = LogContext {
            agent: AgentId::random(kici_model::ScalerType::BareMetal),
            scaler: ScalerName::new("metal"),
            job: None,
            source: "test",
        };
        let tailer = Tailer::start_with_options(
            ctx,
            dir.path(),
            TailerOptions {
                resumable: true,
                keep_bytes: std::num::NonZeroU64::new(keep),
            },
        );
        // Every line forwarded once, in order, none lost to the punching.
        assert_eq!(next_lines(&mut rx, lines.len()).await, lines);
        tailer.finish().await;
        assert!(rx.try_recv().is_err());

        let meta = std::fs::metadata(&log).unwrap();
        assert_eq!(meta.len(), 1_024_000, "the apparent size is kept");
        let on_disk = meta.blocks() * 512;
        // What is kept, the punching step, partial blocks and the marker's.
        assert!(
            on_disk <= keep + keep / 4 + 4 * PUNCH_ALIGN,
            "{on_disk} bytes on disk"
        );
        let text = std::fs::read(&log).unwrap();
        let first = text.split(|b| *b == b'\n').next().unwrap();
        let first = String::from_utf8(first.to_vec()).unwrap();
        let removed: u64 = first
            .strip_prefix("[kici-scaler: the first ")
            .and_then(|r| r.split(' ').next())
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(first, truncation_marker(removed).trim_end());
        assert!(
            removed.is_multiple_of(PUNCH_ALIGN)
                && removed >= 1_024_000 - keep - keep / 4 - PUNCH_ALIGN
        );
        // The kept tail is intact.
        let tail = &text[text.len() - keep as usize..];
        assert!(tail.ends_with(format!("{}\n", lines[10_239]).as_bytes()));
        assert!(!tail.contains(&0));
        assert_eq!(read_offset(&log), 1_024_000);
    }

    #[tokio::test]
    async fn a_resumed_tailer_restarts_a_file_shorter_than_its_offset() {
        use tracing_subscriber::layer::SubscriberExt;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let _guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(Lines(tx)));
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("stderr.log");
        std::fs::write(&log, "new\n").unwrap();
        std::fs::write(offset_path(&log), format!("{:020}\n", 1000)).unwrap();
        let ctx = LogContext {
            agent: AgentId::random(kici_model::ScalerType::BareMetal),
            scaler: ScalerName::new("metal"),
            job: None,
            source: "test",
        };
        let tailer = Tailer::start_resumable(ctx, dir.path());
        assert_eq!(next_lines(&mut rx, 1).await, ["new"]);
        tailer.finish().await;
        assert_eq!(read_offset(&log), 4);
    }

    #[test]
    fn retirement_keeps_bounded_tails_of_the_newest_agents() {
        let dir = tempfile::tempdir().unwrap();
        let retired = dir.path().join("retired");
        let mut names = Vec::new();
        for i in 0..RETAINED_AGENTS + 2 {
            let agent = dir.path().join(format!("agent-{i:02}"));
            std::fs::create_dir_all(agent.join("work")).unwrap();
            let big = vec![b'x'; (RETAINED_BYTES_PER_FILE + 10) as usize];
            std::fs::write(agent.join("stdout.log"), &big).unwrap();
            std::fs::write(agent.join("stderr.log"), b"why it failed\n").unwrap();
            retire(&agent, &retired).unwrap();
            assert!(!agent.exists());
            names.push(format!("agent-{i:02}"));
            // Distinct modification times order the pruning.
            let t = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + i as u64);
            std::fs::File::open(retired.join(&names[i]))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        let mut kept: Vec<String> = std::fs::read_dir(&retired)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        kept.sort();
        assert_eq!(kept.len(), RETAINED_AGENTS);
        assert_eq!(kept[0], "agent-02");
        let last = retired.join(kept.last().unwrap());
        assert_eq!(
            std::fs::metadata(last.join("stdout.log")).unwrap().len(),
            RETAINED_BYTES_PER_FILE
        );
        assert_eq!(
            std::fs::read(last.join("stderr.log")).unwrap(),
            b"why it failed\n"
        );
        assert!(!last.join("work").exists());
    }
}
