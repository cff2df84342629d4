//! Every route of the control API, and the paths the client builds.
//!
//! The table also says, per route, whether the hosts of a fleet call it on
//! each other ([`PeerCall`]): what a host accepts the fleet's signature for
//! instead of the API token, and which calls are about one agent or one
//! request and so are answered by the host that owns it. The daemon reads
//! these flags from the route its router matched, never from the path's
//! spelling.

/// One route: its method, its path template (OpenAPI spelling) and whether
/// fleet hosts call it on each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Route {
    /// Upper case: `GET`, `POST`, `DELETE`.
    pub method: &'static str,
    /// `/v1/agents/{id}`.
    pub path: &'static str,
    /// Whether (and how) a fleet host calls it on another.
    pub peer: PeerCall,
}

/// Whether fleet hosts call a route on each other (with the fleet's
/// signature instead of the API token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerCall {
    /// Never: an operator's (or orchestrator's) call, behind the API token.
    Never,
    /// A call about one agent or one request, identified by path parameter
    /// `param`: only the host that owns it can carry it out, so any host
    /// carries it there.
    Owner { owned: Owned, param: &'static str },
    /// Always (a job's log stream, which a host relays from the job's
    /// host).
    Always,
    /// Only with `local=true`: a host's own part of a fleet-wide read.
    Local,
}

/// What an owner-only call is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owned {
    /// An agent: its host owns it.
    Agent,
    /// A scale request or a standalone job: the host holding it owns it.
    Job,
}

const fn route(method: &'static str, path: &'static str) -> Route {
    Route {
        method,
        path,
        peer: PeerCall::Never,
    }
}

impl Route {
    /// This route, called by hosts on each other as `peer` says.
    const fn peer(self, peer: PeerCall) -> Self {
        Route { peer, ..self }
    }

    /// This route, about the agent named by path parameter `param`.
    const fn agent(self, param: &'static str) -> Self {
        self.peer(PeerCall::Owner {
            owned: Owned::Agent,
            param,
        })
    }

    /// This route, about the request (job) named by path parameter
    /// `param`.
    const fn job(self, param: &'static str) -> Self {
        self.peer(PeerCall::Owner {
            owned: Owned::Job,
            param,
        })
    }

    /// The route `method path_template` of [`ROUTES`] (method in any case).
    pub fn find(method: &str, path_template: &str) -> Option<&'static Route> {
        ROUTES
            .iter()
            .find(|r| r.path == path_template && r.method.eq_ignore_ascii_case(method))
    }

    /// Whether a fleet host may make this call on another, with query
    /// `query`: the fleet's signature is accepted for it.
    pub fn peer_callable(&self, query: Option<&str>) -> bool {
        match self.peer {
            PeerCall::Never => false,
            PeerCall::Owner { .. } | PeerCall::Always => true,
            PeerCall::Local => query
                .unwrap_or_default()
                .split('&')
                .any(|p| p == "local" || p == "local=true"),
        }
    }

    /// What this call is about, when only its owner can carry it out.
    pub fn owned(&self) -> Option<(Owned, &'static str)> {
        match self.peer {
            PeerCall::Owner { owned, param } => Some((owned, param)),
            _ => None,
        }
    }
}

/// Every route the daemon serves on its control API listener (the agent
/// gateway's `/ws` has a listener of its own). The client has a method for
/// each; the daemon's OpenAPI document lists exactly these.
pub const ROUTES: &[Route] = &[
    route("POST", "/v1/scale"),
    route("DELETE", "/v1/scale/{jobId}").job("jobId"),
    route("POST", "/v1/jobs"),
    route("GET", "/v1/jobs"),
    route("GET", "/v1/jobs/{id}").job("id"),
    route("DELETE", "/v1/jobs/{id}").job("id"),
    route("GET", "/v1/jobs/{id}/logs").peer(PeerCall::Always),
    route("POST", "/v1/agents/{id}/registered").agent("id"),
    route("POST", "/v1/agents/{id}/config-ack").agent("id"),
    route("POST", "/v1/agents/{id}/job-started").agent("id"),
    route("POST", "/v1/agents/{id}/job-complete").agent("id"),
    route("POST", "/v1/agents/{id}/disconnected").agent("id"),
    route("GET", "/v1/agents").peer(PeerCall::Local),
    route("GET", "/v1/agents/{id}").agent("id"),
    route("DELETE", "/v1/agents/{id}").agent("id"),
    route("POST", "/v1/scalers/{name}/cordon"),
    route("POST", "/v1/scalers/{name}/uncordon"),
    route("POST", "/v1/scalers/{name}/drain"),
    route("GET", "/v1/status").peer(PeerCall::Local),
    route("POST", "/v1/reload"),
    route("GET", "/v1/events").peer(PeerCall::Local),
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
            assert!(seen.insert((r.method, r.path)), "{r:?} twice");
        }
    }

    #[test]
    fn an_owner_only_route_names_its_path_parameter() {
        for r in ROUTES {
            if let Some((_, param)) = r.owned() {
                assert!(
                    r.path.contains(&format!("{{{param}}}")),
                    "{r:?}: no parameter {param} in its path"
                );
            }
            if r.peer == PeerCall::Local {
                assert_eq!(r.method, "GET", "{r:?}: only reads have a local part");
            }
        }
    }

    /// The calls hosts make on each other, listed here by hand: a route
    /// added to the table with the wrong flag fails this test.
    #[test]
    fn the_fleet_signature_opens_only_the_calls_hosts_make_on_each_other() {
        let callable = |m: &str, p: &str, q: Option<&str>| {
            Route::find(m, p)
                .unwrap_or_else(|| panic!("{m} {p} is not a route"))
                .peer_callable(q)
        };
        let mut peer: Vec<(&str, &str)> = ROUTES
            .iter()
            .filter(|r| r.peer != PeerCall::Never)
            .map(|r| (r.method, r.path))
            .collect();
        peer.sort();
        assert_eq!(
            peer,
            [
                ("DELETE", "/v1/agents/{id}"),
                ("DELETE", "/v1/jobs/{id}"),
                ("DELETE", "/v1/scale/{jobId}"),
                ("GET", "/v1/agents"),
                ("GET", "/v1/agents/{id}"),
                ("GET", "/v1/events"),
                ("GET", "/v1/jobs/{id}"),
                ("GET", "/v1/jobs/{id}/logs"),
                ("GET", "/v1/status"),
                ("POST", "/v1/agents/{id}/config-ack"),
                ("POST", "/v1/agents/{id}/disconnected"),
                ("POST", "/v1/agents/{id}/job-complete"),
                ("POST", "/v1/agents/{id}/job-started"),
                ("POST", "/v1/agents/{id}/registered"),
            ]
        );
        assert!(callable("POST", "/v1/agents/{id}/registered", None));
        assert!(callable("delete", "/v1/jobs/{id}", None));
        assert!(callable("GET", "/v1/jobs/{id}/logs", None));
        assert!(callable("GET", "/v1/status", Some("local=true")));
        assert!(callable("GET", "/v1/agents", Some("all=true&local=true")));
        assert!(callable("GET", "/v1/events", Some("local")));
        // Operator calls stay behind the API token.
        assert!(!callable("GET", "/v1/status", None));
        assert!(!callable("GET", "/v1/status", Some("local=false")));
        assert!(!callable("POST", "/v1/reload", None));
        assert!(!callable("POST", "/v1/scale", None));
        assert!(!callable("POST", "/v1/jobs", None));
        assert!(!callable("POST", "/v1/scalers/{name}/drain", None));
        assert!(!callable("GET", "/v1/fleet", Some("local=true")));
        assert!(!callable("GET", "/metrics", Some("local=true")));
        assert_eq!(Route::find("POST", "/v1/jobs/{id}/logs"), None);
    }

    #[test]
    fn only_calls_about_one_agent_or_one_request_go_to_an_owner() {
        let owned = |m: &str, p: &str| Route::find(m, p).and_then(Route::owned);
        assert_eq!(
            owned("POST", "/v1/agents/{id}/registered"),
            Some((Owned::Agent, "id"))
        );
        assert_eq!(owned("GET", "/v1/agents/{id}"), Some((Owned::Agent, "id")));
        assert_eq!(owned("GET", "/v1/agents"), None);
        assert_eq!(
            owned("DELETE", "/v1/scale/{jobId}"),
            Some((Owned::Job, "jobId"))
        );
        assert_eq!(owned("POST", "/v1/scale"), None);
        assert_eq!(owned("GET", "/v1/jobs/{id}"), Some((Owned::Job, "id")));
        assert_eq!(owned("DELETE", "/v1/jobs/{id}"), Some((Owned::Job, "id")));
        assert_eq!(owned("GET", "/v1/jobs/{id}/logs"), None);
        assert_eq!(owned("GET", "/v1/status"), None);
    }
}
