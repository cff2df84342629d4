//! Diagnostics: one error or warning, with the `file:line:col` it points at
//! and the field path it concerns.

use kici_model::Origin;
use std::fmt;

/// One finding about a configuration file.
///
/// Displayed as `file:line:col: path: message`. Two degenerate forms exist:
/// a diagnostic about a whole file (an I/O error: line 0) prints as
/// `file: path: message`, and one without a field path (a YAML syntax error)
/// omits the `path: ` part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub origin: Origin,
    /// The field the finding concerns, e.g.
    /// `scalers[0].labelSets[1].resources.requests.memory` or
    /// `globalMaxAgents`; empty for file-level findings.
    pub path: String,
    pub message: String,
}

impl Diagnostic {
    pub fn new(origin: Origin, path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            origin,
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.origin.line == 0 {
            write!(f, "{}: ", self.origin.file)?;
        } else {
            write!(f, "{}: ", self.origin)?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// Every error found in a configuration, sorted by file (in load order: the
/// main file first, then the drop-ins in their order), line and column.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<Diagnostic>);

impl ConfigErrors {
    pub fn iter(&self) -> impl Iterator<Item = &Diagnostic> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

/// Sorts diagnostics by file (position of the file in `files`, unknown files
/// last by name), then line, then column; equal positions keep their order.
pub(crate) fn sort(diags: &mut [Diagnostic], files: &[std::sync::Arc<str>]) {
    let rank = |d: &Diagnostic| {
        files
            .iter()
            .position(|f| *f == d.origin.file)
            .unwrap_or(usize::MAX)
    };
    diags.sort_by(|a, b| {
        rank(a)
            .cmp(&rank(b))
            .then_with(|| a.origin.file.cmp(&b.origin.file))
            .then(a.origin.line.cmp(&b.origin.line))
            .then(a.origin.col.cmp(&b.origin.col))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_forms() {
        let d = Diagnostic::new(Origin::new("a.yaml", 3, 5), "globalMaxAgents", "bad");
        assert_eq!(d.to_string(), "a.yaml:3:5: globalMaxAgents: bad");
        let d = Diagnostic::new(Origin::new("a.yaml", 0, 0), "", "cannot read");
        assert_eq!(d.to_string(), "a.yaml: cannot read");
        let d = Diagnostic::new(Origin::new("a.yaml", 1, 2), "", "syntax");
        assert_eq!(d.to_string(), "a.yaml:1:2: syntax");
        let e = ConfigErrors(vec![
            Diagnostic::new(Origin::new("a", 1, 1), "x", "one"),
            Diagnostic::new(Origin::new("a", 2, 1), "y", "two"),
        ]);
        assert_eq!(e.to_string(), "a:1:1: x: one\na:2:1: y: two");
    }

    #[test]
    fn sorts_by_load_order_then_position() {
        let files: Vec<std::sync::Arc<str>> = vec!["main.yaml".into(), "d/01.yaml".into()];
        let mut v = vec![
            Diagnostic::new(Origin::new("d/01.yaml", 1, 1), "", "c"),
            Diagnostic::new(Origin::new("main.yaml", 9, 1), "", "b"),
            Diagnostic::new(Origin::new("main.yaml", 2, 7), "", "a"),
        ];
        sort(&mut v, &files);
        let order: Vec<_> = v.iter().map(|d| d.message.as_str()).collect();
        assert_eq!(order, ["a", "b", "c"]);
    }
}
