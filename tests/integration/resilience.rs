//! Nothing lost: checkpoints survive a SIGKILL (mid-run and mid-write),
//! `--resume` reproduces the uninterrupted run, damaged checkpoints fall
//! back to older ones, checkpoints of another run are refused, and a W = 3
//! run survives losing a replica and then a whole stage.
//!
//! The runs are real `pipebd` child processes (killed with SIGKILL through
//! `Child::kill`) or in-process runs, on a slice of real MNIST.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pipebd_cli::config::RunConfig;
use pipebd_cli::jobs::run::RunFlags;
use pipebd_cli::report::RunReport;
use pipebd_zoo::run_builtin;

use crate::common::{self, newest_step};

/// A pipelined 2-slot run, 8 epochs of 10 steps, a checkpoint every 2 steps.
fn pipelined_config(batch_size: usize) -> String {
    common::small_config(640, 200, 8).replace("batch_size = 64", &format!("batch_size = {batch_size}")).replace(
        "device = \"cpu\"\n",
        "device = \"cpu\"\ndevices = [\"cpu\", \"cpu\"]\nschedule = \"tr-dpu\"\n\n[checkpoint]\nevery_steps = 2\nevery_minutes = 0.0\n",
    )
}

fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn pipebd(args: &[&std::ffi::OsStr]) -> Command {
    let mut command = Command::new(common::pipebd_bin());
    command.arg("run").args(args).arg("--quiet").env_remove(pipe_bd::fault::ENV);
    command
}

fn run_to_end(config: &Path, out: &Path, resume: bool) -> RunReport {
    run_to_end_with(config, out, resume, &[])
}

fn run_to_end_with(config: &Path, out: &Path, resume: bool, extra: &[&str]) -> RunReport {
    let mut args = vec![config.as_os_str(), "--out".as_ref(), out.as_os_str()];
    if resume {
        args.extend(["--resume".as_ref(), out.as_os_str()]);
    }
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    let output = pipebd(&args).output().unwrap();
    assert!(output.status.success(), "pipebd failed: {}", String::from_utf8_lossy(&output.stderr));
    RunReport::read(out).unwrap()
}

fn assert_same_weights(a: &Path, b: &Path) {
    let (wa, wb) = (common::student_weights(a), common::student_weights(b));
    assert_eq!(wa.len(), wb.len());
    for (k, (x, y)) in wa.iter().zip(&wb).enumerate() {
        assert_eq!(x.len(), y.len());
        let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        assert!(worst <= 1e-5, "block {}: weights differ by {worst} from the uninterrupted run", k + 1);
    }
}

#[test]
fn sigkill_mid_run_and_mid_checkpoint_write_then_resume_reproduces_the_uninterrupted_run() {
    let _one = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "run.toml", &pipelined_config(64));
    let reference = dir.path().join("reference");
    let whole = run_to_end(&config, &reference, false);
    assert_eq!(whole.steps, 80);
    assert!(whole.resilience.checkpoints_written >= 4 * 40, "{:?}", whole.resilience);

    // 1. SIGKILL while training, once some block has passed step 10.
    let killed = dir.path().join("killed");
    let mut child = pipebd(&[config.as_os_str(), "--out".as_ref(), killed.as_os_str()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let checkpoints = killed.join("checkpoints");
    common::kill_after_checkpoint(&mut child, &checkpoints, 10);
    assert!(!killed.join("report.json").exists(), "the run had finished: not killed mid-run");
    let before: Vec<usize> = (1..=4).map(|b| newest_step(&checkpoints, b).unwrap_or(0)).collect();
    assert!(before.iter().any(|&s| s < 80), "{before:?}");
    let resumed = run_to_end(&config, &killed, true);
    let steps: Vec<usize> = resumed.resilience.resumed.iter().map(|r| r.step).collect();
    assert_eq!(steps, before, "each block resumes from its own newest checkpoint");
    assert_eq!(resumed.steps_run, 80 - before.iter().min().unwrap());
    assert_same_weights(&reference, &killed);

    // 2. SIGKILL in the middle of a checkpoint write (block 2 at step 12,
    //    half of its weights on disk), then resume on one slot.
    let torn = dir.path().join("torn");
    let mut child = pipebd(&[config.as_os_str(), "--out".as_ref(), torn.as_os_str()])
        .env(pipe_bd::fault::ENV, "stall-checkpoint block=2 step=12")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut stalled = false;
    for line in stderr.lines() {
        if line.unwrap().contains("checkpoint write stalled") {
            stalled = true;
            break;
        }
    }
    assert!(stalled, "the checkpoint write never stalled");
    child.kill().unwrap();
    child.wait().unwrap();
    let block2 = torn.join("checkpoints/block-02");
    assert!(block2.join(".step-00000012.tmp").is_dir(), "the torn write should be left as a temporary");
    assert_eq!(newest_step(&torn.join("checkpoints"), 2), Some(10), "a torn write is never a checkpoint");
    // Resumed on one device slot instead of two: blocks are independent, so
    // the plan may change and the weights may not.
    let resumed = run_to_end_with(&config, &torn, true, &["--schedule", "ideal", "--devices", "cpu"]);
    assert_eq!(resumed.plan, "{1-4}");
    assert_eq!(resumed.resilience.resumed[1].step, 10);
    assert_same_weights(&reference, &torn);
}

#[test]
fn a_damaged_checkpoint_falls_back_to_the_older_one_and_another_runs_is_refused() {
    let _one = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "run.toml", &pipelined_config(64));
    let reference = dir.path().join("reference");
    run_to_end(&config, &reference, false);

    // Copy the finished run, flip one byte of block 2's newest weights and
    // cut block 3's newest optimizer state short.
    let damaged = dir.path().join("damaged");
    copy_dir(&reference, &damaged);
    let checkpoints = damaged.join("checkpoints");
    assert_eq!(newest_step(&checkpoints, 2), Some(80));
    let weights = checkpoints.join("block-02/step-00000080/weights.mpk");
    let mut bytes = std::fs::read(&weights).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&weights, bytes).unwrap();
    let optimizer = checkpoints.join("block-03/step-00000080/optimizer.mpk");
    let bytes = std::fs::read(&optimizer).unwrap();
    std::fs::write(&optimizer, &bytes[..bytes.len() - 10]).unwrap();

    let report = run_to_end(&config, &damaged, true);
    let resumed = &report.resilience.resumed;
    assert_eq!(resumed.iter().map(|r| r.step).collect::<Vec<_>>(), vec![80, 78, 78, 80]);
    assert!(resumed[1].refused[0].contains("block-02/step-00000080/weights.mpk"), "{:?}", resumed[1]);
    assert!(resumed[1].refused[0].contains("sha256"), "{:?}", resumed[1]);
    assert!(resumed[2].refused[0].contains("optimizer.mpk") && resumed[2].refused[0].contains("truncated"));
    assert!(resumed[0].refused.is_empty() && resumed[3].refused.is_empty());
    // Two steps retrained from the older checkpoints land on the same weights.
    assert_same_weights(&reference, &damaged);

    // Another run's checkpoints (other batch size) are refused, naming the
    // file and the field.
    let other = write_config(dir.path(), "other.toml", &pipelined_config(32));
    let output = pipebd(&[
        other.as_os_str(),
        "--out".as_ref(),
        dir.path().join("x").as_os_str(),
        "--resume".as_ref(),
        reference.as_os_str(),
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("manifest.json") && stderr.contains("train.batch_size"), "{stderr}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Three slots: blocks 1-2 on two replicas, blocks 3-4 on the third.
fn three_slot_config(faults: &str) -> RunConfig {
    let text = common::small_config(3200, 1000, 2).replace(
        "device = \"cpu\"\n",
        &format!(
            "device = \"cpu\"\ndevices = [\"cpu\", \"cpu\", \"cpu\"]\nschedule = \"hybrid\"\n\
             [[stages]]\nblocks = [1, 2]\nreplicas = 2\n[[stages]]\nblocks = [3, 4]\n\n\
             [runtime]\ntimeout_seconds = 3.0\nmax_failures = 2\n\n\
             [checkpoint]\nevery_steps = 4\nevery_minutes = 0.0\n{faults}\n"
        ),
    );
    RunConfig::parse(&text, Path::new("three-slots.toml")).unwrap()
}

#[test]
fn a_w3_run_survives_a_lost_replica_and_then_a_lost_stage() {
    let _one = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let clean =
        run_builtin(&three_slot_config(""), &dir.path().join("clean"), &RunFlags::default(), &mut |_| {})
            .unwrap();
    assert!(clean.resilience.failures.is_empty());

    // The second replica of stage 1 panics at step 6; at step 41 the only
    // worker of stage 2 stops answering (no error: only the watchdog sees it).
    let faults = "[[faults]]\nkind = \"panic\"\nslot = 1\nstep = 6\n\n[[faults]]\nkind = \"hang\"\nslot = 2\nstep = 41\n";
    let started = Instant::now();
    let faulty = run_builtin(
        &three_slot_config(faults),
        &dir.path().join("faulty"),
        &RunFlags::default(),
        &mut |_| {},
    )
    .unwrap();
    let elapsed = started.elapsed();
    let failures = &faulty.resilience.failures;
    assert_eq!(failures.len(), 2, "{failures:#?}");

    let replica = &failures[0];
    assert_eq!((replica.stage, replica.replica, replica.slot), (1, 1, 1));
    assert!(replica.error.contains("panicked"), "{}", replica.error);
    assert!(replica.action.contains("re-routed"), "{}", replica.action);
    assert_eq!(replica.new_plan, "{1-2 | 3-4}");
    assert!(replica.restored.is_empty() && replica.steps_lost == 0, "{replica:?}");

    let stage = &failures[1];
    assert_eq!((stage.stage, stage.slot), (2, 2));
    assert!(stage.error.contains("no progress"), "{}", stage.error);
    assert!(stage.action.contains("re-planned"), "{}", stage.action);
    assert_eq!(stage.new_plan, "{1-4}");
    let restored: Vec<usize> = stage.restored.iter().map(|r| r.block).collect();
    assert_eq!(restored, vec![3, 4]);
    for r in &stage.restored {
        assert!(r.resumed_at <= r.lost_at && r.resumed_at % 4 == 0 && r.lost_at >= 36, "{r:?}");
    }
    // Checkpoints every 4 steps and a hang at step 41: each restored block
    // redoes what it did since its last checkpoint, at most a checkpoint
    // interval (and the step it was in), never nothing.
    assert!(
        stage.steps_lost > 0 && stage.steps_lost <= restored.len() * 5,
        "{} steps lost by blocks {restored:?}",
        stage.steps_lost
    );
    assert!(stage.recovery_seconds > 0.0 && elapsed < Duration::from_secs(300));

    // Every block trained to the end, and the student is as good.
    assert_eq!(faulty.steps, clean.steps);
    assert!(faulty.blocks.iter().all(|b| b.final_loss.is_finite()));
    let gap = 100.0 * (faulty.student_accuracy - clean.student_accuracy).abs();
    assert!(gap <= 0.5, "accuracy {} vs fault-free {}", faulty.student_accuracy, clean.student_accuracy);
    assert!(faulty.student_accuracy > 0.5, "{}", faulty.student_accuracy);
}

#[test]
fn past_max_failures_the_run_stops_with_an_error_and_its_checkpoints() {
    let _one = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let faults = "[[faults]]\nkind = \"error\"\nslot = 2\nstep = 9\n";
    let mut config = three_slot_config(faults);
    config.runtime.max_failures = 0;
    let out = dir.path().join("stopped");
    let error = run_builtin(&config, &out, &RunFlags::default(), &mut |_| {}).unwrap_err().to_string();
    assert!(error.contains("slot 2") && error.contains("injected fault"), "{error}");
    // Blocks 3-4 had written step 4 and 8 before their worker failed at step 9.
    assert_eq!(newest_step(&out.join("checkpoints"), 3), Some(8));
}

#[test]
fn dp_on_three_slots_reroutes_every_later_phase_around_a_lost_slot() {
    let _one = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let text = common::small_config(640, 200, 1).replace(
        "device = \"cpu\"\n",
        "device = \"cpu\"\ndevices = [\"cpu\", \"cpu\", \"cpu\"]\nschedule = \"dp\"\n",
    );
    let config = RunConfig::parse(&text, Path::new("dp.toml")).unwrap();
    let clean = run_builtin(&config, &dir.path().join("clean"), &RunFlags::default(), &mut |_| {}).unwrap();
    let mut faulty_config = config.clone();
    faulty_config.faults = pipe_bd::fault::parse_list("error slot=2 step=5").unwrap();
    let faulty =
        run_builtin(&faulty_config, &dir.path().join("faulty"), &RunFlags::default(), &mut |_| {}).unwrap();
    let failures = &faulty.resilience.failures;
    assert_eq!(failures.len(), 1, "{failures:#?}");
    assert_eq!(
        failures[0].new_plan,
        "{1 x2} then {2 x2 (recompute)} then {3 x2 (recompute)} then {4 x2 (recompute)}"
    );
    assert_eq!(faulty.resilience.final_plan, failures[0].new_plan);
    assert_eq!(failures[0].steps_lost, 0);
    let gap = 100.0 * (faulty.student_accuracy - clean.student_accuracy).abs();
    assert!(gap <= 0.5, "accuracy {} vs fault-free {}", faulty.student_accuracy, clean.student_accuracy);
}
