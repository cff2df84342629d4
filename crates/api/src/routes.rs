//! Every route of the control API, and the paths the client builds.

/// One route: its method and its path template (OpenAPI spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Route {
    /// Upper case: `GET`, `POST`, `DELETE`.
    pub method: &'static str,
    /// `/v1/agents/{id}`.
    pub path: &'static str,
}

const fn route(method: &'static str, path: &'static str) -> Route {
    Route { method, path }
}

/// Every route the daemon serves on its control API listener (the agent
/// gateway's `/ws` has a listener of its own). The client has a method for
/// each; the daemon's OpenAPI document lists exactly these.
pub const ROUTES: &[Route] = &[
    route("POST", "/v1/scale"),
    route("DELETE", "/v1/scale/{jobId}"),
    route("POST", "/v1/jobs"),
    route("GET", "/v1/jobs"),
    route("GET", "/v1/jobs/{id}"),
    route("DELETE", "/v1/jobs/{id}"),
    route("GET", "/v1/jobs/{id}/logs"),
    route("POST", "/v1/agents/{id}/registered"),
    route("POST", "/v1/agents/{id}/config-ack"),
    route("POST", "/v1/agents/{id}/job-started"),
    route("POST", "/v1/agents/{id}/job-complete"),
    route("POST", "/v1/agents/{id}/disconnected"),
    route("GET", "/v1/agents"),
    route("GET", "/v1/agents/{id}"),
    route("DELETE", "/v1/agents/{id}"),
    route("POST", "/v1/scalers/{name}/cordon"),
    route("POST", "/v1/scalers/{name}/uncordon"),
    route("POST", "/v1/scalers/{name}/drain"),
    route("GET", "/v1/status"),
    route("POST", "/v1/reload"),
    route("GET", "/v1/events"),
    route("GET", "/v1/fleet"),
    route("GET", "/metrics"),
    route("GET", "/healthz"),
    route("GET", "/readyz"),
    route("GET", "/openapi.json"),
];

/// Percent-encodes a path segment (ids and names are plain, but a typo
/// must not turn into another route).
pub fn path_segment(raw: &str) -> String {
    let mut s = String::with_capacity(raw.len());
    for b in raw.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            s.push(char::from(b));
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(
            path_segment("scaler-bare-metal-0a1b2c3d"),
            "scaler-bare-metal-0a1b2c3d"
        );
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn routes_are_listed_once() {
        let mut seen = std::collections::HashSet::new();
        for r in ROUTES {
            assert!(seen.insert(r), "{r:?} twice");
        }
    }
}
