//! Calls to the other hosts of the fleet: a call only the owner of an
//! agent or a request can carry out — one agent's view and reports,
//! destroying it, cancelling a request it holds — made on the owner
//! ([`FleetHost::owner_of`]), fleet-wide reads, and the streams a host
//! relays. Which calls those are is a property of the control API's route
//! table (`kici_api::ROUTES`, [`kici_api::PeerCall`]); deciding when to
//! carry a call is the fleet service's ([`crate::service::fleet`]).
//!
//! Every peer call goes to the URL the peer advertised (read from the
//! fleet's database), with the typed client, over TLS when it is `https`
//! (verified as [`super::auth::peer_tls`] says), signed with the fleet key
//! ([`super::auth`]) — never with the operator's API token, which a
//! database writer could otherwise collect by rewriting a URL.
//!
//! Fleet-wide reads ([`FleetHost::gather`]) ask every other live host for
//! its own part (`local=true`, so a peer never fans out again) at once, each
//! within [`PEER_READ_TIMEOUT`]; a host that does not answer is named in
//! the reply instead of failing it.

use super::FleetHost;
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

/// The live host that owns an agent or a request, ready to be called.
pub struct Owner {
    /// Its instance id.
    pub instance: String,
    /// The URL it advertised.
    pub url: String,
    /// Its client: signed for it with the fleet key.
    pub client: kici_api::Client,
}

impl Owner {
    /// Why a call to it failed.
    pub fn unreachable(&self, reason: String) -> PeerError {
        PeerError::Unreachable {
            instance: self.instance.clone(),
            url: self.url.clone(),
            reason,
        }
    }
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
    /// The live host other than this one that owns `what` (`id`), if one
    /// does.
    pub async fn owner_of(
        &self,
        what: kici_api::Owned,
        id: &str,
    ) -> Result<Option<Owner>, PeerError> {
        let queue = self.queue();
        let owner = match what {
            kici_api::Owned::Agent => queue.agent_owner(id).await?,
            kici_api::Owned::Job => queue.job_owner(id).await?,
        };
        let Some(owner) = owner.filter(|o| o.instance != self.instance().to_string()) else {
            return Ok(None);
        };
        let Some(url) = owner.url else {
            return Err(PeerError::NoUrl {
                instance: owner.instance,
            });
        };
        let client =
            self.peer_client(&url, &owner.instance)
                .map_err(|reason| PeerError::Unreachable {
                    instance: owner.instance.clone(),
                    url: url.clone(),
                    reason,
                })?;
        Ok(Some(Owner {
            instance: owner.instance,
            url,
            client,
        }))
    }
}

impl FleetHost {
    /// `read` (a typed call of a host's own part: `local=true`) on every
    /// other live (`up` or `leaving`) host of the fleet, concurrently, each
    /// within [`PEER_READ_TIMEOUT`]. Fails only when the fleet's hosts
    /// cannot be read.
    pub async fn gather<T, F, Fut>(
        &self,
        read: F,
    ) -> Result<Vec<PeerPart<T>>, kici_fleet::FleetError>
    where
        F: Fn(kici_api::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, kici_api::ApiError>>,
    {
        let read = &read;
        let asks = self.live_peers().await?.into_iter().map(|h| async move {
            let answer = match &h.url {
                None => Err(no_url()),
                Some(url) => match self.peer_client(url, &h.instance_id) {
                    Ok(client) => read_peer(read(client)).await,
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
    pub async fn gather_reachable<T, F, Fut>(
        &self,
        read: F,
    ) -> (Vec<T>, Vec<kici_api::UnreachableHost>)
    where
        F: Fn(kici_api::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, kici_api::ApiError>>,
    {
        let mut answers = Vec::new();
        let mut unreachable = Vec::new();
        match self.gather(read).await {
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

/// A peer's answer to a read, within [`PEER_READ_TIMEOUT`].
async fn read_peer<T>(
    read: impl std::future::Future<Output = Result<T, kici_api::ApiError>>,
) -> Result<T, String> {
    tokio::time::timeout(PEER_READ_TIMEOUT, read)
        .await
        .map_err(|_| format!("no answer within {PEER_READ_TIMEOUT:?}"))?
        .map_err(|e| match e {
            kici_api::ApiError::Api(answer) => {
                format!("answered {}: {}", answer.status, answer.document)
            }
            e => e.to_string(),
        })
}
