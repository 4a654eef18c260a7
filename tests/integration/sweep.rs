//! `pipebd sweep`: 2 batch sizes x 3 schedules from one command, killed
//! halfway (SIGKILL, a real child process), resumed, and plotted.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common;

/// The whole data lines of `sweep.csv` (a last line still being written,
/// without its newline, is left out).
fn data_rows(csv: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(csv).unwrap_or_default();
    let whole = &text[..text.rfind('\n').map_or(0, |last| last + 1)];
    whole.lines().skip(1).filter(|l| !l.is_empty()).map(String::from).collect()
}

#[test]
fn a_sweep_resumes_after_being_killed_and_draws_its_plot() {
    let dir = tempfile::tempdir().unwrap();
    let base = common::small_config(256, 100, 1).replace("device = \"cpu\"", "devices = [\"cpu\", \"cpu\"]");
    std::fs::write(dir.path().join("base.toml"), base).unwrap();
    let out = dir.path().join("out");
    let sweep = format!(
        "base = \"base.toml\"\nout = \"{}\"\nx = \"train.batch_size\"\n\n[grid]\nschedule = [\"dp\", \"tr-dpu\", \"hybrid\"]\n\"train.batch_size\" = [32, 64]\n",
        out.display()
    );
    // `hybrid` needs stages: one replicated stage over both slots.
    let base_path = dir.path().join("base.toml");
    let mut text = std::fs::read_to_string(&base_path).unwrap();
    text = text.replacen("[data]", "[[stages]]\nblocks = [1, 2, 3, 4]\nreplicas = 2\n\n[data]", 1);
    std::fs::write(&base_path, text).unwrap();
    let sweep_path = dir.path().join("sweep.toml");
    std::fs::write(&sweep_path, sweep).unwrap();
    let csv = out.join("sweep.csv");

    // Start the sweep and kill it once two points are written.
    let mut child = Command::new(common::pipebd_bin())
        .args(["sweep", sweep_path.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while data_rows(&csv).len() < 2 {
        assert!(Instant::now() < deadline, "the sweep wrote no two points in time");
        assert!(child.try_wait().unwrap().is_none(), "the sweep ended before it was killed");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = data_rows(&csv);
    assert!(before.len() >= 2 && before.len() < 6, "killed after {} points", before.len());
    assert!(!out.join("sweep.png").exists(), "no plot before the sweep is complete");

    // Resume: the finished points are kept, the rest run.
    let (code, stdout, stderr) = common::pipebd(&["sweep", sweep_path.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stderr.matches("already done").count(), before.len(), "{stderr}");
    let after = data_rows(&csv);
    assert_eq!(after.len(), 6, "{after:?}");
    assert_eq!(&after[..before.len()], &before[..], "finished points were rewritten");
    let ids: std::collections::HashSet<&str> = after.iter().map(|r| r.split("\",").next().unwrap()).collect();
    assert_eq!(ids.len(), 6, "duplicate points: {after:?}");
    assert!(stdout.contains("schedule=hybrid,train.batch_size=64"), "{stdout}");

    let png = std::fs::read(out.join("sweep.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 10_000, "the plot is suspiciously small: {} bytes", png.len());
}
