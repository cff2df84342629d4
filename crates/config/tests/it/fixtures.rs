//! Every file under tests/fixtures/valid loads; every file under
//! tests/fixtures/invalid fails with positioned errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

fn fixtures(kind: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(kind);
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    assert!(!v.is_empty());
    v
}

#[test]
fn valid_fixtures_load() {
    for path in fixtures("valid") {
        match kici_config::load(&path, None) {
            Ok(l) => {
                for w in &l.warnings {
                    println!("{w}");
                }
            }
            Err(e) => panic!("{}:\n{e}", path.display()),
        }
    }
}

#[test]
fn invalid_fixtures_fail_with_positions() {
    for path in fixtures("invalid") {
        let err = kici_config::load(&path, None).expect_err(&path.display().to_string());
        println!("--- {}\n{err}", path.display());
        for d in err.iter() {
            assert_eq!(d.origin.file.as_ref(), path.display().to_string());
            assert!(d.origin.line > 0, "{d}");
        }
    }
}

#[test]
fn the_repository_examples_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    for (main, dir) in [
        ("scalers.yaml", Some("scalers.d")),
        ("quickstart.yaml", None),
    ] {
        let dir = dir.map(|d| root.join(d));
        match kici_config::load(&root.join(main), dir.as_deref()) {
            Ok(l) => {
                for w in &l.warnings {
                    println!("{w}");
                }
            }
            Err(e) => panic!("examples/{main}:\n{e}"),
        }
    }
}
