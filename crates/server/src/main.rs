//! The `kici-scaler` binary: everything lives in the library (`cli`).

fn main() -> std::process::ExitCode {
    kici_scaler::cli::main_with_args(std::env::args_os())
}
