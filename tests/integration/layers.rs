//! The layer rule of ARCHITECTURE.md, checked on the source: the engine
//! (every module of `src/` but the zoo, the command line and the crate's
//! face) knows no concrete teacher, student or dataset of the built-in zoo.
//! They reach it only through the `Zoo` trait, so a user's zoo gets every
//! door the built-in one has.

use std::path::{Path, PathBuf};

/// What only the built-in zoo (`src/zoo/`) and the command line may name.
const ZOO_ONLY: [&str; 8] =
    ["pipebd_teachers", "pipebd_students", "Builtin", "minilm", "MiniLm", "mnist_cnn", "\"brown\"", "Brown"];

/// Files of `src/` outside the engine.
fn outside_the_engine(relative: &Path) -> bool {
    relative.starts_with("zoo")
        || relative.starts_with("cli")
        || relative == Path::new("lib.rs")
        || relative == Path::new("main.rs")
}

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// The code of a file: its lines up to its unit tests, without comments.
fn code_of(text: &str) -> Vec<(usize, &str)> {
    text.lines()
        .enumerate()
        .take_while(|(_, line)| line.trim() != "#[cfg(test)]")
        .map(|(i, line)| (i + 1, line.split("//").next().unwrap_or("")))
        .collect()
}

/// Each use of a zoo-only name in `text`, as `line: name`.
fn zoo_names_in(text: &str) -> Vec<String> {
    code_of(text)
        .into_iter()
        .flat_map(|(n, line)| {
            ZOO_ONLY.iter().filter(move |name| line.contains(*name)).map(move |name| format!("{n}: {name}"))
        })
        .collect()
}

#[test]
fn the_engine_names_no_teacher_student_or_dataset_of_the_built_in_zoo() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let engine: Vec<&PathBuf> =
        files.iter().filter(|f| !outside_the_engine(f.strip_prefix(&src).unwrap())).collect();
    assert!(engine.len() > 30, "the engine's files are found: {engine:?}");
    let mut broken = Vec::new();
    for file in engine {
        let text = std::fs::read_to_string(file).unwrap();
        for place in zoo_names_in(&text) {
            broken.push(format!("{}:{place}", file.strip_prefix(&src).unwrap().display()));
        }
    }
    assert!(broken.is_empty(), "the engine names the built-in zoo's parts:\n{}", broken.join("\n"));
}

/// Layers 1-5 of ARCHITECTURE.md: they take settings structs, never a
/// config file's text or tables.
fn below_the_job_layer(relative: &Path) -> bool {
    ["data", "train", "planning", "search", "runtime"].iter().any(|dir| relative.starts_with(dir))
        || ["error.rs", "fsio.rs", "device.rs", "fault.rs", "trace.rs", "rng.rs"]
            .iter()
            .any(|f| relative == Path::new(f))
}

#[test]
fn the_layers_below_the_jobs_never_read_toml() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let below: Vec<&PathBuf> =
        files.iter().filter(|f| below_the_job_layer(f.strip_prefix(&src).unwrap())).collect();
    assert!(below.len() > 25, "the lower layers' files are found: {below:?}");
    let mut broken = Vec::new();
    for file in below {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in code_of(&text) {
            if line.contains("toml") {
                broken.push(format!("{}:{n}: {}", file.strip_prefix(&src).unwrap().display(), line.trim()));
            }
        }
    }
    assert!(broken.is_empty(), "below the job layer, code reads TOML:\n{}", broken.join("\n"));
}

#[test]
fn the_check_sees_a_zoo_name_in_code_and_not_in_comments_or_tests() {
    let text = "use crate::zoo::Builtin;\n// minilm in a comment\nfn f() {} // \"brown\"\n#[cfg(test)]\nmod tests { use pipebd_teachers; }\n";
    assert_eq!(zoo_names_in(text), ["1: Builtin"]);
    assert!(outside_the_engine(Path::new("zoo/builtin.rs")));
    assert!(!outside_the_engine(Path::new("runtime/worker.rs")));
    assert!(below_the_job_layer(Path::new("runtime/worker.rs")) && below_the_job_layer(Path::new("rng.rs")));
    assert!(!below_the_job_layer(Path::new("jobs/run.rs")) && !below_the_job_layer(Path::new("config.rs")));
}
