//! Serde glue shared by the message types: ids parsed from strings, label
//! lists, timestamps.

use kici_model::{Label, LabelSet};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt::Display;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: every `timestamp` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UnixMillis(pub u64);

impl UnixMillis {
    /// The current wall-clock time. A clock before 1970 reads as 0: a
    /// timestamp is informational and must not fail a send.
    pub fn now() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self(ms)
    }
}

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
