#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]
//! Helpers shared by the API tests: checking every answer against the
//! OpenAPI document, and reading SSE streams.

pub mod daemon;
pub mod firecracker;
pub mod firecracker_standin;
pub mod users;

use serde_json::{json, Value};

/// The route template of `path` in `doc` (`/v1/agents/x` → `/v1/agents/{id}`).
pub fn template_of(doc: &Value, path: &str) -> Option<String> {
    let path = path.split('?').next().unwrap_or(path);
    let segments: Vec<&str> = path.split('/').collect();
    doc["paths"]
        .as_object()?
        .keys()
        .filter(|t| {
            let ts: Vec<&str> = t.split('/').collect();
            ts.len() == segments.len()
                && ts
                    .iter()
                    .zip(&segments)
                    .all(|(t, s)| (t.starts_with('{') && t.ends_with('}')) || t == s)
        })
        // A literal segment beats a parameter (`/v1/agents` vs `/{x}`).
        .max_by_key(|t| t.split('/').filter(|s| !s.starts_with('{')).count())
        .cloned()
}

/// Checks that `status` is documented for `method path` and, for a JSON
/// body, that the body validates against the documented schema (with the
/// document's components in scope for `$ref`s).
pub fn check_against_doc(doc: &Value, method: &str, path: &str, status: u16, body: &[u8]) {
    let template = template_of(doc, path);
    let op = template
        .as_ref()
        .map(|t| &doc["paths"][t][method.to_ascii_lowercase()])
        .filter(|op| op.is_object());
    let Some(op) = op else {
        // Not a route: the fallback's answer, in the error shape.
        assert!(
            status == 404 || status == 405,
            "{method} {path}: undocumented, yet answered {status}"
        );
        validate(
            doc,
            method,
            path,
            status,
            &json!({"$ref": "#/components/schemas/ErrorBody"}),
            body,
        );
        return;
    };
    let template = template.unwrap_or_default();
    let response = &op["responses"][status.to_string()];
    assert!(
        response.is_object(),
        "{method} {template}: status {status} is not documented (body: {})",
        String::from_utf8_lossy(body)
    );
    let Some(schema) = response["content"]["application/json"]["schema"].as_object() else {
        return;
    };
    if schema.is_empty() {
        return;
    }
    validate(
        doc,
        method,
        path,
        status,
        &Value::Object(schema.clone()),
        body,
    );
}

fn validate(doc: &Value, method: &str, path: &str, status: u16, schema: &Value, body: &[u8]) {
    let instance: Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "{method} {path} {status}: body is not JSON ({e}): {}",
            String::from_utf8_lossy(body)
        )
    });
    let mut schema = schema.clone();
    schema["components"] = doc["components"].clone();
    let validator = jsonschema::validator_for(&schema)
        .unwrap_or_else(|e| panic!("{method} {path} {status}: schema does not compile: {e}"));
    let errors: Vec<String> = validator
        .iter_errors(&instance)
        .map(|e| format!("{} at {}", e, e.instance_path))
        .collect();
    assert!(
        errors.is_empty(),
        "{method} {path} {status}: body does not match the OpenAPI schema:\n{}\nbody: {instance}",
        errors.join("\n")
    );
}

/// One parsed SSE event.
#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    pub id: Option<u64>,
    pub event: String,
    pub data: Value,
}

/// Parses complete SSE events out of `buffer`, leaving a partial one there.
pub fn take_sse_events(buffer: &mut String) -> Vec<SseEvent> {
    let mut out = Vec::new();
    while let Some(end) = buffer.find("\n\n") {
        let block: String = buffer.drain(..end + 2).collect();
        let mut id = None;
        let mut event = String::from("message");
        let mut data = String::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                id = v.trim().parse().ok();
            } else if let Some(v) = line.strip_prefix("event:") {
                event = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        if data.is_empty() {
            continue; // a keep-alive comment
        }
        out.push(SseEvent {
            id,
            event,
            data: serde_json::from_str(&data).unwrap_or(Value::String(data)),
        });
    }
    out
}

/// Every route of the control API's contract (the agent gateway's `/ws` has its own
/// listener and is not part of the control API).
pub const DESIGN_ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/scale"),
    ("post", "/v1/jobs"),
    ("get", "/v1/jobs/{id}"),
    ("get", "/v1/jobs/{id}/logs"),
    ("delete", "/v1/scale/{jobId}"),
    ("post", "/v1/agents/{id}/registered"),
    ("post", "/v1/agents/{id}/config-ack"),
    ("post", "/v1/agents/{id}/job-started"),
    ("post", "/v1/agents/{id}/job-complete"),
    ("post", "/v1/agents/{id}/disconnected"),
    ("delete", "/v1/agents/{id}"),
    ("get", "/v1/agents"),
    ("get", "/v1/agents/{id}"),
    ("get", "/v1/status"),
    ("post", "/v1/scalers/{name}/cordon"),
    ("post", "/v1/scalers/{name}/uncordon"),
    ("post", "/v1/scalers/{name}/drain"),
    ("post", "/v1/reload"),
    ("get", "/v1/events"),
    ("get", "/v1/fleet"),
    ("get", "/metrics"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/openapi.json"),
];

/// Routes served beyond that contract (documented in docs/operations.md).
pub const EXTRA_ROUTES: &[(&str, &str)] = &[("delete", "/v1/jobs/{id}"), ("get", "/v1/jobs")];
