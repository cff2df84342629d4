//! The agent bootstrap from Firecracker's MicroVM Metadata Service, V2
//! (KiCI's MMDS keys, see docs/deviations.md, D-mmds-v2; Firecracker's MMDS user guide).
//!
//! A session token comes from `PUT /latest/api/token` with
//! `X-metadata-token-ttl-seconds`; every `GET` carries it in
//! `X-metadata-token`, and `Accept: application/json` makes MMDS answer the
//! whole `latest/meta-data` object as JSON (without it, MMDS lists keys as
//! IMDS text). The host writes the store only after the guest has started
//! booting, so until then MMDS answers 404 (no data) or an empty object (a
//! cleared store); [`fetch`] retries those — and a network that is not up
//! yet — with a capped exponential backoff, until a deadline. A 401 means
//! the token expired or the VMM forgot it: a new one is minted.
//!
//! [`GuestBootstrap::from_meta`] applies the env contract: the dedicated
//! keys become the `KICI_*` variables, `kici-env` entries are exported as
//! they are (POSIX names and string values only), and a `kici-env` entry
//! never overrides a dedicated key (the token binding depends on those).

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;
use tokio::time::Instant;

/// Where Firecracker serves MMDS unless its config names another address.
pub const DEFAULT_ADDRESS: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(169, 254, 169, 254), 80));
/// The V2 session-token path.
pub const TOKEN_PATH: &str = "/latest/api/token";
/// The document the scaler writes.
pub const META_DATA_PATH: &str = "/latest/meta-data";
pub const TOKEN_TTL_HEADER: &str = "X-metadata-token-ttl-seconds";
pub const TOKEN_HEADER: &str = "X-metadata-token";

/// The dedicated MMDS keys and the variables they become.
pub const DEDICATED_KEYS: [(&str, &str); 6] = [
    ("kici-orchestrator-url", "KICI_ORCHESTRATOR_URL"),
    ("kici-agent-id", "KICI_AGENT_ID"),
    ("kici-labels", "KICI_LABELS"),
    ("kici-scaler-managed", "KICI_SCALER_MANAGED"),
    ("kici-agent-token", "KICI_AGENT_TOKEN"),
    ("kici-backpressure-mode", "KICI_BACKPRESSURE_MODE"),
];
/// The forwarded env object.
pub const ENV_KEY: &str = "kici-env";
/// The bridge gateway (for `/etc/hosts`; not an env variable).
pub const GATEWAY_KEY: &str = "kici-gateway-ip";

/// Why no bootstrap came out of MMDS.
#[derive(Debug, thiserror::Error)]
pub enum MmdsError {
    #[error("MMDS at {address} had no bootstrap within {deadline:?} (last: {last})")]
    Deadline {
        address: SocketAddr,
        deadline: Duration,
        last: String,
    },
    #[error("MMDS {method} {path} answered {status}: {body}")]
    Refused {
        method: &'static str,
        path: &'static str,
        status: u16,
        body: String,
    },
    #[error("MMDS {path} is not a JSON object: {reason}")]
    NotAnObject { path: &'static str, reason: String },
    #[error("MMDS key {key} is not a string")]
    NotAString { key: &'static str },
}

/// How [`fetch`] talks to MMDS and how long it waits.
#[derive(Debug, Clone)]
pub struct FetchPolicy {
    pub address: SocketAddr,
    /// The whole wait, from the first attempt.
    pub deadline: Duration,
    /// Bound on one HTTP exchange (connect included).
    pub request_timeout: Duration,
    /// First retry delay; doubled after each failed attempt up to `max_delay`.
    pub initial_delay: Duration,
    pub max_delay: Duration,
    /// Lifetime asked for the session token (Firecracker: 1..=21600 s).
    pub token_ttl_seconds: u32,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        Self {
            address: DEFAULT_ADDRESS,
            // The scaler destroys an agent that has not registered within
            // its registration timeout (120 s by default).
            deadline: Duration::from_secs(60),
            request_timeout: Duration::from_secs(2),
            initial_delay: Duration::from_millis(20),
            max_delay: Duration::from_secs(1),
            token_ttl_seconds: 300,
        }
    }
}

/// One HTTP answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmdsResponse {
    pub status: u16,
    pub body: String,
}

/// A plain-HTTP/1.1 MMDS client: one connection per request (MMDS closes
/// idle connections, and a guest makes a handful of requests).
#[derive(Debug, Clone, Copy)]
pub struct MmdsClient {
    address: SocketAddr,
    timeout: Duration,
}

/// A transport failure (connect, timeout, protocol).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(String);

impl MmdsClient {
    pub fn new(address: SocketAddr, timeout: Duration) -> Self {
        Self { address, timeout }
    }

    /// `PUT /latest/api/token` asking for a token living `ttl_seconds`.
    pub async fn put_token(&self, ttl_seconds: u32) -> Result<MmdsResponse, TransportError> {
        self.request(
            hyper::Method::PUT,
            TOKEN_PATH,
            &[(TOKEN_TTL_HEADER, ttl_seconds.to_string())],
        )
        .await
    }

    /// `GET path` as JSON, with the session token when there is one.
    pub async fn get_json(
        &self,
        path: &str,
        token: Option<&str>,
    ) -> Result<MmdsResponse, TransportError> {
        let mut headers = vec![("Accept", "application/json".to_owned())];
        if let Some(token) = token {
            headers.push((TOKEN_HEADER, token.to_owned()));
        }
        self.request(hyper::Method::GET, path, &headers).await
    }

    async fn request(
        &self,
        method: hyper::Method,
        path: &str,
        headers: &[(&str, String)],
    ) -> Result<MmdsResponse, TransportError> {
        tokio::time::timeout(self.timeout, self.exchange(method, path, headers))
            .await
            .map_err(|_| TransportError(format!("no answer within {:?}", self.timeout)))?
    }

    async fn exchange(
        &self,
        method: hyper::Method,
        path: &str,
        headers: &[(&str, String)],
    ) -> Result<MmdsResponse, TransportError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| TransportError(format!("{what}: {e}"));
        let stream = tokio::net::TcpStream::connect(self.address)
            .await
            .map_err(|e| fail("connect", &e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| fail("handshake", &e))?;
        let driver = tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, self.address.ip().to_string());
        for (name, value) in headers {
            request = request.header(*name, value.as_str());
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| fail("request", &e))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| fail("request", &e))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| fail("response body", &e))?
            .to_bytes();
        driver.abort();
        Ok(MmdsResponse {
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }
}

/// Waits for the `latest/meta-data` object to be populated and returns it.
pub async fn fetch(policy: &FetchPolicy) -> Result<Map<String, Value>, MmdsError> {
    let client = MmdsClient::new(policy.address, policy.request_timeout);
    let started = Instant::now();
    let mut delay = policy.initial_delay;
    let mut token: Option<String> = None;
    loop {
        let last = match attempt(&client, policy, &mut token).await? {
            Ok(meta) => return Ok(meta),
            Err(reason) => reason,
        };
        let left = policy.deadline.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(MmdsError::Deadline {
                address: policy.address,
                deadline: policy.deadline,
                last,
            });
        }
        tracing::debug!(reason = %last, "MMDS not ready; retrying");
        tokio::time::sleep(delay.min(left)).await;
        delay = (delay * 2).min(policy.max_delay);
    }
}

/// One token-then-document attempt: the document, a reason to retry, or a
/// final error.
async fn attempt(
    client: &MmdsClient,
    policy: &FetchPolicy,
    token: &mut Option<String>,
) -> Result<Result<Map<String, Value>, String>, MmdsError> {
    let session = match token {
        Some(t) => t.clone(),
        None => {
            let answer = match client.put_token(policy.token_ttl_seconds).await {
                Ok(a) => a,
                Err(e) => return Ok(Err(format!("PUT {TOKEN_PATH}: {e}"))),
            };
            match answer.status {
                200 => {}
                s if s >= 500 => return Ok(Err(format!("PUT {TOKEN_PATH}: {s}"))),
                status => {
                    return Err(MmdsError::Refused {
                        method: "PUT",
                        path: TOKEN_PATH,
                        status,
                        body: answer.body,
                    })
                }
            }
            let t = answer.body.trim().to_owned();
            *token = Some(t.clone());
            t
        }
    };
    let answer = match client.get_json(META_DATA_PATH, Some(&session)).await {
        Ok(a) => a,
        Err(e) => return Ok(Err(format!("GET {META_DATA_PATH}: {e}"))),
    };
    match answer.status {
        200 => {}
        401 => {
            *token = None;
            return Ok(Err(format!(
                "GET {META_DATA_PATH}: 401 (token refused; minting a new one)"
            )));
        }
        404 => return Ok(Err(format!("GET {META_DATA_PATH}: 404 (not populated)"))),
        s if s >= 500 => return Ok(Err(format!("GET {META_DATA_PATH}: {s}"))),
        status => {
            return Err(MmdsError::Refused {
                method: "GET",
                path: META_DATA_PATH,
                status,
                body: answer.body,
            })
        }
    }
    match serde_json::from_str::<Value>(&answer.body) {
        Ok(Value::Object(meta)) if meta.is_empty() => Ok(Err(format!(
            "GET {META_DATA_PATH}: empty (not populated or cleared)"
        ))),
        Ok(Value::Object(meta)) => Ok(Ok(meta)),
        Ok(other) => Err(MmdsError::NotAnObject {
            path: META_DATA_PATH,
            reason: format!("got {other}"),
        }),
        Err(e) => Err(MmdsError::NotAnObject {
            path: META_DATA_PATH,
            reason: e.to_string(),
        }),
    }
}

/// What the guest takes from the document.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GuestBootstrap {
    /// The agent's environment entries, by name.
    pub env: BTreeMap<String, String>,
    /// `kici-gateway-ip`, when present and an IPv4 address.
    pub gateway_ip: Option<Ipv4Addr>,
    /// `kici-env` entries left out (not a POSIX name, not a string, or
    /// naming a dedicated variable), for a warning.
    pub skipped: Vec<String>,
}

impl GuestBootstrap {
    /// Applies the env contract to a `latest/meta-data` object.
    pub fn from_meta(meta: &Map<String, Value>) -> Result<Self, MmdsError> {
        let mut out = Self::default();
        if let Some(extra) = meta.get(ENV_KEY) {
            let Some(extra) = extra.as_object() else {
                return Err(MmdsError::NotAnObject {
                    path: "/latest/meta-data/kici-env",
                    reason: format!("got {extra}"),
                });
            };
            for (name, value) in extra {
                let dedicated = DEDICATED_KEYS.iter().any(|(_, var)| var == name);
                match value.as_str() {
                    Some(v) if is_posix_name(name) && !dedicated => {
                        out.env.insert(name.clone(), v.to_owned());
                    }
                    _ => out.skipped.push(name.clone()),
                }
            }
        }
        for (key, var) in DEDICATED_KEYS {
            match meta.get(key) {
                None => {}
                Some(Value::String(v)) => {
                    out.env.insert(var.to_owned(), v.clone());
                }
                Some(_) => return Err(MmdsError::NotAString { key }),
            }
        }
        out.gateway_ip = meta
            .get(GATEWAY_KEY)
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok());
        Ok(out)
    }

    /// The agent id, when the document names one (the guest's hostname).
    pub fn agent_id(&self) -> Option<&str> {
        self.env.get("KICI_AGENT_ID").map(String::as_str)
    }
}

/// Does `name` match `^[A-Za-z_][A-Za-z0-9_]*$`?
pub fn is_posix_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn dedicated_keys_become_kici_variables_and_kici_env_is_exported_as_is() {
        let b = GuestBootstrap::from_meta(&object(json!({
            "kici-orchestrator-url": "ws://10.0.0.1:7879/ws",
            "kici-agent-id": "scaler-firecracker-01020304",
            "kici-labels": "linux,kici:agent:firecracker",
            "kici-scaler-managed": "1",
            "kici-agent-token": "kat_x",
            "kici-backpressure-mode": "drop",
            "kici-gateway-ip": "10.0.0.1",
            "kici-env": {"HTTP_PROXY": "http://p:3128", "KICI_ROLES": "builder"}
        })))
        .unwrap();
        let expected: BTreeMap<String, String> = [
            ("KICI_ORCHESTRATOR_URL", "ws://10.0.0.1:7879/ws"),
            ("KICI_AGENT_ID", "scaler-firecracker-01020304"),
            ("KICI_LABELS", "linux,kici:agent:firecracker"),
            ("KICI_SCALER_MANAGED", "1"),
            ("KICI_AGENT_TOKEN", "kat_x"),
            ("KICI_BACKPRESSURE_MODE", "drop"),
            ("HTTP_PROXY", "http://p:3128"),
            ("KICI_ROLES", "builder"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(b.env, expected);
        assert_eq!(b.gateway_ip, Some(Ipv4Addr::new(10, 0, 0, 1)));
        assert_eq!(b.agent_id(), Some("scaler-firecracker-01020304"));
        assert!(b.skipped.is_empty());
    }

    #[test]
    fn kici_env_never_overrides_a_dedicated_key_and_bad_entries_are_skipped() {
        let b = GuestBootstrap::from_meta(&object(json!({
            "kici-agent-id": "scaler-firecracker-01020304",
            "kici-env": {
                "KICI_AGENT_ID": "forged",
                "BAD-NAME": "x",
                "NUMBER": 1,
                "GOOD": "yes"
            }
        })))
        .unwrap();
        assert_eq!(b.agent_id(), Some("scaler-firecracker-01020304"));
        assert_eq!(b.env.get("GOOD").map(String::as_str), Some("yes"));
        assert_eq!(b.env.len(), 2);
        let mut skipped = b.skipped.clone();
        skipped.sort();
        assert_eq!(skipped, ["BAD-NAME", "KICI_AGENT_ID", "NUMBER"]);
        assert_eq!(b.gateway_ip, None);
    }

    #[test]
    fn malformed_documents_are_errors() {
        assert!(matches!(
            GuestBootstrap::from_meta(&object(json!({"kici-agent-id": 7}))),
            Err(MmdsError::NotAString {
                key: "kici-agent-id"
            })
        ));
        assert!(matches!(
            GuestBootstrap::from_meta(&object(json!({"kici-env": "A=1"}))),
            Err(MmdsError::NotAnObject { .. })
        ));
    }
}
