//! The routing conformance corpus: every file under `tests/conformance/` is a
//! configuration (loaded by kici-config, as the daemon loads it) and the
//! routes it must give, beside the upstream behaviour each follows. Header
//! comments:
//!
//! - `# upstream:` (continued by `#   ` lines): what upstream KiCI 0.9 does
//!   and why, or where and why we deliberately differ; prose;
//! - `# host: <os>/<arch>`: the host platform for the lines below it
//!   (default `linux/x86_64`);
//! - `# route: <labels> [exclude <labels>] -> <scaler>[<i>] | none`: where a
//!   job with these labels (a JSON list, as a request carries them) lands;
//! - `# explain: <labels> -> <scaler>[<i>] <code>`: the verdict `route`
//!   gives that label set for that job;
//! - `# gate: <scaler>[<i>] = <labels>`: every label a job needs to land
//!   there (comma-separated, sorted; empty for none);
//! - `# agent-labels: <scaler>[<i>] = <JSON list>`: the agent's labels.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_routing::{request_labels, CordonSet, HostPlatform, Router};
use std::path::{Path, PathBuf};

/// A JSON list of labels at the start of `s`, and the rest of `s`.
fn labels_then(s: &str) -> (Vec<String>, &str) {
    let mut stream = serde_json::Deserializer::from_str(s).into_iter::<Vec<String>>();
    let labels = stream
        .next()
        .expect("a JSON list of labels")
        .expect("labels");
    let rest = &s[stream.byte_offset()..];
    (labels, rest.trim_start())
}

/// `name[i]` → (scaler index, label set index).
fn target(router: &Router, s: &str) -> (usize, usize) {
    let (name, index) = s
        .trim()
        .trim_end_matches(']')
        .split_once('[')
        .expect("name[i]");
    let scaler = router
        .scaler_index(name)
        .unwrap_or_else(|| panic!("no scaler {name}"));
    (scaler, index.parse().expect("label set index"))
}

fn host(s: &str) -> HostPlatform {
    let (os, arch) = s.trim().split_once('/').expect("os/arch");
    HostPlatform::new(os, arch)
}

fn check(path: &Path) -> Result<usize, String> {
    let text = std::fs::read_to_string(path).unwrap();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    if !text.contains("# upstream: ") {
        return Err(format!(
            "{name}: no `# upstream:` line saying what upstream does"
        ));
    }
    let loaded = kici_config::load_documents(&[("scalers.yaml", &text)])
        .map_err(|e| format!("{name}: the configuration does not load:\n{e}"))?;
    let config = &loaded.config;
    let mut router = Router::new(config, &HostPlatform::new("linux", "x86_64"));
    let none = CordonSet::none();
    let mut checked = 0;
    for line in text.lines() {
        let Some(directive) = line.strip_prefix("# ") else {
            continue;
        };
        let Some((kind, rest)) = directive.split_once(": ") else {
            continue;
        };
        let fail = |what: String| Err(format!("{name}: `{line}`: {what}"));
        match kind {
            "host" => router = Router::new(config, &host(rest)),
            "route" => {
                let (job, rest) = labels_then(rest);
                let (exclude, rest) = match rest.strip_prefix("exclude ") {
                    Some(r) => labels_then(r),
                    None => (Vec::new(), rest),
                };
                let want = rest.strip_prefix("-> ").expect("-> target").trim();
                let (job, exclude) = (
                    request_labels(&job).map_err(|e| e.to_string())?,
                    request_labels(&exclude).map_err(|e| e.to_string())?,
                );
                let got = router.route(&job, &exclude, &none);
                let want = (want != "none").then(|| target(&router, want));
                let got = got.map(|r| (r.scaler, r.label_set));
                if got != want {
                    return fail(format!("routed to {got:?}, expected {want:?}"));
                }
                // Explaining always agrees with routing.
                let explained = router.explain(&job, &exclude, &none).chosen;
                if explained.map(|r| (r.scaler, r.label_set)) != got {
                    return fail(format!("explain chose {explained:?}"));
                }
            }
            "explain" => {
                let (job, rest) = labels_then(rest);
                let rest = rest.strip_prefix("-> ").expect("-> target code");
                let (at, code) = rest.trim().split_once(' ').expect("target and code");
                let (scaler, set) = target(&router, at);
                let job = request_labels(&job).map_err(|e| e.to_string())?;
                let e = router.explain(&job, &request_labels(Vec::<String>::new()).unwrap(), &none);
                let got = e.reason(scaler, set).map(|r| r.to_string());
                if got.as_deref() != Some(code) {
                    return fail(format!("the verdict is {got:?}"));
                }
            }
            "gate" => {
                let (at, want) = rest
                    .split_once(" = ")
                    .unwrap_or((rest.trim_end_matches(" ="), ""));
                let (scaler, set) = target(&router, at);
                let got = router.gate(scaler, set).key();
                if got != want.trim() {
                    return fail(format!("the gate is {got:?}"));
                }
            }
            "agent-labels" => {
                let (at, want) = rest.split_once(" = ").expect("target = labels");
                let (scaler, set) = target(&router, at);
                let want: Vec<String> = serde_json::from_str(want).expect("JSON list");
                let got = router.agent_labels(scaler, set);
                if got != want {
                    return fail(format!("the agent labels are {got:?}"));
                }
            }
            _ => continue,
        }
        checked += 1;
    }
    if checked == 0 {
        return Err(format!(
            "{name}: no route, explain, gate or agent-labels line"
        ));
    }
    Ok(checked)
}

fn cases() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/conformance");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

#[test]
fn routing_conformance_corpus() {
    let cases = cases();
    assert!(cases.len() >= 8, "the corpus has {} cases", cases.len());
    let failures: Vec<String> = cases.iter().filter_map(|p| check(p).err()).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
