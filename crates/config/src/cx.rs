//! The walk's context: where each node is, which file it came from, and the
//! findings collected so far; plus typed readers for scalars, lists and
//! objects that report what they expected.

use crate::diagnostic::Diagnostic;
use crate::node::{MappingNode, Marker, Node, ScalarNode};
use crate::yaml::{classify, describe, quote, Scalar};
use kici_model::Origin;
use std::sync::Arc;

/// Collects findings while the schema walk goes on; nothing stops at the
/// first error.
pub(crate) struct Cx {
    files: Vec<Arc<str>>,
    pub errors: Vec<Diagnostic>,
    pub warnings: Vec<Diagnostic>,
    /// Where the value of the required field being read starts: leaving
    /// that key out is no way to a default, so a null there gets no hint.
    required_at: Option<Marker>,
}

/// One step of a field path.
#[derive(Clone, Copy)]
enum Seg<'a> {
    Root(&'a str),
    Key(&'a str),
    Index(usize),
}

/// A value found in a document: the node, its position, and the chain of
/// parents that names it. The path and the [`Origin`] are only built when a
/// finding is reported: a valid configuration never pays for them.
#[derive(Clone, Copy)]
pub(crate) struct Val<'a> {
    pub node: &'a Node,
    mark: Marker,
    seg: Seg<'a>,
    parent: Option<&'a Val<'a>>,
}

/// A mapping found in a document.
#[derive(Clone, Copy)]
pub(crate) struct Obj<'a> {
    pub map: &'a MappingNode,
    pub val: Val<'a>,
}

/// Whether unknown keys in an object are errors (upstream's strict objects)
/// or warnings (objects upstream strips silently).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keys {
    Strict,
    Lenient,
}

/// Why `<<` is an unknown key: operators coming from YAML 1.1 tools expect it
/// to merge.
const MERGE_KEY_HINT: &str = "YAML 1.2, which upstream reads, has no merge keys: `<<` is an ordinary key and merges nothing; write the fields out, or alias whole values";

fn is_plain_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn push_key(out: &mut String, key: &str) {
    if is_plain_key(key) {
        if !out.is_empty() {
            out.push('.');
        }
        out.push_str(key);
    } else {
        out.push_str(&format!("[{key:?}]"));
    }
}

/// `parent.key`, or `parent["odd key"]` when the key is not a plain word.
pub(crate) fn field_path(parent: &str, key: &str) -> String {
    let mut out = parent.to_owned();
    push_key(&mut out, key);
    out
}

impl<'a> Val<'a> {
    /// A value at the root of the walk, named `root` (e.g. `scalers[3]`).
    pub fn root(node: &'a Node, root: &'a str) -> Self {
        Self {
            node,
            mark: node.mark(),
            seg: Seg::Root(root),
            parent: None,
        }
    }

    /// The field path, e.g. `scalers[0].labelSets[1].image`.
    pub fn path(&self) -> String {
        let mut chain = vec![self.seg];
        let mut p = self.parent;
        while let Some(v) = p {
            chain.push(v.seg);
            p = v.parent;
        }
        let mut out = String::new();
        for seg in chain.iter().rev() {
            match seg {
                Seg::Root(r) => out.push_str(r),
                Seg::Key(k) => push_key(&mut out, k),
                Seg::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        out
    }

    /// The path of `key` below this value (for a missing key).
    pub fn child_path(&self, key: &str) -> String {
        field_path(&self.path(), key)
    }
}

impl Cx {
    pub fn new(files: Vec<Arc<str>>) -> Self {
        Self {
            files,
            errors: Vec::new(),
            warnings: Vec::new(),
            required_at: None,
        }
    }

    pub fn files(&self) -> &[Arc<str>] {
        &self.files
    }

    pub fn file(&self, source: usize) -> Arc<str> {
        self.files
            .get(source)
            .cloned()
            .unwrap_or_else(|| Arc::from("<unknown>"))
    }

    pub fn origin_at(&self, m: Marker) -> Origin {
        Origin::new(self.file(m.source()), m.line(), m.column())
    }

    pub fn origin(&self, v: &Val<'_>) -> Origin {
        self.origin_at(v.mark)
    }

    /// An error about `v` itself.
    pub fn err(&mut self, v: &Val<'_>, message: impl Into<String>) {
        let origin = self.origin(v);
        self.error(origin, v.path(), message);
    }

    /// A warning about `v` itself.
    pub fn warn_at(&mut self, v: &Val<'_>, message: impl Into<String>) {
        let origin = self.origin(v);
        self.warn(origin, v.path(), message);
    }

    /// An error about `key` of `obj` (typically: it is missing).
    pub fn err_key(&mut self, obj: &Obj<'_>, key: &str, message: impl Into<String>) {
        let origin = self.origin(&obj.val);
        self.error(origin, obj.val.child_path(key), message);
    }

    /// An error about `key` of `obj`: at its value when written, else at
    /// the object.
    pub fn err_field(&mut self, obj: &Obj<'_>, key: &str, message: impl Into<String>) {
        match self.field(obj, key) {
            Some(v) => self.err(&v, message),
            None => self.err_key(obj, key, message),
        }
    }

    pub fn error(&mut self, origin: Origin, path: impl Into<String>, message: impl Into<String>) {
        self.errors.push(Diagnostic::new(origin, path, message));
    }

    pub fn warn(&mut self, origin: Origin, path: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Diagnostic::new(origin, path, message));
    }

    pub fn error_count(&self) -> usize {
        self.errors.len()
    }

    /// The value of `key` in `obj`. An omitted value (`key:` alone) is
    /// positioned at its key: the parser places it at the next token.
    pub fn field<'b>(&self, obj: &'b Obj<'_>, key: &str) -> Option<Val<'b>> {
        let (k, v) = obj.map.get_key_value(key)?;
        Some(self.value_of(&obj.val, k, v))
    }

    pub fn value_of<'b>(&self, parent: &'b Val<'_>, k: &'b ScalarNode, v: &'b Node) -> Val<'b> {
        let omitted = matches!(v, Node::Scalar(s) if s.as_str().is_empty() && s.is_plain());
        let mark = if omitted { k.mark() } else { v.mark() };
        Val {
            node: v,
            mark,
            seg: Seg::Key(k.as_str()),
            parent: Some(parent),
        }
    }

    /// Reports keys of `obj` outside `accepted` (errors for strict objects,
    /// warnings otherwise). `hint` may add advice for a known key.
    pub fn check_keys(
        &mut self,
        obj: &Obj<'_>,
        accepted: &[&str],
        mode: Keys,
        hint: fn(&str) -> Option<&'static str>,
    ) {
        for k in obj.map.keys() {
            let key = k.as_str();
            if accepted.contains(&key) {
                continue;
            }
            let origin = self.origin_at(k.mark());
            let path = obj.val.child_path(key);
            let extra = hint(key)
                .or_else(|| (key == "<<").then_some(MERGE_KEY_HINT))
                .map(|h| format!(" ({h})"))
                .unwrap_or_default();
            match mode {
                Keys::Strict => self.error(
                    origin,
                    path,
                    format!(
                        "unrecognized key {}{extra}; accepted keys: {}",
                        quote(key),
                        accepted.join(", ")
                    ),
                ),
                Keys::Lenient => self.warn(
                    origin,
                    path,
                    format!(
                        "unknown key {}{extra} is ignored; known keys: {}",
                        quote(key),
                        accepted.join(", ")
                    ),
                ),
            }
        }
    }

    fn expected(&mut self, v: &Val<'_>, what: &str) {
        let got = describe(v.node);
        // Upstream refuses an explicit null for every field it types (`~`,
        // `null`, or a key with no value): leaving a field out is the only
        // way to get its default. Say so, where a key could be left out.
        let optional = self.required_at != Some(v.mark);
        let hint = if optional && matches!(v.seg, Seg::Key(_)) && Self::is_null(v) {
            " (an explicit null is not \"unset\": remove the key to use the default)"
        } else {
            ""
        };
        self.err(v, format!("expected {what}, got {got}{hint}"));
    }

    pub fn obj<'b>(&mut self, v: &Val<'b>) -> Option<Obj<'b>> {
        match v.node {
            Node::Mapping(map) => Some(Obj { map, val: *v }),
            _ => {
                self.expected(v, "a mapping");
                None
            }
        }
    }

    pub fn list<'b>(&mut self, v: &'b Val<'_>) -> Option<Vec<Val<'b>>> {
        match v.node {
            Node::Sequence(seq) => Some(
                seq.iter()
                    .enumerate()
                    .map(|(i, n)| Val {
                        node: n,
                        mark: n.mark(),
                        seg: Seg::Index(i),
                        parent: Some(v),
                    })
                    .collect(),
            ),
            _ => {
                self.expected(v, "a list");
                None
            }
        }
    }

    fn scalar<'n>(v: &Val<'n>) -> Option<Scalar<'n>> {
        match v.node {
            Node::Scalar(s) => Some(classify(s)),
            _ => None,
        }
    }

    /// A string. Plain scalars that YAML reads as numbers, booleans or null
    /// are refused, as upstream's schema does.
    pub fn string(&mut self, v: &Val<'_>) -> Option<String> {
        match Self::scalar(v) {
            Some(Scalar::Str(s)) => Some(s.to_owned()),
            Some(Scalar::Number(_) | Scalar::Bool(_)) => {
                let got = describe(v.node);
                let tagged = matches!(v.node, Node::Scalar(s) if s.tag().is_some());
                let hint = if tagged {
                    "its explicit tag makes it one; drop the tag"
                } else {
                    "quote it to use it as a string"
                };
                self.err(v, format!("expected a string, got {got} ({hint})"));
                None
            }
            _ => {
                self.expected(v, "a string");
                None
            }
        }
    }

    pub fn string_list(&mut self, v: &Val<'_>) -> Option<Vec<String>> {
        let items = self.list(v)?;
        let before = self.error_count();
        let out: Vec<String> = items.iter().filter_map(|i| self.string(i)).collect();
        (self.error_count() == before).then_some(out)
    }

    pub fn bool(&mut self, v: &Val<'_>) -> Option<bool> {
        match Self::scalar(v) {
            Some(Scalar::Bool(b)) => Some(b),
            _ => {
                self.expected(v, "true or false");
                None
            }
        }
    }

    /// A number as YAML reads it (not necessarily finite).
    fn number(&mut self, v: &Val<'_>, what: &str) -> Option<f64> {
        match Self::scalar(v) {
            Some(Scalar::Number(n)) => Some(n),
            _ => {
                self.expected(v, what);
                None
            }
        }
    }

    /// A finite number > 0 (seconds, cores).
    pub fn positive_number(&mut self, v: &Val<'_>) -> Option<f64> {
        const WHAT: &str = "a number > 0";
        let n = self.number(v, WHAT)?;
        if n.is_finite() && n > 0.0 {
            Some(n)
        } else {
            self.expected(v, WHAT);
            None
        }
    }

    /// Any number (range checked by the caller), for messages of its own.
    pub fn any_number(&mut self, v: &Val<'_>, what: &str) -> Option<f64> {
        self.number(v, what)
    }

    fn integer(&mut self, v: &Val<'_>, min: u32, what: &str) -> Option<u32> {
        let n = self.number(v, what)?;
        if n.is_finite() && n.fract() == 0.0 && n >= f64::from(min) && n <= f64::from(u32::MAX) {
            // Checked just above: integral and within u32.
            Some(n as u32)
        } else {
            self.expected(v, what);
            None
        }
    }

    /// An integer > 0 (`2.0` counts, as in JavaScript; `1.5` does not).
    pub fn positive_int(&mut self, v: &Val<'_>) -> Option<u32> {
        self.integer(v, 1, "an integer > 0")
    }

    pub fn non_negative_int(&mut self, v: &Val<'_>) -> Option<u32> {
        self.integer(v, 0, "an integer >= 0")
    }

    pub fn int_at_least(&mut self, v: &Val<'_>, min: u32) -> Option<u32> {
        self.integer(v, min, &format!("an integer >= {min}"))
    }

    /// One of `choices`, exactly as written.
    pub fn choice<T: Copy>(&mut self, v: &Val<'_>, choices: &[(&str, T)]) -> Option<T> {
        let what = || {
            let names: Vec<String> = choices.iter().map(|(n, _)| quote(n)).collect();
            format!("one of {}", names.join(", "))
        };
        match Self::scalar(v) {
            Some(Scalar::Str(s)) => {
                if let Some((_, t)) = choices.iter().find(|(n, _)| *n == s) {
                    return Some(*t);
                }
                let what = what();
                self.expected(v, &what);
                None
            }
            _ => {
                let what = what();
                self.expected(v, &what);
                None
            }
        }
    }

    /// True when the value is null in the YAML sense (`~`, `null`, empty).
    pub fn is_null(v: &Val<'_>) -> bool {
        matches!(Self::scalar(v), Some(Scalar::Null))
    }
}

/// The outcome of reading an optional field.
pub(crate) enum Got<T> {
    /// Not written.
    Absent,
    /// Written but invalid (already reported).
    Bad,
    Value(T),
}

impl<T> Got<T> {
    pub fn value(self) -> Option<T> {
        match self {
            Got::Value(v) => Some(v),
            _ => None,
        }
    }
}

impl Cx {
    /// Reads an optional field. An explicit null is not absent: upstream's
    /// schema refuses it for every field, so `read` sees it and reports what
    /// it expected instead.
    pub fn opt<'b, T>(
        &mut self,
        obj: &'b Obj<'_>,
        key: &str,
        read: impl FnOnce(&mut Self, &Val<'b>) -> Option<T>,
    ) -> Got<T> {
        match self.field(obj, key) {
            None => Got::Absent,
            Some(v) => match read(self, &v) {
                Some(t) => Got::Value(t),
                None => Got::Bad,
            },
        }
    }

    /// Reads a required field; a missing key is reported at the object.
    pub fn required<'b, T>(
        &mut self,
        obj: &'b Obj<'_>,
        key: &str,
        read: impl FnOnce(&mut Self, &Val<'b>) -> Option<T>,
    ) -> Option<T> {
        match self.field(obj, key) {
            Some(v) => {
                let outer = self.required_at.replace(v.mark);
                let got = read(self, &v);
                self.required_at = outer;
                got
            }
            None => {
                self.err_key(obj, key, format!("missing required key `{key}`"));
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(field_path("", "version"), "version");
        assert_eq!(
            field_path("scalers[0]", "x-kici-scaler"),
            "scalers[0].x-kici-scaler"
        );
        assert_eq!(field_path("a", "odd key"), "a[\"odd key\"]");
    }

    fn with_value<R>(text: &str, f: impl FnOnce(&mut Cx, &Val<'_>) -> R) -> (R, Vec<String>) {
        let node = crate::yaml::parse(0, &format!("k: {text}\n")).unwrap();
        let mut cx = Cx::new(vec!["f.yaml".into()]);
        let root = Val::root(&node, "");
        let obj = Obj {
            map: node.as_mapping().unwrap(),
            val: root,
        };
        let v = cx.field(&obj, "k").unwrap();
        let r = f(&mut cx, &v);
        (r, cx.errors.iter().map(|d| d.to_string()).collect())
    }

    #[test]
    fn typed_readers_say_what_they_expected() {
        let (r, e) = with_value("abc", |cx, v| cx.positive_int(v));
        assert_eq!(r, None);
        assert_eq!(e, ["f.yaml:1:4: k: expected an integer > 0, got \"abc\""]);
        let (r, e) = with_value("1.5", |cx, v| cx.positive_int(v));
        assert_eq!(
            (r, e[0].as_str()),
            (None, "f.yaml:1:4: k: expected an integer > 0, got 1.5")
        );
        assert_eq!(with_value("2.0", |cx, v| cx.positive_int(v)).0, Some(2));
        assert_eq!(with_value("0", |cx, v| cx.non_negative_int(v)).0, Some(0));
        let (_, e) = with_value("-1", |cx, v| cx.non_negative_int(v));
        assert!(e[0].ends_with("expected an integer >= 0, got -1"), "{e:?}");
        let (_, e) = with_value("12", |cx, v| cx.string(v));
        assert!(e[0].ends_with("expected a string, got 12 (quote it to use it as a string)"));
        assert_eq!(
            with_value("'12'", |cx, v| cx.string(v)).0.as_deref(),
            Some("12")
        );
        let (_, e) = with_value("!!int '12'", |cx, v| cx.string(v));
        assert!(
            e[0].ends_with(
                "expected a string, got 12 (its explicit tag makes it one; drop the tag)"
            ),
            "{e:?}"
        );
        let (_, e) = with_value("", |cx, v| cx.string(v));
        assert_eq!(e, ["f.yaml:1:1: k: expected a string, got null (an explicit null is not \"unset\": remove the key to use the default)"]);
        let (_, e) = with_value(".nan", |cx, v| cx.positive_number(v));
        assert!(e[0].ends_with("expected a number > 0, got .nan"));
        let (_, e) = with_value("[a]", |cx, v| cx.bool(v));
        assert!(e[0].ends_with("expected true or false, got a list"));
        let (r, e) = with_value("podman", |cx, v| {
            cx.choice(v, &[("docker", 1), ("podman", 2)])
        });
        assert_eq!((r, e.len()), (Some(2), 0));
        let (_, e) = with_value("x", |cx, v| cx.choice(v, &[("docker", 1), ("podman", 2)]));
        assert!(e[0].ends_with("expected one of \"docker\", \"podman\", got \"x\""));
    }
}
