//! Your own teacher cut and student kinds behind the whole `pipebd` command
//! line: TOML configs, `run`, `check`, `bench`, `profile`, `sweep`, `eval`,
//! checkpoints and `--resume`, all for blocks pipe-bd has never heard of.
//!
//! The zoo here (`MyZoo`) serves:
//! - a teacher of its own cut: the pretrained MNIST CNN's four blocks
//!   grouped as `[custom] cut = [2, 2]` says (two blocks of two here), as a
//!   block type of its own (`Group`);
//! - student kinds of its own (`[[students]] kind = "strided"` or `"mlp"`),
//!   parsed from the config's student tables;
//! - the MNIST images as its data set, scored by top-1 accuracy.
//!
//! ```sh
//! bash scripts/setup-data.sh     # once: MNIST and the teacher into data/
//! cargo run --release --example custom_zoo -- run examples/custom-zoo.toml --out runs/custom-zoo
//! cargo run --release --example custom_zoo -- eval runs/custom-zoo
//! ```

mod zoo;

fn main() -> std::process::ExitCode {
    pipebd_cli::cli::run_with(zoo::MyZoo)
}
