//! The whole load: parse every file, merge drop-in scalers after the main
//! file's, walk the top-level schema, every scaler, then the rules that span
//! scalers (duplicate names, label-set overlaps).

use crate::cross;
use crate::cx::{field_path, Cx, Got, Keys, Obj, Val};
use crate::diagnostic::{self, ConfigErrors, Diagnostic};
use crate::node::Node;
use crate::resources::{self, NamedCap};
use crate::scaler::{self, Globals, ParsedScaler};
use crate::yaml::{self, classify, describe, quote, ParseFailure, Scalar};
use crate::Loaded;
use ipnet::Ipv4Net;
use kici_model::{Config, FirecrackerNetwork, MachinePool, Origin, ResourceRequest};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;

const TOP_KEYS: [&str; 7] = [
    "version",
    "globalMaxAgents",
    "defaults",
    "globalResourceCap",
    "machinePools",
    "scalers",
    "firecracker",
];

const FIRECRACKER_KEYS: [&str; 6] = [
    "cidr",
    "bridgeName",
    "gateway",
    "netmask",
    "table",
    "autoProvisionHost",
];

/// Linux interface names are at most 15 bytes.
const MAX_IFNAME_LEN: usize = 15;

/// One file's text, named as diagnostics will name it.
pub(crate) struct Doc<'a> {
    pub name: Arc<str>,
    pub text: &'a str,
}

fn parse_all(cx: &mut Cx, docs: &[Doc<'_>]) -> Vec<Option<Node>> {
    docs.iter()
        .enumerate()
        .map(|(i, d)| {
            let main = i == 0;
            match yaml::parse_with_warnings(i, d.text) {
                Ok((node, warnings)) => {
                    for w in warnings {
                        cx.warn(cx.origin_at(w.at), "", w.message);
                    }
                    Some(node)
                }
                Err(ParseFailure::Empty) if main => {
                    cx.error(
                        Origin::new(d.name.clone(), 1, 1),
                        "",
                        "the file is empty: expected a mapping with at least `version: 1` and `scalers`",
                    );
                    None
                }
                Err(ParseFailure::Empty) => {
                    cx.warn(Origin::new(d.name.clone(), 1, 1), "", "empty drop-in file: nothing to add");
                    None
                }
                Err(ParseFailure::NotAMapping { line, col }) if main => {
                    cx.error(
                        Origin::new(d.name.clone(), line, col),
                        "",
                        "the top level must be a mapping (version, globalMaxAgents, scalers, ...)",
                    );
                    None
                }
                Err(ParseFailure::NotAMapping { line, col }) => {
                    cx.warn(
                        Origin::new(d.name.clone(), line, col),
                        "",
                        "the top level is not a mapping: this drop-in file is ignored (only its `scalers` list would be read)",
                    );
                    None
                }
                Err(ParseFailure::Syntax { line, col, message }) => {
                    cx.error(Origin::new(d.name.clone(), line, col), "", message);
                    None
                }
            }
        })
        .collect()
}

fn top_obj(node: &Node) -> Option<Obj<'_>> {
    node.as_mapping().map(|map| Obj {
        map,
        val: Val::root(node, ""),
    })
}

/// The scaler nodes a drop-in adds (`None` when it has no `scalers` list at
/// all), with warnings for everything it ignores.
fn drop_in_scalers<'n>(cx: &mut Cx, obj: &Obj<'n>) -> Option<Vec<&'n Node>> {
    for k in obj.map.keys() {
        if k.as_str() != "scalers" {
            cx.warn(
                cx.origin_at(k.mark()),
                field_path("", k.as_str()),
                format!(
                    "{} is ignored in a drop-in file: only `scalers` is read from scalers.d (set it in the main file)",
                    quote(k.as_str())
                ),
            );
        }
    }
    if let Some(Node::Sequence(seq)) = obj.map.get("scalers") {
        return Some(seq.iter().collect());
    }
    // Upstream merges a drop-in's `scalers` only when it is a list; anything
    // else (null included) adds nothing.
    if let Some(v) = cx.field(obj, "scalers") {
        let got = describe(v.node);
        cx.warn_at(
            &v,
            format!("`scalers` in a drop-in must be a list, got {got}: ignored"),
        );
    }
    None
}

fn version(cx: &mut Cx, top: &Obj<'_>) {
    match cx.field(top, "version") {
        None => cx.err_key(top, "version", "missing required key `version` (must be 1)"),
        Some(v) => {
            let ok = matches!(v.node, Node::Scalar(s) if classify(s) == Scalar::Number(1.0));
            if !ok {
                let got = describe(v.node);
                cx.err(&v, format!("unsupported version: expected 1, got {got}"));
            }
        }
    }
}

fn defaults(cx: &mut Cx, v: &Val<'_>) -> Option<Option<ResourceRequest>> {
    let obj = cx.obj(v)?;
    cx.check_keys(&obj, &["resources"], Keys::Lenient, |_| None);
    match cx.opt(&obj, "resources", resources::request) {
        Got::Value(r) => Some(Some(r)),
        Got::Absent => Some(None),
        Got::Bad => None,
    }
}

fn valid_pool_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `machinePools`; `None` when any entry is invalid (references to pools are
/// then not checked, to avoid reporting follow-on errors).
fn machine_pools(cx: &mut Cx, v: &Val<'_>) -> Option<Vec<MachinePool>> {
    let items = cx.list(v)?;
    let before = cx.error_count();
    let mut pools: Vec<MachinePool> = Vec::with_capacity(items.len());
    for item in &items {
        let Some(obj) = cx.obj(item) else { continue };
        cx.check_keys(&obj, &["name", "cap"], Keys::Strict, |_| None);
        let name = cx.required(&obj, "name", |cx, v| {
            let s = cx.string(v)?;
            if valid_pool_name(&s) {
                Some(s)
            } else {
                cx.err(v, format!(
                        "machinePool name {} must be letters, digits, '.', '_' or '-' and not start with '.' (it names ledger files)",
                        quote(&s)
                    ),
                );
                None
            }
        });
        let cap = cx.required(&obj, "cap", resources::cap);
        let (Some(name), Some(cap)) = (name, cap) else {
            continue;
        };
        if let Some(first) = pools.iter().find(|p| p.name == name) {
            cx.err_field(
                &obj,
                "name",
                format!(
                    "Duplicate machinePool name {} (first defined at {})",
                    quote(&name),
                    first.origin
                ),
            );
            continue;
        }
        pools.push(MachinePool {
            name,
            cap,
            origin: cx.origin(&obj.val),
        });
    }
    (cx.error_count() == before).then_some(pools)
}

fn ipv4(cx: &mut Cx, v: &Val<'_>, what: &str) -> Option<Ipv4Addr> {
    let s = cx.string(v)?;
    match s.parse::<Ipv4Addr>() {
        Ok(a) => Some(a),
        Err(_) => {
            cx.err(v, format!("expected {what}, got {}", quote(&s)));
            None
        }
    }
}

fn nonempty(cx: &mut Cx, v: &Val<'_>) -> Option<String> {
    let s = cx.string(v)?;
    if s.is_empty() {
        cx.err(v, "must not be empty");
        return None;
    }
    Some(s)
}

/// The `firecracker` block. The gateway and netmask default from the CIDR
/// (upstream's literal defaults when the CIDR is the default one).
fn firecracker(cx: &mut Cx, v: &Val<'_>) -> Option<FirecrackerNetwork> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &FIRECRACKER_KEYS, Keys::Lenient, |_| None);
    let defaults = FirecrackerNetwork::default();
    let cidr_val = cx.field(&obj, "cidr");
    let cidr = match cx.opt(&obj, "cidr", |cx, v| {
        let s = cx.string(v)?;
        let Ok(net) = s.parse::<Ipv4Net>() else {
            cx.err(v, format!("expected an IPv4 CIDR such as \"10.0.0.0/24\", got {}", quote(&s)),
            );
            return None;
        };
        if net.prefix_len() > 30 {
            cx.err(v, format!("cidr {net} leaves no room for the gateway and a VM: the prefix must be /30 or shorter"),
            );
            return None;
        }
        if net.addr() != net.network() {
            cx.warn_at(v, format!("cidr {net} has host bits set; the network is {}", net.trunc()),
            );
        }
        Some(net)
    }) {
        Got::Value(n) => Some(n),
        Got::Absent => Some(defaults.cidr),
        Got::Bad => None,
    };
    let gateway = cx.opt(&obj, "gateway", |cx, v| ipv4(cx, v, "an IPv4 address"));
    let netmask = cx.opt(&obj, "netmask", |cx, v| {
        ipv4(cx, v, "a dotted IPv4 netmask")
    });
    let bridge_name = cx
        .opt(&obj, "bridgeName", nonempty)
        .value()
        .unwrap_or(defaults.bridge_name);
    if bridge_name.len() > MAX_IFNAME_LEN {
        if let Some(b) = cx.field(&obj, "bridgeName") {
            cx.warn_at(&b, format!("bridgeName {} is longer than the {MAX_IFNAME_LEN} bytes Linux allows for an interface name", quote(&bridge_name)),
            );
        }
    }
    let table = cx
        .opt(&obj, "table", nonempty)
        .value()
        .unwrap_or(defaults.table);
    if let Some(t) = cx.field(&obj, "table") {
        // Read for upstream compatibility, but our rules live in tables the
        // daemon names itself (one per concern, each tagged with the owning
        // instance), so an operator's name would silently do nothing.
        cx.warn_at(
            &t,
            "firecracker.table is not used: kici-scaler keeps its nftables rules in its own tables (`inet kici_scaler`, `bridge kici_scaler`; see docs/deviations.md, D-nftables)",
        );
    }
    let auto_provision_host = cx
        .opt(&obj, "autoProvisionHost", |cx, v| cx.bool(v))
        .value()
        .unwrap_or(defaults.auto_provision_host);
    let cidr = cidr?;
    let net = cidr.trunc();
    let first_host = u32::from(net.network()).checked_add(1).map(Ipv4Addr::from);
    let gateway = match gateway {
        Got::Value(g) => {
            let at = cidr_val
                .map(|c| format!(" (cidr at {})", cx.origin(&c)))
                .unwrap_or_default();
            if !net.contains(&g) || g == net.network() || g == net.broadcast() {
                cx.err_field(
                    &obj,
                    "gateway",
                    format!("gateway {g} is not a usable host address of cidr {cidr}{at}"),
                );
            } else if Some(g) != first_host {
                // The address allocator reserves exactly the first host
                // address for the bridge; any other gateway would be handed
                // to an agent as well. `serve` refuses it; so does the file.
                let expected = first_host.map(|a| a.to_string()).unwrap_or_default();
                cx.err_field(
                    &obj,
                    "gateway",
                    format!(
                        "gateway {g} must be the first host address of cidr {cidr} (expected {expected}){at}: the bridge takes that address and the allocator never hands it out"
                    ),
                );
            }
            g
        }
        Got::Absent => first_host.unwrap_or(defaults.gateway),
        Got::Bad => defaults.gateway,
    };
    let netmask = match netmask {
        Got::Value(m) => {
            if m != cidr.netmask() {
                cx.err_field(
                    &obj,
                    "netmask",
                    format!(
                        "netmask {m} does not match cidr {cidr} (expected {})",
                        cidr.netmask()
                    ),
                );
            }
            m
        }
        _ => cidr.netmask(),
    };
    (cx.error_count() == before).then_some(FirecrackerNetwork {
        cidr,
        bridge_name,
        gateway,
        netmask,
        table,
        auto_provision_host,
    })
}

/// Loads already-read documents; `pre` holds findings from reading them
/// (I/O errors) and `files` the paths to report in [`Loaded`].
pub(crate) fn load(
    docs: &[Doc<'_>],
    pre_errors: Vec<Diagnostic>,
    pre_warnings: Vec<Diagnostic>,
    files: Vec<PathBuf>,
) -> Result<Loaded, ConfigErrors> {
    let names: Vec<Arc<str>> = docs.iter().map(|d| d.name.clone()).collect();
    let mut cx = Cx::new(names);
    cx.errors = pre_errors;
    cx.warnings = pre_warnings;
    let nodes = parse_all(&mut cx, docs);
    let config = walk(&mut cx, &nodes);
    let mut errors = std::mem::take(&mut cx.errors);
    let mut warnings = std::mem::take(&mut cx.warnings);
    diagnostic::sort(&mut errors, cx.files());
    diagnostic::sort(&mut warnings, cx.files());
    match config {
        Some(config) if errors.is_empty() => Ok(Loaded {
            config,
            warnings,
            files,
        }),
        _ if errors.is_empty() => Err(ConfigErrors(vec![Diagnostic::new(
            Origin::new(cx.file(0), 0, 0),
            "",
            "no configuration could be built",
        )])),
        _ => Err(ConfigErrors(errors)),
    }
}

fn walk(cx: &mut Cx, nodes: &[Option<Node>]) -> Option<Config> {
    let main = nodes.first()?.as_ref()?;
    let top = top_obj(main)?;
    cx.check_keys(&top, &TOP_KEYS, Keys::Lenient, |_| None);
    version(cx, &top);
    let global_max_agents = match cx.opt(&top, "globalMaxAgents", |cx, v| cx.positive_int(v)) {
        Got::Value(n) => Some(n),
        Got::Absent => Some(Config::DEFAULT_GLOBAL_MAX_AGENTS),
        Got::Bad => None,
    };
    let defaults_val = cx.field(&top, "defaults");
    let defaults = cx.opt(&top, "defaults", defaults).value().flatten();
    let global_cap = cx.opt(&top, "globalResourceCap", resources::cap);
    let global_cap_ok = !matches!(global_cap, Got::Bad);
    let global_cap = global_cap.value();
    let pools = match cx.opt(&top, "machinePools", machine_pools) {
        Got::Value(p) => Some(p),
        Got::Absent => Some(Vec::new()),
        Got::Bad => None,
    };
    let network = cx
        .opt(&top, "firecracker", firecracker)
        .value()
        .unwrap_or_default();

    if let (Some(d), Some(cap), Some(dv)) = (&defaults, &global_cap, &defaults_val) {
        let caps = [NamedCap {
            name: "globalResourceCap".into(),
            cap,
            global: false,
        }];
        for m in resources::misfits(Some(d), None, &caps) {
            if let Some(obj) = dv.node.as_mapping().map(|map| Obj { map, val: *dv }) {
                cx.err_field(&obj, "resources", m.message);
            }
        }
    }

    // Scaler nodes: the main file's, then each drop-in's in order.
    let mut scaler_nodes: Vec<&Node> = Vec::new();
    let scalers_val = cx.field(&top, "scalers");
    // Upstream appends drop-in lists to the main file's `scalers`, treating a
    // missing or null one as empty; only when no drop-in brings a list does
    // the main file's have to be one itself.
    let main_null = scalers_val.as_ref().is_some_and(Cx::is_null);
    if let Some(v) = scalers_val.as_ref().filter(|_| !main_null) {
        if let Some(items) = cx.list(v) {
            scaler_nodes.extend(items.iter().map(|i| i.node));
        }
    }
    let mut drop_in_lists = false;
    for node in nodes.iter().skip(1).flatten() {
        if let Some(obj) = top_obj(node) {
            if let Some(added) = drop_in_scalers(cx, &obj) {
                drop_in_lists = true;
                scaler_nodes.extend(added);
            }
        }
    }
    if scalers_val.is_none() && !drop_in_lists {
        cx.err_key(
            &top,
            "scalers",
            "missing required key `scalers` (a list of scaler entries)",
        );
    } else if main_null && !drop_in_lists {
        if let Some(v) = &scalers_val {
            cx.err(
                v,
                "expected a list of scaler entries, got null (write `scalers: []` for none)",
            );
        }
    } else if scaler_nodes.is_empty() {
        let origin = scalers_val.map_or_else(|| cx.origin(&top.val), |v| cx.origin(&v));
        cx.warn(
            origin,
            "scalers",
            "no scalers are configured: no agents will ever be provisioned",
        );
    }

    let globals = Globals {
        global_max_agents,
        defaults: defaults.as_ref(),
        global_cap: if global_cap_ok {
            global_cap.as_ref()
        } else {
            None
        },
        pools: pools.as_deref(),
    };
    let roots: Vec<String> = (0..scaler_nodes.len())
        .map(|i| format!("scalers[{i}]"))
        .collect();
    let parsed: Vec<ParsedScaler> = scaler_nodes
        .iter()
        .zip(&roots)
        .map(|(node, root)| scaler::parse(cx, &Val::root(node, root), &globals))
        .collect();
    cross::check(cx, &parsed);

    let scalers: Option<Vec<_>> = parsed.into_iter().map(|p| p.entry).collect();
    Some(Config {
        global_max_agents: global_max_agents?,
        defaults,
        global_resource_cap: global_cap,
        machine_pools: pools?,
        scalers: scalers?,
        firecracker: network,
    })
}
