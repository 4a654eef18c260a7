//! The `pipebd` binary is the engine's command line over the built-in zoo:
//! its checks are the zoo's (a dataset it does not know is refused with the
//! file and field named). The engine's own tests (`tests/` at the top) drive
//! the same binary for the multi-process and interruption tests.

use std::process::Command;

fn pipebd(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pipebd")).args(args).output().expect("pipebd runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn check_refuses_a_dataset_the_built_in_zoo_does_not_know() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cifar.toml");
    let quickstart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments/mnist-cnn.toml");
    let text = std::fs::read_to_string(quickstart).unwrap();
    assert!(text.contains("dataset = \"mnist\""), "the quickstart config names its dataset");
    std::fs::write(&config, text.replace("dataset = \"mnist\"", "dataset = \"cifar10\"")).unwrap();
    let (code, text) = pipebd(&["check", config.to_str().unwrap()]);
    assert_eq!(code, 2, "a config error is the user's: {text}");
    assert!(text.contains("cifar.toml") && text.contains("data.dataset"), "names the file and field: {text}");
    assert!(text.contains("`mnist` or `brown`"), "says what the built-in zoo takes: {text}");
}

#[test]
fn the_binary_lists_the_engines_commands() {
    let (code, text) = pipebd(&["--help"]);
    assert_eq!(code, 0, "{text}");
    for command in ["run", "bench", "profile", "plan", "sweep", "search", "eval", "check", "kernels"] {
        assert!(text.contains(command), "`pipebd --help` lists `{command}`: {text}");
    }
}
