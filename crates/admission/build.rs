//! Declares the `loom` cfg (set by `RUSTFLAGS="--cfg loom"` for the model
//! checking run) so that rustc's `unexpected_cfgs` lint knows it.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
}
