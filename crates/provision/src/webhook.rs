//! One attempt of a `webhook` delivery: `POST` the event JSON to the URL,
//! signed (see [`crate::signature`]), within a bound covering DNS, connect,
//! TLS, the request and the response head. A 2xx answer is delivered;
//! anything else — another status, a refused connection, the bound — is a
//! failed attempt. Up to [`RESPONSE_EXCERPT_LIMIT`] bytes of a refusing
//! answer's body are kept for the log.
//!
//! Each attempt is signed with the time it is sent, so a retry after a long
//! backoff is still inside a receiver's replay window.
//!
//! `https://` URLs are served with rustls, trusting the system's root
//! certificates (or `SSL_CERT_FILE`/`SSL_CERT_DIR`), see [`WebhookTls`].

use crate::signature::{sign, EVENT_HEADER, REQUEST_ID_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use kici_model::Secret;
use rustls::pki_types::{CertificateDer, ServerName};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// The certificates an `https` webhook's server is verified against.
#[derive(Clone)]
pub struct WebhookTls {
    config: Arc<rustls::ClientConfig>,
}

impl fmt::Debug for WebhookTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookTls")
    }
}

/// No usable TLS client configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsSetupError {
    #[error("no trusted root certificates found on this system ({0})")]
    NoRoots(String),
    #[error("TLS client configuration: {0}")]
    Config(String),
}

impl WebhookTls {
    /// The system's roots (`SSL_CERT_FILE`/`SSL_CERT_DIR` when set).
    pub fn system_roots() -> Result<Self, TlsSetupError> {
        let loaded = rustls_native_certs::load_native_certs();
        if loaded.certs.is_empty() {
            let why = loaded
                .errors
                .first()
                .map(|e| e.to_string())
                .unwrap_or_else(|| "the certificate store is empty".to_owned());
            return Err(TlsSetupError::NoRoots(why));
        }
        Self::with_roots(loaded.certs)
    }

    /// Exactly these roots (a private CA, a test's self-signed certificate).
    /// Certificates rustls cannot parse are skipped; none usable is an error.
    pub fn with_roots(
        roots: impl IntoIterator<Item = CertificateDer<'static>>,
    ) -> Result<Self, TlsSetupError> {
        let mut store = rustls::RootCertStore::empty();
        let (_added, _skipped) = store.add_parsable_certificates(roots);
        if store.is_empty() {
            return Err(TlsSetupError::NoRoots(
                "no parsable root certificate".to_owned(),
            ));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsSetupError::Config(e.to_string()))?
            .with_root_certificates(store)
            .with_no_client_auth();
        Ok(Self {
            config: Arc::new(config),
        })
    }
}

/// Bytes of a non-2xx answer's body kept for the log.
pub const RESPONSE_EXCERPT_LIMIT: usize = 4096;

/// What the request says about the event besides its body.
#[derive(Debug, Clone, Copy)]
pub struct EventHeaders<'a> {
    pub event: &'a str,
    pub request_id: &'a str,
}

/// How one attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WebhookEnd {
    /// The receiver answered with this status (2xx = delivered) and body
    /// excerpt.
    Answered { status: u16, body: String },
    /// No answer: DNS, connect, TLS or protocol failure.
    Failed(String),
    /// The bound passed.
    TimedOut,
}

impl WebhookEnd {
    pub fn delivered(&self) -> bool {
        matches!(self, Self::Answered { status, .. } if (200..300).contains(status))
    }
}

impl fmt::Display for WebhookEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Answered { status, body } if body.is_empty() => write!(f, "answered {status}"),
            Self::Answered { status, body } => write!(f, "answered {status}: {body}"),
            Self::Failed(e) => write!(f, "no answer: {e}"),
            Self::TimedOut => f.write_str("no answer within the timeout"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error("the URL has no host")]
    NoHost,
    #[error("connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("https URL but no TLS configuration")]
    NoTls,
    #[error("TLS with {host}: {source}")]
    Tls {
        host: String,
        source: std::io::Error,
    },
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("request: {0}")]
    Request(#[from] hyper::http::Error),
}

/// Posts `body` to `url` once (`tls` is needed for an `https` URL).
pub async fn post_once(
    url: &url::Url,
    tls: Option<&WebhookTls>,
    secret: &Secret,
    body: &[u8],
    headers: EventHeaders<'_>,
    timeout: Duration,
) -> WebhookEnd {
    match tokio::time::timeout(timeout, exchange(url, tls, secret, body, headers)).await {
        Ok(Ok((status, body))) => WebhookEnd::Answered { status, body },
        Ok(Err(e)) => WebhookEnd::Failed(e.to_string()),
        Err(_) => WebhookEnd::TimedOut,
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn exchange(
    url: &url::Url,
    tls: Option<&WebhookTls>,
    secret: &Secret,
    body: &[u8],
    headers: EventHeaders<'_>,
) -> Result<(u16, String), AttemptError> {
    let host = url.host_str().ok_or(AttemptError::NoHost)?;
    let port = url.port_or_known_default().ok_or(AttemptError::NoHost)?;
    // `host_str` keeps IPv6 brackets; connect and SNI want the bare address.
    let bare_host = host.trim_start_matches('[').trim_end_matches(']');
    let stream = TcpStream::connect((bare_host, port))
        .await
        .map_err(|source| AttemptError::Connect {
            addr: format!("{host}:{port}"),
            source,
        })?;
    if url.scheme() != "https" {
        return send(stream, url, host, secret, body, headers).await;
    }
    let tls = tls.ok_or(AttemptError::NoTls)?;
    let tls_err = |source: std::io::Error| AttemptError::Tls {
        host: host.to_owned(),
        source,
    };
    let name = ServerName::try_from(bare_host.to_owned())
        .map_err(|e| tls_err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    let stream = tokio_rustls::TlsConnector::from(tls.config.clone())
        .connect(name, stream)
        .await
        .map_err(tls_err)?;
    send(stream, url, host, secret, body, headers).await
}

/// The HTTP/1.1 exchange over an established connection.
async fn send<I>(
    io: I,
    url: &url::Url,
    host: &str,
    secret: &Secret,
    body: &[u8],
    headers: EventHeaders<'_>,
) -> Result<(u16, String), AttemptError>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let conn = tokio::spawn(conn);

    let timestamp = unix_now();
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
        .header(
            hyper::header::USER_AGENT,
            concat!("kici-scaler/", env!("CARGO_PKG_VERSION")),
        )
        .header(TIMESTAMP_HEADER, timestamp.to_string())
        .header(
            SIGNATURE_HEADER,
            sign(secret.expose().as_bytes(), timestamp, body),
        )
        .header(EVENT_HEADER, headers.event)
        .header(REQUEST_ID_HEADER, headers.request_id)
        .body(Full::new(Bytes::copy_from_slice(body)))?;
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let excerpt = if (200..300).contains(&status) {
        String::new()
    } else {
        // A refusal's body says why; read a bounded excerpt, best effort.
        match Limited::new(response.into_body(), RESPONSE_EXCERPT_LIMIT)
            .collect()
            .await
        {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(_) => "[body unreadable or over the excerpt limit]".to_owned(),
        }
    };
    conn.abort();
    Ok((status, excerpt))
}
