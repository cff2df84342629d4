//! Redeeming a claim code: how an agent on an externally provisioned
//! instance gets its bootstrap.
//!
//! A `type: event` scaler's scale-up event carries a single-use claim code
//! and the URL to redeem it at; the provisioner starts the agent with
//! `--claim CODE --claim-url URL` (or `KICI_CLAIM_CODE` + `KICI_CLAIM_URL`,
//! which keeps the code out of the process list). [`redeem`] posts
//! `{"claimCode": CODE}` there and gets `{agentToken, agentId, gatewayUrl,
//! labels}`, which [`apply`] lays over the environment as the usual
//! `KICI_*` bootstrap; the agent then connects and registers as usual.
//!
//! A refusal (`unknown`, `consumed`, `expired`, or any other 4xx) is final:
//! a code is single use, so retrying cannot help. A network failure, a
//! 408/429 or a 5xx is retried with a capped backoff until the deadline (the
//! instance's network may come up after the agent starts). Plain `http://`
//! only in this build, like the gateway's `ws://`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use kici_protocol::bootstrap::{AGENT_ID, AGENT_TOKEN, LABELS, ORCHESTRATOR_URL, SCALER_MANAGED};
use kici_provision::claim::{ClaimCode, ClaimErrorBody, ClaimRequest, ClaimedCredentials};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;
use tokio::time::Instant;

/// The environment variables the agent reads its claim from.
pub const CLAIM_CODE: &str = "KICI_CLAIM_CODE";
pub const CLAIM_URL: &str = "KICI_CLAIM_URL";
/// Largest answer read (credentials are a few hundred bytes).
const MAX_ANSWER: usize = 64 * 1024;

/// Where to redeem: an `http://` URL with a host and no credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct ClaimUrl(url::Url);

impl ClaimUrl {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let url = url::Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL ({e})"))?;
        match url.scheme() {
            "http" => {}
            "https" => {
                return Err(
                    "https:// is not supported by this build (plain http:// only)".to_owned(),
                )
            }
            other => return Err(format!("scheme {other:?} is not http")),
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!("{raw:?} has no host"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err("credentials in the URL are not allowed".to_owned());
        }
        Ok(Self(url))
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl fmt::Debug for ClaimUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClaimUrl({})", self.0)
    }
}

impl fmt::Display for ClaimUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_str())
    }
}

/// What to redeem, from the command line or the environment.
#[derive(Debug, Clone)]
pub struct Claim {
    pub code: ClaimCode,
    pub url: ClaimUrl,
}

impl Claim {
    /// The claim from flags (preferred) or the environment; `Ok(None)` when
    /// neither names one. Both halves are needed. The two variables are
    /// removed from `env` either way: they are the agent's own input, not
    /// part of the bootstrap contract.
    pub fn from_flags_or_env(
        code_flag: Option<String>,
        url_flag: Option<String>,
        env: &mut BTreeMap<String, String>,
    ) -> Result<Option<Self>, String> {
        let env_code = env.remove(CLAIM_CODE).filter(|v| !v.is_empty());
        let env_url = env.remove(CLAIM_URL).filter(|v| !v.is_empty());
        let code = code_flag.or(env_code);
        let url = url_flag.or(env_url);
        match (code, url) {
            (None, None) => Ok(None),
            (Some(_), None) => Err(format!(
                "a claim code needs the URL to redeem it at (--claim-url or {CLAIM_URL})"
            )),
            (None, Some(_)) => Err(format!(
                "a claim URL needs the code to redeem (--claim or {CLAIM_CODE})"
            )),
            (Some(code), Some(url)) => Ok(Some(Self {
                code: ClaimCode::from_wire(&code).map_err(|e| e.to_string())?,
                url: ClaimUrl::parse(&url).map_err(|e| format!("claim URL: {e}"))?,
            })),
        }
    }
}

/// How long and how often to try.
#[derive(Debug, Clone)]
pub struct RedeemPolicy {
    /// The whole wait, from the first attempt.
    pub deadline: Duration,
    /// Bound on one HTTP exchange (connect included).
    pub request_timeout: Duration,
    pub initial_delay: Duration,
    pub max_delay: Duration,
}

impl Default for RedeemPolicy {
    fn default() -> Self {
        Self {
            // Well inside the claim's TTL (300 s by default) and the
            // registration deadline.
            deadline: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            initial_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(5),
        }
    }
}

/// Why no credentials came back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// The server refused the code; `reason` is its `unknown`, `consumed`
    /// or `expired` when it gave one.
    #[error("claim refused ({status}{}): {message}", reason.as_deref().map(|r| format!(", reason {r}")).unwrap_or_default())]
    Refused {
        status: u16,
        reason: Option<String>,
        message: String,
    },
    /// The server answered 200 with something that is not credentials.
    #[error("the claim answer is not credentials: {0}")]
    BadAnswer(String),
    /// Nothing usable within the deadline.
    #[error("no answer from {url} within {deadline:?} (last: {last})")]
    Deadline {
        url: String,
        deadline: Duration,
        last: String,
    },
}

/// One exchange's result.
enum Attempt {
    Done(ClaimedCredentials),
    Final(ClaimError),
    Retry(String),
}

/// Redeems `claim`, retrying transient failures until the deadline.
pub async fn redeem(
    claim: &Claim,
    policy: &RedeemPolicy,
) -> Result<ClaimedCredentials, ClaimError> {
    let body = serde_json::to_vec(&ClaimRequest {
        claim_code: claim.code.clone(),
    })
    .map_err(|e| ClaimError::BadAnswer(format!("cannot encode the request: {e}")))?;
    let started = Instant::now();
    let mut delay = policy.initial_delay;
    loop {
        let last =
            match tokio::time::timeout(policy.request_timeout, attempt(&claim.url, &body)).await {
                Ok(Attempt::Done(creds)) => return Ok(creds),
                Ok(Attempt::Final(e)) => return Err(e),
                Ok(Attempt::Retry(why)) => why,
                Err(_) => format!("no answer within {:?}", policy.request_timeout),
            };
        let left = policy.deadline.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(ClaimError::Deadline {
                url: claim.url.to_string(),
                deadline: policy.deadline,
                last,
            });
        }
        tracing::warn!(url = %claim.url, reason = %last, "claim not redeemed yet; retrying");
        tokio::time::sleep(delay.min(left)).await;
        delay = (delay * 2).min(policy.max_delay);
    }
}

async fn attempt(url: &ClaimUrl, body: &[u8]) -> Attempt {
    let (status, answer) = match exchange(&url.0, body).await {
        Ok(r) => r,
        Err(e) => return Attempt::Retry(e),
    };
    match status {
        200 => match serde_json::from_slice::<ClaimedCredentials>(&answer) {
            Ok(creds) => Attempt::Done(creds),
            Err(e) => Attempt::Final(ClaimError::BadAnswer(e.to_string())),
        },
        408 | 429 | 500..=599 => Attempt::Retry(format!("answered {status}")),
        _ => {
            let (reason, message) = match serde_json::from_slice::<ClaimErrorBody>(&answer) {
                Ok(b) => (
                    b.error.reason.map(|r| r.as_str().to_owned()),
                    b.error.message,
                ),
                Err(_) => (None, String::from_utf8_lossy(&answer).into_owned()),
            };
            Attempt::Final(ClaimError::Refused {
                status,
                reason,
                message,
            })
        }
    }
}

async fn exchange(url: &url::Url, body: &[u8]) -> Result<(u16, Bytes), String> {
    let host = url.host_str().ok_or("no host")?;
    let port = url.port_or_known_default().ok_or("no port")?;
    let connect_host = host.trim_start_matches('[').trim_end_matches(']');
    let stream = tokio::net::TcpStream::connect((connect_host, port))
        .await
        .map_err(|e| format!("connect to {host}:{port}: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let driver = tokio::spawn(connection);
    let path = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_owned(),
    };
    let host_header = match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_owned(),
    };
    let request = hyper::Request::post(path)
        .header(hyper::header::HOST, host_header)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(hyper::header::ACCEPT, "application/json")
        .body(Full::new(Bytes::copy_from_slice(body)))
        .map_err(|e| format!("request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let status = response.status().as_u16();
    let answer = Limited::new(response.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| format!("response body: {e}"))?
        .to_bytes();
    driver.abort();
    Ok((status, answer))
}

/// Lays the credentials over the environment as the bootstrap contract's
/// variables (they replace any set there: the claim is authoritative).
pub fn apply(env: &mut BTreeMap<String, String>, creds: &ClaimedCredentials) {
    env.insert(ORCHESTRATOR_URL.to_owned(), creds.gateway_url.clone());
    env.insert(AGENT_ID.to_owned(), creds.agent_id.clone());
    env.insert(AGENT_TOKEN.to_owned(), creds.agent_token.clone());
    env.insert(LABELS.to_owned(), creds.labels.join(","));
    // A claimed agent is one the scaler provisioned: its labels may carry
    // the reserved `kici:` ones.
    env.insert(SCALER_MANAGED.to_owned(), "1".to_owned());
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn flags_win_and_both_halves_are_needed() {
        let mut env = BTreeMap::from([
            (CLAIM_CODE.to_owned(), "kcc_env".to_owned()),
            (CLAIM_URL.to_owned(), "http://env:1/v1/claims".to_owned()),
        ]);
        let c = Claim::from_flags_or_env(Some("kcc_flag".into()), None, &mut env)
            .unwrap()
            .unwrap();
        assert_eq!(c.code.expose(), "kcc_flag");
        assert_eq!(c.url.as_str(), "http://env:1/v1/claims");
        assert!(env.is_empty(), "the claim variables are consumed");

        let mut env = BTreeMap::new();
        assert!(Claim::from_flags_or_env(None, None, &mut env)
            .unwrap()
            .is_none());
        assert!(
            Claim::from_flags_or_env(Some("kcc_x".into()), None, &mut env)
                .unwrap_err()
                .contains("--claim-url")
        );
        assert!(
            Claim::from_flags_or_env(None, Some("http://h/".into()), &mut env)
                .unwrap_err()
                .contains("--claim")
        );
        assert!(Claim::from_flags_or_env(
            Some("kcc_x".into()),
            Some("https://h/".into()),
            &mut env
        )
        .unwrap_err()
        .contains("https:// is not supported"));
        assert!(
            Claim::from_flags_or_env(Some("a b".into()), Some("http://h/".into()), &mut env)
                .is_err()
        );
    }

    #[test]
    fn apply_writes_the_bootstrap() {
        let mut env = BTreeMap::new();
        apply(
            &mut env,
            &ClaimedCredentials {
                agent_token: "kat_t".into(),
                agent_id: "scaler-event-0a1b2c3d".into(),
                gateway_url: "ws://10.0.0.1:9090/ws".into(),
                labels: vec!["linux".into(), "kici:scaler:cloud".into()],
            },
        );
        assert_eq!(env[ORCHESTRATOR_URL], "ws://10.0.0.1:9090/ws");
        assert_eq!(env[AGENT_ID], "scaler-event-0a1b2c3d");
        assert_eq!(env[AGENT_TOKEN], "kat_t");
        assert_eq!(env[LABELS], "linux,kici:scaler:cloud");
        assert_eq!(env[SCALER_MANAGED], "1");
    }
}
