//! A typed client of the Firecracker API (v1.16.1,
//! `crates/testkit/spec/firecracker-api-v1.16.1.yaml`) over its unix socket.
//!
//! Request bodies are serde structs named after the spec's `definitions`;
//! optional fields are omitted, never sent as `null`. One HTTP/1.1
//! connection per call (Firecracker serves one request at a time anyway),
//! every call bounded by the client's timeout (upstream set none: a wedged
//! VMM hung spawn, destroy and shutdown for ever; see docs/deviations.md,
//! D-bounded-calls).

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixStream;

/// `BootSource`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BootSource {
    pub kernel_image_path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_args: Option<String>,
}

/// `Drive` (virtio-block).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Drive {
    pub drive_id: String,
    pub path_on_host: String,
    pub is_root_device: bool,
    pub is_read_only: bool,
}

/// `NetworkInterface`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkInterface {
    pub iface_id: String,
    pub host_dev_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
}

/// `MachineConfiguration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MachineConfiguration {
    pub vcpu_count: u32,
    pub mem_size_mib: u32,
    pub smt: bool,
}

/// `Logger`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Logger {
    pub log_path: String,
    pub level: LogLevel,
    pub show_level: bool,
    pub show_log_origin: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum LogLevel {
    Error,
    Warning,
    Info,
    Debug,
}

/// `Metrics`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Metrics {
    pub metrics_path: String,
}

/// `TokenBucket`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TokenBucket {
    pub size: u64,
    pub refill_time: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub one_time_burst: Option<u64>,
}

/// `SerialDevice`: output stays on Firecracker's stdout (our log file); only
/// its rate is bounded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SerialDevice {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_limiter: Option<TokenBucket>,
}

/// `MmdsConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MmdsConfig {
    pub version: MmdsVersion,
    pub network_interfaces: Vec<String>,
    pub ipv4_address: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MmdsVersion {
    V1,
    V2,
}

/// `InstanceActionInfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct InstanceActionInfo {
    pub action_type: ActionType,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ActionType {
    FlushMetrics,
    InstanceStart,
    SendCtrlAltDel,
}

/// `InstanceInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct InstanceInfo {
    pub app_name: String,
    pub id: String,
    pub state: String,
    pub vmm_version: String,
}

/// A failed API call.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("Firecracker API {method} {path}: no answer within {timeout:?}")]
    Timeout {
        method: Method,
        path: String,
        timeout: Duration,
    },
    #[error("Firecracker API {method} {path}: {source}")]
    Connect {
        method: Method,
        path: String,
        source: std::io::Error,
    },
    #[error("Firecracker API {method} {path}: {message}")]
    Http {
        method: Method,
        path: String,
        message: String,
    },
    #[error("Firecracker API {method} {path}: {status} {fault}")]
    Status {
        method: Method,
        path: String,
        status: StatusCode,
        /// The `fault_message`, or the raw body.
        fault: String,
    },
    #[error("Firecracker API {method} {path}: cannot encode or decode the body: {source}")]
    Json {
        method: Method,
        path: String,
        source: serde_json::Error,
    },
}

/// The API of one Firecracker process.
#[derive(Debug, Clone)]
pub struct ApiClient {
    socket: PathBuf,
    timeout: Duration,
}

#[derive(Deserialize)]
struct Fault {
    fault_message: String,
}

impl ApiClient {
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> Self {
        Self {
            socket: socket.into(),
            timeout,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `GET /`.
    pub async fn describe_instance(&self) -> Result<InstanceInfo, ApiError> {
        let body = self.call(Method::GET, "/", None).await?;
        serde_json::from_slice(&body).map_err(|source| ApiError::Json {
            method: Method::GET,
            path: "/".into(),
            source,
        })
    }

    pub async fn put_boot_source(&self, body: &BootSource) -> Result<(), ApiError> {
        self.put("/boot-source", body).await
    }

    pub async fn put_drive(&self, body: &Drive) -> Result<(), ApiError> {
        self.put(&format!("/drives/{}", body.drive_id), body).await
    }

    pub async fn put_network_interface(&self, body: &NetworkInterface) -> Result<(), ApiError> {
        self.put(&format!("/network-interfaces/{}", body.iface_id), body)
            .await
    }

    pub async fn put_machine_config(&self, body: &MachineConfiguration) -> Result<(), ApiError> {
        self.put("/machine-config", body).await
    }

    pub async fn put_logger(&self, body: &Logger) -> Result<(), ApiError> {
        self.put("/logger", body).await
    }

    pub async fn put_metrics(&self, body: &Metrics) -> Result<(), ApiError> {
        self.put("/metrics", body).await
    }

    pub async fn put_serial(&self, body: &SerialDevice) -> Result<(), ApiError> {
        self.put("/serial", body).await
    }

    pub async fn put_mmds_config(&self, body: &MmdsConfig) -> Result<(), ApiError> {
        self.put("/mmds/config", body).await
    }

    /// `PUT /mmds`: replaces the whole store.
    pub async fn put_mmds(&self, body: &serde_json::Value) -> Result<(), ApiError> {
        self.put("/mmds", body).await
    }

    /// `GET /mmds`.
    pub async fn get_mmds(&self) -> Result<serde_json::Value, ApiError> {
        let body = self.call(Method::GET, "/mmds", None).await?;
        serde_json::from_slice(&body).map_err(|source| ApiError::Json {
            method: Method::GET,
            path: "/mmds".into(),
            source,
        })
    }

    pub async fn action(&self, action_type: ActionType) -> Result<(), ApiError> {
        self.put("/actions", &InstanceActionInfo { action_type })
            .await
    }

    async fn put<T: Serialize>(&self, path: &str, body: &T) -> Result<(), ApiError> {
        let json = serde_json::to_vec(body).map_err(|source| ApiError::Json {
            method: Method::PUT,
            path: path.into(),
            source,
        })?;
        self.call(Method::PUT, path, Some(json)).await.map(drop)
    }

    /// One request on a fresh connection, bounded by the timeout.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, ApiError> {
        let work = self.exchange(method.clone(), path, body);
        match tokio::time::timeout(self.timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(ApiError::Timeout {
                method,
                path: path.into(),
                timeout: self.timeout,
            }),
        }
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, ApiError> {
        let http = |message: String| ApiError::Http {
            method: method.clone(),
            path: path.into(),
            message,
        };
        let stream =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ApiError::Connect {
                    method: method.clone(),
                    path: path.into(),
                    source,
                })?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| http(e.to_string()))?;
        let driver = tokio::spawn(connection);
        let mut request = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(hyper::header::HOST, "localhost")
            .header(hyper::header::ACCEPT, "application/json");
        let body = match body {
            Some(bytes) => {
                request = request
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .header(hyper::header::CONTENT_LENGTH, bytes.len());
                Full::new(Bytes::from(bytes))
            }
            None => Full::new(Bytes::new()),
        };
        let request = request.body(body).map_err(|e| http(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| http(e.to_string()))?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| http(e.to_string()))?
            .to_bytes();
        driver.abort();
        if status.is_success() {
            return Ok(bytes);
        }
        let fault = serde_json::from_slice::<Fault>(&bytes)
            .map(|f| f.fault_message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        Err(ApiError::Status {
            method,
            path: path.into(),
            status,
            fault,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixListener;

    #[test]
    fn firecracker_bodies_serialise_as_the_spec_names_them() {
        let v = |x: &dyn erased::Ser| x.value();
        assert_eq!(
            v(&BootSource {
                kernel_image_path: "/kernel".into(),
                boot_args: Some("console=ttyS0".into())
            }),
            json!({"kernel_image_path": "/kernel", "boot_args": "console=ttyS0"})
        );
        assert_eq!(
            v(&MmdsConfig {
                version: MmdsVersion::V2,
                network_interfaces: vec!["eth0".into()],
                ipv4_address: "169.254.169.254".into()
            }),
            json!({"version": "V2", "network_interfaces": ["eth0"], "ipv4_address": "169.254.169.254"})
        );
        assert_eq!(
            v(&InstanceActionInfo {
                action_type: ActionType::InstanceStart
            }),
            json!({"action_type": "InstanceStart"})
        );
        assert_eq!(
            v(&NetworkInterface {
                iface_id: "eth0".into(),
                host_dev_name: "kici-00000001".into(),
                guest_mac: None
            }),
            json!({"iface_id": "eth0", "host_dev_name": "kici-00000001"})
        );
        assert_eq!(
            v(&SerialDevice {
                rate_limiter: Some(TokenBucket {
                    size: 10,
                    refill_time: 1000,
                    one_time_burst: None
                })
            }),
            json!({"rate_limiter": {"size": 10, "refill_time": 1000}})
        );
    }

    mod erased {
        pub trait Ser {
            fn value(&self) -> serde_json::Value;
        }
        impl<T: serde::Serialize> Ser for T {
            fn value(&self) -> serde_json::Value {
                serde_json::to_value(self).unwrap()
            }
        }
    }

    /// Serves one connection: records the raw request, answers `response`.
    async fn serve_once(listener: UnixListener, response: &'static str) -> String {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = conn.read(&mut chunk).await.unwrap();
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf);
            if let Some(end) = text.find("\r\n\r\n") {
                let len = text[..end]
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                if buf.len() >= end + 4 + len {
                    break;
                }
            }
            if n == 0 {
                break;
            }
        }
        conn.write_all(response.as_bytes()).await.unwrap();
        conn.shutdown().await.unwrap();
        String::from_utf8(buf).unwrap()
    }

    #[tokio::test]
    async fn firecracker_api_put_sends_json_with_length_and_get_sends_no_body() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let client = ApiClient::new(&socket, Duration::from_secs(5));
        let server = tokio::spawn(serve_once(listener, "HTTP/1.1 204 No Content\r\n\r\n"));
        client
            .put_mmds(&json!({"latest": {"meta-data": {"k": "é"}}}))
            .await
            .unwrap();
        let raw = server.await.unwrap();
        assert!(raw.starts_with("PUT /mmds HTTP/1.1\r\n"), "{raw}");
        assert!(raw.contains("content-type: application/json"));
        let body = r#"{"latest":{"meta-data":{"k":"é"}}}"#;
        assert!(raw.contains(&format!("content-length: {}", body.len())));
        assert!(raw.ends_with(body));

        let listener = UnixListener::bind(dir.path().join("get.sock")).unwrap();
        let client = ApiClient::new(dir.path().join("get.sock"), Duration::from_secs(5));
        let server = tokio::spawn(serve_once(
            listener,
            "HTTP/1.1 200 OK\r\ncontent-length: 75\r\n\r\n{\"app_name\":\"Firecracker\",\"id\":\"x\",\"state\":\"Not started\",\"vmm_version\":\"1\"}",
        ));
        let info = client.describe_instance().await.unwrap();
        assert_eq!(info.state, "Not started");
        let raw = server.await.unwrap();
        assert!(raw.starts_with("GET / HTTP/1.1\r\n"));
        assert!(!raw.to_ascii_lowercase().contains("content-type"));
    }

    #[tokio::test]
    async fn firecracker_api_errors_carry_the_fault_message_and_time_out() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("api.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let client = ApiClient::new(&socket, Duration::from_secs(5));
        let server = tokio::spawn(serve_once(
            listener,
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 32\r\n\r\n{\"fault_message\":\"bad drive id\"}",
        ));
        let err = client.action(ActionType::SendCtrlAltDel).await.unwrap_err();
        server.await.unwrap();
        match &err {
            ApiError::Status {
                status,
                fault,
                path,
                ..
            } => {
                assert_eq!(*status, StatusCode::BAD_REQUEST);
                assert_eq!(fault, "bad drive id");
                assert_eq!(path, "/actions");
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("400"));

        // A VMM that accepts but never answers.
        let silent = dir.path().join("silent.sock");
        let _listener = UnixListener::bind(&silent).unwrap();
        let client = ApiClient::new(&silent, Duration::from_millis(100));
        assert!(matches!(
            client.describe_instance().await,
            Err(ApiError::Timeout { .. })
        ));
        // No socket at all.
        let client = ApiClient::new(dir.path().join("none.sock"), Duration::from_secs(1));
        assert!(matches!(
            client.describe_instance().await,
            Err(ApiError::Connect { .. })
        ));
    }
}
