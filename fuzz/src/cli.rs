//! The command line end to end: the `pipebd` binary under random argument
//! vectors and mutated config files and run folders (every process must exit
//! with 0, 1 or 2, with one error message and never a panic or a crash), and
//! runs stopped at random points (SIGKILL, SIGTERM, SIGINT, sometimes twice)
//! then resumed, which must end with the weights of the uninterrupted run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::mutate::{self, Rng};

/// What the argument-vector fuzzing saw.
#[derive(Debug, Default, serde::Serialize)]
pub struct CliTally {
    pub inputs: u64,
    /// Processes by exit code.
    pub exit_codes: BTreeMap<i32, u64>,
    /// A few distinct error messages per exit code, with their command.
    pub samples: BTreeMap<i32, Vec<String>>,
    /// Stopped at the time limit (a real run of a config that asks for
    /// much work; not a failure, counted apart).
    pub over_time: u64,
    /// Panics, crashes, other exit codes, errors without their one message.
    pub failures: Vec<String>,
    pub seconds: f64,
}

/// What the kill-and-resume rounds saw.
#[derive(Debug, Default, serde::Serialize)]
pub struct KillTally {
    pub rounds: u64,
    /// How each round's stops went: `SIGKILL at 1.3 s`, ...
    pub stops: Vec<String>,
    /// The largest weight difference from the uninterrupted run.
    pub worst_difference: f32,
    pub failures: Vec<String>,
    pub seconds: f64,
}

/// A small MNIST run whose files live under `root/data` (4 blocks, 2 slots
/// pipelined, `epochs` epochs of 10 steps, a checkpoint every 3 steps).
fn tiny_config(root: &Path, epochs: usize) -> String {
    let data = root.join("data");
    let sections = pipebd_zoo::smoke_sections(
        &data.join("mnist"),
        &data.join("teachers/mnist-cnn.pth"),
        (640, 100),
        epochs,
    );
    format!(
        "name = \"fuzz\"\nseed = 7\ndevice = \"cpu\"\ndevices = [\"cpu\", \"cpu\"]\nschedule = \"tr-dpu\"\n\n\
         [checkpoint]\nevery_steps = 3\nevery_minutes = 0.0\n\n{sections}"
    )
}

/// Runs `pipebd` with `args` in `cwd` for at most `limit`: (exit code or
/// `None` when killed by a signal, stderr, over the limit).
fn pipebd(
    bin: &Path,
    cwd: &Path,
    args: &[String],
    limit: Duration,
) -> Result<(Option<i32>, String, bool), String> {
    let mut child = Command::new(bin)
        .args(args)
        .current_dir(cwd)
        .env_remove("PIPEBD_FAULTS")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    let mut stderr = child.stderr.take().ok_or("no stderr")?;
    let reader = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut text);
        String::from_utf8_lossy(&text).into_owned()
    });
    let started = Instant::now();
    let (code, over) = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break (status.code(), false);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Ok((code, reader.join().unwrap_or_default(), over))
}

const COMMANDS: [&str; 17] = [
    "run",
    "check",
    "eval",
    "plot",
    "search",
    "export",
    "eval-gguf",
    "plan",
    "sweep",
    "profile",
    "bench",
    "kernels",
    "eval-teacher",
    "export-init",
    "help",
    "--version",
    "frobnicate",
];

const FLAGS: [&str; 30] = [
    "--out",
    "--resume",
    "--device",
    "--devices",
    "--schedule",
    "--epochs",
    "--trace",
    "--quiet",
    "--max-failures",
    "--transport",
    "--budget",
    "--pareto",
    "--evaluate",
    "--points",
    "--argmax",
    "--objective",
    "--format",
    "--type",
    "--teacher",
    "--text",
    "--context",
    "--chunks",
    "--save-text",
    "--top",
    "--memory-per-device",
    "--check",
    "--bench",
    "--repeats",
    "--only",
    "--help",
];

/// One argument vector of input `i`, with its config and run folder
/// written into `work` (the config mutated from `base`, the run folder a
/// copy of `run` with one file mutated).
fn argument_vector(rng: &mut Rng, work: &Path, base: &[u8], run: &Path) -> Result<Vec<String>, String> {
    let config = work.join("input.toml");
    let text = if rng.chance(0.15) { base.to_vec() } else { mutate::mutate(rng, base, &[], true) };
    std::fs::write(&config, text).map_err(|e| e.to_string())?;
    let damaged = work.join("input-run");
    let _ = std::fs::remove_dir_all(&damaged);
    copy_dir(run, &damaged)?;
    let files = files_under(&damaged);
    if !files.is_empty() && rng.chance(0.8) {
        let file = rng.pick(&files).clone();
        let bytes = std::fs::read(&file).map_err(|e| e.to_string())?;
        let text = file.extension().is_some_and(|e| e == "json" || e == "csv" || e == "toml");
        std::fs::write(&file, mutate::mutate(rng, &bytes, &[], text)).map_err(|e| e.to_string())?;
    }
    let path_value = |rng: &mut Rng| -> String {
        let choices = [
            config.display().to_string(),
            damaged.display().to_string(),
            run.display().to_string(),
            work.join("missing/nothing.toml").display().to_string(),
            "/dev/null".into(),
            "/dev/zero".into(),
            work.display().to_string(),
            String::new(),
        ];
        rng.pick(&choices).clone()
    };
    let any_value = |rng: &mut Rng| -> String {
        let choices = [
            "0",
            "1",
            "-1",
            "3",
            "1e309",
            "nan",
            "18446744073709551616",
            "cpu",
            "cuda:7",
            "wgpu",
            "tr",
            "auto",
            "gguf",
            "q8_0",
            "flops",
            "loss",
            "local",
            "mpi",
            "\u{1F600}",
            "--",
            "=",
        ];
        rng.pick(&choices).to_string()
    };
    let command = rng.pick(&COMMANDS).to_string();
    let mut args = vec![command.clone()];
    if rng.chance(0.9) {
        args.push(match command.as_str() {
            "eval" | "plot" | "search" | "export" if rng.chance(0.8) => damaged.display().to_string(),
            _ if rng.chance(0.7) => config.display().to_string(),
            _ => path_value(rng),
        });
    }
    // Outputs stay in the work folder.
    if matches!(command.as_str(), "run" | "export" | "bench" | "profile" | "export-init" | "plan") {
        args.extend(["--out".into(), work.join("out").display().to_string()]);
    }
    if command == "run" {
        args.push("--quiet".into());
    }
    for _ in 0..rng.below(4) {
        args.push(rng.pick(&FLAGS).to_string());
        if rng.chance(0.8) {
            args.push(if rng.chance(0.4) { path_value(rng) } else { any_value(rng) });
        }
    }
    Ok(args)
}

/// Fuzzes the command line with `inputs` argument vectors.
pub fn fuzz_cli(
    bin: &Path,
    root: &Path,
    work: &Path,
    (inputs, seed): (u64, u64),
    limit: Duration,
    findings: &Path,
) -> Result<CliTally, String> {
    let started = Instant::now();
    std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
    let base = tiny_config(root, 1);
    let base_path = work.join("base.toml");
    std::fs::write(&base_path, &base).map_err(|e| e.to_string())?;
    let run = work.join("base-run");
    let _ = std::fs::remove_dir_all(&run);
    let args: Vec<String> =
        ["run", &base_path.display().to_string(), "--out", &run.display().to_string(), "--quiet"]
            .map(String::from)
            .to_vec();
    match pipebd(bin, work, &args, Duration::from_secs(600))? {
        (Some(0), _, _) => {}
        (code, stderr, _) => return Err(format!("the base run failed ({code:?}): {stderr}")),
    }
    let mut tally = CliTally::default();
    for i in 0..inputs {
        let mut rng = Rng::for_input(seed, "cli", i);
        let args = argument_vector(&mut rng, work, base.as_bytes(), &run)?;
        let (code, stderr, over) = pipebd(bin, work, &args, limit)?;
        tally.inputs += 1;
        if over {
            tally.over_time += 1;
            continue;
        }
        *tally.exit_codes.entry(code.unwrap_or(-1)).or_default() += 1;
        let errors = stderr.lines().filter(|l| l.starts_with("error")).count();
        if let (Some(c @ 1..=2), Some(line)) = (code, stderr.lines().find(|l| l.starts_with("error"))) {
            let kept = tally.samples.entry(c).or_default();
            let words: String = line.chars().take(160).collect();
            if kept.len() < 12 && !kept.iter().any(|k| k.ends_with(&words)) {
                kept.push(format!("pipebd {} => {words}", args.first().map_or("", String::as_str)));
            }
        }
        let problem = match code {
            None => Some("killed by a signal (a crash)".to_string()),
            Some(c) if !(0..=2).contains(&c) => Some(format!("exit code {c}")),
            _ if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") => Some("a panic".into()),
            Some(1 | 2) if errors != 1 => Some(format!("{errors} error messages instead of one")),
            _ => None,
        };
        if let Some(problem) = problem {
            let kept = findings.join(format!("cli-{i}"));
            let _ = std::fs::create_dir_all(&kept);
            let _ = std::fs::copy(work.join("input.toml"), kept.join("input.toml"));
            let _ = std::fs::write(kept.join("argv.txt"), args.join("\n"));
            let _ = std::fs::write(kept.join("stderr.txt"), &stderr);
            tally.failures.push(format!(
                "input {i}: {problem}: pipebd {} (kept in {})",
                args.join(" "),
                kept.display()
            ));
        }
        if (i + 1) % 50 == 0 {
            eprintln!("fuzz: cli {}/{inputs} inputs, {} failures", i + 1, tally.failures.len());
        }
    }
    tally.seconds = started.elapsed().as_secs_f64();
    Ok(tally)
}

/// Stops a run `rounds` times at random points (a random signal, at a
/// random time up to the whole run's length, sometimes again during the
/// resume), resumes it to the end, and compares its students with the
/// uninterrupted run's.
pub fn fuzz_kills(bin: &Path, root: &Path, work: &Path, rounds: u64, seed: u64) -> Result<KillTally, String> {
    let started = Instant::now();
    std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
    let config = work.join("kill.toml");
    std::fs::write(&config, tiny_config(root, 4)).map_err(|e| e.to_string())?;
    let run = |out: &Path, resume: bool| -> Vec<String> {
        let mut args: Vec<String> =
            ["run", &config.display().to_string(), "--out", &out.display().to_string(), "--quiet"]
                .map(String::from)
                .to_vec();
        if resume {
            args.extend(["--resume".into(), out.display().to_string()]);
        }
        args
    };
    let reference = work.join("reference");
    let _ = std::fs::remove_dir_all(&reference);
    let t0 = Instant::now();
    if pipebd(bin, work, &run(&reference, false), Duration::from_secs(600))?.0 != Some(0) {
        return Err("the uninterrupted run failed".into());
    }
    let whole = t0.elapsed();
    let expected = student_weights(&reference)?;
    let mut tally = KillTally::default();
    for round in 0..rounds {
        let mut rng = Rng::for_input(seed, "kill", round);
        let out = work.join(format!("killed-{round}"));
        let _ = std::fs::remove_dir_all(&out);
        let mut stops = Vec::new();
        let mut resume = false;
        loop {
            let signal = *rng.pick(&["KILL", "KILL", "KILL", "TERM", "INT"]);
            let at = whole.mul_f64(0.05 + 1.05 * (rng.below(1000) as f64 / 1000.0));
            let mut child = Command::new(bin)
                .args(run(&out, resume))
                .current_dir(work)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| e.to_string())?;
            std::thread::sleep(at);
            let ended = child.try_wait().map_err(|e| e.to_string())?.is_some();
            if !ended {
                let _ = Command::new("kill").args(["-s", signal, &child.id().to_string()]).status();
            }
            let status = child.wait().map_err(|e| e.to_string())?;
            stops.push(match ended {
                true => format!("ended before SIG{signal} at {:.2} s", at.as_secs_f64()),
                false => format!("SIG{signal} at {:.2} s -> {:?}", at.as_secs_f64(), status.code()),
            });
            resume = true;
            if ended || !rng.chance(0.3) {
                break;
            }
        }
        let (code, stderr, _) = pipebd(bin, work, &run(&out, true), Duration::from_secs(600))?;
        if code != Some(0) {
            tally.failures.push(format!(
                "round {round} ({}): the resume failed ({code:?}): {stderr}",
                stops.join(", ")
            ));
            continue;
        }
        let got = student_weights(&out)?;
        let worst = max_difference(&expected, &got);
        tally.worst_difference = tally.worst_difference.max(worst);
        if worst > 1e-5 {
            tally.failures.push(format!("round {round} ({}): weights differ by {worst}", stops.join(", ")));
        }
        tally.stops.push(stops.join(", "));
        tally.rounds += 1;
        let _ = std::fs::remove_dir_all(&out);
        eprintln!("fuzz: kill round {}/{rounds}: {}", round + 1, tally.stops.last().map_or("", |s| s));
    }
    tally.seconds = started.elapsed().as_secs_f64();
    Ok(tally)
}

fn max_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.len() != y.len()) {
        return f32::INFINITY;
    }
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

/// Every float parameter of every student block saved in a run folder.
fn student_weights(run_dir: &Path) -> Result<Vec<Vec<f32>>, String> {
    use pipebd_cli::zoo::Zoo;
    struct Flatten(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Flatten {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.extend(param.val().into_data().iter::<f32>());
        }
    }
    let report = pipebd_cli::report::RunReport::read(run_dir).map_err(|e| e.to_string())?;
    let zoo = pipebd_zoo::Builtin;
    let teacher = zoo.teacher_specs(&report.config).map_err(|e| e.to_string())?;
    let (blocks, _) = pipebd_cli::jobs::eval::load_students(&zoo, run_dir, &report.config, &teacher)
        .map_err(|e| e.to_string())?;
    Ok(blocks
        .iter()
        .map(|b| {
            let mut v = Flatten(Vec::new());
            b.visit(&mut v);
            v.0
        })
        .collect())
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn copy_dir(from: &Path, to: &Path) -> Result<(), String> {
    for file in files_under(from) {
        let relative = file.strip_prefix(from).map_err(|e| e.to_string())?;
        let target = to.join(relative);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        std::fs::copy(&file, &target).map_err(|e| format!("{}: {e}", file.display()))?;
    }
    Ok(())
}
