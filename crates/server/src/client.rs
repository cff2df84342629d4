//! The CLI's client for the control API: one HTTP/1.1 request per call over
//! TCP (`http://`), TLS (`https://`, trusting `--ca-cert`) or a unix socket
//! (`unix:/path`), with the bearer token from `KICI_SCALER_API_TOKEN`.

use crate::token::Secret;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

/// The default `--server`.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7878";

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--server {0:?}: expected http://HOST[:PORT], https://HOST[:PORT] or unix:/path")]
    BadServer(String),
    #[error(
        "--server {0}: https needs --ca-cert FILE (the CA that signed the daemon's certificate)"
    )]
    NoCa(String),
    #[error("{0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error("cannot connect to {server}: {source}")]
    Connect {
        server: String,
        source: std::io::Error,
    },
    #[error("talking to {server}: {message}")]
    Http { server: String, message: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Tcp { host: String, port: u16 },
    Tls { host: String, port: u16 },
    Unix(PathBuf),
}

/// A reply: status and body.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// A client for one daemon.
pub struct Client {
    server: String,
    target: Target,
    tls: Option<tokio_rustls::TlsConnector>,
    token: Option<Secret>,
}

fn parse_server(server: &str) -> Result<Target, ClientError> {
    let bad = || ClientError::BadServer(server.to_owned());
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

impl Client {
    pub fn new(
        server: &str,
        ca_cert: Option<&Path>,
        token: Option<Secret>,
    ) -> Result<Self, ClientError> {
        let target = parse_server(server)?;
        let tls = match (&target, ca_cert) {
            (Target::Tls { .. }, Some(ca)) => Some(tokio_rustls::TlsConnector::from(Arc::new(
                crate::tls::client_config(ca)?,
            ))),
            (Target::Tls { .. }, None) => return Err(ClientError::NoCa(server.to_owned())),
            _ => None,
        };
        Ok(Self {
            server: server.to_owned(),
            target,
            tls,
            token,
        })
    }

    async fn connect(&self) -> Result<Box<dyn Io>, ClientError> {
        let err = |source| ClientError::Connect {
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
                let tcp = TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(err)?;
                let name = rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| err(std::io::Error::other(e)))?;
                let connector = self
                    .tls
                    .as_ref()
                    .ok_or_else(|| ClientError::NoCa(self.server.clone()))?;
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

    /// Sends one request; `body` is sent as JSON.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<Reply, ClientError> {
        let streaming = self.open(method, path, body).await?;
        let status = streaming.status;
        let body = streaming.collect().await.map_err(|e| self.http_error(e))?;
        Ok(Reply { status, body })
    }

    fn http_error(&self, message: String) -> ClientError {
        ClientError::Http {
            server: self.server.clone(),
            message,
        }
    }

    /// Sends one request and returns as soon as the answer's head arrived;
    /// the body is read as it comes (`GET /v1/jobs/{id}/logs`).
    pub async fn open(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<Streaming, ClientError> {
        let io = self.connect().await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| self.http_error(e.to_string()))?;
        let conn = tokio::spawn(conn);
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, self.host_header());
        if let Some(token) = &self.token {
            builder = builder.header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", token.expose()),
            );
        }
        let payload = match body {
            Some(v) => {
                builder = builder.header(hyper::header::CONTENT_TYPE, "application/json");
                Bytes::from(v.to_string())
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
        Ok(Streaming {
            status: response.status().as_u16(),
            body: response.into_body(),
            conn,
        })
    }
}

/// An answer whose body is still arriving.
pub struct Streaming {
    pub status: u16,
    pub body: hyper::body::Incoming,
    conn: tokio::task::JoinHandle<Result<(), hyper::Error>>,
}

impl Streaming {
    /// The next piece of the body; `None` at its end.
    pub async fn next_bytes(&mut self) -> Option<Result<Bytes, String>> {
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
    pub async fn collect(self) -> Result<Bytes, String> {
        let Streaming { body, conn, .. } = self;
        let bytes = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        conn.abort();
        Ok(bytes)
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
    }
}
