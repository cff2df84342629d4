//! The MicroVM Metadata Service as Firecracker implements it: the data store
//! (PUT replaces, PATCH is an RFC 7396 merge patch and needs a prior PUT, both
//! bounded by the size limit), and the guest-facing HTTP semantics of V1 and
//! V2 (session tokens from `PUT /latest/api/token` with a TTL of 1..=21600 s,
//! 401 without a valid `X-metadata-token`, IMDS plain text vs JSON output).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::RngCore;
use serde_json::{Map, Value};

/// Default data-store limit: Firecracker's `--http-api-max-payload-size` default.
pub const DEFAULT_MMDS_SIZE_LIMIT: usize = 51_200;
/// Token TTL bounds from Firecracker's token authority.
pub const MIN_TOKEN_TTL_SECONDS: u32 = 1;
pub const MAX_TOKEN_TTL_SECONDS: u32 = 21_600;
/// The only path a V2 `PUT` may target.
pub const TOKEN_PATH: &str = "/latest/api/token";

/// MMDS protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MmdsVersion {
    #[default]
    V1,
    V2,
}

impl MmdsVersion {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "V1",
            Self::V2 => "V2",
        }
    }
}

/// Data-store errors, worded like Firecracker's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataStoreError {
    #[error("The MMDS patch request doesn't fit.")]
    LimitExceeded,
    #[error("The MMDS data store is not initialized.")]
    NotInitialized,
}

/// The data store plus the token authority.
#[derive(Debug)]
pub struct Mmds {
    data: Value,
    initialized: bool,
    limit: usize,
    version: MmdsVersion,
    imds_compat: bool,
    tokens: HashMap<String, Instant>,
}

impl Mmds {
    pub fn new(limit: usize) -> Self {
        Self {
            data: Value::Null,
            initialized: false,
            limit,
            version: MmdsVersion::V1,
            imds_compat: false,
            tokens: HashMap::new(),
        }
    }

    pub fn version(&self) -> MmdsVersion {
        self.version
    }

    pub fn set_version(&mut self, version: MmdsVersion, imds_compat: bool) {
        if version == MmdsVersion::V1 {
            self.tokens.clear();
        }
        self.version = version;
        self.imds_compat = imds_compat;
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The store as `GET /mmds` returns it (`{}` before any PUT).
    pub fn value(&self) -> Value {
        match &self.data {
            Value::Null => Value::Object(Map::new()),
            v => v.clone(),
        }
    }

    fn serialized_len(v: &Value) -> usize {
        // Serializing a `Value` cannot fail: keys are strings.
        serde_json::to_vec(v).map(|b| b.len()).unwrap_or(usize::MAX)
    }

    /// `PUT /mmds`.
    pub fn put(&mut self, data: Value) -> Result<(), DataStoreError> {
        if Self::serialized_len(&data) > self.limit {
            return Err(DataStoreError::LimitExceeded);
        }
        self.data = data;
        self.initialized = true;
        Ok(())
    }

    /// `PATCH /mmds`.
    pub fn patch(&mut self, patch: &Value) -> Result<(), DataStoreError> {
        if !self.initialized {
            return Err(DataStoreError::NotInitialized);
        }
        let mut next = self.data.clone();
        json_merge_patch(&mut next, patch);
        if Self::serialized_len(&next) > self.limit {
            return Err(DataStoreError::LimitExceeded);
        }
        self.data = next;
        Ok(())
    }

    /// Serve one guest request (what the device model answers at the MMDS address).
    pub fn guest_request(&mut self, req: &GuestRequest) -> GuestResponse {
        if req.path.is_empty() {
            return GuestResponse::text(400, "Invalid URI.");
        }
        match self.version {
            MmdsVersion::V1 => match req.method {
                GuestMethod::Get => self.get_unchecked(req),
                _ => GuestResponse::text(405, "Not allowed HTTP method.").allow("GET"),
            },
            MmdsVersion::V2 => match req.method {
                GuestMethod::Get => {
                    let Some(token) = req
                        .header("x-metadata-token")
                        .or_else(|| req.header("x-aws-ec2-metadata-token"))
                    else {
                        return GuestResponse::text(
                            401,
                            "No MMDS token provided. Use `X-metadata-token` header to specify the session token.",
                        );
                    };
                    let now = Instant::now();
                    self.tokens.retain(|_, exp| *exp > now);
                    if self.tokens.contains_key(token) {
                        self.get_unchecked(req)
                    } else {
                        GuestResponse::text(401, "MMDS token not valid.")
                    }
                }
                GuestMethod::Put => self.put_token(req),
                GuestMethod::Other => {
                    GuestResponse::text(405, "Not allowed HTTP method.").allow("GET, PUT")
                }
            },
        }
    }

    fn put_token(&mut self, req: &GuestRequest) -> GuestResponse {
        if req.header("x-forwarded-for").is_some() {
            return GuestResponse::text(
                400,
                "Invalid header. Reason: Unsupported header name. Key: X-Forwarded-For",
            );
        }
        if sanitize(&req.path) != TOKEN_PATH {
            return GuestResponse::text(404, format!("Resource not found: {}.", req.path));
        }
        let raw = req
            .header("x-metadata-token-ttl-seconds")
            .or_else(|| req.header("x-aws-ec2-metadata-token-ttl-seconds"));
        let Some(raw) = raw else {
            return GuestResponse::text(
                400,
                "Token time to live value not found. Use `X-metadata-token-ttl-seconds` header to specify the token's lifetime.",
            );
        };
        let Ok(ttl) = raw.trim().parse::<u32>() else {
            return GuestResponse::text(
                400,
                format!("Invalid header. Reason: Invalid value. Key:X-metadata-token-ttl-seconds; Value:{raw}"),
            );
        };
        if !(MIN_TOKEN_TTL_SECONDS..=MAX_TOKEN_TTL_SECONDS).contains(&ttl) {
            return GuestResponse::text(
                400,
                format!(
                    "Invalid time to live value provided for token: {ttl}. Please provide a value between {MIN_TOKEN_TTL_SECONDS} and {MAX_TOKEN_TTL_SECONDS}."
                ),
            );
        }
        let mut bytes = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut bytes);
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        self.tokens.insert(
            token.clone(),
            Instant::now() + Duration::from_secs(u64::from(ttl)),
        );
        GuestResponse::text(200, token)
    }

    fn get_unchecked(&self, req: &GuestRequest) -> GuestResponse {
        let path = sanitize(&req.path);
        let pointer = path.strip_suffix('/').unwrap_or(&path);
        let Some(found) = self.data.pointer(pointer) else {
            return GuestResponse::text(404, format!("Resource not found: {}.", req.path));
        };
        let json = !self.imds_compat
            && req
                .header("accept")
                .is_some_and(|a| a.contains("application/json"));
        if json {
            return GuestResponse {
                status: 200,
                content_type: "application/json",
                body: found.to_string(),
                allow: None,
            };
        }
        match found {
            Value::Object(map) => {
                let keys: Vec<String> = map
                    .iter()
                    .map(|(k, v)| {
                        if v.is_object() {
                            format!("{k}/")
                        } else {
                            k.clone()
                        }
                    })
                    .collect();
                GuestResponse::text(200, keys.join("\n"))
            }
            Value::String(s) => GuestResponse::text(200, s.clone()),
            _ => GuestResponse::text(
                501,
                "Cannot retrieve value. The value has an unsupported type.",
            ),
        }
    }
}

/// RFC 7396 JSON merge patch, as Firecracker applies it.
pub fn json_merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(patch_map) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            if let Value::Object(doc) = target {
                for (k, v) in patch_map {
                    if v.is_null() {
                        doc.remove(k);
                    } else {
                        json_merge_patch(doc.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn sanitize(uri: &str) -> String {
    let mut s = uri.to_string();
    while s.contains("//") {
        s = s.replace("//", "/");
    }
    s
}

/// Guest request method (the device model only distinguishes these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestMethod {
    Get,
    Put,
    Other,
}

/// A request a guest sends to the MMDS address.
#[derive(Debug, Clone)]
pub struct GuestRequest {
    pub method: GuestMethod,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl GuestRequest {
    pub fn get(path: &str) -> Self {
        Self {
            method: GuestMethod::Get,
            path: path.to_string(),
            headers: Vec::new(),
        }
    }

    pub fn put(path: &str) -> Self {
        Self {
            method: GuestMethod::Put,
            path: path.to_string(),
            headers: Vec::new(),
        }
    }

    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What the device model answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestResponse {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
    pub allow: Option<&'static str>,
}

impl GuestResponse {
    fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain",
            body: body.into(),
            allow: None,
        }
    }

    fn allow(mut self, methods: &'static str) -> Self {
        self.allow = Some(methods);
        self
    }
}

#[cfg(test)]
mod firecracker_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use serde_json::json;

    use super::*;

    #[test]
    fn v2_requires_a_token_and_bounds_its_ttl() {
        let mut m = Mmds::new(DEFAULT_MMDS_SIZE_LIMIT);
        m.put(json!({"latest": {"meta-data": {"a": "b"}}})).unwrap();
        m.set_version(MmdsVersion::V2, false);
        let r = m.guest_request(&GuestRequest::get("/latest/meta-data/a"));
        assert_eq!(r.status, 401);
        let r = m.guest_request(&GuestRequest::put(TOKEN_PATH));
        assert_eq!(r.status, 400);
        for bad in ["0", "21601"] {
            let r = m.guest_request(
                &GuestRequest::put(TOKEN_PATH).with_header("X-metadata-token-ttl-seconds", bad),
            );
            assert_eq!(r.status, 400, "{bad}");
        }
        let tok = m
            .guest_request(
                &GuestRequest::put(TOKEN_PATH).with_header("X-metadata-token-ttl-seconds", "60"),
            )
            .body;
        let r = m.guest_request(
            &GuestRequest::get("/latest/meta-data/a").with_header("X-metadata-token", &tok),
        );
        assert_eq!((r.status, r.body.as_str()), (200, "b"));
        let r = m.guest_request(
            &GuestRequest::get("/latest/meta-data/a").with_header("X-metadata-token", "forged"),
        );
        assert_eq!(r.status, 401);
        let r = m.guest_request(
            &GuestRequest::get("/latest/meta-data")
                .with_header("X-metadata-token", &tok)
                .with_header("Accept", "application/json"),
        );
        assert_eq!(r.body, r#"{"a":"b"}"#);
    }

    #[test]
    fn v1_serves_without_token_and_refuses_put() {
        let mut m = Mmds::new(DEFAULT_MMDS_SIZE_LIMIT);
        m.put(json!({"k": {"x": "y"}, "n": 1})).unwrap();
        assert_eq!(m.guest_request(&GuestRequest::get("/")).body, "k/\nn");
        assert_eq!(m.guest_request(&GuestRequest::get("/n")).status, 501);
        assert_eq!(m.guest_request(&GuestRequest::put(TOKEN_PATH)).status, 405);
    }

    #[test]
    fn patch_needs_put_and_limits_apply() {
        let mut m = Mmds::new(20);
        assert_eq!(
            m.patch(&json!({"a": "b"})),
            Err(DataStoreError::NotInitialized)
        );
        m.put(json!({"a": "b"})).unwrap();
        assert_eq!(
            m.put(json!({"a": "0123456789012345678"})),
            Err(DataStoreError::LimitExceeded)
        );
        m.patch(&json!({"a": null, "c": "d"})).unwrap();
        assert_eq!(m.value(), json!({"c": "d"}));
    }
}
