//! The standalone-mode job: what the gateway asks an agent to run
//! ([`JobSpec`]), the output the agent streams back ([`OutputChunk`]) and
//! how the job ended ([`JobEnd`], [`JobResult`]).

use base64::Engine as _;
use kici_model::{EnvName, JobId};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;

/// Most raw output bytes one `log.chunk` carries (16 KiB; about 21.4 KiB
/// once base64-encoded). Small enough to interleave stdout and stderr
/// promptly and to keep a slow gateway's buffer bounded, large enough that a
/// chatty build is not thousands of frames per second.
pub const MAX_OUTPUT_CHUNK_BYTES: usize = 16 * 1024;

/// Most bytes a [`JobSpec`]'s strings may total (argv entries, env names
/// and values): 256 KiB, well under Linux's `ARG_MAX` (2 MiB) for argv +
/// environment together.
pub const MAX_JOB_SPEC_BYTES: usize = 256 * 1024;

// ---------------------------------------------------------------------------
// JobSpec

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobSpecError {
    #[error("argv must name at least the program to run")]
    EmptyArgv,
    #[error("{0} contains a NUL byte, which no process argument or environment can carry")]
    NulByte(String),
    #[error("env name {0:?} is not a POSIX name ([A-Za-z_][A-Za-z0-9_]*)")]
    BadEnvName(String),
    #[error("timeoutSeconds must be at least 1 (omit it for no timeout)")]
    ZeroTimeout,
    #[error("argv and env total {bytes} bytes; at most {MAX_JOB_SPEC_BYTES} are allowed")]
    TooLarge { bytes: usize },
}

/// One job for an agent: run `argv` with `env` (on top of the agent's
/// minimal base environment), killing it after `timeout_seconds`.
///
/// Valid by construction ([`JobSpec::new`], and deserialization runs the
/// same checks): argv is non-empty, nothing contains NUL, env names are
/// POSIX names, the timeout is positive, the whole stays under
/// [`MAX_JOB_SPEC_BYTES`].
///
/// Wire form: `{"jobId":"…","argv":["sh","-c","…"],"env":{"K":"V"},"timeoutSeconds":60}`
/// (`env` may be omitted when empty, `timeoutSeconds` when there is none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "JobSpecWire", into = "JobSpecWire")]
pub struct JobSpec {
    job_id: JobId,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    timeout_seconds: Option<u64>,
}

impl JobSpec {
    pub fn new(
        job_id: JobId,
        argv: Vec<String>,
        env: BTreeMap<String, String>,
        timeout_seconds: Option<u64>,
    ) -> Result<Self, JobSpecError> {
        if argv.is_empty() {
            return Err(JobSpecError::EmptyArgv);
        }
        if timeout_seconds == Some(0) {
            return Err(JobSpecError::ZeroTimeout);
        }
        let mut bytes = 0usize;
        for (i, arg) in argv.iter().enumerate() {
            if arg.contains('\0') {
                return Err(JobSpecError::NulByte(format!("argv[{i}]")));
            }
            bytes = bytes.saturating_add(arg.len());
        }
        for (name, value) in &env {
            if EnvName::parse(name).is_none() {
                return Err(JobSpecError::BadEnvName(name.clone()));
            }
            if value.contains('\0') {
                return Err(JobSpecError::NulByte(format!("env {name}")));
            }
            bytes = bytes.saturating_add(name.len()).saturating_add(value.len());
        }
        if bytes > MAX_JOB_SPEC_BYTES {
            return Err(JobSpecError::TooLarge { bytes });
        }
        Ok(Self {
            job_id,
            argv,
            env,
            timeout_seconds,
        })
    }

    pub fn job_id(&self) -> &JobId {
        &self.job_id
    }

    /// Never empty: `argv()[0]` is the program.
    pub fn argv(&self) -> &[String] {
        &self.argv
    }

    pub fn env(&self) -> &BTreeMap<String, String> {
        &self.env
    }

    /// `None`: no timeout. Never `Some(0)`.
    pub fn timeout_seconds(&self) -> Option<u64> {
        self.timeout_seconds
    }
}

// No `deny_unknown_fields`: the agent receives it (inside `job.dispatch`)
// and reads the fields it knows, so a newer gateway may add some.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct JobSpecWire {
    #[serde(deserialize_with = "crate::wire::from_str")]
    job_id: JobId,
    argv: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    timeout_seconds: Option<u64>,
}

impl TryFrom<JobSpecWire> for JobSpec {
    type Error = JobSpecError;
    fn try_from(w: JobSpecWire) -> Result<Self, Self::Error> {
        JobSpec::new(w.job_id, w.argv, w.env, w.timeout_seconds)
    }
}

impl From<JobSpec> for JobSpecWire {
    fn from(s: JobSpec) -> Self {
        Self {
            job_id: s.job_id,
            argv: s.argv,
            env: s.env,
            timeout_seconds: s.timeout_seconds,
        }
    }
}

// ---------------------------------------------------------------------------
// JobResult, JobEnd

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobResultError {
    #[error("a job result has exactly one of exitCode and signal")]
    NotExactlyOne,
    #[error("signal {0} is not a signal number (must be positive)")]
    BadSignal(i32),
}

/// How a process that ran ended: an exit code or the signal that killed it,
/// exactly one of the two.
///
/// Wire form: `{"exitCode":3,"signal":null}` or `{"exitCode":null,"signal":9}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "JobResultWire", into = "JobResultWire")]
pub struct JobResult {
    exit_code: Option<i32>,
    signal: Option<i32>,
}

impl JobResult {
    pub const fn exited(code: i32) -> Self {
        Self {
            exit_code: Some(code),
            signal: None,
        }
    }

    pub fn signalled(signal: i32) -> Result<Self, JobResultError> {
        if signal <= 0 {
            return Err(JobResultError::BadSignal(signal));
        }
        Ok(Self {
            exit_code: None,
            signal: Some(signal),
        })
    }

    /// `Some` iff the process exited on its own.
    pub fn exit_code(&self) -> Option<i32> {
        self.exit_code
    }

    /// `Some` iff a signal killed the process.
    pub fn signal(&self) -> Option<i32> {
        self.signal
    }

    pub fn is_success(&self) -> bool {
        self.exit_code == Some(0)
    }
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JobResultWire {
    #[serde(default)]
    exit_code: Option<i32>,
    #[serde(default)]
    signal: Option<i32>,
}

impl TryFrom<JobResultWire> for JobResult {
    type Error = JobResultError;
    fn try_from(w: JobResultWire) -> Result<Self, Self::Error> {
        match (w.exit_code, w.signal) {
            (Some(code), None) => Ok(JobResult::exited(code)),
            (None, Some(sig)) => JobResult::signalled(sig),
            _ => Err(JobResultError::NotExactlyOne),
        }
    }
}

impl From<JobResult> for JobResultWire {
    fn from(r: JobResult) -> Self {
        Self {
            exit_code: r.exit_code,
            signal: r.signal,
        }
    }
}

/// How a job ended, as the agent reports it in a terminal `job.status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEnd {
    /// The process ended on its own (state `success` iff exit code 0,
    /// otherwise `failed`).
    Completed(JobResult),
    /// The agent killed it when `timeoutSeconds` passed (state `failed`).
    TimedOut(JobResult),
    /// The agent killed it on `job.cancel` (state `cancelled`).
    Cancelled(JobResult),
    /// The process could not be started (state `failed`); `error` says why
    /// (e.g. the program was not found).
    SpawnFailed { error: String },
}

impl JobEnd {
    pub fn result(&self) -> Option<JobResult> {
        match self {
            Self::Completed(r) | Self::TimedOut(r) | Self::Cancelled(r) => Some(*r),
            Self::SpawnFailed { .. } => None,
        }
    }

    pub fn is_success(&self) -> bool {
        matches!(self, Self::Completed(r) if r.is_success())
    }
}

// ---------------------------------------------------------------------------
// Output

/// Which of the job's output streams a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputStream {
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("an output chunk holds at most {MAX_OUTPUT_CHUNK_BYTES} bytes, got {0}")]
pub struct ChunkTooLarge(pub usize);

/// Raw output bytes, at most [`MAX_OUTPUT_CHUNK_BYTES`] (checked on
/// construction and on deserialization, before decoding allocates).
/// Serialized as standard base64 with padding.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ChunkData(Vec<u8>);

impl ChunkData {
    pub fn new(bytes: Vec<u8>) -> Result<Self, ChunkTooLarge> {
        if bytes.len() > MAX_OUTPUT_CHUNK_BYTES {
            return Err(ChunkTooLarge(bytes.len()));
        }
        Ok(Self(bytes))
    }

    /// Cuts `bytes` into chunks of at most [`MAX_OUTPUT_CHUNK_BYTES`]
    /// (nothing for empty input).
    pub fn split(bytes: &[u8]) -> impl Iterator<Item = ChunkData> + '_ {
        bytes
            .chunks(MAX_OUTPUT_CHUNK_BYTES)
            .map(|c| ChunkData(c.to_vec()))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl std::fmt::Debug for ChunkData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChunkData({:?})", String::from_utf8_lossy(&self.0))
    }
}

impl Serialize for ChunkData {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for ChunkData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Encoded length of the largest chunk: refuse bigger text before
        // decoding it.
        const MAX_ENCODED: usize = MAX_OUTPUT_CHUNK_BYTES.div_ceil(3) * 4;
        let text = String::deserialize(d)?;
        if text.len() > MAX_ENCODED {
            return Err(D::Error::custom(ChunkTooLarge(text.len() / 4 * 3)));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.as_bytes())
            .map_err(|e| D::Error::custom(format!("output chunk data is not base64: {e}")))?;
        ChunkData::new(bytes).map_err(D::Error::custom)
    }
}

/// `log.chunk`: a piece of the job's output, in the order it was read.
/// `seq` numbers the job's chunks from 0 across both streams, so a
/// receiver can interleave them as read and notice a gap.
///
/// Wire form: `{"type":"log.chunk","jobId":"…","seq":0,"stream":"stdout","data":"aGkK"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutputChunk {
    #[serde(deserialize_with = "crate::wire::from_str")]
    pub job_id: JobId,
    pub seq: u64,
    pub stream: OutputStream,
    pub data: ChunkData,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job_id() -> JobId {
        "j-1".parse().unwrap()
    }

    #[test]
    fn job_spec_checks() {
        let argv = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            JobSpec::new(job_id(), vec![], BTreeMap::new(), None),
            Err(JobSpecError::EmptyArgv)
        );
        assert_eq!(
            JobSpec::new(job_id(), argv(&["a\0b"]), BTreeMap::new(), None),
            Err(JobSpecError::NulByte("argv[0]".into()))
        );
        let env = BTreeMap::from([("1BAD".to_string(), "x".to_string())]);
        assert_eq!(
            JobSpec::new(job_id(), argv(&["true"]), env, None),
            Err(JobSpecError::BadEnvName("1BAD".into()))
        );
        let env = BTreeMap::from([("OK".to_string(), "a\0".to_string())]);
        assert_eq!(
            JobSpec::new(job_id(), argv(&["true"]), env, None),
            Err(JobSpecError::NulByte("env OK".into()))
        );
        assert_eq!(
            JobSpec::new(job_id(), argv(&["true"]), BTreeMap::new(), Some(0)),
            Err(JobSpecError::ZeroTimeout)
        );
        let huge = "x".repeat(MAX_JOB_SPEC_BYTES);
        assert_eq!(
            JobSpec::new(job_id(), vec!["echo".into(), huge], BTreeMap::new(), None),
            Err(JobSpecError::TooLarge {
                bytes: MAX_JOB_SPEC_BYTES + 4
            })
        );
        let ok = JobSpec::new(job_id(), argv(&["true"]), BTreeMap::new(), Some(1)).unwrap();
        assert_eq!(ok.argv()[0], "true");
        assert_eq!(ok.timeout_seconds(), Some(1));
    }

    #[test]
    fn job_spec_wire_runs_the_same_checks() {
        for (bad, needle) in [
            (r#"{"jobId":"j","argv":[]}"#, "argv must name"),
            (r#"{"jobId":"j","argv":["x"],"env":{"A=B":"1"}}"#, "POSIX"),
            (
                r#"{"jobId":"j","argv":["x"],"timeoutSeconds":0}"#,
                "at least 1",
            ),
            (r#"{"jobId":"has space","argv":["x"]}"#, "job id"),
            (r#"{"argv":["x"]}"#, "missing field `jobId`"),
        ] {
            let err = serde_json::from_str::<JobSpec>(bad)
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn job_result_is_exactly_one_of_code_and_signal() {
        for bad in [
            r#"{"exitCode":null,"signal":null}"#,
            r#"{}"#,
            r#"{"exitCode":1,"signal":9}"#,
            r#"{"exitCode":null,"signal":0}"#,
            r#"{"exitCode":0,"signal":null,"core":true}"#,
        ] {
            assert!(serde_json::from_str::<JobResult>(bad).is_err(), "{bad}");
        }
        let r: JobResult = serde_json::from_str(r#"{"signal":15}"#).unwrap();
        assert_eq!(r.signal(), Some(15));
        assert_eq!(r.exit_code(), None);
        assert!(JobResult::signalled(-1).is_err());
        assert!(JobResult::exited(0).is_success());
        assert!(!JobResult::exited(3).is_success());
    }

    #[test]
    fn chunk_data_is_bounded_both_ways() {
        assert!(ChunkData::new(vec![0; MAX_OUTPUT_CHUNK_BYTES]).is_ok());
        assert_eq!(
            ChunkData::new(vec![0; MAX_OUTPUT_CHUNK_BYTES + 1]),
            Err(ChunkTooLarge(MAX_OUTPUT_CHUNK_BYTES + 1))
        );
        let max = ChunkData::new(vec![0xff; MAX_OUTPUT_CHUNK_BYTES]).unwrap();
        let json = serde_json::to_string(&max).unwrap();
        assert_eq!(serde_json::from_str::<ChunkData>(&json).unwrap(), max);
        let over =
            base64::engine::general_purpose::STANDARD.encode(vec![0u8; MAX_OUTPUT_CHUNK_BYTES + 1]);
        assert!(serde_json::from_str::<ChunkData>(&format!("\"{over}\"")).is_err());
        assert!(serde_json::from_str::<ChunkData>("\"not base64!\"").is_err());

        let input = vec![7u8; 2 * MAX_OUTPUT_CHUNK_BYTES + 5];
        let parts: Vec<ChunkData> = ChunkData::split(&input).collect();
        assert_eq!(
            parts.iter().map(|p| p.as_bytes().len()).collect::<Vec<_>>(),
            [MAX_OUTPUT_CHUNK_BYTES, MAX_OUTPUT_CHUNK_BYTES, 5]
        );
        assert_eq!(ChunkData::split(&[]).count(), 0);
    }
}
