//! The conformance corpus: every file under `tests/conformance/` is one
//! configuration and what must become of it, beside the upstream behaviour
//! it follows. Its header comments say:
//!
//! - `# upstream:` (continued by `#   ` lines): what upstream KiCI 0.9 does
//!   with this configuration and why; prose, for the reader;
//! - `# upstream-verdict: accept|refuse`: upstream's loader's answer;
//! - `# verdict: accept|refuse`: ours (they differ only for deliberate
//!   deviations, which the `upstream:` prose names);
//! - `# error: <text>` / `# warning: <text>`: some error / warning line must
//!   contain the text (as displayed: `file:line:col: path: message`);
//! - `# no-error: <text>`: no error line contains the text;
//! - `# json: <pointer> = <json>`: the loaded configuration, serialised,
//!   holds that value at that JSON pointer (accepted configurations only);
//! - `#--- <file name>`: the lines below are another file, a drop-in named
//!   so (the first file is always `scalers.yaml`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

#[derive(Debug, Default)]
struct Case {
    upstream: String,
    upstream_verdict: Option<bool>,
    verdict: Option<bool>,
    errors: Vec<String>,
    no_errors: Vec<String>,
    warnings: Vec<String>,
    json: Vec<(String, serde_json::Value)>,
    files: Vec<(String, String)>,
}

fn verdict(v: &str) -> bool {
    match v.trim() {
        "accept" => true,
        "refuse" => false,
        other => panic!("verdict must be accept or refuse, got {other:?}"),
    }
}

fn parse_case(text: &str) -> Case {
    let mut case = Case {
        files: vec![("scalers.yaml".into(), String::new())],
        ..Case::default()
    };
    let mut in_upstream = false;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("#--- ") {
            case.files.push((name.trim().to_owned(), String::new()));
            in_upstream = false;
            continue;
        }
        let directive = line.strip_prefix("# ");
        match directive.and_then(|d| {
            d.split_once(": ")
                .or_else(|| d.strip_suffix(':').map(|k| (k, "")))
        }) {
            Some(("upstream", v)) => {
                case.upstream = v.to_owned();
                in_upstream = true;
            }
            Some(("upstream-verdict", v)) => case.upstream_verdict = Some(verdict(v)),
            Some(("verdict", v)) => case.verdict = Some(verdict(v)),
            Some(("error", v)) => case.errors.push(v.to_owned()),
            Some(("no-error", v)) => case.no_errors.push(v.to_owned()),
            Some(("warning", v)) => case.warnings.push(v.to_owned()),
            Some(("json", v)) => {
                let (pointer, value) = v.split_once(" = ").expect("json: <pointer> = <value>");
                let value = serde_json::from_str(value).expect("json value");
                case.json.push((pointer.to_owned(), value));
            }
            _ => {
                if in_upstream {
                    if let Some(more) = line.strip_prefix("#   ") {
                        case.upstream.push(' ');
                        case.upstream.push_str(more.trim());
                        continue;
                    }
                }
                in_upstream = false;
            }
        }
        if let Some(file) = case.files.last_mut() {
            file.1.push_str(line);
            file.1.push('\n');
        }
    }
    case
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

fn check(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).unwrap();
    let case = parse_case(&text);
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    if case.upstream.is_empty() {
        return Err(format!(
            "{name}: no `# upstream:` line saying what upstream does"
        ));
    }
    let (Some(ours), Some(_)) = (case.verdict, case.upstream_verdict) else {
        return Err(format!(
            "{name}: needs `# verdict:` and `# upstream-verdict:`"
        ));
    };
    let docs: Vec<(&str, &str)> = case
        .files
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    let result = kici_config::load_documents(&docs);
    let (errors, warnings, config) = match &result {
        Ok(l) => (
            Vec::new(),
            l.warnings.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
            Some(serde_json::to_value(&l.config).unwrap()),
        ),
        Err(e) => (e.iter().map(|d| d.to_string()).collect(), Vec::new(), None),
    };
    let shown = || {
        format!(
            "errors:\n  {}\nwarnings:\n  {}",
            errors.join("\n  "),
            warnings.join("\n  ")
        )
    };
    if result.is_ok() != ours {
        return Err(format!(
            "{name}: expected {}, got {}\n{}",
            if ours { "accept" } else { "refuse" },
            if result.is_ok() { "accept" } else { "refuse" },
            shown()
        ));
    }
    for want in &case.errors {
        if !errors.iter().any(|e| e.contains(want.as_str())) {
            return Err(format!("{name}: no error contains {want:?}\n{}", shown()));
        }
    }
    for want in &case.warnings {
        if !warnings.iter().any(|w| w.contains(want.as_str())) {
            return Err(format!("{name}: no warning contains {want:?}\n{}", shown()));
        }
    }
    for (pointer, want) in &case.json {
        let got = config.as_ref().and_then(|c| c.pointer(pointer));
        if got != Some(want) {
            return Err(format!("{name}: {pointer} is {got:?}, expected {want}"));
        }
    }
    for unwanted in &case.no_errors {
        if errors.iter().any(|e| e.contains(unwanted.as_str())) {
            return Err(format!(
                "{name}: an error contains {unwanted:?}\n{}",
                shown()
            ));
        }
    }
    // Every error is positioned (the whole point of our errors).
    if let Err(e) = &result {
        if let Some(d) = e.iter().find(|d| d.origin.line == 0) {
            return Err(format!("{name}: unpositioned error {d}"));
        }
    }
    Ok(())
}

#[test]
fn conformance_corpus() {
    let cases = cases();
    assert!(cases.len() >= 40, "the corpus has {} cases", cases.len());
    let failures: Vec<String> = cases.iter().filter_map(|p| check(p).err()).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn corpus_files_never_panic_when_truncated() {
    // Every prefix of every case loads or fails cleanly.
    for path in cases() {
        let text = std::fs::read_to_string(&path).unwrap();
        for cut in (0..text.len())
            .step_by(7)
            .filter(|&i| text.is_char_boundary(i))
        {
            let _ = kici_config::load_documents(&[("scalers.yaml", &text[..cut])]);
        }
    }
}
