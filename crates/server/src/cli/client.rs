//! The CLI's connection to a daemon: a [`kici_api::Client`] for
//! `--server` (`http://`, `https://` trusting `--ca-cert`, or `unix:/path`)
//! with the bearer token from `KICI_SCALER_API_TOKEN`. The requests and
//! answers themselves are `kici-api`'s types.

use crate::daemon::settings::{default_api_socket, API_TOKEN_ENV};
use crate::gateway::token::Secret;
use kici_api::{ApiError, Client};
use std::path::Path;
use std::sync::Arc;

/// The default `--server`: the unix socket a `serve` without `--listen`
/// serves on (see [`default_api_socket`]).
pub fn default_server() -> String {
    format!("unix:{}", default_api_socket().display())
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--server {0:?}: expected http://HOST[:PORT], https://HOST[:PORT] or unix:/path")]
    BadServer(String),
    #[error(
        "--server {0}: https needs --ca-cert FILE (the CA that signed the daemon's certificate)"
    )]
    NoCa(String),
    #[error("{0}")]
    Tls(#[from] crate::daemon::tls::TlsError),
    /// Talking to the daemon failed (connecting, HTTP), or it answered
    /// something the CLI cannot read.
    #[error("{0}")]
    Api(#[from] ApiError),
}

/// A client for `server`, trusting the certificates in `ca_cert` (PEM) for
/// an `https://` server.
pub fn connect(
    server: &str,
    ca_cert: Option<&Path>,
    token: Option<Secret>,
) -> Result<Client, ClientError> {
    let client = if server.starts_with("https://") {
        let ca = ca_cert.ok_or_else(|| ClientError::NoCa(server.to_owned()))?;
        Client::with_tls(server, Arc::new(crate::daemon::tls::client_config(ca)?))
    } else {
        Client::new(server)
    }
    .map_err(|e| match e {
        ApiError::BadServer(_) => ClientError::BadServer(server.to_owned()),
        other => ClientError::Api(other),
    })?;
    Ok(match token {
        Some(token) => client.with_token(token.expose()),
        None => client,
    })
}

/// The bearer token in `KICI_SCALER_API_TOKEN`, if set.
pub fn token_from_env() -> Option<Secret> {
    std::env::var(API_TOKEN_ENV)
        .ok()
        .filter(|t| !t.trim().is_empty())
        .map(|t| Secret::new(t.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn server_urls() {
        for good in [
            "http://127.0.0.1:7878",
            "http://[::1]:9",
            "unix:/run/k.sock",
        ] {
            assert!(connect(good, None, None).is_ok(), "{good}");
        }
        for bad in [
            "127.0.0.1:7878",
            "http://",
            "http://h:x",
            "unix:",
            "ftp://h",
            "http://h/v1",
        ] {
            assert!(
                matches!(connect(bad, None, None), Err(ClientError::BadServer(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            connect("https://example.test/", None, None),
            Err(ClientError::NoCa(_))
        ));
    }
}
