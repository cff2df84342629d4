//! YAML anchors and aliases, and the merge keys YAML 1.2 does not have, read
//! as upstream's parser (the `yaml` package, YAML 1.2 core schema) reads
//! them: aliases stand for the anchored value, `<<` is an ordinary key
//! (unknown in strict objects), anchors are per file, findings inside an
//! aliased value point at its definition, and alias bombs are refused with a
//! positioned error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use kici_config::load_documents;
use kici_model::{LabelSetBackend, ScalerType};
use proptest::prelude::*;

fn image(l: &kici_config::Loaded, scaler: usize) -> &str {
    match &l.config.scalers[scaler].label_sets[0].backend {
        LabelSetBackend::Container { image, .. } => image,
        other => panic!("not a container label set: {other:?}"),
    }
}

#[test]
fn aliases_stand_for_scalars_lists_and_mappings() {
    let l = ok("version: 1
scalers:
  - name: a
    type: container
    maxAgents: &max 4
    mandatoryLabels: &mandatory [linux]
    labelSets:
      - labels: [linux, a]
        image: &img kici/agent:1
        resources: &res { requests: { cpus: 1, memory: 512m } }
  - name: b
    type: container
    maxAgents: *max
    mandatoryLabels: *mandatory
    labelSets:
      - labels: [linux, b]
        image: *img
        resources: *res
");
    let [a, b] = &l.config.scalers[..] else {
        panic!("two scalers expected")
    };
    assert_eq!((a.max_agents, b.max_agents), (4, 4));
    assert_eq!(a.mandatory_labels, b.mandatory_labels);
    assert_eq!(image(&l, 0), "kici/agent:1");
    assert_eq!(image(&l, 1), "kici/agent:1");
    assert!(a.label_sets[0].resources.is_some());
    assert_eq!(a.label_sets[0].resources, b.label_sets[0].resources);
}

#[test]
fn a_whole_scaler_or_label_set_can_be_aliased() {
    let l = ok("version: 1
scalers:
  - name: a
    type: container
    maxAgents: 2
    labelSets:
      - &ls
        labels: [linux]
        image: kici/agent:1
  - name: b
    type: bare-metal
    maxAgents: 1
    labelSets:
      - labels: [metal]
        binaryPath: /opt/agent
");
    assert_eq!(l.config.scalers.len(), 2);
    // The same label set twice in one scaler is the usual warning, at the
    // anchored definition.
    let text = "version: 1
scalers:
  - name: a
    type: container
    maxAgents: 2
    labelSets:
      - &ls
        labels: [linux]
        image: kici/agent:1
      - *ls
";
    assert_eq!(
        warning_lines(&ok(text)),
        ["scalers.yaml:8:9: scalers[0].labelSets[1].labels: label set [linux] repeats labelSets[0] of the same scaler; the first one always wins"]
    );
}

#[test]
fn quoting_survives_an_alias() {
    let l = ok(&with_scalers(
        "  - name: &n '12'
    type: container
    maxAgents: 2
    labelSets:
      - labels: [*n]
        image: kici/agent:1
",
    ));
    assert_eq!(l.config.scalers[0].name.as_str(), "12");
    assert_eq!(l.config.scalers[0].label_sets[0].raw_labels, ["12"]);
    // A quoted number is still a string where a number is expected.
    assert_eq!(
        err_lines(&with_scalers(
            "  - name: &n '12'
    type: container
    maxAgents: *n
    labelSets:
      - labels: [a]
        image: kici/agent:1
"
        )),
        ["scalers.yaml:3:14: scalers[0].maxAgents: expected an integer > 0, got \"12\""]
    );
}

#[test]
fn merge_keys_are_ordinary_keys() {
    // Upstream's parser reads YAML 1.2, which has no merge keys: `<<` is a
    // key like any other. A scaler entry and a label set are strict objects,
    // so it is an unknown key there, and the fields it meant to bring in are
    // missing. (This config used to load, merged as js-yaml would.)
    let text = "version: 1
x-templates:
  container: &container
    type: container
    maxAgents: 2
  linux: &linux
    labels: [linux]
    image: kici/agent:1
scalers:
  - <<: *container
    name: plain
    labelSets:
      - <<: *linux
";
    let keys = "name, type, maxAgents, maxConcurrentSpawns, labelSets, host, socketPath, runtime, orchestratorUrl, extraHosts, networkIsolation, warmPool, mandatoryLabels, platform, roles, resourceCap, machinePool, enforceCgroups, firecrackerPath, jailerPath, kernelPath, chrootBaseDir, uid, gid, vcpuCount, memSizeMib, requireSudo, provisioningTargets, claimTtlSeconds, agentTokenTtlSeconds, x-kici-scaler";
    let hint = "(YAML 1.2, which upstream reads, has no merge keys: `<<` is an ordinary key and merges nothing; write the fields out, or alias whole values)";
    assert_eq!(
        err_lines(text),
        [
            format!("scalers.yaml:10:5: scalers[0][\"<<\"]: unrecognized key \"<<\" {hint}; accepted keys: {keys}"),
            "scalers.yaml:10:5: scalers[0].type: missing required key `type`".to_owned(),
            "scalers.yaml:10:5: scalers[0].maxAgents: missing required key `maxAgents`".to_owned(),
            format!("scalers.yaml:13:9: scalers[0].labelSets[0][\"<<\"]: unrecognized key \"<<\" {hint}; accepted keys: labels, image, imagePullPolicy, binaryPath, resources, containerSocket, volumes, env, networkPolicy, backpressureMode, rootfsPath, kernelPath, vcpuCount, memSizeMib, overlayDriveSizeMib, x-kici-scaler"),
            "scalers.yaml:13:9: scalers[0].labelSets[0].labels: missing required key `labels`".to_owned(),
        ]
    );
    // In an object upstream does not check strictly (the top level), `<<` is
    // an unknown key like any other: a warning, and nothing merged.
    let l = ok(&format!(
        "x: &v {{globalMaxAgents: 7}}\n<<: *v\n{}",
        with_scalers(&container("c", "a"))
    ));
    assert_eq!(l.config.global_max_agents, 50);
    assert!(warning_lines(&l).iter().any(|w| w.starts_with(&format!(
        "scalers.yaml:2:1: [\"<<\"]: unknown key \"<<\" {hint} is ignored"
    ))));
}

#[test]
fn merge_key_mistakes_are_ordinary_key_mistakes() {
    let base = "version: 1\nx: &b {type: container, maxAgents: 2}\n";
    // Written twice: a duplicate key, as upstream's parser reports it.
    assert_eq!(
        err_lines(&format!("{base}scalers:\n  - <<: *b\n    <<: *b\n")),
        ["scalers.yaml:5:5: duplicate key \"<<\" (first at line 4, column 5)"]
    );
    // Whatever its value, and quoted or not, it is the same unknown key.
    for entry in ["<<: 3", "'<<': *b", "\"<<\": [*b]"] {
        assert_error(
            &format!("{base}scalers:\n  - {entry}\n    name: a\n"),
            &["scalers.yaml:4:5: scalers[0][\"<<\"]: unrecognized key \"<<\""],
        );
    }
}

#[test]
fn errors_inside_an_aliased_value_point_at_its_definition() {
    let text = "version: 1
x-bad: &bad
  name: a
  type: container
  maxAgents: 0
  bogus: 1
  labelSets:
    - labels: [a]
      image: kici/agent:1
scalers:
  - *bad
  - name: b
    type: container
    maxAgents: &zero 0
    labelSets:
      - labels: [b]
        image: kici/agent:1
  - name: c
    type: container
    maxAgents: *zero
    labelSets:
      - labels: [c]
        image: kici/agent:1
";
    assert_eq!(
        err_lines(text),
        [
            "scalers.yaml:5:14: scalers[0].maxAgents: expected an integer > 0, got 0",
            "scalers.yaml:6:3: scalers[0].bogus: unrecognized key \"bogus\"; accepted keys: name, type, maxAgents, maxConcurrentSpawns, labelSets, host, socketPath, runtime, orchestratorUrl, extraHosts, networkIsolation, warmPool, mandatoryLabels, platform, roles, resourceCap, machinePool, enforceCgroups, firecrackerPath, jailerPath, kernelPath, chrootBaseDir, uid, gid, vcpuCount, memSizeMib, requireSudo, provisioningTargets, claimTtlSeconds, agentTokenTtlSeconds, x-kici-scaler",
            // The anchored value's own position (after `&zero`), for both uses.
            "scalers.yaml:14:22: scalers[1].maxAgents: expected an integer > 0, got 0",
            "scalers.yaml:14:22: scalers[2].maxAgents: expected an integer > 0, got 0",
        ]
    );
}

#[test]
fn anchors_are_per_file() {
    let main = "version: 1\nx: &img kici/agent:1\nscalers: []\n";
    let drop_in = "scalers:\n  - name: d\n    type: container\n    maxAgents: 1\n    labelSets:\n      - labels: [d]\n        image: *img\n";
    let err = load_documents(&[("scalers.yaml", main), ("scalers.d/a.yaml", drop_in)])
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "scalers.d/a.yaml:7:16: unknown alias *img: no anchor of that name is defined before it in this file (anchors do not carry over between files)"
    );
    // Within a drop-in they work; the same name in two files names two
    // different values.
    let drop_in = "x: &t [bare-metal, 3]\nscalers:\n  - name: d\n    type: bare-metal\n    maxAgents: &n 3\n    labelSets:\n      - labels: [d]\n        binaryPath: /opt/agent\n  - name: e\n    type: bare-metal\n    maxAgents: *n\n    labelSets:\n      - labels: [e]\n        binaryPath: /opt/agent\n";
    let main = "version: 1\nx: &n 2\nscalers:\n  - name: m\n    type: container\n    maxAgents: *n\n    labelSets:\n      - labels: [m]\n        image: kici/agent:1\n";
    let l = load_documents(&[("scalers.yaml", main), ("scalers.d/a.yaml", drop_in)]).unwrap();
    let s = &l.config.scalers;
    assert_eq!(
        (
            s[0].kind,
            s[0].max_agents,
            s[1].kind,
            s[1].max_agents,
            s[2].max_agents
        ),
        (ScalerType::Container, 2, ScalerType::BareMetal, 3, 3)
    );
    // A finding in the drop-in's aliased value names the drop-in, at the
    // definition, for each use.
    let drop_in = drop_in.replace("&n 3", "&n x");
    let err = load_documents(&[("scalers.yaml", main), ("scalers.d/a.yaml", &drop_in)])
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "scalers.d/a.yaml:5:19: scalers[1].maxAgents: expected an integer > 0, got \"x\"\nscalers.d/a.yaml:5:19: scalers[2].maxAgents: expected an integer > 0, got \"x\""
    );
}

#[test]
fn alias_mistakes_are_positioned() {
    assert_eq!(
        err_lines("version: 1\nscalers: *nope\n"),
        ["scalers.yaml:2:10: unknown alias *nope: no anchor of that name is defined before it in this file (anchors do not carry over between files)"]
    );
    assert_eq!(
        err_lines("version: 1\nscalers: &s [*s]\n"),
        ["scalers.yaml:2:14: alias *s refers to a node that contains it (recursive aliases are not supported)"]
    );
    // An alias as a key must stand for a scalar.
    assert_eq!(
        err_lines("version: 1\nx: &m {a: 1}\n*m : 2\n"),
        ["scalers.yaml:3:1: mapping keys must be plain strings"]
    );
    // A later anchor of the same name replaces the earlier one (YAML).
    let l = ok("version: 1\nx: &v 1\ny: &v 7\nglobalMaxAgents: *v\nscalers: []\n");
    assert_eq!(l.config.global_max_agents, 7);
}

#[test]
fn the_anchors_fixture_reads_as_written_out() {
    let l = ok(include_str!("../fixtures/valid/anchors.yaml"));
    let s = &l.config.scalers;
    assert_eq!(
        (s[0].max_agents, s[1].max_agents, s[1].kind),
        (4, 2, ScalerType::Container)
    );
    assert_eq!(image(&l, 1), "ghcr.io/kici-dev/agent:1.2.3");
    let large = &s[1].label_sets[0];
    assert_eq!(large.raw_labels, ["linux", "x64", "large"]);
    assert_eq!(large.env, s[0].label_sets[0].env);
    assert_ne!(large.resources, s[0].label_sets[0].resources);
    let arm = &s[1].label_sets[1];
    let env: Vec<(&str, &str)> = arm
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        env,
        [
            ("ARCH", "arm64"),
            ("CI", "true"),
            ("NODE_OPTIONS", "--max-old-space-size=2048")
        ]
    );
}

/// Ten lists of ten, each made of aliases to the one before: 10^9 nodes.
fn billion_laughs() -> String {
    let mut text = String::from("version: 1\na: &a [x, x, x, x, x, x, x, x, x, x]\n");
    let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
    for w in names.windows(2) {
        let items = vec![format!("*{}", w[0]); 10].join(", ");
        text.push_str(&format!("{0}: &{0} [{items}]\n", w[1]));
    }
    text.push_str("scalers: *i\n");
    text
}

#[test]
fn alias_bombs_are_refused_at_the_alias_that_crosses_the_cap() {
    // Nodes up to f's list: the root, `version: 1` (2), then a to e with
    // their keys (12 + 112 + 1112 + 11112 + 111112), f's key and list (2):
    // 123465. Each *e adds 111111, so f's eighth *e (column 8 + 7 * 4)
    // crosses 1,000,000.
    assert_eq!(
        err_lines(&billion_laughs()),
        ["scalers.yaml:7:36: the document expands to more than 1000000 YAML nodes (aliases counted at their full size): refused"]
    );
}

#[test]
fn aliases_nested_too_deep_are_refused() {
    let mut text = String::from("version: 1\na0: &a0 x\n");
    for i in 1..=40 {
        text.push_str(&format!("a{i}: &a{i} [*a{}]\n", i - 1));
    }
    text.push_str("scalers: []\n");
    // a33's alias is the 33rd standing inside one another.
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:35:12: aliases nest more than 32 deep here (an alias to a node holding an alias to ...): refused"]
    );
    // Aliases that deepen the document past the depth limit are refused too:
    // a is 251 levels deep, b 501 (accepted), c would be 752.
    let (open, close) = ("[".repeat(250), "]".repeat(250));
    let text = format!(
        "version: 1\na: &a {open}x{close}\nb: &b {open}*a{close}\nc: &c {open}*b{close}\nscalers: []\n"
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:4:257: this alias would nest the document more than 512 levels deep: refused"]
    );
}

#[test]
fn a_bomb_is_refused_on_a_small_stack() {
    let text = billion_laughs();
    let h = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || load_documents(&[("s.yaml", &text)]).is_err())
        .unwrap();
    assert!(h.join().unwrap());
}

const PIECES: [&str; 18] = [
    "a: &a {type: container, maxAgents: 2}\n",
    "b: &b [x, *a]\n",
    "c: &c\n  <<: *a\n  name: c\n",
    "<<: *a\n",
    "<<: [*a, *c]\n",
    "<<: *b\n",
    "d: *a\n",
    "e: *c\n",
    "  - <<: *a\n",
    "  - *c\n",
    "scalers:\n",
    "version: 1\n",
    "    <<: *c\n",
    "&a ",
    "*a",
    "*c ",
    "[*a, *b]",
    "f: &f [*b, *b, *b, *b]\n",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Anchors, aliases and merges in any order never panic, and every
    /// finding is positioned.
    #[test]
    fn anchor_soup_never_panics(picks in proptest::collection::vec(0..PIECES.len(), 0..24)) {
        let text: String = picks.iter().map(|&i| PIECES[i]).collect();
        if let Err(e) = load_documents(&[("s.yaml", &text), ("d.yaml", &text)]) {
            prop_assert!(!e.is_empty());
            for d in e.iter() {
                prop_assert!(!d.message.is_empty());
                prop_assert!(d.origin.line > 0, "{d}");
            }
        }
    }
}
