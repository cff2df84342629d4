//! The typed async client (feature `client`): one HTTP/1.1 request per
//! call, over TCP (`http://`), TLS (`https://`, with the caller's rustls
//! configuration) or a unix socket (`unix:/path`), with an optional bearer
//! token.
//!
//! Every method sends the typed body and reads the typed answer; an error
//! answer is an [`ApiError::Api`] whose [`ErrorCode`] the caller can match
//! on.

use crate::agents::{
    AgentList, AgentObject, JobCompleteBody, JobStartedBody, RegisteredBody, RegistrationAnswer,
};
use crate::error::{ErrorCode, ErrorDetail};
use crate::events::StreamEvent;
use crate::jobs::{JobAccepted, JobBody, JobList, JobLogEvent, JobView};
use crate::routes::path_segment;
use crate::scale::{ScaleAnswer, ScaleBody};
use crate::sse::{SseEvent, SseParser};
use crate::status::{Health, Readiness, ReloadAnswer, StatusObject};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The server address is not `http://HOST[:PORT]`, `https://HOST[:PORT]`
    /// or `unix:/path`.
    #[error("{0:?}: expected http://HOST[:PORT], https://HOST[:PORT] or unix:/path")]
    BadServer(String),
    /// An `https://` server without a TLS configuration.
    #[error("{0}: https needs a TLS configuration trusting the daemon's certificate")]
    NoTls(String),
    #[error("cannot connect to {server}: {source}")]
    Connect {
        server: String,
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed (connection reset, not HTTP, ...).
    #[error("talking to {server}: {message}")]
    Http { server: String, message: String },
    /// The daemon answered with an error.
    #[error("{0}")]
    Api(Box<ErrorAnswer>),
    /// A request body could not be encoded as JSON (a map with non-string
    /// keys, a NaN).
    #[error("cannot encode the request body: {0}")]
    Encode(#[source] serde_json::Error),
    /// The daemon answered something this client cannot read.
    #[error("unexpected answer (HTTP {status}): {body}")]
    Unexpected { status: u16, body: String },
}

impl ApiError {
    /// The daemon's error code, for an error answer.
    pub fn code(&self) -> Option<&ErrorCode> {
        match self {
            Self::Api(a) => Some(&a.error.code),
            _ => None,
        }
    }

    /// The error answer, if the daemon gave one.
    pub fn answer(&self) -> Option<&ErrorAnswer> {
        match self {
            Self::Api(a) => Some(a),
            _ => None,
        }
    }
}

/// An error answer: its HTTP status and the error document.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorAnswer {
    pub status: u16,
    pub error: ErrorDetail,
    /// `POST /v1/reload`: every configuration error (empty otherwise).
    pub errors: Vec<String>,
    /// The document as the daemon sent it.
    pub document: serde_json::Value,
}

impl fmt::Display for ErrorAnswer {
    /// `<code>: <message> (field: <path>)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.error.code, self.error.message)?;
        if let Some(field) = &self.error.field {
            write!(f, " (field: {field})")?;
        }
        Ok(())
    }
}

/// Any error document (`errors` only on a refused reload).
#[derive(Deserialize)]
struct AnyErrorBody {
    error: ErrorDetail,
    #[serde(default)]
    errors: Vec<String>,
}

/// Headers computed for each request from what it sends: a request
/// signature (what fleet hosts authenticate each other with) instead of,
/// or beside, a bearer token.
pub trait RequestSigner: Send + Sync {
    /// The headers to add to `method path` (path with its query) sending
    /// `body` (empty when there is none).
    fn headers(&self, method: &str, path: &str, body: &[u8]) -> Vec<(String, String)>;
}

/// A raw answer: status and body.
#[derive(Debug, Clone)]
pub struct RawReply {
    pub status: u16,
    pub body: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Tcp { host: String, port: u16 },
    Tls { host: String, port: u16 },
    Unix(PathBuf),
}

fn parse_server(server: &str) -> Result<Target, ApiError> {
    let bad = || ApiError::BadServer(server.to_owned());
    if let Some(path) = server.strip_prefix("unix:") {
        if path.is_empty() {
            return Err(bad());
        }
        return Ok(Target::Unix(PathBuf::from(path)));
    }
    let (tls, rest) = if let Some(rest) = server.strip_prefix("http://") {
        (false, rest)
    } else if let Some(rest) = server.strip_prefix("https://") {
        (true, rest)
    } else {
        return Err(bad());
    };
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        return Err(bad());
    }
    let default_port = if tls { 443 } else { 80 };
    let (host, port) = match authority.rsplit_once(':') {
        // `[::1]:7878`, `host:7878`; a bare IPv6 `[::1]` has no port.
        Some((h, p)) if !p.contains(']') => (h, p.parse::<u16>().map_err(|_| bad())?),
        _ => (authority, default_port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    let host = host.to_owned();
    Ok(if tls {
        Target::Tls { host, port }
    } else {
        Target::Tcp { host, port }
    })
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A client for one daemon.
///
/// ```no_run
/// # async fn demo() -> Result<(), kici_api::ApiError> {
/// use kici_api::{Client, ScaleAnswer, ScaleBody};
/// let client = Client::new("http://127.0.0.1:7878")?.with_token("secret");
/// let body = ScaleBody {
///     job_id: "job-1".into(),
///     labels: vec!["linux".into()],
///     ..ScaleBody::default()
/// };
/// match client.scale(&body).await? {
///     ScaleAnswer::Spawning { agent_id, .. } => println!("spawning {agent_id}"),
///     other => println!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    server: String,
    target: Target,
    tls: Option<tokio_rustls::TlsConnector>,
    token: Option<String>,
    signer: Option<Arc<dyn RequestSigner>>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("server", &self.server)
            .field("tls", &self.tls.is_some())
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("signed", &self.signer.is_some())
            .finish()
    }
}

impl Client {
    /// A client for `server` (`http://HOST[:PORT]`, `https://HOST[:PORT]`
    /// or `unix:/path`); `https://` needs [`Client::with_tls`].
    pub fn new(server: &str) -> Result<Self, ApiError> {
        let target = parse_server(server)?;
        if matches!(target, Target::Tls { .. }) {
            return Err(ApiError::NoTls(server.to_owned()));
        }
        Ok(Self {
            server: server.to_owned(),
            target,
            tls: None,
            token: None,
            signer: None,
        })
    }

    /// A client for `server` that speaks TLS with `config` for an
    /// `https://` server (the configuration decides which certificates are
    /// trusted; ALPN `http/1.1` is what the daemon offers).
    pub fn with_tls(server: &str, config: Arc<rustls::ClientConfig>) -> Result<Self, ApiError> {
        let target = parse_server(server)?;
        Ok(Self {
            server: server.to_owned(),
            target,
            tls: Some(tokio_rustls::TlsConnector::from(config)),
            token: None,
            signer: None,
        })
    }

    /// Sends `Authorization: Bearer <token>` with every request (the
    /// daemon's `KICI_SCALER_API_TOKEN`).
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Adds the headers `signer` computes to every request (after the
    /// token, if any).
    pub fn with_signer(mut self, signer: Arc<dyn RequestSigner>) -> Self {
        self.signer = Some(signer);
        self
    }

    /// The server address this client talks to.
    pub fn server(&self) -> &str {
        &self.server
    }

    // ------------------------------------------------------------ scale

    /// `POST /v1/scale`.
    pub async fn scale(&self, body: &ScaleBody) -> Result<ScaleAnswer, ApiError> {
        self.call(Method::POST, "/v1/scale", Some(body)).await
    }

    /// `DELETE /v1/scale/{jobId}`.
    pub async fn cancel_scale(&self, job_id: &str) -> Result<(), ApiError> {
        let path = format!("/v1/scale/{}", path_segment(job_id));
        self.call_empty(Method::DELETE, &path, None::<&()>).await
    }

    // ------------------------------------------------------------- jobs

    /// `POST /v1/jobs`.
    pub async fn submit_job(&self, body: &JobBody) -> Result<JobAccepted, ApiError> {
        self.call(Method::POST, "/v1/jobs", Some(body)).await
    }

    /// `GET /v1/jobs/{id}`.
    pub async fn job(&self, id: &str) -> Result<JobView, ApiError> {
        let path = format!("/v1/jobs/{}", path_segment(id));
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// `GET /v1/jobs`: the answering host's jobs.
    pub async fn jobs(&self) -> Result<JobList, ApiError> {
        self.call(Method::GET, "/v1/jobs", None::<&()>).await
    }

    /// `DELETE /v1/jobs/{id}`: the job's state after the cancel.
    pub async fn cancel_job(&self, id: &str) -> Result<JobAccepted, ApiError> {
        let path = format!("/v1/jobs/{}", path_segment(id));
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    /// `GET /v1/jobs/{id}/logs`: the job's output from the start (or after
    /// chunk `after`), then its end.
    pub async fn job_logs(&self, id: &str, after: Option<u64>) -> Result<JobLogs, ApiError> {
        let path = format!("/v1/jobs/{}/logs", path_segment(id));
        let stream = self.open_stream(&path, after).await?;
        Ok(JobLogs { stream })
    }

    // ----------------------------------------------------------- agents

    /// `GET /v1/agents` (`all`: also the recently gone ones).
    pub async fn agents(&self, all: bool) -> Result<AgentList, ApiError> {
        let path = if all {
            "/v1/agents?all=true"
        } else {
            "/v1/agents"
        };
        self.call(Method::GET, path, None::<&()>).await
    }

    /// `GET /v1/agents?local=true` (`all`: also the recently gone ones): in
    /// a fleet, the answering host's agents only (what a host gathers into
    /// its fleet-wide list).
    pub async fn local_agents(&self, all: bool) -> Result<AgentList, ApiError> {
        let path = if all {
            "/v1/agents?all=true&local=true"
        } else {
            "/v1/agents?local=true"
        };
        self.call(Method::GET, path, None::<&()>).await
    }

    /// `GET /v1/agents/{id}`.
    pub async fn agent(&self, id: &str) -> Result<AgentObject, ApiError> {
        let path = format!("/v1/agents/{}", path_segment(id));
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// `DELETE /v1/agents/{id}`: destroy the agent now.
    pub async fn destroy_agent(&self, id: &str) -> Result<(), ApiError> {
        let path = format!("/v1/agents/{}", path_segment(id));
        self.call_empty(Method::DELETE, &path, None::<&()>).await
    }

    /// `POST /v1/agents/{id}/registered`.
    pub async fn registered(
        &self,
        id: &str,
        body: &RegisteredBody,
    ) -> Result<RegistrationAnswer, ApiError> {
        let path = format!("/v1/agents/{}/registered", path_segment(id));
        self.call(Method::POST, &path, Some(body)).await
    }

    /// `POST /v1/agents/{id}/config-ack`.
    pub async fn config_ack(&self, id: &str) -> Result<(), ApiError> {
        let path = format!("/v1/agents/{}/config-ack", path_segment(id));
        self.call_empty(Method::POST, &path, None::<&()>).await
    }

    /// `POST /v1/agents/{id}/job-started`.
    pub async fn job_started(&self, id: &str, body: &JobStartedBody) -> Result<(), ApiError> {
        let path = format!("/v1/agents/{}/job-started", path_segment(id));
        self.call_empty(Method::POST, &path, Some(body)).await
    }

    /// `POST /v1/agents/{id}/job-complete`.
    pub async fn job_complete(&self, id: &str, body: &JobCompleteBody) -> Result<(), ApiError> {
        let path = format!("/v1/agents/{}/job-complete", path_segment(id));
        self.call_empty(Method::POST, &path, Some(body)).await
    }

    /// `POST /v1/agents/{id}/disconnected`.
    pub async fn disconnected(&self, id: &str) -> Result<(), ApiError> {
        let path = format!("/v1/agents/{}/disconnected", path_segment(id));
        self.call_empty(Method::POST, &path, None::<&()>).await
    }

    // ---------------------------------------------------------- scalers

    /// `POST /v1/scalers/{name}/cordon`.
    pub async fn cordon(&self, scaler: &str) -> Result<(), ApiError> {
        self.scaler_switch(scaler, "cordon").await
    }

    /// `POST /v1/scalers/{name}/uncordon`.
    pub async fn uncordon(&self, scaler: &str) -> Result<(), ApiError> {
        self.scaler_switch(scaler, "uncordon").await
    }

    /// `POST /v1/scalers/{name}/drain`.
    pub async fn drain(&self, scaler: &str) -> Result<(), ApiError> {
        self.scaler_switch(scaler, "drain").await
    }

    async fn scaler_switch(&self, scaler: &str, verb: &str) -> Result<(), ApiError> {
        let path = format!("/v1/scalers/{}/{verb}", path_segment(scaler));
        self.call_empty(Method::POST, &path, None::<&()>).await
    }

    // ------------------------------------------------------- operations

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<StatusObject, ApiError> {
        self.call(Method::GET, "/v1/status", None::<&()>).await
    }

    /// `GET /v1/status?local=true`: in a fleet, the answering host's status
    /// only (what a host gathers under `hosts`).
    pub async fn local_status(&self) -> Result<StatusObject, ApiError> {
        self.call(Method::GET, "/v1/status?local=true", None::<&()>)
            .await
    }

    /// `GET /v1/fleet` (a host of a fleet only).
    pub async fn fleet(&self) -> Result<crate::FleetObject, ApiError> {
        self.call(Method::GET, "/v1/fleet", None::<&()>).await
    }

    /// `POST /v1/reload`; a refused configuration is an [`ApiError::Api`]
    /// with code [`ErrorCode::InvalidConfig`] and every error in
    /// [`ErrorAnswer::errors`].
    pub async fn reload(&self) -> Result<ReloadAnswer, ApiError> {
        self.call(Method::POST, "/v1/reload", None::<&()>).await
    }

    /// `GET /v1/events`: from now on, or after event `last_event_id`.
    pub async fn events(&self, last_event_id: Option<u64>) -> Result<Events, ApiError> {
        let stream = self.open_stream("/v1/events", last_event_id).await?;
        Ok(Events { stream })
    }

    /// `GET /v1/events?local=true`: in a fleet, this host's events only
    /// (what a host relays into its fleet-wide stream), from now on.
    pub async fn local_events(&self) -> Result<Events, ApiError> {
        let stream = self.open_stream("/v1/events?local=true", None).await?;
        Ok(Events { stream })
    }

    /// `GET /healthz`.
    pub async fn healthz(&self) -> Result<Health, ApiError> {
        self.call(Method::GET, "/healthz", None::<&()>).await
    }

    /// `GET /readyz`: ready or not (a 503 is an answer here, not an error).
    pub async fn readyz(&self) -> Result<Readiness, ApiError> {
        let reply = self.send(Method::GET, "/readyz", None, None).await?;
        match reply.status {
            200 | 503 => decode(&reply),
            _ => Err(error_of(&reply)),
        }
    }

    /// `GET /metrics`: the Prometheus text exposition.
    pub async fn metrics(&self) -> Result<String, ApiError> {
        let reply = self.send(Method::GET, "/metrics", None, None).await?;
        if !(200..300).contains(&reply.status) {
            return Err(error_of(&reply));
        }
        Ok(String::from_utf8_lossy(&reply.body).into_owned())
    }

    /// `GET /openapi.json`: the OpenAPI document.
    pub async fn openapi(&self) -> Result<serde_json::Value, ApiError> {
        self.call(Method::GET, "/openapi.json", None::<&()>).await
    }

    // -------------------------------------------------------- transport

    /// Any request, answered as it came: `method` (`GET`, `POST`, ...),
    /// `path` with its query, `json` sent as `application/json`.
    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        json: Option<Vec<u8>>,
    ) -> Result<RawReply, ApiError> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|e| self.http_error(format!("method {method:?}: {e}")))?;
        self.send(method, path, json.map(Bytes::from), None).await
    }

    async fn call<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ApiError> {
        let reply = self.send(method, path, encode(body)?, None).await?;
        if !(200..300).contains(&reply.status) {
            return Err(error_of(&reply));
        }
        decode(&reply)
    }

    async fn call_empty<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(), ApiError> {
        let reply = self.send(method, path, encode(body)?, None).await?;
        if !(200..300).contains(&reply.status) {
            return Err(error_of(&reply));
        }
        Ok(())
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        last_event_id: Option<u64>,
    ) -> Result<RawReply, ApiError> {
        let open = self.open(method, path, body, last_event_id).await?;
        let status = open.status;
        let body = open.collect().await.map_err(|e| self.http_error(e))?;
        Ok(RawReply { status, body })
    }

    async fn open_stream(&self, path: &str, after: Option<u64>) -> Result<Sse, ApiError> {
        let open = self.open(Method::GET, path, None, after).await?;
        if open.status != 200 {
            let status = open.status;
            let body = open.collect().await.map_err(|e| self.http_error(e))?;
            return Err(error_of(&RawReply { status, body }));
        }
        Ok(Sse {
            open,
            parser: SseParser::default(),
            queued: VecDeque::new(),
            server: self.server.clone(),
        })
    }

    fn http_error(&self, message: String) -> ApiError {
        ApiError::Http {
            server: self.server.clone(),
            message,
        }
    }

    async fn connect(&self) -> Result<Box<dyn Io>, ApiError> {
        let err = |source| ApiError::Connect {
            server: self.server.clone(),
            source,
        };
        match &self.target {
            Target::Unix(path) => Ok(Box::new(UnixStream::connect(path).await.map_err(err)?)),
            Target::Tcp { host, port } => Ok(Box::new(
                TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(err)?,
            )),
            Target::Tls { host, port } => {
                let connector = self
                    .tls
                    .as_ref()
                    .ok_or_else(|| ApiError::NoTls(self.server.clone()))?;
                let tcp = TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(err)?;
                let name = rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| err(std::io::Error::other(e)))?;
                Ok(Box::new(connector.connect(name, tcp).await.map_err(err)?))
            }
        }
    }

    fn host_header(&self) -> String {
        match &self.target {
            Target::Unix(_) => "localhost".to_owned(),
            Target::Tcp { host, port } | Target::Tls { host, port } => {
                if host.contains(':') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                }
            }
        }
    }

    /// Sends one request and returns as soon as the answer's head arrived.
    async fn open(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        last_event_id: Option<u64>,
    ) -> Result<Open, ApiError> {
        let io = self.connect().await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| self.http_error(e.to_string()))?;
        let conn = tokio::spawn(conn);
        let signed = self
            .signer
            .as_ref()
            .map(|s| s.headers(method.as_str(), path, body.as_deref().unwrap_or_default()));
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, self.host_header());
        if let Some(token) = &self.token {
            builder = builder.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        for (name, value) in signed.into_iter().flatten() {
            builder = builder.header(name, value);
        }
        if let Some(id) = last_event_id {
            builder = builder.header("last-event-id", id.to_string());
        }
        let payload = match body {
            Some(b) => {
                builder = builder.header(hyper::header::CONTENT_TYPE, "application/json");
                b
            }
            None => Bytes::new(),
        };
        let request = builder
            .body(Full::new(payload))
            .map_err(|e| self.http_error(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| self.http_error(e.to_string()))?;
        Ok(Open {
            status: response.status().as_u16(),
            body: response.into_body(),
            conn,
        })
    }
}

fn encode<B: Serialize + ?Sized>(body: Option<&B>) -> Result<Option<Bytes>, ApiError> {
    body.map(|b| {
        serde_json::to_vec(b)
            .map(Bytes::from)
            .map_err(ApiError::Encode)
    })
    .transpose()
}

fn decode<T: DeserializeOwned>(reply: &RawReply) -> Result<T, ApiError> {
    serde_json::from_slice(&reply.body).map_err(|e| ApiError::Unexpected {
        status: reply.status,
        body: format!("{e}: {}", String::from_utf8_lossy(&reply.body)),
    })
}

/// The error an answer that is not a success stands for.
fn error_of(reply: &RawReply) -> ApiError {
    let document = serde_json::from_slice::<serde_json::Value>(&reply.body).ok();
    let parsed = document
        .as_ref()
        .and_then(|d| AnyErrorBody::deserialize(d).ok());
    match (document, parsed) {
        (Some(document), Some(body)) => ApiError::Api(Box::new(ErrorAnswer {
            status: reply.status,
            error: body.error,
            errors: body.errors,
            document,
        })),
        _ => ApiError::Unexpected {
            status: reply.status,
            body: String::from_utf8_lossy(&reply.body).into_owned(),
        },
    }
}

/// An answer whose body is still arriving.
struct Open {
    status: u16,
    body: hyper::body::Incoming,
    conn: tokio::task::JoinHandle<Result<(), hyper::Error>>,
}

impl Open {
    /// The next piece of the body; `None` at its end.
    async fn next_bytes(&mut self) -> Option<Result<Bytes, String>> {
        loop {
            match self.body.frame().await? {
                Ok(frame) => match frame.into_data() {
                    Ok(data) => return Some(Ok(data)),
                    // Trailers: nothing for us.
                    Err(_) => continue,
                },
                Err(e) => return Some(Err(e.to_string())),
            }
        }
    }

    /// The whole (remaining) body.
    async fn collect(mut self) -> Result<Bytes, String> {
        let mut bytes = Vec::new();
        while let Some(piece) = self.next_bytes().await {
            bytes.extend_from_slice(&piece?);
        }
        // Dropping `self` ends the connection task.
        Ok(Bytes::from(bytes))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        // The connection task ends with the connection; a stream dropped
        // before its end must not keep it open.
        self.conn.abort();
    }
}

/// An SSE answer, event by event.
struct Sse {
    open: Open,
    parser: SseParser,
    queued: VecDeque<SseEvent>,
    server: String,
}

impl Sse {
    /// The next SSE event; `None` when the stream ended.
    async fn next(&mut self) -> Option<Result<SseEvent, ApiError>> {
        loop {
            if let Some(e) = self.queued.pop_front() {
                return Some(Ok(e));
            }
            match self.open.next_bytes().await? {
                Ok(bytes) => self.queued.extend(self.parser.feed(&bytes)),
                Err(message) => {
                    return Some(Err(ApiError::Http {
                        server: self.server.clone(),
                        message,
                    }))
                }
            }
        }
    }
}

fn unreadable(event: &SseEvent, e: serde_json::Error) -> ApiError {
    ApiError::Unexpected {
        status: 200,
        body: format!("unreadable {} event ({e}): {}", event.event, event.data),
    }
}

/// `GET /v1/jobs/{id}/logs`, event by event.
pub struct JobLogs {
    stream: Sse,
}

impl JobLogs {
    /// The next event; `None` when the stream ended (after
    /// [`JobLogEvent::End`], or when the daemon closed it).
    pub async fn next(&mut self) -> Option<Result<JobLogEvent, ApiError>> {
        loop {
            let event = match self.stream.next().await? {
                Ok(e) => e,
                Err(e) => return Some(Err(e)),
            };
            match JobLogEvent::from_sse(&event.event, event.id, &event.data) {
                Ok(Some(e)) => return Some(Ok(e)),
                Ok(None) => continue,
                Err(e) => return Some(Err(unreadable(&event, e))),
            }
        }
    }
}

/// `GET /v1/events`, event by event.
pub struct Events {
    stream: Sse,
}

impl Events {
    /// The next event; `None` when the daemon closed the stream.
    pub async fn next(&mut self) -> Option<Result<StreamEvent, ApiError>> {
        loop {
            let event = match self.stream.next().await? {
                Ok(e) => e,
                Err(e) => return Some(Err(e)),
            };
            match StreamEvent::from_sse(&event.event, event.id, &event.data) {
                Ok(Some(e)) => return Some(Ok(e)),
                Ok(None) => continue,
                Err(e) => return Some(Err(unreadable(&event, e))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn server_urls() {
        assert_eq!(
            parse_server("http://127.0.0.1:7878").unwrap(),
            Target::Tcp {
                host: "127.0.0.1".into(),
                port: 7878
            }
        );
        assert_eq!(
            parse_server("https://example.test/").unwrap(),
            Target::Tls {
                host: "example.test".into(),
                port: 443
            }
        );
        assert_eq!(
            parse_server("http://[::1]:9").unwrap(),
            Target::Tcp {
                host: "::1".into(),
                port: 9
            }
        );
        assert_eq!(
            parse_server("unix:/run/k.sock").unwrap(),
            Target::Unix("/run/k.sock".into())
        );
        for bad in [
            "127.0.0.1:7878",
            "http://",
            "http://h:x",
            "unix:",
            "ftp://h",
            "http://h/v1",
        ] {
            assert!(parse_server(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            Client::new("https://h:1"),
            Err(ApiError::NoTls(_))
        ));
    }

    #[test]
    fn error_answers_carry_their_code_and_document() {
        let reply = RawReply {
            status: 422,
            body: Bytes::from_static(
                br#"{"error":{"code":"invalid-config","message":"refused","field":null},"errors":["a","b"]}"#,
            ),
        };
        let e = error_of(&reply);
        assert_eq!(e.code(), Some(&ErrorCode::InvalidConfig));
        let answer = e.answer().unwrap();
        assert_eq!(answer.errors, ["a", "b"]);
        assert_eq!(answer.document["errors"][1], "b");
        assert_eq!(e.to_string(), "invalid-config: refused");
        let plain = error_of(&RawReply {
            status: 502,
            body: Bytes::from_static(b"bad gateway"),
        });
        assert!(matches!(plain, ApiError::Unexpected { status: 502, .. }));
    }

    #[test]
    fn the_token_is_not_in_debug_output() {
        let c = Client::new("http://127.0.0.1:1")
            .unwrap()
            .with_token("s3cret");
        assert!(!format!("{c:?}").contains("s3cret"));
    }
}
