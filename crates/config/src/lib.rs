//! Loads `scalers.yaml` and the `scalers.d/` drop-ins into a validated,
//! immutable [`kici_model::Config`], or reports every error at once.
//!
//! This crate owns the configuration *format*: upstream's schema (field
//! names, defaults, strictness), the configurations upstream accepts and we
//! deliberately reject (duplicate names, memory strings, requests above
//! limits, gateway and netmask, POSIX and reserved env names, ...; see
//! docs/deviations.md, D-strict-config), the cross-scaler rules (label-set
//! overlaps, machine-pool references) and the reload [`diff`].
//!
//! Every finding carries `file:line:col` and a field path. The YAML is parsed
//! (from `saphyr_parser` events) into a node tree of our own that keeps
//! positions, and walked by hand so that a bad value never hides the next
//! one.
//!
//! Anchors, aliases and merge keys (`&x`, `*x`, `<<: *x`) are read as
//! upstream's js-yaml reads them; anchors are per file, and a finding inside
//! an aliased value points at the anchored definition (see the `yaml`
//! module). Core-schema tags (`!!str`, `!!int`, ...) are honoured as js-yaml
//! does; any other tag gets a clear, positioned error. Each file holds
//! exactly one YAML document.
//!
//! It reads only the configuration files: whether an agent binary, an image
//! or a kernel exists is for each backend's `validate`.
//!
//! ```
//! let main = r#"
//! version: 1
//! scalers:
//!   - name: linux
//!     type: container
//!     maxAgents: 4
//!     labelSets:
//!       - labels: [linux, Docker]
//!         image: kici/agent:1
//! "#;
//! let loaded = kici_config::load_documents(&[("scalers.yaml", main)]).unwrap();
//! let scaler = &loaded.config.scalers[0];
//! assert_eq!(scaler.max_agents, 4);
//! assert_eq!(scaler.label_sets[0].labels.key(), "docker,linux");
//! assert_eq!(loaded.config.global_max_agents, 50); // upstream's default
//!
//! // Every finding at once, each with its file, line, column and field path.
//! let bad = "version: 1\nscalers:\n  - name: a\n    type: container\n    maxAgents: -1\n    labelSets: []\n";
//! let errors = kici_config::load_documents(&[("scalers.yaml", bad)]).unwrap_err();
//! let first = errors.iter().next().unwrap().to_string();
//! assert!(first.starts_with("scalers.yaml:5:16: scalers[0].maxAgents: "), "{first}");
//! assert_eq!(errors.iter().count(), 2, "{errors}"); // labelSets: [] is the other
//! ```

mod cross;
mod cx;
mod diagnostic;
mod diff;
mod document;
mod files;
mod label_set;
mod node;
mod resources;
mod scaler;
mod warm;
mod yaml;

pub use diagnostic::{ConfigErrors, Diagnostic};
pub use diff::{diff, FieldChange};

use document::Doc;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A successful load.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: kici_model::Config,
    /// Findings that do not prevent loading (unknown top-level keys, keys a
    /// drop-in may not set, fields of another backend type, ...), sorted like
    /// errors.
    pub warnings: Vec<Diagnostic>,
    /// Every file read: the main file, then the drop-ins in merge order.
    pub files: Vec<PathBuf>,
}

/// Reads `main` and, when given, the drop-ins of `dir` (non-recursive, names
/// ending in `.yaml` or `.yml`, sorted byte-wise; a missing directory is an
/// error). I/O problems are reported as diagnostics like any other.
pub fn load(main: &Path, dir: Option<&Path>) -> Result<Loaded, ConfigErrors> {
    files::load(main, dir)
}

/// Loads documents already in memory: `(file name, text)`, `docs[0]` the main
/// file, the rest drop-ins in merge order. Does no I/O.
pub fn load_documents(docs: &[(&str, &str)]) -> Result<Loaded, ConfigErrors> {
    let owned: Vec<Doc<'_>> = docs
        .iter()
        .map(|(name, text)| Doc {
            name: Arc::from(*name),
            text,
        })
        .collect();
    let files = docs.iter().map(|(name, _)| PathBuf::from(name)).collect();
    document::load(&owned, Vec::new(), Vec::new(), files)
}
