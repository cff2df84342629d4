//! The environment an agent starts with — one precedence for every backend.
//!
//! This module owns KiCI's agent-environment rule, with one precedence for
//! every backend and the identity variables protected (lowest → highest;
//! see docs/deviations.md, D-strict-config):
//!
//! 1. **system**: the host allowlist ([`BARE_METAL_SYSTEM_ALLOWLIST`]) copied
//!    from the daemon's environment — bare-metal only;
//! 2. **forwarded**: every daemon variable `KICI_AGENT_ENV_<X>` as `<X>`;
//! 3. **scaler**: kici-scaler's own `KICI_*` values (URL, id, labels, token, …);
//! 4. **label set**: the label set's `env:` map.
//!
//! Names that bind an agent to its token (`KICI_AGENT_ID`, `KICI_AGENT_TOKEN`,
//! `KICI_LABELS`, `KICI_SCALER_MANAGED`) are never taken from layers 2 or 4:
//! forwarding one is refused when the daemon starts ([`ForwardedEnv::from_vars`]),
//! the config loader refuses them in `env:`, and should one slip through the
//! scaler's value still wins. Nothing else of the daemon's environment reaches
//! an agent.

use kici_engine::SpawnSpec;
use kici_model::contract::{
    agent_accepts, BARE_METAL_SYSTEM_ALLOWLIST, FORWARD_PREFIX, NOT_OVERRIDABLE,
};
use kici_model::{EnvName, ScalerType};
use std::collections::BTreeMap;
use std::fmt;

/// The daemon's allowlisted host variables (`PATH`, `HOME`, …), captured once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SystemEnv(BTreeMap<String, String>);

impl SystemEnv {
    /// Keeps only the allowlisted names of `vars` (which may be the daemon's
    /// whole environment).
    pub fn from_vars<I, K, V>(vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        Self(
            vars.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .filter(|(k, _)| BARE_METAL_SYSTEM_ALLOWLIST.contains(&k.as_str()))
                .collect(),
        )
    }

    pub fn vars(&self) -> &BTreeMap<String, String> {
        &self.0
    }
}

/// One forwarded variable the agent could not be given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardedEnvProblem {
    /// `KICI_AGENT_ENV_<X>` where `<X>` is not a POSIX name.
    BadName { var: String },
    /// `<X>` is a `KICI_*` name outside the agent's schema: the agent would
    /// refuse to start.
    UnknownKici { var: String, name: String },
    /// `<X>` is one of the names that bind the agent to its token.
    Reserved { var: String, name: String },
}

impl fmt::Display for ForwardedEnvProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadName { var } => write!(
                f,
                "{var}: the forwarded name after {FORWARD_PREFIX} is not a POSIX variable name"
            ),
            Self::UnknownKici { var, name } => write!(
                f,
                "{var} would give every agent {name}, a KICI_* variable outside the agent's \
                 schema (the KiCI agent refuses to start on unknown KICI_* variables)"
            ),
            Self::Reserved { var, name } => write!(
                f,
                "{var} would set {name}, which kici-scaler sets itself to bind each agent to \
                 its token; it cannot be forwarded"
            ),
        }
    }
}

/// The daemon's `KICI_AGENT_ENV_*` variables could not all be forwarded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot forward the daemon's {FORWARD_PREFIX}* variables to agents: {}", join(.problems))]
pub struct ForwardedEnvError {
    pub problems: Vec<ForwardedEnvProblem>,
}

fn join(problems: &[ForwardedEnvProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The daemon's `KICI_AGENT_ENV_<X>` variables as `<X>`, validated once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForwardedEnv(BTreeMap<String, String>);

impl ForwardedEnv {
    /// Strips the prefix of every `KICI_AGENT_ENV_<X>` in `vars` (other names
    /// are ignored, so the daemon's whole environment may be passed; an empty
    /// `<X>` is ignored as upstream does). Every name that would break agent
    /// start-up or token binding is reported, all at once.
    pub fn from_vars<I, K, V>(vars: I) -> Result<Self, ForwardedEnvError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let mut forwarded = BTreeMap::new();
        let mut problems = Vec::new();
        for (var, value) in vars {
            let var: String = var.into();
            let Some(name) = var.strip_prefix(FORWARD_PREFIX) else {
                continue;
            };
            if name.is_empty() {
                continue;
            }
            let name = name.to_owned();
            if EnvName::parse(&name).is_none() {
                problems.push(ForwardedEnvProblem::BadName { var });
            } else if NOT_OVERRIDABLE.contains(&name.as_str()) {
                problems.push(ForwardedEnvProblem::Reserved { var, name });
            } else if !agent_accepts(&name) {
                problems.push(ForwardedEnvProblem::UnknownKici { var, name });
            } else {
                forwarded.insert(name, value.into());
            }
        }
        if problems.is_empty() {
            Ok(Self(forwarded))
        } else {
            Err(ForwardedEnvError { problems })
        }
    }

    pub fn vars(&self) -> &BTreeMap<String, String> {
        &self.0
    }
}

/// The agent's complete environment for `spec` on a backend of `kind`,
/// sorted by name. Pure: everything comes from the arguments.
///
/// Per backend (as upstream sets them): `KICI_EXECUTION_MODE=bare-metal`
/// for container and bare-metal agents (Firecracker agents default to
/// `firecracker` themselves), `KICI_PORT=0` for bare-metal only (agents share
/// the host's ports), the system allowlist for bare-metal only.
pub fn agent_env(
    spec: &SpawnSpec,
    kind: ScalerType,
    system: &SystemEnv,
    forwarded: &ForwardedEnv,
) -> Vec<(String, String)> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    if kind == ScalerType::BareMetal {
        env.extend(system.0.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    env.extend(forwarded.0.iter().map(|(k, v)| (k.clone(), v.clone())));

    let mut own: Vec<(&str, String)> = vec![
        ("KICI_ORCHESTRATOR_URL", spec.orchestrator_url.clone()),
        ("KICI_AGENT_ID", spec.agent.to_string()),
        ("KICI_LABELS", spec.agent_labels.join(",")),
        ("KICI_SCALER_MANAGED", "1".to_owned()),
    ];
    if let Some(token) = &spec.token {
        own.push(("KICI_AGENT_TOKEN", token.expose().to_owned()));
    }
    if matches!(kind, ScalerType::BareMetal | ScalerType::Container) {
        own.push(("KICI_EXECUTION_MODE", "bare-metal".to_owned()));
    }
    if kind == ScalerType::BareMetal {
        own.push(("KICI_PORT", "0".to_owned()));
    }
    if let Some(mode) = spec.label_set.backpressure_mode {
        own.push(("KICI_BACKPRESSURE_MODE", mode.as_str().to_owned()));
    }
    if let Some(roles) = spec.scaler.roles.agent_env_value() {
        own.push(("KICI_ROLES", roles));
    }
    if let Some(ms) = spec.idle_timeout_ms {
        own.push(("KICI_SCALER_IDLE_TIMEOUT", ms.to_string()));
    }
    env.extend(own.into_iter().map(|(k, v)| (k.to_owned(), v)));

    for (name, value) in &spec.label_set.env {
        // The loader refuses these in `env:`; the scaler's value wins anyway.
        if !NOT_OVERRIDABLE.contains(&name.as_str()) {
            env.insert(name.as_str().to_owned(), value.clone());
        }
    }
    env.into_iter().collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use kici_engine::testing::{scaler_from_yaml, spawn_spec};

    const YAML: &str = r#"
version: 1
scalers:
  - name: metal
    type: bare-metal
    maxAgents: 2
    roles: [builder]
    labelSets:
      - labels: [linux, metal]
        binaryPath: /usr/bin/env
        backpressureMode: drop
        env:
          FOO: from-label-set
          KICI_LOG_LEVEL: debug
          KICI_ORCHESTRATOR_URL: ws://override.example/ws
"#;

    fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn full_environment_in_precedence_order() {
        let scaler = scaler_from_yaml(YAML, "metal");
        let (mut spec, _rx) = spawn_spec(&scaler, 0);
        spec.token = Some(kici_model::Secret::new("kat_secret"));
        spec.idle_timeout_ms = Some(300_000);
        let system = SystemEnv::from_vars([
            ("PATH", "/usr/bin:/bin"),
            ("HOME", "/root"),
            ("FOO", "from-system"),
            ("DATABASE_URL", "postgres://secret"),
            ("AWS_SECRET_ACCESS_KEY", "x"),
            ("BAR", "from-system"),
        ]);
        let forwarded = ForwardedEnv::from_vars([
            ("KICI_AGENT_ENV_HOME", "/home/agent"),
            ("KICI_AGENT_ENV_FOO", "forwarded"),
            ("KICI_AGENT_ENV_KICI_SANDBOX", "true"),
            ("KICI_AGENT_ENV_KICI_PORT", "9999"),
            ("KICI_AGENT_ENV_", "ignored"),
            ("UNRELATED", "ignored"),
        ])
        .unwrap();
        let env = agent_env(&spec, ScalerType::BareMetal, &system, &forwarded);
        let labels = spec.agent_labels.join(",");
        let agent = spec.agent.to_string();
        assert_eq!(
            env,
            owned(&[
                // label set beats everything it may override
                ("FOO", "from-label-set"),
                // forwarded beats system
                ("HOME", "/home/agent"),
                ("KICI_AGENT_ID", &agent),
                ("KICI_AGENT_TOKEN", "kat_secret"),
                ("KICI_BACKPRESSURE_MODE", "drop"),
                ("KICI_EXECUTION_MODE", "bare-metal"),
                ("KICI_LABELS", &labels),
                ("KICI_LOG_LEVEL", "debug"),
                ("KICI_ORCHESTRATOR_URL", "ws://override.example/ws"),
                // the scaler's own beats forwarded
                ("KICI_PORT", "0"),
                ("KICI_ROLES", "builder"),
                ("KICI_SANDBOX", "true"),
                ("KICI_SCALER_IDLE_TIMEOUT", "300000"),
                ("KICI_SCALER_MANAGED", "1"),
                ("PATH", "/usr/bin:/bin"),
            ])
        );
        // `BAR` is not on the allowlist; nothing outside it leaks.
        assert!(env.iter().all(|(k, _)| k != "BAR" && k != "DATABASE_URL"));
    }

    #[test]
    fn minimal_environment_without_optional_values() {
        let yaml = r#"
version: 1
scalers:
  - name: plain
    type: bare-metal
    maxAgents: 1
    labelSets:
      - labels: [plain]
        binaryPath: /usr/bin/env
"#;
        let scaler = scaler_from_yaml(yaml, "plain");
        let (spec, _rx) = spawn_spec(&scaler, 0);
        let env = agent_env(
            &spec,
            ScalerType::BareMetal,
            &SystemEnv::default(),
            &ForwardedEnv::default(),
        );
        let labels = spec.agent_labels.join(",");
        let agent = spec.agent.to_string();
        assert_eq!(
            env,
            owned(&[
                ("KICI_AGENT_ID", &agent),
                ("KICI_EXECUTION_MODE", "bare-metal"),
                ("KICI_LABELS", &labels),
                ("KICI_ORCHESTRATOR_URL", "ws://127.0.0.1:7879/ws"),
                ("KICI_PORT", "0"),
                ("KICI_SCALER_MANAGED", "1"),
            ])
        );
    }

    #[test]
    fn execution_only_roles_give_an_empty_kici_roles() {
        let yaml = r#"
version: 1
scalers:
  - name: exec
    type: bare-metal
    maxAgents: 1
    roles: []
    labelSets:
      - labels: [exec]
        binaryPath: /usr/bin/env
"#;
        let scaler = scaler_from_yaml(yaml, "exec");
        let (spec, _rx) = spawn_spec(&scaler, 0);
        let env = agent_env(
            &spec,
            ScalerType::BareMetal,
            &SystemEnv::default(),
            &ForwardedEnv::default(),
        );
        assert!(env.contains(&("KICI_ROLES".to_owned(), String::new())));
    }

    #[test]
    fn system_variables_and_port_are_bare_metal_only() {
        let scaler = scaler_from_yaml(YAML, "metal");
        let (spec, _rx) = spawn_spec(&scaler, 0);
        let system = SystemEnv::from_vars([("PATH", "/bin")]);
        let forwarded = ForwardedEnv::from_vars([("KICI_AGENT_ENV_X", "1")]).unwrap();
        let container = agent_env(&spec, ScalerType::Container, &system, &forwarded);
        let names: Vec<&str> = container.iter().map(|(k, _)| k.as_str()).collect();
        assert!(!names.contains(&"PATH"));
        assert!(!names.contains(&"KICI_PORT"));
        assert!(names.contains(&"KICI_EXECUTION_MODE"));
        assert!(names.contains(&"X"));
        let vm = agent_env(&spec, ScalerType::Firecracker, &system, &forwarded);
        assert!(vm
            .iter()
            .all(|(k, _)| k != "KICI_EXECUTION_MODE" && k != "PATH"));
    }

    #[test]
    fn forwarding_refuses_reserved_unknown_and_malformed_names_all_at_once() {
        let err = ForwardedEnv::from_vars([
            ("KICI_AGENT_ENV_KICI_AGENT_TOKEN", "x"),
            ("KICI_AGENT_ENV_KICI_MAX_CONCURRENT_JOBS", "4"),
            ("KICI_AGENT_ENV_1BAD", "x"),
            ("KICI_AGENT_ENV_FINE", "x"),
        ])
        .unwrap_err();
        assert_eq!(
            err.problems,
            vec![
                ForwardedEnvProblem::Reserved {
                    var: "KICI_AGENT_ENV_KICI_AGENT_TOKEN".into(),
                    name: "KICI_AGENT_TOKEN".into()
                },
                ForwardedEnvProblem::UnknownKici {
                    var: "KICI_AGENT_ENV_KICI_MAX_CONCURRENT_JOBS".into(),
                    name: "KICI_MAX_CONCURRENT_JOBS".into()
                },
                ForwardedEnvProblem::BadName {
                    var: "KICI_AGENT_ENV_1BAD".into()
                },
            ]
        );
        let message = err.to_string();
        assert!(message.contains("KICI_AGENT_ENV_KICI_AGENT_TOKEN would set KICI_AGENT_TOKEN"));
        assert!(message.contains("refuses to start on unknown KICI_* variables"));
        for reserved in NOT_OVERRIDABLE {
            let var = format!("{FORWARD_PREFIX}{reserved}");
            assert!(ForwardedEnv::from_vars([(var, "x")]).is_err(), "{reserved}");
        }
    }
}
