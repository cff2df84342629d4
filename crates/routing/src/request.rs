//! Normalising a request's labels before routing.
use kici_model::{LabelError, LabelSet};

/// A request's labels (a job's `runsOn`, or the labels it excludes) as
/// routing compares them: each trimmed and lower-cased (`" Linux"` is
/// `linux`), de-duplicated. Every label a caller hands to [`Router::route`]
/// or [`Router::explain`] should come through here, so that a request
/// routes exactly as the same labels written in the configuration would.
/// An empty list is valid: such a job routes as [`Router::route`] says.
///
/// [`Router::route`]: crate::Router::route
/// [`Router::explain`]: crate::Router::explain
pub fn request_labels<S: AsRef<str>>(
    raw: impl IntoIterator<Item = S>,
) -> Result<LabelSet, LabelError> {
    LabelSet::canonical(raw)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn request_labels_are_canonical() {
        assert_eq!(
            request_labels([" Linux", "linux", "GPU "]).unwrap().key(),
            "gpu,linux"
        );
        assert!(request_labels(Vec::<&str>::new()).unwrap().is_empty());
        assert!(request_labels([" kici:os:linux"]).is_ok());
        assert!(request_labels(["  "]).is_err());
    }
}
