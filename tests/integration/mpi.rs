//! `mpirun -np N pipebd run`: real processes on OpenMPI (loopback, one
//! machine, `--oversubscribe`), against the same run in one process; a rank
//! killed with SIGKILL mid-run, then `--resume` on fewer ranks; a plan that
//! needs more ranks than were started. Needs the `mpi` feature and
//! `mpirun` (`scripts/setup-mpi.sh`).
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use pipebd_cli::report::RunReport;

use crate::common;

/// `mpirun` with the flags a one-machine test needs (root allowed, more
/// ranks than cores, no pinning).
fn mpirun(ranks: usize) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args(["--oversubscribe", "--bind-to", "none", "-np", &ranks.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // Containers often forbid the cross-process memory copy of the
        // shared-memory transport; plain copies work everywhere.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env_remove(pipe_bd::fault::ENV)
        .arg(common::pipebd_bin());
    command
}

fn one_process() -> Command {
    let mut command = Command::new(common::pipebd_bin());
    command.env_remove(pipe_bd::fault::ENV);
    command
}

fn run_args<'a>(command: &'a mut Command, config: &Path, out: &Path) -> &'a mut Command {
    command.arg("run").arg(config).arg("--out").arg(out).arg("--quiet")
}

fn succeed(output: Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// A small MNIST run on CPU slots, with `extra` appended (schedule, checkpoints).
fn write_config(dir: &Path, name: &str, train_limit: usize, epochs: usize, extra: &str) -> PathBuf {
    let text = common::small_config(train_limit, 100, epochs)
        .replace("device = \"cpu\"\n", &format!("device = \"cpu\"\n{extra}\n"))
        .replace("log_every = 1", "log_every = 1\n\n[runtime]\ntimeout_seconds = 30");
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn mpirun_on_two_and_three_ranks_trains_what_one_process_trains() {
    let _serial = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "run.toml", 512, 1, "");
    // hybrid: 2 replicas of block 1, then blocks 2-4 (3 slots); on 2 slots
    // blocks 1-4 on 2 replicas.
    let cases: [(&str, usize, &str); 6] = [
        ("tr", 2, ""),
        ("dp", 2, ""),
        ("hybrid", 2, "1,2,3,4x2"),
        ("tr-dpu", 3, ""),
        ("ls", 3, ""),
        ("hybrid", 3, "1x2;2,3,4"),
    ];
    for (schedule, ranks, stages) in cases {
        let config = if schedule == "hybrid" {
            let stages: String = stages
                .split(';')
                .map(|s| {
                    let (blocks, replicas) = s.split_once('x').unwrap_or((s, "1"));
                    format!("\n[[stages]]\nblocks = [{blocks}]\nreplicas = {replicas}\n")
                })
                .collect();
            let text = std::fs::read_to_string(&config).unwrap() + &stages;
            let path = dir.path().join(format!("hybrid-{ranks}.toml"));
            std::fs::write(&path, text).unwrap();
            path
        } else {
            config.clone()
        };
        let mpi_out = dir.path().join(format!("{schedule}-{ranks}-mpi"));
        let local_out = dir.path().join(format!("{schedule}-{ranks}-local"));
        let slots = vec!["cpu"; ranks].join(",");
        let what = format!("{schedule} on {ranks} ranks");
        let stdout = succeed(
            run_args(&mut mpirun(ranks), &config, &mpi_out).args(["--schedule", schedule]).output().unwrap(),
            &what,
        );
        assert_eq!(stdout.matches("wrote ").count(), 1, "{what}: only rank 0 writes outputs:\n{stdout}");
        succeed(
            run_args(&mut one_process(), &config, &local_out)
                .args(["--schedule", schedule, "--devices", &slots, "--transport", "local"])
                .output()
                .unwrap(),
            &format!("{what} (one process)"),
        );
        let (mpi, local) = (RunReport::read(&mpi_out).unwrap(), RunReport::read(&local_out).unwrap());
        assert_eq!(mpi.plan, local.plan, "{what}: not the same plan");
        assert_eq!(
            mpi.workers.len(),
            local.workers.len(),
            "{what}: a rank's workers are missing from the report"
        );
        assert_same_losses(&mpi_out, &local_out, &what);
        let diff =
            common::max_abs_diff(&common::student_weights(&local_out), &common::student_weights(&mpi_out));
        assert!(diff <= 1e-6, "{what}: the students differ from one process by {diff}");
    }
}

/// The loss curves of two runs agree (every row of `metrics.csv`; replicas
/// sum their gradients in one order, but a replicated run on one machine is
/// reproducible to about 1e-7 only).
fn assert_same_losses(a: &Path, b: &Path, what: &str) {
    let rows = |d: &Path| -> Vec<Vec<f64>> {
        let text = std::fs::read_to_string(d.join("metrics.csv")).unwrap();
        text.lines().skip(1).map(|l| l.split(',').map(|v| v.parse().unwrap()).collect()).collect()
    };
    let (ra, rb) = (rows(a), rows(b));
    assert_eq!(ra.len(), rb.len(), "{what}: not the same number of metric rows");
    assert!(ra.len() > 4, "{what}: no metric rows");
    for (x, y) in ra.iter().zip(&rb) {
        assert_eq!(x[..3], y[..3], "{what}: rows of other steps or blocks");
        let loss = (x[3] - y[3]).abs() / x[3].abs().max(1e-12);
        assert!(loss <= 1e-5, "{what}: step {} block {}: loss {} against {}", x[1], x[2], x[3], y[3]);
    }
}

/// The pids of the processes `mpirun` started as ranks of `config`'s run, by rank.
fn rank_pids(config: &Path) -> Vec<(usize, u32)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.contains(&*config.to_string_lossy()) || !cmdline.starts_with(common::pipebd_bin()) {
            continue;
        }
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        let rank = String::from_utf8_lossy(&environ)
            .split('\0')
            .find_map(|v| v.strip_prefix("OMPI_COMM_WORLD_RANK=").and_then(|r| r.parse().ok()));
        if let Some(rank) = rank {
            found.push((rank, pid));
        }
    }
    found.sort();
    found
}

#[test]
fn a_rank_killed_mid_run_stops_the_others_and_resume_continues_on_fewer_ranks() {
    let _serial = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let extra = "schedule = \"tr-dpu\"\n\n[checkpoint]\nevery_steps = 2\nevery_minutes = 0.0";
    let config = write_config(dir.path(), "kill.toml", 1280, 8, extra);
    let killed = dir.path().join("killed");
    let mut child = run_args(&mut mpirun(3), &config, &killed)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Once every block has a checkpoint past step 10, SIGKILL rank 1.
    let checkpoints = killed.join("checkpoints");
    let deadline = Instant::now() + Duration::from_secs(120);
    while (1..=4).any(|b| common::newest_step(&checkpoints, b).unwrap_or(0) < 10) {
        assert!(Instant::now() < deadline, "no checkpoints after 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pids = rank_pids(&config);
    assert_eq!(pids.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1, 2], "ranks found: {pids:?}");
    let killed_at = Instant::now();
    let status = Command::new("kill").args(["-9", &pids[1].1.to_string()]).status().unwrap();
    assert!(status.success());
    // The others stop within the progress timeout (30 s), and none is left behind.
    let deadline = Instant::now() + Duration::from_secs(45);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("mpirun still running 45 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "mpirun reported success after a rank was killed");
    assert!(killed_at.elapsed() < Duration::from_secs(45));
    std::thread::sleep(Duration::from_millis(500));
    assert!(rank_pids(&config).is_empty(), "ranks left running: {:?}", rank_pids(&config));
    assert!(!killed.join("report.json").exists(), "the run had finished: not killed mid-run");

    // Resume on 2 ranks: tr-dpu re-planned for 2 slots from the checkpoints.
    let stdout = succeed(
        run_args(&mut mpirun(2), &config, &killed).arg("--resume").arg(&killed).output().unwrap(),
        "resume on 2 ranks",
    );
    let resumed = RunReport::read(&killed).unwrap();
    assert!(resumed.steps_run < resumed.steps, "nothing came from the checkpoints:\n{stdout}");
    assert_eq!(resumed.plan.matches('|').count(), 1, "not re-planned for 2 slots: {}", resumed.plan);

    // The uninterrupted run, in one process.
    let reference = dir.path().join("reference");
    succeed(
        run_args(&mut one_process(), &config, &reference).args(["--transport", "local"]).output().unwrap(),
        "uninterrupted run",
    );
    let diff = common::max_abs_diff(&common::student_weights(&reference), &common::student_weights(&killed));
    assert!(diff <= 1e-5, "the resumed students differ from the uninterrupted run by {diff}");
}

#[test]
fn a_plan_needing_more_ranks_than_started_fails_before_training() {
    let _serial = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "three.toml",
        512,
        1,
        "devices = [\"cpu\", \"cpu\", \"cpu\"]\nschedule = \"tr\"",
    );
    let out = dir.path().join("out");
    let started = Instant::now();
    let output = run_args(&mut mpirun(2), &config, &out).output().unwrap();
    assert!(!output.status.success(), "a 3-slot plan ran on 2 ranks");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("3 device slots") && stderr.contains("2 ranks were started"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(60));
    assert!(!out.join("report.json").exists() && !out.join("checkpoints").exists(), "it trained");
}

#[test]
fn sigterm_to_every_rank_or_sigint_to_one_stops_all_at_one_step_and_resume_continues() {
    use crate::signals::{completed_steps, finish, printed_resume_command, send, wait_for_checkpoint};
    let _serial = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let extra = "schedule = \"tr-dpu\"\n\n[checkpoint]\nevery_steps = 7\nevery_minutes = 0.0";
    let config = write_config(dir.path(), "signals.toml", 1280, 8, extra);
    let reference = dir.path().join("reference");
    succeed(
        run_args(&mut one_process(), &config, &reference).args(["--transport", "local"]).output().unwrap(),
        "uninterrupted run",
    );
    // As Slurm preempts a job (SIGTERM to every task), then Ctrl-C reaching
    // one rank only: the others learn it from that rank.
    for (signal, to_ranks) in [("TERM", vec![0, 1]), ("INT", vec![1])] {
        let out = dir.path().join(signal);
        let mut child = run_args(&mut mpirun(2), &config, &out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let checkpoints = out.join("checkpoints");
        wait_for_checkpoint(&mut child, &checkpoints, 7);
        let pids = rank_pids(&config);
        assert_eq!(pids.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1], "ranks found: {pids:?}");
        for rank in to_ranks {
            send(signal, pids[rank].1);
        }
        let (exit, stderr) = finish(child, Duration::from_secs(60));
        assert_ne!(exit, Some(0), "{stderr}");
        assert!(stderr.contains(&format!("interrupted by SIG{signal}")), "{stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("no heartbeat"), "{stderr}");
        std::thread::sleep(Duration::from_millis(300));
        assert!(rank_pids(&config).is_empty(), "ranks left running: {:?}", rank_pids(&config));
        let stopped = completed_steps(&stderr);
        assert!((7..160).contains(&stopped), "stopped at {stopped}");
        let saved: Vec<Option<usize>> = (1..=4).map(|b| common::newest_step(&checkpoints, b)).collect();
        assert_eq!(saved, vec![Some(stopped); 4], "SIG{signal}: checkpoints after the stop");

        let words = printed_resume_command(&stderr);
        assert_eq!(&words[..3], ["mpirun", "-n", "2"], "{words:?}");
        assert_eq!(words[4..].last().map(String::as_str), Some(&*out.to_string_lossy()), "{words:?}");
        // The printed command, with this machine's mpirun flags.
        succeed(mpirun(2).args(&words[4..]).output().unwrap(), "the printed resume command");
        let resumed = RunReport::read(&out).unwrap();
        assert_eq!(resumed.steps_run, resumed.steps - stopped);
        let diff = common::max_abs_diff(&common::student_weights(&reference), &common::student_weights(&out));
        assert!(diff <= 1e-5, "SIG{signal}: resumed weights differ by {diff} from the uninterrupted run");
    }
}

#[test]
fn sigusr1_to_mpirun_reaches_every_rank_and_stops_them_at_one_step() {
    use crate::signals::{completed_steps, finish, send, wait_for_checkpoint};
    let _serial = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let extra = "schedule = \"tr-dpu\"\n\n[checkpoint]\nevery_steps = 7\nevery_minutes = 0.0";
    let config = write_config(dir.path(), "usr1.toml", 1280, 8, extra);
    let out = dir.path().join("usr1");
    let mut child =
        run_args(&mut mpirun(2), &config, &out).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let checkpoints = out.join("checkpoints");
    wait_for_checkpoint(&mut child, &checkpoints, 7);
    // What scripts/slurm.sbatch does when Slurm warns of the end of the job.
    send("USR1", child.id());
    let (exit, stderr) = finish(child, Duration::from_secs(60));
    assert_ne!(exit, Some(0), "{stderr}");
    assert!(stderr.contains("interrupted by SIGUSR1"), "{stderr}");
    let stopped = completed_steps(&stderr);
    let saved: Vec<Option<usize>> = (1..=4).map(|b| common::newest_step(&checkpoints, b)).collect();
    assert_eq!(saved, vec![Some(stopped); 4], "checkpoints after the stop");
    succeed(run_args(&mut mpirun(2), &config, &out).arg("--resume").arg(&out).output().unwrap(), "resume");
    let resumed = RunReport::read(&out).unwrap();
    assert_eq!(resumed.steps_run, resumed.steps - stopped);
}

#[test]
fn auto_under_mpirun_plans_from_every_ranks_own_profile() {
    let _serial = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "auto.toml", 640, 1, "schedule = \"auto\"");
    let out = dir.path().join("auto");
    // In the temporary folder: the profile cache (runs/.profile-cache) starts empty.
    // Without --quiet: the `auto:` lines are what this test reads.
    let output =
        mpirun(2).arg("run").arg(&config).arg("--out").arg(&out).current_dir(dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    succeed(output, "auto on 2 ranks");
    for rank in 0..2 {
        assert!(stderr.contains(&format!("auto: rank {rank}: the blocks take")), "{stderr}");
        let cached = std::fs::read_dir(dir.path().join("runs/.profile-cache"))
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(&format!("-rank{rank}.json")));
        assert!(cached, "rank {rank} measured no profile of its own");
    }
    let report = RunReport::read(&out).unwrap();
    assert_eq!(report.schedule, "auto");
    assert_eq!(report.steps_run, report.steps);
}

/// Pipe-BD on the decoder LLM across processes: a search run's candidates
/// (SmolLM2's 30 layers in three blocks, two candidate sets) trained on two
/// MPI ranks under teacher relaying, with and without decoupled updates, and
/// under `auto` in one process and on two ranks, end with the weights and
/// final losses the ideal schedule gives them in one process.
#[test]
fn the_decoder_search_on_two_ranks_and_under_auto_trains_what_ideal_trains() {
    let _serial = common::timing_sensitive();
    let dir = tempfile::tempdir().unwrap();
    let config = crate::smollm2::tiny_config(dir.path(), crate::smollm2::SEARCH_STUDENTS);
    let run = |name: &str, mut command: Command, args: &[&str]| {
        let out = dir.path().join(name);
        // In the temporary folder: `auto` profiles afresh (runs/.profile-cache).
        command.current_dir(dir.path());
        succeed(run_args(&mut command, &config, &out).args(args).output().unwrap(), name);
        let report = RunReport::read(&out).unwrap();
        assert!(
            report.steps >= 1 && report.steps_run == report.steps,
            "{name}: {} of {} steps",
            report.steps_run,
            report.steps
        );
        let losses: Vec<f32> = report.blocks.iter().map(|b| b.final_loss).collect();
        (common::student_weights(&out), losses, report.plan)
    };
    let (ideal, ideal_losses, _) = run("ideal", one_process(), &["--schedule", "ideal", "--devices", "cpu"]);
    let cases: [(&str, Command, &[&str]); 4] = [
        ("tr on 2 ranks", mpirun(2), &["--schedule", "tr"]),
        ("tr-dpu on 2 ranks", mpirun(2), &["--schedule", "tr-dpu"]),
        ("auto on 2 slots", one_process(), &["--schedule", "auto", "--devices", "cpu,cpu"]),
        ("auto on 2 ranks", mpirun(2), &["--schedule", "auto"]),
    ];
    for (what, command, args) in cases {
        let (weights, losses, plan) = run(&what.replace(' ', "-"), command, args);
        eprintln!("{what}: {plan}");
        let diff = common::max_abs_diff(&ideal, &weights);
        assert!(diff <= 1e-5, "{what} ({plan:?}): the students differ from ideal's by {diff}");
        for (a, b) in ideal_losses.iter().zip(&losses) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{what} ({plan:?}): final losses {losses:?} vs ideal's {ideal_losses:?}"
            );
        }
    }
}
