//! `pipebd run` draws `losses.png` and, with `--trace`, `timeline.png`; the
//! pictures are PNGs of their stated size, and what they plot comes from the
//! run's own files: the loss curves are `metrics.csv`'s rows, the timeline's
//! rows and span kinds are the workers and spans of `trace.json`. The log
//! progress line gives the rate and the time left. `pipebd plot` draws them
//! again from the folder alone.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use pipe_bd::trace::worker_name;
use pipebd_cli::jobs::plot::losses::{LossCurves, LOSSES_SIZE};
use pipebd_cli::jobs::plot::timeline::{timeline_height, Timeline, TimelineGroup, TIMELINE_WIDTH};
use pipebd_cli::metrics::read_metrics;
use pipebd_cli::report::RunReport;
use pipebd_core::LossKind;

use crate::common;

/// Width and height of a PNG file, from its IHDR chunk.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{} is a PNG", path.display());
    assert_eq!(&bytes[12..16], b"IHDR");
    let word = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    (word(16), word(20))
}

/// The rows of `metrics.csv` read here, apart from the library's reader:
/// block -> [(step, loss)].
fn metrics_by_block(path: &Path) -> BTreeMap<usize, Vec<(usize, f32)>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut by_block: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let (step, block, loss) =
            (fields[1].parse().unwrap(), fields[2].parse().unwrap(), fields[3].parse().unwrap());
        by_block.entry(block).or_default().push((step, loss));
    }
    by_block
}

/// The thread names and the span kinds per thread of `trace.json`.
fn trace_rows(path: &Path) -> BTreeMap<u64, (String, BTreeSet<String>)> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut rows: BTreeMap<u64, (String, BTreeSet<String>)> = BTreeMap::new();
    for event in json["traceEvents"].as_array().unwrap() {
        let row = rows.entry(event["tid"].as_u64().unwrap()).or_default();
        match event["ph"].as_str().unwrap() {
            "M" => row.0 = event["args"]["name"].as_str().unwrap().to_string(),
            _ => {
                row.1.insert(event["cat"].as_str().unwrap().to_string());
            }
        }
    }
    rows
}

#[test]
fn a_traced_two_stage_run_draws_its_losses_and_its_timeline_from_its_files() {
    let dir = tempfile::tempdir().unwrap();
    // Two blockwise epochs of 5 steps, then a stitched epoch.
    let text =
        common::small_config(64 * 5, 100, 2).replace("log_every = 1", "log_every = 1\nstitched_epochs = 1");
    let config = dir.path().join("pictures.toml");
    std::fs::write(&config, text).unwrap();
    let out = dir.path().join("run");
    let (code, stdout, stderr) = common::pipebd(&[
        "run",
        config.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--schedule",
        "tr",
        "--devices",
        "cpu,cpu",
        "--trace",
    ]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("losses.png") && stdout.contains("timeline.png"), "{stdout}");
    // stderr is not a terminal here: the last progress line is printed, with
    // the rate and the time left.
    let last = stderr.lines().rfind(|l| l.starts_with("progress:")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(last.contains(" samples/s, ") && last.contains("0s left"), "{last}");
    let report = RunReport::read(&out).unwrap();

    // losses.png: the curves are metrics.csv's rows, block by block.
    assert_eq!(png_size(&out.join("losses.png")), LOSSES_SIZE);
    let rows = read_metrics(&out.join("metrics.csv")).unwrap();
    let kinds: Vec<Option<LossKind>> = report.blocks.iter().map(|b| b.loss).collect();
    assert_eq!(kinds.last(), Some(&Some(LossKind::SoftTargetCrossEntropy)), "the head's loss is reported");
    let curves = LossCurves::from_rows(&rows, &kinds, Some(report.steps));
    let expected = metrics_by_block(&out.join("metrics.csv"));
    assert_eq!(curves.blocks.len(), expected.len());
    for curve in &curves.blocks {
        assert_eq!(curve.losses, expected[&curve.block], "block {}", curve.block);
    }
    assert_eq!(report.steps, 10);
    assert_eq!(curves.stitched_from, Some(report.steps), "the stitched rows follow the blockwise steps");
    assert_eq!(curves.epoch_starts, vec![5], "one boundary between the two blockwise epochs");
    assert!(curves.blocks.iter().all(|c| c.losses.last().unwrap().0 > report.steps), "stitched rows drawn");

    // timeline.png: a row per worker of trace.json, with its span kinds.
    let timeline = Timeline::read(&out.join("trace.json")).unwrap();
    let traced = trace_rows(&out.join("trace.json"));
    assert_eq!(timeline.rows.len(), 2, "two stages on two slots");
    assert_eq!(timeline.rows.len(), traced.len());
    for (row, (tid, (name, kinds))) in timeline.rows.iter().zip(&traced) {
        assert_eq!((row.worker as u64, &row.name), (*tid, name));
        let drawn: BTreeSet<String> = row.spans.iter().map(|s| s.kind.name().to_string()).collect();
        assert_eq!(&drawn, kinds, "worker {tid}");
    }
    let names: Vec<String> = report.workers.iter().map(worker_name).collect();
    assert_eq!(timeline.rows.iter().map(|r| r.name.clone()).collect::<Vec<_>>(), names);
    assert!(traced[&1].1.contains("recv_wait"), "the second stage waits for the first: {:?}", traced[&1]);
    let group = TimelineGroup { title: String::new(), timeline };
    assert_eq!(png_size(&out.join("timeline.png")), (TIMELINE_WIDTH, timeline_height(&[group])));

    // `pipebd plot` draws them again from the folder alone.
    std::fs::remove_file(out.join("losses.png")).unwrap();
    std::fs::remove_file(out.join("timeline.png")).unwrap();
    let (code, stdout, stderr) = common::pipebd(&["plot", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(out.join("losses.png").is_file() && out.join("timeline.png").is_file(), "{stdout}");
}

#[test]
fn plot_names_a_folder_without_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, stderr) = common::pipebd(&["plot", dir.path().to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(stderr.contains("metrics.csv") && stderr.contains("--out"), "{stderr}");
}
