//! The layer rules of ARCHITECTURE.md. The engine (`pipe-bd`, `src/`) and
//! the application (`pipebd-cli`, `cli/`) know no concrete teacher, student
//! or dataset: the built-in ones live in the `pipebd-zoo` crate above them,
//! which cargo enforces once neither depends on their crates (checked on the
//! manifests); the source check below also catches a name written out (a
//! kind or dataset string). They reach the application only through the
//! `Zoo` trait, so a user's zoo gets every door the built-in one has. The
//! engine links no application library (command line, config format,
//! progress bars, plots).

use std::path::{Path, PathBuf};

/// What only the built-in zoo (`zoo/`, crate `pipebd-zoo`) may name.
const ZOO_ONLY: [&str; 8] =
    ["pipebd_teachers", "pipebd_students", "Builtin", "minilm", "MiniLm", "mnist_cnn", "\"brown\"", "Brown"];

/// The dependencies of the crate whose manifest is `dir/Cargo.toml`.
fn dependencies_of(dir: &str) -> toml::Table {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).join("Cargo.toml");
    let manifest: toml::Table = std::fs::read_to_string(&manifest).unwrap().parse().unwrap();
    let dependencies = manifest["dependencies"].as_table().expect("a [dependencies] table").clone();
    assert!(dependencies.contains_key("pipebd-core"), "the dependencies are read: {dependencies:?}");
    dependencies
}

#[test]
fn the_engine_crate_depends_on_no_zoo_crate_and_no_application_library() {
    let engine = dependencies_of(".");
    for zoo_crate in ["pipebd-teachers", "pipebd-students", "pipebd-zoo", "pipebd-cli"] {
        assert!(!engine.contains_key(zoo_crate), "the engine depends on {zoo_crate}");
    }
    // What only the application (`cli/`, crate `pipebd-cli`) links: a library
    // user's build never compiles a command-line parser, a config-file
    // format, progress bars or a plotting library.
    for app_library in ["clap", "indicatif", "plotters", "toml", "anyhow", "signal-hook"] {
        assert!(!engine.contains_key(app_library), "the engine depends on {app_library}");
    }
    let app = dependencies_of("cli");
    assert!(app.contains_key("clap") && app.contains_key("pipe-bd"), "the app crate is read: {app:?}");
    for zoo_crate in ["pipebd-teachers", "pipebd-students", "pipebd-zoo"] {
        assert!(!app.contains_key(zoo_crate), "the app crate depends on {zoo_crate}");
    }
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

/// A file of unit tests of its own (`#[cfg(test)] mod tests;` beside it).
fn is_test_module(file: &Path) -> bool {
    file.file_name().is_some_and(|name| name == "tests.rs")
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
fn the_engine_and_the_app_name_no_teacher_student_or_dataset_of_the_built_in_zoo() {
    for crate_dir in ["src", "cli/src"] {
        names_no_zoo_part(crate_dir);
    }
}

fn names_no_zoo_part(crate_dir: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(crate_dir);
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 20, "the engine's files are found: {files:?}");
    let mut broken = Vec::new();
    for file in files.iter().filter(|f| !is_test_module(f)) {
        let text = std::fs::read_to_string(file).unwrap();
        for place in zoo_names_in(&text) {
            broken.push(format!("{}:{place}", file.strip_prefix(&src).unwrap().display()));
        }
    }
    assert!(broken.is_empty(), "{crate_dir} names the built-in zoo's parts:\n{}", broken.join("\n"));
}

#[test]
fn the_check_sees_a_zoo_name_in_code_and_not_in_comments_or_tests() {
    let text = "use crate::zoo::Builtin;\n// minilm in a comment\nfn f() {} // \"brown\"\n#[cfg(test)]\nmod tests { use pipebd_teachers; }\n";
    assert_eq!(zoo_names_in(text), ["1: Builtin"]);
}

/// The places docs/library.md lists for adding a teacher `name` to the
/// built-in zoo: its model (`teachers/src/<name>.rs`, its blocks in
/// `blocks.rs`, a `mod` line), its zoo module (`zoo/src/<name>.rs`, a
/// `TeacherKind` variant in `builtin.rs`, a `mod` line).
fn documented_places(name: &str) -> Vec<String> {
    let mut places = vec![format!("teachers/src/{name}.rs"), format!("zoo/src/{name}.rs")];
    places.extend(
        ["teachers/src/blocks.rs", "teachers/src/lib.rs", "zoo/src/builtin.rs", "zoo/src/lib.rs"]
            .map(String::from),
    );
    places
}

/// The workspace's library files (not tests) whose code names any of `names`.
fn files_naming(names: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for dir in ["src", "cli/src", "core/src", "kernels/src", "teachers/src", "students/src", "zoo/src"] {
        let mut files = Vec::new();
        rust_files(&root.join(dir), &mut files);
        for file in files.iter().filter(|f| !is_test_module(f)) {
            let text = std::fs::read_to_string(file).unwrap();
            if code_of(&text).iter().any(|(_, line)| names.iter().any(|name| line.contains(name))) {
                found.push(file.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    found.sort();
    found
}

/// Adding a teacher touches the places docs/library.md lists, and no
/// teacher spreads further without saying why: the MNIST CNN, which shares
/// no data or evaluation module, is named in exactly those places; MiniLM
/// and SmolLM2 also where their layer sizes are owned and read, and in
/// their data, evaluation and export modules.
#[test]
fn each_built_in_teacher_is_named_only_where_adding_a_teacher_touches() {
    let extras: [(&str, &[&str], &[&str]); 3] = [
        ("mnist_cnn", &["mnist_cnn", "MnistCnn", "mnist-cnn", "MNIST_CNN"], &[]),
        (
            "minilm",
            &["minilm", "MiniLm", "MINILM"],
            // Its layer sizes (owned by the kernels, the students' defaults)
            // and its data and evaluation module.
            &["kernels/src/encoder.rs", "students/src/config.rs", "zoo/src/text.rs"],
        ),
        (
            "smollm2",
            &["smollm2", "SmolLm2", "SMOLLM2"],
            // Its layer sizes, its data, evaluation, export and fuzzing.
            &[
                "kernels/src/decoder.rs",
                "students/src/config.rs",
                "teachers/src/export.rs",
                "zoo/src/export.rs",
                "zoo/src/fuzzing.rs",
                "zoo/src/lm.rs",
                "zoo/src/text.rs",
            ],
        ),
    ];
    for (name, names, extra) in extras {
        let mut allowed = documented_places(name);
        allowed.extend(extra.iter().map(|e| e.to_string()));
        let found = files_naming(names);
        assert!(found.contains(&format!("zoo/src/{name}.rs")), "{name}: the check finds nothing: {found:?}");
        let beyond: Vec<&String> = found.iter().filter(|f| !allowed.contains(f)).collect();
        assert!(beyond.is_empty(), "{name} is named beyond the places that add a teacher: {beyond:?}");
    }
    // The smallest teacher is named in all six places and only there.
    assert_eq!(files_naming(&["mnist_cnn", "MnistCnn", "mnist-cnn", "MNIST_CNN"]).len(), 6);
}

/// The most lines a function may have (ARCHITECTURE.md: "no function over
/// 100 lines", tests included).
const MAX_FUNCTION_LINES: usize = 100;

/// A line with its string and character literals emptied and its comment
/// cut, so that only the code's own braces remain.
fn braces_of(line: &str) -> String {
    let mut code = String::new();
    let mut chars = line.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        match (in_string, c) {
            (true, '\\') => {
                chars.next();
            }
            (true, '"') => in_string = false,
            (true, _) => {}
            (false, '"') => in_string = true,
            (false, '/') if chars.peek() == Some(&'/') => break,
            // A brace as a character literal ('{'): not a block.
            (false, '\'') if matches!(chars.peek(), Some('{' | '}')) => {
                chars.next();
            }
            (false, '{' | '}') => code.push(c),
            _ => {}
        }
    }
    code
}

/// Each function of `text` longer than `limit` lines, as `line: name (N lines)`.
fn long_functions(text: &str, limit: usize) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(at) = words.iter().position(|w| *w == "fn") else { continue };
        let name = words.get(at + 1).map_or("", |w| w.split(['(', '<']).next().unwrap_or(""));
        if words[..at].iter().any(|w| w.starts_with("//")) || name.is_empty() {
            continue;
        }
        let mut depth = 0i64;
        let mut opened = false;
        for (end, body) in lines.iter().enumerate().skip(start) {
            for brace in braces_of(body).chars() {
                depth += if brace == '{' { 1 } else { -1 };
                opened = true;
            }
            // A declaration without a body (a trait's) ends at its `;`.
            if !opened && body.trim_end().ends_with(';') {
                break;
            }
            if opened && depth <= 0 {
                let length = end - start + 1;
                if length > limit {
                    found.push(format!("{}: {name} ({length} lines)", start + 1));
                }
                break;
            }
        }
    }
    found
}

#[test]
fn no_function_is_longer_than_a_hundred_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in [
        "src", "cli", "zoo", "core", "kernels", "teachers", "students", "fuzz", "tests", "examples",
        "benches",
    ] {
        if root.join(dir).is_dir() {
            rust_files(&root.join(dir), &mut files);
        }
    }
    assert!(files.len() > 100, "the workspace's files are found: {}", files.len());
    let mut long = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for place in long_functions(&text, MAX_FUNCTION_LINES) {
            long.push(format!("{}:{place}", file.strip_prefix(root).unwrap().display()));
        }
    }
    assert!(long.is_empty(), "functions over {MAX_FUNCTION_LINES} lines:\n{}", long.join("\n"));
}

/// The most lines a file may have before its unit tests (ARCHITECTURE.md:
/// one concept per file); the integration tests are not counted.
const MAX_FILE_LINES: usize = 800;

#[test]
fn no_file_is_longer_than_eight_hundred_lines_before_its_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "cli", "zoo", "core", "kernels", "teachers", "students", "fuzz", "examples", "benches"]
    {
        if root.join(dir).is_dir() {
            rust_files(&root.join(dir), &mut files);
        }
    }
    assert!(files.len() > 100, "the workspace's files are found: {}", files.len());
    let long: Vec<String> = files
        .iter()
        .filter(|f| !is_test_module(f))
        .filter_map(|file| {
            let text = std::fs::read_to_string(file).unwrap();
            let lines = code_of(&text).len();
            (lines > MAX_FILE_LINES)
                .then(|| format!("{}: {lines} lines", file.strip_prefix(root).unwrap().display()))
        })
        .collect();
    assert!(long.is_empty(), "files over {MAX_FILE_LINES} lines before their tests:\n{}", long.join("\n"));
}

#[test]
fn the_length_check_counts_a_function_by_its_braces() {
    let text = "fn short() {\n    let s = \"}\";\n    let c = '{';\n}\n\npub(crate) fn long<T>(x: T) {\n    if true {\n        // }\n    }\n}\n";
    assert_eq!(long_functions(text, 4), ["6: long (5 lines)"], "strings, chars and comments hold no braces");
    assert!(long_functions(text, 5).is_empty());
    assert_eq!(braces_of("let s = \"a\\\"{\"; { // }"), "{");
    // A file's length stops at its unit tests.
    assert_eq!(code_of("fn a() {}\n\n#[cfg(test)]\nmod tests {}\n").len(), 2);
}
