//! YAML text → `marked_yaml` node tree, with the guards the parser lacks, and
//! the YAML 1.2 core-schema reading of plain scalars.
//!
//! `marked_yaml` keeps every node's position but reads only the first
//! document, recurses once per nesting level (deep input overflows the
//! stack), and treats an empty file like `{}`. [`prescan`] closes those gaps
//! with one cheap pass over the text before the parser sees it.

use marked_yaml::types::MarkedScalarNode;
use marked_yaml::{LoadError, LoaderOptions, Marker, Node};

/// Largest file accepted, in bytes. Configurations are a few hundred KiB at
/// most; the bound keeps a mistaken path (a log, an image) from being parsed.
pub const MAX_FILE_BYTES: usize = 8 << 20;

/// Most columns of indentation (spaces plus `- `, `? `, `: ` indicators) a
/// line may start with. Block nesting depth is at most about twice this, and
/// flow nesting is capped at 255 by the scanner; together they keep the
/// parser's recursion well inside a 2 MiB thread stack, even in debug builds.
pub const MAX_INDENT_COLUMNS: usize = 128;

/// What [`prescan`] learned about a text.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Prescan {
    /// Some line holds something other than blanks, comments, directives and
    /// document markers.
    pub has_content: bool,
    /// 1-based line of a second document, if any.
    pub second_document: Option<u32>,
    /// 1-based line whose indentation exceeds [`MAX_INDENT_COLUMNS`].
    pub too_deep: Option<u32>,
}

fn is_marker(line: &str, marker: &str) -> bool {
    line.strip_prefix(marker)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
}

fn is_blank_or_comment(s: &str) -> bool {
    let t = s.trim_start_matches([' ', '\t', '\r']);
    t.is_empty() || t.starts_with('#')
}

/// Columns of structural prefix: indentation whitespace and block indicators
/// (`-`, `?`, `:`) each followed by whitespace or the end of the line.
fn structural_indent(line: &str) -> usize {
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b' ' | b'\t' => i += 1,
            b'-' | b'?' | b':' if matches!(b.get(i + 1), None | Some(b' ' | b'\t' | b'\r')) => {
                i += 1
            }
            _ => break,
        }
    }
    i
}

/// One pass over the text: content present, a second document, a line
/// indented too deeply.
pub fn prescan(text: &str) -> Prescan {
    let mut out = Prescan::default();
    let mut ended = false;
    for (n, line) in text.split('\n').enumerate() {
        let lineno = u32::try_from(n + 1).unwrap_or(u32::MAX);
        if out.too_deep.is_none() && structural_indent(line) > MAX_INDENT_COLUMNS {
            out.too_deep = Some(lineno);
        }
        if is_marker(line, "---") {
            if out.has_content {
                out.second_document.get_or_insert(lineno);
            } else if !is_blank_or_comment(&line[3..]) {
                out.has_content = true;
            }
            continue;
        }
        if is_marker(line, "...") {
            ended |= out.has_content;
            continue;
        }
        if is_blank_or_comment(line) || (!out.has_content && line.starts_with('%')) {
            continue;
        }
        if ended {
            out.second_document.get_or_insert(lineno);
        }
        out.has_content = true;
    }
    out
}

/// Why a text produced no mapping.
#[derive(Debug, PartialEq, Eq)]
pub enum ParseFailure {
    /// Nothing but blanks and comments.
    Empty,
    /// The document is a list or a scalar.
    NotAMapping { line: u32, col: u32 },
    /// Anything else, with a position when the parser gave one.
    Syntax {
        line: u32,
        col: u32,
        message: String,
    },
}

fn pos(m: &Marker) -> (u32, u32) {
    let c = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    (c(m.line()), c(m.column()))
}

/// Parses one document whose markers carry `source`. The top level must be a
/// mapping. Never panics: the parser is run under `catch_unwind` as a last
/// line of defence, and deep or oversized input is refused before parsing.
pub fn parse(source: usize, text: &str) -> Result<Node, ParseFailure> {
    if text.len() > MAX_FILE_BYTES {
        return Err(ParseFailure::Syntax {
            line: 0,
            col: 0,
            message: format!(
                "file is {} bytes, more than the {MAX_FILE_BYTES} accepted",
                text.len()
            ),
        });
    }
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let scan = prescan(text);
    if let Some(line) = scan.too_deep {
        return Err(ParseFailure::Syntax {
            line,
            col: 1,
            message: format!(
                "nested too deeply: at most {MAX_INDENT_COLUMNS} columns of indentation are supported"
            ),
        });
    }
    if !scan.has_content {
        return Err(ParseFailure::Empty);
    }
    if let Some(line) = scan.second_document {
        return Err(ParseFailure::Syntax {
            line,
            col: 1,
            message: "a second YAML document starts here; a configuration file holds exactly one"
                .into(),
        });
    }
    let options = LoaderOptions::default()
        .error_on_duplicate_keys(true)
        .prevent_coercion(true);
    let result =
        std::panic::catch_unwind(|| marked_yaml::parse_yaml_with_options(source, text, options));
    let result = match result {
        Ok(r) => r,
        Err(_) => {
            return Err(ParseFailure::Syntax {
                line: 0,
                col: 0,
                message: "the YAML parser failed on this file (internal error); please report it"
                    .into(),
            })
        }
    };
    result.map_err(|e| match e {
        LoadError::TopLevelMustBeMapping(m) => {
            let (line, col) = pos(&m);
            ParseFailure::NotAMapping { line, col }
        }
        LoadError::TopLevelMustBeSequence(m) => {
            let (line, col) = pos(&m);
            ParseFailure::Syntax {
                line,
                col,
                message: "unexpected top level".into(),
            }
        }
        LoadError::UnexpectedAnchor(m) => {
            let (line, col) = pos(&m);
            ParseFailure::Syntax {
                line,
                col,
                message: "YAML anchors and aliases are not supported: write the value out in full"
                    .into(),
            }
        }
        LoadError::MappingKeyMustBeScalar(m) => {
            let (line, col) = pos(&m);
            ParseFailure::Syntax {
                line,
                col,
                message: "mapping keys must be plain strings".into(),
            }
        }
        LoadError::UnexpectedTag(m) => {
            let (line, col) = pos(&m);
            ParseFailure::Syntax {
                line,
                col,
                message: "YAML tags (`!…`) are not supported".into(),
            }
        }
        LoadError::ScanError(m, e) => {
            let (line, col) = pos(&m);
            ParseFailure::Syntax {
                line,
                col,
                message: format!("YAML syntax error: {}", e.info()),
            }
        }
        LoadError::DuplicateKey(d) => {
            let (line, col) = d.key.span().start().map_or((0, 0), pos);
            let (pl, pc) = d.prev_key.span().start().map_or((0, 0), pos);
            ParseFailure::Syntax {
                line,
                col,
                message: format!(
                    "duplicate key {:?} (first at line {pl}, column {pc})",
                    d.key.as_str()
                ),
            }
        }
    })
}

/// A scalar read with the YAML 1.2 core schema (what upstream's parser
/// does): plain scalars may be null, booleans or numbers; quoted and block
/// scalars are always strings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar<'a> {
    Null,
    Bool(bool),
    /// Integers and floats alike (as in JavaScript); `.inf`/`.nan` included.
    Number(f64),
    Str(&'a str),
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// The core schema's float pattern:
/// `[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?`.
fn is_core_float(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", frac)) => is_digits(frac),
        Some((int, frac)) => is_digits(int) && (frac.is_empty() || is_digits(frac)),
        None => is_digits(mantissa),
    };
    let exponent_ok = exponent.is_none_or(|e| is_digits(e.strip_prefix(['-', '+']).unwrap_or(e)));
    mantissa_ok && exponent_ok
}

pub fn classify(s: &MarkedScalarNode) -> Scalar<'_> {
    let v = s.as_str();
    if !s.may_coerce() {
        return Scalar::Str(v);
    }
    match v {
        "" | "~" | "null" | "Null" | "NULL" => return Scalar::Null,
        "true" | "True" | "TRUE" => return Scalar::Bool(true),
        "false" | "False" | "FALSE" => return Scalar::Bool(false),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            return Scalar::Number(f64::INFINITY)
        }
        "-.inf" | "-.Inf" | "-.INF" => return Scalar::Number(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return Scalar::Number(f64::NAN),
        _ => {}
    }
    if let Some(hex) = v.strip_prefix("0x") {
        if let Ok(n) = u64::from_str_radix(hex, 16) {
            return Scalar::Number(n as f64);
        }
    }
    if let Some(oct) = v.strip_prefix("0o") {
        if let Ok(n) = u64::from_str_radix(oct, 8) {
            return Scalar::Number(n as f64);
        }
    }
    if is_core_float(v) {
        if let Ok(n) = v.parse::<f64>() {
            return Scalar::Number(n);
        }
    }
    Scalar::Str(v)
}

/// Longest value quoted back in a message.
const MAX_QUOTED: usize = 80;

/// How a value is named in "got …": strings quoted, other scalars as written.
pub fn describe(node: &Node) -> String {
    match node {
        Node::Mapping(_) => "a mapping".into(),
        Node::Sequence(_) => "a list".into(),
        Node::Scalar(s) => match classify(s) {
            Scalar::Null => "null".into(),
            Scalar::Str(v) => quote(v),
            Scalar::Bool(_) | Scalar::Number(_) => truncate(s.as_str()),
        },
    }
}

fn truncate(v: &str) -> String {
    if v.chars().count() <= MAX_QUOTED {
        return v.to_owned();
    }
    let mut t: String = v.chars().take(MAX_QUOTED).collect();
    t.push('…');
    t
}

/// `"value"` with Rust escapes, shortened past [`MAX_QUOTED`] characters.
pub fn quote(v: &str) -> String {
    if v.chars().count() <= MAX_QUOTED {
        format!("{v:?}")
    } else {
        let t: String = v.chars().take(MAX_QUOTED).collect();
        format!("{t:?}…")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn scalar(text: &str) -> Node {
        let n = parse(0, &format!("k: {text}\n")).unwrap();
        n.as_mapping().unwrap().get("k").unwrap().clone()
    }

    #[test]
    fn core_schema() {
        let c = |t: &str| match scalar(t) {
            Node::Scalar(s) => format!("{:?}", classify(&s)),
            other => panic!("{other:?}"),
        };
        assert_eq!(c("1"), "Number(1.0)");
        assert_eq!(c("-2.5e3"), "Number(-2500.0)");
        assert_eq!(c(".5"), "Number(0.5)");
        assert_eq!(c("1."), "Number(1.0)");
        assert_eq!(c("0x1F"), "Number(31.0)");
        assert_eq!(c("0o17"), "Number(15.0)");
        assert_eq!(c("\"1\""), "Str(\"1\")");
        assert_eq!(c("'true'"), "Str(\"true\")");
        assert_eq!(c("true"), "Bool(true)");
        assert_eq!(c("~"), "Null");
        assert_eq!(c(""), "Null");
        assert_eq!(c("inf"), "Str(\"inf\")");
        assert_eq!(c("1e"), "Str(\"1e\")");
        assert_eq!(c("512m"), "Str(\"512m\")");
        assert_eq!(c("yes"), "Str(\"yes\")");
        assert_eq!(c(".inf"), "Number(inf)");
    }

    #[test]
    fn prescan_finds_documents_and_depth() {
        assert!(!prescan("").has_content);
        assert!(!prescan("# c\n\n---\n...\n").has_content);
        assert!(prescan("--- {a: 1}\n").has_content);
        assert_eq!(prescan("---\na: 1\n").second_document, None);
        assert_eq!(prescan("a: 1\n---\nb: 2\n").second_document, Some(2));
        assert_eq!(prescan("a: 1\n...\nb: 2\n").second_document, Some(3));
        assert_eq!(prescan("a: 1\n...\n# c\n").second_document, None);
        assert_eq!(prescan("a: |\n  ---\n").second_document, None);
        let deep = format!("a:\n{}x\n", "- ".repeat(70));
        assert_eq!(prescan(&deep).too_deep, Some(2));
        assert_eq!(prescan("a: |\n    ------------------------------------------------------------------------------------------------------------------------------------------\n").too_deep, None);
    }

    #[test]
    fn failures_have_positions() {
        assert_eq!(parse(0, "  \n# only a comment\n"), Err(ParseFailure::Empty));
        assert_eq!(
            parse(0, "- a\n"),
            Err(ParseFailure::NotAMapping { line: 1, col: 1 })
        );
        match parse(0, "a: 1\na: 2\n") {
            Err(ParseFailure::Syntax {
                line: 2,
                col: 1,
                message,
            }) => {
                assert!(message.contains("duplicate key \"a\""), "{message}")
            }
            other => panic!("{other:?}"),
        }
        match parse(0, "a: [1, 2\n") {
            Err(ParseFailure::Syntax {
                line: 2, message, ..
            }) => {
                assert!(message.starts_with("YAML syntax error"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deepest_accepted_input_fits_a_small_stack() {
        // Worst case within the limits: maximal block nesting and maximal
        // flow nesting together, parsed on a 2 MiB thread.
        let mut text = String::new();
        for i in 0..MAX_INDENT_COLUMNS {
            text.push_str(&" ".repeat(i));
            text.push_str("k:\n");
        }
        text.push_str(&" ".repeat(MAX_INDENT_COLUMNS));
        text.push_str(&format!("{}{}\n", "[".repeat(250), "]".repeat(250)));
        let h = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || parse(0, &text).is_ok())
            .unwrap();
        assert!(h.join().unwrap());
        let too_deep = format!("a:\n{}x\n", "- ".repeat(MAX_INDENT_COLUMNS));
        assert!(matches!(
            parse(0, &too_deep),
            Err(ParseFailure::Syntax { line: 2, .. })
        ));
    }
}
