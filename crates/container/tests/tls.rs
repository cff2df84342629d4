//! The Engine API over `tcp://` with TLS, against the real dockerd: the test
//! makes a CA, a server and a client certificate (rcgen) and runs a
//! TLS-terminating proxy (tokio-rustls) that requires a client certificate
//! of that CA and forwards to dockerd's unix socket. The backend pings,
//! negotiates, spawns and destroys through it; a wrong CA, a client
//! certificate the daemon does not trust and a missing certificate file
//! each fail with an error that says so.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kici_container::{ContainerBackend, RuntimeKind, TlsFiles};
use kici_engine::Backend;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::mpsc;

const GRACE: Duration = Duration::from_secs(1);
const DOCKER_SOCKET: &str = "/var/run/docker.sock";

struct Authority {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Authority {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        Self { cert, key }
    }

    /// A leaf for `names`, for `purpose`: (certificate PEM, key PEM, DER pair).
    fn issue(
        &self,
        names: &[&str],
        purpose: ExtendedKeyUsagePurpose,
    ) -> (rcgen::Certificate, KeyPair) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .unwrap();
        params.extended_key_usages = vec![purpose];
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert, key)
    }
}

/// The client side's files, Docker's `DOCKER_CERT_PATH` layout.
fn write_client_files(
    dir: &Path,
    ca: &Authority,
    client: &(rcgen::Certificate, KeyPair),
) -> TlsFiles {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.cert.pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), client.0.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), client.1.serialize_pem()).unwrap();
    TlsFiles::in_dir(dir)
}

/// A TLS listener on loopback that requires a client certificate issued by
/// `ca` and pipes each connection to dockerd's socket. Failed handshakes
/// are reported on the returned channel (the server's view).
async fn tls_proxy(
    ca: &Authority,
    server: &(rcgen::Certificate, KeyPair),
) -> (
    u16,
    mpsc::UnboundedReceiver<String>,
    tokio::task::JoinHandle<()>,
) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert.der().clone()).unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from(server.0.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server.1.serialize_der())),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (refused_tx, refused) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let refused_tx = refused_tx.clone();
            tokio::spawn(async move {
                let mut tls = match acceptor.accept(tcp).await {
                    Ok(tls) => tls,
                    Err(e) => {
                        let _ = refused_tx.send(e.to_string());
                        return;
                    }
                };
                let Ok(mut engine) = UnixStream::connect(DOCKER_SOCKET).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut engine).await;
            });
        }
    });
    (port, refused, task)
}

fn tls_scaler(image: &str, port: u16) -> Arc<kici_model::ScalerEntry> {
    // Rules are installed on this host: with a TCP endpoint they would not
    // be where the containers run, so isolation must be off (validated).
    scaler_from_yaml(
        &scaler_yaml(
            "tls",
            image,
            &format!("    host: tcp://127.0.0.1:{port}\n    networkIsolation: false"),
            "",
        ),
        "tls",
    )
}

fn backend_with(fx: &Fixture, tls: TlsFiles) -> ContainerBackend {
    let mut options = fx.options.clone();
    options.tls = Some(tls);
    ContainerBackend::new(options).unwrap()
}

fn path_of(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

#[tokio::test]
async fn serial_a_tls_host_is_reached_with_client_certificates_and_refused_without() {
    let _serial = SERIAL.lock().await;
    let pki = tempfile::tempdir().unwrap();
    let ca = Authority::new("kici test CA");
    let server = ca.issue(
        &["127.0.0.1", "localhost"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let client = ca.issue(&["kici-scaler"], ExtendedKeyUsagePurpose::ClientAuth);
    let good = write_client_files(&path_of(&pki, "good"), &ca, &client);
    let (port, mut refused, proxy) = tls_proxy(&ca, &server).await;

    let fx = Fixture::with(|o| o.tls = Some(good.clone())).await;
    let image = fx.image("tls", &["sleep", "3600"]);
    let scaler = tls_scaler(&image, port);
    let check = fx.backend.check_host(&scaler).await;
    assert!(check.is_ok(), "{check:?}");
    let endpoint = format!("https://127.0.0.1:{port}");
    assert_eq!(check.endpoint.as_deref(), Some(endpoint.as_str()));
    assert_eq!(check.runtime, Some(RuntimeKind::Docker));
    // Debian's dockerd 20.10 speaks 1.41: negotiated down through the proxy.
    let api: f32 = check.api_version.as_deref().unwrap().parse().unwrap();
    assert!(api <= 1.41, "{check:?}");

    let (spec, _reports) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    assert_eq!(handle.extra["endpoint"], endpoint);
    let running = inspect("container", &format!("kici-{agent}")).unwrap();
    assert_eq!(running["State"]["Running"], true, "{running}");
    assert_eq!(
        running["Config"]["Labels"]["dev.kici.scaler.instance"],
        fx.instance.to_string()
    );
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(inspect("container", &format!("kici-{agent}")).is_none());
    assert!(fx.containers().is_empty());
    assert!(fx.held().await.is_empty());
    assert!(refused.try_recv().is_err(), "the good client was refused");

    // The daemon's certificate is not signed by the CA the client trusts.
    let other_ca = Authority::new("another CA");
    let wrong_ca = write_client_files(&path_of(&pki, "wrong-ca"), &other_ca, &client);
    let check = backend_with(&fx, wrong_ca).check_host(&scaler).await;
    let problems = check.messages().join("\n");
    assert!(problems.contains(&endpoint), "{problems}");
    assert!(problems.contains("TLS"), "{problems}");
    assert!(
        problems.contains("invalid peer certificate: UnknownIssuer"),
        "{problems}"
    );

    // A client certificate the daemon does not trust (another CA's).
    let rogue = other_ca.issue(&["kici-scaler"], ExtendedKeyUsagePurpose::ClientAuth);
    let untrusted = write_client_files(&path_of(&pki, "untrusted"), &ca, &rogue);
    let check = backend_with(&fx, untrusted).check_host(&scaler).await;
    let problems = check.messages().join("\n");
    assert!(problems.contains(&endpoint), "{problems}");
    assert!(problems.contains("TLS"), "{problems}");
    assert!(problems.contains("UnknownCA"), "{problems}");
    // The daemon's side: it refused that client's certificate (before it,
    // the wrong-CA client's own refusal may arrive).
    loop {
        let why = tokio::time::timeout(Duration::from_secs(30), refused.recv())
            .await
            .expect("the proxy saw no refused client certificate")
            .unwrap();
        if why.contains("invalid peer certificate") {
            assert!(why.contains("UnknownIssuer"), "{why}");
            break;
        }
    }

    // No client certificate at all: the file is named before any connection.
    let missing = write_client_files(&path_of(&pki, "missing"), &ca, &client);
    std::fs::remove_file(&missing.cert).unwrap();
    let check = backend_with(&fx, missing.clone()).check_host(&scaler).await;
    let problems = check.messages().join("\n");
    assert!(
        problems.contains(&missing.cert.display().to_string()),
        "{problems}"
    );
    proxy.abort();
}
