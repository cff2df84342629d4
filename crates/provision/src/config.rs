//! `x-kici-scaler: { provisioner: … }` of a `type: event` scaler, parsed
//! into a [`ProvisionerConfig`].
//!
//! ```yaml
//! x-kici-scaler:
//!   provisioner:
//!     command: ["/usr/local/bin/provision-vm", "--zone", "eu-west-1a"]
//!     webhook:
//!       url: https://provisioner.internal.example.com/kici
//!       secretEnv: KICI_PROVISIONER_SECRET
//!     env:                 # literal variables for the command
//!       CLOUD_REGION: eu-west-1
//!     passEnv: [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY]  # from the daemon's environment
//!     timeoutSeconds: 30   # per attempt (default 30)
//!     maxAttempts: 5       # attempts per event (default 5)
//! ```
//!
//! At least one of `command` and `webhook`; with both, an event counts as
//! delivered once both took it. `env` and `passEnv` shape the command's
//! environment, which otherwise holds only `PATH`, `HOME`, `LANG`, `LC_ALL`
//! and the event variables ([`EVENT_ENV`]): nothing else of the daemon's
//! environment reaches it. The parser works on the block as a JSON
//! value and reports every problem at once, each with a [`FieldPath`]
//! relative to the `provisioner` block (`command[0]`, `webhook.secretEnv`),
//! so `kici-config` can put the file position of the node at that path in
//! front of it. It reads no environment: the webhook secret is resolved when
//! a [`crate::Deliverer`] is built.

use crate::retry::RetryPolicy;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Per-attempt bound when `timeoutSeconds` is not set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest `timeoutSeconds`.
pub const MAX_TIMEOUT_SECONDS: u64 = 3600;
/// Largest `maxAttempts`.
pub const MAX_ATTEMPTS: u64 = 100;

/// The command's event variables: which event (`scale-up`/`scale-down`),
/// its `requestId` and its `agentId`, so a script can branch without
/// parsing JSON first. Outside the `KICI_*` names on purpose: a script that
/// starts the agent passes its environment on, and the agent refuses
/// `KICI_*` variables it does not know.
pub const ENV_EVENT: &str = "PROVISION_EVENT";
pub const ENV_REQUEST_ID: &str = "PROVISION_REQUEST_ID";
pub const ENV_AGENT_ID: &str = "PROVISION_AGENT_ID";
/// Every event variable; `env` and `passEnv` may not name one.
pub const EVENT_ENV: [&str; 3] = [ENV_EVENT, ENV_REQUEST_ID, ENV_AGENT_ID];
/// The daemon's own settings (its API token among them): `passEnv` may not
/// name one.
pub const DAEMON_ENV_PREFIX: &str = "KICI_SCALER_";

const KEYS: [&str; 6] = [
    "command",
    "webhook",
    "env",
    "passEnv",
    "timeoutSeconds",
    "maxAttempts",
];
const WEBHOOK_KEYS: [&str; 2] = ["url", "secretEnv"];

/// Where the operator's provisioner is and how hard to try it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProvisionerConfig {
    pub command: Option<CommandTarget>,
    pub webhook: Option<WebhookTarget>,
    /// `env`: variables set, with these values, in the command's
    /// environment (over anything of the same name).
    pub env: BTreeMap<String, String>,
    /// `passEnv`: variables copied from the daemon's environment into the
    /// command's when set there (an unset one is left out).
    pub pass_env: Vec<String>,
    /// Bound on one attempt (a command run, an HTTP exchange).
    pub timeout: Duration,
    pub retry: RetryPolicy,
}

/// `command: [argv…]`: run once per event, the event JSON on stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandTarget {
    /// Never empty; `argv[0]` is looked up in `PATH` unless it has a `/`.
    pub argv: Vec<String>,
}

/// `webhook: {url, secretEnv}`: POST the event JSON, signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookTarget {
    /// `http` or `https`, with a host, without credentials.
    pub url: url::Url,
    /// The environment variable holding the HMAC secret.
    pub secret_env: String,
}

/// One step of a [`FieldPath`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathSegment {
    Key(String),
    Index(usize),
}

/// Where in the `provisioner` block a problem is; empty = the block itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldPath(pub Vec<PathSegment>);

impl FieldPath {
    fn key(&self, k: &str) -> Self {
        let mut s = self.0.clone();
        s.push(PathSegment::Key(k.to_owned()));
        Self(s)
    }

    fn index(&self, i: usize) -> Self {
        let mut s = self.0.clone();
        s.push(PathSegment::Index(i));
        Self(s)
    }

    pub fn segments(&self) -> &[PathSegment] {
        &self.0
    }

    /// The full path below `parent` (`scalers[0].x-kici-scaler.provisioner`
    /// + `webhook.url` → `scalers[0].x-kici-scaler.provisioner.webhook.url`).
    pub fn under(&self, parent: &str) -> String {
        let mut out = parent.to_owned();
        for seg in &self.0 {
            match seg {
                PathSegment::Key(k) if out.is_empty() => out.push_str(k),
                PathSegment::Key(k) => {
                    out.push('.');
                    out.push_str(k);
                }
                PathSegment::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        out
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.under(""))
    }
}

/// One problem in the block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", if path.0.is_empty() { "provisioner".to_owned() } else { path.under("provisioner") })]
pub struct FieldError {
    pub path: FieldPath,
    pub message: String,
}

/// Every problem found (unknown keys first, then each field in turn).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
pub struct ProvisionerConfigError(pub Vec<FieldError>);

struct Problems(Vec<FieldError>);

impl Problems {
    fn push(&mut self, path: FieldPath, message: impl Into<String>) {
        self.0.push(FieldError {
            path,
            message: message.into(),
        });
    }
}

/// Parses the value of `provisioner:`.
pub fn parse_provisioner(value: &Value) -> Result<ProvisionerConfig, ProvisionerConfigError> {
    let root = FieldPath::default();
    let mut p = Problems(Vec::new());
    let Some(obj) = value.as_object() else {
        p.push(root, format!("expected a mapping, got {}", kind(value)));
        return Err(ProvisionerConfigError(p.0));
    };
    unknown_keys(&mut p, &root, obj, &KEYS);

    let command = obj
        .get("command")
        .and_then(|v| command(&mut p, &root.key("command"), v));
    let webhook = obj
        .get("webhook")
        .and_then(|v| webhook(&mut p, &root.key("webhook"), v));
    let timeout = match obj.get("timeoutSeconds") {
        None => DEFAULT_TIMEOUT,
        Some(v) => int_in(
            &mut p,
            &root.key("timeoutSeconds"),
            v,
            1,
            MAX_TIMEOUT_SECONDS,
        )
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_TIMEOUT),
    };
    let env = obj
        .get("env")
        .map(|v| literal_env(&mut p, &root.key("env"), v))
        .unwrap_or_default();
    let secret_env = webhook.as_ref().map(|w| w.secret_env.as_str());
    let pass_env = obj
        .get("passEnv")
        .map(|v| pass_env(&mut p, &root.key("passEnv"), v, &env, secret_env))
        .unwrap_or_default();
    for key in ["env", "passEnv"] {
        if obj.contains_key(key) && !obj.contains_key("command") {
            p.push(
                root.key(key),
                "only applies to `command` (the environment of the provisioner command), and there is none",
            );
        }
    }
    let mut retry = RetryPolicy::default();
    if let Some(v) = obj.get("maxAttempts") {
        if let Some(n) = int_in(&mut p, &root.key("maxAttempts"), v, 1, MAX_ATTEMPTS) {
            // ≤ MAX_ATTEMPTS, fits.
            retry.max_attempts = u32::try_from(n).unwrap_or(u32::MAX);
        }
    }
    if !obj.contains_key("command") && !obj.contains_key("webhook") {
        p.push(
            root,
            "needs `command` (argv run per event) or `webhook` (URL posted per event), or both",
        );
    }
    if !p.0.is_empty() {
        return Err(ProvisionerConfigError(p.0));
    }
    Ok(ProvisionerConfig {
        command,
        webhook,
        env,
        pass_env,
        timeout,
        retry,
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

fn unknown_keys(p: &mut Problems, at: &FieldPath, obj: &Map<String, Value>, known: &[&str]) {
    for k in obj.keys() {
        if !known.contains(&k.as_str()) {
            p.push(
                at.key(k),
                format!("unknown key `{k}` (expected one of: {})", known.join(", ")),
            );
        }
    }
}

fn int_in(p: &mut Problems, at: &FieldPath, v: &Value, min: u64, max: u64) -> Option<u64> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Some(n),
        _ => {
            p.push(
                at.clone(),
                format!("expected an integer from {min} to {max}, got {v}"),
            );
            None
        }
    }
}

fn command(p: &mut Problems, at: &FieldPath, v: &Value) -> Option<CommandTarget> {
    let Some(items) = v.as_array() else {
        p.push(
            at.clone(),
            format!("expected a list of strings (argv), got {}", kind(v)),
        );
        return None;
    };
    if items.is_empty() {
        p.push(
            at.clone(),
            "expected at least the program to run, got an empty list",
        );
        return None;
    }
    let mut argv = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item.as_str() {
            Some("") if i == 0 => p.push(at.index(i), "the program must not be empty"),
            Some(s) if s.contains('\0') => p.push(at.index(i), "must not contain a NUL byte"),
            Some(s) => argv.push(s.to_owned()),
            None => p.push(
                at.index(i),
                format!("expected a string, got {}", kind(item)),
            ),
        }
    }
    (argv.len() == items.len()).then_some(CommandTarget { argv })
}

fn webhook(p: &mut Problems, at: &FieldPath, v: &Value) -> Option<WebhookTarget> {
    let Some(obj) = v.as_object() else {
        p.push(
            at.clone(),
            format!(
                "expected a mapping with `url` and `secretEnv`, got {}",
                kind(v)
            ),
        );
        return None;
    };
    unknown_keys(p, at, obj, &WEBHOOK_KEYS);
    let url = match obj.get("url") {
        None => {
            p.push(at.key("url"), "missing required key `url`");
            None
        }
        Some(v) => webhook_url(p, &at.key("url"), v),
    };
    let secret_env = match obj.get("secretEnv") {
        None => {
            p.push(
                at.key("secretEnv"),
                "missing required key `secretEnv` (the environment variable holding the signing secret)",
            );
            None
        }
        Some(Value::String(s)) if is_env_name(s) => Some(s.clone()),
        Some(v) => {
            p.push(
                at.key("secretEnv"),
                format!("expected an environment variable name ([A-Za-z_][A-Za-z0-9_]*), got {v}"),
            );
            None
        }
    };
    Some(WebhookTarget {
        url: url?,
        secret_env: secret_env?,
    })
}

fn webhook_url(p: &mut Problems, at: &FieldPath, v: &Value) -> Option<url::Url> {
    let Some(raw) = v.as_str() else {
        p.push(
            at.clone(),
            format!("expected a URL string, got {}", kind(v)),
        );
        return None;
    };
    let url = match url::Url::parse(raw) {
        Ok(u) => u,
        Err(e) => {
            p.push(at.clone(), format!("not a URL ({e}): {raw:?}"));
            return None;
        }
    };
    if !matches!(url.scheme(), "http" | "https") {
        p.push(
            at.clone(),
            format!(
                "expected an http:// or https:// URL, got scheme {:?}",
                url.scheme()
            ),
        );
        return None;
    }
    if url.host_str().is_none_or(str::is_empty) {
        p.push(at.clone(), "the URL has no host");
        return None;
    }
    if !url.username().is_empty() || url.password().is_some() {
        // URLs get logged; the secret is what authenticates.
        p.push(
            at.clone(),
            "credentials in the URL are not allowed (the request is signed with secretEnv's secret)",
        );
        return None;
    }
    Some(url)
}

const ENV_NAME_SHAPE: &str = "an environment variable name ([A-Za-z_][A-Za-z0-9_]*)";

/// `env: {NAME: value}`; the valid entries (the problems are pushed).
fn literal_env(p: &mut Problems, at: &FieldPath, v: &Value) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Some(obj) = v.as_object() else {
        p.push(
            at.clone(),
            format!(
                "expected a mapping of variable names to values, got {}",
                kind(v)
            ),
        );
        return out;
    };
    for (name, value) in obj {
        let here = at.key(name);
        let name_ok = env_name_usable(p, &here, name);
        match value {
            Value::String(s) if s.contains('\0') => p.push(here, "must not contain a NUL byte"),
            Value::String(s) if name_ok => {
                out.insert(name.clone(), s.clone());
            }
            Value::String(_) => {}
            other => p.push(
                here,
                format!(
                    "expected a string value (quote numbers and booleans), got {}",
                    kind(other)
                ),
            ),
        }
    }
    out
}

/// `passEnv: [NAME, …]`; the valid names (the problems are pushed).
fn pass_env(
    p: &mut Problems,
    at: &FieldPath,
    v: &Value,
    literal: &BTreeMap<String, String>,
    secret_env: Option<&str>,
) -> Vec<String> {
    let Some(items) = v.as_array() else {
        p.push(
            at.clone(),
            format!("expected a list of variable names, got {}", kind(v)),
        );
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let here = at.index(i);
        let Some(name) = item.as_str() else {
            p.push(
                here,
                format!("expected {ENV_NAME_SHAPE}, got {}", kind(item)),
            );
            continue;
        };
        if !env_name_usable(p, &here, name) {
            continue;
        }
        if name.starts_with(DAEMON_ENV_PREFIX) {
            p.push(
                here,
                format!(
                    "{name} is one of kici-scaler's own settings ({DAEMON_ENV_PREFIX}*, its API token among them): never passed to a provisioner"
                ),
            );
        } else if secret_env == Some(name) {
            p.push(
                here,
                format!("{name} holds the webhook's signing secret (webhook.secretEnv): the command has no business with it"),
            );
        } else if literal.contains_key(name) {
            p.push(
                here,
                format!("{name} is also set in `env`: give it one source"),
            );
        } else if out.iter().any(|n| n == name) {
            p.push(here, format!("{name} is listed twice"));
        } else {
            out.push(name.to_owned());
        }
    }
    out
}

/// A name `env` or `passEnv` may use: well formed and not an event
/// variable (pushes the problem and says `false` otherwise).
fn env_name_usable(p: &mut Problems, at: &FieldPath, name: &str) -> bool {
    if !is_env_name(name) {
        p.push(
            at.clone(),
            format!("expected {ENV_NAME_SHAPE}, got {name:?}"),
        );
        false
    } else if EVENT_ENV.contains(&name) {
        p.push(
            at.clone(),
            format!("{name} is set by kici-scaler for every event and cannot be configured"),
        );
        false
    } else {
        true
    }
}

fn is_env_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b'A'..=b'Z' | b'a'..=b'z' | b'_'))
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn errors(v: Value) -> Vec<String> {
        parse_provisioner(&v)
            .unwrap_err()
            .0
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn full_block() {
        let c = parse_provisioner(&json!({
            "command": ["/bin/provision", "--zone", "a"],
            "webhook": {"url": "https://hooks.example.com/kici", "secretEnv": "HOOK_SECRET"},
            "timeoutSeconds": 10,
            "maxAttempts": 3
        }))
        .unwrap();
        assert_eq!(c.command.unwrap().argv, ["/bin/provision", "--zone", "a"]);
        let w = c.webhook.unwrap();
        assert_eq!(w.url.as_str(), "https://hooks.example.com/kici");
        assert_eq!(w.secret_env, "HOOK_SECRET");
        assert_eq!(c.timeout, Duration::from_secs(10));
        assert_eq!(c.retry.max_attempts, 3);
    }

    #[test]
    fn defaults() {
        let c = parse_provisioner(&json!({"command": ["provision"]})).unwrap();
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        assert_eq!(c.retry, RetryPolicy::default());
        assert!(c.webhook.is_none());
    }

    #[test]
    fn every_problem_with_its_path() {
        assert_eq!(
            errors(json!({
                "command": ["", 3],
                "webhook": {"url": "ftp://x/", "secretEnv": "1BAD", "extra": 1},
                "timeoutSeconds": 0,
                "maxAttempts": "five",
                "retries": 2
            })),
            [
                "provisioner.retries: unknown key `retries` (expected one of: command, webhook, env, passEnv, timeoutSeconds, maxAttempts)",
                "provisioner.command[0]: the program must not be empty",
                "provisioner.command[1]: expected a string, got a number",
                "provisioner.webhook.extra: unknown key `extra` (expected one of: url, secretEnv)",
                "provisioner.webhook.url: expected an http:// or https:// URL, got scheme \"ftp\"",
                "provisioner.webhook.secretEnv: expected an environment variable name ([A-Za-z_][A-Za-z0-9_]*), got \"1BAD\"",
                "provisioner.timeoutSeconds: expected an integer from 1 to 3600, got 0",
                "provisioner.maxAttempts: expected an integer from 1 to 100, got \"five\"",
            ]
        );
    }

    #[test]
    fn needs_a_target_and_a_mapping() {
        assert_eq!(
            errors(json!({"timeoutSeconds": 5})),
            ["provisioner: needs `command` (argv run per event) or `webhook` (URL posted per event), or both"]
        );
        assert_eq!(
            errors(json!(["x"])),
            ["provisioner: expected a mapping, got a list"]
        );
        assert_eq!(
            errors(json!({"command": []})),
            ["provisioner.command: expected at least the program to run, got an empty list"]
        );
        assert_eq!(
            errors(json!({"webhook": {"url": "http://u:p@h/"}})),
            [
                "provisioner.webhook.url: credentials in the URL are not allowed (the request is signed with secretEnv's secret)",
                "provisioner.webhook.secretEnv: missing required key `secretEnv` (the environment variable holding the signing secret)",
            ]
        );
    }

    #[test]
    fn env_and_pass_env() {
        let c = parse_provisioner(&json!({
            "command": ["provision"],
            "env": {"CLOUD_REGION": "eu-west-1", "PATH": "/opt/cloud/bin:/usr/bin:/bin"},
            "passEnv": ["AWS_ACCESS_KEY_ID", "KICI_LOG_LEVEL"]
        }))
        .unwrap();
        assert_eq!(
            c.env,
            BTreeMap::from([
                ("CLOUD_REGION".to_owned(), "eu-west-1".to_owned()),
                ("PATH".to_owned(), "/opt/cloud/bin:/usr/bin:/bin".to_owned()),
            ])
        );
        assert_eq!(c.pass_env, ["AWS_ACCESS_KEY_ID", "KICI_LOG_LEVEL"]);
        let d = parse_provisioner(&json!({"command": ["provision"]})).unwrap();
        assert!(d.env.is_empty() && d.pass_env.is_empty());
    }

    #[test]
    fn env_and_pass_env_problems_with_their_paths() {
        assert_eq!(
            errors(json!({
                "command": ["provision"],
                "webhook": {"url": "https://h/", "secretEnv": "HOOK_SECRET"},
                "env": {"1BAD": "x", "PROVISION_EVENT": "x", "PORT": 8080, "OK": "a\u{0}b", "TWICE": "x"},
                "passEnv": ["KICI_SCALER_API_TOKEN", "HOOK_SECRET", "TWICE", "PGHOST", "PGHOST", "A-B", 3, "PROVISION_AGENT_ID"]
            })),
            [
                "provisioner.env.1BAD: expected an environment variable name ([A-Za-z_][A-Za-z0-9_]*), got \"1BAD\"",
                "provisioner.env.OK: must not contain a NUL byte",
                "provisioner.env.PORT: expected a string value (quote numbers and booleans), got a number",
                "provisioner.env.PROVISION_EVENT: PROVISION_EVENT is set by kici-scaler for every event and cannot be configured",
                "provisioner.passEnv[0]: KICI_SCALER_API_TOKEN is one of kici-scaler's own settings (KICI_SCALER_*, its API token among them): never passed to a provisioner",
                "provisioner.passEnv[1]: HOOK_SECRET holds the webhook's signing secret (webhook.secretEnv): the command has no business with it",
                "provisioner.passEnv[2]: TWICE is also set in `env`: give it one source",
                "provisioner.passEnv[4]: PGHOST is listed twice",
                "provisioner.passEnv[5]: expected an environment variable name ([A-Za-z_][A-Za-z0-9_]*), got \"A-B\"",
                "provisioner.passEnv[6]: expected an environment variable name ([A-Za-z_][A-Za-z0-9_]*), got a number",
                "provisioner.passEnv[7]: PROVISION_AGENT_ID is set by kici-scaler for every event and cannot be configured",
            ]
        );
        assert_eq!(
            errors(json!({
                "webhook": {"url": "https://h/", "secretEnv": "HOOK_SECRET"},
                "env": ["A=b"],
                "passEnv": "PGHOST"
            })),
            [
                "provisioner.env: expected a mapping of variable names to values, got a list",
                "provisioner.passEnv: expected a list of variable names, got a string",
                "provisioner.env: only applies to `command` (the environment of the provisioner command), and there is none",
                "provisioner.passEnv: only applies to `command` (the environment of the provisioner command), and there is none",
            ]
        );
    }

    #[test]
    fn paths_join_under_a_parent() {
        let e = &parse_provisioner(&json!({"command": [1]})).unwrap_err().0[0];
        assert_eq!(
            e.path.segments(),
            [PathSegment::Key("command".into()), PathSegment::Index(0)]
        );
        assert_eq!(
            e.path.under("scalers[2].x-kici-scaler.provisioner"),
            "scalers[2].x-kici-scaler.provisioner.command[0]"
        );
    }
}
