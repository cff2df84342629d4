//! One `scalers[]` entry: identity, counts, warm pool, gates, caps, backend
//! settings, `x-kici-scaler`, its label sets, and the rules local to it.

use crate::cx::{field_path, Cx, Got, Keys, Obj, Val};
use crate::label_set::{self, required_truthy, warn_foreign, ParsedLabelSet};
use crate::node::Node;
use crate::resources::{self, NamedCap};
use crate::yaml::{classify, quote, Scalar};
use kici_model::{
    AgentUser, BackendSettings, BackoffPolicy, BareMetalSettings, ContainerRuntime,
    ContainerSettings, EventSettings, FirecrackerSettings, LabelSet, MachinePool, Origin,
    PlatformArch, PlatformOs, ProvisionerSettings, ProvisionerTarget, ProvisionerWebhook,
    ResourceCap, ResourceRequest, Role, Roles, ScalerEntry, ScalerExtension, ScalerName,
    ScalerPlatform, ScalerType, UlimitName, UlimitValue, WarmPoolConfig,
};
use kici_provision::config::PathSegment;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Duration;

pub(crate) const KEYS: [&str; 31] = [
    "name",
    "type",
    "maxAgents",
    "maxConcurrentSpawns",
    "labelSets",
    "host",
    "socketPath",
    "runtime",
    "orchestratorUrl",
    "extraHosts",
    "networkIsolation",
    "warmPool",
    "mandatoryLabels",
    "platform",
    "roles",
    "resourceCap",
    "machinePool",
    "enforceCgroups",
    "firecrackerPath",
    "jailerPath",
    "kernelPath",
    "chrootBaseDir",
    "uid",
    "gid",
    "vcpuCount",
    "memSizeMib",
    "requireSudo",
    "provisioningTargets",
    "claimTtlSeconds",
    "agentTokenTtlSeconds",
    "x-kici-scaler",
];

/// Fields only `type: event` scalers use (upstream's schema accepts them on
/// every entry and ignores them elsewhere).
const EVENT_KEYS: [&str; 3] = [
    "provisioningTargets",
    "claimTtlSeconds",
    "agentTokenTtlSeconds",
];

const CONTAINER: &[ScalerType] = &[ScalerType::Container];
const BARE_METAL: &[ScalerType] = &[ScalerType::BareMetal];
const FIRECRACKER: &[ScalerType] = &[ScalerType::Firecracker];

const OWNED: [(&str, &[ScalerType]); 14] = [
    ("host", CONTAINER),
    ("socketPath", CONTAINER),
    ("runtime", CONTAINER),
    ("extraHosts", CONTAINER),
    ("networkIsolation", CONTAINER),
    ("enforceCgroups", BARE_METAL),
    ("firecrackerPath", FIRECRACKER),
    ("jailerPath", FIRECRACKER),
    ("kernelPath", FIRECRACKER),
    ("chrootBaseDir", FIRECRACKER),
    ("uid", FIRECRACKER),
    ("gid", FIRECRACKER),
    ("vcpuCount", FIRECRACKER),
    ("memSizeMib", FIRECRACKER),
];

const EXT_KEYS: [&str; 15] = [
    "provisionTimeoutSeconds",
    "registrationTimeoutSeconds",
    "pendingDispatchTimeoutSeconds",
    "maxLifetimeSeconds",
    "destroyGraceSeconds",
    "apiCallTimeoutSeconds",
    "idleGraceSeconds",
    "backoff",
    "ulimits",
    "fleetMaxAgents",
    "fleetResourceCap",
    "provisioner",
    "user",
    "group",
    "warmPool",
];

const BACKOFF_KEYS: [&str; 4] = [
    "initialSeconds",
    "maxSeconds",
    "breakerThreshold",
    "breakerOpenSeconds",
];

/// Firecracker machine defaults, applied to every entry as upstream does.
const DEFAULT_VCPU_COUNT: u32 = 2;
const DEFAULT_MEM_SIZE_MIB: u32 = 512;

/// Longest scaler name accepted: it travels inside the `kici:scaler:<name>`
/// label, which is bounded too.
const MAX_NAME_LEN: usize = 200;

fn hint(key: &str) -> Option<&'static str> {
    match key {
        "cleanable" | "cleanupScript" => Some("removed upstream"),
        "dockerHost" => Some("removed upstream; use host"),
        _ => None,
    }
}

/// The settings a scaler is checked against.
pub(crate) struct Globals<'a> {
    /// `None` when `globalMaxAgents` itself is invalid.
    pub global_max_agents: Option<u32>,
    pub defaults: Option<&'a ResourceRequest>,
    pub global_cap: Option<&'a ResourceCap>,
    /// `None` when `machinePools` is invalid: references are then unchecked.
    pub pools: Option<&'a [MachinePool]>,
}

/// What the cross-scaler checks need from an entry, valid or not.
pub(crate) struct ParsedScaler {
    pub entry: Option<ScalerEntry>,
    pub name: Option<(String, Origin)>,
    pub origin: Origin,
    pub path: String,
    pub label_sets: Vec<ParsedLabelSet>,
}

fn name(cx: &mut Cx, v: &Val<'_>) -> Option<String> {
    let s = cx.string(v)?;
    let problem = if s.is_empty() {
        Some("must not be empty".to_owned())
    } else if s.len() > MAX_NAME_LEN {
        Some(format!("is longer than {MAX_NAME_LEN} bytes"))
    } else if s
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || c == ',')
    {
        Some("must not contain whitespace, commas or control characters (it becomes the label kici:scaler:<name>)".to_owned())
    } else {
        None
    };
    match problem {
        Some(p) => {
            cx.err(v, format!("scaler name {} {p}", quote(&s)));
            None
        }
        None => Some(s),
    }
}

fn kind(cx: &mut Cx, v: &Val<'_>) -> Option<ScalerType> {
    let s = cx.string(v)?;
    if let Ok(t) = s.parse::<ScalerType>() {
        return Some(t);
    }
    let why = match s.as_str() {
        "docker" => " (the legacy type \"docker\" was removed; use \"container\")",
        "kubernetes" => " (\"kubernetes\" is reserved upstream and not supported)",
        _ => "",
    };
    cx.err(
        v,
        format!(
            "expected \"container\", \"bare-metal\", \"firecracker\" or \"event\", got {}{why}",
            quote(&s)
        ),
    );
    None
}

fn seconds(cx: &mut Cx, v: &Val<'_>) -> Option<Duration> {
    let n = cx.positive_number(v)?;
    match Duration::try_from_secs_f64(n) {
        Ok(d) => Some(d),
        Err(_) => {
            cx.err(v, format!("{n} seconds is too large"));
            None
        }
    }
}

fn warm_pool(cx: &mut Cx, v: &Val<'_>) -> Option<WarmPoolConfig> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(
        &obj,
        &["enabled", "size", "idleTimeoutSeconds"],
        Keys::Lenient,
        |_| None,
    );
    let enabled = cx
        .opt(&obj, "enabled", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(false);
    let size = cx
        .opt(&obj, "size", |cx, v| cx.non_negative_int(v))
        .value()
        .unwrap_or(0);
    let idle_timeout = cx
        .opt(&obj, "idleTimeoutSeconds", seconds)
        .value()
        .unwrap_or(WarmPoolConfig::DEFAULT_IDLE_TIMEOUT);
    (cx.error_count() == before).then_some(WarmPoolConfig {
        enabled,
        size,
        idle_timeout,
    })
}

/// `platform: {os, arch}`, a strict object with both keys required.
fn platform(cx: &mut Cx, v: &Val<'_>) -> Option<ScalerPlatform> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &["os", "arch"], Keys::Strict, |_| None);
    let os = cx.required(&obj, "os", |cx, v| {
        let choices = PlatformOs::ALL.map(|o| (o.as_str(), o));
        platform_choice(cx, v, &choices, |s| match s {
            "darwin" => Some("macos"),
            "win32" => Some("windows"),
            _ => None,
        })
    });
    let arch = cx.required(&obj, "arch", |cx, v| {
        let choices = PlatformArch::ALL.map(|a| (a.as_str(), a));
        platform_choice(cx, v, &choices, |s| match s {
            "x86_64" | "amd64" => Some("x64"),
            "aarch64" => Some("arm64"),
            _ => None,
        })
    });
    if cx.error_count() != before {
        return None;
    }
    Some(ScalerPlatform {
        os: os?,
        arch: arch?,
    })
}

/// One of `choices`, with a hint when the value is another common name of
/// one of them (upstream names platforms as Node.js does).
fn platform_choice<T: Copy>(
    cx: &mut Cx,
    v: &Val<'_>,
    choices: &[(&str, T)],
    alias: fn(&str) -> Option<&'static str>,
) -> Option<T> {
    if let Node::Scalar(s) = v.node {
        if let Scalar::Str(text) = classify(s) {
            if let Some(name) = alias(text) {
                let names: Vec<String> = choices.iter().map(|(n, _)| quote(n)).collect();
                cx.err(
                    v,
                    format!(
                        "expected one of {}, got {} (upstream's name for it is {})",
                        names.join(", "),
                        quote(text),
                        quote(name)
                    ),
                );
                return None;
            }
        }
    }
    cx.choice(v, choices)
}

/// An event scaler's settings: upstream's fields and
/// `x-kici-scaler.provisioner` (validated by `kici-provision`'s parser, each
/// problem placed at the node it names).
fn event_settings(cx: &mut Cx, obj: &Obj<'_>) -> Option<BackendSettings> {
    let before = cx.error_count();
    let provisioning_targets = cx
        .opt(obj, "provisioningTargets", provisioning_targets)
        .value()
        .unwrap_or_default();
    let claim_ttl = cx
        .opt(obj, "claimTtlSeconds", |cx, v| cx.positive_int(v))
        .value()
        .map_or(EventSettings::DEFAULT_CLAIM_TTL, |n| {
            Duration::from_secs(u64::from(n))
        });
    let agent_token_ttl = cx
        .opt(obj, "agentTokenTtlSeconds", |cx, v| cx.positive_int(v))
        .value()
        .map(|n| Duration::from_secs(u64::from(n)));
    let mut provisioner = None;
    if let Some(ext) = cx.field(obj, "x-kici-scaler") {
        if let Some(ext_map) = ext.node.as_mapping() {
            let ext_obj = Obj {
                map: ext_map,
                val: ext,
            };
            if let Some(pv) = cx.field(&ext_obj, "provisioner") {
                provisioner = provisioner_settings(cx, &pv);
            }
        }
    }
    (cx.error_count() == before).then_some(BackendSettings::Event(EventSettings {
        provisioning_targets,
        claim_ttl,
        agent_token_ttl,
        provisioner,
    }))
}

/// `x-kici-scaler.provisioner`, through [`kici_provision::parse_provisioner`].
fn provisioner_settings(cx: &mut Cx, v: &Val<'_>) -> Option<ProvisionerSettings> {
    let json = to_json(v.node);
    match kici_provision::parse_provisioner(&json) {
        Ok(c) => {
            let command = c.command.map(|c| c.argv);
            let webhook = c.webhook.map(|w| ProvisionerWebhook {
                url: w.url.to_string(),
                secret_env: w.secret_env,
            });
            let target = match (command, webhook) {
                (Some(command), Some(webhook)) => ProvisionerTarget::Both { command, webhook },
                (Some(c), None) => ProvisionerTarget::Command(c),
                (None, Some(w)) => ProvisionerTarget::Webhook(w),
                // The parser refuses a block without a target.
                (None, None) => {
                    cx.err(v, "needs `command` or `webhook`");
                    return None;
                }
            };
            Some(ProvisionerSettings {
                target,
                env: c.env,
                pass_env: c.pass_env,
                timeout: c.timeout,
                max_attempts: c.retry.max_attempts,
            })
        }
        Err(errors) => {
            let path = v.path();
            for e in errors.0 {
                let node = node_at(v.node, e.path.segments()).unwrap_or(v.node);
                cx.error(cx.origin_at(node.mark()), e.path.under(&path), e.message);
            }
            None
        }
    }
}

/// The node at `path` below `node`, if it exists.
fn node_at<'n>(node: &'n Node, path: &[PathSegment]) -> Option<&'n Node> {
    let mut at = node;
    for seg in path {
        at = match (seg, at) {
            (PathSegment::Key(k), Node::Mapping(m)) => m.get(k)?,
            (PathSegment::Index(i), Node::Sequence(s)) => s.iter().nth(*i)?,
            _ => return None,
        };
    }
    Some(at)
}

/// A YAML node as JSON, scalars resolved by the core schema.
fn to_json(node: &Node) -> serde_json::Value {
    use serde_json::Value;
    match node {
        Node::Scalar(s) => match classify(s) {
            Scalar::Null => Value::Null,
            Scalar::Bool(b) => Value::Bool(b),
            Scalar::Number(n)
                if n.fract() == 0.0 && (0.0..9.007_199_254_740_992e15).contains(&n) =>
            {
                // Integral (and exact in an f64): as an integer, so
                // `as_u64` reads it.
                Value::from(n as u64)
            }
            Scalar::Number(n) => serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number),
            Scalar::Str(t) => Value::String(t.to_owned()),
        },
        Node::Sequence(items) => Value::Array(items.iter().map(to_json).collect()),
        Node::Mapping(m) => Value::Object(
            m.iter()
                .map(|(k, v)| (k.as_str().to_owned(), to_json(v)))
                .collect(),
        ),
    }
}

/// `provisioningTargets`: workflow refs, each a non-empty string.
fn provisioning_targets(cx: &mut Cx, v: &Val<'_>) -> Option<Vec<String>> {
    let items = cx.list(v)?;
    let before = cx.error_count();
    let mut out = Vec::with_capacity(items.len());
    for item in &items {
        match cx.string(item) {
            Some(t) if t.is_empty() => cx.err(item, "a provisioning target must not be empty"),
            Some(t) => out.push(t),
            None => {}
        }
    }
    (cx.error_count() == before).then_some(out)
}

fn roles(cx: &mut Cx, v: &Val<'_>) -> Option<Roles> {
    #[derive(Clone, Copy, PartialEq)]
    enum R {
        One(Role),
        All,
    }
    let items = cx.list(v)?;
    let before = cx.error_count();
    let mut out: Vec<Role> = Vec::new();
    let mut all = false;
    for item in &items {
        let r = cx.choice(
            item,
            &[
                ("builder", R::One(Role::Builder)),
                ("init-runner", R::One(Role::InitRunner)),
                ("all", R::All),
            ],
        );
        match r {
            Some(R::All) => all = true,
            Some(R::One(role)) if !out.contains(&role) => out.push(role),
            _ => {}
        }
    }
    if cx.error_count() != before {
        return None;
    }
    Some(if all { Roles::All } else { Roles::Only(out) })
}

fn extension(
    cx: &mut Cx,
    v: &Val<'_>,
    kind: ScalerType,
    max_agents: Option<u32>,
) -> Option<ScalerExtension> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &EXT_KEYS, Keys::Strict, |_| None);
    let mut ext = ScalerExtension::defaults_for(kind);
    let d = &mut ext.deadlines;
    for (key, slot) in [
        ("provisionTimeoutSeconds", &mut d.provision),
        ("registrationTimeoutSeconds", &mut d.registration),
        ("pendingDispatchTimeoutSeconds", &mut d.pending_dispatch),
        ("maxLifetimeSeconds", &mut d.max_lifetime),
        ("destroyGraceSeconds", &mut d.destroy_grace),
        ("apiCallTimeoutSeconds", &mut d.api_call),
        ("idleGraceSeconds", &mut d.idle_grace),
    ] {
        if let Some(s) = cx.opt(&obj, key, seconds).value() {
            *slot = s;
        }
    }
    if let Some(b) = cx.opt(&obj, "backoff", backoff).value() {
        ext.backoff = b;
    }
    if kind != ScalerType::Event && obj.map.get("provisioner").is_some() {
        cx.err_field(
            &obj,
            "provisioner",
            format!("provisioner applies to event scalers only, not to type \"{kind}\""),
        );
    }
    if let Some(u) = cx.opt(&obj, "ulimits", ulimits).value() {
        if kind == ScalerType::Container {
            ext.ulimits = u;
        } else {
            cx.err_field(
                &obj,
                "ulimits",
                format!("ulimits apply to container scalers only, not to type \"{kind}\""),
            );
        }
    }
    // A fleet's caps of this pool, across every host serving it (each
    // host's own capacity stays `maxAgents` / `resourceCap`).
    if let Some(n) = cx
        .opt(&obj, "fleetMaxAgents", |cx, v| cx.positive_int(v))
        .value()
    {
        ext.fleet_max_agents = Some(n);
    }
    if let Some(cap) = cx.opt(&obj, "fleetResourceCap", resources::cap).value() {
        ext.fleet_resource_cap = Some(cap);
    }
    ext.agent_user = agent_user(cx, &obj, kind);
    ext.warm_pool = cx
        .opt(&obj, "warmPool", |cx, v| {
            crate::warm::policy(cx, v, max_agents)
        })
        .value();
    (cx.error_count() == before).then_some(ext)
}

/// `user` / `group`: who a bare-metal scaler's agents run as. Names only
/// (resolved on the host when the daemon starts); `group` needs `user`.
fn agent_user(cx: &mut Cx, obj: &Obj<'_>, kind: ScalerType) -> Option<AgentUser> {
    let user = cx
        .opt(obj, "user", |cx, v| account_name(cx, v, "user"))
        .value();
    let group = cx
        .opt(obj, "group", |cx, v| account_name(cx, v, "group"))
        .value();
    if kind != ScalerType::BareMetal {
        for key in ["user", "group"] {
            if obj.map.get(key).is_some() {
                cx.err_field(
                    obj,
                    key,
                    format!("{key} applies to bare-metal scalers only, not to type \"{kind}\""),
                );
            }
        }
        return None;
    }
    match (user, group) {
        (Some(user), group) => Some(AgentUser { user, group }),
        (None, Some(_)) => {
            cx.err_field(
                obj,
                "group",
                "group needs user: name the user the agents run as too",
            );
            None
        }
        (None, None) => None,
    }
}

/// A user or group name as `getpwnam(3)` takes it: not empty, not all
/// digits (a number is not looked up as a name), no `:`, whitespace or
/// control characters, not starting with `-`.
fn account_name(cx: &mut Cx, v: &Val<'_>, what: &str) -> Option<String> {
    let s = cx.string(v)?;
    let problem = if s.is_empty() {
        Some("must not be empty")
    } else if s.bytes().all(|b| b.is_ascii_digit()) {
        Some("must be a name, not a number")
    } else if s.starts_with('-') {
        Some("must not start with '-'")
    } else if s
        .chars()
        .any(|c| c == ':' || c == '/' || c.is_whitespace() || c.is_control())
    {
        Some("must not contain ':', '/', whitespace or control characters")
    } else {
        None
    };
    match problem {
        Some(p) => {
            cx.err(v, format!("expected a {what} name; {} {p}", quote(&s)));
            None
        }
        None => Some(s),
    }
}

/// Largest ulimit value taken: every integer up to it is exact in a YAML
/// number read as f64.
const MAX_ULIMIT: u64 = 1 << 53;

/// `ulimits:` as compose writes it: `{nofile: {soft: 20000, hard: 40000},
/// nproc: 4096}` (a bare integer sets soft and hard alike).
fn ulimits(cx: &mut Cx, v: &Val<'_>) -> Option<BTreeMap<UlimitName, UlimitValue>> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    let mut out = BTreeMap::new();
    for (k, node) in obj.map.iter() {
        let val = cx.value_of(&obj.val, k, node);
        let Ok(name) = k.as_str().parse::<UlimitName>() else {
            let known: Vec<&str> = UlimitName::ALL.iter().map(|n| n.as_str()).collect();
            cx.error(
                cx.origin_at(k.mark()),
                val.path(),
                format!(
                    "unknown ulimit {}; known: {}",
                    quote(k.as_str()),
                    known.join(", ")
                ),
            );
            continue;
        };
        let limit = if let Some(limits) = val.node.as_mapping() {
            let limits = Obj { map: limits, val };
            cx.check_keys(&limits, &["soft", "hard"], Keys::Strict, |_| None);
            let soft = cx.required(&limits, "soft", ulimit_number);
            let hard = cx.required(&limits, "hard", ulimit_number);
            let (Some(soft), Some(hard)) = (soft, hard) else {
                continue;
            };
            match UlimitValue::new(soft, hard) {
                Some(l) => l,
                None => {
                    cx.err(
                        &val,
                        format!("ulimit {name}: soft ({soft}) must not exceed hard ({hard})"),
                    );
                    continue;
                }
            }
        } else {
            let Some(n) = ulimit_number(cx, &val) else {
                continue;
            };
            match UlimitValue::new(n, n) {
                Some(l) => l,
                // Unreachable (soft == hard <= MAX_ULIMIT); reported anyway.
                None => {
                    cx.err(&val, format!("ulimit {name}: {n} is out of range"));
                    continue;
                }
            }
        };
        out.insert(name, limit);
    }
    (cx.error_count() == before).then_some(out)
}

fn ulimit_number(cx: &mut Cx, v: &Val<'_>) -> Option<u64> {
    const WHAT: &str = "an integer >= 0 (or a mapping {soft, hard} of them)";
    let n = cx.any_number(v, WHAT)?;
    if n < 0.0 {
        cx.err(v, format!("a ulimit must not be negative, got {n}"));
        return None;
    }
    if !n.is_finite() || n.fract() != 0.0 || n > MAX_ULIMIT as f64 {
        cx.err(
            v,
            format!("expected an integer between 0 and {MAX_ULIMIT}, got {n}"),
        );
        return None;
    }
    // Checked just above: integral, non-negative, at most 2^53.
    Some(n as u64)
}

fn backoff(cx: &mut Cx, v: &Val<'_>) -> Option<BackoffPolicy> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &BACKOFF_KEYS, Keys::Strict, |_| None);
    let mut b = BackoffPolicy::default();
    if let Some(s) = cx.opt(&obj, "initialSeconds", seconds).value() {
        b.initial = s;
    }
    if let Some(s) = cx.opt(&obj, "maxSeconds", seconds).value() {
        b.max = s;
    }
    if let Some(n) = cx
        .opt(&obj, "breakerThreshold", |cx, v| cx.int_at_least(v, 1))
        .value()
    {
        b.breaker_threshold = n;
    }
    if let Some(s) = cx.opt(&obj, "breakerOpenSeconds", seconds).value() {
        b.breaker_open = s;
    }
    if cx.error_count() != before {
        return None;
    }
    if b.initial > b.max {
        cx.err(
            v,
            format!(
                "initialSeconds ({}) must not exceed maxSeconds ({})",
                b.initial.as_secs_f64(),
                b.max.as_secs_f64()
            ),
        );
        return None;
    }
    Some(b)
}

fn opt_nonempty_string(cx: &mut Cx, obj: &Obj<'_>, key: &str) -> Option<String> {
    cx.opt(obj, key, |cx, v| cx.string(v))
        .value()
        .filter(|s| !s.is_empty())
}

fn backend(cx: &mut Cx, obj: &Obj<'_>, kind: Option<ScalerType>) -> Option<BackendSettings> {
    // Every field is type-checked whatever the type (upstream's schema is one
    // flat object); only the entry's own type's fields are kept.
    let host = opt_nonempty_string(cx, obj, "host");
    let socket_path = opt_nonempty_string(cx, obj, "socketPath").map(PathBuf::from);
    let runtime = cx
        .opt(obj, "runtime", |cx, v| {
            cx.choice(
                v,
                &[
                    ("auto", ContainerRuntime::Auto),
                    ("docker", ContainerRuntime::Docker),
                    ("podman", ContainerRuntime::Podman),
                ],
            )
        })
        .value()
        .unwrap_or(ContainerRuntime::Auto);
    let extra_hosts = cx
        .opt(obj, "extraHosts", |cx, v| cx.string_list(v))
        .value()
        .unwrap_or_default();
    let network_isolation = cx
        .opt(obj, "networkIsolation", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(true);
    let enforce_cgroups = cx
        .opt(obj, "enforceCgroups", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(false);
    let require_sudo = cx
        .opt(obj, "requireSudo", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(false);
    if require_sudo {
        if let Some(v) = cx.field(obj, "requireSudo") {
            cx.warn_at(
                &v,
                "requireSudo is not used: kici-scaler never runs its privileged steps through sudo; run the daemon as root or as the packaged systemd service (see docs/deviations.md, D-require-sudo)",
            );
        }
    }
    if network_isolation && kind == Some(ScalerType::Container) {
        if let Some(h) = host.as_deref().filter(|h| is_remote_engine(h)) {
            if let Some(v) = cx.field(obj, "host") {
                cx.err(
                    &v,
                    format!(
                        "networkIsolation is on (the default) but the runtime {} is remote: egress rules are installed on this host and would not apply there; set networkIsolation: false for this scaler (and isolate that host yourself)",
                        quote(h)
                    ),
                );
            }
        }
    }
    let chroot_base_dir = match cx.opt(obj, "chrootBaseDir", |cx, v| {
        let s = cx.string(v)?;
        if s.is_empty() {
            cx.err(v, "chrootBaseDir must not be empty");
            return None;
        }
        Some(PathBuf::from(s))
    }) {
        Got::Value(p) => p,
        _ => PathBuf::from(FirecrackerSettings::DEFAULT_CHROOT_BASE_DIR),
    };
    let fc_paths = ["firecrackerPath", "jailerPath", "kernelPath"];
    let ids = ["uid", "gid"];
    let Some(kind) = kind else {
        for key in fc_paths {
            let _ = cx.opt(obj, key, |cx, v| cx.string(v));
        }
        for key in ids {
            let _ = cx.opt(obj, key, |cx, v| cx.non_negative_int(v));
        }
        return None;
    };
    warn_foreign(cx, obj, kind, &OWNED);
    match kind {
        ScalerType::Event => {
            for key in fc_paths {
                let _ = cx.opt(obj, key, |cx, v| cx.string(v));
            }
            for key in ids {
                let _ = cx.opt(obj, key, |cx, v| cx.non_negative_int(v));
            }
            event_settings(cx, obj)
        }
        ScalerType::Container | ScalerType::BareMetal => {
            for key in fc_paths {
                let _ = cx.opt(obj, key, |cx, v| cx.string(v));
            }
            for key in ids {
                let _ = cx.opt(obj, key, |cx, v| cx.non_negative_int(v));
            }
            Some(if kind == ScalerType::Container {
                BackendSettings::Container(ContainerSettings {
                    host,
                    socket_path,
                    runtime,
                    extra_hosts,
                    network_isolation,
                })
            } else {
                BackendSettings::BareMetal(BareMetalSettings { enforce_cgroups })
            })
        }
        ScalerType::Firecracker => {
            let [fc, jailer, kernel] =
                fc_paths.map(|key| required_truthy(cx, obj, key, kind, false));
            let [uid, gid] =
                ids.map(
                    |key| match cx.opt(obj, key, |cx, v| cx.non_negative_int(v)) {
                        Got::Value(n) => Some(n),
                        Got::Bad => None,
                        Got::Absent => {
                            cx.err_key(
                                obj,
                                key,
                                format!("a firecracker scaler requires a '{key}' field"),
                            );
                            None
                        }
                    },
                );
            Some(BackendSettings::Firecracker(FirecrackerSettings {
                firecracker_path: PathBuf::from(fc?),
                jailer_path: PathBuf::from(jailer?),
                kernel_path: PathBuf::from(kernel?),
                chroot_base_dir,
                uid: uid?,
                gid: gid?,
                require_sudo,
            }))
        }
    }
}

/// Parses `scalers[i]` and checks the rules local to it.
pub(crate) fn parse(cx: &mut Cx, v: &Val<'_>, g: &Globals<'_>) -> ParsedScaler {
    let mut out = ParsedScaler {
        entry: None,
        name: None,
        origin: cx.origin(v),
        path: v.path(),
        label_sets: Vec::new(),
    };
    let Some(obj) = cx.obj(v) else { return out };
    let before = cx.error_count();
    cx.check_keys(&obj, &KEYS, Keys::Strict, hint);

    let name_val = cx.field(&obj, "name");
    let name = cx.required(&obj, "name", name);
    out.name = name.clone().zip(name_val.map(|v| cx.origin(&v)));
    let kind = cx.required(&obj, "type", kind);
    let max_agents = cx.required(&obj, "maxAgents", |cx, v| cx.positive_int(v));
    let max_concurrent_spawns = cx
        .opt(&obj, "maxConcurrentSpawns", |cx, v| cx.positive_int(v))
        .value()
        .unwrap_or(ScalerEntry::DEFAULT_MAX_CONCURRENT_SPAWNS);
    let platform_got = cx.opt(&obj, "platform", platform);
    let platform_ok = !matches!(platform_got, Got::Bad);
    let platform = platform_got.value();
    // Type-checked on every entry, as upstream's flat schema does (an event
    // scaler's backend settings read them again); only event scalers use
    // them.
    if kind != Some(ScalerType::Event) {
        let _ = cx.opt(&obj, "provisioningTargets", provisioning_targets);
        for key in ["claimTtlSeconds", "agentTokenTtlSeconds"] {
            let _ = cx.opt(&obj, key, |cx, v| cx.positive_int(v));
        }
    }
    if kind.is_some_and(|k| k != ScalerType::Event) {
        for key in EVENT_KEYS {
            if let Some(v) = cx.field(&obj, key) {
                cx.warn_at(
                    &v,
                    format!("`{key}` only applies to event scalers; ignored for this scaler"),
                );
            }
        }
    }
    let orchestrator_url = opt_nonempty_string(cx, &obj, "orchestratorUrl");
    let warm_val = cx.field(&obj, "warmPool");
    let warm = cx.opt(&obj, "warmPool", warm_pool).value();
    let mandatory = cx.opt(&obj, "mandatoryLabels", label_set::label_list);
    let mandatory_ok = !matches!(mandatory, Got::Bad);
    let mandatory = mandatory.value().unwrap_or_default();
    let roles = cx.opt(&obj, "roles", roles).value().unwrap_or(Roles::All);
    let cap_got = cx.opt(&obj, "resourceCap", resources::cap);
    let cap_ok = !matches!(cap_got, Got::Bad);
    let resource_cap = cap_got.value();
    let pool_val = cx.field(&obj, "machinePool");
    let machine_pool = cx.opt(&obj, "machinePool", |cx, v| cx.string(v)).value();
    let backend = backend(cx, &obj, kind);
    let vcpu_count = cx
        .opt(&obj, "vcpuCount", |cx, v| cx.positive_int(v))
        .value()
        .unwrap_or(DEFAULT_VCPU_COUNT);
    let mem_size_mib = cx
        .opt(&obj, "memSizeMib", |cx, v| cx.positive_int(v))
        .value()
        .unwrap_or(DEFAULT_MEM_SIZE_MIB);
    let ext = cx
        .opt(&obj, "x-kici-scaler", |cx, v| {
            extension(cx, v, kind.unwrap_or(ScalerType::Container), max_agents)
        })
        .value();

    // Label sets.
    if let Some(list_val) = cx.field(&obj, "labelSets") {
        if let Some(items) = cx.list(&list_val) {
            if items.is_empty() {
                cx.err(
                    &list_val,
                    "expected at least one label set, got an empty list",
                );
            }
            out.label_sets = items
                .iter()
                .map(|i| label_set::parse(cx, i, kind))
                .collect();
        }
    } else {
        cx.err_key(&obj, "labelSets", "missing required key `labelSets`");
    }

    // mandatoryLabels: every label set must carry every gate label, or a job
    // could reach the scaler through a label set without it. A label the
    // declared platform taints the pool with counts as carried: routing adds
    // it to every label set of the pool (upstream's rule).
    let taints = LabelSet::from_labels(platform.map(ScalerPlatform::taints).unwrap_or_default());
    if mandatory_ok && platform_ok {
        for (i, ls) in out.label_sets.iter().enumerate() {
            let Some(labels) = &ls.labels else { continue };
            let reachable = labels.union(&taints);
            for m in mandatory.missing_from(&reachable) {
                cx.error(
                    ls.origin.clone(),
                    field_path(&ls.path, "labels"),
                    format!(
                        "mandatoryLabel {} is missing from labelSets[{i}]: every label set must contain every mandatory label",
                        quote(m.as_str())
                    ),
                );
            }
        }
    }

    // Plain platform labels (`macos`, `windows`, `arm64`) taint a label set
    // even without `platform` (upstream's legacy rule). Upstream also logs a
    // hint at load; we do not warn: `route` explains the taint
    // (`tainted:<label>:label`), and every configuration written before
    // `platform` existed would otherwise carry a warning it cannot act on
    // (see docs/deviations.md, D-legacy-taint-quiet).
    if let (Some(p), Some(ScalerType::Firecracker)) = (platform, kind) {
        if p.os != PlatformOs::Linux {
            if let Some(v) = cx.field(&obj, "platform") {
                cx.warn_at(
                    &v,
                    format!("Firecracker guests run Linux, but platform.os is {:?}: the pool is tainted with it and only jobs asking for it land here", p.os.as_str()),
                );
            }
        }
    }

    // Same-scaler duplicate label sets are allowed upstream (the first wins).
    let mut seen: HashMap<&LabelSet, usize> = HashMap::new();
    for (i, ls) in out.label_sets.iter().enumerate() {
        let Some(labels) = &ls.labels else { continue };
        if let Some(first) = seen.get(labels) {
            cx.warn(
                ls.origin.clone(),
                field_path(&ls.path, "labels"),
                format!(
                    "label set [{}] repeats labelSets[{first}] of the same scaler; the first one always wins",
                    labels.key()
                ),
            );
        } else {
            seen.insert(labels, i);
        }
    }

    if let (Some(w), Some(max), Some(wv)) = (&warm, max_agents, &warm_val) {
        if let (true, Some(map)) = (w.size > max, wv.node.as_mapping()) {
            cx.err_field(
                &Obj { map, val: *wv },
                "size",
                format!("warmPool.size ({}) exceeds maxAgents ({max})", w.size),
            );
        }
    }
    if let (Some(max), Some(global)) = (max_agents, g.global_max_agents) {
        if max > global {
            let origin = cx
                .field(&obj, "maxAgents")
                .map_or_else(|| cx.origin(&obj.val), |v| cx.origin(&v));
            cx.warn(
                origin,
                obj.val.child_path("maxAgents"),
                format!("maxAgents ({max}) exceeds globalMaxAgents ({global}); the global limit applies"),
            );
        }
    }

    // machinePool must name a defined pool.
    let mut pool_cap = None;
    if let (Some(name), Some(pools), Some(pv)) = (&machine_pool, g.pools, &pool_val) {
        match pools.iter().find(|p| &p.name == name) {
            Some(p) => pool_cap = Some(p.cap),
            None => {
                let defined: Vec<String> = pools.iter().map(|p| quote(&p.name)).collect();
                let defined = if defined.is_empty() {
                    "no machinePools are defined".to_owned()
                } else {
                    format!("defined: {}", defined.join(", "))
                };
                cx.err(
                    pv,
                    format!("unknown machinePool {} ({defined})", quote(name)),
                );
            }
        }
    }

    // A label set whose own request exceeds a cap above it can never be admitted.
    if cap_ok {
        let mut caps = Vec::new();
        if let Some(c) = &resource_cap {
            caps.push(NamedCap {
                name: "the scaler's resourceCap".into(),
                cap: c,
                global: false,
            });
        }
        if let (Some(c), Some(n)) = (&pool_cap, &machine_pool) {
            caps.push(NamedCap {
                name: format!("machinePool {} cap", quote(n)),
                cap: c,
                global: false,
            });
        }
        if let Some(c) = g.global_cap {
            caps.push(NamedCap {
                name: "globalResourceCap".into(),
                cap: c,
                global: true,
            });
        }
        if !caps.is_empty() {
            for ls in &out.label_sets {
                if ls.has_resources && ls.resources.is_none() {
                    continue;
                }
                for m in resources::misfits(ls.resources.as_ref(), g.defaults, &caps) {
                    let (origin, path) = match (&ls.resources_origin, m.from_defaults) {
                        (Some(o), false) => (o.clone(), field_path(&ls.path, "resources")),
                        _ => (ls.origin.clone(), ls.path.clone()),
                    };
                    cx.error(origin, path, m.message);
                }
            }
        }
    }

    if cx.error_count() != before {
        return out;
    }
    let configs: Option<Vec<_>> = out.label_sets.iter_mut().map(|l| l.config.take()).collect();
    if let (Some(name), Some(kind), Some(max_agents), Some(backend), Some(label_sets)) =
        (name, kind, max_agents, backend, configs)
    {
        out.entry = Some(ScalerEntry {
            name: ScalerName::new(&name),
            origin: out.origin.clone(),
            kind,
            max_agents,
            label_sets,
            orchestrator_url,
            warm_pool: warm,
            mandatory_labels: mandatory,
            platform,
            max_concurrent_spawns,
            roles,
            resource_cap,
            machine_pool,
            backend,
            vcpu_count,
            mem_size_mib,
            ext: ext.unwrap_or_else(|| ScalerExtension::defaults_for(kind)),
        });
    }
    out
}

/// A container `host` that names an Engine on another machine: TCP or HTTPS
/// to anything but loopback. (A malformed `host` is the backend's to refuse
/// with its own message.)
fn is_remote_engine(host: &str) -> bool {
    let Some(rest) = host
        .strip_prefix("tcp://")
        .or_else(|| host.strip_prefix("https://"))
    else {
        return false;
    };
    let address = rest.trim_end_matches('/');
    let name = address.rsplit_once(':').map_or(address, |(n, _)| n);
    let name = name.trim_matches(['[', ']']);
    !(name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback()))
}
