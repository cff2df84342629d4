//! Serde glue shared by the message types: ids parsed from strings, label
//! lists, timestamps.

use kici_model::{Label, LabelSet};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use std::fmt::Display;
use std::str::FromStr;

/// Every `timestamp` field: the workspace's one wall-clock type.
pub use kici_model::UnixMillis;

/// Deserializes any `FromStr` type (ids) from a JSON string; pairs with the
/// type's own `Serialize` (which writes its `Display` form).
pub(crate) fn from_str<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: Display,
{
    let s = String::deserialize(d)?;
    s.parse().map_err(D::Error::custom)
}

/// Deserializes a label list into its normalised set; any invalid label
/// rejects the message.
pub(crate) fn label_set<'de, D: Deserializer<'de>>(d: D) -> Result<LabelSet, D::Error> {
    let raw = Vec::<String>::deserialize(d)?;
    let labels = raw
        .iter()
        .map(|s| Label::parse(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(D::Error::custom)?;
    Ok(LabelSet::from_labels(labels))
}

pub(crate) fn is_false(b: &bool) -> bool {
    !*b
}
