//! A job history: one job a line, JSON Lines
//! (`{"at": …, "labels": […], "durationSeconds": …, "resources": {…}}`) or
//! CSV with the same columns (`labels` space-separated, `resources` as JSON).
//! `at` is seconds since the trace's start or an RFC 3339 time.

use kici_model::{LabelSet, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec};
use serde_json::Value;
use std::time::Duration;

/// One recorded job.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceJob {
    /// Since the trace's start.
    pub at: Duration,
    pub labels: LabelSet,
    pub duration: Duration,
    pub resources: Option<ResourceRequest>,
}

/// A parsed trace, jobs in arrival order (ties keep file order).
#[derive(Debug, Clone)]
pub struct Trace {
    /// The wall-clock time of `at` = 0: the earliest RFC 3339 time when the
    /// trace uses them, else `None` (the caller picks one).
    pub start: Option<jiff::Timestamp>,
    pub jobs: Vec<TraceJob>,
}

/// A trace line that cannot be read: where, which field, what was expected.
#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {field}: {message}")]
pub struct TraceError {
    pub file: String,
    pub line: usize,
    pub field: String,
    pub message: String,
}

/// `at` as written.
enum At {
    Seconds(f64),
    Time(jiff::Timestamp),
}

struct Raw {
    at: At,
    labels: LabelSet,
    duration: Duration,
    resources: Option<ResourceRequest>,
}

/// Parses `text` (named `file` in errors): CSV when the name ends in
/// `.csv` or the first line is not a JSON object, JSON Lines otherwise.
pub fn parse_trace(file: &str, text: &str) -> Result<Trace, TraceError> {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let csv = file.ends_with(".csv") || !first.trim_start().starts_with('{');
    let raws = if csv {
        parse_csv(file, text)?
    } else {
        parse_jsonl(file, text)?
    };
    let start = raws
        .iter()
        .filter_map(|r| match r.at {
            At::Time(t) => Some(t),
            At::Seconds(_) => None,
        })
        .min();
    let mut jobs: Vec<TraceJob> = raws
        .into_iter()
        .map(|r| {
            let at = match (r.at, start) {
                (At::Seconds(s), _) => Duration::from_secs_f64(s),
                (At::Time(t), Some(s)) => {
                    let d = t.duration_since(s);
                    Duration::try_from(d).unwrap_or_default()
                }
                (At::Time(_), None) => Duration::ZERO,
            };
            TraceJob {
                at,
                labels: r.labels,
                duration: r.duration,
                resources: r.resources,
            }
        })
        .collect();
    jobs.sort_by_key(|j| j.at);
    Ok(Trace { start, jobs })
}

fn error(file: &str, line: usize, field: &str, message: impl Into<String>) -> TraceError {
    TraceError {
        file: file.to_owned(),
        line,
        field: field.to_owned(),
        message: message.into(),
    }
}

fn parse_jsonl(file: &str, text: &str) -> Result<Vec<Raw>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| error(file, n, "(line)", format!("expected a JSON object: {e}")))?;
        let Value::Object(map) = v else {
            return Err(error(file, n, "(line)", "expected a JSON object"));
        };
        for key in map.keys() {
            if !["at", "labels", "durationSeconds", "resources"].contains(&key.as_str()) {
                return Err(error(
                    file,
                    n,
                    key,
                    "unknown key; accepted keys: at, labels, durationSeconds, resources",
                ));
            }
        }
        let at = match map.get("at") {
            Some(Value::Number(x)) => at_seconds(file, n, x.as_f64())?,
            Some(Value::String(s)) => at_text(file, n, s)?,
            Some(other) => {
                return Err(error(
                    file,
                    n,
                    "at",
                    format!(
                        "expected seconds since the trace's start or an RFC 3339 time, got {other}"
                    ),
                ))
            }
            None => return Err(error(file, n, "at", "missing required key `at`")),
        };
        let labels = match map.get("labels") {
            Some(Value::Array(items)) => {
                let mut raw = Vec::new();
                for item in items {
                    match item {
                        Value::String(s) => raw.push(s.clone()),
                        other => {
                            return Err(error(
                                file,
                                n,
                                "labels",
                                format!("expected a list of strings, got {other}"),
                            ))
                        }
                    }
                }
                labels(file, n, raw)?
            }
            Some(other) => {
                return Err(error(
                    file,
                    n,
                    "labels",
                    format!("expected a list of strings, got {other}"),
                ))
            }
            None => return Err(error(file, n, "labels", "missing required key `labels`")),
        };
        let duration = match map.get("durationSeconds") {
            Some(Value::Number(x)) => duration(file, n, x.as_f64())?,
            Some(other) => {
                return Err(error(
                    file,
                    n,
                    "durationSeconds",
                    format!("expected a number of seconds >= 0, got {other}"),
                ))
            }
            None => {
                return Err(error(
                    file,
                    n,
                    "durationSeconds",
                    "missing required key `durationSeconds`",
                ))
            }
        };
        let resources = match map.get("resources") {
            None | Some(Value::Null) => None,
            Some(v) => resources(file, n, v)?,
        };
        out.push(Raw {
            at,
            labels,
            duration,
            resources,
        });
    }
    Ok(out)
}

fn at_seconds(file: &str, n: usize, x: Option<f64>) -> Result<At, TraceError> {
    match x {
        Some(s) if (0.0..1e12).contains(&s) => Ok(At::Seconds(s)),
        _ => Err(error(
            file,
            n,
            "at",
            "expected seconds since the trace's start (a number >= 0) or an RFC 3339 time",
        )),
    }
}

fn at_text(file: &str, n: usize, s: &str) -> Result<At, TraceError> {
    if let Ok(x) = s.trim().parse::<f64>() {
        return at_seconds(file, n, Some(x));
    }
    s.trim().parse::<jiff::Timestamp>().map(At::Time).map_err(|_| {
        error(
            file,
            n,
            "at",
            format!("expected seconds since the trace's start or an RFC 3339 time such as 2026-01-05T09:00:00Z, got {s:?}"),
        )
    })
}

fn duration(file: &str, n: usize, x: Option<f64>) -> Result<Duration, TraceError> {
    match x {
        Some(s) if (0.0..1e9).contains(&s) => Ok(Duration::from_secs_f64(s)),
        _ => Err(error(
            file,
            n,
            "durationSeconds",
            "expected a number of seconds >= 0",
        )),
    }
}

fn labels(file: &str, n: usize, raw: Vec<String>) -> Result<LabelSet, TraceError> {
    if raw.is_empty() {
        return Err(error(file, n, "labels", "expected at least one label"));
    }
    LabelSet::parse(raw.iter().map(String::as_str))
        .map_err(|e| error(file, n, "labels", e.to_string()))
}

/// `resources` as `POST /v1/scale` takes it: `{requests: {cpus, memory},
/// limits: {cpus, memory}}`.
fn resources(file: &str, n: usize, v: &Value) -> Result<Option<ResourceRequest>, TraceError> {
    let Value::Object(map) = v else {
        return Err(error(
            file,
            n,
            "resources",
            "expected an object {requests: {cpus, memory}, limits: {cpus, memory}}",
        ));
    };
    let spec = |key: &str| -> Result<Option<ResourceSpec>, TraceError> {
        let at = format!("resources.{key}");
        let Some(v) = map.get(key) else {
            return Ok(None);
        };
        let Value::Object(s) = v else {
            return Err(error(file, n, &at, "expected an object {cpus, memory}"));
        };
        let cpus = match s.get("cpus") {
            None => None,
            Some(c) => Some(
                c.as_f64()
                    .ok_or_else(|| {
                        error(file, n, &format!("{at}.cpus"), "expected a number of cores")
                    })
                    .and_then(|c| {
                        MilliCpu::from_cores(c)
                            .map_err(|e| error(file, n, &format!("{at}.cpus"), e.to_string()))
                    })?,
            ),
        };
        let memory = match s.get("memory") {
            None => None,
            Some(Value::String(m)) => Some(
                MemoryBytes::parse_request(m)
                    .map_err(|e| error(file, n, &format!("{at}.memory"), e.to_string()))?,
            ),
            Some(_) => {
                return Err(error(
                    file,
                    n,
                    &format!("{at}.memory"),
                    "expected a string such as \"512m\"",
                ))
            }
        };
        Ok(Some(ResourceSpec { cpus, memory }).filter(|s| !s.is_empty()))
    };
    let requests = spec("requests")?;
    let limits = spec("limits")?;
    if requests.is_none() && limits.is_none() {
        return Ok(None);
    }
    let request = ResourceRequest { requests, limits };
    request
        .check_requests_within_limits()
        .map_err(|e| error(file, n, "resources.requests", e))?;
    Ok(Some(request))
}

/// One CSV record's fields (RFC 4180 quoting: `"a ""b"""`).
fn csv_fields(line: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut field = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (false, '"') if field.is_empty() => quoted = true,
            (false, ',') => out.push(std::mem::take(&mut field)),
            (_, c) => field.push(c),
        }
    }
    if quoted {
        return None;
    }
    out.push(field);
    Some(out)
}

fn parse_csv(file: &str, text: &str) -> Result<Vec<Raw>, TraceError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((hi, header)) = lines.next() else {
        return Ok(Vec::new());
    };
    let names =
        csv_fields(header).ok_or_else(|| error(file, hi + 1, "(header)", "unterminated quote"))?;
    let col = |name: &str| names.iter().position(|h| h.trim() == name);
    for h in &names {
        if !["at", "labels", "durationSeconds", "resources"].contains(&h.trim()) {
            return Err(error(
                file,
                hi + 1,
                h.trim(),
                "unknown column; accepted columns: at, labels, durationSeconds, resources",
            ));
        }
    }
    let (Some(at_c), Some(labels_c), Some(dur_c)) =
        (col("at"), col("labels"), col("durationSeconds"))
    else {
        return Err(error(
            file,
            hi + 1,
            "(header)",
            "expected the columns at, labels, durationSeconds (and optionally resources)",
        ));
    };
    let res_c = col("resources");
    let mut out = Vec::new();
    for (i, line) in lines {
        let n = i + 1;
        let fields =
            csv_fields(line).ok_or_else(|| error(file, n, "(line)", "unterminated quote"))?;
        if fields.len() != names.len() {
            return Err(error(
                file,
                n,
                "(line)",
                format!("expected {} fields, got {}", names.len(), fields.len()),
            ));
        }
        let at = at_text(file, n, &fields[at_c])?;
        let raw: Vec<String> = fields[labels_c]
            .split(|c: char| c.is_whitespace() || c == ';')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let labels = labels(file, n, raw)?;
        let duration = duration(file, n, fields[dur_c].trim().parse::<f64>().ok())?;
        let resources = match res_c.map(|c| fields[c].trim()) {
            None | Some("") => None,
            Some(text) => {
                let v: Value = serde_json::from_str(text).map_err(|e| {
                    error(file, n, "resources", format!("expected a JSON object: {e}"))
                })?;
                resources(file, n, &v)?
            }
        };
        out.push(Raw {
            at,
            labels,
            duration,
            resources,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn json_lines_and_csv_read_the_same_jobs() {
        let jsonl = concat!(
            "{\"at\": 5, \"labels\": [\"linux\"], \"durationSeconds\": 60}\n",
            "\n",
            "{\"at\": 0.5, \"labels\": [\"linux\", \"big\"], \"durationSeconds\": 1.5, \"resources\": {\"requests\": {\"cpus\": 2, \"memory\": \"1g\"}}}\n",
        );
        let csv = concat!(
            "at,labels,durationSeconds,resources\n",
            "5,linux,60,\n",
            "0.5,linux big,1.5,\"{\"\"requests\"\": {\"\"cpus\"\": 2, \"\"memory\"\": \"\"1g\"\"}}\"\n",
        );
        let a = parse_trace("t.jsonl", jsonl).unwrap();
        let b = parse_trace("t.csv", csv).unwrap();
        assert_eq!(a.jobs, b.jobs);
        assert_eq!(a.jobs[0].at, Duration::from_millis(500));
        assert_eq!(a.jobs[0].labels, LabelSet::parse(["big", "linux"]).unwrap());
        let r = a.jobs[0].resources.unwrap().requests.unwrap();
        assert_eq!(r.cpus, Some(MilliCpu::from_cores(2.0).unwrap()));
        assert_eq!(a.jobs[1].at, Duration::from_secs(5));
        assert!(a.start.is_none());
    }

    #[test]
    fn rfc3339_times_count_from_the_earliest() {
        let t = parse_trace(
            "t.jsonl",
            concat!(
                "{\"at\": \"2026-01-05T09:00:10Z\", \"labels\": [\"a\"], \"durationSeconds\": 1}\n",
                "{\"at\": \"2026-01-05T10:00:00+01:00\", \"labels\": [\"a\"], \"durationSeconds\": 1}\n",
            ),
        )
        .unwrap();
        assert_eq!(t.start, Some("2026-01-05T09:00:00Z".parse().unwrap()));
        assert_eq!(t.jobs[0].at, Duration::ZERO);
        assert_eq!(t.jobs[1].at, Duration::from_secs(10));
    }

    #[test]
    fn bad_lines_name_the_line_the_field_and_what_was_expected() {
        let e = |file: &str, text: &str| parse_trace(file, text).unwrap_err().to_string();
        assert_eq!(
            e("t.jsonl", "{\"at\": 1, \"labels\": [\"a\"], \"durationSeconds\": 1}\n{\"at\": -1, \"labels\": [\"a\"], \"durationSeconds\": 1}"),
            "t.jsonl:2: at: expected seconds since the trace's start (a number >= 0) or an RFC 3339 time"
        );
        assert_eq!(
            e(
                "t.jsonl",
                "{\"at\": 1, \"labels\": \"a\", \"durationSeconds\": 1}"
            ),
            "t.jsonl:1: labels: expected a list of strings, got \"a\""
        );
        assert_eq!(
            e("t.jsonl", "{\"at\": 1, \"labels\": [\"a\"]}"),
            "t.jsonl:1: durationSeconds: missing required key `durationSeconds`"
        );
        assert_eq!(
            e("t.jsonl", "{\"at\": 1, \"labels\": [\"a\"], \"durationSeconds\": 1, \"duration\": 2}"),
            "t.jsonl:1: duration: unknown key; accepted keys: at, labels, durationSeconds, resources"
        );
        assert_eq!(
            e("t.csv", "at,labels,durationSeconds\n1,a,x\n"),
            "t.csv:2: durationSeconds: expected a number of seconds >= 0"
        );
        assert_eq!(
            e("t.csv", "at,labels,durationSeconds\n1,a\n"),
            "t.csv:2: (line): expected 3 fields, got 2"
        );
        assert!(e("t.jsonl", "{\"at\": 1, \"labels\": [\"a\"], \"durationSeconds\": 1, \"resources\": {\"requests\": {\"memory\": \"lots\"}}}")
            .starts_with("t.jsonl:1: resources.requests.memory: "));
    }
}
