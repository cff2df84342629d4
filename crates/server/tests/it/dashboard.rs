//! The shipped Grafana dashboard and Prometheus rules against a live
//! daemon's `/metrics`: every expression names only families the daemon
//! exports, every exported family is on some panel (or listed as left out,
//! with why), the dashboard's datasource is a variable, and the rules pass
//! `promtool check rules`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::daemon::{Daemon, Dir};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// Families the dashboard deliberately leaves out, and why. None today:
/// keep an entry's reason when adding one.
const LEFT_OUT: &[(&str, &str)] = &[];

/// The families a live daemon exports (`# TYPE` lines).
fn exported() -> BTreeSet<String> {
    // A warm pool: its families exist only where one is configured.
    let dir = Dir::bare_metal(2);
    let config = std::fs::read_to_string(dir.path("scalers.yaml")).unwrap();
    let config = config.replace(
        "    maxAgents: 2\n",
        "    maxAgents: 2\n    warmPool: { enabled: true, size: 1 }\n",
    );
    assert!(config.contains("warmPool"), "{config}");
    std::fs::write(dir.path("scalers.yaml"), config).unwrap();
    let d = Daemon::start(&dir, &["--listen", "127.0.0.1:0"], &[]);
    let text = d.metrics();
    let families: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(families.len() > 20, "{text}");
    families
}

/// Every `kici_…` metric name in a PromQL expression.
fn names_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("kici_") {
        let start = i + at;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = expr[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(expr.len(), |e| start + e);
        if boundary {
            out.push(expr[start..end].to_owned());
        }
        i = end;
    }
    out
}

/// The family a sample name belongs to (`_total`, `_bucket`, `_sum`,
/// `_count` are its series), if the daemon exports it.
fn family_of(name: &str, families: &BTreeSet<String>) -> Option<String> {
    if families.contains(name) {
        return Some(name.to_owned());
    }
    ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .filter_map(|s| name.strip_suffix(s))
        .find(|f| families.contains(*f))
        .map(str::to_owned)
}

/// Every `expr` and variable query of the dashboard, with where it is.
fn dashboard_exprs(dash: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    fn panels(list: &Value, out: &mut Vec<(String, String)>) {
        for p in list.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?");
            for t in p["targets"].as_array().into_iter().flatten() {
                out.push((
                    format!("panel {title:?}"),
                    t["expr"].as_str().unwrap().to_owned(),
                ));
            }
            panels(&p["panels"], out);
        }
    }
    panels(&dash["panels"], &mut out);
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            out.push((format!("variable {}", v["name"]), q.to_owned()));
        }
    }
    out
}

fn rules_exprs(rules: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for g in rules["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            out.push((
                format!(
                    "rule {}",
                    r["alert"].as_str().or(r["record"].as_str()).unwrap()
                ),
                r["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

#[test]
fn the_dashboard_and_the_rules_name_what_the_daemon_exports() {
    let families = exported();
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("packaging/grafana/kici-scaler.json")).unwrap(),
    )
    .unwrap();
    let rules: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo("packaging/prometheus/kici-scaler-rules.yaml")).unwrap(),
    )
    .unwrap();

    let mut unknown = Vec::new();
    let mut on_panels = BTreeSet::new();
    let dash_exprs = dashboard_exprs(&dash);
    assert!(dash_exprs.len() > 20, "{dash_exprs:?}");
    let all: Vec<(bool, String, String)> = dash_exprs
        .into_iter()
        .map(|(place, expr)| (true, place, expr))
        .chain(
            rules_exprs(&rules)
                .into_iter()
                .map(|(place, expr)| (false, place, expr)),
        )
        .collect();
    for (from_dash, place, expr) in &all {
        let from_dash = *from_dash;
        let names = names_in(expr);
        assert!(
            !names.is_empty(),
            "{place}: no kici-scaler metric in {expr}"
        );
        for n in names {
            match family_of(&n, &families) {
                Some(f) if from_dash => {
                    on_panels.insert(f);
                }
                Some(_) => {}
                None => unknown.push(format!("{place}: {n} is not exported ({expr})")),
            }
        }
    }
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
    for (f, why) in LEFT_OUT {
        assert!(
            families.contains(*f),
            "LEFT_OUT names {f}, which is not exported"
        );
        assert!(
            !on_panels.contains(*f),
            "LEFT_OUT names {f} ({why}), but a panel shows it"
        );
    }
    let missing: Vec<&String> = families
        .iter()
        .filter(|f| !on_panels.contains(*f) && !LEFT_OUT.iter().any(|(l, _)| l == f))
        .collect();
    assert!(missing.is_empty(), "exported but on no panel: {missing:?}");

    // Importable into any Grafana: the datasource is a variable, and every
    // panel and query uses it.
    let vars = dash["templating"]["list"].as_array().unwrap();
    assert!(
        vars.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "no datasource variable"
    );
    let mut stack = vec![&dash["panels"]];
    while let Some(list) = stack.pop() {
        for p in list.as_array().into_iter().flatten() {
            if p["type"] != "row" {
                assert_eq!(
                    p["datasource"]["uid"], "${datasource}",
                    "panel {}",
                    p["title"]
                );
            }
            for t in p["targets"].as_array().into_iter().flatten() {
                assert_eq!(
                    t["datasource"]["uid"], "${datasource}",
                    "panel {}",
                    p["title"]
                );
            }
            stack.push(&p["panels"]);
        }
    }
}

#[test]
fn the_rules_pass_promtool() {
    let out = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(repo("packaging/prometheus/kici-scaler-rules.yaml"))
        .output()
        .expect("promtool (scripts/install-deps.sh installs Debian's prometheus package)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
