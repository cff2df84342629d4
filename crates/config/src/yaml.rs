//! YAML text → positioned [`Node`] tree, and the YAML 1.2 core-schema
//! reading of scalars.
//!
//! The events come from `saphyr_parser` (the maintained successor of
//! yaml-rust's parser: a non-recursive state machine that reports a start
//! and an end position for every event). This module builds the tree from
//! them without recursion, reading a document the way upstream's loader does
//! (the `yaml` npm package with its default YAML 1.2 core schema):
//!
//! - Anchors and aliases: `*x` is the node anchored `&x` earlier in the same
//!   file. Anchors are per file; an alias to an anchor that is not defined
//!   yet, or to the node the alias sits in, is an error.
//! - An aliased value keeps the positions of its definition: an error inside
//!   `*x` points at the file:line:col where `&x` wrote it, while its field
//!   path names the place the alias is used.
//! - `<<` is an ordinary key, as YAML 1.2 defines it: `<<: *base` does not
//!   merge anything (merge keys are a YAML 1.1 feature). In a strict object
//!   the schema walk then reports it as an unknown key, which is what
//!   upstream reports too. A `%YAML 1.1` directive, which would switch
//!   upstream's parser to YAML 1.1 rules, is refused with a clear error.
//! - Explicit tags decide a scalar's type whatever its quoting, as upstream's
//!   parser does: `!!int "3"` is 3 and `!!str 3` is "3". A core tag whose
//!   pattern the value does not match (`!!float "3"`: a 1.2 float has a
//!   point or an exponent), and any tag the core schema does not define,
//!   leave the value a string, with a warning. Tags that would make a value
//!   no field accepts (`!!binary`, `!!timestamp`, `!!set`, ...) are errors.
//! - Duplicate keys are errors naming both positions; a second document is
//!   an error.
//! - Guards: [`MAX_FILE_BYTES`], [`MAX_INDENT_COLUMNS`] (checked by
//!   [`prescan`] before the parser runs), [`MAX_NODES`] counting every alias
//!   at its full size (alias bombs), [`MAX_DEPTH`] and [`MAX_ALIAS_DEPTH`].

use crate::node::{
    self, KeyIndex, MappingNode, Marker, Node, ScalarNode, ScalarTag, SequenceNode,
    LINEAR_LOOKUP_MAX,
};
use saphyr_parser::{Event, Parser, ScalarStyle, ScanError, Span, Tag};
use std::rc::Rc;

/// Largest file accepted, in bytes. Configurations are a few hundred KiB at
/// most; the bound keeps a mistaken path (a log, an image) from being parsed.
pub const MAX_FILE_BYTES: usize = 8 << 20;

/// Most columns of indentation (spaces plus `- `, `? `, `: ` indicators) a
/// line may start with. Block nesting depth is at most about twice this, and
/// flow nesting is capped at 255 by the scanner; together they bound the
/// tree's depth, and so the recursion of dropping it, well inside a 2 MiB
/// thread stack, even in debug builds.
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
    /// 1-based line of a `%YAML 1.1` directive.
    pub yaml_1_1: Option<u32>,
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
        if !out.has_content && line.starts_with('%') {
            let mut words = line.split_whitespace();
            if words.next() == Some("%YAML") && words.next() == Some("1.1") {
                out.yaml_1_1.get_or_insert(lineno);
            }
            continue;
        }
        if is_blank_or_comment(line) {
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

/// Most nodes a document may expand to, each alias counting as many nodes
/// as the value it stands for. A configuration has a few tens of thousands;
/// the cap stops alias bombs ("billion laughs") and absurdly large lists.
pub const MAX_NODES: usize = 1_000_000;

/// Deepest nesting an alias may produce (the text alone stays below it: see
/// [`MAX_INDENT_COLUMNS`]); an alias placed deep down adds its own depth.
/// Keeps dropping the tree well inside a small stack.
pub const MAX_DEPTH: usize = 512;

/// Most aliases that may stand inside one another: an alias to a node that
/// holds an alias to a node that holds an alias, ...
pub const MAX_ALIAS_DEPTH: u32 = 32;

fn fail(at: Marker, message: impl Into<String>) -> ParseFailure {
    ParseFailure::Syntax {
        line: at.line(),
        col: at.column(),
        message: message.into(),
    }
}

/// Something the parser accepted but the operator should know: a tag that
/// did not apply, read as a string instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseWarning {
    pub at: Marker,
    pub message: String,
}

/// [`parse_with_warnings`] without the warnings.
#[cfg(test)]
pub fn parse(source: usize, text: &str) -> Result<Node, ParseFailure> {
    parse_with_warnings(source, text).map(|(node, _)| node)
}

/// Parses one document whose markers carry `source`. The top level must be a
/// mapping. Never panics: the parser is run under `catch_unwind` as a last
/// line of defence, and deep or oversized input is refused before parsing.
pub fn parse_with_warnings(
    source: usize,
    text: &str,
) -> Result<(Node, Vec<ParseWarning>), ParseFailure> {
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
    if let Some(line) = scan.yaml_1_1 {
        return Err(ParseFailure::Syntax {
            line,
            col: 1,
            message: "`%YAML 1.1` switches upstream's parser to YAML 1.1 rules (merge keys, yes/no booleans, ...), which kici-scaler does not implement: remove the directive and write the file in YAML 1.2".into(),
        });
    }
    if !scan.has_content {
        return Err(ParseFailure::Empty);
    }
    if let Some(line) = scan.second_document {
        return Err(second_document(line));
    }
    let result = std::panic::catch_unwind(|| Builder::new(source, text).run());
    let (root, warnings) = match result {
        Ok(r) => r?,
        Err(_) => {
            return Err(ParseFailure::Syntax {
                line: 0,
                col: 0,
                message: "the YAML parser failed on this file (internal error); please report it"
                    .into(),
            })
        }
    };
    match root {
        Node::Mapping(_) => Ok((root, warnings)),
        other => {
            let at = other.mark();
            Err(ParseFailure::NotAMapping {
                line: at.line(),
                col: at.column(),
            })
        }
    }
}

fn second_document(line: u32) -> ParseFailure {
    ParseFailure::Syntax {
        line,
        col: 1,
        message: "a second YAML document starts here; a configuration file holds exactly one"
            .into(),
    }
}

/// What the node cap and the depth guards need to know of a finished node.
#[derive(Debug, Clone, Copy)]
struct Extent {
    /// Nodes in the subtree, aliases expanded.
    size: usize,
    /// Levels in the subtree (a scalar is 1).
    height: usize,
    /// Aliases standing inside one another within the subtree.
    alias_depth: u32,
}

impl Extent {
    const LEAF: Extent = Extent {
        size: 1,
        height: 1,
        alias_depth: 0,
    };

    fn absorb(&mut self, child: Extent) {
        self.size = self.size.saturating_add(child.size);
        self.height = self.height.max(child.height + 1);
        self.alias_depth = self.alias_depth.max(child.alias_depth);
    }
}

/// A collection being read.
struct Open {
    kind: OpenKind,
    mark: Marker,
    /// The anchor id to define when the collection ends (0: none).
    anchor: usize,
    extent: Extent,
}

enum OpenKind {
    /// A list whose items so far are `Builder::items[start..]`.
    Seq {
        start: usize,
    },
    Map(OpenMap),
}

type Entry = (ScalarNode, Node);

/// A mapping being read: its entries so far are `Builder::entries[start..]`
/// (one scratch stack serves every open collection, so that each finished
/// one is allocated once, at its exact size).
struct OpenMap {
    start: usize,
    /// Key → position relative to `start`, once the mapping is large.
    index: Option<KeyIndex>,
    /// A key awaiting its value, and where it appears in the text.
    key: Option<(ScalarNode, Marker)>,
}

impl OpenMap {
    fn new(start: usize) -> Self {
        Self {
            start,
            index: None,
            key: None,
        }
    }

    fn position(&self, all: &[Entry], key: &str) -> Option<usize> {
        node::position(all.get(self.start..)?, self.index.as_ref(), key)
    }

    /// `key: value`. Every key is an ordinary key, `<<` included (YAML 1.2
    /// has no merge keys); a key written twice is an error naming both
    /// places.
    fn insert(
        &mut self,
        all: &mut Vec<Entry>,
        (key, key_at): (ScalarNode, Marker),
        value: Node,
    ) -> Result<(), ParseFailure> {
        if let Some(i) = self.position(all, key.as_str()) {
            let first = all[self.start + i].0.mark();
            return Err(fail(
                key_at,
                format!(
                    "duplicate key {:?} (first at line {}, column {})",
                    key.as_str(),
                    first.line(),
                    first.column()
                ),
            ));
        }
        let i = all.len() - self.start;
        if let Some(index) = &mut self.index {
            index.insert(key.as_str().into(), i);
        }
        all.push((key, value));
        if self.index.is_none() && i + 1 > LINEAR_LOOKUP_MAX {
            let index: KeyIndex = all[self.start..]
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (Box::from(k.as_str()), i))
                .collect();
            self.index = Some(index);
        }
        Ok(())
    }
}

/// Turns parser events into a [`Node`] tree, resolving aliases and merge
/// keys, counting nodes and guarding depth on the way.
struct Builder<'t> {
    source: usize,
    text: &'t str,
    ascii: bool,
    /// A (character index, byte offset) pair of `text` reached before, so
    /// that positions given in characters map to bytes without rescanning.
    cursor: (usize, usize),
    open: Vec<Open>,
    /// The items of every open list, innermost last.
    items: Vec<Node>,
    /// The entries of every open mapping, innermost last.
    entries: Vec<Entry>,
    /// Finished anchored nodes by the parser's anchor id; `None` while the
    /// anchored collection is still open.
    anchors: Vec<Option<(Node, Extent)>>,
    produced: usize,
    root: Option<Node>,
    warnings: Vec<ParseWarning>,
}

impl<'t> Builder<'t> {
    fn new(source: usize, text: &'t str) -> Self {
        Self {
            source,
            text,
            ascii: text.is_ascii(),
            cursor: (0, 0),
            open: Vec::new(),
            items: Vec::with_capacity(64),
            entries: Vec::with_capacity(64),
            anchors: Vec::new(),
            produced: 0,
            root: None,
            warnings: Vec::new(),
        }
    }

    fn warn(&mut self, at: Marker, message: String) {
        self.warnings.push(ParseWarning { at, message });
    }

    fn run(mut self) -> Result<(Node, Vec<ParseWarning>), ParseFailure> {
        let mut parser = Parser::new_from_str(self.text);
        while let Some(next) = parser.next_event() {
            let (event, span) = next.map_err(|e| self.scan_error(&e))?;
            match event {
                Event::StreamEnd => break,
                Event::DocumentStart(_) if self.root.is_some() => {
                    return Err(second_document(self.mark(span.start).line()));
                }
                Event::Nothing
                | Event::StreamStart
                | Event::DocumentStart(_)
                | Event::DocumentEnd => {}
                Event::Alias(id) => self.alias(id, &span)?,
                Event::Scalar(value, style, anchor, tag) => {
                    let mark = self.content_mark(&span, anchor != 0 || tag.is_some());
                    let plain = style == ScalarStyle::Plain;
                    let value = value.into_owned();
                    let scalar = match tag.as_deref() {
                        None => ScalarNode::new(value, plain, mark),
                        Some(t) => {
                            let tag = self.scalar_tag(t, mark)?;
                            let scalar = ScalarNode::tagged(value, plain, tag, mark);
                            if let Some(w) = tag_mismatch(t, &scalar) {
                                self.warn(mark, w);
                            }
                            scalar
                        }
                    };
                    self.count(1, mark)?;
                    let node = Node::Scalar(scalar);
                    self.define(anchor, &node, Extent::LEAF);
                    self.push(node, Extent::LEAF, mark)?;
                }
                Event::SequenceStart(anchor, tag) => {
                    let kind = OpenKind::Seq {
                        start: self.items.len(),
                    };
                    self.start(kind, anchor, tag.as_deref(), &span)?;
                }
                Event::MappingStart(anchor, tag) => {
                    let kind = OpenKind::Map(OpenMap::new(self.entries.len()));
                    self.start(kind, anchor, tag.as_deref(), &span)?;
                }
                Event::SequenceEnd | Event::MappingEnd => {
                    let Some(open) = self.open.pop() else {
                        return Err(fail(
                            self.mark(span.start),
                            "YAML syntax error: unbalanced collection end",
                        ));
                    };
                    let node = match open.kind {
                        OpenKind::Seq { start } => {
                            let items = self.items.drain(start..).collect();
                            Node::Sequence(Rc::new(SequenceNode::new(items, open.mark)))
                        }
                        OpenKind::Map(map) => {
                            let entries = self.entries.drain(map.start..).collect();
                            Node::Mapping(Rc::new(MappingNode::new(entries, map.index, open.mark)))
                        }
                    };
                    self.define(open.anchor, &node, open.extent);
                    self.push(node, open.extent, open.mark)?;
                }
            }
        }
        let root = self.root.ok_or(ParseFailure::Empty)?;
        Ok((root, self.warnings))
    }

    /// What an explicit tag on a scalar means; an error for the core tags
    /// whose values no field of the schema could take.
    fn scalar_tag(&mut self, tag: &Tag, at: Marker) -> Result<ScalarTag, ParseFailure> {
        Ok(match core_suffix(tag) {
            Some("str") => ScalarTag::Str,
            Some("int") => ScalarTag::Int,
            Some("float") => ScalarTag::Float,
            Some("bool") => ScalarTag::Bool,
            Some("null") => ScalarTag::Null,
            Some(other) if UNUSABLE_CORE_TAGS.contains(&other) => {
                return Err(unusable_tag(at, tag))
            }
            Some(_) => {
                self.warn(
                    at,
                    format!("the tag {} does not apply to a scalar: the value is read as a string, as upstream's parser reads it", tag_text(tag)),
                );
                ScalarTag::Other
            }
            // `!` alone: the non-specific tag, a string by definition.
            None if is_non_specific(tag) => ScalarTag::Str,
            None => {
                self.warn(
                    at,
                    format!("the tag {} is not a YAML core-schema tag: the value is read as a string, as upstream's parser reads it", tag_text(tag)),
                );
                ScalarTag::Other
            }
        })
    }

    fn start(
        &mut self,
        kind: OpenKind,
        anchor: usize,
        tag: Option<&Tag>,
        span: &Span,
    ) -> Result<(), ParseFailure> {
        let mark = self.content_mark(span, anchor != 0 || tag.is_some());
        if let Some(tag) = tag {
            let (fits, what) = match &kind {
                OpenKind::Seq { .. } => (core_suffix(tag) == Some("seq"), "list"),
                OpenKind::Map(_) => (core_suffix(tag) == Some("map"), "mapping"),
            };
            let non_specific = is_non_specific(tag);
            if core_suffix(tag).is_some_and(|s| UNUSABLE_CORE_TAGS.contains(&s)) {
                return Err(unusable_tag(mark, tag));
            }
            if !fits && !non_specific {
                self.warn(
                    mark,
                    format!("the tag {} does not apply to a {what}: it is ignored and the value read as a {what}, as upstream's parser reads it", tag_text(tag)),
                );
            }
        }
        self.count(1, mark)?;
        self.open.push(Open {
            kind,
            mark,
            anchor,
            extent: Extent::LEAF,
        });
        Ok(())
    }

    fn mark(&self, m: saphyr_parser::Marker) -> Marker {
        let c = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        Marker::new(self.source, c(m.line()), c(m.col()).saturating_add(1))
    }

    /// The byte offset of the character at `index` (clamped to the text).
    fn byte_offset(&mut self, index: usize) -> usize {
        if self.ascii {
            return index.min(self.text.len());
        }
        if index < self.cursor.0 {
            self.cursor = (0, 0);
        }
        let (mut chars, mut bytes) = self.cursor;
        for c in self.text[bytes..].chars() {
            if chars == index {
                break;
            }
            chars += 1;
            bytes += c.len_utf8();
        }
        self.cursor = (chars, bytes);
        bytes
    }

    /// Where a node's content starts. The parser's span of a node with an
    /// anchor or a tag starts at those properties; positions point past them
    /// (at `1` in `&x 1`, at the first key of an anchored block mapping).
    fn content_mark(&mut self, span: &Span, has_properties: bool) -> Marker {
        let start = self.mark(span.start);
        if !has_properties {
            return start;
        }
        let begin = self.byte_offset(span.start.index());
        let end = self.byte_offset(span.end.index()).max(begin);
        let Some(props) = self.text.get(begin..end) else {
            return start;
        };
        let (mut line, mut col) = (start.line(), start.column());
        let mut chars = props.chars().peekable();
        while let Some(&c) = chars.peek() {
            match c {
                '&' | '!' | '#' => {
                    // A property or a comment runs to the next blank (a
                    // comment to the end of the line).
                    let comment = c == '#';
                    while let Some(&c) = chars.peek() {
                        if c == '\n' || c == '\r' || (!comment && (c == ' ' || c == '\t')) {
                            break;
                        }
                        chars.next();
                        col = col.saturating_add(1);
                    }
                }
                ' ' | '\t' => {
                    chars.next();
                    col = col.saturating_add(1);
                }
                '\r' => {
                    chars.next();
                }
                '\n' => {
                    chars.next();
                    line = line.saturating_add(1);
                    col = 1;
                }
                _ => break,
            }
        }
        Marker::new(self.source, line, col)
    }

    /// The alias name (`*name`) starting at the character `index`.
    fn alias_name(&mut self, index: usize) -> String {
        let at = self.byte_offset(index);
        let rest = self.text.get(at..).unwrap_or("");
        let end = rest
            .char_indices()
            .skip(1)
            .find(|(_, c)| c.is_whitespace() || matches!(c, ',' | '[' | ']' | '{' | '}'))
            .map_or(rest.len(), |(i, _)| i);
        truncate(&rest[..end])
    }

    fn scan_error(&mut self, e: &ScanError) -> ParseFailure {
        let at = self.mark(*e.marker());
        if e.info() == "while parsing node, found unknown anchor" {
            let name = self.alias_name(e.marker().index());
            return fail(
                at,
                format!(
                    "unknown alias {name}: no anchor of that name is defined before it in this file (anchors do not carry over between files)"
                ),
            );
        }
        fail(at, format!("YAML syntax error: {}", e.info()))
    }

    fn count(&mut self, nodes: usize, at: Marker) -> Result<(), ParseFailure> {
        self.produced = self.produced.saturating_add(nodes);
        if self.produced > MAX_NODES {
            return Err(fail(
                at,
                format!("the document expands to more than {MAX_NODES} YAML nodes (aliases counted at their full size): refused"),
            ));
        }
        Ok(())
    }

    fn define(&mut self, anchor: usize, node: &Node, extent: Extent) {
        if anchor == 0 {
            return;
        }
        if self.anchors.len() <= anchor {
            self.anchors.resize(anchor + 1, None);
        }
        self.anchors[anchor] = Some((node.clone(), extent));
    }

    /// `*name`: the anchored node itself (shared), keeping the positions of
    /// its definition.
    fn alias(&mut self, id: usize, span: &Span) -> Result<(), ParseFailure> {
        let at = self.mark(span.start);
        let Some(Some((node, extent))) = self.anchors.get(id) else {
            let name = self.alias_name(span.start.index());
            return Err(fail(
                at,
                format!("alias {name} refers to a node that contains it (recursive aliases are not supported)"),
            ));
        };
        let node = node.clone();
        let extent = Extent {
            alias_depth: extent.alias_depth + 1,
            ..*extent
        };
        if extent.alias_depth > MAX_ALIAS_DEPTH {
            return Err(fail(
                at,
                format!("aliases nest more than {MAX_ALIAS_DEPTH} deep here (an alias to a node holding an alias to ...): refused"),
            ));
        }
        if self.open.len() + extent.height > MAX_DEPTH {
            return Err(fail(
                at,
                format!(
                    "this alias would nest the document more than {MAX_DEPTH} levels deep: refused"
                ),
            ));
        }
        self.count(extent.size, at)?;
        self.push(node, extent, at)
    }

    /// Adds a finished node to the open collection (or makes it the root).
    /// `at` is where it appears in the text (the alias, for an alias).
    fn push(&mut self, node: Node, extent: Extent, at: Marker) -> Result<(), ParseFailure> {
        let Some(open) = self.open.last_mut() else {
            self.root = Some(node);
            return Ok(());
        };
        open.extent.absorb(extent);
        match &mut open.kind {
            OpenKind::Seq { .. } => {
                self.items.push(node);
                Ok(())
            }
            OpenKind::Map(map) => match map.key.take() {
                Some(key) => map.insert(&mut self.entries, key, node),
                None => match node {
                    Node::Scalar(key) => {
                        map.key = Some((key, at));
                        Ok(())
                    }
                    _ => Err(fail(at, "mapping keys must be plain strings")),
                },
            },
        }
    }
}

/// The suffix of a YAML core-schema tag (`!!str` and its verbatim form
/// `!<tag:yaml.org,2002:str>` → `str`), `None` for any other tag.
fn core_suffix(tag: &Tag) -> Option<&str> {
    const CORE: &str = "tag:yaml.org,2002:";
    if tag.is_yaml_core_schema() {
        return Some(tag.suffix.as_str());
    }
    tag.suffix.strip_prefix(CORE)
}

/// The non-specific tag `!` (the parser reports it as the suffix `!` with
/// no handle).
fn is_non_specific(tag: &Tag) -> bool {
    (tag.handle.is_empty() && tag.suffix == "!") || (tag.handle == "!" && tag.suffix.is_empty())
}

/// Core-schema tags whose values (bytes, dates, sets, ordered maps) no field
/// of the configuration takes: upstream's parser builds them and its schema
/// then refuses them.
const UNUSABLE_CORE_TAGS: [&str; 5] = ["binary", "timestamp", "omap", "pairs", "set"];

fn tag_text(tag: &Tag) -> String {
    match core_suffix(tag) {
        Some(s) => format!("`!!{s}`"),
        None => format!("`{tag}`"),
    }
}

fn unusable_tag(at: Marker, tag: &Tag) -> ParseFailure {
    fail(
        at,
        format!(
            "the tag {} makes a value no configuration field accepts (only !!str, !!int, !!float, !!bool, !!null, !!seq and !!map are useful here)",
            tag_text(tag)
        ),
    )
}

/// The warning for a core scalar tag whose pattern the value does not
/// match: the value stays a string (upstream's parser does the same).
fn tag_mismatch(tag: &Tag, scalar: &ScalarNode) -> Option<String> {
    let what = match scalar.tag()? {
        ScalarTag::Int => "an integer (digits, 0o octal or 0x hex)",
        ScalarTag::Float => {
            "a YAML 1.2 float (it needs a decimal point or an exponent, or is .inf/.nan)"
        }
        ScalarTag::Bool => "true or false",
        ScalarTag::Null => "null or ~",
        ScalarTag::Str | ScalarTag::Other => return None,
    };
    match classify(scalar) {
        Scalar::Str(v) => Some(format!(
            "{} applies only to {what}; {} is read as a string",
            tag_text(tag),
            quote(v)
        )),
        _ => None,
    }
}

/// A scalar read with the YAML 1.2 core schema (what upstream's parser
/// does): plain scalars may be null, booleans or numbers; quoted and block
/// scalars are strings; an explicit tag decides whatever the quoting.
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

fn core_null(v: &str) -> bool {
    matches!(v, "" | "~" | "null" | "Null" | "NULL")
}

fn core_bool(v: &str) -> Option<bool> {
    match v {
        "true" | "True" | "TRUE" => Some(true),
        "false" | "False" | "FALSE" => Some(false),
        _ => None,
    }
}

/// The core schema's integers: `[-+]?[0-9]+`, `0o[0-7]+`, `0x[0-9a-fA-F]+`
/// (no sign after the prefix, no underscores).
fn core_int(v: &str) -> Option<f64> {
    let radix = |digits: &str, radix: u32| -> Option<f64> {
        if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
            return None;
        }
        u64::from_str_radix(digits, radix).ok().map(|n| n as f64)
    };
    if let Some(hex) = v.strip_prefix("0x") {
        return radix(hex, 16);
    }
    if let Some(oct) = v.strip_prefix("0o") {
        return radix(oct, 8);
    }
    if is_digits(v.strip_prefix(['-', '+']).unwrap_or(v)) {
        return v.parse::<f64>().ok();
    }
    None
}

/// The core schema's floats: `.inf`, `.nan` and the float pattern.
fn core_float(v: &str) -> Option<f64> {
    match v {
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => Some(f64::INFINITY),
        "-.inf" | "-.Inf" | "-.INF" => Some(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => Some(f64::NAN),
        _ if is_core_float(v) => v.parse::<f64>().ok(),
        _ => None,
    }
}

/// A float an explicit `!!float` accepts: the float pattern minus plain
/// integers (`!!float 3` matches none of the core schema's float forms, so
/// upstream's parser leaves it a string).
fn tagged_float(v: &str) -> Option<f64> {
    if is_digits(v.strip_prefix(['-', '+']).unwrap_or(v)) {
        return None;
    }
    core_float(v)
}

pub fn classify(s: &ScalarNode) -> Scalar<'_> {
    let v = s.as_str();
    let resolved = match s.tag() {
        Some(ScalarTag::Str | ScalarTag::Other) => None,
        Some(ScalarTag::Null) => core_null(v).then_some(Scalar::Null),
        Some(ScalarTag::Bool) => core_bool(v).map(Scalar::Bool),
        Some(ScalarTag::Int) => core_int(v).map(Scalar::Number),
        Some(ScalarTag::Float) => tagged_float(v).map(Scalar::Number),
        None if !s.is_plain() => None,
        None if core_null(v) => Some(Scalar::Null),
        None => core_bool(v)
            .map(Scalar::Bool)
            .or_else(|| core_int(v).or_else(|| core_float(v)).map(Scalar::Number)),
    };
    resolved.unwrap_or(Scalar::Str(v))
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
        // Signs inside the prefixed forms, and underscores, are not numbers
        // in YAML 1.2 (nor for upstream's parser).
        assert_eq!(c("0x+1F"), "Str(\"0x+1F\")");
        assert_eq!(c("0o-7"), "Str(\"0o-7\")");
        assert_eq!(c("1_000"), "Str(\"1_000\")");
        assert_eq!(c("+12"), "Number(12.0)");
        assert_eq!(c("007"), "Number(7.0)");
        assert_eq!(c("2001-01-01"), "Str(\"2001-01-01\")");
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

    fn at<'n>(node: &'n Node, key: &str) -> &'n Node {
        node.as_mapping().unwrap().get(key).unwrap()
    }

    fn text_of(node: &Node) -> &str {
        match node {
            Node::Scalar(s) => s.as_str(),
            other => panic!("{other:?}"),
        }
    }

    fn pos(node: &Node) -> (u32, u32) {
        (node.mark().line(), node.mark().column())
    }

    #[test]
    fn aliases_are_the_anchored_node_with_its_positions() {
        let n = parse(3, "a: &x {k: v}\nb: *x\nc: &s 'q'\nd: *s\n").unwrap();
        assert_eq!(at(&n, "a"), at(&n, "b"));
        assert_eq!(pos(at(&n, "b")), (1, 7));
        assert_eq!(at(&n, "b").mark().source(), 3);
        assert_eq!(pos(at(at(&n, "b"), "k")), (1, 11));
        let d = match at(&n, "d") {
            Node::Scalar(s) => s,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (d.as_str(), d.is_plain(), pos(at(&n, "d"))),
            ("q", false, (3, 7))
        );
    }

    #[test]
    fn merge_keys_are_ordinary_keys() {
        // YAML 1.2 (upstream's parser) has no merge keys: `<<` is a key like
        // any other, its value the aliased mapping itself.
        let n = parse(0, "a: &a {x: 1}\nm:\n  <<: *a\n  x: 3\n").unwrap();
        let m = at(&n, "m").as_mapping().unwrap();
        let keys: Vec<&str> = m.keys().map(|k| k.as_str()).collect();
        assert_eq!(keys, ["<<", "x"]);
        assert_eq!(m.get("<<"), Some(at(&n, "a")));
        // So two of them are a duplicate key, as upstream reports.
        assert_eq!(
            parse(0, "m: {<<: {y: 1}, <<: {x: 1}}\n"),
            Err(ParseFailure::Syntax {
                line: 1,
                col: 17,
                message: "duplicate key \"<<\" (first at line 1, column 5)".into()
            })
        );
        // Whatever its value.
        assert!(parse(0, "m: {<<: 3}\n").is_ok());
    }

    #[test]
    fn a_yaml_1_1_directive_is_refused() {
        match parse(0, "%YAML 1.1\n---\na: &a {x: 1}\nb: {<<: *a}\n") {
            Err(ParseFailure::Syntax {
                line: 1,
                col: 1,
                message,
            }) => assert!(message.contains("YAML 1.1"), "{message}"),
            other => panic!("{other:?}"),
        }
        assert!(parse(0, "%YAML 1.2\n---\na: 1\n").is_ok());
        assert_eq!(prescan("a: |\n  %YAML 1.1\n").yaml_1_1, None);
    }

    #[test]
    fn positions_skip_anchors_comments_and_non_ascii_text() {
        let n = parse(
            0,
            "é: \"ü\"\na: &x # the anchor\n  k: v\nb: &y\n  - 1\nc: &z\n\u{1F600}: &w 5\n",
        )
        .unwrap();
        assert_eq!(pos(at(&n, "a")), (3, 3));
        assert_eq!(pos(at(&n, "b")), (5, 3));
        assert_eq!(pos(at(&n, "\u{1F600}")), (7, 7));
        // An empty anchored value sits at the end of its anchor.
        assert_eq!(pos(at(&n, "c")), (6, 6));
        let crlf = parse(0, "\u{feff}a: &x\r\n  k: v\r\nb: *x\r\n").unwrap();
        assert_eq!(pos(at(&crlf, "b")), (2, 3));
    }

    fn warnings(text: &str) -> Vec<String> {
        let (_, w) = parse_with_warnings(0, text).unwrap();
        w.iter()
            .map(|w| format!("{}:{}: {}", w.at.line(), w.at.column(), w.message))
            .collect()
    }

    #[test]
    fn tags_decide_the_type_whatever_the_quoting() {
        let c = |t: &str| match scalar(t) {
            Node::Scalar(s) => format!("{:?}", classify(&s)),
            other => panic!("{other:?}"),
        };
        // What upstream's parser (the `yaml` package, core schema) makes of
        // each; checked against it.
        assert_eq!(c("!!int \"3\""), "Number(3.0)");
        assert_eq!(c("!!int '+3'"), "Number(3.0)");
        assert_eq!(c("!!int \"0x1F\""), "Number(31.0)");
        assert_eq!(c("!!int \"0o17\""), "Number(15.0)");
        assert_eq!(c("!!float \"0.5\""), "Number(0.5)");
        assert_eq!(c("!!float \"1e3\""), "Number(1000.0)");
        assert_eq!(c("!!float \"1.\""), "Number(1.0)");
        assert_eq!(c("!!float \".inf\""), "Number(inf)");
        assert_eq!(c("!!bool \"true\""), "Bool(true)");
        assert_eq!(c("!!null \"\""), "Null");
        assert_eq!(c("!!null '~'"), "Null");
        assert_eq!(c("!!str 3"), "Str(\"3\")");
        assert_eq!(c("!!str true"), "Str(\"true\")");
        assert_eq!(c("! 3"), "Str(\"3\")");
        assert_eq!(c("!<tag:yaml.org,2002:int> \"5\""), "Number(5.0)");
        // A core tag whose pattern the value does not match leaves a string.
        assert_eq!(c("!!float \"3\""), "Str(\"3\")");
        assert_eq!(c("!!float 3"), "Str(\"3\")");
        assert_eq!(c("!!int \"abc\""), "Str(\"abc\")");
        assert_eq!(c("!!int 1_000"), "Str(\"1_000\")");
        assert_eq!(c("!!int 0x+1F"), "Str(\"0x+1F\")");
        assert_eq!(c("!!null \"x\""), "Str(\"x\")");
        // Unknown tags: a string.
        assert_eq!(c("!custom 3"), "Str(\"3\")");
    }

    #[test]
    fn tags_that_do_not_apply_warn_where_the_value_starts() {
        assert_eq!(
            warnings("a: !!float \"3\"\nb: !!int x\nc: !custom 3\nd: !!map [1]\ne: !!str {k: v}\nf: !!seq 1\n"),
            [
                "1:12: `!!float` applies only to a YAML 1.2 float (it needs a decimal point or an exponent, or is .inf/.nan); \"3\" is read as a string",
                "2:10: `!!int` applies only to an integer (digits, 0o octal or 0x hex); \"x\" is read as a string",
                "3:12: the tag `!custom` is not a YAML core-schema tag: the value is read as a string, as upstream's parser reads it",
                "4:10: the tag `!!map` does not apply to a list: it is ignored and the value read as a list, as upstream's parser reads it",
                "5:10: the tag `!!str` does not apply to a mapping: it is ignored and the value read as a mapping, as upstream's parser reads it",
                "6:10: the tag `!!seq` does not apply to a scalar: the value is read as a string, as upstream's parser reads it",
            ]
        );
        assert_eq!(
            warnings("a: &x !!map {k: v}\nb: !!int '3'\nc: ! 3\nd: !!seq [1]\n"),
            Vec::<String>::new()
        );
        let n = parse(0, "a: &x !!map {k: v}\nd: !!seq [1]\ne: !custom {k: v}\n").unwrap();
        assert_eq!(pos(at(&n, "a")), (1, 13));
        assert!(at(&n, "e").as_mapping().is_some());
        assert_eq!(
            parse(0, "a: &x !!set {k: v}\n"),
            Err(ParseFailure::Syntax {
                line: 1,
                col: 13,
                message: "the tag `!!set` makes a value no configuration field accepts (only !!str, !!int, !!float, !!bool, !!null, !!seq and !!map are useful here)".into()
            })
        );
        assert!(matches!(
            parse(0, "a: !!timestamp 2001-01-01\n"),
            Err(ParseFailure::Syntax {
                line: 1,
                col: 16,
                ..
            })
        ));
    }

    #[test]
    fn large_mappings_are_indexed() {
        let mut text = String::from("m:\n");
        for i in 0..100 {
            text.push_str(&format!("  k{i}: {i}\n"));
        }
        let n = parse(0, &text).unwrap();
        let m = at(&n, "m").as_mapping().unwrap();
        assert_eq!(m.keys().count(), 100);
        assert_eq!(text_of(m.get("k73").unwrap()), "73");
        assert!(m.get("k100").is_none());
        text.push_str("  k42: again\n");
        assert_eq!(
            parse(0, &text),
            Err(ParseFailure::Syntax {
                line: 102,
                col: 3,
                message: "duplicate key \"k42\" (first at line 44, column 3)".into()
            })
        );
    }

    #[test]
    fn deepest_alias_expansion_fits_a_small_stack() {
        // Just inside MAX_DEPTH, built through an alias, parsed and dropped
        // on a 2 MiB thread.
        let (open, close) = ("[".repeat(250), "]".repeat(250));
        let text = format!("a: &a {open}x{close}\nb: {open}*a{close}\n");
        let h = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || parse(0, &text).is_ok())
            .unwrap();
        assert!(h.join().unwrap());
    }

    #[test]
    fn the_builder_refuses_a_second_document_itself() {
        // The prescan catches every second document first; the builder does
        // not rely on it.
        match Builder::new(0, "a: 1\n--- # two\nb: 2\n").run() {
            Err(ParseFailure::Syntax {
                line: 2, message, ..
            }) => {
                assert!(message.contains("second YAML document"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }
}
