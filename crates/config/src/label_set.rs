//! One `labelSets[]` entry: labels, resources, env, network policy and the
//! fields of the scaler's backend type.

use crate::cx::{Cx, Got, Keys, Obj, Val};
use crate::node::Node;
use crate::resources;
use crate::yaml::{classify, quote, Scalar};
use ipnet::IpNet;
use kici_model::{
    BackpressureMode, EnvName, FirecrackerLabelSet, HostAccess, ImagePullPolicy, Label, LabelSet,
    LabelSetBackend, LabelSetConfig, LabelSetExtension, NetworkPolicy, Origin, ScalerType,
};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

pub(crate) const KEYS: [&str; 16] = [
    "labels",
    "image",
    "imagePullPolicy",
    "binaryPath",
    "resources",
    "containerSocket",
    "volumes",
    "env",
    "networkPolicy",
    "backpressureMode",
    "rootfsPath",
    "kernelPath",
    "vcpuCount",
    "memSizeMib",
    "overlayDriveSizeMib",
    "x-kici-scaler",
];

const CONTAINER: &[ScalerType] = &[ScalerType::Container];
const BARE_METAL: &[ScalerType] = &[ScalerType::BareMetal];
const FIRECRACKER: &[ScalerType] = &[ScalerType::Firecracker];
const ISOLATED: &[ScalerType] = &[ScalerType::Container, ScalerType::Firecracker];

/// Fields that only one or two backend types use; others accept and ignore
/// them (as upstream), with a warning.
const OWNED: [(&str, &[ScalerType]); 11] = [
    ("image", CONTAINER),
    ("imagePullPolicy", CONTAINER),
    ("containerSocket", CONTAINER),
    ("volumes", CONTAINER),
    ("binaryPath", BARE_METAL),
    ("rootfsPath", FIRECRACKER),
    ("kernelPath", FIRECRACKER),
    ("vcpuCount", FIRECRACKER),
    ("memSizeMib", FIRECRACKER),
    ("overlayDriveSizeMib", FIRECRACKER),
    ("networkPolicy", ISOLATED),
];

/// Variables the engine derives from the scaler entry; setting them in `env`
/// silently replaces what the entry says.
const DERIVED_ENV: [&str; 5] = [
    "KICI_ROLES",
    "KICI_ORCHESTRATOR_URL",
    "KICI_EXECUTION_MODE",
    "KICI_BACKPRESSURE_MODE",
    "KICI_SCALER_IDLE_TIMEOUT",
];

fn hint(key: &str) -> Option<&'static str> {
    match key {
        "dockerSocket" => Some("removed upstream; use containerSocket"),
        _ => None,
    }
}

/// What the scaler walk needs from a label set, valid or not.
pub(crate) struct ParsedLabelSet {
    /// Present when the label set is entirely valid.
    pub config: Option<LabelSetConfig>,
    /// The normalised labels, when every label parsed.
    pub labels: Option<LabelSet>,
    /// `resources` as parsed (for the fit check).
    pub resources: Option<kici_model::ResourceRequest>,
    pub has_resources: bool,
    pub resources_origin: Option<Origin>,
    pub origin: Origin,
    pub path: String,
}

/// Warns about fields that belong to other backend types.
pub(crate) fn warn_foreign(
    cx: &mut Cx,
    obj: &Obj<'_>,
    kind: ScalerType,
    owned: &[(&str, &[ScalerType])],
) {
    for (key, owners) in owned {
        if owners.contains(&kind) {
            continue;
        }
        if let Some(v) = cx.field(obj, key) {
            if Cx::is_null(&v) {
                continue;
            }
            let owners: Vec<&str> = owners.iter().map(|t| t.as_str()).collect();
            cx.warn_at(
                &v,
                format!(
                    "`{key}` only applies to {} scalers; ignored for this {kind} scaler",
                    owners.join(" and ")
                ),
            );
        }
    }
}

/// A required string that must also be non-empty (upstream checks
/// truthiness), reported with upstream's wording.
pub(crate) fn required_truthy(
    cx: &mut Cx,
    obj: &Obj<'_>,
    key: &str,
    kind: ScalerType,
    every_label_set: bool,
) -> Option<String> {
    match cx.opt(obj, key, |cx, v| cx.string(v)) {
        Got::Value(s) if !s.is_empty() => Some(s),
        Got::Bad => None,
        _ => {
            let article = if key.starts_with(['a', 'e', 'i', 'o', 'u']) {
                "an"
            } else {
                "a"
            };
            let scope = if every_label_set {
                " in every label set"
            } else {
                ""
            };
            cx.err_key(
                obj,
                key,
                format!("a {kind} scaler requires {article} '{key}' field{scope}"),
            );
            None
        }
    }
}

fn labels(cx: &mut Cx, v: &Val<'_>) -> Option<(LabelSet, Vec<String>)> {
    let items = cx.list(v)?;
    if items.is_empty() {
        cx.err(v, "expected at least one label, got an empty list");
        return None;
    }
    let before = cx.error_count();
    let mut parsed = Vec::with_capacity(items.len());
    let mut raw = Vec::with_capacity(items.len());
    for item in &items {
        let Some(s) = cx.string(item) else { continue };
        match Label::canonical_user(&s) {
            Ok(l) => parsed.push(l),
            Err(e) => cx.err(item, e.to_string()),
        }
        // Agents get the spelling as written, minus the surrounding blanks
        // that canonical labels drop.
        raw.push(
            s.trim_matches(|c: char| c.is_whitespace() || c == '\u{feff}')
                .to_owned(),
        );
    }
    (cx.error_count() == before).then(|| (LabelSet::from_labels(parsed), raw))
}

/// `mandatoryLabels` and similar label lists (may be empty), canonical as
/// label sets are.
pub(crate) fn label_list(cx: &mut Cx, v: &Val<'_>) -> Option<LabelSet> {
    let items = cx.list(v)?;
    let before = cx.error_count();
    let mut parsed = Vec::with_capacity(items.len());
    for item in &items {
        let Some(s) = cx.string(item) else { continue };
        match Label::canonical_user(&s) {
            Ok(l) => parsed.push(l),
            Err(e) => cx.err(item, e.to_string()),
        }
    }
    (cx.error_count() == before).then(|| LabelSet::from_labels(parsed))
}

fn env(cx: &mut Cx, v: &Val<'_>) -> Option<BTreeMap<EnvName, String>> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    let mut out = BTreeMap::new();
    for (k, node) in obj.map.iter() {
        let val = cx.value_of(&obj.val, k, node);
        let key_origin = cx.origin_at(k.mark());
        let name = match EnvName::parse(k.as_str()) {
            Some(n) => n,
            None => {
                cx.error(
                    key_origin,
                    val.path(),
                    format!(
                        "environment variable name {} is not POSIX: expected letters, digits and '_', not starting with a digit",
                        quote(k.as_str())
                    ),
                );
                continue;
            }
        };
        if EnvName::RESERVED.contains(&name.as_str()) {
            cx.error(
                key_origin,
                val.path(),
                format!(
                    "{name} is set by kici-scaler for every agent and cannot be overridden (reserved: {})",
                    EnvName::RESERVED.join(", ")
                ),
            );
            continue;
        }
        if !kici_model::contract::agent_accepts(name.as_str()) {
            // The KiCI agent refuses to start on a KICI_* name outside its
            // schema: catch it here instead of at every spawn.
            cx.error(
                key_origin,
                val.path(),
                format!(
                    "{name} is not a variable the KiCI agent accepts: it refuses to start on unknown KICI_* names (see the agent bootstrap contract)"
                ),
            );
            continue;
        }
        if DERIVED_ENV.contains(&name.as_str()) {
            cx.warn(
                key_origin,
                val.path(),
                format!("{name} replaces the value kici-scaler derives from the scaler entry"),
            );
        }
        if let Some(s) = cx.string(&val) {
            out.insert(name, s);
        }
    }
    (cx.error_count() == before).then_some(out)
}

fn network_policy(cx: &mut Cx, v: &Val<'_>) -> Option<NetworkPolicy> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(
        &obj,
        &["allowlist", "denyAll", "hostAccess"],
        Keys::Lenient,
        |_| None,
    );
    let allowlist = cx
        .opt(&obj, "allowlist", |cx, v| {
            let items = cx.list(v)?;
            let before = cx.error_count();
            let mut nets = Vec::with_capacity(items.len());
            for item in &items {
                let Some(s) = cx.string(item) else { continue };
                let parsed = s
                    .parse::<IpNet>()
                    .ok()
                    .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::from));
                match parsed {
                    Some(n) => nets.push(n),
                    None => cx.err(
                        item,
                        format!(
                            "expected a CIDR such as \"10.1.0.0/16\" or an IP address, got {}",
                            quote(&s)
                        ),
                    ),
                }
            }
            (cx.error_count() == before).then_some(nets)
        })
        .value()
        .unwrap_or_default();
    let deny_all = cx
        .opt(&obj, "denyAll", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(false);
    let host_access = cx.opt(&obj, "hostAccess", |cx, v| {
        let items = cx.list(v)?;
        let before = cx.error_count();
        let mut entries = Vec::with_capacity(items.len());
        for item in &items {
            let Some(s) = cx.string(item) else { continue };
            match s.parse::<HostAccess>() {
                Ok(e) => entries.push(e),
                Err(e) => cx.err(item, e.to_string()),
            }
        }
        (cx.error_count() == before).then_some(entries)
    });
    (cx.error_count() == before).then_some(NetworkPolicy {
        allowlist,
        deny_all,
        host_access: host_access.value(),
    })
}

fn extension(cx: &mut Cx, v: &Val<'_>) -> Option<LabelSetExtension> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &["readOnlyRootfs"], Keys::Strict, |_| None);
    let read_only_rootfs = cx
        .opt(&obj, "readOnlyRootfs", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(false);
    (cx.error_count() == before).then_some(LabelSetExtension { read_only_rootfs })
}

/// A bare-metal label set's agent: `binaryPath`. Upstream also accepts an
/// `image` instead, and then runs the job's own container image as the agent
/// with its runtime injected; kici-scaler has no such mode, so that label
/// set is refused rather than started some other way.
fn bare_metal(cx: &mut Cx, obj: &Obj<'_>) -> Option<LabelSetBackend> {
    if image_instead_of_binary(obj) {
        let image = cx.field(obj, "image")?;
        cx.err(
            &image,
            "a bare-metal label set with an `image` and no `binaryPath` runs the job's own container image as its agent upstream; kici-scaler does not support that mode: set `binaryPath` to the agent binary, or move this label set to a container scaler",
        );
        return None;
    }
    required_truthy(cx, obj, "binaryPath", ScalerType::BareMetal, true).map(|p| {
        LabelSetBackend::BareMetal {
            binary_path: PathBuf::from(p),
        }
    })
}

/// A label set naming a non-empty string `image` and no `binaryPath` (as
/// upstream's truthiness test reads them).
fn image_instead_of_binary(obj: &Obj<'_>) -> bool {
    let non_empty_string = |key: &str| matches!(obj.map.get(key), Some(Node::Scalar(s)) if matches!(classify(s), Scalar::Str(t) if !t.is_empty()));
    non_empty_string("image") && !non_empty_string("binaryPath")
}

fn path_buf(cx: &mut Cx, v: &Val<'_>) -> Option<PathBuf> {
    cx.string(v).map(PathBuf::from)
}

/// Parses `labelSets[i]` for a scaler of type `kind` (`None` when the type
/// itself is invalid: type-specific rules are then skipped).
pub(crate) fn parse(cx: &mut Cx, v: &Val<'_>, kind: Option<ScalerType>) -> ParsedLabelSet {
    let mut out = ParsedLabelSet {
        config: None,
        labels: None,
        resources: None,
        has_resources: false,
        resources_origin: None,
        origin: cx.origin(v),
        path: v.path(),
    };
    let Some(obj) = cx.obj(v) else { return out };
    let before = cx.error_count();
    cx.check_keys(&obj, &KEYS, Keys::Strict, hint);

    let labels = cx.required(&obj, "labels", labels);
    out.labels = labels.as_ref().map(|(set, _)| set.clone());
    let resources = cx.opt(&obj, "resources", resources::request);
    out.has_resources = !matches!(resources, Got::Absent);
    out.resources_origin = cx.field(&obj, "resources").map(|v| cx.origin(&v));
    let resources = resources.value();
    out.resources = resources;
    let env = cx.opt(&obj, "env", env).value().unwrap_or_default();
    let network_policy = cx.opt(&obj, "networkPolicy", network_policy).value();
    let backpressure_mode = cx
        .opt(&obj, "backpressureMode", |cx, v| {
            cx.choice(
                v,
                &[
                    ("pause", BackpressureMode::Pause),
                    ("drop", BackpressureMode::Drop),
                ],
            )
        })
        .value();
    let image_pull_policy = cx
        .opt(&obj, "imagePullPolicy", |cx, v| {
            cx.choice(
                v,
                &[
                    ("Always", ImagePullPolicy::Always),
                    ("IfNotPresent", ImagePullPolicy::IfNotPresent),
                    ("Never", ImagePullPolicy::Never),
                ],
            )
        })
        .value()
        // Upstream's default since 0.9: agent images are pinned, and pulling
        // on every spawn only loads the registry.
        .unwrap_or(ImagePullPolicy::IfNotPresent);
    let container_socket = cx
        .opt(&obj, "containerSocket", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(false);
    let volumes = cx
        .opt(&obj, "volumes", |cx, v| cx.string_list(v))
        .value()
        .unwrap_or_default();
    let kernel_path = cx
        .opt(&obj, "kernelPath", path_buf)
        .value()
        .filter(|p| !p.as_os_str().is_empty());
    let vcpu_count = cx
        .opt(&obj, "vcpuCount", |cx, v| cx.positive_int(v))
        .value();
    let mem_size_mib = cx
        .opt(&obj, "memSizeMib", |cx, v| cx.positive_int(v))
        .value();
    let overlay_drive_size_mib = cx
        .opt(&obj, "overlayDriveSizeMib", |cx, v| cx.positive_int(v))
        .value();
    let ext = cx
        .opt(&obj, "x-kici-scaler", extension)
        .value()
        .unwrap_or_default();

    // Upstream's schema is one flat object: the other types' fields are
    // type-checked too, then dropped.
    for (key, owner) in [
        ("image", ScalerType::Container),
        ("binaryPath", ScalerType::BareMetal),
        ("rootfsPath", ScalerType::Firecracker),
    ] {
        if kind != Some(owner) {
            let _ = cx.opt(&obj, key, |cx, v| cx.string(v));
        }
    }
    let backend = match kind {
        None => None,
        Some(kind) => {
            // A bare-metal `image` without `binaryPath` is an error of its
            // own (below), not a field to ignore.
            let bare_metal_image = kind == ScalerType::BareMetal && image_instead_of_binary(&obj);
            let owned: Vec<(&str, &[ScalerType])> = OWNED
                .iter()
                .copied()
                .filter(|(key, _)| !(bare_metal_image && *key == "image"))
                .collect();
            warn_foreign(cx, &obj, kind, &owned);
            if ext.read_only_rootfs && kind != ScalerType::Container {
                if let Some(x) = cx.field(&obj, "x-kici-scaler") {
                    cx.warn_at(&x, format!("readOnlyRootfs only applies to container scalers; ignored for this {kind} scaler"),
                    );
                }
            }
            match kind {
                ScalerType::Container => {
                    required_truthy(cx, &obj, "image", kind, true).map(|image| {
                        LabelSetBackend::Container {
                            image,
                            image_pull_policy,
                            container_socket,
                            volumes,
                        }
                    })
                }
                ScalerType::BareMetal => bare_metal(cx, &obj),
                ScalerType::Event => Some(LabelSetBackend::Event),
                ScalerType::Firecracker => {
                    required_truthy(cx, &obj, "rootfsPath", kind, true).map(|p| {
                        LabelSetBackend::Firecracker(FirecrackerLabelSet {
                            rootfs_path: PathBuf::from(p),
                            kernel_path,
                            vcpu_count,
                            mem_size_mib,
                            overlay_drive_size_mib,
                        })
                    })
                }
            }
        }
    };

    if cx.error_count() != before {
        return out;
    }
    if let (Some((set, raw)), Some(backend)) = (labels, backend) {
        out.config = Some(LabelSetConfig {
            labels: set,
            raw_labels: raw,
            origin: out.origin.clone(),
            resources,
            env,
            network_policy,
            backpressure_mode,
            backend,
            ext,
        });
    }
    out
}
