//! Property tests: route ≡ explain().chosen, route ≡ a straightforward
//! string-based reference of our rules (gates, platform taints, the
//! tie-break, jobs without labels), and invariance to label order, case and
//! repetition.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{scaler, ScalerBuilder};
use kici_model::{
    Config, LabelSet, PlatformArch, PlatformOs, Role, Roles, ScalerPlatform, ScalerType,
};
use kici_routing::{CordonSet, HostPlatform, Route, Router};
use proptest::prelude::*;
use std::collections::HashSet;

/// Configured labels, the plain platform labels (legacy taints) among them.
const USER_VOCAB: [&str; 10] = [
    "l0", "l1", "l2", "l3", "l4", "l5", "l6", "l7", "macos", "arm64",
];
/// Labels jobs and exclusions draw from: user labels, platform labels, auto
/// labels, and one label no configuration carries.
const JOB_VOCAB: [&str; 20] = [
    "l0",
    "l1",
    "l2",
    "l3",
    "l4",
    "l5",
    "l6",
    "l7",
    "macos",
    "arm64",
    "windows",
    "kici:agent:container",
    "kici:agent:firecracker",
    "kici:os:linux",
    "kici:os:darwin",
    "kici:arch:arm64",
    "kici:role:builder",
    "kici:scaler:s1",
    "kici:scaler:s12",
    "unknown",
];

#[derive(Debug, Clone)]
struct ScalerSpec {
    kind: ScalerType,
    name_upper: bool,
    mandatory: Vec<usize>,
    roles: Roles,
    platform: Option<ScalerPlatform>,
    sets: Vec<Vec<usize>>,
}

fn platform() -> impl Strategy<Value = Option<ScalerPlatform>> {
    let p = |os, arch| Some(ScalerPlatform { os, arch });
    prop_oneof![
        4 => Just(None),
        1 => Just(p(PlatformOs::Linux, PlatformArch::X64)),
        1 => Just(p(PlatformOs::Macos, PlatformArch::Arm64)),
        1 => Just(p(PlatformOs::Windows, PlatformArch::X64)),
        1 => Just(p(PlatformOs::Linux, PlatformArch::Arm64)),
    ]
}

fn kind() -> impl Strategy<Value = ScalerType> {
    prop_oneof![
        Just(ScalerType::Container),
        Just(ScalerType::BareMetal),
        Just(ScalerType::Firecracker)
    ]
}

fn roles() -> impl Strategy<Value = Roles> {
    prop_oneof![
        Just(Roles::All),
        Just(Roles::Only(vec![])),
        Just(Roles::Only(vec![Role::Builder])),
        Just(Roles::Only(vec![Role::InitRunner])),
    ]
}

fn scaler_spec() -> impl Strategy<Value = ScalerSpec> {
    let set = proptest::collection::vec(0..USER_VOCAB.len(), 1..5);
    (
        kind(),
        any::<bool>(),
        prop_oneof![3 => Just(vec![]), 1 => proptest::collection::vec(0..USER_VOCAB.len(), 1..3)],
        roles(),
        platform(),
        proptest::collection::vec(set, 1..5),
    )
        .prop_map(
            |(kind, name_upper, mandatory, roles, platform, sets)| ScalerSpec {
                kind,
                name_upper,
                mandatory,
                roles,
                platform,
                sets,
            },
        )
}

fn host() -> impl Strategy<Value = HostPlatform> {
    prop_oneof![
        Just(HostPlatform::new("linux", "x86_64")),
        Just(HostPlatform::new("macos", "aarch64")),
        Just(HostPlatform::new("windows", "x86_64")),
        Just(HostPlatform::new("freebsd", "riscv64")),
    ]
}

fn build(specs: &[ScalerSpec]) -> Config {
    common::config(specs.iter().enumerate().map(|(i, spec)| {
        let name = if spec.name_upper {
            format!("S{i}")
        } else {
            format!("s{i}")
        };
        let mandatory: Vec<&str> = spec.mandatory.iter().map(|&l| USER_VOCAB[l]).collect();
        let mut b: ScalerBuilder = scaler(&name, spec.kind)
            .mandatory(&mandatory)
            .roles(spec.roles.clone())
            .platform(spec.platform);
        for set in &spec.sets {
            let raw: Vec<&str> = set.iter().map(|&l| USER_VOCAB[l]).collect();
            b = b.set(&raw);
        }
        b
    }))
}

fn raw_labels() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec(proptest::sample::select(&JOB_VOCAB[..]), 0..5)
        .prop_map(|v| v.into_iter().map(str::to_owned).collect())
}

fn parse(raw: &[String]) -> LabelSet {
    LabelSet::parse(raw.iter()).unwrap()
}

/// Our rules, written as plainly as possible over strings.
fn reference(
    cfg: &Config,
    host: &HostPlatform,
    job: &[String],
    exclude: &[String],
    cordoned: &[usize],
) -> Option<Route> {
    let lower = |v: &[String]| -> HashSet<String> { v.iter().map(|s| s.to_lowercase()).collect() };
    let (job, exclude) = (lower(job), lower(exclude));
    let os_names = |os: &str| -> Vec<String> {
        match os {
            "linux" => vec!["kici:os:linux".into()],
            "macos" => vec!["kici:os:macos".into(), "kici:os:darwin".into()],
            "windows" => vec!["kici:os:windows".into(), "kici:os:win32".into()],
            other => vec![format!("kici:os:{other}")],
        }
    };
    let arch_names = |arch: &str| -> Vec<String> {
        match arch {
            "x86_64" | "x64" => vec!["kici:arch:x64".into(), "kici:arch:amd64".into()],
            "aarch64" | "arm64" => vec!["kici:arch:arm64".into()],
            other => vec![format!("kici:arch:{other}")],
        }
    };
    // The host as a platform, when it is one of upstream's.
    let host_platform = match (host.os.as_str(), host.arch.as_str()) {
        ("linux" | "macos" | "windows", "x86_64") => Some((host.os.clone(), "x64".to_owned())),
        ("linux" | "macos" | "windows", "aarch64") => Some((host.os.clone(), "arm64".to_owned())),
        _ => None,
    };
    let mut best: Option<(usize, Route)> = None;
    for (si, s) in cfg.scalers.iter().enumerate() {
        if cordoned.contains(&si) {
            continue;
        }
        if !s
            .mandatory_labels
            .iter()
            .all(|m| job.contains(&m.as_str().to_lowercase()))
        {
            continue;
        }
        let declared = s
            .platform
            .map(|p| (p.os.as_str().to_owned(), p.arch.as_str().to_owned()));
        let resolved = match (&declared, s.kind) {
            (Some(p), _) => Some(p.clone()),
            (None, ScalerType::BareMetal) => host_platform.clone(),
            (None, _) => None,
        };
        let mut taints: Vec<String> = Vec::new();
        if let Some((os, arch)) = &resolved {
            if os != "linux" {
                taints.push(os.clone());
            }
            if arch != "x64" {
                taints.push(arch.clone());
            }
        }
        let mut auto: Vec<String> = match &declared {
            Some((os, arch)) => [os_names(os), arch_names(arch)].concat(),
            None if s.kind == ScalerType::Event => Vec::new(),
            None => {
                let os = if s.kind == ScalerType::BareMetal {
                    host.os.as_str()
                } else {
                    "linux"
                };
                [os_names(os), arch_names(&host.arch)].concat()
            }
        };
        auto.extend(taints.iter().cloned());
        let kind = match s.kind {
            ScalerType::Container => "container",
            ScalerType::BareMetal => "bare-metal",
            ScalerType::Firecracker => "firecracker",
            ScalerType::Event => "event",
        };
        auto.push(format!("kici:agent:{kind}"));
        auto.push(format!("kici:scaler:{}", s.name.as_str().to_lowercase()));
        let roles: Vec<String> = match &s.roles {
            Roles::All => vec!["kici:role:builder".into(), "kici:role:init-runner".into()],
            Roles::Only(rs) => rs
                .iter()
                .map(|r| format!("kici:role:{}", r.as_str()))
                .collect(),
        };
        auto.extend(roles.iter().cloned());
        for (li, set) in s.label_sets.iter().enumerate() {
            let user: HashSet<String> = set.raw_labels.iter().map(|l| l.to_lowercase()).collect();
            let legacy = user
                .iter()
                .filter(|l| ["macos", "windows", "arm64"].contains(&l.as_str()));
            if !taints.iter().chain(legacy).all(|t| job.contains(t)) {
                continue;
            }
            let enriched: HashSet<String> =
                user.iter().cloned().chain(auto.iter().cloned()).collect();
            if !job.is_subset(&enriched) || exclude.iter().any(|e| enriched.contains(e)) {
                continue;
            }
            // Configured plus role labels; a job without labels takes the
            // first match.
            let rank = if job.is_empty() {
                0
            } else {
                user.len() + roles.len()
            };
            if best.as_ref().is_none_or(|(n, _)| rank < *n) {
                best = Some((
                    rank,
                    Route {
                        scaler: si,
                        label_set: li,
                    },
                ));
            }
        }
    }
    best.map(|(_, r)| r)
}

/// Shuffles (by rotation and reversal), re-cases and repeats labels.
fn mangle(
    raw: &[String],
    rotate: usize,
    reverse: bool,
    upper_mask: u32,
    repeat: usize,
) -> Vec<String> {
    let mut out: Vec<String> = raw
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if upper_mask & (1 << (i % 32)) != 0 {
                s.to_uppercase()
            } else {
                s.clone()
            }
        })
        .collect();
    if !out.is_empty() {
        let k = rotate % out.len();
        out.rotate_left(k);
        let dup = out[repeat % out.len()].clone();
        out.push(dup.to_uppercase());
    }
    if reverse {
        out.reverse();
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn route_matches_explain_and_reference(
        specs in proptest::collection::vec(scaler_spec(), 0..30),
        host in host(),
        job in raw_labels(),
        exclude in raw_labels(),
        cordoned in proptest::collection::vec(0usize..30, 0..4),
    ) {
        let cfg = build(&specs);
        let router = Router::new(&cfg, &host);
        let cordon = CordonSet::from_indices(cordoned.iter().copied());
        let (j, x) = (parse(&job), parse(&exclude));
        let routed = router.route(&j, &x, &cordon);
        let explained = router.explain(&j, &x, &cordon);
        prop_assert_eq!(routed, explained.chosen);
        prop_assert_eq!(routed, reference(&cfg, &host, &job, &exclude, &cordoned));

        // Exactly one `selected`, at the chosen route; every set explained once.
        let total: usize = cfg.scalers.iter().map(|s| s.label_sets.len()).sum();
        prop_assert_eq!(explained.candidates.len(), total);
        let selected: Vec<Route> = explained.candidates.iter()
            .filter(|c| c.reason.to_string() == "selected")
            .map(|c| Route { scaler: c.scaler, label_set: c.label_set })
            .collect();
        prop_assert_eq!(selected, routed.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn invariant_to_order_case_and_duplicates(
        specs in proptest::collection::vec(scaler_spec(), 1..12),
        host in host(),
        job in raw_labels(),
        exclude in raw_labels(),
        cordoned in proptest::collection::vec(0usize..12, 0..3),
        (rotate, reverse, upper_mask, repeat) in (any::<usize>(), any::<bool>(), any::<u32>(), any::<usize>()),
        (rotate2, reverse2, upper_mask2, repeat2) in (any::<usize>(), any::<bool>(), any::<u32>(), any::<usize>()),
    ) {
        let cfg = build(&specs);
        let router = Router::new(&cfg, &host);
        let cordon = CordonSet::from_indices(cordoned);
        let (j, x) = (parse(&job), parse(&exclude));
        let (j2, x2) = (
            parse(&mangle(&job, rotate, reverse, upper_mask, repeat)),
            parse(&mangle(&exclude, rotate2, reverse2, upper_mask2, repeat2)),
        );
        prop_assert_eq!(router.route(&j, &x, &cordon), router.route(&j2, &x2, &cordon));
        prop_assert_eq!(router.explain(&j, &x, &cordon), router.explain(&j2, &x2, &cordon));
    }

    #[test]
    fn invariant_to_configured_label_order_and_case(
        specs in proptest::collection::vec(scaler_spec(), 1..12),
        host in host(),
        job in raw_labels(),
        exclude in raw_labels(),
    ) {
        // The configuration side is normalised too: reversing and repeating
        // the labels of every configured set changes nothing.
        let cfg = build(&specs);
        let mut shuffled = specs.clone();
        for s in &mut shuffled {
            for set in &mut s.sets {
                set.reverse();
                set.extend(set.clone());
            }
        }
        let cfg2 = build(&shuffled);
        let (r1, r2) = (Router::new(&cfg, &host), Router::new(&cfg2, &host));
        let (j, x) = (parse(&job), parse(&exclude));
        prop_assert_eq!(r1.route(&j, &x, &CordonSet::none()), r2.route(&j, &x, &CordonSet::none()));
    }
}
