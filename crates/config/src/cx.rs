//! The walk's context: where each node is, which file it came from, and the
//! findings collected so far; plus typed readers for scalars, lists and
//! objects that report what they expected.

use crate::diagnostic::Diagnostic;
use crate::yaml::{classify, describe, quote, Scalar};
use kici_model::Origin;
use marked_yaml::types::{MarkedMappingNode, MarkedScalarNode};
use marked_yaml::{Marker, Node};
use std::sync::Arc;

/// Collects findings while the schema walk goes on; nothing stops at the
/// first error.
pub(crate) struct Cx {
    files: Vec<Arc<str>>,
    pub errors: Vec<Diagnostic>,
    pub warnings: Vec<Diagnostic>,
}

/// A value found in a document: the node, the field path leading to it, and
/// its position.
#[derive(Clone)]
pub(crate) struct Val<'n> {
    pub node: &'n Node,
    pub path: String,
    pub origin: Origin,
}

/// A mapping found in a document.
#[derive(Clone)]
pub(crate) struct Obj<'n> {
    pub map: &'n MarkedMappingNode,
    pub path: String,
    pub origin: Origin,
}

/// Whether unknown keys in an object are errors (upstream's strict objects)
/// or warnings (objects upstream strips silently).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keys {
    Strict,
    Lenient,
}

/// `parent.key`, or `parent["odd key"]` when the key is not a plain word.
pub(crate) fn field_path(parent: &str, key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    match (parent.is_empty(), plain) {
        (true, true) => key.to_owned(),
        (false, true) => format!("{parent}.{key}"),
        (_, false) => format!("{parent}[{key:?}]"),
    }
}

pub(crate) fn index_path(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

fn earlier(a: Option<&Marker>, b: Option<&Marker>) -> Option<Marker> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if (b.line(), b.column()) < (a.line(), a.column()) {
            *b
        } else {
            *a
        }),
        (a, b) => a.or(b).copied(),
    }
}

impl Cx {
    pub fn new(files: Vec<Arc<str>>) -> Self {
        Self {
            files,
            errors: Vec::new(),
            warnings: Vec::new(),
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

    pub fn origin_at(&self, m: Option<&Marker>) -> Origin {
        match m {
            Some(m) => Origin::new(
                self.file(m.source()),
                u32::try_from(m.line()).unwrap_or(u32::MAX),
                u32::try_from(m.column()).unwrap_or(u32::MAX),
            ),
            None => Origin::synthetic(),
        }
    }

    /// Where a node starts. A block mapping's own marker sits after its first
    /// key, so the first key's position is used when it is earlier.
    pub fn node_origin(&self, node: &Node) -> Origin {
        let m = match node {
            Node::Mapping(map) => earlier(
                map.span().start(),
                map.keys().next().and_then(|k| k.span().start()),
            ),
            other => other.span().start().copied(),
        };
        self.origin_at(m.as_ref())
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
    pub fn field<'n>(&self, obj: &Obj<'n>, key: &str) -> Option<Val<'n>> {
        let (k, v) = obj.map.iter().find(|(k, _)| k.as_str() == key)?;
        Some(self.value_of(&obj.path, k, v))
    }

    pub fn value_of<'n>(&self, parent: &str, k: &MarkedScalarNode, v: &'n Node) -> Val<'n> {
        let omitted = matches!(v, Node::Scalar(s) if s.as_str().is_empty() && s.may_coerce());
        let origin = if omitted {
            self.origin_at(k.span().start())
        } else {
            self.node_origin(v)
        };
        Val {
            node: v,
            path: field_path(parent, k.as_str()),
            origin,
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
            let origin = self.origin_at(k.span().start());
            let path = field_path(&obj.path, key);
            let extra = hint(key).map(|h| format!(" ({h})")).unwrap_or_default();
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
        self.error(
            v.origin.clone(),
            v.path.clone(),
            format!("expected {what}, got {got}"),
        );
    }

    pub fn obj<'n>(&mut self, v: &Val<'n>) -> Option<Obj<'n>> {
        match v.node {
            Node::Mapping(map) => Some(Obj {
                map,
                path: v.path.clone(),
                origin: v.origin.clone(),
            }),
            _ => {
                self.expected(v, "a mapping");
                None
            }
        }
    }

    pub fn list<'n>(&mut self, v: &Val<'n>) -> Option<Vec<Val<'n>>> {
        match v.node {
            Node::Sequence(seq) => Some(
                seq.iter()
                    .enumerate()
                    .map(|(i, n)| Val {
                        node: n,
                        path: index_path(&v.path, i),
                        origin: self.node_origin(n),
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
                self.error(
                    v.origin.clone(),
                    v.path.clone(),
                    format!("expected a string, got {got} (quote it to use it as a string)"),
                );
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

    /// True when the value is absent in the YAML sense (`~`, `null`, empty).
    pub fn is_null(v: &Val<'_>) -> bool {
        matches!(Self::scalar(v), Some(Scalar::Null))
    }
}

/// The outcome of reading an optional field.
pub(crate) enum Got<T> {
    /// Not written, or written as null.
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
    /// Reads an optional field; null counts as absent.
    pub fn opt<'n, T>(
        &mut self,
        obj: &Obj<'n>,
        key: &str,
        read: impl FnOnce(&mut Self, &Val<'n>) -> Option<T>,
    ) -> Got<T> {
        match self.field(obj, key) {
            None => Got::Absent,
            Some(v) if Self::is_null(&v) => Got::Absent,
            Some(v) => match read(self, &v) {
                Some(t) => Got::Value(t),
                None => Got::Bad,
            },
        }
    }

    /// Reads a required field; a missing key is reported at the object.
    pub fn required<'n, T>(
        &mut self,
        obj: &Obj<'n>,
        key: &str,
        read: impl FnOnce(&mut Self, &Val<'n>) -> Option<T>,
    ) -> Option<T> {
        match self.field(obj, key) {
            Some(v) => read(self, &v),
            None => {
                self.error(
                    obj.origin.clone(),
                    field_path(&obj.path, key),
                    format!("missing required key `{key}`"),
                );
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
        assert_eq!(index_path("scalers", 3), "scalers[3]");
    }

    fn with_value<R>(text: &str, f: impl FnOnce(&mut Cx, &Val<'_>) -> R) -> (R, Vec<String>) {
        let node = crate::yaml::parse(0, &format!("k: {text}\n")).unwrap();
        let mut cx = Cx::new(vec!["f.yaml".into()]);
        let obj = Obj {
            map: node.as_mapping().unwrap(),
            path: String::new(),
            origin: Origin::synthetic(),
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
        let (_, e) = with_value("", |cx, v| cx.string(v));
        assert_eq!(e, ["f.yaml:1:1: k: expected a string, got null"]);
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
