//! TLS for the control API (server side) and for the CLI client, with
//! rustls on the `ring` provider.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the certificate chain {path}: {message}")]
    Certs { path: PathBuf, message: String },
    #[error("{path} holds no certificate")]
    NoCerts { path: PathBuf },
    #[error("cannot read the private key {path}: {message}")]
    Key { path: PathBuf, message: String },
    #[error("the certificate and key do not make a TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::Certs {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCerts {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The server configuration for `--tls-cert` / `--tls-key` (PEM).
pub fn server_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, TlsError> {
    let certs = load_certs(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
        path: key.to_owned(),
        message: e.to_string(),
    })?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// A client configuration trusting exactly the certificates in `ca` (PEM).
pub fn client_config(ca: &Path) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(ca)? {
        roots.add(cert)?;
    }
    client_config_with_roots(roots)
}

/// A client configuration trusting exactly `roots`.
pub fn client_config_with_roots(
    roots: rustls::RootCertStore,
) -> Result<rustls::ClientConfig, TlsError> {
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
