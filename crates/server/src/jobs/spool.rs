//! A standalone job's output on disk, so that what a job printed before a
//! daemon crash is still readable after the restart.
//!
//! The output arrives over the agent gateway into the daemon's memory (the
//! only copy before this): one file per job in the spool directory (the
//! state dir's `job-output/`) receives each chunk as it arrives, with one
//! `write` per chunk and no user-space buffer, so a `kill -9` of the daemon
//! loses nothing written (the page cache belongs to the kernel). A power
//! loss can lose the tail; so it does the job itself. No fsync: it would
//! make every chunk wait on the disk.
//!
//! Format: [`MAGIC`], then frames of `kind: u8`, `index: u64 LE`,
//! `len: u32 LE`, `len` bytes. Kind 0 / 1 is a stdout / stderr chunk with
//! its index; kind 2 ([`SKIP`]) opens every file and says where its chunks
//! start: `index` is the first chunk's index, the 8 payload bytes (LE) how
//! many bytes of output came before it and are not in the file. Chunk
//! indexes then follow one by one. A torn last frame (a crash in the middle
//! of a write) is ignored when the file is read back.
//!
//! The file is bounded like the memory buffer: once it holds about twice
//! the per-job cap, it is rewritten from what memory keeps (the newest cap
//! of bytes) under a new skip frame, into a temporary file renamed over it
//! (a crash meanwhile leaves the old file or the new one, both whole).
//!
//! Output may carry secrets: the directory is 0700 and each file 0600.

use kici_model::JobId;
use kici_protocol::{ChunkData, OutputStream, MAX_OUTPUT_CHUNK_BYTES};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Opens every spool file (and names the format's version).
const MAGIC: &[u8; 8] = b"KICIOUT1";
/// The frame kind that says where the file's chunks start.
const SKIP: u8 = 2;
/// Bytes of a frame before its payload.
const FRAME_HEAD: usize = 1 + 8 + 4;
/// Beyond this many bytes over twice the cap, the file is rewritten.
const COMPACT_SLACK: u64 = 64 * 1024;
/// File name suffix (the rest is the job id).
const SUFFIX: &str = ".out";

/// The directory of every job's output file.
#[derive(Debug, Clone)]
pub struct Spool {
    dir: PathBuf,
}

/// A job's output file, open for appending.
#[derive(Debug)]
pub struct SpoolFile {
    file: File,
    path: PathBuf,
    /// The file's length.
    len: u64,
}

/// A job's output as read back from its file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// The index of the first chunk in `chunks`.
    pub first_index: u64,
    /// Bytes of output before that chunk, no longer in the file.
    pub dropped_bytes: u64,
    pub chunks: Vec<(OutputStream, ChunkData)>,
}

impl Spool {
    /// Creates the directory if needed (mode 0700).
    pub fn open(dir: &Path) -> io::Result<Self> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// The file of `job`; `None` for an id that is not a plain file name
    /// (ids minted here always are: `job-` + hex).
    fn path(&self, job: &JobId) -> Option<PathBuf> {
        let id = job.as_str();
        let plain = !id.is_empty()
            && !id.starts_with('.')
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        plain.then(|| self.dir.join(format!("{id}{SUFFIX}")))
    }

    /// A new, empty output file for `job` (an old one is replaced).
    pub fn create(&self, job: &JobId) -> io::Result<SpoolFile> {
        let path = self.path(job).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "job id is not a file name")
        })?;
        write_new(&path, 0, 0, std::iter::empty())
    }

    /// Reads `job`'s output back. `Ok(None)`: there is no file.
    pub fn recover(&self, job: &JobId) -> io::Result<Option<Recovered>> {
        let Some(path) = self.path(job) else {
            return Ok(None);
        };
        match std::fs::read(&path) {
            Ok(bytes) => parse(&bytes).map(Some),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Deletes `job`'s file (if any).
    pub fn remove(&self, job: &JobId) {
        if let Some(path) = self.path(job) {
            if let Err(e) = std::fs::remove_file(&path) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a job's output file");
                }
            }
        }
    }

    /// Deletes every file whose job `keep` refuses (a job forgotten while
    /// the daemon was down, a temporary file of an interrupted rewrite).
    pub fn remove_others(&self, keep: impl Fn(&str) -> bool) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let job = name.strip_suffix(SUFFIX);
            if job.is_some_and(&keep) {
                continue;
            }
            if std::fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

impl SpoolFile {
    /// Appends one chunk (one `write`).
    pub fn append(&mut self, index: u64, stream: OutputStream, data: &ChunkData) -> io::Result<()> {
        let frame = frame(stream_kind(stream), index, data.as_bytes());
        self.file.write_all(&frame)?;
        self.len += frame.len() as u64;
        Ok(())
    }

    /// Whether the file grew past about twice `cap` and should be
    /// rewritten from what memory keeps.
    pub fn wants_compaction(&self, cap: usize) -> bool {
        self.len > 2 * cap as u64 + COMPACT_SLACK
    }

    /// Whether the file holds more than `kept` output bytes in `chunks`
    /// chunks need, by more than the slack (a finished job's file is
    /// rewritten to what is readable).
    pub fn larger_than(&self, kept: usize, chunks: usize) -> bool {
        let needed = (MAGIC.len() + FRAME_HEAD * (chunks + 1) + 8 + kept) as u64;
        self.len > needed + COMPACT_SLACK
    }

    /// Replaces the file with `chunks` (the first is `first_index`; before
    /// it, `dropped_bytes` bytes of output), through a temporary file
    /// renamed over it.
    pub fn rewrite<'a>(
        &mut self,
        first_index: u64,
        dropped_bytes: u64,
        chunks: impl Iterator<Item = (OutputStream, &'a ChunkData)>,
    ) -> io::Result<()> {
        *self = write_new(&self.path, first_index, dropped_bytes, chunks)?;
        Ok(())
    }
}

fn stream_kind(stream: OutputStream) -> u8 {
    match stream {
        OutputStream::Stdout => 0,
        OutputStream::Stderr => 1,
    }
}

fn frame(kind: u8, index: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(FRAME_HEAD + payload.len());
    f.push(kind);
    f.extend_from_slice(&index.to_le_bytes());
    // Chunks hold at most MAX_OUTPUT_CHUNK_BYTES; a skip frame 8 bytes.
    f.extend_from_slice(
        &u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .to_le_bytes(),
    );
    f.extend_from_slice(payload);
    f
}

/// Writes a whole file at `path` (through a temporary file renamed over
/// it) and opens it for appending.
fn write_new<'a>(
    path: &Path,
    first_index: u64,
    dropped_bytes: u64,
    chunks: impl Iterator<Item = (OutputStream, &'a ChunkData)>,
) -> io::Result<SpoolFile> {
    let mut bytes = MAGIC.to_vec();
    bytes.extend(frame(SKIP, first_index, &dropped_bytes.to_le_bytes()));
    for (i, (stream, data)) in chunks.enumerate() {
        bytes.extend(frame(
            stream_kind(stream),
            first_index + i as u64,
            data.as_bytes(),
        ));
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    file.write_all(&bytes)?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    let file = OpenOptions::new().append(true).open(path)?;
    Ok(SpoolFile {
        file,
        path: path.to_path_buf(),
        len: bytes.len() as u64,
    })
}

/// A file's chunks; a torn or inconsistent tail ends the reading (what
/// came before it is kept).
fn parse(bytes: &[u8]) -> io::Result<Recovered> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    let rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| bad("not a job output file"))?;
    let mut frames = Frames(rest);
    let (kind, first_index, payload) = frames.next().ok_or_else(|| bad("no skip frame"))?;
    let dropped: [u8; 8] = payload.try_into().map_err(|_| bad("bad skip frame"))?;
    if kind != SKIP {
        return Err(bad("no skip frame"));
    }
    let mut out = Recovered {
        first_index,
        dropped_bytes: u64::from_le_bytes(dropped),
        chunks: Vec::new(),
    };
    for (kind, index, payload) in frames {
        let stream = match kind {
            0 => OutputStream::Stdout,
            1 => OutputStream::Stderr,
            _ => break,
        };
        if index != first_index + out.chunks.len() as u64 {
            break;
        }
        let Ok(data) = ChunkData::new(payload.to_vec()) else {
            break;
        };
        out.chunks.push((stream, data));
    }
    Ok(out)
}

/// Whole frames, in order; stops at a torn one.
struct Frames<'a>(&'a [u8]);

impl<'a> Iterator for Frames<'a> {
    type Item = (u8, u64, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let head = self.0.get(..FRAME_HEAD)?;
        let kind = head[0];
        let index = u64::from_le_bytes(head[1..9].try_into().ok()?);
        let len = u32::from_le_bytes(head[9..13].try_into().ok()?) as usize;
        if len > MAX_OUTPUT_CHUNK_BYTES {
            return None;
        }
        let payload = self.0.get(FRAME_HEAD..FRAME_HEAD + len)?;
        self.0 = &self.0[FRAME_HEAD + len..];
        Some((kind, index, payload))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn data(s: &str) -> ChunkData {
        ChunkData::new(s.as_bytes().to_vec()).unwrap()
    }

    fn job(id: &str) -> JobId {
        id.parse().unwrap()
    }

    #[test]
    fn chunks_come_back_in_order_and_a_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(&dir.path().join("job-output")).unwrap();
        let mode = std::fs::metadata(dir.path().join("job-output"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let id = job("job-0123456789abcdef");
        assert_eq!(spool.recover(&id).unwrap(), None);
        let mut f = spool.create(&id).unwrap();
        f.append(0, OutputStream::Stdout, &data("one\n")).unwrap();
        f.append(1, OutputStream::Stderr, &data("two\n")).unwrap();
        let path = spool.path(&id).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // A crash in the middle of the third write.
        let mut torn = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        torn.write_all(&frame(0, 2, b"three\n")[..10]).unwrap();
        let back = spool.recover(&id).unwrap().unwrap();
        assert_eq!(back.first_index, 0);
        assert_eq!(back.dropped_bytes, 0);
        assert_eq!(
            back.chunks,
            [
                (OutputStream::Stdout, data("one\n")),
                (OutputStream::Stderr, data("two\n"))
            ]
        );
        spool.remove(&id);
        assert_eq!(spool.recover(&id).unwrap(), None);
    }

    #[test]
    fn a_rewrite_keeps_the_newest_chunks_and_counts_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(dir.path()).unwrap();
        let id = job("job-1");
        let mut f = spool.create(&id).unwrap();
        for i in 0..10 {
            f.append(i, OutputStream::Stdout, &data("abcd")).unwrap();
        }
        let kept = [data("xy"), data("z")];
        f.rewrite(8, 32, kept.iter().map(|d| (OutputStream::Stdout, d)))
            .unwrap();
        f.append(10, OutputStream::Stderr, &data("!")).unwrap();
        let back = spool.recover(&id).unwrap().unwrap();
        assert_eq!(back.first_index, 8);
        assert_eq!(back.dropped_bytes, 32);
        assert_eq!(
            back.chunks,
            [
                (OutputStream::Stdout, data("xy")),
                (OutputStream::Stdout, data("z")),
                (OutputStream::Stderr, data("!"))
            ]
        );
    }

    #[test]
    fn only_plain_ids_get_a_file_and_strays_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(dir.path()).unwrap();
        assert!(spool.create(&job("../escape")).is_err());
        assert_eq!(spool.recover(&job("../escape")).unwrap(), None);
        spool.create(&job("job-a")).unwrap();
        spool.create(&job("job-b")).unwrap();
        std::fs::write(dir.path().join("job-c.out.tmp"), b"x").unwrap();
        assert_eq!(spool.remove_others(|j| j == "job-a"), 2);
        assert!(spool.recover(&job("job-a")).unwrap().is_some());
        assert!(spool.recover(&job("job-b")).unwrap().is_none());
    }

    #[test]
    fn garbage_is_an_error_not_output() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::open(dir.path()).unwrap();
        std::fs::write(dir.path().join("job-x.out"), b"hello").unwrap();
        assert!(spool.recover(&job("job-x")).is_err());
    }
}
