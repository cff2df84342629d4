//! Image references: parsed and validated the way the Engine does
//! (distribution's `reference` grammar), so a malformed `image:` is a config
//! error at load time instead of a failed pull at the first spawn.
//!
//! ```text
//! reference  := name [ ":" tag ] [ "@" digest ]
//! name       := [ domain "/" ] path-component ( "/" path-component )*
//! domain     := host [ ":" port ]      (a first component with ".", ":" or "localhost")
//! path-comp  := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
//! tag        := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
//! digest     := algorithm ":" hex{32,}
//! ```
//!
//! Without a domain the registry is Docker Hub (`docker.io`, with
//! `library/` for one-component names); without a tag or digest the tag is
//! `latest`. The pull asks for exactly one tag: an empty `tag` parameter
//! would make the Engine pull every tag of the repository.

use std::fmt;

/// Docker Hub's registry host as references name it.
pub const DOCKER_HUB: &str = "docker.io";
/// The key Docker's `config.json` stores Docker Hub credentials under.
pub const DOCKER_HUB_AUTH_KEY: &str = "https://index.docker.io/v1/";

const MAX_NAME_LEN: usize = 255;

/// A valid image reference, split into its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageReference {
    /// As written in the configuration (what create and inspect are given).
    original: String,
    /// The registry host (and port); `None` = Docker Hub.
    domain: Option<String>,
    /// The repository path below the domain.
    path: String,
    tag: Option<String>,
    digest: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid image reference {input:?}: {reason}")]
pub struct ReferenceError {
    pub input: String,
    pub reason: String,
}

impl ImageReference {
    pub fn parse(input: &str) -> Result<Self, ReferenceError> {
        let fail = |reason: &str| ReferenceError {
            input: input.to_owned(),
            reason: reason.to_owned(),
        };
        if input.is_empty() {
            return Err(fail("empty"));
        }
        if input.chars().any(|c| c.is_whitespace()) {
            return Err(fail("contains whitespace"));
        }
        let (rest, digest) = match input.split_once('@') {
            Some((rest, digest)) => {
                check_digest(digest).map_err(|r| fail(&r))?;
                (rest, Some(digest.to_owned()))
            }
            None => (input, None),
        };
        // A tag is after the last ':' that follows the last '/': a ':' before
        // it belongs to the domain's port.
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let at = last_slash + i;
                let tag = &rest[at + 1..];
                check_tag(tag).map_err(|r| fail(&r))?;
                (&rest[..at], Some(tag.to_owned()))
            }
            None => (rest, None),
        };
        if name.is_empty() {
            return Err(fail("no repository name"));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(fail("repository name longer than 255 characters"));
        }
        let (domain, path) = match name.split_once('/') {
            Some((first, path))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                check_domain(first).map_err(|r| fail(&r))?;
                (Some(first.to_owned()), path)
            }
            _ => (None, name),
        };
        if path.is_empty() {
            return Err(fail("no repository path after the registry"));
        }
        for component in path.split('/') {
            check_path_component(component).map_err(|r| fail(&r))?;
        }
        Ok(Self {
            original: input.to_owned(),
            domain,
            path: path.to_owned(),
            tag,
            digest,
        })
    }

    /// The reference as configured.
    pub fn as_str(&self) -> &str {
        &self.original
    }

    /// The registry host (and port) credentials are looked up for.
    pub fn registry(&self) -> &str {
        self.domain.as_deref().unwrap_or(DOCKER_HUB)
    }

    /// The repository without tag or digest, as the pull's `fromImage`.
    pub fn repository(&self) -> String {
        match &self.domain {
            Some(domain) => format!("{domain}/{}", self.path),
            None => self.path.clone(),
        }
    }

    /// The pull's `tag` parameter: the digest when pinned, else the tag,
    /// else `latest`.
    pub fn pull_tag(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// Pinned by digest: the content cannot change, so a present image
    /// never needs a pull (even under `Always`).
    pub fn is_digest_pinned(&self) -> bool {
        self.digest.is_some()
    }
}

impl fmt::Display for ImageReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.original)
    }
}

fn check_tag(tag: &str) -> Result<(), String> {
    let mut chars = tag.chars();
    let Some(first) = chars.next() else {
        return Err("empty tag after ':'".into());
    };
    if !(first.is_ascii_alphanumeric() || first == '_') {
        return Err(format!(
            "tag {tag:?} must start with a letter, digit or '_'"
        ));
    }
    if tag.len() > 128 {
        return Err(format!("tag {tag:?} is longer than 128 characters"));
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')) {
        return Err(format!(
            "tag {tag:?} may contain only letters, digits, '_', '.' and '-'"
        ));
    }
    Ok(())
}

fn check_digest(digest: &str) -> Result<(), String> {
    let Some((algorithm, hex)) = digest.split_once(':') else {
        return Err(format!("digest {digest:?} is not <algorithm>:<hex>"));
    };
    let algorithm_ok = !algorithm.is_empty()
        && algorithm
            .split(['-', '_', '+', '.'])
            .all(|part| part.chars().next().is_some_and(|c| c.is_ascii_alphabetic()))
        && algorithm
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '+' | '.'));
    if !algorithm_ok {
        return Err(format!("digest algorithm {algorithm:?} is malformed"));
    }
    if hex.len() < 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "digest {digest:?} needs at least 32 hexadecimal characters"
        ));
    }
    if algorithm == "sha256" && hex.len() != 64 {
        return Err(format!(
            "sha256 digest {digest:?} must have 64 hexadecimal characters"
        ));
    }
    Ok(())
}

fn check_domain(domain: &str) -> Result<(), String> {
    let (host, port) = match domain.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (domain, None),
    };
    if let Some(port) = port {
        if port.is_empty() || !port.chars().all(|c| c.is_ascii_digit()) {
            return Err(format!("registry port {port:?} is not a number"));
        }
    }
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    if host.is_empty() || !host.split('.').all(label_ok) {
        return Err(format!("registry host {host:?} is not a valid host name"));
    }
    Ok(())
}

fn check_path_component(component: &str) -> Result<(), String> {
    let bad = || {
        Err(format!(
            "repository path component {component:?} must be lowercase letters and digits, \
             separated by '.', '_', '__' or dashes"
        ))
    };
    let bytes = component.as_bytes();
    if bytes.is_empty() {
        return Err("empty repository path component (a doubled or trailing '/')".into());
    }
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
        return bad();
    }
    let mut i = 0;
    while i < bytes.len() {
        if alnum(bytes[i]) {
            i += 1;
            continue;
        }
        // A separator run: ".", "_", "__" or one or more "-".
        let start = i;
        while i < bytes.len() && !alnum(bytes[i]) {
            i += 1;
        }
        let sep = &component[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|b| b == b'-');
        if !ok {
            return bad();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn parts_of_valid_references() {
        let r = ImageReference::parse("busybox").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.pull_tag()),
            ("docker.io", "busybox".into(), "latest")
        );
        let r = ImageReference::parse("127.0.0.1:5000/kici/agent:v1.2-rc_3").unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "127.0.0.1:5000/kici/agent");
        assert_eq!(r.pull_tag(), "v1.2-rc_3");
        let r = ImageReference::parse("localhost/agent").unwrap();
        assert_eq!(r.registry(), "localhost");
        let digest = format!("sha256:{}", "a".repeat(64));
        let r = ImageReference::parse(&format!("ghcr.io/o/r:t@{digest}")).unwrap();
        assert_eq!(r.pull_tag(), digest);
        assert!(r.is_digest_pinned());
        assert_eq!(r.repository(), "ghcr.io/o/r");
        let r = ImageReference::parse("my-org/my__image.x:1").unwrap();
        assert_eq!(r.registry(), "docker.io");
        assert_eq!(r.as_str(), "my-org/my__image.x:1");
    }

    #[test]
    fn malformed_references_say_why() {
        for (input, why) in [
            ("", "empty"),
            ("Busybox", "lowercase"),
            ("busy box", "whitespace"),
            ("busybox:", "empty tag"),
            ("busybox:-x", "must start"),
            ("busybox:a/b", "not a number"),
            ("reg.io:port/x", "not a number"),
            ("reg.io/", "no repository path"),
            ("a//b", "empty repository path component"),
            ("a/b/", "empty repository path component"),
            ("a_-b", "lowercase"),
            ("busybox@sha256:abc", "at least 32"),
            (
                &format!("busybox@sha256:{}", "a".repeat(40)),
                "64 hexadecimal",
            ),
            ("busybox@md5", "<algorithm>:<hex>"),
            ("-reg.io/x", "not a valid host name"),
            ("bad_host.io/x", "not a valid host name"),
        ] {
            let err = ImageReference::parse(input).expect_err(input);
            assert!(err.reason.contains(why), "{input:?}: {}", err.reason);
            assert!(err.to_string().contains(&format!("{input:?}")));
        }
        let long = "a".repeat(256);
        assert!(ImageReference::parse(&long).is_err());
        let long_tag = format!("a:{}", "t".repeat(129));
        assert!(ImageReference::parse(&long_tag).is_err());
    }
}
