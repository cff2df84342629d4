//! Helpers shared by the integration tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use kici_config::{load_documents, ConfigErrors, Loaded};

pub const MAIN: &str = "scalers.yaml";

/// A main file with `version: 1` and the given `scalers:` entries (YAML
/// list items, indented by the caller as under `scalers:`).
pub fn with_scalers(entries: &str) -> String {
    format!("version: 1\nscalers:\n{entries}")
}

/// A container scaler named `name` with one label set `[labels]`.
pub fn container(name: &str, labels: &str) -> String {
    format!(
        "  - name: {name}\n    type: container\n    maxAgents: 2\n    labelSets:\n      - labels: [{labels}]\n        image: kici/agent:1\n"
    )
}

pub fn ok(text: &str) -> Loaded {
    match load_documents(&[(MAIN, text)]) {
        Ok(l) => l,
        Err(e) => panic!("expected the config to load:\n{e}\n--- config:\n{text}"),
    }
}

pub fn err(text: &str) -> ConfigErrors {
    match load_documents(&[(MAIN, text)]) {
        Ok(_) => panic!("expected errors for:\n{text}"),
        Err(e) => e,
    }
}

/// The error lines, as displayed.
pub fn err_lines(text: &str) -> Vec<String> {
    err(text).iter().map(|d| d.to_string()).collect()
}

/// Asserts that some error line contains every fragment.
pub fn assert_error(text: &str, fragments: &[&str]) {
    let lines = err_lines(text);
    assert!(
        lines
            .iter()
            .any(|l| fragments.iter().all(|f| l.contains(f))),
        "no error contains {fragments:?}; errors:\n{}",
        lines.join("\n")
    );
}

pub fn warning_lines(l: &Loaded) -> Vec<String> {
    l.warnings.iter().map(|d| d.to_string()).collect()
}
