//! Loading from disk: drop-in selection and order, and I/O problems reported
//! as diagnostics.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use std::path::Path;

fn write(p: &Path, text: &str) {
    std::fs::write(p, text).unwrap();
}

fn drop_in(name: &str) -> String {
    format!("scalers:\n{}", container(name, name))
}

#[test]
fn drop_ins_sorted_bytewise_dotfiles_included_others_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("scalers.yaml");
    let d = dir.path().join("scalers.d");
    std::fs::create_dir(&d).unwrap();
    write(&main, &with_scalers(&container("main", "main")));
    write(&d.join("b.yaml"), &drop_in("b"));
    write(&d.join("B.yml"), &drop_in("upper-b"));
    write(&d.join("10.yaml"), &drop_in("ten"));
    write(&d.join("9.yaml"), &drop_in("nine"));
    write(&d.join(".hidden.yaml"), &drop_in("hidden"));
    write(&d.join("notes.txt"), "scalers: [");
    write(&d.join("x.yaml~"), "scalers: [");
    write(&d.join("y.json"), "{}");
    std::fs::create_dir(d.join("sub.yaml")).unwrap();
    std::fs::create_dir(d.join("nested")).unwrap();
    write(&d.join("nested/n.yaml"), &drop_in("nested"));

    let l = kici_config::load(&main, Some(&d)).unwrap();
    let names: Vec<&str> = l.config.scalers.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["main", "hidden", "ten", "nine", "upper-b", "b"]);
    assert_eq!(l.files.len(), 6);
    assert_eq!(l.files[1], d.join(".hidden.yaml"));
    let w: Vec<String> = warning_lines(&l);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].ends_with("sub.yaml: is a directory, not a drop-in file: ignored (drop-ins are not read recursively)"), "{w:?}");
}

#[test]
fn missing_drop_in_dir_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("scalers.yaml");
    write(&main, &with_scalers(&container("c", "a")));
    let missing = dir.path().join("scalers.d");
    let e = kici_config::load(&main, Some(&missing)).unwrap_err();
    assert_eq!(e.len(), 1);
    let line = e.to_string();
    assert!(
        line.starts_with(&format!(
            "{}: cannot read the drop-in directory: ",
            missing.display()
        )),
        "{line}"
    );
    // An empty directory is fine.
    std::fs::create_dir(&missing).unwrap();
    assert_eq!(
        kici_config::load(&main, Some(&missing)).unwrap().files,
        [main]
    );
}

#[test]
fn missing_or_unreadable_main_file() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("nope.yaml");
    let e = kici_config::load(&main, None).unwrap_err();
    let line = e.to_string();
    assert!(
        line.starts_with(&format!("{}: cannot read: ", main.display())),
        "{line}"
    );
    let e = kici_config::load(dir.path(), None).unwrap_err();
    assert!(
        e.to_string().ends_with("cannot read: not a regular file"),
        "{e}"
    );
}

#[test]
fn empty_main_file_with_drop_ins_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("scalers.yaml");
    let d = dir.path().join("scalers.d");
    std::fs::create_dir(&d).unwrap();
    write(&main, "");
    write(&d.join("a.yaml"), &drop_in("a"));
    let e = kici_config::load(&main, Some(&d)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:1:1: the file is empty: expected a mapping with at least `version: 1` and `scalers`",
            main.display()
        )
    );
}

#[test]
fn invalid_utf8_is_reported_with_its_position() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("scalers.yaml");
    let mut bytes = b"version: 1\nscalers:\n  - name: \"".to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(b"\"\n");
    std::fs::write(&main, bytes).unwrap();
    let e = kici_config::load(&main, None).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{}:3:12: the file is not valid UTF-8", main.display())
    );
}

#[test]
fn errors_in_a_drop_in_name_the_drop_in() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("scalers.yaml");
    let d = dir.path().join("scalers.d");
    std::fs::create_dir(&d).unwrap();
    write(&main, &with_scalers(&container("a", "a")));
    write(&d.join("01.yaml"), "scalers:\n  - name: b\n    type: container\n    maxAgents: x\n    labelSets: [{labels: [b], image: i}]\n");
    let e = kici_config::load(&main, Some(&d)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:4:16: scalers[1].maxAgents: expected an integer > 0, got \"x\"",
            d.join("01.yaml").display()
        )
    );
}

#[test]
fn utf8_bom_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("scalers.yaml");
    write(
        &main,
        &format!("\u{feff}{}", with_scalers(&container("c", "a"))),
    );
    assert_eq!(
        kici_config::load(&main, None).unwrap().config.scalers.len(),
        1
    );
}
