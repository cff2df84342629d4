//! Label sets configured identically on two different scalers.
//!
//! Routing alone would silently send every such job to the earlier scaler,
//! so boot and reload refuse a configuration with overlaps (as upstream
//! KiCI's overlap detection does). Compared on the configured labels, not the enriched ones: the
//! `kici:scaler:*` auto label would otherwise make every set unique.

use kici_model::{LabelSet, ScalerEntry, ScalerName};
use std::collections::HashMap;
use std::fmt;

/// A label set a later scaler shares with the first scaler that used it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSetOverlap {
    pub labels: LabelSet,
    /// The first scaler (in config order) that configured this set.
    pub first: ScalerName,
    /// A later scaler that configures it again.
    pub second: ScalerName,
}

impl fmt::Display for LabelSetOverlap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Label set [{}] overlaps between scalers \"{}\" and \"{}\"",
            self.labels, self.first, self.second
        )
    }
}

/// Every cross-scaler repetition of a label set, in config order. A set
/// repeated within one scaler is allowed (the first one wins); a set shared by
/// three scalers yields two records, both naming the first owner.
pub fn label_set_overlaps(scalers: &[ScalerEntry]) -> Vec<LabelSetOverlap> {
    let mut owners: HashMap<&LabelSet, usize> = HashMap::new();
    let mut overlaps = Vec::new();
    for (index, scaler) in scalers.iter().enumerate() {
        for set in &scaler.label_sets {
            let owner = *owners.entry(&set.labels).or_insert(index);
            if owner != index {
                overlaps.push(LabelSetOverlap {
                    labels: set.labels.clone(),
                    first: scalers[owner].name.clone(),
                    second: scaler.name.clone(),
                });
            }
        }
    }
    overlaps
}
