//! The webhook signature: how a receiver knows a request came from this
//! daemon and is recent.
//!
//! Each webhook request carries
//!
//! - `X-Kici-Timestamp: <unix seconds>` — when it was signed (each retry is
//!   signed afresh);
//! - `X-Kici-Signature: sha256=<hex>` — HMAC-SHA256, keyed with the secret
//!   from the webhook's `secretEnv`, over the bytes `<timestamp>.<body>`
//!   (the decimal timestamp exactly as sent, a dot, the raw body).
//!
//! A receiver recomputes the HMAC over the raw body it read (before any
//! JSON parsing), compares in constant time, and refuses a timestamp more
//! than [`REPLAY_WINDOW`] (5 minutes) away from its own clock, either way.
//! Within the window a captured request could be replayed; the event's
//! `requestId` makes a replay a duplicate the receiver already deduplicates.
//! [`verify_signature`] does all of that.
//!
//! ```
//! use kici_provision::signature::{sign, verify_signature, REPLAY_WINDOW};
//! let body = br#"{"event":"scale-down"}"#;
//! let sig = sign(b"s3cret", 1_764_638_100, body);
//! assert!(sig.starts_with("sha256="));
//! verify_signature(b"s3cret", "1764638100", &sig, body, 1_764_638_130, REPLAY_WINDOW).unwrap();
//! assert!(verify_signature(b"other", "1764638100", &sig, body, 1_764_638_130, REPLAY_WINDOW).is_err());
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::time::Duration;

pub const SIGNATURE_HEADER: &str = "X-Kici-Signature";
pub const TIMESTAMP_HEADER: &str = "X-Kici-Timestamp";
/// `scale-up` or `scale-down` (also in the body; here for routing).
pub const EVENT_HEADER: &str = "X-Kici-Event";
/// The event's `requestId` (also in the body).
pub const REQUEST_ID_HEADER: &str = "X-Kici-Request-Id";
/// How far a receiver should accept a timestamp from its own clock.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(300);

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &[u8], timestamp: &str, body: &[u8]) -> HmacSha256 {
    // HMAC accepts a key of any length (a long key is hashed first), so
    // `new_from_slice` never fails for HMAC-SHA256; `KeyInit::new` takes a
    // fixed-size array instead, hence the slice constructor.
    #[allow(clippy::expect_used)]
    let mut mac =
        HmacSha256::new_from_slice(secret).expect("HMAC-SHA256 accepts keys of any length");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The `X-Kici-Signature` value for `body` signed at `timestamp` (unix
/// seconds).
pub fn sign(secret: &[u8], timestamp: u64, body: &[u8]) -> String {
    let tag = mac(secret, &timestamp.to_string(), body)
        .finalize()
        .into_bytes();
    format!("sha256={}", hex::encode(tag))
}

/// Why a signature was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the timestamp header is not unix seconds")]
    BadTimestamp,
    #[error("the signature header is not sha256=<64 hex>")]
    BadSignatureFormat,
    #[error("the timestamp is outside the replay window")]
    Stale,
    #[error("the signature does not match")]
    Mismatch,
}

/// Checks a request's headers against its raw body, at `now` (unix seconds),
/// accepting timestamps within `window` of `now`.
pub fn verify_signature(
    secret: &[u8],
    timestamp_header: &str,
    signature_header: &str,
    body: &[u8],
    now: u64,
    window: Duration,
) -> Result<(), SignatureError> {
    if timestamp_header.is_empty() || !timestamp_header.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SignatureError::BadTimestamp);
    }
    let ts: u64 = timestamp_header
        .parse()
        .map_err(|_| SignatureError::BadTimestamp)?;
    let hex_tag = signature_header
        .strip_prefix("sha256=")
        .ok_or(SignatureError::BadSignatureFormat)?;
    let mut tag = [0u8; 32];
    hex::decode_to_slice(hex_tag, &mut tag).map_err(|_| SignatureError::BadSignatureFormat)?;
    if ts.abs_diff(now) > window.as_secs() {
        return Err(SignatureError::Stale);
    }
    // `verify_slice` compares in constant time.
    mac(secret, timestamp_header, body)
        .verify_slice(&tag)
        .map_err(|_| SignatureError::Mismatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answer() {
        // Independently: printf '%s' '1700000000.{}' | openssl dgst -sha256 -hmac key
        assert_eq!(
            sign(b"key", 1_700_000_000, b"{}"),
            "sha256=9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae"
        );
    }

    #[test]
    fn refuses_tampering_staleness_and_garbage() {
        let body = b"{\"event\":\"scale-up\"}";
        let sig = sign(b"k", 1000, body);
        let ok = |ts: &str, sig: &str, body: &[u8], now: u64| {
            verify_signature(b"k", ts, sig, body, now, REPLAY_WINDOW)
        };
        assert_eq!(ok("1000", &sig, body, 1000), Ok(()));
        assert_eq!(ok("1000", &sig, body, 1300), Ok(()));
        assert_eq!(ok("1000", &sig, body, 700), Ok(()));
        assert_eq!(ok("1000", &sig, body, 1301), Err(SignatureError::Stale));
        assert_eq!(ok("1001", &sig, body, 1000), Err(SignatureError::Mismatch));
        assert_eq!(ok("1000", &sig, b"{}", 1000), Err(SignatureError::Mismatch));
        assert_eq!(
            ok("10x", &sig, body, 1000),
            Err(SignatureError::BadTimestamp)
        );
        assert_eq!(
            ok("+1000", &sig, body, 1000),
            Err(SignatureError::BadTimestamp)
        );
        assert_eq!(
            ok("1000", &sig[7..], body, 1000),
            Err(SignatureError::BadSignatureFormat)
        );
        assert_eq!(
            verify_signature(b"other", "1000", &sig, body, 1000, REPLAY_WINDOW),
            Err(SignatureError::Mismatch)
        );
    }
}
