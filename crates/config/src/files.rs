//! Reading `scalers.yaml` and the `scalers.d/` drop-ins from disk. Every I/O
//! problem becomes a [`Diagnostic`] like any other finding.

use crate::diagnostic::{ConfigErrors, Diagnostic};
use crate::document::{self, Doc};
use crate::yaml::MAX_FILE_BYTES;
use crate::Loaded;
use kici_model::Origin;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn display(p: &Path) -> Arc<str> {
    Arc::from(p.display().to_string())
}

fn file_error(name: &Arc<str>, message: String) -> Diagnostic {
    Diagnostic::new(Origin::new(name.clone(), 0, 0), "", message)
}

/// Reads one file as UTF-8, or says why not (with the position of the first
/// invalid byte).
fn read(path: &Path, name: &Arc<str>) -> Result<String, Diagnostic> {
    let meta =
        std::fs::metadata(path).map_err(|e| file_error(name, format!("cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(file_error(name, "cannot read: not a regular file".into()));
    }
    if meta.len() > MAX_FILE_BYTES as u64 {
        return Err(file_error(
            name,
            format!(
                "file is {} bytes, more than the {MAX_FILE_BYTES} accepted",
                meta.len()
            ),
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| file_error(name, format!("cannot read: {e}")))?;
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line = valid.iter().filter(|&&b| b == b'\n').count() + 1;
        let col = valid.iter().rev().take_while(|&&b| b != b'\n').count() + 1;
        Diagnostic::new(
            Origin::new(
                name.clone(),
                u32::try_from(line).unwrap_or(u32::MAX),
                u32::try_from(col).unwrap_or(u32::MAX),
            ),
            "",
            "the file is not valid UTF-8",
        )
    })
}

/// The drop-ins of `dir`: regular files whose names end exactly in `.yaml`
/// or `.yml` (dotfiles included), sorted byte-wise by name. Not recursive.
pub(crate) fn drop_ins(dir: &Path) -> Result<(Vec<PathBuf>, Vec<Diagnostic>), Diagnostic> {
    let name = display(dir);
    let entries = std::fs::read_dir(dir)
        .map_err(|e| file_error(&name, format!("cannot read the drop-in directory: {e}")))?;
    let mut found = Vec::new();
    let mut warnings = Vec::new();
    for entry in entries {
        let entry = entry
            .map_err(|e| file_error(&name, format!("cannot read the drop-in directory: {e}")))?;
        let file_name = entry.file_name();
        let bytes = file_name.as_encoded_bytes();
        if !(bytes.ends_with(b".yaml") || bytes.ends_with(b".yml")) {
            continue;
        }
        let path = entry.path();
        // Follows symlinks: a link to a file is a drop-in.
        if std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
            warnings.push(file_error(
                &display(&path),
                "is a directory, not a drop-in file: ignored (drop-ins are not read recursively)"
                    .into(),
            ));
            continue;
        }
        found.push((bytes.to_vec(), path));
    }
    found.sort();
    Ok((found.into_iter().map(|(_, p)| p).collect(), warnings))
}

pub(crate) fn load(main: &Path, dir: Option<&Path>) -> Result<Loaded, ConfigErrors> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let mut paths = vec![main.to_path_buf()];
    if let Some(dir) = dir {
        match drop_ins(dir) {
            Ok((files, w)) => {
                paths.extend(files);
                warnings.extend(w);
            }
            Err(e) => errors.push(e),
        }
    }
    let names: Vec<Arc<str>> = paths.iter().map(|p| display(p)).collect();
    let mut texts = Vec::with_capacity(paths.len());
    for (path, name) in paths.iter().zip(&names) {
        match read(path, name) {
            Ok(t) => texts.push(Some(t)),
            Err(d) => {
                errors.push(d);
                texts.push(None);
            }
        }
    }
    if texts.first().is_none_or(Option::is_none) {
        // Without the main file there is nothing to validate against.
        return Err(ConfigErrors(errors));
    }
    // An unreadable drop-in is still listed (as empty) so positions and the
    // file order stay right; its read error already fails the load.
    let docs: Vec<Doc<'_>> = names
        .iter()
        .zip(&texts)
        .map(|(name, t)| Doc {
            name: name.clone(),
            text: t.as_deref().unwrap_or(""),
        })
        .collect();
    document::load(&docs, errors, warnings, paths)
}
