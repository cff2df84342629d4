//! Where a configuration value was written: `file:line:col`.

use std::fmt;
use std::sync::Arc;

/// A position in a configuration file. Lines and columns are 1-based, as
/// editors show them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Origin {
    pub file: Arc<str>,
    pub line: u32,
    pub col: u32,
}

impl Origin {
    pub fn new(file: impl Into<Arc<str>>, line: u32, col: u32) -> Self {
        Self {
            file: file.into(),
            line,
            col,
        }
    }

    /// An origin for values built in code (tests, defaults).
    pub fn synthetic() -> Self {
        Self::new("<built-in>", 0, 0)
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.col)
    }
}
