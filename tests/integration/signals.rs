//! Signals as users and schedulers send them: SIGINT (Ctrl-C) and SIGTERM
//! (what Slurm sends before it preempts a job) finish the steps in flight,
//! write a checkpoint of every block, print the command that resumes the
//! run and exit with 130 / 143; the printed command resumes to the weights
//! of the uninterrupted run; a second signal ends the process at once.
//! (The same across `mpirun` ranks: `mpi::sigterm_...`.)

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pipebd_cli::report::RunReport;

use crate::common::{self, newest_step};

/// A pipelined 2-slot run of 4 blocks, 8 epochs of 10 steps, with a
/// checkpoint every 7 steps (so that a checkpoint at any other step before
/// the last is the interrupt's).
pub fn signal_config(dir: &Path) -> PathBuf {
    let text = common::small_config(640, 200, 8).replace(
        "device = \"cpu\"\n",
        "device = \"cpu\"\ndevices = [\"cpu\", \"cpu\"]\nschedule = \"tr-dpu\"\n\n[checkpoint]\nevery_steps = 7\nevery_minutes = 0.0\n",
    );
    let path = dir.join("signals.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn pipebd() -> Command {
    let mut command = Command::new(common::pipebd_bin());
    command.env_remove(pipe_bd::fault::ENV);
    command
}

/// Sends `signal` (a `kill -s` name) to process `pid`.
pub fn send(signal: &str, pid: u32) {
    let status = Command::new("kill").args(["-s", signal, &pid.to_string()]).status().unwrap();
    assert!(status.success(), "kill -s {signal} {pid} failed");
}

/// Waits until some block has a checkpoint at step `step` or later.
pub fn wait_for_checkpoint(child: &mut Child, checkpoints: &Path, step: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while (1..=4).all(|b| newest_step(checkpoints, b).unwrap_or(0) < step) {
        assert!(Instant::now() < deadline, "no checkpoint after 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended before the signal");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for `child` (at most `limit`), returning its exit code and stderr.
pub fn finish(mut child: Child, limit: Duration) -> (Option<i32>, String) {
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running {limit:?} after the signal");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.code(), reader.join().unwrap())
}

/// The steps every block had completed, from the interrupted run's message.
pub fn completed_steps(stderr: &str) -> usize {
    let after = stderr.split("every block has completed ").nth(1).unwrap_or_else(|| panic!("{stderr}"));
    let number = after.split(' ').next().unwrap_or_default();
    number.parse().unwrap_or_else(|_| panic!("`{number}` is not a step count:\n{stderr}"))
}

/// The resume command the interrupted run printed, as words.
pub fn printed_resume_command(stderr: &str) -> Vec<String> {
    let line = stderr
        .split("\nresume with:\n")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .unwrap_or_else(|| panic!("no resume command printed:\n{stderr}"));
    line.split_whitespace().map(str::to_string).collect()
}

#[test]
fn sigint_and_sigterm_finish_the_step_checkpoint_every_block_and_the_printed_command_resumes() {
    let _one = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = signal_config(dir.path());
    let reference = dir.path().join("reference");
    let output =
        pipebd().arg("run").arg(&config).arg("--out").arg(&reference).arg("--quiet").output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));

    for (signal, code) in [("INT", 130), ("TERM", 143)] {
        let out = dir.path().join(signal);
        let child = pipebd()
            .arg("run")
            .arg(&config)
            .arg("--out")
            .arg(&out)
            .arg("--quiet")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut child = child;
        let checkpoints = out.join("checkpoints");
        wait_for_checkpoint(&mut child, &checkpoints, 7);
        send(signal, child.id());
        let (exit, stderr) = finish(child, Duration::from_secs(60));
        assert_eq!(exit, Some(code), "SIG{signal}:\n{stderr}");
        assert!(stderr.contains(&format!("interrupted by SIG{signal}")), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!out.join("report.json").exists(), "SIG{signal} came after the run had finished");
        // Every block saved at the one step the pipeline stopped at.
        let stopped = completed_steps(&stderr);
        assert!((7..80).contains(&stopped), "stopped at {stopped}");
        let saved: Vec<Option<usize>> = (1..=4).map(|b| newest_step(&checkpoints, b)).collect();
        assert_eq!(saved, vec![Some(stopped); 4], "SIG{signal}: checkpoints after the stop");

        let words = printed_resume_command(&stderr);
        assert_eq!(words[0], common::pipebd_bin(), "{words:?}");
        let resumed =
            Command::new(&words[0]).args(&words[1..]).env_remove(pipe_bd::fault::ENV).output().unwrap();
        assert!(resumed.status.success(), "{words:?}: {}", String::from_utf8_lossy(&resumed.stderr));
        let report = RunReport::read(&out).unwrap();
        let from: Vec<usize> = report.resilience.resumed.iter().map(|r| r.step).collect();
        assert_eq!(from, vec![stopped; 4]);
        assert_eq!(report.steps_run, 80 - stopped);
        let diff = common::max_abs_diff(&common::student_weights(&reference), &common::student_weights(&out));
        assert!(diff <= 1e-5, "SIG{signal}: resumed weights differ by {diff} from the uninterrupted run");
    }
}

#[test]
fn a_second_signal_ends_the_run_at_once() {
    let _one = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = signal_config(dir.path());
    let out = dir.path().join("out");
    // Block 2's checkpoint write at step 14 stalls for an hour: the first
    // signal cannot finish the step, the second must end the process.
    let mut child = pipebd()
        .arg("run")
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .arg("--quiet")
        .env(pipe_bd::fault::ENV, "stall-checkpoint block=2 step=14")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("checkpoint write stalled") {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "the checkpoint write never stalled");
    }
    send("INT", child.id());
    std::thread::sleep(Duration::from_millis(1500));
    assert!(child.try_wait().unwrap().is_none(), "the stalled run ended on the first signal");
    send("INT", child.id());
    // No timing asserted: the stalled write would hold the run for an hour,
    // and the watchdog's way out (120 s) exits with 1, so exit code 130
    // says the second signal ended it.
    let deadline = Instant::now() + Duration::from_secs(100);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "still running 100 s after the second signal");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr_text = String::new();
    stderr.read_to_string(&mut stderr_text).unwrap();
    let stderr = stderr_text;
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("send it again to stop at once"), "{stderr}");
}

#[test]
fn resuming_a_run_stopped_before_its_first_checkpoint_starts_it_and_a_mistyped_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("small.toml");
    std::fs::write(&config, common::small_config(256, 100, 1)).unwrap();
    let out = dir.path().join("never-saved");
    // The printed resume command of a run stopped before any checkpoint (or
    // a scheduler's requeue): its own folder, with nothing in it yet.
    let run =
        pipebd().arg("run").arg(&config).arg("--out").arg(&out).arg("--resume").arg(&out).output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("nothing to resume") && stderr.contains("starting from the first step"),
        "{stderr}"
    );
    let report = RunReport::read(&out).unwrap();
    assert_eq!(report.steps_run, report.steps);
    assert!(report.resilience.resumed.is_empty());
    // Another folder without checkpoints is a mistake: refused, named.
    let typo = dir.path().join("never-saved-typo");
    let other = dir.path().join("other");
    let run = pipebd()
        .arg("run")
        .arg(&config)
        .arg("--out")
        .arg(&other)
        .arg("--resume")
        .arg(&typo)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("no checkpoints to resume from") && stderr.contains("never-saved-typo"),
        "{stderr}"
    );
}
