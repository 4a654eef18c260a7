//! Which of two ways to run an op is faster, per device and shape: timed at
//! the op's first call with those shapes, remembered for the process and,
//! once [`keep_in`] names a folder, in a file there (`tuning.tsv`: one
//! `key<TAB>choice` line each), so that a later start on the same machine
//! skips the timing.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The choices known so far, and the file they are kept in.
#[derive(Default)]
struct Tuning {
    choices: HashMap<String, String>,
    file: Option<PathBuf>,
}

fn tuning() -> &'static Mutex<Tuning> {
    static TUNING: OnceLock<Mutex<Tuning>> = OnceLock::new();
    TUNING.get_or_init(Default::default)
}

/// Keeps the choices in `dir/tuning.tsv` from now on, starting with those
/// already there.
pub(crate) fn keep_in(dir: &std::path::Path) {
    let file = dir.join("tuning.tsv");
    let mut tuning = tuning().lock().unwrap_or_else(|p| p.into_inner());
    if let Ok(text) = std::fs::read_to_string(&file) {
        for line in text.lines() {
            if let Some((key, choice)) = line.split_once('\t') {
                tuning.choices.entry(key.to_string()).or_insert_with(|| choice.to_string());
            }
        }
    }
    tuning.file = Some(file);
}

/// Minimum of three timed runs of `run` after one warm-up (`run` waits for
/// the device itself).
fn best_of_three(run: &dyn Fn()) -> Duration {
    run();
    (0..3)
        .map(|_| {
            let start = Instant::now();
            run();
            start.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// The name of the faster of `candidates` (name, a run that waits for the
/// device) for `key`: remembered, or timed now and remembered. Ties go to
/// the first.
pub(crate) fn faster(key: String, candidates: [(&'static str, &dyn Fn()); 2]) -> &'static str {
    let key = key.replace(['\t', '\n'], " ");
    let known = tuning().lock().unwrap_or_else(|p| p.into_inner()).choices.get(&key).cloned();
    if let Some(choice) = known.and_then(|c| candidates.iter().find(|(name, _)| *name == c)) {
        return choice.0;
    }
    let [(first, run_first), (second, run_second)] = candidates;
    let choice = if best_of_three(run_first) <= best_of_three(run_second) { first } else { second };
    let mut tuning = tuning().lock().unwrap_or_else(|p| p.into_inner());
    tuning.choices.insert(key.clone(), choice.to_string());
    if let Some(file) = &tuning.file {
        // Best effort: an unwritable cache only costs the next start a timing.
        let line = format!("{key}\t{choice}\n");
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(file) {
            let _ = f.write_all(line.as_bytes());
        }
    }
    choice
}
