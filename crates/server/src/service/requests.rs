//! Request bodies (the wire types of [`kici_api`]) turned into the engine's
//! requests, and a scale request's body as the fleet's queue stores it.
//!
//! One conversion serves every way a request arrives: the HTTP handlers
//! (`POST /v1/scale`, `POST /v1/jobs`) and a fleet host claiming a request
//! another host queued. It lives here, not in the HTTP layer, because the
//! claim path has no HTTP request; the HTTP layer turns an [`Invalid`] into
//! its 422 answer.

use crate::jobs::JobRequest;
use kici_api::{JobBody, ResourceSpecBody, ResourcesBody, ScaleBody};
use kici_engine::{Mode, ScaleRequest};
use kici_model::{JobId, LabelSet, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec};
use kici_protocol::{JobSpec, JobSpecError};

/// A value of a request body that is not acceptable, and where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    /// The value's JSON path (`labels[1]`, `resources.requests.cpus`).
    pub field: String,
    pub message: String,
}

impl Invalid {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// The engine's scale request for `body`; every problem names its field.
pub fn scale_request(body: ScaleBody) -> Result<ScaleRequest, Invalid> {
    let job: JobId = body
        .job_id
        .parse()
        .map_err(|e: kici_model::IdError| Invalid::new("jobId", e.to_string()))?;
    let run_id = match body.run_id {
        Some(run) => {
            run.parse::<JobId>().map_err(|_| {
                Invalid::new(
                    "runId",
                    format!(
                        "run id must be 1 to {} printable characters without whitespace",
                        JobId::MAX_LEN
                    ),
                )
            })?;
            Some(run)
        }
        None => None,
    };
    // No labels at all is a job upstream routes too (to the first label
    // set without a gate); the router decides, not the parser.
    let labels = parse_labels("labels", &body.labels)?;
    let exclude = parse_labels(
        "excludeLabels",
        body.exclude_labels.as_deref().unwrap_or(&[]),
    )?;
    let resources = match body.resources {
        Some(r) => resource_request(r, "resources")?,
        None => None,
    };
    Ok(ScaleRequest {
        job,
        run_id,
        labels,
        exclude,
        resources,
        mode: Mode::Orchestrator,
    })
}

/// The job book's request for standalone job `job` of `body`; every
/// problem names its field.
pub fn job_request(body: JobBody, job: JobId) -> Result<JobRequest, Invalid> {
    // As for `POST /v1/scale`: no labels routes like upstream does.
    let labels = parse_labels("labels", &body.labels)?;
    let resources = match body.resources {
        Some(r) => resource_request(r, "resources")?,
        None => None,
    };
    let spec = JobSpec::new(
        job,
        body.command,
        body.env.unwrap_or_default(),
        body.timeout_seconds,
    )
    .map_err(|e| {
        let field = match &e {
            JobSpecError::EmptyArgv | JobSpecError::TooLarge { .. } => "command".to_owned(),
            JobSpecError::NulByte(at) => match at.strip_prefix("argv") {
                Some(index) => format!("command{index}"),
                None => at.replacen("env ", "env.", 1),
            },
            JobSpecError::BadEnvName(name) => format!("env.{name}"),
            JobSpecError::ZeroTimeout => "timeoutSeconds".to_owned(),
        };
        Invalid::new(field, e.to_string())
    })?;
    Ok(JobRequest {
        labels,
        resources,
        spec,
    })
}

/// The labels of field `field`.
pub fn parse_labels(field: &str, raw: &[String]) -> Result<LabelSet, Invalid> {
    // Trimmed and lower-cased as upstream does on every request (`" Linux"`
    // is `linux`), each refusal naming the element.
    for (i, label) in raw.iter().enumerate() {
        kici_model::Label::canonical(label)
            .map_err(|e| Invalid::new(format!("{field}[{i}]"), e.to_string()))?;
    }
    kici_routing::request_labels(raw).map_err(|e| Invalid::new(field, e.to_string()))
}

/// The resources of a request body at JSON path `at`; `None` when nothing
/// is set.
pub fn resource_request(body: ResourcesBody, at: &str) -> Result<Option<ResourceRequest>, Invalid> {
    let requests = body
        .requests
        .map(|s| resource_spec(s, &format!("{at}.requests")))
        .transpose()?
        .filter(|s| !s.is_empty());
    let limits = body
        .limits
        .map(|s| resource_spec(s, &format!("{at}.limits")))
        .transpose()?
        .filter(|s| !s.is_empty());
    if requests.is_none() && limits.is_none() {
        return Ok(None);
    }
    let request = ResourceRequest { requests, limits };
    request
        .check_requests_within_limits()
        .map_err(|e| Invalid::new(format!("{at}.requests"), e))?;
    Ok(Some(request))
}

fn resource_spec(body: ResourceSpecBody, at: &str) -> Result<ResourceSpec, Invalid> {
    let cpus = body
        .cpus
        .map(MilliCpu::from_cores)
        .transpose()
        .map_err(|e| Invalid::new(format!("{at}.cpus"), e.to_string()))?;
    let memory = body
        .memory
        .map(|m| MemoryBytes::parse_request(&m))
        .transpose()
        .map_err(|e| Invalid::new(format!("{at}.memory"), e.to_string()))?;
    if memory == Some(MemoryBytes::ZERO) {
        return Err(Invalid::new(
            format!("{at}.memory"),
            "memory must be more than 0",
        ));
    }
    Ok(ResourceSpec { cpus, memory })
}

/// A scale request as the fleet's queue stores it (`fleet_requests.body`):
/// the wire body, typed. Its text is [`StoredScale::text`], the body's
/// serialization — canonical (fields in declaration order, unset ones
/// left out), so the same body gives the same text on every host, which
/// makes the text the request's dedupe key: the same job id with the same
/// text is the same request; another text is a conflict.
///
/// Rows written before this type existed hold the same serialization of
/// the same type (or the body as a caller sent it: any JSON spelling of
/// it), so [`StoredScale::parse`] reads them too.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredScale(pub ScaleBody);

impl StoredScale {
    /// The stored text.
    pub fn text(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(&self.0)
    }

    /// A stored text, read back.
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text).map(Self)
    }

    /// The engine's request (the same conversion as the HTTP entry's).
    pub fn into_request(self) -> Result<ScaleRequest, Invalid> {
        scale_request(self.0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn body() -> ScaleBody {
        ScaleBody {
            job_id: "job-1".into(),
            run_id: Some("run-1".into()),
            labels: vec!["linux".into(), "x64".into()],
            exclude_labels: None,
            resources: ResourcesBody::requests(Some(1.5), Some("512m".into())),
        }
    }

    #[test]
    fn the_stored_text_is_the_canonical_serialization_and_reads_back_as_the_same_body() {
        let stored = StoredScale(body());
        let text = stored.text().unwrap();
        assert_eq!(
            text,
            r#"{"jobId":"job-1","runId":"run-1","labels":["linux","x64"],"resources":{"requests":{"cpus":1.5,"memory":"512m"}}}"#
        );
        assert_eq!(StoredScale::parse(&text).unwrap(), stored);
        assert_eq!(StoredScale::parse(&text).unwrap().text().unwrap(), text);
    }

    /// A row as an earlier host may have written it: the body in another
    /// JSON spelling (fields in another order, white space) reads back as
    /// the same typed body, and converts to the same engine request.
    #[test]
    fn a_row_in_the_earlier_format_is_read() {
        let old = r#"{ "labels": ["linux", "x64"], "resources": {"requests": {"memory": "512m", "cpus": 1.5}},
                       "runId": "run-1", "jobId": "job-1" }"#;
        let read = StoredScale::parse(old).unwrap();
        assert_eq!(read, StoredScale(body()));
        let request = read.into_request().unwrap();
        assert_eq!(request, scale_request(body()).unwrap());
        assert_eq!(request.job.as_str(), "job-1");
    }

    #[test]
    fn a_bad_value_names_its_field() {
        let mut b = body();
        b.labels = vec!["linux".into(), "a,b".into()];
        assert_eq!(scale_request(b).unwrap_err().field, "labels[1]");
        let mut b = body();
        b.resources = ResourcesBody::requests(None, Some("0".into()));
        assert_eq!(
            scale_request(b).unwrap_err().field,
            "resources.requests.memory"
        );
        let job = job_request(JobBody::default(), "j".parse().unwrap()).unwrap_err();
        assert_eq!(job.field, "command");
    }
}
