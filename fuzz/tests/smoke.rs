//! CI's share of the fuzzing: every target for a fixed number of inputs
//! (a minute or so in all), through the binary as `scripts/fuzz.sh` runs
//! it. Any panic, abort, crash, hang or damaged file read as valid fails
//! the test, with the kept input's path in the output.

use std::process::Command;

/// Inputs per target: a few thousand for the fast readers, fewer for the
/// configs (each is parsed and preflighted, some build 150 decoder layers).
const PLAN: [(&str, u64); 2] = [("config", 1500), ("sweep", 1500)];
const OTHERS: u64 = 4000;

#[test]
fn every_reader_survives_its_mutated_inputs() {
    let exe = env!("CARGO_BIN_EXE_pipebd-fuzz");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let listed = Command::new(exe).arg("--list").output().unwrap();
    let names: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    assert!(names.len() >= 14, "the targets: {names:?}");
    let out = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for name in &names {
        let inputs = PLAN.iter().find(|(n, _)| n == name).map_or(OTHERS, |p| p.1);
        let dir = out.path().join(name);
        // A generous hang limit: the test shares two cores with other tests.
        let run = Command::new(exe)
            .current_dir(&root)
            .args(["--targets", name, "--inputs", &inputs.to_string(), "--check", "--hang-ms", "10000"])
            .arg("--out")
            .arg(&dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        if !run.status.success() {
            failures.push(format!("{name}: {}\n{stderr}", run.status));
            continue;
        }
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
        let tally = &summary[0];
        // Every input ran; the unmutated seed (input 0) is read; mutations
        // reach many distinct refusals, each naming the file (frames have none).
        assert_eq!(tally["inputs"].as_u64(), Some(inputs), "{name}: {tally}");
        assert!(tally["accepted"].as_u64().unwrap() >= 1, "{name}: the valid seed was refused: {tally}");
        assert!(tally["distinct_errors"].as_u64().unwrap() >= 5, "{name}: few distinct errors: {tally}");
        // (A config may be refused for a file it names, e.g. its teacher's.)
        if name != "frames" {
            let named = tally["errors_naming_the_file"].as_u64().unwrap() as f64;
            let refused = tally["refused"].as_u64().unwrap() as f64;
            assert!(
                named >= 0.99 * refused,
                "{name}: refusals that do not name the file: {}",
                tally["unnamed"]
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The `pipebd` binary end to end: random argument vectors with mutated
/// configs and run folders (every exit 0, 1 or 2 with one message, no
/// panic, no crash), and runs stopped at random points by SIGKILL, SIGTERM
/// or SIGINT then resumed to the uninterrupted run's weights.
#[test]
fn the_command_line_survives_random_arguments_and_random_stops() {
    let exe = env!("CARGO_BIN_EXE_pipebd-fuzz");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(exe)
        .current_dir(&root)
        .args(["--cli", "200", "--kills", "4", "--check", "--cli-limit-s", "60"])
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}\n{stderr}", run.status);
    let cli: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("cli.json")).unwrap()).unwrap();
    assert_eq!(cli["inputs"].as_u64(), Some(200), "{cli}");
    // The inputs reach both ends: commands that succeed and refusals.
    for code in ["0", "2"] {
        assert!(cli["exit_codes"][code].as_u64().unwrap_or(0) >= 5, "few exits with {code}: {cli}");
    }
    let kills: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("kills.json")).unwrap()).unwrap();
    assert_eq!(kills["rounds"].as_u64(), Some(4), "{kills}");
    assert!(kills["worst_difference"].as_f64().unwrap() <= 1e-5, "{kills}");
}
