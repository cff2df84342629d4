//! `diff`: field-level changes between two snapshots.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use kici_config::{diff, FieldChange};
use serde_json::json;

fn lines(old: &str, new: &str) -> Vec<String> {
    diff(&ok(old).config, &ok(new).config)
        .iter()
        .map(|c| c.to_string())
        .collect()
}

#[test]
fn identical_configs_have_no_changes() {
    let text = with_scalers(&format!("{}{}", container("a", "x"), container("b", "y")));
    assert!(lines(&text, &text).is_empty());
    // Positions are not part of the comparison.
    let moved = format!("# a comment\n\n{text}");
    assert!(lines(&text, &moved).is_empty());
}

#[test]
fn scalar_change_is_named_by_scaler() {
    let old = with_scalers(&format!("{}{}", container("a", "x"), container("b", "y")));
    let new = old.replacen("maxAgents: 2", "maxAgents: 10", 2).replacen(
        "maxAgents: 10",
        "maxAgents: 2",
        1,
    );
    assert_eq!(lines(&old, &new), ["scalers[name=b].maxAgents: 2 -> 10"]);
    let c = &diff(&ok(&old).config, &ok(&new).config)[0];
    assert_eq!(
        c,
        &FieldChange {
            path: "scalers[name=b].maxAgents".into(),
            old: Some(json!(2)),
            new: Some(json!(10))
        }
    );
}

#[test]
fn added_removed_and_type_changed_scalers() {
    let a = container("a", "x");
    let b = container("b", "y");
    let old = with_scalers(&format!("{a}{b}"));
    let new = with_scalers(&a);
    let d = diff(&ok(&old).config, &ok(&new).config);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].path, "scalers[name=b]");
    assert!(d[0].new.is_none());
    assert_eq!(d[0].old.as_ref().unwrap()["maxAgents"], json!(2));
    assert!(d[0].to_string().ends_with(" -> (absent)"));

    let d = diff(&ok(&new).config, &ok(&old).config);
    assert_eq!(
        (d.len(), d[0].path.as_str(), d[0].old.is_none()),
        (1, "scalers[name=b]", true)
    );

    let bm = "  - name: b\n    type: bare-metal\n    maxAgents: 2\n    labelSets:\n      - labels: [y]\n        binaryPath: /a\n";
    let changed = with_scalers(&format!("{a}{bm}"));
    let d = diff(&ok(&old).config, &ok(&changed).config);
    assert_eq!(d.len(), 2, "{d:#?}");
    assert_eq!(
        (d[0].path.as_str(), d[0].new.is_none()),
        ("scalers[name=b]", true)
    );
    assert_eq!(
        (d[1].path.as_str(), d[1].old.is_none()),
        ("scalers[name=b]", true)
    );
    assert_eq!(d[1].new.as_ref().unwrap()["type"], json!("bare-metal"));
}

#[test]
fn nested_fields_lists_and_top_level() {
    let old = with_scalers(&container("a", "x, y"));
    let new = format!(
        "version: 1\nglobalMaxAgents: 9\nfirecracker: {{cidr: 10.1.0.0/24}}\nscalers:\n{}        env: {{A: b}}\n",
        container("a", "x, y, z").replace("    labelSets:", "    warmPool: {enabled: true, size: 1}\n    labelSets:")
    );
    let got = lines(&old, &new);
    let expected = [
        "firecracker.cidr: \"10.0.0.0/24\" -> \"10.1.0.0/24\"",
        "firecracker.gateway: \"10.0.0.1\" -> \"10.1.0.1\"",
        "globalMaxAgents: 50 -> 9",
        "scalers[name=a].labelSets[0].env.A: (absent) -> \"b\"",
        "scalers[name=a].labelSets[0].labels[2]: (absent) -> \"z\"",
        "scalers[name=a].warmPool: (absent) -> ",
    ];
    assert_eq!(got.len(), expected.len(), "{got:#?}");
    for (g, e) in got.iter().zip(expected) {
        assert!(g.starts_with(e), "{g} vs {e}");
    }
    let d = diff(&ok(&old).config, &ok(&new).config);
    assert_eq!(
        d[5].new,
        Some(json!({"enabled": true, "size": 1, "idleTimeout": 300.0}))
    );
}

#[test]
fn reordering_scalers_is_reported() {
    let a = container("a", "x");
    let b = container("b", "y");
    let got = lines(
        &with_scalers(&format!("{a}{b}")),
        &with_scalers(&format!("{b}{a}")),
    );
    assert_eq!(got, ["scalers(order): [\"a\",\"b\"] -> [\"b\",\"a\"]"]);
}

#[test]
fn extension_changes_show_seconds() {
    let old = with_scalers(&container("a", "x"));
    let new = with_scalers(&container("a", "x").replace(
        "    labelSets:",
        "    x-kici-scaler: {registrationTimeoutSeconds: 30}\n    labelSets:",
    ));
    assert_eq!(
        lines(&old, &new),
        ["scalers[name=a].x-kici-scaler.deadlines.registration: 120.0 -> 30.0"]
    );
}
