//! `kici-scaler generate completions|man DIR` (hidden): shell completions
//! (bash, zsh, fish) and man pages (one per command) written from the
//! clap definition of this very binary.
//!
//! A subcommand rather than a build script: the definition lives in this
//! library ([`crate::cli::Cli`]), which a build script of the same crate
//! cannot link, so a build step would need a copy of it — and copies drift.
//! `scripts/package.sh` runs the freshly built binary to produce the files
//! the Debian package ships; what they describe is exactly what that binary
//! parses.

use crate::cli::{CliError, Outcome};
use clap::{Args, CommandFactory, Subcommand};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(subcommand)]
    pub what: Generate,
}

#[derive(Debug, Subcommand)]
pub enum Generate {
    /// kici-scaler.bash, _kici-scaler (zsh) and kici-scaler.fish in DIR.
    Completions {
        /// Where to write them (created if missing).
        dir: PathBuf,
    },
    // Also the --help text, where <…> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
    /// kici-scaler.1 and kici-scaler-<command>.1 for every visible command,
    /// in DIR.
    Man {
        /// Where to write them (created if missing).
        dir: PathBuf,
    },
}

const BIN: &str = "kici-scaler";

/// Runs `generate`, listing every file written on `out`.
pub fn generate(args: &GenerateArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let written = match &args.what {
        Generate::Completions { dir } => completions(dir)?,
        Generate::Man { dir } => man_pages(dir)?,
    };
    for path in written {
        writeln!(out, "{}", path.display())?;
    }
    Ok(Outcome::Ok)
}

/// The completions of every shell the package supports.
pub fn completions(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    use clap_complete::Shell;
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let mut cmd = crate::cli::Cli::command();
        written.push(clap_complete::generate_to(shell, &mut cmd, BIN, dir)?);
    }
    Ok(written)
}

/// One man page for the binary and one per visible subcommand (nested ones
/// as `kici-scaler-firecracker-provision.1`), named by clap's display names.
pub fn man_pages(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    clap_mangen::generate_to(crate::cli::Cli::command(), dir)?;
    let mut written: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "1"))
        .collect();
    written.sort();
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_and_man_pages_cover_the_visible_commands() {
        let dir = tempfile::tempdir().unwrap();
        let files = completions(dir.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["kici-scaler.bash", "_kici-scaler", "kici-scaler.fish"]
        );
        let bash = std::fs::read_to_string(dir.path().join("kici-scaler.bash")).unwrap();
        assert!(bash.contains("doctor") && bash.contains("--cgroup-root"));

        let pages = man_pages(&dir.path().join("man")).unwrap();
        let man = |name: &str| dir.path().join("man").join(name);
        assert!(pages.contains(&man("kici-scaler.1")));
        assert!(pages.contains(&man("kici-scaler-serve.1")));
        assert!(pages.contains(&man("kici-scaler-firecracker-provision.1")));
        assert!(!pages.contains(&man("kici-scaler-generate.1")));
        let serve = std::fs::read_to_string(man("kici-scaler-serve.1")).unwrap();
        assert!(serve.contains("kici\\-scaler\\-serve"), "{serve}");
    }
}
