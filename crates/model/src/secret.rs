//! A value that must never reach a log line: agent tokens, API tokens.

use std::fmt;

/// A secret string. `Debug` and `Display` redact it; the only way to read it
/// is [`Secret::expose`], so every use is visible in review.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
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
}
