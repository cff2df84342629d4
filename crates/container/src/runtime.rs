//! Finding and connecting to a container runtime's Engine API.
//!
//! A scaler names its runtime with `runtime` (`auto`, `docker`, `podman`),
//! `socketPath` or `host` (`unix://…`, `tcp://host:port`, `https://…`). The
//! connection is made with bollard, **pinged** (a socket file that exists but
//! does not answer is no runtime — upstream only checked `access()`) and
//! the API version negotiated down to what the daemon speaks (Debian's
//! dockerd 20.10 speaks 1.41). Which runtime answered is read from
//! `GET /version` (Podman names itself among the components), not guessed
//! from the socket path (see docs/deviations.md, D-container-runtime).
//!
//! `tcp://` without TLS material is plain HTTP and is refused unless the
//! address is loopback; with [`TlsFiles`] it is HTTPS with client
//! certificates (upstream handed the host string over unparsed, without TLS).

use bollard::Docker;
use kici_model::{ContainerRuntime, ContainerSettings};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const DOCKER_SOCKET: &str = "/var/run/docker.sock";
pub const PODMAN_ROOTFUL_SOCKET: &str = "/run/podman/podman.sock";

/// bollard's own per-request timeout (response headers). Every call we make
/// is bounded by its own deadline (`api_call`); this only stops a wedged
/// connection from hanging forever, and must not cut a long-lived stream
/// (logs, wait, pull) whose headers come at once.
const CLIENT_TIMEOUT_SECS: u64 = 3600;

/// The TLS material of a `tcp://` / `https://` host (Docker's
/// `DOCKER_CERT_PATH` layout: `ca.pem`, `cert.pem`, `key.pem`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// `<dir>/ca.pem`, `<dir>/cert.pem`, `<dir>/key.pem`.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }
    }
}

/// Where an Engine API answers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port`; `tls` decides HTTP or HTTPS.
    Tcp {
        address: String,
        tls: bool,
    },
}

impl Endpoint {
    /// Parses a scaler's `host`: `unix:///path`, `tcp://h:p`, `https://h:p`
    /// (`tcp` with TLS when `tls` material is configured).
    pub fn parse_host(host: &str, tls_configured: bool) -> Result<Self, ConnectError> {
        let bad = |reason: &str| ConnectError::BadHost {
            host: host.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(path) = host.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad("a unix socket path must be absolute (unix:///path)"));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let (rest, tls) = if let Some(rest) = host.strip_prefix("tcp://") {
            (rest, tls_configured)
        } else if let Some(rest) = host.strip_prefix("https://") {
            (rest, true)
        } else if host.starts_with("http://") {
            return Err(bad("use tcp:// (plain) or https:// (TLS)"));
        } else {
            return Err(bad("expected unix://, tcp:// or https://"));
        };
        let address = rest.trim_end_matches('/');
        let Some((name, port)) = address.rsplit_once(':') else {
            return Err(bad("a port is required (tcp://host:2376)"));
        };
        if name.is_empty() || port.parse::<u16>().is_err() || address.contains('/') {
            return Err(bad("expected host:port"));
        }
        if !tls && !is_loopback(name) {
            return Err(bad(
                "plain TCP to a remote Engine exposes root on that host; configure TLS \
                 (ca.pem, cert.pem, key.pem) or use https://",
            ));
        }
        Ok(Self::Tcp {
            address: address.to_owned(),
            tls,
        })
    }

    pub fn is_local(&self) -> bool {
        matches!(self, Self::Unix(_))
    }
}

fn is_loopback(name: &str) -> bool {
    name == "localhost"
        || name
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix(path) => write!(f, "unix://{}", path.display()),
            Self::Tcp { address, tls: true } => write!(f, "https://{address}"),
            Self::Tcp {
                address,
                tls: false,
            } => write!(f, "tcp://{address}"),
        }
    }
}

/// Which engine answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RuntimeKind {
    Docker,
    Podman,
}

impl RuntimeKind {
    /// The `logsSource` of forwarded lines (upstream's values).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Docker => "docker",
            Self::Podman => "podman",
        }
    }
}

impl fmt::Display for RuntimeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("host {host:?}: {reason}")]
    BadHost { host: String, reason: String },
    #[error(
        "no container runtime answers ({tried}); install and start Docker or Podman, \
         or configure socketPath or host"
    )]
    NoRuntime { tried: String },
    #[error("the Engine API at {endpoint} does not answer: {reason}")]
    NoAnswer { endpoint: Endpoint, reason: String },
    #[error("TLS {role} {path}: {reason}")]
    TlsFile {
        role: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{endpoint} is {found}, but the scaler asks for runtime {wanted}")]
    WrongRuntime {
        endpoint: Endpoint,
        found: RuntimeKind,
        wanted: RuntimeKind,
    },
}

/// A connected, version-negotiated Engine API client.
#[derive(Debug, Clone)]
pub struct Connection {
    pub docker: Docker,
    pub endpoint: Endpoint,
    pub kind: RuntimeKind,
    /// The daemon's version string (e.g. `20.10.24+dfsg1`, `4.3.1`).
    pub version: String,
    /// The API version in use after negotiation (e.g. `1.41`).
    pub api_version: String,
}

/// What a scaler's settings say about where its runtime is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RuntimeTarget {
    /// Probe the standard sockets of the runtime named (`None` = any).
    Probe(Option<RuntimeKind>),
    /// One endpoint; `wanted` is checked against what answers.
    Fixed {
        endpoint: Endpoint,
        wanted: Option<RuntimeKind>,
    },
}

impl RuntimeTarget {
    /// `host` beats `socketPath` beats probing (as upstream).
    pub fn of(settings: &ContainerSettings, tls: Option<&TlsFiles>) -> Result<Self, ConnectError> {
        let wanted = match settings.runtime {
            ContainerRuntime::Auto => None,
            ContainerRuntime::Docker => Some(RuntimeKind::Docker),
            ContainerRuntime::Podman => Some(RuntimeKind::Podman),
        };
        if let Some(host) = &settings.host {
            return Ok(Self::Fixed {
                endpoint: Endpoint::parse_host(host, tls.is_some())?,
                wanted,
            });
        }
        if let Some(path) = &settings.socket_path {
            return Ok(Self::Fixed {
                endpoint: Endpoint::Unix(path.clone()),
                wanted,
            });
        }
        Ok(Self::Probe(wanted))
    }

    /// The sockets probed, in upstream's order: Docker's, rootful
    /// Podman's, then rootless Podman's under `$XDG_RUNTIME_DIR`.
    fn candidates(runtime: Option<RuntimeKind>) -> Vec<(PathBuf, RuntimeKind)> {
        let mut all = vec![
            (PathBuf::from(DOCKER_SOCKET), RuntimeKind::Docker),
            (PathBuf::from(PODMAN_ROOTFUL_SOCKET), RuntimeKind::Podman),
        ];
        if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR") {
            all.push((
                PathBuf::from(dir).join("podman/podman.sock"),
                RuntimeKind::Podman,
            ));
        }
        all.retain(|(_, kind)| runtime.is_none_or(|wanted| wanted == *kind));
        all
    }

    /// Connects to the first endpoint that answers.
    pub async fn connect(
        &self,
        tls: Option<&TlsFiles>,
        deadline: Duration,
    ) -> Result<Connection, ConnectError> {
        match self {
            Self::Fixed { endpoint, wanted } => {
                let conn = connect(endpoint, tls, deadline).await?;
                match wanted {
                    Some(wanted) if *wanted != conn.kind => Err(ConnectError::WrongRuntime {
                        endpoint: endpoint.clone(),
                        found: conn.kind,
                        wanted: *wanted,
                    }),
                    _ => Ok(conn),
                }
            }
            Self::Probe(runtime) => {
                let mut tried = Vec::new();
                for (path, _) in Self::candidates(*runtime) {
                    if !path.exists() {
                        tried.push(format!("{}: no such socket", path.display()));
                        continue;
                    }
                    match connect(&Endpoint::Unix(path.clone()), tls, deadline).await {
                        Ok(conn) => return Ok(conn),
                        Err(e) => tried.push(format!("{}: {e}", path.display())),
                    }
                }
                Err(ConnectError::NoRuntime {
                    tried: tried.join("; "),
                })
            }
        }
    }
}

/// Connects to `endpoint`, pings it and negotiates the API version, all
/// within `deadline`.
pub async fn connect(
    endpoint: &Endpoint,
    tls: Option<&TlsFiles>,
    deadline: Duration,
) -> Result<Connection, ConnectError> {
    let no_answer = |reason: String| ConnectError::NoAnswer {
        endpoint: endpoint.clone(),
        reason,
    };
    let docker = match endpoint {
        Endpoint::Unix(path) => Docker::connect_with_unix(
            &path.to_string_lossy(),
            CLIENT_TIMEOUT_SECS,
            bollard::API_DEFAULT_VERSION,
        ),
        Endpoint::Tcp { address, tls: true } => {
            let Some(files) = tls else {
                return Err(no_answer(
                    "https needs TLS material (ca.pem, cert.pem, key.pem)".into(),
                ));
            };
            files.check_readable()?;
            Docker::connect_with_ssl(
                address,
                &files.key,
                &files.cert,
                &files.ca,
                CLIENT_TIMEOUT_SECS,
                bollard::API_DEFAULT_VERSION,
            )
        }
        Endpoint::Tcp {
            address,
            tls: false,
        } => Docker::connect_with_http(
            &format!("tcp://{address}"),
            CLIENT_TIMEOUT_SECS,
            bollard::API_DEFAULT_VERSION,
        ),
    }
    .map_err(|e| no_answer(e.to_string()))?;
    let negotiated = tokio::time::timeout(deadline, async {
        docker.ping().await?;
        docker.negotiate_version().await
    })
    .await
    .map_err(|_| no_answer(format!("no answer within {deadline:?}")))?
    .map_err(|e| {
        let reason = error_chain(&e);
        match (endpoint, tls) {
            (Endpoint::Tcp { tls: true, .. }, Some(files)) if looks_like_tls(&reason) => {
                no_answer(format!(
                    "{reason} (TLS handshake failed: the daemon's certificate must be \
                     issued by the CA in {} and name the host, and the daemon must trust \
                     the client certificate {})",
                    files.ca.display(),
                    files.cert.display()
                ))
            }
            _ => no_answer(reason),
        }
    })?;
    let version = tokio::time::timeout(deadline, negotiated.version())
        .await
        .map_err(|_| no_answer(format!("GET /version: no answer within {deadline:?}")))?
        .map_err(|e| no_answer(format!("GET /version: {e}")))?;
    let is_podman = version
        .components
        .iter()
        .flatten()
        .any(|c| c.name.to_ascii_lowercase().contains("podman"))
        || version
            .platform
            .as_ref()
            .is_some_and(|p| p.name.to_ascii_lowercase().contains("podman"));
    let api_version = negotiated.client_version().to_string();
    Ok(Connection {
        docker: negotiated,
        endpoint: endpoint.clone(),
        kind: if is_podman {
            RuntimeKind::Podman
        } else {
            RuntimeKind::Docker
        },
        version: version.version.unwrap_or_default(),
        api_version,
    })
}

/// An error with its sources: bollard's (hyper's) top-level message is
/// often only "client error (Connect)", the cause is further down.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

fn looks_like_tls(reason: &str) -> bool {
    let lower = reason.to_ascii_lowercase();
    ["certificate", "tls", "handshake", "alert"]
        .iter()
        .any(|w| lower.contains(w))
}

impl TlsFiles {
    /// Each file is there and readable: bollard reads the client
    /// certificate only during a handshake, where a missing file is merely
    /// "no certificate sent".
    fn check_readable(&self) -> Result<(), ConnectError> {
        for (role, path) in [
            ("CA certificate", &self.ca),
            ("client certificate", &self.cert),
            ("client key", &self.key),
        ] {
            if let Err(e) = std::fs::File::open(path) {
                return Err(ConnectError::TlsFile {
                    role,
                    path: path.clone(),
                    reason: e.to_string(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn hosts_parse_or_say_why() {
        assert_eq!(
            Endpoint::parse_host("unix:///run/podman/podman.sock", false).unwrap(),
            Endpoint::Unix("/run/podman/podman.sock".into())
        );
        assert_eq!(
            Endpoint::parse_host("tcp://10.0.0.5:2376", true).unwrap(),
            Endpoint::Tcp {
                address: "10.0.0.5:2376".into(),
                tls: true
            }
        );
        assert_eq!(
            Endpoint::parse_host("https://docker.example:2376/", false).unwrap(),
            Endpoint::Tcp {
                address: "docker.example:2376".into(),
                tls: true
            }
        );
        assert_eq!(
            Endpoint::parse_host("tcp://127.0.0.1:2375", false).unwrap(),
            Endpoint::Tcp {
                address: "127.0.0.1:2375".into(),
                tls: false
            }
        );
        for (host, why) in [
            ("tcp://10.0.0.5:2375", "configure TLS"),
            ("tcp://10.0.0.5", "port is required"),
            ("tcp://:2375", "host:port"),
            ("http://h:1", "use tcp://"),
            ("ssh://h", "expected unix://"),
            ("unix://relative.sock", "absolute"),
            ("tcp://h:99999", "host:port"),
        ] {
            let err = Endpoint::parse_host(host, false).unwrap_err().to_string();
            assert!(err.contains(why), "{host}: {err}");
        }
    }

    #[test]
    fn probe_order_and_runtime_filter() {
        let all = RuntimeTarget::candidates(None);
        assert_eq!(all[0], (PathBuf::from(DOCKER_SOCKET), RuntimeKind::Docker));
        assert_eq!(
            all[1],
            (PathBuf::from(PODMAN_ROOTFUL_SOCKET), RuntimeKind::Podman)
        );
        assert!(RuntimeTarget::candidates(Some(RuntimeKind::Podman))
            .iter()
            .all(|(_, k)| *k == RuntimeKind::Podman));
        assert_eq!(
            RuntimeTarget::candidates(Some(RuntimeKind::Docker)).len(),
            1
        );
    }

    /// A stand-in Engine API on a unix socket: `/_ping` answers OK,
    /// `/version` answers `version` (JSON). Enough for connect's ping,
    /// negotiation and runtime detection.
    async fn fake_engine(version: serde_json::Value) -> (tempfile::TempDir, Endpoint) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let body = version.to_string();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let body = body.clone();
                tokio::spawn(async move {
                    let mut pending = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") else {
                            match conn.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => pending.extend_from_slice(&buf[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&pending[..end]).into_owned();
                        pending.drain(..end + 4);
                        let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                        let (kind, answer) = if path.ends_with("/_ping") {
                            ("text/plain", "OK".to_owned())
                        } else if path.ends_with("/version") {
                            ("application/json", body.clone())
                        } else {
                            ("application/json", "{\"message\":\"not here\"}".to_owned())
                        };
                        let status = if path.ends_with("/_ping") || path.ends_with("/version") {
                            "200 OK"
                        } else {
                            "404 Not Found"
                        };
                        let response = format!(
                            "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\r\n{answer}",
                            answer.len()
                        );
                        if conn.write_all(response.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (dir, Endpoint::Unix(path))
    }

    #[tokio::test]
    async fn the_api_version_is_negotiated_down_to_an_older_daemon() {
        let (_dir, endpoint) = fake_engine(serde_json::json!({
            "Version": "17.06.0-ce", "ApiVersion": "1.30", "MinAPIVersion": "1.12",
        }))
        .await;
        let conn = connect(&endpoint, None, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(conn.api_version, "1.30");
        assert_eq!(conn.kind, RuntimeKind::Docker);
        assert_eq!(conn.version, "17.06.0-ce");
        // Every later request names the negotiated version in its path.
        assert_eq!(conn.docker.client_version().to_string(), "1.30");
    }

    #[tokio::test]
    async fn a_newer_daemon_is_spoken_to_at_our_own_version() {
        let (_dir, endpoint) = fake_engine(serde_json::json!({
            "Version": "99.0.0", "ApiVersion": "1.99",
        }))
        .await;
        let conn = connect(&endpoint, None, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(conn.api_version, bollard::API_DEFAULT_VERSION.to_string());
    }

    #[tokio::test]
    async fn podman_is_told_by_its_version_components_not_its_socket_path() {
        let podman = serde_json::json!({
            "Version": "4.3.1", "ApiVersion": "1.41",
            "Platform": {"Name": "linux/amd64/debian-12"},
            "Components": [{"Name": "Podman Engine", "Version": "4.3.1"}],
        });
        // A socket path that says nothing about what serves it.
        let (_dir, endpoint) = fake_engine(podman).await;
        let conn = connect(&endpoint, None, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(conn.kind, RuntimeKind::Podman);
        assert_eq!(conn.api_version, "1.41");
        // runtime: docker pointed at it is refused, naming both.
        let err = RuntimeTarget::Fixed {
            endpoint: endpoint.clone(),
            wanted: Some(RuntimeKind::Docker),
        }
        .connect(None, Duration::from_secs(5))
        .await
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("is podman, but the scaler asks for runtime docker"),
            "{err}"
        );
        // ... and runtime: auto or podman take it.
        for wanted in [None, Some(RuntimeKind::Podman)] {
            let conn = RuntimeTarget::Fixed {
                endpoint: endpoint.clone(),
                wanted,
            }
            .connect(None, Duration::from_secs(5))
            .await
            .unwrap();
            assert_eq!(conn.kind, RuntimeKind::Podman);
        }
    }

    #[tokio::test]
    async fn a_daemon_without_an_api_version_is_no_runtime() {
        let (_dir, endpoint) = fake_engine(serde_json::json!({"Version": "1.0"})).await;
        let err = connect(&endpoint, None, Duration::from_secs(5))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(&endpoint.to_string()), "{err}");
        assert!(err.contains("does not answer"), "{err}");
    }

    #[tokio::test]
    async fn nothing_answering_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let dead = dir.path().join("dead.sock");
        // A socket file with nobody behind it (a daemon that died).
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        let target = RuntimeTarget::Fixed {
            endpoint: Endpoint::Unix(dead.clone()),
            wanted: None,
        };
        let err = target
            .connect(None, Duration::from_secs(5))
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&dead.display().to_string()), "{msg}");
        assert!(msg.contains("does not answer"), "{msg}");
    }
}
