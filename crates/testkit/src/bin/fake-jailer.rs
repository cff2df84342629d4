//! `fake-jailer`: Firecracker's jailer contract for tests (see `kici_testkit::jailer`).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(kici_testkit::jailer::main_with_args(&args));
}
