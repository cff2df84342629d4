//! Registry credentials for pulls, from the standard Docker `config.json`
//! (upstream sends none at all; docs/deviations.md, D-registry-auth).
//!
//! The daemon never reads the client's `config.json`: whoever pulls through
//! the Engine API must send the credentials as `X-Registry-Auth`. Lookup for a
//! registry host, as the Docker CLI does it:
//!
//! 1. `credHelpers[<host>]` → run `docker-credential-<helper> get`;
//! 2. `auths[<host>]` (keys compared without scheme and path, so
//!    `https://reg:5000/v2/` matches `reg:5000`; Docker Hub is stored under
//!    `https://index.docker.io/v1/`): `auth` (base64 `user:password`) or
//!    `identitytoken`;
//! 3. `credsStore` → the same helper protocol;
//! 4. nothing: an anonymous pull.
//!
//! The file is read at every pull (a `docker login` while the daemon runs
//! takes effect at once); a missing file means no credentials, a malformed
//! one is an error (a silent anonymous pull would hide the mistake).

use crate::reference::{DOCKER_HUB, DOCKER_HUB_AUTH_KEY};
use base64::Engine as _;
use bollard::auth::DockerCredentials;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// How long a credential helper may take.
const HELPER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot read registry credentials {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("registry credentials {} are not valid JSON: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("registry credentials {} for {registry}: `auth` is not base64 of user:password", path.display())]
    BadAuth { path: PathBuf, registry: String },
    #[error("credential helper docker-credential-{helper} for {registry}: {reason}")]
    Helper {
        helper: String,
        registry: String,
        reason: String,
    },
}

/// The parts of `config.json` that hold credentials.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConfigFile {
    #[serde(default)]
    auths: HashMap<String, AuthEntry>,
    #[serde(default)]
    cred_helpers: HashMap<String, String>,
    #[serde(default)]
    creds_store: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

/// What a credential helper prints for `get`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HelperAnswer {
    username: String,
    secret: String,
}

/// The default `config.json`: `$DOCKER_CONFIG/config.json`, else
/// `$HOME/.docker/config.json`.
pub fn default_config_path() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DOCKER_CONFIG") {
        return Some(PathBuf::from(dir).join("config.json"));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".docker/config.json"))
}

/// `https://reg:5000/v2/` → `reg:5000`; Docker Hub's aliases → `docker.io`.
fn normalize_host(key: &str) -> String {
    let without_scheme = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = without_scheme.split('/').next().unwrap_or(without_scheme);
    match host {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            DOCKER_HUB.to_owned()
        }
        other => other.to_owned(),
    }
}

/// The address the Engine expects in `serveraddress` for `registry`.
fn server_address(registry: &str) -> String {
    if registry == DOCKER_HUB {
        DOCKER_HUB_AUTH_KEY.to_owned()
    } else {
        registry.to_owned()
    }
}

/// Credentials for `registry` (a `host[:port]` as [`crate::ImageReference::registry`]
/// gives it) from the `config.json` at `path`; `None` = anonymous.
pub async fn credentials_for(
    path: &Path,
    registry: &str,
) -> Result<Option<DockerCredentials>, AuthError> {
    let text = match tokio::fs::read_to_string(path).await {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(AuthError::Read {
                path: path.to_owned(),
                source,
            })
        }
    };
    let config: ConfigFile = serde_json::from_str(&text).map_err(|source| AuthError::Parse {
        path: path.to_owned(),
        source,
    })?;
    let wanted = normalize_host(registry);
    if let Some(helper) = config
        .cred_helpers
        .iter()
        .find(|(host, _)| normalize_host(host) == wanted)
        .map(|(_, helper)| helper)
    {
        return run_helper(helper, registry).await.map(Some);
    }
    if let Some(entry) = config
        .auths
        .iter()
        .find(|(host, _)| normalize_host(host) == wanted)
        .map(|(_, entry)| entry)
    {
        if let Some(credentials) = from_entry(entry, registry, path)? {
            return Ok(Some(credentials));
        }
    }
    if let Some(helper) = &config.creds_store {
        return run_helper(helper, registry).await.map(Some);
    }
    Ok(None)
}

fn from_entry(
    entry: &AuthEntry,
    registry: &str,
    path: &Path,
) -> Result<Option<DockerCredentials>, AuthError> {
    let mut credentials = DockerCredentials {
        serveraddress: Some(server_address(registry)),
        ..Default::default()
    };
    if let Some(token) = entry.identitytoken.as_ref().filter(|t| !t.is_empty()) {
        credentials.identitytoken = Some(token.clone());
        return Ok(Some(credentials));
    }
    if let Some(auth) = entry.auth.as_ref().filter(|a| !a.is_empty()) {
        let bad = || AuthError::BadAuth {
            path: path.to_owned(),
            registry: registry.to_owned(),
        };
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| bad())?;
        let decoded = String::from_utf8(decoded).map_err(|_| bad())?;
        let (user, password) = decoded.split_once(':').ok_or_else(bad)?;
        credentials.username = Some(user.to_owned());
        credentials.password = Some(password.to_owned());
        return Ok(Some(credentials));
    }
    if let (Some(user), Some(password)) = (&entry.username, &entry.password) {
        credentials.username = Some(user.clone());
        credentials.password = Some(password.clone());
        return Ok(Some(credentials));
    }
    Ok(None)
}

/// The credential-helper protocol: `docker-credential-<helper> get`, the
/// server address on stdin, `{"Username","Secret"}` on stdout; the user
/// `<token>` means the secret is an identity token.
async fn run_helper(helper: &str, registry: &str) -> Result<DockerCredentials, AuthError> {
    let fail = |reason: String| AuthError::Helper {
        helper: helper.to_owned(),
        registry: registry.to_owned(),
        reason,
    };
    let program = format!("docker-credential-{helper}");
    let mut child = tokio::process::Command::new(&program)
        .arg("get")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| fail(format!("cannot run {program}: {e}")))?;
    let address = server_address(registry);
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(address.as_bytes())
            .await
            .map_err(|e| fail(format!("cannot write to {program}: {e}")))?;
        // Dropping stdin closes it: the helper reads to EOF.
    }
    let output = tokio::time::timeout(HELPER_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| fail(format!("no answer within {HELPER_TIMEOUT:?}")))?
        .map_err(|e| fail(format!("{program} failed: {e}")))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        return Err(fail(format!(
            "{program} get exited with {}: {}",
            output.status,
            format!("{} {}", stdout.trim(), stderr.trim()).trim()
        )));
    }
    let answer: HelperAnswer = serde_json::from_slice(&output.stdout)
        .map_err(|e| fail(format!("unexpected answer: {e}")))?;
    let mut credentials = DockerCredentials {
        serveraddress: Some(address),
        ..Default::default()
    };
    if answer.username == "<token>" {
        credentials.identitytoken = Some(answer.secret);
    } else {
        credentials.username = Some(answer.username);
        credentials.password = Some(answer.secret);
    }
    Ok(credentials)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    #[tokio::test]
    async fn auths_match_without_scheme_and_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let config = serde_json::json!({
            "auths": {
                "https://127.0.0.1:5000/v2/": {"auth": b64("kici:s3cret:with-colon")},
                "https://index.docker.io/v1/": {"auth": b64("hub:pw")},
                "tok.example": {"identitytoken": "idt"},
                "bad.example": {"auth": "!!!"}
            }
        });
        std::fs::write(&path, config.to_string()).unwrap();
        let c = credentials_for(&path, "127.0.0.1:5000")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.username.as_deref(), Some("kici"));
        assert_eq!(c.password.as_deref(), Some("s3cret:with-colon"));
        assert_eq!(c.serveraddress.as_deref(), Some("127.0.0.1:5000"));
        let c = credentials_for(&path, "docker.io").await.unwrap().unwrap();
        assert_eq!(c.username.as_deref(), Some("hub"));
        assert_eq!(c.serveraddress.as_deref(), Some(DOCKER_HUB_AUTH_KEY));
        let c = credentials_for(&path, "tok.example")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.identitytoken.as_deref(), Some("idt"));
        assert!(credentials_for(&path, "other.example")
            .await
            .unwrap()
            .is_none());
        let err = credentials_for(&path, "bad.example").await.unwrap_err();
        assert!(matches!(err, AuthError::BadAuth { .. }), "{err}");
    }

    #[tokio::test]
    async fn missing_file_is_anonymous_and_malformed_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        assert!(credentials_for(&path, "docker.io").await.unwrap().is_none());
        std::fs::write(&path, "{not json").unwrap();
        assert!(matches!(
            credentials_for(&path, "docker.io").await,
            Err(AuthError::Parse { .. })
        ));
    }

    #[tokio::test]
    async fn credential_helpers_per_registry_and_as_store() {
        let dir = tempfile::tempdir().unwrap();
        // A helper on PATH that answers with the address it was asked for.
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let helper = bin.join("docker-credential-kicitest");
        std::fs::write(
            &helper,
            "#!/bin/sh\nread addr\nif [ \"$addr\" = nope.example ]; then echo 'not found' >&2; exit 1; fi\n\
             if [ \"$addr\" = tok.example ]; then echo '{\"Username\":\"<token>\",\"Secret\":\"T\"}'; exit 0; fi\n\
             printf '{\"ServerURL\":\"%s\",\"Username\":\"u-%s\",\"Secret\":\"p\"}' \"$addr\" \"$addr\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("config.json");
        let config = serde_json::json!({
            "credHelpers": {"helped.example": "kicitest", "tok.example": "kicitest", "nope.example": "kicitest"},
            "auths": {"helped.example": {"auth": b64("ignored:x")}},
        });
        std::fs::write(&path, config.to_string()).unwrap();
        // The helper is found through PATH, as the CLI finds it.
        let old_path = std::env::var("PATH").unwrap_or_default();
        // Safe: this test module's only PATH user runs in this test.
        std::env::set_var("PATH", format!("{}:{old_path}", bin.display()));
        let c = credentials_for(&path, "helped.example")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.username.as_deref(), Some("u-helped.example"));
        let c = credentials_for(&path, "tok.example")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.identitytoken.as_deref(), Some("T"));
        let err = credentials_for(&path, "nope.example").await.unwrap_err();
        assert!(err.to_string().contains("not found"), "{err}");
        let store = dir.path().join("store.json");
        std::fs::write(&store, r#"{"credsStore":"kicitest"}"#).unwrap();
        let c = credentials_for(&store, "docker.io").await.unwrap().unwrap();
        assert_eq!(c.username.as_deref(), Some("u-https://index.docker.io/v1/"));
    }
}
