//! The `pipebd` command line: the built-in zoo through `pipebd_cli::cli`.

fn main() -> std::process::ExitCode {
    pipebd_zoo::cli()
}
