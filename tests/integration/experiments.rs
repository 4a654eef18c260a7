//! Every shipped config passes what `pipebd check` checks: run configs
//! parse and preflight (fields, student shapes against the teacher, devices,
//! schedule), and every point of a sweep file builds a valid run config.

use std::path::{Path, PathBuf};

use pipebd_cli::jobs::check::preflight;
use pipebd_cli::jobs::sweep::{apply, expand, SweepConfig};
use pipebd_cli::zoo::Zoo;
use pipebd_zoo::Builtin;

fn experiments() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_experiment_config_passes_check() {
    let files = experiments();
    assert!(files.len() >= 5, "expected the shipped configs, found {files:?}");
    let mut sweeps = 0;
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let table: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if table.contains_key("grid") {
            sweeps += 1;
            let sweep: SweepConfig =
                toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let base_path = path.parent().unwrap().join(&sweep.base);
            let base: toml::Table = toml::from_str(&std::fs::read_to_string(&base_path).unwrap()).unwrap();
            for point in expand(&sweep.grid) {
                let config = apply(&Builtin, &base, &point, &base_path).unwrap_or_else(|e| panic!("{e}"));
                preflight(&Builtin, &config)
                    .unwrap_or_else(|e| panic!("{} [{}]: {e}", path.display(), point.id()));
            }
        } else {
            let config = Builtin.load_config(path, Default::default()).unwrap_or_else(|e| panic!("{e}"));
            preflight(&Builtin, &config).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
    assert!(sweeps >= 1, "the sweep example was not recognised");
}
