//! The JSON Schema of `scalers.yaml` (`kici-scaler schema`, shipped in the
//! package) against the loader, over the whole configuration corpus: every
//! file the loader accepts is valid under the schema, and every file it
//! refuses is refused by the schema too — but for the rules only the loader
//! can judge, each listed here with why. Then targeted structural errors
//! (unknown keys in strict objects, wrong types, enums), each refused by
//! both.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::daemon::{Dir, BIN};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// The schema as `kici-scaler schema` prints it.
fn schema() -> Value {
    let out = std::process::Command::new(BIN)
        .arg("schema")
        .output()
        .unwrap();
    assert!(out.status.success());
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let shipped: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("packaging/scalers.schema.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(printed, shipped, "the binary prints the shipped schema");
    printed
}

fn validator() -> jsonschema::Validator {
    jsonschema::draft202012::new(&schema()).unwrap()
}

/// Files the loader refuses for a reason a JSON Schema cannot express,
/// and why. Listed in docs/operations.md (*Editor support*).
const LOADER_ONLY: &[(&str, &str)] = &[
    (
        "conformance/23-overlap-after-canonicalisation.yaml",
        "label sets overlapping across scalers",
    ),
    (
        "conformance/34-mandatory-label-missing.yaml",
        "every label set must hold the scaler's mandatoryLabels",
    ),
    (
        "conformance/48-firecracker-gateway-not-first.yaml",
        "firecracker.gateway must be the first address of cidr",
    ),
    (
        "conformance/49-remote-engine-with-isolation.yaml",
        "networkIsolation needs a local container runtime (host)",
    ),
    (
        "conformance/49-type-event-provisioner-env-errors.yaml",
        "the provisioner's environment: reserved names, string values",
    ),
];

/// Files a YAML 1.2 reader other than the loader's reads differently (tags,
/// merge keys, directives): not comparable.
const YAML_DIFFERS: &[(&str, &str)] = &[
    (
        "conformance/12-null-scalers-with-drop-in.yaml",
        "a duplicate key, which other readers take the last of",
    ),
    (
        "conformance/15-tag-float-on-integer.yaml",
        "a !!float tag, which other readers apply",
    ),
    (
        "conformance/17-unknown-tag.yaml",
        "an unknown tag, which the loader ignores and other readers refuse",
    ),
    (
        "conformance/18-yaml-1-1-directive.yaml",
        "a %YAML 1.1 directive, which other readers follow",
    ),
];

fn corpus() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in [
        "crates/config/tests/conformance",
        "crates/config/tests/fixtures/valid",
        "crates/config/tests/fixtures/invalid",
        "examples",
        "packaging",
    ] {
        for e in std::fs::read_dir(repo(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|e| e == "yaml") {
                files.push(p);
            }
        }
    }
    files.sort();
    assert!(files.len() > 60, "the corpus is missing: {files:?}");
    files
}

fn name(p: &Path) -> String {
    p.strip_prefix(repo("")).unwrap_or(p).display().to_string()
}

#[test]
fn the_schema_agrees_with_the_loader_over_the_corpus() {
    let v = validator();
    let mut wrong = Vec::new();
    let mut loader_only_seen = Vec::new();
    let mut differs_seen = Vec::new();
    for path in corpus() {
        let file = name(&path);
        let text = std::fs::read_to_string(&path).unwrap();
        let loaded = kici_config::load(&path, None);
        let json: Option<Value> = serde_norway::from_str(&text).ok();
        if let Some((_, why)) = YAML_DIFFERS.iter().find(|(f, _)| file.ends_with(f)) {
            differs_seen.push(file.clone());
            println!("{file}: not compared ({why})");
            continue;
        }
        let Some(json) = json else {
            // A YAML error: an editor shows it, and the loader refuses it.
            if loaded.is_ok() {
                wrong.push(format!(
                    "{file}: the loader reads it, other YAML readers cannot"
                ));
            }
            continue;
        };
        let errors: Vec<String> = v
            .iter_errors(&json)
            .map(|e| format!("{}: {e}", e.instance_path))
            .collect();
        let listed = LOADER_ONLY.iter().find(|(f, _)| file.ends_with(f));
        match (&loaded, errors.is_empty()) {
            (Ok(_), true) | (Err(_), false) => {
                if listed.is_some() && loaded.is_err() {
                    wrong.push(format!(
                        "{file}: listed as loader-only, but the schema refuses it: {errors:?}"
                    ));
                }
            }
            (Ok(_), false) => wrong.push(format!(
                "{file}: the loader accepts it, the schema refuses: {errors:?}"
            )),
            (Err(e), true) => match listed {
                Some(_) => loader_only_seen.push(file.clone()),
                None => wrong.push(format!(
                    "{file}: the loader refuses it, the schema accepts it:\n{e}"
                )),
            },
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    assert_eq!(
        loader_only_seen.len(),
        LOADER_ONLY.len(),
        "stale LOADER_ONLY entries: {loader_only_seen:?}"
    );
    assert_eq!(
        differs_seen.len(),
        YAML_DIFFERS.len(),
        "stale YAML_DIFFERS entries: {differs_seen:?}"
    );
}

/// One valid scaler of each type, then one structural error at a time:
/// the loader and the schema both refuse each.
#[test]
fn structural_errors_are_refused_by_both() {
    let v = validator();
    let base = "version: 1
scalers:
  - name: c
    type: container
    maxAgents: 2
    x-kici-scaler: { provisionTimeoutSeconds: 30, backoff: { breakerThreshold: 3 } }
    labelSets:
      - labels: [a]
        image: kici/agent:1
        resources: { requests: { cpus: 1, memory: 1g } }
  - name: b
    type: bare-metal
    maxAgents: 1
    resourceCap: { maxCpu: 4 }
    labelSets:
      - labels: [b]
        binaryPath: /opt/agent
";
    let dir = Dir::with_config(base);
    let check = |text: &str| -> (bool, bool) {
        std::fs::write(dir.path("scalers.yaml"), text).unwrap();
        let loader = kici_config::load(&dir.path("scalers.yaml"), None).is_ok();
        let json: Value = serde_norway::from_str(text).unwrap();
        (loader, v.is_valid(&json))
    };
    assert_eq!(check(base), (true, true), "the base is valid");
    for (what, from, to) in [
        (
            "an unknown top-level-scaler key",
            "maxAgents: 2",
            "maxAgents: 2\n    maxAgentz: 3",
        ),
        (
            "an unknown label-set key",
            "image: kici/agent:1",
            "image: kici/agent:1\n        imagee: x",
        ),
        (
            "an unknown x-kici-scaler key",
            "provisionTimeoutSeconds: 30",
            "provisionTimeoutSecs: 30",
        ),
        (
            "an unknown backoff key",
            "breakerThreshold: 3",
            "breakerTreshold: 3",
        ),
        (
            "an unknown resources key",
            "cpus: 1, memory",
            "cpu: 1, memory",
        ),
        ("an unknown cap key", "maxCpu: 4", "maxCpus: 4"),
        ("maxAgents a string", "maxAgents: 2", "maxAgents: two"),
        ("maxAgents zero", "maxAgents: 2", "maxAgents: 0"),
        ("labels not a list", "labels: [a]", "labels: {a: 1}"),
        ("an unknown type", "type: container", "type: kubernetes"),
        (
            "an unknown runtime",
            "maxAgents: 2",
            "maxAgents: 2\n    runtime: rkt",
        ),
        ("version 2", "version: 1", "version: 2"),
        (
            "no labelSets",
            "    labelSets:\n      - labels: [b]\n        binaryPath: /opt/agent\n",
            "",
        ),
        (
            "a negative timeout",
            "provisionTimeoutSeconds: 30",
            "provisionTimeoutSeconds: -1",
        ),
        (
            "a boolean as a string",
            "maxAgents: 2",
            "maxAgents: 2\n    networkIsolation: \"yes\"",
        ),
    ] {
        assert!(base.contains(from), "{what}: {from:?}");
        let text = base.replacen(from, to, 1);
        assert_eq!(
            check(&text),
            (false, false),
            "{what} (loader ok?, schema ok?):\n{text}"
        );
    }
}
