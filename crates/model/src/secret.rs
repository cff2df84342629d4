//! A value that must never reach a log line: agent tokens, API tokens.

use sha2::{Digest, Sha256};
use std::fmt;
use subtle::ConstantTimeEq;

/// A secret string, kept out of every log line, panic message and error
/// string: `Debug` and `Display` redact it; the only way to read it is
/// [`Secret::expose`], so every use is visible in review.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Constant-time equality with `presented` (both sides hashed first, so
    /// neither the content nor the length leaks through timing).
    pub fn matches(&self, presented: &str) -> bool {
        let hash = |s: &str| -> [u8; 32] { Sha256::digest(s.as_bytes()).into() };
        bool::from(hash(&self.0).ct_eq(&hash(presented)))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_formats_its_value() {
        let s = Secret::new("kat_0123");
        assert_eq!(format!("{s} {s:?}"), "<redacted> Secret(<redacted>)");
        assert_eq!(s.expose(), "kat_0123");
    }

    #[test]
    fn matches_only_the_same_value() {
        let s = Secret::new("kat_deadbeef");
        assert!(s.matches("kat_deadbeef"));
        assert!(!s.matches("kat_deadbeeF"));
        assert!(!s.matches(""));
    }
}
