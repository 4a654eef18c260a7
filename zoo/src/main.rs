//! The `pipebd` command line: the built-in zoo through `pipe_bd::cli`.

fn main() -> std::process::ExitCode {
    pipebd_zoo::cli()
}
