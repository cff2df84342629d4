//! The positioned YAML node tree the schema walk reads: scalars keep their
//! text and whether they were written plain (only plain scalars may be read
//! as numbers, booleans or null), mappings keep their entries in document
//! order, and every node knows where it starts.
//!
//! Built by [`crate::yaml::parse`]. Collections sit behind [`Rc`] so that an
//! alias is the anchored node itself, shared rather than copied: the tree is
//! immutable, so sharing reads exactly like a copy, and an alias bomb costs
//! no memory before the node cap refuses it.

use std::collections::HashMap;
use std::rc::Rc;

/// Where a node starts: the index of its file in the load, the 1-based line
/// and the 1-based column (in characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Marker {
    source: u32,
    line: u32,
    column: u32,
}

impl Marker {
    pub fn new(source: usize, line: u32, column: u32) -> Self {
        Self {
            source: u32::try_from(source).unwrap_or(u32::MAX),
            line,
            column,
        }
    }

    pub fn source(&self) -> usize {
        self.source as usize
    }

    pub fn line(&self) -> u32 {
        self.line
    }

    pub fn column(&self) -> u32 {
        self.column
    }
}

/// One YAML node.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Scalar(ScalarNode),
    Sequence(Rc<SequenceNode>),
    Mapping(Rc<MappingNode>),
}

impl Node {
    /// Where the node's content starts (after any anchor).
    pub fn mark(&self) -> Marker {
        match self {
            Node::Scalar(s) => s.mark,
            Node::Sequence(s) => s.mark,
            Node::Mapping(m) => m.mark,
        }
    }

    pub fn as_mapping(&self) -> Option<&MappingNode> {
        match self {
            Node::Mapping(m) => Some(m),
            _ => None,
        }
    }
}

/// An explicit tag on a scalar, as the YAML 1.2 core schema knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalarTag {
    /// `!!str`, or the non-specific `!`.
    Str,
    Int,
    Float,
    Bool,
    Null,
    /// A tag the core schema does not define (`!custom`): upstream's parser
    /// reads the value as a string (and warns), so do we.
    Other,
}

/// A scalar's text, as written once quotes and escapes are resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScalarNode {
    value: String,
    plain: bool,
    tag: Option<ScalarTag>,
    mark: Marker,
}

impl ScalarNode {
    pub fn new(value: String, plain: bool, mark: Marker) -> Self {
        Self {
            value,
            plain,
            tag: None,
            mark,
        }
    }

    /// A scalar written with an explicit tag, which decides its type
    /// whatever its quoting (`!!int "3"` is the number 3).
    pub fn tagged(value: String, plain: bool, tag: ScalarTag, mark: Marker) -> Self {
        Self {
            value,
            plain,
            tag: Some(tag),
            mark,
        }
    }

    /// The explicit tag, if any.
    pub fn tag(&self) -> Option<ScalarTag> {
        self.tag
    }

    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// Written without quotes and not as a block scalar. Without a tag, the
    /// YAML core schema may read such a scalar as null, a boolean or a number.
    pub fn is_plain(&self) -> bool {
        self.plain
    }

    pub fn mark(&self) -> Marker {
        self.mark
    }
}

/// A list.
#[derive(Debug, PartialEq)]
pub struct SequenceNode {
    items: Vec<Node>,
    mark: Marker,
}

impl SequenceNode {
    pub fn new(items: Vec<Node>, mark: Marker) -> Self {
        Self { items, mark }
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Node> {
        self.items.iter()
    }
}

/// Mappings with more entries than this get a hash index; smaller ones (all
/// of a normal configuration) are searched linearly, which is faster.
pub const LINEAR_LOOKUP_MAX: usize = 16;

/// Key → entry position, for large mappings only.
pub type KeyIndex = HashMap<Box<str>, usize>;

/// A mapping with string keys, unique, in document order.
#[derive(Debug, PartialEq)]
pub struct MappingNode {
    entries: Vec<(ScalarNode, Node)>,
    index: Option<KeyIndex>,
    mark: Marker,
}

/// The position of `key` in `entries`, through `index` when there is one.
pub fn position(
    entries: &[(ScalarNode, Node)],
    index: Option<&KeyIndex>,
    key: &str,
) -> Option<usize> {
    match index {
        Some(index) => index.get(key).copied(),
        None => entries.iter().position(|(k, _)| k.as_str() == key),
    }
}

impl MappingNode {
    /// `index`, when given, must map every key of `entries` to its position.
    pub fn new(entries: Vec<(ScalarNode, Node)>, index: Option<KeyIndex>, mark: Marker) -> Self {
        Self {
            entries,
            index,
            mark,
        }
    }

    pub fn get_key_value(&self, key: &str) -> Option<(&ScalarNode, &Node)> {
        let i = position(&self.entries, self.index.as_ref(), key)?;
        self.entries.get(i).map(|(k, v)| (k, v))
    }

    pub fn get(&self, key: &str) -> Option<&Node> {
        self.get_key_value(key).map(|(_, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&ScalarNode, &Node)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &ScalarNode> {
        self.entries.iter().map(|(k, _)| k)
    }
}
