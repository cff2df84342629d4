//! `fc-sim`: a Firecracker stand-in (see `kici_testkit::sim`).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(kici_testkit::sim::main_with_args(&args));
}
