//! Routing behaviour: upstream's `label-matcher.test.ts` checklist
//! adapted to our deviations (docs/deviations.md, D-tie-break and
//! D-empty-runs-on), explanation reason
//! codes, and auto labels.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{bare_metal, config, container, firecracker, labels};
use kici_model::{Config, Label, Role, Roles};
use kici_routing::{label_set_overlaps, CordonSet, HostPlatform, Reason, Route, Router};

fn linux_x64() -> HostPlatform {
    HostPlatform::new("linux", "x86_64")
}

fn router(cfg: &Config) -> Router {
    Router::new(cfg, &linux_x64())
}

/// Routes and checks that `explain` agrees.
fn route_full(
    r: &Router,
    job: &[&str],
    exclude: &[&str],
    cordoned: &CordonSet,
) -> Option<(usize, usize)> {
    let (job, exclude) = (labels(job), labels(exclude));
    let routed = r.route(&job, &exclude, cordoned);
    assert_eq!(
        routed,
        r.explain(&job, &exclude, cordoned).chosen,
        "route and explain disagree"
    );
    routed.map(|Route { scaler, label_set }| (scaler, label_set))
}

fn route(r: &Router, job: &[&str]) -> Option<(usize, usize)> {
    route_full(r, job, &[], &CordonSet::none())
}

fn route_ex(r: &Router, job: &[&str], exclude: &[&str]) -> Option<(usize, usize)> {
    route_full(r, job, exclude, &CordonSet::none())
}

fn reasons(r: &Router, job: &[&str], exclude: &[&str], cordoned: &CordonSet) -> Vec<String> {
    r.explain(&labels(job), &labels(exclude), cordoned)
        .candidates
        .iter()
        .map(|c| c.reason.to_string())
        .collect()
}

// ---- normalise ------------------------------------------------------------

#[test]
fn normalise_sorts_dedups_and_lower_cases() {
    assert_eq!(labels(&["linux", "docker"]).key(), "docker,linux");
    assert_eq!(labels(&["linux", "linux", "docker"]).key(), "docker,linux");
    assert_eq!(labels(&["Linux", "DOCKER"]).key(), "docker,linux");
    assert_eq!(
        labels(&["Linux", "docker", "LINUX", "Docker", "arm64"]).key(),
        "arm64,docker,linux"
    );
    assert_eq!(labels(&[]).key(), "");
}

// ---- exact match (labelSetsMatch) -----------------------------------------

#[test]
fn exact_match_is_normalised_equality() {
    assert_eq!(labels(&["linux", "docker"]), labels(&["linux", "docker"]));
    assert_eq!(labels(&["linux", "docker"]), labels(&["docker", "linux"]));
    assert_ne!(labels(&["linux", "docker"]), labels(&["linux", "gpu"]));
    assert_ne!(labels(&["linux"]), labels(&["linux", "docker"]));
    assert_ne!(
        labels(&["linux", "docker", "gpu"]),
        labels(&["linux", "docker"])
    );
    assert_eq!(labels(&["Linux", "DOCKER"]), labels(&["linux", "docker"]));
}

// ---- overlaps --------------------------------------------------------------

#[test]
fn no_overlaps() {
    let cfg = config([
        container("a").set(&["linux", "docker"]),
        bare_metal("b").set(&["linux", "gpu"]),
    ]);
    assert!(label_set_overlaps(&cfg.scalers).is_empty());
}

#[test]
fn overlap_between_two_scalers() {
    let cfg = config([
        container("a").set(&["linux", "docker"]),
        bare_metal("b").set(&["docker", "Linux"]),
    ]);
    let overlaps = label_set_overlaps(&cfg.scalers);
    assert_eq!(overlaps.len(), 1);
    assert_eq!(overlaps[0].labels.key(), "docker,linux");
    assert_eq!(overlaps[0].first.as_str(), "a");
    assert_eq!(overlaps[0].second.as_str(), "b");
    let text = overlaps[0].to_string();
    assert_eq!(
        text,
        r#"Label set [docker,linux] overlaps between scalers "a" and "b""#
    );
}

#[test]
fn overlaps_allow_intra_scaler_duplicates() {
    let cfg = config([container("a")
        .set(&["linux", "docker"])
        .set(&["docker", "linux"])]);
    assert!(label_set_overlaps(&cfg.scalers).is_empty());
}

#[test]
fn overlaps_report_each_pair_with_first_owner() {
    let cfg = config([
        container("a").set(&["linux", "docker"]).set(&["x"]),
        bare_metal("b").set(&["linux", "docker"]).set(&["x"]),
        firecracker("c").set(&["docker", "linux"]),
    ]);
    let found: Vec<(String, String, String)> = label_set_overlaps(&cfg.scalers)
        .into_iter()
        .map(|o| (o.labels.key(), o.first.to_string(), o.second.to_string()))
        .collect();
    let expect = |l: &str, a: &str, b: &str| (l.to_string(), a.to_string(), b.to_string());
    assert_eq!(
        found,
        [
            expect("docker,linux", "a", "b"),
            expect("x", "a", "b"),
            expect("docker,linux", "a", "c")
        ]
    );
}

// ---- selection ---------------------------------------------------------------

fn two_scalers() -> Router {
    router(&config([
        container("docker")
            .set(&["linux", "docker"])
            .set(&["linux", "docker", "arm64"]),
        bare_metal("mac")
            .set(&["macos", "darwin", "bare-metal"])
            .set(&["linux", "gpu"]),
    ]))
}

#[test]
fn selection_exact_match_returns_scaler_and_index() {
    assert_eq!(route(&two_scalers(), &["linux", "docker"]), Some((0, 0)));
}

#[test]
fn selection_second_label_set() {
    assert_eq!(
        route(&two_scalers(), &["linux", "docker", "arm64"]),
        Some((0, 1))
    );
}

#[test]
fn selection_second_scaler() {
    assert_eq!(route(&two_scalers(), &["linux", "gpu"]), Some((1, 1)));
}

#[test]
fn selection_none() {
    assert_eq!(route(&two_scalers(), &["windows"]), None);
    assert_eq!(route(&two_scalers(), &["linux", "docker", "gpu"]), None);
}

#[test]
fn selection_subset_match() {
    assert_eq!(route(&two_scalers(), &["macos"]), Some((1, 0)));
    // Subset of both docker sets: the smaller one wins.
    assert_eq!(route(&two_scalers(), &["docker"]), Some((0, 0)));
    assert_eq!(route(&two_scalers(), &["arm64"]), Some((0, 1)));
}

#[test]
fn selection_is_order_and_case_insensitive() {
    let r = two_scalers();
    assert_eq!(route(&r, &["docker", "linux"]), Some((0, 0)));
    assert_eq!(route(&r, &["LINUX", "Docker"]), Some((0, 0)));
    assert_eq!(route(&r, &["GPU", "linux", "Linux"]), Some((1, 1)));
    // Case in the configuration does not matter either.
    let upper = router(&config([container("c").set(&["Linux", "DOCKER"])]));
    assert_eq!(route(&upper, &["docker", "linux"]), Some((0, 0)));
}

// ---- exclusion -----------------------------------------------------------------

#[test]
fn exclusion_skips_a_set_with_an_excluded_label() {
    let r = router(&config([container("c")
        .set(&["linux", "docker", "gpu"])
        .set(&["linux", "docker", "cpu"])]));
    assert_eq!(route_ex(&r, &["linux"], &["gpu"]), Some((0, 1)));
    assert_eq!(route_ex(&r, &["linux"], &["GPU"]), Some((0, 1)));
}

#[test]
fn exclusion_empty_is_the_same_as_omitted() {
    let r = two_scalers();
    for job in [&["linux"][..], &["docker"], &["macos"], &[]] {
        assert_eq!(route_ex(&r, job, &[]), route(&r, job));
    }
}

#[test]
fn exclusion_falls_through_to_the_next_scaler() {
    let r = router(&config([
        firecracker("fc").set(&["linux"]),
        container("docker").set(&["linux"]),
    ]));
    assert_eq!(route(&r, &["linux"]), Some((0, 0)));
    assert_eq!(
        route_ex(&r, &["linux"], &["kici:agent:firecracker"]),
        Some((1, 0))
    );
}

#[test]
fn exclusion_of_everything_gives_none() {
    let r = two_scalers();
    assert_eq!(route_ex(&r, &["linux"], &["linux"]), None);
    assert_eq!(route_ex(&r, &[], &["kici:os:linux"]), None);
}

#[test]
fn unknown_exclude_label_is_ignored() {
    assert_eq!(
        route_ex(&two_scalers(), &["linux", "docker"], &["nowhere"]),
        Some((0, 0))
    );
}

// ---- gate (mandatory labels) -------------------------------------------------------

fn gated_and_open() -> Router {
    router(&config([
        bare_metal("gpu").mandatory(&["gpu"]).set(&["linux", "gpu"]),
        container("cpu").set(&["linux", "docker"]),
    ]))
}

#[test]
fn gate_matches_when_all_mandatory_labels_present() {
    assert_eq!(route(&gated_and_open(), &["linux", "gpu"]), Some((0, 0)));
}

#[test]
fn gate_generic_job_skips_gated_scaler() {
    assert_eq!(route(&gated_and_open(), &["linux"]), Some((1, 0)));
}

#[test]
fn gate_only_gated_scalers_gives_none() {
    let r = router(&config([bare_metal("gpu")
        .mandatory(&["gpu"])
        .set(&["linux", "gpu"])]));
    assert_eq!(route(&r, &["linux"]), None);
}

#[test]
fn gate_absent_is_the_same_as_empty() {
    // The model has no "undefined": an absent gate is the empty set.
    let r = router(&config([container("c").mandatory(&[]).set(&["linux"])]));
    assert_eq!(route(&r, &["linux"]), Some((0, 0)));
}

#[test]
fn gate_is_case_insensitive() {
    let r = router(&config([bare_metal("gpu")
        .mandatory(&["GPU"])
        .set(&["linux", "Gpu"])]));
    assert_eq!(route(&r, &["linux", "gpu"]), Some((0, 0)));
    assert_eq!(route(&r, &["LINUX", "GPU"]), Some((0, 0)));
}

#[test]
fn gate_with_several_labels_needs_all() {
    let r = router(&config([bare_metal("hpc")
        .mandatory(&["gpu", "cuda"])
        .set(&["linux", "gpu", "cuda"])]));
    assert_eq!(route(&r, &["gpu"]), None);
    assert_eq!(route(&r, &["cuda"]), None);
    assert_eq!(route(&r, &["gpu", "cuda"]), Some((0, 0)));
}

#[test]
fn gate_empty_runs_on_skips_gated_and_picks_the_smallest_ungated() {
    let r = router(&config([
        bare_metal("gpu").mandatory(&["gpu"]).set(&["gpu"]),
        container("big")
            .set(&["linux", "docker", "large"])
            .set(&["linux", "docker"]),
        container("small").set(&["linux"]),
    ]));
    // As upstream routes a job without labels: the first label set without
    // a gate, in config order, not the smallest one (this used to rank it
    // like any other job and pick "small").
    assert_eq!(route(&r, &[]), Some((1, 0)));
}

#[test]
fn gate_empty_runs_on_with_only_gated_scalers_gives_none() {
    let r = router(&config([bare_metal("gpu")
        .mandatory(&["gpu"])
        .set(&["gpu"])]));
    assert_eq!(route(&r, &[]), None);
}

#[test]
fn gate_smallest_set_among_gated() {
    let r = router(&config([
        bare_metal("big")
            .mandatory(&["gpu"])
            .set(&["linux", "gpu", "cuda"]),
        bare_metal("small")
            .mandatory(&["gpu"])
            .set(&["linux", "gpu"]),
    ]));
    assert_eq!(route(&r, &["gpu"]), Some((1, 0)));
}

#[test]
fn gate_and_exclude_stack() {
    let r = router(&config([
        bare_metal("gpu").mandatory(&["gpu"]).set(&["linux", "gpu"]),
        container("cpu").set(&["linux", "docker"]),
    ]));
    assert_eq!(route_ex(&r, &["gpu"], &["kici:agent:bare-metal"]), None);
    assert_eq!(route_ex(&r, &["linux"], &["docker"]), None);
}

// ---- deviations ------------------------------------------------------------------

#[test]
fn tie_break_counts_role_labels_as_upstream() {
    // A plain job lands on the least-privileged pool: the exec-only pool's
    // two labels beat the all-roles pool's one label plus two role labels,
    // as upstream ranks them. (This used to count configured labels only and
    // pick the all-roles pool.)
    let r = router(&config([
        container("all-roles").set(&["linux"]),
        container("exec-only")
            .roles(Roles::Only(vec![]))
            .set(&["linux", "docker"]),
        container("builder")
            .roles(Roles::Only(vec![Role::Builder]))
            .set(&["linux"]),
    ]));
    assert_eq!(route(&r, &["linux"]), Some((1, 0)));
    // builder: 1 + 1 = 2 ties exec-only's 2 + 0 and loses on config order.
    assert_eq!(
        r.explain(&labels(&["linux"]), &labels(&[]), &CordonSet::none())
            .candidates[2]
            .reason
            .to_string(),
        "larger-than-winner"
    );
    // An internal job still needs its role label.
    assert_eq!(route(&r, &["linux", "kici:role:builder"]), Some((2, 0)));
}

#[test]
fn tie_break_never_counts_host_derived_labels() {
    // Upstream compared enriched sizes: "mac" (bare metal on a macOS host)
    // gets 2 os labels and its platform taint where "lean" (a container) gets
    // 1 os label, so upstream picked "lean" despite its extra configured
    // label. os/arch labels differ between host platforms: they never count.
    let cfg = config([
        container("lean")
            .roles(Roles::Only(vec![]))
            .set(&["docker", "macos", "extra"]),
        bare_metal("mac")
            .roles(Roles::Only(vec![]))
            .set(&["docker", "fast"]),
    ]);
    let r = Router::new(&cfg, &HostPlatform::new("macos", "x86_64"));
    assert!(r.enriched(0, 0).len() < r.enriched(1, 0).len());
    assert_eq!(route(&r, &["docker", "macos"]), Some((1, 0)));
}

#[test]
fn tie_break_equal_user_labels_goes_to_config_order() {
    let r = router(&config([
        container("a").set(&["x", "y", "z"]).set(&["x", "w"]),
        bare_metal("b").set(&["x", "v"]),
    ]));
    assert_eq!(route(&r, &["x"]), Some((0, 1)));
}

#[test]
fn empty_runs_on_honours_exclude() {
    let r = router(&config([
        container("a").set(&["a"]),
        container("b").set(&["b", "c"]),
    ]));
    assert_eq!(route(&r, &[]), Some((0, 0)));
    assert_eq!(route_ex(&r, &[], &["a"]), Some((1, 0)));
    assert_eq!(route_ex(&r, &[], &["kici:scaler:a"]), Some((1, 0)));
}

// ---- cordon ------------------------------------------------------------------

#[test]
fn cordoned_scaler_is_skipped() {
    let r = router(&config([
        container("a").set(&["linux"]),
        container("b").set(&["linux", "docker"]),
    ]));
    assert_eq!(
        route_full(&r, &["linux"], &[], &CordonSet::from_indices([0])),
        Some((1, 0))
    );
    assert_eq!(
        route_full(&r, &["linux"], &[], &CordonSet::from_indices([0, 1])),
        None
    );
    assert_eq!(
        route_full(&r, &["linux"], &[], &CordonSet::from_indices([7])),
        Some((0, 0))
    );
}

// ---- unknown labels, many labels, many slots --------------------------------------

#[test]
fn unknown_job_label_matches_nothing() {
    assert_eq!(route(&two_scalers(), &["linux", "no-such-label"]), None);
    let e = two_scalers().explain(
        &labels(&["no-such-label"]),
        &labels(&[]),
        &CordonSet::none(),
    );
    assert!(e
        .candidates
        .iter()
        .all(|c| c.reason.to_string() == "not-superset:no-such-label"));
}

#[test]
fn long_label_lists_spill_and_still_route() {
    let many: Vec<String> = (0..20).map(|i| format!("l{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let r = router(&config([
        container("a").set(&many[..19]),
        container("b").set(&many),
    ]));
    assert_eq!(route(&r, &many), Some((1, 0)));
    assert_eq!(route(&r, &many[..12]), Some((0, 0)));
    assert_eq!(route_ex(&r, &many[..12], &many[10..20]), None);
}

#[test]
fn routes_across_many_words_of_slots() {
    // 40 scalers × 5 sets = 200 slots, four bitset words.
    let cfg = config((0..40).map(|s| {
        let mut b = container(&format!("s{s}"));
        for i in 0..5 {
            b = b.set(&["common", &format!("set{}", s * 5 + i), "filler"]);
        }
        b
    }));
    let r = router(&cfg);
    assert_eq!(route(&r, &["set199"]), Some((39, 4)));
    assert_eq!(route(&r, &["set64", "common"]), Some((12, 4)));
    assert_eq!(route(&r, &["kici:scaler:s33", "filler"]), Some((33, 0)));
    assert_eq!(route(&r, &["common"]), Some((0, 0)));
    assert_eq!(
        route_full(&r, &["common"], &["set0"], &CordonSet::from_indices(0..39)),
        Some((39, 0))
    );
    assert_eq!(route(&r, &["set1", "set199"]), None);
}

// ---- explanation ----------------------------------------------------------------------

#[test]
fn explanation_reason_codes() {
    let r = router(&config([
        container("cordoned").set(&["linux"]),
        bare_metal("gated")
            .mandatory(&["gpu", "cuda"])
            .set(&["linux", "gpu", "cuda"])
            .set(&["gpu", "cuda"]),
        container("narrow").set(&["windows"]),
        container("vetoed").set(&["linux", "slow"]),
        container("loser").set(&["linux", "docker", "big"]),
        container("winner").set(&["linux", "docker"]),
        container("tie").set(&["linux", "other"]),
    ]));
    let job = ["linux", "docker"];
    let cordon = CordonSet::from_indices([0]);
    let codes = reasons(&r, &job, &["slow", "zzz"], &cordon);
    assert_eq!(
        codes,
        [
            "cordoned",
            "gated-missing:cuda",
            "gated-missing:cuda",
            "not-superset:docker,linux",
            "not-superset:docker",
            "larger-than-winner",
            "selected",
            "not-superset:docker",
        ]
    );
    let e = r.explain(&labels(&job), &labels(&["slow"]), &cordon);
    assert_eq!(
        e.chosen,
        Some(Route {
            scaler: 5,
            label_set: 0
        })
    );
    assert_eq!(
        e.reason(1, 1),
        Some(&Reason::GatedMissing(Label::parse("cuda").unwrap()))
    );
    assert_eq!(e.candidates[1].scaler_name.as_str(), "gated");
    assert_eq!((e.candidates[2].scaler, e.candidates[2].label_set), (1, 1));

    // Exclusion shows when the set would otherwise match; equal user counts
    // after the winner lose on config order.
    let codes = reasons(&r, &["linux"], &["slow"], &cordon);
    assert_eq!(codes[3], "not-superset:linux");
    assert_eq!(codes[4], "excluded:slow");
    assert_eq!(codes[5], "larger-than-winner");
    assert_eq!(codes[6], "selected");
    assert_eq!(codes[7], "larger-than-winner");
}

#[test]
fn explanation_precedence() {
    let r = router(&config([
        bare_metal("all-wrong")
            .mandatory(&["gpu"])
            .set(&["gpu", "slow"]),
        container("gate-and-subset")
            .mandatory(&["gpu"])
            .set(&["gpu"]),
        container("subset-and-exclude").set(&["slow"]),
    ]));
    // Cordoned beats gated-missing, not-superset and excluded.
    let codes = reasons(&r, &["fast"], &["slow"], &CordonSet::from_indices([0]));
    assert_eq!(
        codes,
        ["cordoned", "gated-missing:gpu", "not-superset:fast"]
    );
    let codes = reasons(&r, &["fast"], &["slow"], &CordonSet::none());
    assert_eq!(codes[0], "gated-missing:gpu");
    // Excluded only once the set is a superset.
    let codes = reasons(&r, &["slow"], &["slow"], &CordonSet::none());
    assert_eq!(codes[2], "excluded:slow");
    // First excluded label in sorted order.
    let codes = reasons(
        &r,
        &["gpu"],
        &["slow", "kici:agent:bare-metal", "gpu"],
        &CordonSet::none(),
    );
    assert_eq!(codes, ["excluded:gpu", "excluded:gpu", "not-superset:gpu"]);
}

#[test]
fn explanation_with_no_winner() {
    let r = two_scalers();
    let e = r.explain(&labels(&["windows"]), &labels(&[]), &CordonSet::none());
    assert_eq!(e.chosen, None);
    assert_eq!(e.candidates.len(), 4);
    assert!(e.candidates.iter().all(|c| !c.reason.is_match()));
}

#[test]
fn explanation_serialises_reasons_as_codes() {
    let r = router(&config([
        container("a").set(&["linux"]),
        container("b").set(&["linux", "gpu"]),
    ]));
    let e = r.explain(&labels(&["linux", "gpu"]), &labels(&[]), &CordonSet::none());
    let json = serde_json::to_value(&e).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "chosen": {"scaler": 1, "labelSet": 0},
            "candidates": [
                {"scaler": 0, "scalerName": "a", "labelSet": 0, "reason": "not-superset:gpu"},
                {"scaler": 1, "scalerName": "b", "labelSet": 0, "reason": "selected"},
            ]
        })
    );
    assert_eq!(Reason::Cordoned.to_string(), "cordoned");
    assert_eq!(Reason::LargerThanWinner.to_string(), "larger-than-winner");
    assert_eq!(
        Reason::Excluded(Label::parse("x").unwrap()).to_string(),
        "excluded:x"
    );
}

// ---- auto labels ------------------------------------------------------------------------

fn strs(set: &kici_model::LabelSet) -> Vec<&str> {
    set.iter().map(Label::as_str).collect()
}

#[test]
fn enriched_container_set() {
    let r = router(&config(
        [container("Docker-Pool").set(&["Linux", "docker"])],
    ));
    assert_eq!(
        strs(r.enriched(0, 0)),
        [
            "docker",
            "kici:agent:container",
            "kici:arch:amd64",
            "kici:arch:x64",
            "kici:os:linux",
            "kici:role:builder",
            "kici:role:init-runner",
            "kici:scaler:docker-pool",
            "linux",
        ]
    );
}

#[test]
fn os_labels_follow_the_backend() {
    let cfg = config([
        bare_metal("bm").set(&["a"]),
        container("ct").set(&["a"]),
        firecracker("fc").set(&["a"]),
    ]);
    let r = Router::new(&cfg, &HostPlatform::new("macos", "aarch64"));
    let os_arch = |s: usize| -> Vec<String> {
        r.enriched(s, 0)
            .iter()
            .filter(|l| l.as_str().starts_with("kici:os:") || l.as_str().starts_with("kici:arch:"))
            .map(|l| l.to_string())
            .collect()
    };
    assert_eq!(
        os_arch(0),
        ["kici:arch:arm64", "kici:os:darwin", "kici:os:macos"]
    );
    assert_eq!(os_arch(1), ["kici:arch:arm64", "kici:os:linux"]);
    assert_eq!(os_arch(2), ["kici:arch:arm64", "kici:os:linux"]);
    // The bare-metal pool runs on this macOS/arm64 host, so it is tainted
    // with the host's platform: a job must name `macos` and `arm64` too.
    assert_eq!(route(&r, &["a", "kici:os:darwin"]), None);
    assert_eq!(
        route(&r, &["a", "kici:os:darwin", "macos", "arm64"]),
        Some((0, 0))
    );
    assert_eq!(route(&r, &["a", "kici:os:linux"]), Some((1, 0)));
    assert_eq!(route(&r, &["kici:arch:x64"]), None);
    let win = Router::new(&cfg, &HostPlatform::new("windows", "x86_64"));
    assert_eq!(
        route(&win, &["kici:os:win32", "kici:arch:amd64", "windows"]),
        Some((0, 0))
    );
}

#[test]
fn agent_type_label_in_runs_on_and_exclude() {
    let r = router(&config([
        container("ct").set(&["linux"]),
        firecracker("fc").set(&["linux"]),
    ]));
    assert_eq!(
        route(&r, &["linux", "kici:agent:firecracker"]),
        Some((1, 0))
    );
    assert_eq!(route(&r, &["KICI:AGENT:FIRECRACKER"]), Some((1, 0)));
    assert_eq!(
        route_ex(&r, &["linux"], &["kici:agent:container"]),
        Some((1, 0))
    );
    assert_eq!(
        route_ex(&r, &["kici:agent:firecracker"], &["kici:agent:firecracker"]),
        None
    );
}

#[test]
fn scaler_name_label() {
    let r = router(&config([
        container("Alpha").set(&["linux"]),
        container("beta").set(&["linux"]),
    ]));
    assert_eq!(route(&r, &["linux", "kici:scaler:beta"]), Some((1, 0)));
    assert_eq!(route(&r, &["kici:scaler:alpha"]), Some((0, 0)));
    assert_eq!(
        route_ex(&r, &["linux"], &["kici:scaler:alpha"]),
        Some((1, 0))
    );
}

#[test]
fn role_labels() {
    let r = router(&config([
        container("exec-only")
            .roles(Roles::Only(vec![]))
            .set(&["linux"]),
        container("builder")
            .roles(Roles::Only(vec![Role::Builder]))
            .set(&["linux"]),
        container("all").roles(Roles::All).set(&["linux"]),
    ]));
    let roles = |s: usize| -> Vec<&str> {
        r.enriched(s, 0)
            .iter()
            .map(Label::as_str)
            .filter(|l| l.starts_with("kici:role:"))
            .collect()
    };
    assert!(roles(0).is_empty());
    assert_eq!(roles(1), ["kici:role:builder"]);
    assert_eq!(roles(2), ["kici:role:builder", "kici:role:init-runner"]);
    // Execution jobs (no role label) run anywhere; internal jobs need the role.
    assert_eq!(route(&r, &["linux"]), Some((0, 0)));
    assert_eq!(route(&r, &["kici:role:builder"]), Some((1, 0)));
    assert_eq!(route(&r, &["kici:role:init-runner"]), Some((2, 0)));
}

#[test]
fn agent_labels_are_configured_spelling_plus_injected() {
    let r = router(&config([
        container("Pool-A").set(&["Linux", "docker", "LINUX"]),
        bare_metal("bm").roles(Roles::Only(vec![])).set(&["gpu"]),
        firecracker("fc")
            .roles(Roles::Only(vec![Role::InitRunner]))
            .set(&["vm"]),
    ]));
    assert_eq!(
        r.agent_labels(0, 0),
        [
            "Linux",
            "docker",
            "kici:agent:container",
            "kici:scaler:Pool-A",
            "kici:role:builder",
            "kici:role:init-runner",
        ]
    );
    assert_eq!(
        r.agent_labels(1, 0),
        ["gpu", "kici:agent:bare-metal", "kici:scaler:bm"]
    );
    assert_eq!(
        r.agent_labels(2, 0),
        [
            "vm",
            "kici:agent:firecracker",
            "kici:scaler:fc",
            "kici:role:init-runner"
        ]
    );
}

#[test]
fn agent_labels_fall_back_to_normalised_labels() {
    let mut cfg = config([container("c").set(&["B", "a"])]);
    cfg.scalers[0].label_sets[0].raw_labels.clear();
    let r = router(&cfg);
    assert_eq!(&r.agent_labels(0, 0)[..2], ["a", "b"]);
}

#[test]
fn scaler_index_and_counts() {
    let r = two_scalers();
    assert_eq!(r.scaler_index("docker"), Some(0));
    assert_eq!(r.scaler_index("mac"), Some(1));
    assert_eq!(r.scaler_index("Mac"), None);
    assert_eq!(r.scaler_count(), 2);
    assert_eq!(r.label_set_count(1), 2);
    assert_eq!(r.label_set_count(9), 0);
}

#[test]
#[should_panic(expected = "has 2 label sets")]
fn enriched_rejects_an_index_of_another_scaler() {
    // Slots are contiguous; index 2 of scaler 0 must not read scaler 1's set.
    let _ = two_scalers().enriched(0, 2);
}

#[test]
fn empty_config_routes_nothing() {
    let r = router(&config([]));
    assert_eq!(route(&r, &[]), None);
    assert_eq!(route(&r, &["linux"]), None);
    assert!(r
        .explain(&labels(&[]), &labels(&[]), &CordonSet::none())
        .candidates
        .is_empty());
}

#[test]
fn enriched_and_agent_labels_address_the_right_label_set_of_later_scalers() {
    let c = config([
        container("a").set(&["x", "one"]).set(&["x", "two"]),
        container("b")
            .set(&["y", "three"])
            .set(&["y", "four"])
            .set(&["y", "five"]),
    ]);
    let r = Router::new(&c, &HostPlatform::new("linux", "x86_64"));
    for (scaler, set, label) in [
        (0, 1, "two"),
        (1, 0, "three"),
        (1, 1, "four"),
        (1, 2, "five"),
    ] {
        assert!(
            r.enriched(scaler, set).iter().any(|l| l.as_str() == label),
            "enriched({scaler}, {set})"
        );
        assert!(
            r.agent_labels(scaler, set).iter().any(|l| l == label),
            "agent_labels({scaler}, {set})"
        );
    }
}

// ---- platform taints -------------------------------------------------------------

#[test]
fn taints_name_their_source_once_each() {
    use kici_model::{PlatformArch, PlatformOs, ScalerPlatform};
    use kici_routing::TaintSource;
    let mac = ScalerPlatform {
        os: PlatformOs::Macos,
        arch: PlatformArch::X64,
    };
    let r = router(&config([
        // Declared `macos` and a label set naming it too: one taint, from
        // the declaration; `arm64` from the label.
        bare_metal("mac")
            .platform(Some(mac))
            .set(&["macos", "arm64", "xcode"]),
        container("plain").set(&["linux"]),
    ]));
    let taints: Vec<(String, TaintSource)> = r
        .taints(0, 0)
        .iter()
        .map(|(l, s)| (l.to_string(), *s))
        .collect();
    assert_eq!(
        taints,
        [
            ("arm64".to_owned(), TaintSource::Label),
            ("macos".to_owned(), TaintSource::Platform)
        ]
    );
    assert!(r.taints(1, 0).is_empty());
    assert_eq!(r.gate(0, 0).key(), "arm64,macos");
    // The agent labels name the token once, in the configured spelling.
    let agent = r.agent_labels(0, 0);
    assert_eq!(agent.iter().filter(|l| l.as_str() == "macos").count(), 1);
    assert_eq!(
        reasons(&r, &["xcode"], &[], &CordonSet::none())[0],
        "tainted:arm64:label"
    );
    assert_eq!(route(&r, &["xcode", "arm64", "macos"]), Some((0, 0)));
}
