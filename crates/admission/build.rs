//! Declares the `loom` cfg (set by `RUSTFLAGS="--cfg loom"` for the model
//! checking run) so that rustc's `unexpected_cfgs` lint knows it.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
    // Without this cargo reruns the script, and so recompiles the crate and
    // everything above it, whenever any file of the package changes (a test
    // too); its output depends on nothing but this file.
    println!("cargo::rerun-if-changed=build.rs");
}
