//! How the hosts of a fleet know each other: the fleet key, the signature
//! every peer call carries, its check on the receiving host, and the TLS
//! configuration peer calls over `https` are verified with.
//!
//! A peer call carries no bearer token: the operator's API token is never
//! sent to a URL read from the database (anyone who can write the hosts
//! table could otherwise point a host at a listener of theirs and collect
//! it). Instead each call carries
//!
//! ```text
//! X-Kici-Fleet-Auth: v1 <from> <to> <unix-time> <nonce> <hmac>
//! ```
//!
//! where `<hmac>` is the hex HMAC-SHA256, under the fleet key, of the
//! sender's and the addressee's instance ids, the time, a random nonce,
//! the method, the path with its query and the SHA-256 of the body. The
//! receiver accepts it (on the routes hosts call on each other only) when
//! it is addressed to it, the time is within [`MAX_SKEW`] of its own clock,
//! the HMAC verifies (in constant time) under one of its keys and the
//! nonce was not seen before. A captured call can therefore not be sent
//! to another host, another route, with another body, later than the
//! window, or twice to the same host while it runs. What remains: a host
//! restarted within the window forgets the nonces it saw, so a call
//! captured just before its restart can be replayed to it once right
//! after — over `http`, where calls can be captured at all. Over `https`
//! nothing can be captured.
//!
//! The window is ±30 s: wide enough for hosts whose clocks NTP keeps within
//! a few seconds plus a call's own time in flight (at most
//! [`super::peer::PEER_CALL_TIMEOUT`]), narrow enough that the nonces of a
//! whole window stay in memory (kept for twice the window).

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The environment variable holding the fleet key.
pub const FLEET_KEY_ENV: &str = "KICI_SCALER_FLEET_KEY";
/// The header a peer call is signed in.
pub const HEADER: &str = "x-kici-fleet-auth";
/// The shortest fleet key accepted: 256 bits, HMAC-SHA256's own strength.
pub const MIN_KEY_BYTES: usize = 32;
/// How far a signed call's time may be from the receiver's clock.
pub const MAX_SKEW: Duration = Duration::from_secs(30);
/// The scheme's version, the header's first word and part of what is
/// signed.
const VERSION: &str = "v1";

type HmacSha256 = Hmac<Sha256>;

/// Why there is no usable fleet key.
#[derive(Debug, thiserror::Error)]
pub enum FleetKeyError {
    #[error("this host joins fleet {fleet:?} (a PostgreSQL --state without --no-fleet), so its hosts need a shared fleet key to call each other: set {FLEET_KEY_ENV} (at least {MIN_KEY_BYTES} bytes, e.g. `openssl rand -hex 32`, the same on every host) or --fleet-key-file FILE (`fleet-key-file` in the daemon config; a file only its owner can read) — or --no-fleet to serve alone")]
    Missing { fleet: String },
    #[error("both {FLEET_KEY_ENV} and --fleet-key-file {} are set: set one", .0.display())]
    Both(PathBuf),
    #[error("cannot read the fleet key file {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the fleet key file {} has mode {mode:04o}: group or others may read it; make it readable by its owner only (chmod 600 {})", .path.display(), .path.display())]
    Exposed { path: PathBuf, mode: u32 },
    #[error("{origin}: holds no fleet key")]
    Empty { origin: String },
    #[error("{origin}: key {index} has {len} bytes; a fleet key must have at least {MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)")]
    Short {
        origin: String,
        index: usize,
        len: usize,
    },
}

/// The fleet key, and during a rotation the other key accepted. The first
/// key signs; every key is accepted. Never printed.
#[derive(Clone)]
pub struct FleetKeys {
    keys: Vec<Vec<u8>>,
}

impl fmt::Debug for FleetKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FleetKeys(<{} redacted>)", self.keys.len())
    }
}

impl FleetKeys {
    /// Keys separated by white space (a file's lines, or words of the
    /// variable): the first signs, each is accepted. `origin` names where
    /// they came from in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, FleetKeyError> {
        let keys: Vec<Vec<u8>> = text
            .split_whitespace()
            .map(|k| k.as_bytes().to_vec())
            .collect();
        if keys.is_empty() {
            return Err(FleetKeyError::Empty {
                origin: origin.to_owned(),
            });
        }
        if let Some((i, k)) = keys
            .iter()
            .enumerate()
            .find(|(_, k)| k.len() < MIN_KEY_BYTES)
        {
            return Err(FleetKeyError::Short {
                origin: origin.to_owned(),
                index: i + 1,
                len: k.len(),
            });
        }
        Ok(Self { keys })
    }

    /// The fleet key of `fleet`: from `env` (the value of
    /// [`FLEET_KEY_ENV`]) or from `file`, which group and others must not
    /// be able to read.
    pub fn load(
        env: Option<&str>,
        file: Option<&Path>,
        fleet: &str,
    ) -> Result<Self, FleetKeyError> {
        match (env, file) {
            (Some(_), Some(path)) => Err(FleetKeyError::Both(path.to_owned())),
            (Some(text), None) => Self::parse(text, FLEET_KEY_ENV),
            (None, Some(path)) => {
                use std::os::unix::fs::PermissionsExt;
                let read = |source| FleetKeyError::Read {
                    path: path.to_owned(),
                    source,
                };
                let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o7777;
                if mode & 0o077 != 0 {
                    return Err(FleetKeyError::Exposed {
                        path: path.to_owned(),
                        mode,
                    });
                }
                let text = std::fs::read_to_string(path).map_err(read)?;
                Self::parse(&text, &path.display().to_string())
            }
            (None, None) => Err(FleetKeyError::Missing {
                fleet: fleet.to_owned(),
            }),
        }
    }

    fn mac(key: &[u8], message: &[u8]) -> HmacSha256 {
        // HMAC takes a key of any length: `new_from_slice` cannot fail.
        let mut mac = match HmacSha256::new_from_slice(key) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts keys of any length"),
        };
        mac.update(message);
        mac
    }

    /// The header value signing `method path` with `body`, from instance
    /// `from` to instance `to`, at `time` (unix seconds) with `nonce`.
    pub fn sign(&self, call: &Call<'_>, time: u64, nonce: &str) -> String {
        let message = message(call, time, nonce);
        let tag = Self::mac(&self.keys[0], &message).finalize().into_bytes();
        format!(
            "{VERSION} {} {} {time} {nonce} {}",
            call.from,
            call.to,
            hex::encode(tag)
        )
    }

    /// Whether `tag` is the HMAC of `message` under one of the keys
    /// (each compared in constant time).
    fn verifies(&self, message: &[u8], tag: &[u8]) -> bool {
        let mut ok = false;
        for key in &self.keys {
            // `verify_slice` compares in constant time.
            ok |= Self::mac(key, message).verify_slice(tag).is_ok();
        }
        ok
    }
}

/// What a signature covers besides its time and nonce.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The sender's instance id.
    pub from: &'a str,
    /// The addressee's instance id.
    pub to: &'a str,
    pub method: &'a str,
    /// The path with its query, as sent.
    pub path: &'a str,
    pub body: &'a [u8],
}

fn message(call: &Call<'_>, time: u64, nonce: &str) -> Vec<u8> {
    let body = hex::encode(Sha256::digest(call.body));
    format!(
        "kici-fleet-auth {VERSION}\n{}\n{}\n{time}\n{nonce}\n{}\n{}\n{body}",
        call.from, call.to, call.method, call.path
    )
    .into_bytes()
}

/// Why a signed call was refused. Says nothing the caller could use to
/// forge one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the fleet signature is malformed: expected `{VERSION} FROM TO UNIX-TIME NONCE HMAC`")]
    Malformed,
    #[error("the fleet signature is addressed to host {to}, not this host")]
    NotForMe { to: String },
    #[error("the fleet signature's time is {skew} s from this host's clock (at most {} s accepted: check the hosts' clocks)", MAX_SKEW.as_secs())]
    Stale { skew: u64 },
    #[error("the fleet signature does not verify (a different fleet key, or an altered call)")]
    BadSignature,
    #[error("the fleet signature was used before (a replayed call)")]
    Replayed,
}

/// Nonces of calls accepted within the last two windows, by sender.
#[derive(Debug, Default)]
struct Seen {
    nonces: HashMap<(String, String), u64>,
    pruned_at: u64,
}

/// Checks a peer call's header against `call` (its own `from` is taken
/// from the header). On success, the sender's instance id.
pub fn verify(
    keys: &FleetKeys,
    me: &str,
    header: &str,
    method: &str,
    path: &str,
    body: &[u8],
    now: u64,
) -> Result<Verified, Refusal> {
    let words: Vec<&str> = header.split(' ').collect();
    let [version, from, to, time, nonce, tag] = words[..] else {
        return Err(Refusal::Malformed);
    };
    let time: u64 = time.parse().map_err(|_| Refusal::Malformed)?;
    let tag = hex::decode(tag).map_err(|_| Refusal::Malformed)?;
    let sane = |w: &str| !w.is_empty() && w.len() <= 64 && w.bytes().all(|b| b.is_ascii_graphic());
    if version != VERSION || !sane(from) || !sane(to) || !sane(nonce) {
        return Err(Refusal::Malformed);
    }
    if to != me {
        return Err(Refusal::NotForMe { to: to.to_owned() });
    }
    let skew = now.abs_diff(time);
    if skew > MAX_SKEW.as_secs() {
        return Err(Refusal::Stale { skew });
    }
    let call = Call {
        from,
        to,
        method,
        path,
        body,
    };
    if !keys.verifies(&message(&call, time, nonce), &tag) {
        return Err(Refusal::BadSignature);
    }
    Ok(Verified {
        from: from.to_owned(),
        nonce: nonce.to_owned(),
        time,
    })
}

/// A signature that verified, before its nonce is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub from: String,
    nonce: String,
    time: u64,
}

/// Unix seconds now (0 for a clock before 1970, which no signature
/// verifies against anyway).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// This host's side of the fleet's authentication: its keys, its identity,
/// the nonces it accepted, and how it verifies peers' TLS.
pub struct PeerAuth {
    keys: Arc<FleetKeys>,
    me: String,
    seen: Mutex<Seen>,
    tls: PeerTls,
}

impl fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerAuth")
            .field("me", &self.me)
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

/// How `https` peers are verified.
#[derive(Clone)]
pub enum PeerTls {
    Config(Arc<rustls::ClientConfig>),
    /// No trust anchor: `--fleet-ca-cert` was not given and the platform
    /// has no roots (why); `https` peers cannot be called.
    Unavailable(String),
}

impl PeerAuth {
    pub fn new(keys: FleetKeys, me: &str, tls: PeerTls) -> Self {
        Self {
            keys: Arc::new(keys),
            me: me.to_owned(),
            seen: Mutex::new(Seen::default()),
            tls,
        }
    }

    /// What signs this host's calls to instance `to`.
    pub fn signer_for(&self, to: &str) -> Arc<dyn kici_api::RequestSigner> {
        Arc::new(PeerSigner {
            keys: Arc::clone(&self.keys),
            from: self.me.clone(),
            to: to.to_owned(),
        })
    }

    /// The TLS configuration `https` peers are verified with.
    pub fn tls(&self) -> &PeerTls {
        &self.tls
    }

    /// Checks a call's header at `now`, and that its nonce is new; the
    /// sender's instance id.
    pub fn check(
        &self,
        header: &str,
        method: &str,
        path: &str,
        body: &[u8],
        now: u64,
    ) -> Result<String, Refusal> {
        let v = verify(&self.keys, &self.me, header, method, path, body, now)?;
        let keep = 2 * MAX_SKEW.as_secs();
        let mut seen = self.seen.lock();
        // At most once a second: the map only holds calls that verified.
        if seen.pruned_at != now {
            seen.nonces.retain(|_, t| t.saturating_add(keep) >= now);
            seen.pruned_at = now;
        }
        if seen
            .nonces
            .insert((v.from.clone(), v.nonce.clone()), v.time)
            .is_some()
        {
            return Err(Refusal::Replayed);
        }
        Ok(v.from)
    }
}

/// Signs each request of a peer client.
struct PeerSigner {
    keys: Arc<FleetKeys>,
    from: String,
    to: String,
}

impl kici_api::RequestSigner for PeerSigner {
    fn headers(&self, method: &str, path: &str, body: &[u8]) -> Vec<(String, String)> {
        let nonce = hex::encode(rand::random::<[u8; 16]>());
        let call = Call {
            from: &self.from,
            to: &self.to,
            method,
            path,
            body,
        };
        vec![(HEADER.to_owned(), self.keys.sign(&call, unix_now(), &nonce))]
    }
}

/// The TLS configuration for `https` peers: exactly the CA in `ca` when
/// given (`--fleet-ca-cert`), else the platform's trusted roots.
pub fn peer_tls(ca: Option<&Path>) -> Result<PeerTls, crate::daemon::tls::TlsError> {
    if let Some(ca) = ca {
        return Ok(PeerTls::Config(Arc::new(
            crate::daemon::tls::client_config(ca)?,
        )));
    }
    let loaded = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (_added, _skipped) = roots.add_parsable_certificates(loaded.certs);
    if roots.is_empty() {
        let why = loaded
            .errors
            .first()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "the platform's certificate store is empty".to_owned());
        return Ok(PeerTls::Unavailable(format!(
            "no trusted root certificates ({why}); set --fleet-ca-cert to the CA of the hosts' certificates"
        )));
    }
    Ok(PeerTls::Config(Arc::new(
        crate::daemon::tls::client_config_with_roots(roots)?,
    )))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const KEY: &str = "0123456789abcdef0123456789abcdef-fleet";
    const OTHER: &str = "fedcba9876543210fedcba9876543210-other";

    fn keys(text: &str) -> FleetKeys {
        FleetKeys::parse(text, "test").unwrap()
    }

    fn call<'a>(path: &'a str, body: &'a [u8]) -> Call<'a> {
        Call {
            from: "aaaa0001",
            to: "bbbb0002",
            method: "POST",
            path,
            body,
        }
    }

    fn check(
        k: &FleetKeys,
        header: &str,
        path: &str,
        body: &[u8],
        now: u64,
    ) -> Result<Verified, Refusal> {
        verify(k, "bbbb0002", header, "POST", path, body, now)
    }

    #[test]
    fn a_signed_call_verifies_and_names_its_sender() {
        let k = keys(KEY);
        let h = k.sign(&call("/v1/agents/a/registered", b"{}"), 1000, "n1");
        let v = check(&k, &h, "/v1/agents/a/registered", b"{}", 1000).unwrap();
        assert_eq!(v.from, "aaaa0001");
        assert!(h.starts_with("v1 aaaa0001 bbbb0002 1000 n1 "), "{h}");
        assert!(!h.contains(KEY));
    }

    #[test]
    fn another_key_is_refused() {
        let h = keys(OTHER).sign(&call("/v1/status?local=true", b""), 1000, "n1");
        assert_eq!(
            check(&keys(KEY), &h, "/v1/status?local=true", b"", 1000),
            Err(Refusal::BadSignature)
        );
    }

    #[test]
    fn a_tampered_path_query_method_or_body_is_refused() {
        let k = keys(KEY);
        let h = k.sign(&call("/v1/agents/a1", b"{\"x\":1}"), 1000, "n1");
        for (path, body) in [
            ("/v1/agents/a2", &b"{\"x\":1}"[..]),
            ("/v1/agents/a1?all=true", b"{\"x\":1}"),
            ("/v1/agents/a1", b"{\"x\":2}"),
            ("/v1/agents/a1", b""),
        ] {
            assert_eq!(
                check(&k, &h, path, body, 1000),
                Err(Refusal::BadSignature),
                "{path}"
            );
        }
        assert_eq!(
            verify(
                &k,
                "bbbb0002",
                &h,
                "DELETE",
                "/v1/agents/a1",
                b"{\"x\":1}",
                1000
            ),
            Err(Refusal::BadSignature)
        );
        // The words of the header are signed too: a changed time or nonce.
        let moved = h.replace(" 1000 ", " 1001 ");
        assert_eq!(
            check(&k, &moved, "/v1/agents/a1", b"{\"x\":1}", 1000),
            Err(Refusal::BadSignature)
        );
        let renonced = h.replace(" n1 ", " n2 ");
        assert_eq!(
            check(&k, &renonced, "/v1/agents/a1", b"{\"x\":1}", 1000),
            Err(Refusal::BadSignature)
        );
    }

    #[test]
    fn a_call_for_another_host_is_refused_even_with_its_from_and_to_swapped() {
        let k = keys(KEY);
        let h = k.sign(&call("/v1/status?local=true", b""), 1000, "n1");
        assert_eq!(
            verify(
                &k,
                "cccc0003",
                &h,
                "POST",
                "/v1/status?local=true",
                b"",
                1000
            ),
            Err(Refusal::NotForMe {
                to: "bbbb0002".into()
            })
        );
        let swapped = h.replace("aaaa0001 bbbb0002", "bbbb0002 aaaa0001");
        assert!(verify(
            &k,
            "aaaa0001",
            &swapped,
            "POST",
            "/v1/status?local=true",
            b"",
            1000
        )
        .is_err());
    }

    #[test]
    fn a_stale_or_future_time_is_refused_at_the_edge_of_the_window() {
        let k = keys(KEY);
        let h = k.sign(&call("/p", b""), 1000, "n1");
        assert!(check(&k, &h, "/p", b"", 1030).is_ok());
        assert!(check(&k, &h, "/p", b"", 970).is_ok());
        assert_eq!(
            check(&k, &h, "/p", b"", 1031),
            Err(Refusal::Stale { skew: 31 })
        );
        assert_eq!(
            check(&k, &h, "/p", b"", 969),
            Err(Refusal::Stale { skew: 31 })
        );
    }

    #[test]
    fn malformed_headers_are_refused() {
        let k = keys(KEY);
        let good = k.sign(&call("/p", b""), 1000, "n1");
        for bad in [
            "",
            "Bearer x",
            &good.replacen("v1", "v2", 1),
            &good.replace(" 1000 ", " soon "),
            &format!("{good} extra"),
            &good[..good.len() - 1],
        ] {
            assert!(check(&k, bad, "/p", b"", 1000).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_replayed_call_is_refused_once_its_nonce_was_seen() {
        let auth = PeerAuth::new(keys(KEY), "bbbb0002", PeerTls::Unavailable(String::new()));
        let h = keys(KEY).sign(&call("/v1/agents/a1", b""), 1000, "n1");
        assert_eq!(
            auth.check(&h, "POST", "/v1/agents/a1", b"", 1000).unwrap(),
            "aaaa0001"
        );
        assert_eq!(
            auth.check(&h, "POST", "/v1/agents/a1", b"", 1005),
            Err(Refusal::Replayed)
        );
        // Replayed to another path: refused by the signature, nonce or not.
        assert_eq!(
            auth.check(&h, "POST", "/v1/agents/a2", b"", 1005),
            Err(Refusal::BadSignature)
        );
        // Long after, the nonce is forgotten — and the time is stale.
        assert_eq!(
            auth.check(&h, "POST", "/v1/agents/a1", b"", 1100),
            Err(Refusal::Stale { skew: 100 })
        );
    }

    #[test]
    fn during_a_rotation_both_keys_verify_and_the_first_signs() {
        let rotating = keys(&format!("{KEY}\n{OTHER}\n"));
        let by_old = keys(KEY).sign(&call("/p", b""), 1000, "n1");
        let by_new = keys(OTHER).sign(&call("/p", b""), 1000, "n2");
        assert!(check(&rotating, &by_old, "/p", b"", 1000).is_ok());
        assert!(check(&rotating, &by_new, "/p", b"", 1000).is_ok());
        let signed = rotating.sign(&call("/p", b""), 1000, "n3");
        assert!(check(&keys(KEY), &signed, "/p", b"", 1000).is_ok());
        assert!(check(&keys(OTHER), &signed, "/p", b"", 1000).is_err());
    }

    #[test]
    fn keys_shorter_than_32_bytes_or_none_are_refused_by_origin() {
        let e = FleetKeys::parse("short", FLEET_KEY_ENV).unwrap_err();
        assert_eq!(
            e.to_string(),
            "KICI_SCALER_FLEET_KEY: key 1 has 5 bytes; a fleet key must have at least 32 (e.g. `openssl rand -hex 32`)"
        );
        let e = FleetKeys::parse(&format!("{KEY} tiny"), "f").unwrap_err();
        assert!(e.to_string().starts_with("f: key 2 has 4 bytes"), "{e}");
        assert!(matches!(
            FleetKeys::parse(" \n", "f"),
            Err(FleetKeyError::Empty { .. })
        ));
        assert!(!format!("{:?}", keys(KEY)).contains("0123"));
    }

    #[test]
    fn a_key_file_others_can_read_is_refused_naming_its_path_and_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.key");
        std::fs::write(&path, format!("{KEY}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = FleetKeys::load(None, Some(&path), "default").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&path.display().to_string()) && text.contains("0644"),
            "{text}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(FleetKeys::load(None, Some(&path), "default").is_ok());
        assert!(matches!(
            FleetKeys::load(Some(KEY), Some(&path), "default"),
            Err(FleetKeyError::Both(_))
        ));
        let missing = FleetKeys::load(None, None, "ci").unwrap_err().to_string();
        assert!(
            missing.contains("KICI_SCALER_FLEET_KEY") && missing.contains("--fleet-key-file"),
            "{missing}"
        );
    }
}
