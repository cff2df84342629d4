//! Labels and normalised label sets.
//!
//! A job's `runsOn` and a scaler's label sets are compared as *normalised*
//! sets: lower-cased, de-duplicated, sorted. [`LabelSet`] is that form, so two
//! sets that differ only in order, case or repetition are equal values.

use serde::{Serialize, Serializer};
use std::fmt;
use std::sync::Arc;

/// The prefix reserved for labels kici-scaler (and KiCI) inject themselves.
pub const RESERVED_PREFIX: &str = "kici:";

/// Longest label accepted, in bytes. Labels travel in `KICI_LABELS`, container
/// labels and MMDS; an unbounded one is a denial-of-service lever.
pub const MAX_LABEL_LEN: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("a label must not be empty")]
    Empty,
    #[error("label {0:?} is longer than {MAX_LABEL_LEN} bytes")]
    TooLong(String),
    #[error("label {0:?} contains whitespace, a comma or a control character")]
    BadCharacter(String),
    #[error(
        "label {0:?} uses the 'kici:' prefix, which is reserved for labels kici-scaler injects"
    )]
    Reserved(String),
}

/// `raw` without the whitespace JavaScript's `String.prototype.trim` removes
/// (Unicode white space, plus the byte-order mark, which is not white space
/// to Rust), so a label trims here exactly as it does in KiCI.
fn trim_label(raw: &str) -> &str {
    raw.trim_matches(|c: char| c.is_whitespace() || c == '\u{feff}')
}

/// One label in normalised (lower-case) form.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label(Arc<str>);

impl Label {
    /// Normalises `raw` (lower-case). Auto-injected `kici:` labels are allowed
    /// here because jobs may name them in `runsOn`; configuration uses
    /// [`Label::user`] to forbid them.
    pub fn parse(raw: &str) -> Result<Self, LabelError> {
        if raw.is_empty() {
            return Err(LabelError::Empty);
        }
        if raw.len() > MAX_LABEL_LEN {
            return Err(LabelError::TooLong(raw.to_owned()));
        }
        if raw
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == ',')
        {
            return Err(LabelError::BadCharacter(raw.to_owned()));
        }
        Ok(Self(Arc::from(raw.to_lowercase())))
    }

    /// A label an operator may configure: as [`Label::parse`], minus the
    /// reserved `kici:` prefix.
    pub fn user(raw: &str) -> Result<Self, LabelError> {
        let label = Self::parse(raw)?;
        if label.is_reserved() {
            return Err(LabelError::Reserved(raw.to_owned()));
        }
        Ok(label)
    }

    /// The canonical form KiCI 0.9 gives every label it stores or compares:
    /// surrounding whitespace trimmed, then lower-cased, so `" Linux"` is
    /// `linux`. Whitespace inside a label is still refused, as by
    /// [`Label::parse`].
    pub fn canonical(raw: &str) -> Result<Self, LabelError> {
        Self::parse(trim_label(raw))
    }

    /// [`Label::canonical`] for a label an operator configures. The reserved
    /// prefix is checked on the trimmed label, so `" kici:os:linux"` cannot
    /// slip past the check and become `kici:os:linux` afterwards.
    pub fn canonical_user(raw: &str) -> Result<Self, LabelError> {
        let label = Self::canonical(raw)?;
        if label.is_reserved() {
            return Err(LabelError::Reserved(raw.to_owned()));
        }
        Ok(label)
    }

    /// Builds an auto-injected label without validation of the prefix.
    /// Callers only pass `kici:<kind>:<value>` built from validated parts.
    pub fn auto(kind: &str, value: &str) -> Self {
        Self(Arc::from(
            format!("{RESERVED_PREFIX}{kind}:{value}").to_lowercase(),
        ))
    }

    /// A plain label from a literal known to be valid and lower-case (the
    /// platform taint tokens); not checked.
    pub(crate) fn from_valid_literal(s: &'static str) -> Self {
        Self(Arc::from(s))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_reserved(&self) -> bool {
        self.0.starts_with(RESERVED_PREFIX)
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Label {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// A normalised set of labels: sorted ascending (byte order), no duplicates.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelSet(Vec<Label>);

impl LabelSet {
    /// Builds the normalised set from already parsed labels.
    pub fn from_labels(labels: impl IntoIterator<Item = Label>) -> Self {
        let mut v: Vec<Label> = labels.into_iter().collect();
        v.sort();
        v.dedup();
        Self(v)
    }

    /// Parses and normalises raw labels (job side: `kici:` labels allowed).
    pub fn parse<S: AsRef<str>>(raw: impl IntoIterator<Item = S>) -> Result<Self, LabelError> {
        let labels = raw
            .into_iter()
            .map(|s| Label::parse(s.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::from_labels(labels))
    }

    /// Parses raw labels in their canonical form ([`Label::canonical`]:
    /// trimmed, lower-cased), de-duplicated and sorted. Job side: `kici:`
    /// labels allowed. An empty list is the empty set.
    pub fn canonical<S: AsRef<str>>(raw: impl IntoIterator<Item = S>) -> Result<Self, LabelError> {
        let labels = raw
            .into_iter()
            .map(|s| Label::canonical(s.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::from_labels(labels))
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &Label> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, label: &Label) -> bool {
        self.0.binary_search(label).is_ok()
    }

    /// True when every label of `self` is in `other` (merge walk, both sorted).
    pub fn is_subset_of(&self, other: &LabelSet) -> bool {
        let mut theirs = other.0.iter();
        'outer: for mine in &self.0 {
            for t in theirs.by_ref() {
                match t.cmp(mine) {
                    std::cmp::Ordering::Less => continue,
                    std::cmp::Ordering::Equal => continue 'outer,
                    std::cmp::Ordering::Greater => return false,
                }
            }
            return false;
        }
        true
    }

    /// The labels of `self` that `other` lacks, in order.
    pub fn missing_from<'a>(&'a self, other: &'a LabelSet) -> impl Iterator<Item = &'a Label> {
        self.0.iter().filter(move |l| !other.contains(l))
    }

    /// The union of two sets.
    pub fn union(&self, other: &LabelSet) -> LabelSet {
        Self::from_labels(self.0.iter().chain(other.0.iter()).cloned())
    }

    /// The comma-joined key (upstream's `normalize`): `""` for the empty set.
    pub fn key(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for LabelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, l) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(l.as_str())?;
        }
        Ok(())
    }
}

impl Serialize for LabelSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter())
    }
}

impl<'a> IntoIterator for &'a LabelSet {
    type Item = &'a Label;
    type IntoIter = std::slice::Iter<'a, Label>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(raw: &[&str]) -> LabelSet {
        LabelSet::parse(raw.iter().copied()).unwrap()
    }

    #[test]
    fn normalises_case_order_and_duplicates() {
        assert_eq!(set(&["Linux", "docker", "LINUX"]).key(), "docker,linux");
        assert_eq!(set(&[]).key(), "");
        assert_eq!(set(&["b", "a"]), set(&["A", "B", "a"]));
    }

    #[test]
    fn subset() {
        assert!(set(&["macos"]).is_subset_of(&set(&["macos", "darwin", "bare-metal"])));
        assert!(!set(&["macos", "gpu"]).is_subset_of(&set(&["macos", "darwin"])));
        assert!(set(&[]).is_subset_of(&set(&["a"])));
        assert!(!set(&["a"]).is_subset_of(&set(&[])));
        let missing: Vec<_> = set(&["a", "b", "c"])
            .missing_from(&set(&["b"]))
            .map(|l| l.to_string())
            .collect();
        assert_eq!(missing, ["a", "c"]);
    }

    #[test]
    fn rejects_bad_labels() {
        assert_eq!(Label::parse(""), Err(LabelError::Empty));
        assert!(matches!(
            Label::parse("a b"),
            Err(LabelError::BadCharacter(_))
        ));
        assert!(matches!(
            Label::parse("a,b"),
            Err(LabelError::BadCharacter(_))
        ));
        assert!(matches!(
            Label::user("KICI:os:linux"),
            Err(LabelError::Reserved(_))
        ));
        assert!(Label::parse("kici:os:linux").is_ok());
        assert!(matches!(
            Label::parse(&"x".repeat(300)),
            Err(LabelError::TooLong(_))
        ));
    }

    #[test]
    fn canonical_trims_then_lower_cases_then_checks() {
        assert_eq!(Label::canonical(" Linux").unwrap().as_str(), "linux");
        assert_eq!(
            Label::canonical("\tGPU\u{a0}\u{feff}").unwrap().as_str(),
            "gpu"
        );
        assert_eq!(Label::canonical("   "), Err(LabelError::Empty));
        assert!(matches!(
            Label::canonical(" a b "),
            Err(LabelError::BadCharacter(_))
        ));
        // The reserved prefix is checked after trimming.
        assert_eq!(
            Label::canonical_user(" kici:os:linux"),
            Err(LabelError::Reserved(" kici:os:linux".into()))
        );
        assert!(Label::canonical(" kici:os:linux").is_ok());
        assert_eq!(
            LabelSet::canonical([" Linux", "linux ", "Docker"])
                .unwrap()
                .key(),
            "docker,linux"
        );
        assert!(LabelSet::canonical(Vec::<String>::new())
            .unwrap()
            .is_empty());
        // `parse` itself is unchanged: it does not trim.
        assert!(Label::parse(" linux").is_err());
    }

    proptest! {
        #[test]
        fn subset_matches_naive(a in proptest::collection::vec("[a-e]", 0..6), b in proptest::collection::vec("[a-e]", 0..6)) {
            let (sa, sb) = (set(&a.iter().map(String::as_str).collect::<Vec<_>>()), set(&b.iter().map(String::as_str).collect::<Vec<_>>()));
            let naive = sa.iter().all(|l| sb.iter().any(|m| m == l));
            prop_assert_eq!(sa.is_subset_of(&sb), naive);
        }
    }
}
