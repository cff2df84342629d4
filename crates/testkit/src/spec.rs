//! The Firecracker API description this simulator enforces: the swagger file
//! `spec/firecracker-api-v1.16.1.yaml` (a verbatim copy of the upstream
//! `firecracker.yaml` for v1.16.1), compiled into the binary and parsed at start
//! up, so the simulator runs inside a jail where no repository file is visible.
//!
//! This module owns the translation of that YAML into request routes (method,
//! path template, body schema, pre/post-boot gating derived from the
//! operation summaries) and body schemas ([`Schema`]).

use std::collections::BTreeMap;

use serde_yaml::Value as Yaml;

use crate::schema::{ObjectSchema, Schema};

/// The swagger document, as shipped in the crate.
pub const SPEC_YAML: &str = include_str!("../spec/firecracker-api-v1.16.1.yaml");

/// Version string the spec declares (and the simulator reports as `vmm_version`).
pub const SPEC_VERSION: &str = "1.16.1";

/// Why the spec could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("the Firecracker API spec is not valid YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("the Firecracker API spec has no `{0}` section")]
    MissingSection(&'static str),
    #[error("the Firecracker API spec is malformed at {0}")]
    Malformed(String),
}

/// HTTP methods the Firecracker API server knows (micro_http supports exactly these).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ApiMethod {
    Get,
    Put,
    Patch,
}

impl ApiMethod {
    /// Parse an HTTP method token; `None` for methods Firecracker does not serve.
    pub fn parse(token: &str) -> Option<Self> {
        match token {
            "GET" => Some(Self::Get),
            "PUT" => Some(Self::Put),
            "PATCH" => Some(Self::Patch),
            _ => None,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "GET",
            Self::Put => "PUT",
            Self::Patch => "PATCH",
        }
    }
}

/// When an operation may be called relative to `InstanceStart`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootGate {
    /// Any time.
    Always,
    /// Only before `InstanceStart` ("Pre-boot only." in the summary).
    PreBootOnly,
    /// Only after `InstanceStart` ("Post-boot only." in the summary).
    PostBootOnly,
}

/// One operation of the API.
#[derive(Debug, Clone)]
pub struct Route {
    pub method: ApiMethod,
    /// Path template segments, e.g. `["drives", "{drive_id}"]`.
    pub segments: Vec<String>,
    pub operation_id: String,
    pub summary: String,
    /// The body schema (a `$ref` into definitions or an inline schema), if the operation takes a body.
    pub body: Option<Schema>,
    /// Whether the spec marks the body parameter as required.
    pub body_required: bool,
    pub gate: BootGate,
}

impl Route {
    /// Match a concrete path (split into segments) and return the path parameters.
    pub fn matches(
        &self,
        method: ApiMethod,
        segments: &[&str],
    ) -> Option<BTreeMap<String, String>> {
        if method != self.method || segments.len() != self.segments.len() {
            return None;
        }
        let mut params = BTreeMap::new();
        for (template, actual) in self.segments.iter().zip(segments) {
            if let Some(name) = template.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
                params.insert(name.to_string(), (*actual).to_string());
            } else if template != actual {
                return None;
            }
        }
        Some(params)
    }
}

/// The parsed API: routes and definitions.
#[derive(Debug, Clone)]
pub struct ApiSpec {
    pub routes: Vec<Route>,
    pub definitions: BTreeMap<String, Schema>,
}

impl ApiSpec {
    /// Parse the shipped spec.
    pub fn load() -> Result<Self, SpecError> {
        Self::parse(SPEC_YAML)
    }

    /// Parse a swagger 2.0 document.
    pub fn parse(text: &str) -> Result<Self, SpecError> {
        let doc: Yaml = serde_yaml::from_str(text)?;
        let paths = doc
            .get("paths")
            .and_then(Yaml::as_mapping)
            .ok_or(SpecError::MissingSection("paths"))?;
        let defs = doc
            .get("definitions")
            .and_then(Yaml::as_mapping)
            .ok_or(SpecError::MissingSection("definitions"))?;

        let mut definitions = BTreeMap::new();
        for (name, def) in defs {
            let name = name
                .as_str()
                .ok_or_else(|| SpecError::Malformed("a definition name".into()))?;
            definitions.insert(name.to_string(), schema_from_yaml(def, name)?);
        }

        let mut routes = Vec::new();
        for (path, ops) in paths {
            let path = path
                .as_str()
                .ok_or_else(|| SpecError::Malformed("a path key".into()))?;
            let ops = ops
                .as_mapping()
                .ok_or_else(|| SpecError::Malformed(format!("path {path}")))?;
            for (method, op) in ops {
                let Some(method) = method
                    .as_str()
                    .and_then(|m| ApiMethod::parse(&m.to_uppercase()))
                else {
                    continue;
                };
                routes.push(route_from_yaml(path, method, op)?);
            }
        }
        Ok(Self {
            routes,
            definitions,
        })
    }

    /// Find the route for a method and path (segments without the leading slash).
    pub fn find(
        &self,
        method: ApiMethod,
        segments: &[&str],
    ) -> Option<(&Route, BTreeMap<String, String>)> {
        self.routes
            .iter()
            .find_map(|r| r.matches(method, segments).map(|p| (r, p)))
    }

    /// Whether any route serves this path with another method.
    pub fn path_known(&self, segments: &[&str]) -> bool {
        [ApiMethod::Get, ApiMethod::Put, ApiMethod::Patch]
            .into_iter()
            .any(|m| self.find(m, segments).is_some())
    }
}

fn route_from_yaml(path: &str, method: ApiMethod, op: &Yaml) -> Result<Route, SpecError> {
    let summary = op
        .get("summary")
        .and_then(Yaml::as_str)
        .unwrap_or_default()
        .to_string();
    let operation_id = op
        .get("operationId")
        .and_then(Yaml::as_str)
        .unwrap_or_default()
        .to_string();
    let mut body = None;
    let mut body_required = false;
    if let Some(params) = op.get("parameters").and_then(Yaml::as_sequence) {
        for p in params {
            if p.get("in").and_then(Yaml::as_str) == Some("body") {
                let schema = p
                    .get("schema")
                    .ok_or_else(|| SpecError::Malformed(format!("{path} body schema")))?;
                body = Some(schema_from_yaml(schema, &operation_id)?);
                body_required = p.get("required").and_then(Yaml::as_bool).unwrap_or(false);
            }
        }
    }
    let lower = summary.to_lowercase();
    let gate = if lower.contains("pre-boot only") {
        BootGate::PreBootOnly
    } else if lower.contains("post-boot only") {
        BootGate::PostBootOnly
    } else {
        BootGate::Always
    };
    let segments = path
        .trim_start_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    Ok(Route {
        method,
        segments,
        operation_id,
        summary,
        body,
        body_required,
        gate,
    })
}

fn schema_from_yaml(y: &Yaml, context: &str) -> Result<Schema, SpecError> {
    if let Some(r) = y.get("$ref").and_then(Yaml::as_str) {
        let name = r
            .strip_prefix("#/definitions/")
            .ok_or_else(|| SpecError::Malformed(format!("{context}: unsupported $ref {r}")))?;
        return Ok(Schema::Ref(name.to_string()));
    }
    let ty = y.get("type").and_then(Yaml::as_str);
    let enum_values = y.get("enum").and_then(Yaml::as_sequence).map(|vals| {
        vals.iter()
            .filter_map(|v| match v {
                Yaml::String(s) => Some(s.clone()),
                Yaml::Number(n) => Some(n.to_string()),
                Yaml::Bool(b) => Some(b.to_string()),
                _ => None,
            })
            .collect::<Vec<_>>()
    });
    Ok(match ty {
        Some("object") | None if y.get("properties").is_some() || ty == Some("object") => {
            let mut properties = Vec::new();
            if let Some(props) = y.get("properties").and_then(Yaml::as_mapping) {
                for (k, v) in props {
                    let k = k
                        .as_str()
                        .ok_or_else(|| SpecError::Malformed(format!("{context}: property name")))?;
                    properties.push((k.to_string(), schema_from_yaml(v, context)?));
                }
            }
            let required = y
                .get("required")
                .and_then(Yaml::as_sequence)
                .map(|r| {
                    r.iter()
                        .filter_map(Yaml::as_str)
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            // Firecracker deserializes its request types with serde's
            // `deny_unknown_fields`: unknown keys are refused unless the spec
            // explicitly allows additional properties (MMDS contents).
            let additional = matches!(y.get("additionalProperties"), Some(Yaml::Bool(true)))
                || y.get("additionalProperties")
                    .is_some_and(|a| a.as_mapping().is_some());
            Schema::Object(ObjectSchema {
                name: context.to_string(),
                properties,
                required,
                additional_allowed: additional,
            })
        }
        Some("array") => {
            let items = y
                .get("items")
                .map(|i| schema_from_yaml(i, context))
                .transpose()?
                .unwrap_or(Schema::Any);
            Schema::Array(Box::new(items))
        }
        Some("string") => Schema::String {
            allowed: enum_values,
        },
        Some("integer") => Schema::Integer {
            minimum: y.get("minimum").and_then(Yaml::as_i64),
            maximum: y.get("maximum").and_then(Yaml::as_i64),
        },
        Some("number") => Schema::Number,
        Some("boolean") => Schema::Boolean,
        _ => Schema::Any,
    })
}

#[cfg(test)]
mod firecracker_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn shipped_spec_parses_with_gates_from_summaries() {
        let spec = ApiSpec::load().unwrap();
        let (boot, _) = spec.find(ApiMethod::Put, &["boot-source"]).unwrap();
        assert_eq!(boot.gate, BootGate::PreBootOnly);
        assert!(boot.body_required);
        let (drive_patch, params) = spec.find(ApiMethod::Patch, &["drives", "rootfs"]).unwrap();
        assert_eq!(drive_patch.gate, BootGate::PostBootOnly);
        assert_eq!(params.get("drive_id").map(String::as_str), Some("rootfs"));
        let (mmds_put, _) = spec.find(ApiMethod::Put, &["mmds"]).unwrap();
        assert_eq!(mmds_put.gate, BootGate::Always);
        assert!(spec.find(ApiMethod::Get, &["nope"]).is_none());
        assert!(spec.definitions.contains_key("MmdsConfig"));
    }
}
