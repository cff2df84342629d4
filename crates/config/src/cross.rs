//! Rules that span scalers: unique names, and no label set shared by two
//! scalers (upstream's overlap detection, made part of validation).

use crate::cx::{field_path, Cx};
use crate::scaler::ParsedScaler;
use crate::yaml::quote;
use kici_model::{LabelSet, Origin};
use std::collections::HashMap;

/// `file:line`, the form overlap and duplicate messages use.
fn file_line(o: &Origin) -> String {
    format!("{}:{}", o.file, o.line)
}

pub(crate) fn check(cx: &mut Cx, scalers: &[ParsedScaler]) {
    duplicate_names(cx, scalers);
    overlaps(cx, scalers);
}

/// Names must be unique, and unique ignoring case: agents carry the
/// lower-cased label `kici:scaler:<name>`, so `GPU` and `gpu` would be one
/// routing target.
fn duplicate_names(cx: &mut Cx, scalers: &[ParsedScaler]) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, s) in scalers.iter().enumerate() {
        let Some((name, name_origin)) = &s.name else {
            continue;
        };
        let folded = name.to_lowercase();
        let Some(&first) = seen.get(&folded) else {
            seen.insert(folded, i);
            continue;
        };
        let Some((first_name, first_origin)) = &scalers[first].name else {
            continue;
        };
        let message = if first_name == name {
            format!(
                "duplicate scaler name {}: defined at {} (scalers[{first}]) and {} (scalers[{i}])",
                quote(name),
                file_line(first_origin),
                file_line(name_origin),
            )
        } else {
            format!(
                "scaler name {} at {} (scalers[{i}]) differs only in case from {} at {} (scalers[{first}]); names must be unique ignoring case",
                quote(name),
                file_line(name_origin),
                quote(first_name),
                file_line(first_origin),
            )
        };
        cx.error(name_origin.clone(), field_path(&s.path, "name"), message);
    }
}

/// Upstream's `detectLabelSetOverlaps`: per normalised label set, the first
/// scaler that owns it; every later label set of another scaler with the same
/// key is one error naming both scalers and where they are defined.
fn overlaps(cx: &mut Cx, scalers: &[ParsedScaler]) {
    let mut owner: HashMap<&LabelSet, usize> = HashMap::new();
    for (i, s) in scalers.iter().enumerate() {
        let Some((name, _)) = &s.name else { continue };
        for ls in &s.label_sets {
            let Some(labels) = &ls.labels else { continue };
            let Some(&first) = owner.get(labels) else {
                owner.insert(labels, i);
                continue;
            };
            let Some((first_name, _)) = &scalers[first].name else {
                continue;
            };
            // Same scaler: allowed (warned). Same name: reported as a duplicate name.
            if first == i || first_name.to_lowercase() == name.to_lowercase() {
                continue;
            }
            cx.error(
                ls.origin.clone(),
                field_path(&ls.path, "labels"),
                format!(
                    "label set [{}] overlaps between scalers {} ({}) and {} ({})",
                    labels.key(),
                    quote(first_name),
                    file_line(&scalers[first].origin),
                    quote(name),
                    file_line(&s.origin),
                ),
            );
        }
    }
}
