//! Calls only the owner can carry out — one agent's view and reports,
//! destroying it, cancelling a request it holds — carried to the host that
//! owns the agent or the request and answered as that host answered.
//!
//! Every peer call goes to the URL the peer advertised (read from the
//! fleet's database), over TLS when it is `https` (verified as
//! [`super::auth::peer_tls`] says), signed with the fleet key
//! ([`super::auth`]) — never with the operator's API token, which a
//! database writer could otherwise collect by rewriting a URL. What a peer
//! accepts such a signature for is [`peer_route`].
//!
//! A call is forwarded only when this host does not know the agent or job
//! and the database names another live host as its owner, so a forwarded
//! call never bounces: the owner knows it, or answers 404 itself.
//!
//! Fleet-wide reads ([`FleetHost::gather`]) ask every other live host for
//! its own part (`local=true`, so a peer never fans out again) at once, each
//! within [`PEER_READ_TIMEOUT`]; a host that does not answer is named in
//! the reply instead of failing it.

use super::FleetHost;
use axum::http::Method;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Duration;

/// How long a fleet-wide read waits for each peer: a read must stay fast
/// when a host hangs, and the host's lease names it lost soon anyway.
pub const PEER_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a call carried to its owner may take: an owner that hangs must
/// not hang the caller (owner-only calls answer at once: 202, 204).
pub const PEER_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// One peer's part of a fleet-wide read.
#[derive(Debug)]
pub struct PeerPart<T> {
    pub instance: String,
    pub url: Option<String>,
    /// Its answer, or why there is none.
    pub answer: Result<T, String>,
}

/// What an owner-only call is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnedBy {
    /// `/v1/agents/{id}` and its reports.
    Agent(String),
    /// `DELETE /v1/scale/{jobId}`, `GET`/`DELETE /v1/jobs/{id}`.
    Job(String),
}

/// Which owner-only call `method path` is, if any.
pub fn owner_only(method: &Method, path: &str) -> Option<OwnedBy> {
    if let Some(rest) = path.strip_prefix("/v1/agents/") {
        let id = rest.split('/').next().unwrap_or_default();
        return (!id.is_empty()).then(|| OwnedBy::Agent(id.to_owned()));
    }
    if let Some(job) = path.strip_prefix("/v1/jobs/") {
        // Not the log stream: its handler follows the job itself.
        let one = (method == Method::GET || method == Method::DELETE)
            && !job.is_empty()
            && !job.contains('/');
        return one.then(|| OwnedBy::Job(job.to_owned()));
    }
    if method == Method::DELETE {
        if let Some(job) = path.strip_prefix("/v1/scale/") {
            return (!job.is_empty() && !job.contains('/')).then(|| OwnedBy::Job(job.to_owned()));
        }
    }
    None
}

/// Whether `method path` (with its `query`) is a call hosts make on each
/// other — what the fleet's signature is accepted for instead of the API
/// token: the owner-only calls, a job's log stream, and a host's own part
/// of a fleet-wide read (`local=true`).
pub fn peer_route(method: &Method, path: &str, query: Option<&str>) -> bool {
    if owner_only(method, path).is_some() {
        return true;
    }
    if method != Method::GET {
        return false;
    }
    if let Some(job) = path.strip_prefix("/v1/jobs/") {
        if let Some((id, "logs")) = job.split_once('/') {
            return !id.is_empty() && !id.contains('/');
        }
    }
    let local = query
        .unwrap_or_default()
        .split('&')
        .any(|p| p == "local" || p == "local=true");
    local && matches!(path, "/v1/status" | "/v1/agents" | "/v1/events")
}

/// Why a call could not be carried to its owner.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("the fleet's database is unavailable: {0}")]
    Database(#[from] kici_fleet::FleetError),
    #[error("host {instance} owns it but advertises no URL (--advertise-url)")]
    NoUrl { instance: String },
    #[error("host {instance} at {url} owns it but did not answer: {reason}")]
    Unreachable {
        instance: String,
        url: String,
        reason: String,
    },
}

impl FleetHost {
    /// Carries `method path` (with its JSON `body`) to the owner of `what`
    /// when another live host owns it: its status and body. `Ok(None)`:
    /// no other host owns it (answer here).
    pub async fn forward(
        &self,
        what: &OwnedBy,
        method: &Method,
        path: &str,
        body: Bytes,
    ) -> Result<Option<(u16, Bytes)>, PeerError> {
        let queue = self.queue();
        let owner = match what {
            OwnedBy::Agent(id) => queue.agent_owner(id).await?,
            OwnedBy::Job(id) => queue.job_owner(id).await?,
        };
        let Some(owner) = owner.filter(|o| o.instance != self.instance().to_string()) else {
            return Ok(None);
        };
        let Some(url) = owner.url else {
            return Err(PeerError::NoUrl {
                instance: owner.instance,
            });
        };
        let unreachable = |reason: String| PeerError::Unreachable {
            instance: owner.instance.clone(),
            url: url.clone(),
            reason,
        };
        let client = self
            .peer_client(&url, &owner.instance)
            .map_err(unreachable)?;
        let body = (!body.is_empty()).then(|| body.to_vec());
        let reply =
            tokio::time::timeout(PEER_CALL_TIMEOUT, client.raw(method.as_str(), path, body))
                .await
                .map_err(|_| unreachable(format!("no answer within {PEER_CALL_TIMEOUT:?}")))?
                .map_err(|e| unreachable(e.to_string()))?;
        tracing::debug!(owner = %owner.instance, %method, path, status = reply.status, "fleet: call carried to the owner");
        Ok(Some((reply.status, reply.body)))
    }
}

impl FleetHost {
    /// `GET path` on every other live (`up` or `leaving`) host of the
    /// fleet, concurrently, each decoded as `T`. Fails only when the
    /// fleet's hosts cannot be read.
    pub async fn gather<T: DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<Vec<PeerPart<T>>, kici_fleet::FleetError> {
        let asks = self.live_peers().await?.into_iter().map(|h| async move {
            let answer = match &h.url {
                None => Err(no_url()),
                Some(url) => match self.peer_client(url, &h.instance_id) {
                    Ok(client) => read_peer(&client, path).await,
                    Err(e) => Err(e),
                },
            };
            PeerPart {
                instance: h.instance_id,
                url: h.url,
                answer,
            }
        });
        Ok(futures_util::future::join_all(asks).await)
    }
}

impl FleetHost {
    /// The other live (`up` or `leaving`) hosts of the fleet.
    pub async fn live_peers(&self) -> Result<Vec<kici_fleet::HostStatus>, kici_fleet::FleetError> {
        let me = self.instance().to_string();
        let mut hosts = kici_fleet::membership::hosts(self.fleet()).await?;
        hosts.retain(|h| h.instance_id != me && (h.state == "up" || h.state == "leaving"));
        Ok(hosts)
    }

    /// Opens the log stream of job `id` on `owner`, after chunk `after`.
    pub async fn job_logs_at(
        &self,
        owner: &kici_fleet::Owner,
        id: &kici_model::JobId,
        after: Option<u64>,
    ) -> Result<kici_api::JobLogs, String> {
        let url = owner.url.as_deref().ok_or_else(no_url)?;
        let client = self.peer_client(url, &owner.instance)?;
        open_stream(client.job_logs(id.as_str(), after)).await
    }

    /// Opens the event stream of peer `instance` at `url`: its own events
    /// only, from now on.
    pub async fn events_at(&self, url: &str, instance: &str) -> Result<kici_api::Events, String> {
        let client = self.peer_client(url, instance)?;
        open_stream(client.local_events()).await
    }
}

fn no_url() -> String {
    "it advertises no URL (--advertise-url)".to_owned()
}

/// A peer's stream, once its answer's head arrived (within
/// [`PEER_READ_TIMEOUT`]).
async fn open_stream<T>(
    open: impl std::future::Future<Output = Result<T, kici_api::ApiError>>,
) -> Result<T, String> {
    tokio::time::timeout(PEER_READ_TIMEOUT, open)
        .await
        .map_err(|_| format!("no answer within {PEER_READ_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())
}

impl FleetHost {
    /// A client of peer `instance`'s control API at `url` (as it
    /// advertised it): TLS for `https`, every request signed for that
    /// peer with the fleet key, and no API token.
    fn peer_client(&self, url: &str, instance: &str) -> Result<kici_api::Client, String> {
        use super::auth::PeerTls;
        let client = match self.auth().tls() {
            PeerTls::Config(config) => kici_api::Client::with_tls(url, Arc::clone(config)),
            PeerTls::Unavailable(why) if url.starts_with("https://") => {
                return Err(why.clone());
            }
            PeerTls::Unavailable(_) => kici_api::Client::new(url),
        }
        .map_err(|e| e.to_string())?;
        Ok(client.with_signer(self.auth().signer_for(instance)))
    }
}

impl FleetHost {
    /// [`FleetHost::gather`], split: the answers, and the hosts that gave
    /// none (with why) — every live host when the fleet's hosts cannot be
    /// read at all (named `*`).
    pub async fn gather_reachable<T: DeserializeOwned>(
        &self,
        path: &str,
    ) -> (Vec<T>, Vec<kici_api::UnreachableHost>) {
        let mut answers = Vec::new();
        let mut unreachable = Vec::new();
        match self.gather::<T>(path).await {
            Ok(parts) => {
                for part in parts {
                    match part.answer {
                        Ok(answer) => answers.push(answer),
                        Err(reason) => unreachable.push(kici_api::UnreachableHost {
                            instance_id: part.instance,
                            url: part.url,
                            reason,
                        }),
                    }
                }
            }
            Err(e) => unreachable.push(kici_api::UnreachableHost {
                instance_id: "*".to_owned(),
                url: None,
                reason: format!("the fleet's hosts cannot be read: {e}"),
            }),
        }
        (answers, unreachable)
    }
}

async fn read_peer<T: DeserializeOwned>(
    client: &kici_api::Client,
    path: &str,
) -> Result<T, String> {
    let reply = tokio::time::timeout(PEER_READ_TIMEOUT, client.raw("GET", path, None))
        .await
        .map_err(|_| format!("no answer within {PEER_READ_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    if reply.status != 200 {
        return Err(format!(
            "answered {}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        ));
    }
    serde_json::from_slice(&reply.body).map_err(|e| format!("unreadable answer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_calls_about_one_agent_or_one_request_go_to_an_owner() {
        let agent = |p| owner_only(&Method::POST, p);
        assert_eq!(
            agent("/v1/agents/scaler-bare-metal-0a0b0c0d/registered"),
            Some(OwnedBy::Agent("scaler-bare-metal-0a0b0c0d".into()))
        );
        assert_eq!(
            owner_only(&Method::GET, "/v1/agents/a1"),
            Some(OwnedBy::Agent("a1".into()))
        );
        assert_eq!(owner_only(&Method::GET, "/v1/agents"), None);
        assert_eq!(owner_only(&Method::GET, "/v1/agents/"), None);
        assert_eq!(
            owner_only(&Method::DELETE, "/v1/scale/j-1"),
            Some(OwnedBy::Job("j-1".into()))
        );
        assert_eq!(owner_only(&Method::POST, "/v1/scale"), None);
        assert_eq!(
            owner_only(&Method::GET, "/v1/jobs/job-1"),
            Some(OwnedBy::Job("job-1".into()))
        );
        assert_eq!(
            owner_only(&Method::DELETE, "/v1/jobs/job-1"),
            Some(OwnedBy::Job("job-1".into()))
        );
        assert_eq!(owner_only(&Method::GET, "/v1/jobs/job-1/logs"), None);
        assert_eq!(owner_only(&Method::POST, "/v1/jobs"), None);
        assert_eq!(owner_only(&Method::GET, "/v1/status"), None);
    }

    #[test]
    fn the_fleet_signature_opens_only_the_calls_hosts_make_on_each_other() {
        let peer = |m: Method, p: &str, q: Option<&str>| peer_route(&m, p, q);
        assert!(peer(Method::POST, "/v1/agents/a1/registered", None));
        assert!(peer(Method::DELETE, "/v1/jobs/j1", None));
        assert!(peer(Method::GET, "/v1/jobs/j1/logs", None));
        assert!(peer(Method::GET, "/v1/status", Some("local=true")));
        assert!(peer(Method::GET, "/v1/agents", Some("all=true&local=true")));
        assert!(peer(Method::GET, "/v1/events", Some("local=true")));
        // Operator calls stay behind the API token.
        assert!(!peer(Method::GET, "/v1/status", None));
        assert!(!peer(Method::GET, "/v1/status", Some("local=false")));
        assert!(!peer(Method::POST, "/v1/reload", None));
        assert!(!peer(Method::POST, "/v1/scale", None));
        assert!(!peer(Method::POST, "/v1/jobs", None));
        assert!(!peer(Method::POST, "/v1/scalers/local/drain", None));
        assert!(!peer(Method::GET, "/v1/fleet", Some("local=true")));
        assert!(!peer(Method::GET, "/metrics", Some("local=true")));
        assert!(!peer(Method::POST, "/v1/jobs/j1/logs", None));
    }
}
