//! The documentation agrees with the binary: the settings table of
//! `docs/operations.md` (header `| flag | env | default | meaning |`) lists
//! exactly the flags `kici-scaler serve --help` shows (hidden ones aside),
//! each with the environment variable `--help` names for it.
//!
//! Self-contained (std only, no `common`), so it can move into a single
//! integration-test binary as a module unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// A flag (`--listen`) and its environment variable, if it has one.
type Flags = BTreeMap<String, Option<String>>;

const TABLE_HEADER: &str = "| flag | env | default | meaning |";

/// Flags clap adds to every command; not settings.
const BUILT_IN: [&str; 2] = ["--help", "--version"];

#[test]
fn the_settings_table_and_serve_help_list_the_same_flags() {
    let doc_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
    let doc = std::fs::read_to_string(&doc_path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", doc_path.display()));
    let documented = settings_table(&doc);
    let help = serve_help();
    let actual = help_flags(&help);
    assert!(
        actual.contains_key("--config") && actual.contains_key("--listen"),
        "could not read the flags from `serve --help`:\n{help}"
    );

    let mut problems = Vec::new();
    for (flag, env) in &actual {
        match documented.get(flag) {
            None => problems.push(format!(
                "{flag}: a `serve` flag missing from the table (env {})",
                env.as_deref().unwrap_or("none")
            )),
            Some(doc_env) if doc_env != env => problems.push(format!(
                "{flag}: the table says env {}, `serve --help` says {}",
                doc_env.as_deref().unwrap_or("none"),
                env.as_deref().unwrap_or("none")
            )),
            Some(_) => {}
        }
    }
    for flag in documented.keys().filter(|f| !actual.contains_key(*f)) {
        problems.push(format!("{flag}: in the table but not a `serve` flag"));
    }
    assert!(
        problems.is_empty(),
        "docs/operations.md's settings table and `kici-scaler serve --help` disagree:\n  {}",
        problems.join("\n  ")
    );
}

fn serve_help() -> String {
    // No KICI_* variable of the caller's may show up as a value in the help.
    let out = Command::new(env!("CARGO_BIN_EXE_kici-scaler"))
        .args(["serve", "--help"])
        .env_clear()
        .output()
        .expect("running kici-scaler serve --help");
    assert!(out.status.success(), "serve --help: {:?}", out.status);
    String::from_utf8(out.stdout).expect("UTF-8 help")
}

/// Every option of a clap `--help` text with its `[env: NAME=…]`. Option
/// lines are indented less than their descriptions (`  -h, --help`,
/// `      --listen <ADDR>`); the `[env: …]` note follows in the description.
fn help_flags(help: &str) -> Flags {
    let mut flags = Flags::new();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let indent = line.len() - line.trim_start().len();
        let text = line.trim_start();
        if indent < 8 && text.starts_with('-') {
            current = text
                .split([',', ' ', '='])
                .find(|w| w.starts_with("--"))
                .map(str::to_owned);
            if let Some(flag) = &current {
                flags.insert(flag.clone(), None);
            }
        } else if indent < 8 && !text.is_empty() {
            // A section heading (`Options:`) or the usage: no option's text.
            current = None;
        }
        if let (Some(flag), Some(at)) = (&current, line.find("[env: ")) {
            let name: String = line[at + "[env: ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            flags.insert(flag.clone(), Some(name));
        }
    }
    for flag in BUILT_IN {
        flags.remove(flag);
    }
    flags
}

/// The rows of the one table under [`TABLE_HEADER`]: the first `--flag` of
/// the first cell, and the first `KICI_*` name of the second (none for `—`).
fn settings_table(doc: &str) -> Flags {
    let starts: Vec<usize> = doc
        .lines()
        .enumerate()
        .filter(|(_, l)| l.trim() == TABLE_HEADER)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        starts.len(),
        1,
        "docs/operations.md must have exactly one table headed `{TABLE_HEADER}`"
    );
    let mut flags = Flags::new();
    let rows = doc
        .lines()
        .skip(starts[0] + 1)
        .take_while(|l| l.trim_start().starts_with('|'))
        .filter(|l| !l.trim_start().starts_with("|-"));
    for row in rows {
        let cells = split_row(row);
        assert!(
            cells.len() >= 2,
            "a settings row without an env cell: {row}"
        );
        let flag = words(&cells[0])
            .find(|w| w.starts_with("--"))
            .unwrap_or_else(|| panic!("a settings row without a `--flag`: {row}"));
        let env = words(&cells[1])
            .find(|w| w.starts_with("KICI_"))
            .map(str::to_owned);
        assert!(
            flags.insert(flag.to_owned(), env).is_none(),
            "{flag} has two rows in the settings table"
        );
    }
    assert!(!flags.is_empty(), "the settings table has no rows");
    flags
}

/// A markdown table row's cells; `\|` inside a cell is not a separator.
fn split_row(row: &str) -> Vec<String> {
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut chars = row.trim().trim_start_matches('|').chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cell.push('|');
                chars.next();
            }
            '|' => cells.push(std::mem::take(&mut cell)),
            c => cell.push(c),
        }
    }
    cells
}

/// The words of a cell: runs of letters, digits, `-` and `_`.
fn words(cell: &str) -> impl Iterator<Item = &str> {
    cell.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .filter(|w| !w.is_empty())
}

#[test]
fn the_parsers_read_what_they_are_meant_to() {
    let help = "Run the daemon\n\nUsage: kici-scaler serve [OPTIONS]\n\nOptions:\n      \
                --listen <ADDR>\n          Control API address\n          \n          \
                [env: KICI_SCALER_LISTEN=]\n\n      --reset-identity\n          Mint a new \
                id; see --listen\n\n  -h, --help\n          Print help\n";
    let flags = help_flags(help);
    assert_eq!(
        flags.into_iter().collect::<Vec<_>>(),
        [
            ("--listen".to_owned(), Some("KICI_SCALER_LISTEN".to_owned())),
            ("--reset-identity".to_owned(), None),
        ]
    );
    let doc = "text\n\n| flag | env | default | meaning |\n|---|---|---|---|\n\
               | `--listen ADDR` | `KICI_SCALER_LISTEN` | x | y |\n\
               | `--pids N\\|max` | — | `max` | a \\| b |\n\nafter\n";
    assert_eq!(
        settings_table(doc).into_iter().collect::<Vec<_>>(),
        [
            ("--listen".to_owned(), Some("KICI_SCALER_LISTEN".to_owned())),
            ("--pids".to_owned(), None),
        ]
    );
}
