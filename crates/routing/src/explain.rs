//! Why a job did or did not land on each label set.
//!
//! Returned in `no-backend` answers and by the `explain` command. Each
//! [`Reason`] renders as a short code (`selected`, `not-superset:gpu`, ...)
//! so operators and tests can match on it.

use crate::platform::TaintSource;
use crate::router::Route;
use kici_model::{Label, ScalerName};
use serde::{Serialize, Serializer};
use std::fmt;

/// The routing decision and one verdict per scaler × label set, in config
/// order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    pub chosen: Option<Route>,
    pub candidates: Vec<Candidate>,
}

impl Explanation {
    /// The verdict for one label set.
    pub fn reason(&self, scaler: usize, label_set: usize) -> Option<&Reason> {
        self.candidates
            .iter()
            .find(|c| c.scaler == scaler && c.label_set == label_set)
            .map(|c| &c.reason)
    }
}

/// One label set of one scaler, and its verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Candidate {
    pub scaler: usize,
    pub scaler_name: ScalerName,
    pub label_set: usize,
    pub reason: Reason,
}

/// The verdict for one label set. When several apply, the first in this
/// order is reported: `Cordoned`, `GatedMissing`, `NotSuperset`, `Excluded`,
/// `Tainted`, then `Selected` / `LargerThanWinner`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The winner.
    Selected,
    /// The job asks for labels this (enriched) set lacks; all of them, sorted.
    NotSuperset(Vec<Label>),
    /// The scaler is gated and the job lacks this mandatory label (the first
    /// missing one, in sorted order).
    GatedMissing(Label),
    /// The label set is tainted by a platform label the job does not ask for
    /// (the first missing one, in sorted order), and where the taint comes
    /// from: the scaler's `platform`, the host (a bare-metal scaler takes
    /// the host's platform), or the label set naming the label itself.
    Tainted { label: Label, source: TaintSource },
    /// The job excludes this label, which the enriched set carries (the first
    /// such one, in sorted order).
    Excluded(Label),
    /// Matched, but another set has fewer labels (its own plus role labels)
    /// or comes earlier; for a job without labels, one comes earlier.
    LargerThanWinner,
    /// The scaler is cordoned.
    Cordoned,
}

impl Reason {
    /// True for a set the job could have landed on.
    pub fn is_match(&self) -> bool {
        matches!(self, Reason::Selected | Reason::LargerThanWinner)
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Selected => f.write_str("selected"),
            Reason::NotSuperset(missing) => {
                f.write_str("not-superset:")?;
                for (i, label) in missing.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    f.write_str(label.as_str())?;
                }
                Ok(())
            }
            Reason::GatedMissing(label) => write!(f, "gated-missing:{label}"),
            Reason::Tainted { label, source } => write!(f, "tainted:{label}:{source}"),
            Reason::Excluded(label) => write!(f, "excluded:{label}"),
            Reason::LargerThanWinner => f.write_str("larger-than-winner"),
            Reason::Cordoned => f.write_str("cordoned"),
        }
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(scaler: usize, label_set: usize, reason: Reason) -> Candidate {
        Candidate {
            scaler,
            scaler_name: ScalerName::new(&format!("s{scaler}")),
            label_set,
            reason,
        }
    }

    #[test]
    fn reason_finds_exactly_its_label_set() {
        let e = Explanation {
            chosen: None,
            candidates: vec![
                candidate(0, 0, Reason::Cordoned),
                candidate(0, 1, Reason::LargerThanWinner),
                candidate(1, 0, Reason::Selected),
            ],
        };
        assert_eq!(e.reason(0, 1), Some(&Reason::LargerThanWinner));
        assert_eq!(e.reason(1, 0), Some(&Reason::Selected));
        assert_eq!(e.reason(1, 1), None);
        assert_eq!(e.reason(2, 0), None);
    }

    #[test]
    fn only_selected_and_larger_than_winner_are_matches() {
        assert!(Reason::Selected.is_match());
        assert!(Reason::LargerThanWinner.is_match());
        assert!(!Reason::Cordoned.is_match());
        assert!(!Reason::NotSuperset(vec![]).is_match());
    }
}
