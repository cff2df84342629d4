//! The agent's bootstrap: the `KICI_*` environment an agent starts with
//! (KiCI's agent bootstrap contract), parsed and checked the way the KiCI
//! agent checks it, plus the labels an agent registers with.
//!
//! Every problem is reported at once ([`BootstrapError`] lists them all).
//! The token never appears in an error or in `Debug` output.

use crate::token::AgentToken;
use kici_model::contract::agent_accepts;
use kici_model::{AgentId, BackpressureMode, Label, LabelSet, Role, Roles};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

pub const ORCHESTRATOR_URL: &str = "KICI_ORCHESTRATOR_URL";
pub const AGENT_ID: &str = "KICI_AGENT_ID";
pub const LABELS: &str = "KICI_LABELS";
pub const AGENT_TOKEN: &str = "KICI_AGENT_TOKEN";
pub const SCALER_MANAGED: &str = "KICI_SCALER_MANAGED";
pub const ROLES: &str = "KICI_ROLES";
pub const IDLE_TIMEOUT: &str = "KICI_SCALER_IDLE_TIMEOUT";
pub const PENDING_DISPATCH_TIMEOUT: &str = "KICI_SCALER_PENDING_DISPATCH_TIMEOUT";
pub const BACKPRESSURE_MODE: &str = "KICI_BACKPRESSURE_MODE";
pub const MAX_RECONNECT_DELAY: &str = "KICI_AGENT_MAX_RECONNECT_DELAY_MS";
pub const LOG_LEVEL: &str = "KICI_LOG_LEVEL";
pub const DEV: &str = "KICI_DEV";

/// The contract's defaults (milliseconds in the environment).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_millis(5_000);
pub const DEFAULT_PENDING_DISPATCH_TIMEOUT: Duration = Duration::from_millis(60_000);
pub const DEFAULT_MAX_RECONNECT_DELAY: Duration = Duration::from_millis(60_000);

/// `KICI_ORCHESTRATOR_URL`'s scheme: the gateway is plain `ws` today; `wss`
/// parses so that an agent can say precisely that it lacks TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WsScheme {
    Ws,
    Wss,
}

/// A WebSocket URL with a host (`ws://host:port/path` or `wss://…`).
#[derive(Clone, PartialEq, Eq)]
pub struct OrchestratorUrl {
    url: url::Url,
    scheme: WsScheme,
}

impl OrchestratorUrl {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let url = url::Url::parse(raw).map_err(|e| e.to_string())?;
        let scheme = match url.scheme() {
            "ws" => WsScheme::Ws,
            "wss" => WsScheme::Wss,
            other => return Err(format!("scheme {other:?} is not ws or wss")),
        };
        if url.host_str().is_none_or(str::is_empty) {
            return Err("no host".into());
        }
        if !url.username().is_empty() || url.password().is_some() {
            // Credentials travel in auth.request, never in the URL (which
            // gets logged).
            return Err("credentials in the URL are not allowed".into());
        }
        Ok(Self { url, scheme })
    }

    pub fn scheme(&self) -> WsScheme {
        self.scheme
    }

    pub fn as_str(&self) -> &str {
        self.url.as_str()
    }
}

impl fmt::Debug for OrchestratorUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OrchestratorUrl({})", self.url)
    }
}

impl fmt::Display for OrchestratorUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.url.as_str())
    }
}

/// The parsed bootstrap.
#[derive(Debug, Clone)]
pub struct Bootstrap {
    pub orchestrator_url: OrchestratorUrl,
    pub agent_id: AgentId,
    /// `KICI_LABELS` (the scaler's full labels), normalised.
    pub labels: LabelSet,
    /// `KICI_AGENT_TOKEN`: with one the agent authenticates first.
    pub token: Option<AgentToken>,
    /// `KICI_SCALER_MANAGED=1` (only the literal `1` counts).
    pub scaler_managed: bool,
    /// `KICI_ROLES`: unset or containing `all` ⇒ all roles; `""` ⇒ none.
    pub roles: Roles,
    /// `KICI_SCALER_IDLE_TIMEOUT` (ms; `<= 0` ⇒ zero: leave at once).
    pub idle_timeout: Duration,
    /// `KICI_SCALER_PENDING_DISPATCH_TIMEOUT` (ms; `<= 0` ⇒ zero).
    pub pending_dispatch_timeout: Duration,
    /// `KICI_BACKPRESSURE_MODE`: `pause` (default) or `drop`.
    pub backpressure: BackpressureMode,
    /// `KICI_AGENT_MAX_RECONNECT_DELAY_MS` (ms, > 0): the reconnect delay cap.
    pub max_reconnect_delay: Duration,
    /// `KICI_LOG_LEVEL`, unchecked (a logging filter).
    pub log_level: Option<String>,
    /// Unknown `KICI_*` names tolerated because `KICI_DEV=true` (the KiCI
    /// agent then warns instead of refusing). Empty otherwise.
    pub tolerated_unknown: Vec<String>,
}

/// One thing wrong with the environment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapProblem {
    #[error(
        "unknown KICI_* variable(s) {}: not part of the agent contract (set KICI_DEV=true to only warn)",
        .0.join(", ")
    )]
    UnknownVariables(Vec<String>),
    #[error("{0} is required")]
    Missing(&'static str),
    #[error("{name} must be a ws:// or wss:// URL with a host ({reason})")]
    BadUrl { name: &'static str, reason: String },
    #[error("{name}: {reason}")]
    BadValue { name: &'static str, reason: String },
    #[error("{name} must be an integer number of milliseconds, got {value:?}")]
    BadMillis { name: &'static str, value: String },
    #[error("KICI_LABELS contains {0:?}: kici: labels are reserved to scaler-managed agents (KICI_SCALER_MANAGED=1)")]
    ReservedLabel(String),
}

/// Every problem found, in variable order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid agent bootstrap: {}", .problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
pub struct BootstrapError {
    pub problems: Vec<BootstrapProblem>,
}

impl Bootstrap {
    /// Parses an agent's environment. Variables outside `KICI_*` are ignored.
    pub fn from_env(env: &BTreeMap<String, String>) -> Result<Self, BootstrapError> {
        let mut problems = Vec::new();
        let get = |name: &str| env.get(name).map(String::as_str);

        // The reconnect cap is this agent's own knob, outside the KiCI
        // agent's list (a label set cannot set it: the KiCI agent would
        // refuse it); it is set only where kici-agent-lite runs.
        let unknown: Vec<String> = env
            .keys()
            .filter(|k| !agent_accepts(k) && k.as_str() != MAX_RECONNECT_DELAY)
            .cloned()
            .collect();
        let dev = get(DEV) == Some("true");
        let tolerated_unknown = if dev || unknown.is_empty() {
            unknown
        } else {
            problems.push(BootstrapProblem::UnknownVariables(unknown));
            Vec::new()
        };

        let orchestrator_url = match get(ORCHESTRATOR_URL) {
            None | Some("") => {
                problems.push(BootstrapProblem::Missing(ORCHESTRATOR_URL));
                None
            }
            Some(raw) => OrchestratorUrl::parse(raw)
                .map_err(|reason| {
                    problems.push(BootstrapProblem::BadUrl {
                        name: ORCHESTRATOR_URL,
                        reason,
                    })
                })
                .ok(),
        };

        let agent_id = match get(AGENT_ID) {
            None | Some("") => {
                problems.push(BootstrapProblem::Missing(AGENT_ID));
                None
            }
            Some(raw) => raw
                .parse::<AgentId>()
                .map_err(|e| {
                    problems.push(BootstrapProblem::BadValue {
                        name: AGENT_ID,
                        reason: e.to_string(),
                    })
                })
                .ok(),
        };

        let scaler_managed = get(SCALER_MANAGED) == Some("1");

        let mut labels = Vec::new();
        for raw in get(LABELS).unwrap_or("").split(',').map(str::trim) {
            if raw.is_empty() {
                continue;
            }
            match Label::parse(raw) {
                Ok(l) if l.is_reserved() && !scaler_managed => {
                    problems.push(BootstrapProblem::ReservedLabel(raw.to_owned()))
                }
                Ok(l) => labels.push(l),
                Err(e) => problems.push(BootstrapProblem::BadValue {
                    name: LABELS,
                    reason: e.to_string(),
                }),
            }
        }

        let token = match get(AGENT_TOKEN) {
            None | Some("") => None,
            Some(raw) => raw
                .parse::<AgentToken>()
                .map_err(|e| {
                    problems.push(BootstrapProblem::BadValue {
                        name: AGENT_TOKEN,
                        reason: e.to_string(),
                    })
                })
                .ok(),
        };

        let roles = match get(ROLES) {
            None => Roles::All,
            Some(raw) => parse_roles(raw).unwrap_or_else(|reason| {
                problems.push(BootstrapProblem::BadValue {
                    name: ROLES,
                    reason,
                });
                Roles::All
            }),
        };

        let mut millis = |name: &'static str, default: Duration| match get(name) {
            None => default,
            Some(raw) => match raw.trim().parse::<i64>() {
                Ok(ms) => Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
                Err(_) => {
                    problems.push(BootstrapProblem::BadMillis {
                        name,
                        value: raw.to_owned(),
                    });
                    default
                }
            },
        };
        let idle_timeout = millis(IDLE_TIMEOUT, DEFAULT_IDLE_TIMEOUT);
        let pending_dispatch_timeout =
            millis(PENDING_DISPATCH_TIMEOUT, DEFAULT_PENDING_DISPATCH_TIMEOUT);
        let max_reconnect_delay = millis(MAX_RECONNECT_DELAY, DEFAULT_MAX_RECONNECT_DELAY);
        if max_reconnect_delay.is_zero() {
            problems.push(BootstrapProblem::BadValue {
                name: MAX_RECONNECT_DELAY,
                reason: "must be positive".into(),
            });
        }

        let backpressure = match get(BACKPRESSURE_MODE) {
            None | Some("pause") => BackpressureMode::Pause,
            Some("drop") => BackpressureMode::Drop,
            Some(other) => {
                problems.push(BootstrapProblem::BadValue {
                    name: BACKPRESSURE_MODE,
                    reason: format!("expected pause or drop, got {other:?}"),
                });
                BackpressureMode::Pause
            }
        };

        match (orchestrator_url, agent_id) {
            (Some(orchestrator_url), Some(agent_id)) if problems.is_empty() => Ok(Self {
                orchestrator_url,
                agent_id,
                labels: LabelSet::from_labels(labels),
                token,
                scaler_managed,
                roles,
                idle_timeout,
                pending_dispatch_timeout,
                backpressure,
                max_reconnect_delay,
                log_level: get(LOG_LEVEL).map(str::to_owned),
                tolerated_unknown,
            }),
            _ => Err(BootstrapError { problems }),
        }
    }

    /// The labels to register with: `KICI_LABELS` plus the host's
    /// `kici:os:*`, `kici:arch:*`, `kici:host:*` and the role labels of
    /// `KICI_ROLES` (as the KiCI agent derives them).
    pub fn register_labels(&self, host: &HostFacts) -> LabelSet {
        let mut labels: Vec<Label> = self.labels.iter().cloned().collect();
        labels.extend(host.labels());
        labels.extend(self.roles.labels());
        LabelSet::from_labels(labels)
    }
}

fn parse_roles(raw: &str) -> Result<Roles, String> {
    let mut roles = Vec::new();
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part == "all" {
            return Ok(Roles::All);
        }
        let role = Role::ALL
            .into_iter()
            .find(|r| r.as_str() == part)
            .ok_or_else(|| {
                format!("unknown role {part:?} (expected builder, init-runner or all)")
            })?;
        if !roles.contains(&role) {
            roles.push(role);
        }
    }
    Ok(Roles::Only(roles))
}

/// What an agent knows about its host, in Rust's names
/// (`std::env::consts::{OS, ARCH}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    pub os: String,
    pub arch: String,
    pub hostname: Option<String>,
}

impl HostFacts {
    /// KiCI's (Node's) platform name: `linux`, `darwin`, `win32`.
    pub fn platform(&self) -> &str {
        match self.os.as_str() {
            "macos" => "darwin",
            "windows" => "win32",
            other => other,
        }
    }

    /// KiCI's (Node's) arch name: `x64`, `arm64`, …
    pub fn node_arch(&self) -> &str {
        match self.arch.as_str() {
            "x86_64" => "x64",
            "aarch64" => "arm64",
            "x86" => "ia32",
            other => other,
        }
    }

    /// `kici:os:*` (both names where KiCI gives two), `kici:arch:*` (same),
    /// `kici:host:<hostname>` when the hostname makes a valid label.
    pub fn labels(&self) -> Vec<Label> {
        let os: Vec<&str> = match self.os.as_str() {
            "macos" => vec!["macos", "darwin"],
            "windows" => vec!["windows", "win32"],
            other => vec![other],
        };
        let arch: Vec<&str> = match self.arch.as_str() {
            "x86_64" => vec!["x64", "amd64"],
            _ => vec![self.node_arch()],
        };
        let mut out: Vec<Label> = os.iter().map(|o| Label::auto("os", o)).collect();
        out.extend(arch.iter().map(|a| Label::auto("arch", a)));
        if let Some(host) = &self.hostname {
            if let Ok(l) = Label::parse(&format!("kici:host:{host}")) {
                out.push(l);
            }
        }
        out
    }
}
