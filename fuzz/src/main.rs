//! `pipebd-fuzz`: mutation fuzzing of every file and frame pipe-bd reads,
//! on stable Rust.
//!
//! Each target (see `--list`) starts from valid inputs (the experiments'
//! configs, files our own writers produce, committed seeds) and feeds
//! mutated copies to the very function `pipebd` calls on that file. A
//! worker process runs the inputs; this process supervises it, so that a
//! panic, an abort (an allocation past the ceiling: what a header merely
//! claims), a crash or a hang (an input running over `--hang-ms`) is
//! recorded with the input that caused it (under `--out`), and the fuzzing
//! goes on with the next input. Inputs are a function of `--seed`, the
//! target and their number, so every finding replays.
//!
//! ```sh
//! cargo run --release -p pipebd-fuzz -- --minutes 10          # every target
//! cargo run --release -p pipebd-fuzz -- --targets gguf --inputs 100000 --check
//! ```

mod alloc;
mod cli;
mod mutate;
mod targets;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

/// Fuzz pipe-bd's readers with mutated copies of valid inputs.
#[derive(Parser, Debug)]
#[command(name = "pipebd-fuzz", version)]
struct Args {
    /// Comma-separated targets (default: all; `--list` names them).
    #[arg(long, value_delimiter = ',')]
    targets: Vec<String>,
    /// Inputs per target (default: as many as `--minutes` allow).
    #[arg(long)]
    inputs: Option<u64>,
    /// Minutes in all, shared evenly by the targets (default 1; with
    /// `--inputs`, a limit).
    #[arg(long)]
    minutes: Option<f64>,
    /// The seed every input derives from.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// An input running longer than this is a hang (milliseconds).
    #[arg(long, default_value_t = 2000)]
    hang_ms: u64,
    /// Where the findings (inputs that panicked, crashed or hung) and
    /// summary.json go.
    #[arg(long, default_value = "runs/fuzz")]
    out: PathBuf,
    /// Exit with 1 if any input panicked, crashed, hung, or was read wrong.
    #[arg(long)]
    check: bool,
    /// List the targets and exit.
    #[arg(long)]
    list: bool,
    /// Also run the `pipebd` binary under this many random argument vectors
    /// (mutated configs and run folders); alone, only that.
    #[arg(long)]
    cli: Option<u64>,
    /// Also stop this many runs at random points (SIGKILL, SIGTERM, SIGINT)
    /// and check that resuming them ends with the uninterrupted weights.
    #[arg(long)]
    kills: Option<u64>,
    /// A `pipebd` process of `--cli` running longer than this is stopped
    /// and counted apart (a real run of a config asking for much work).
    #[arg(long, default_value_t = 20)]
    cli_limit_s: u64,
    /// The `pipebd` binary (default: beside this one).
    #[arg(long)]
    pipebd: Option<PathBuf>,
    /// Run inputs `--from`..`--to` of one target (what the supervisor starts).
    #[arg(long, hide = true)]
    worker: Option<String>,
    #[arg(long, hide = true, default_value_t = 0)]
    from: u64,
    #[arg(long, hide = true, default_value_t = 0)]
    to: u64,
    #[arg(long, hide = true)]
    work: Option<PathBuf>,
    #[arg(long, hide = true)]
    findings: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(target) = &args.worker {
        return worker(&args, target);
    }
    if args.list {
        for t in targets::all() {
            println!("{:16} {}", t.name, t.what);
        }
        return ExitCode::SUCCESS;
    }
    let whole_cli = args.cli.is_some() || args.kills.is_some();
    let outcome = match (whole_cli, args.targets.is_empty()) {
        (true, true) => fuzz_command_line(&args),
        (true, false) => supervise(&args).and_then(|clean| Ok(fuzz_command_line(&args)? && clean)),
        (false, _) => supervise(&args),
    };
    match outcome {
        Ok(clean) if clean || !args.check => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(message) => {
            eprintln!("pipebd-fuzz: error: {message}");
            ExitCode::from(2)
        }
    }
}

// ---------------------------------------------------------- command line

/// `--cli` and `--kills`: the `pipebd` binary end to end. Writes `cli.json`
/// and `kills.json` into `--out`; true when nothing failed.
fn fuzz_command_line(args: &Args) -> Result<bool, String> {
    let bin = match &args.pipebd {
        Some(path) => path.clone(),
        None => std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("pipebd"),
    };
    if !bin.is_file() {
        return Err(format!("{}: no pipebd binary (build it, or give --pipebd)", bin.display()));
    }
    let root = std::env::current_dir().map_err(|e| e.to_string())?;
    // The processes run in the work folder: every path they get is absolute.
    let out = root.join(&args.out);
    let findings = out.join("findings");
    std::fs::create_dir_all(&findings).map_err(|e| format!("{}: {e}", findings.display()))?;
    let mut clean = true;
    if let Some(inputs) = args.cli {
        let work = out.join("cli-work");
        let limit = Duration::from_secs(args.cli_limit_s);
        let tally = cli::fuzz_cli(&bin, &root, &work, (inputs, args.seed), limit, &findings)?;
        eprintln!(
            "fuzz: cli: {} inputs in {:.0} s, exit codes {:?}, {} over {} s, {} failures",
            tally.inputs,
            tally.seconds,
            tally.exit_codes,
            tally.over_time,
            args.cli_limit_s,
            tally.failures.len()
        );
        for failure in &tally.failures {
            eprintln!("  {failure}");
        }
        clean &= tally.failures.is_empty();
        write_json(&out.join("cli.json"), &tally)?;
    }
    if let Some(rounds) = args.kills {
        let tally = cli::fuzz_kills(&bin, &root, &out.join("kill-work"), rounds, args.seed)?;
        eprintln!(
            "fuzz: kills: {} rounds in {:.0} s, worst weight difference {:e}, {} failures",
            tally.rounds,
            tally.seconds,
            tally.worst_difference,
            tally.failures.len()
        );
        for failure in &tally.failures {
            eprintln!("  {failure}");
        }
        clean &= tally.failures.is_empty();
        write_json(&out.join("kills.json"), &tally)?;
    }
    Ok(clean)
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), String> {
    let json = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, json).map_err(|e| format!("{}: {e}", path.display()))
}

// ---------------------------------------------------------------- worker

/// The bytes a reader may hold for an input of `len` bytes: twice the file,
/// plus room for what a valid file of the seeds' sizes needs (a tokenizer,
/// a small model, a plot).
fn allowance(len: usize, heavy: bool) -> usize {
    let room: usize = if heavy { (4 << 30) + (512 << 20) } else { 512 << 20 };
    len.saturating_mul(2).saturating_add(room)
}

fn worker(args: &Args, name: &str) -> ExitCode {
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    let Some(target) = targets::all().into_iter().find(|t| t.name == name) else {
        say(format!("fatal unknown target {name}"));
        return ExitCode::from(3);
    };
    let work = args.work.clone().unwrap_or_else(|| std::env::temp_dir().join("pipebd-fuzz"));
    let input = work.join(target.file);
    if let Err(e) = std::fs::create_dir_all(input.parent().unwrap_or(&work)) {
        say(format!("fatal {}: {e}", work.display()));
        return ExitCode::from(3);
    }
    let mut corpus = match target.valid_inputs(&work) {
        Ok(seeds) if !seeds.is_empty() => seeds,
        Ok(_) => {
            say(format!("fatal target {name} has no seeds"));
            return ExitCode::from(3);
        }
        Err(e) => {
            say(format!("fatal seeds of {name}: {e}"));
            return ExitCode::from(3);
        }
    };
    // A panic's message goes to the supervisor, not to stderr.
    std::panic::set_hook(Box::new(|info| {
        let message = match info.payload().downcast_ref::<&str>() {
            Some(s) => s.to_string(),
            None => info.payload().downcast_ref::<String>().cloned().unwrap_or_default(),
        };
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        LAST_PANIC.with(|p| *p.borrow_mut() = format!("{message}{at}"));
    }));
    let mut classes = BTreeSet::new();
    // The slowest input and the one that made the reader hold the most
    // memory are kept (`slowest-*`, `hungriest-*` in the findings).
    let (mut slowest, mut hungriest) = (0u128, 0usize);
    let findings = args.findings.clone().unwrap_or_else(|| work.join("findings"));
    let _ = std::fs::create_dir_all(&findings);
    let file_name = target.file_name();
    say(format!("ready {}", corpus.len()));
    for i in args.from..args.to {
        let mut rng = mutate::Rng::for_input(args.seed, name, i);
        let seed = corpus[rng.below(corpus.len())].clone();
        let data = if i == args.from && args.from == 0 {
            seed
        } else {
            mutate::mutate(&mut rng, &seed, &corpus, target.text)
        };
        if let Err(e) = std::fs::write(&input, &data) {
            say(format!("fatal {}: {e}", input.display()));
            return ExitCode::from(3);
        }
        say(format!("start {i}"));
        let baseline = alloc::start_input(allowance(data.len(), target.heavy));
        let started = Instant::now();
        let result = std::panic::catch_unwind(|| (target.run)(&input, &work));
        let ms = started.elapsed().as_millis();
        let peak = alloc::peak_above(baseline);
        alloc::no_ceiling();
        let (kind, text) = match result {
            Ok(targets::Outcome::Accepted) => ("ok", String::new()),
            Ok(targets::Outcome::Refused(message)) => ("err", message),
            Ok(targets::Outcome::Wrong(message)) => ("wrong", message),
            Err(_) => ("panic", LAST_PANIC.with(|p| p.borrow().clone())),
        };
        let text = text.replace(['\n', '\r'], " ");
        if ms > slowest && i > args.from {
            slowest = ms;
            let _ = std::fs::write(findings.join(format!("slowest-{file_name}")), &data);
        }
        if peak > hungriest && i > args.from {
            hungriest = peak;
            let _ = std::fs::write(findings.join(format!("hungriest-{file_name}")), &data);
        }
        // Inputs that reach an error not seen before join the corpus (a
        // cheap stand-in for coverage feedback).
        if kind == "err" && classes.insert(error_class(&text, &work)) && corpus.len() < 512 {
            corpus.push(data.clone());
        }
        say(format!("done {i} {ms} {peak} {} {kind} {text}", data.len()));
        if kind == "panic" || kind == "wrong" {
            // The supervisor keeps this input (still in place) and starts a
            // fresh worker: a panic may leave locks poisoned behind it.
            return ExitCode::from(RESTART);
        }
    }
    ExitCode::SUCCESS
}

/// The worker's exit code after a panic or a wrong read: start another.
const RESTART: u8 = 4;

thread_local! {
    static LAST_PANIC: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// An error message with its numbers and the work folder taken out: errors
/// of one kind at other places count once.
fn error_class(message: &str, work: &Path) -> String {
    let message = message.replace(&work.display().to_string(), "<work>");
    let mut out = String::new();
    let mut in_number = false;
    for c in message.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('#');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
    }
    out.chars().take(120).collect()
}

// ------------------------------------------------------------ supervisor

/// What one target gave.
#[derive(Debug, Default, serde::Serialize)]
struct Tally {
    target: String,
    inputs: u64,
    accepted: u64,
    refused: u64,
    distinct_errors: usize,
    errors_naming_the_file: u64,
    panics: u64,
    crashes: u64,
    hangs: u64,
    wrong: u64,
    slowest_ms: u64,
    peak_bytes: u64,
    peak_over_input: f64,
    seconds: f64,
    samples: Vec<String>,
    /// Refusals that do not name the file (a few).
    unnamed: Vec<String>,
    findings: Vec<String>,
}

/// Runs every chosen target; returns whether nothing went wrong.
fn supervise(args: &Args) -> Result<bool, String> {
    let all = targets::all();
    let chosen: Vec<&targets::Target> = if args.targets.is_empty() {
        all.iter().collect()
    } else {
        args.targets
            .iter()
            .map(|name| {
                all.iter().find(|t| t.name == name).ok_or_else(|| {
                    let names: Vec<&str> = all.iter().map(|t| t.name).collect();
                    format!("unknown target `{name}` (known: {})", names.join(", "))
                })
            })
            .collect::<Result<_, _>>()?
    };
    let minutes = args.minutes.unwrap_or(if args.inputs.is_some() { f64::INFINITY } else { 1.0 });
    let per_target = Duration::from_secs_f64((minutes * 60.0 / chosen.len() as f64).min(1e9));
    let inputs = args.inputs.unwrap_or(u64::MAX);
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut tallies = Vec::new();
    for target in chosen {
        let tally = fuzz_target(&exe, args, target, inputs, per_target)?;
        eprintln!(
            "fuzz: {:16} {:>9} inputs in {:>5.0} s: {} accepted, {} refused ({} distinct errors, {:.0}% name the file), {} panics, {} crashes, {} hangs, {} wrong; slowest {} ms, peak {:.1} MB",
            tally.target,
            tally.inputs,
            tally.seconds,
            tally.accepted,
            tally.refused,
            tally.distinct_errors,
            100.0 * tally.errors_naming_the_file as f64 / tally.refused.max(1) as f64,
            tally.panics,
            tally.crashes,
            tally.hangs,
            tally.wrong,
            tally.slowest_ms,
            tally.peak_bytes as f64 / 1e6
        );
        tallies.push(tally);
    }
    print_summary(&tallies);
    let json = serde_json::to_string_pretty(&tallies).map_err(|e| e.to_string())?;
    let summary = args.out.join("summary.json");
    std::fs::write(&summary, json).map_err(|e| format!("{}: {e}", summary.display()))?;
    eprintln!("fuzz: wrote {} (findings under {})", summary.display(), args.out.join("findings").display());
    Ok(tallies.iter().all(|t| t.panics + t.crashes + t.hangs + t.wrong == 0))
}

fn print_summary(tallies: &[Tally]) {
    println!(
        "| target | inputs | inputs/s | accepted | refused | distinct errors | name the file | panics | crashes | hangs | wrong | slowest ms | peak MB |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for t in tallies {
        println!(
            "| {} | {} | {:.0} | {} | {} | {} | {:.0}% | {} | {} | {} | {} | {} | {:.1} |",
            t.target,
            t.inputs,
            t.inputs as f64 / t.seconds.max(1e-9),
            t.accepted,
            t.refused,
            t.distinct_errors,
            100.0 * t.errors_naming_the_file as f64 / t.refused.max(1) as f64,
            t.panics,
            t.crashes,
            t.hangs,
            t.wrong,
            t.slowest_ms,
            t.peak_bytes as f64 / 1e6
        );
    }
}

/// A started worker: its process, its stdout lines and its stderr's tail.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

fn start_worker(
    exe: &Path,
    args: &Args,
    target: &str,
    from: u64,
    to: u64,
    work: &Path,
) -> Result<Running, String> {
    let mut child = Command::new(exe)
        .args(["--worker", target, "--seed", &args.seed.to_string()])
        .args(["--from", &from.to_string(), "--to", &to.to_string()])
        .arg("--work")
        .arg(work)
        .arg("--findings")
        .arg(args.out.join("findings").join(target))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start a worker ({}): {e}", exe.display()))?;
    let stdout = child.stdout.take().ok_or("no worker stdout")?;
    let mut stderr = child.stderr.take().ok_or("no worker stderr")?;
    let (send, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if send.send(line).is_err() {
                break;
            }
        }
    });
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        let start = text.len().saturating_sub(2000);
        text[text.floor_char_boundary(start)..].to_string()
    });
    Ok(Running { child, lines, stderr })
}

/// One target's fuzzing under way: its counts and where its findings go.
struct Progress<'a> {
    target: &'a targets::Target,
    work: PathBuf,
    findings: PathBuf,
    hang_ms: u64,
    tally: Tally,
    classes: BTreeSet<String>,
    samples: BTreeMap<String, String>,
}

impl Progress<'_> {
    /// Counts a worker's `done <i> <ms> <peak> <len> <kind> <text>`;
    /// returns the input after it.
    fn done(&mut self, rest: &str) -> u64 {
        let mut parts = rest.splitn(6, ' ');
        let mut number = || parts.next().and_then(|p| p.parse::<u64>().ok()).unwrap_or(0);
        let (i, ms, peak, len) = (number(), number(), number(), number());
        let kind = parts.next().unwrap_or("");
        let text = parts.next().unwrap_or("").to_string();
        let tally = &mut self.tally;
        tally.inputs += 1;
        tally.slowest_ms = tally.slowest_ms.max(ms);
        tally.peak_bytes = tally.peak_bytes.max(peak);
        tally.peak_over_input = tally.peak_over_input.max(peak as f64 / len.max(1) as f64);
        match kind {
            "ok" => tally.accepted += 1,
            "err" => self.refused(&text),
            "wrong" => {
                self.tally.wrong += 1;
                self.finding(i, "wrong", &text);
            }
            _ => {
                self.tally.panics += 1;
                self.finding(i, "panic", &text);
            }
        }
        if ms > self.hang_ms {
            self.tally.hangs += 1;
            self.finding(i, "slow", &format!("{ms} ms"));
        }
        i + 1
    }

    fn refused(&mut self, text: &str) {
        let work = self.work.display().to_string();
        let file_name = self.target.file_name();
        self.tally.refused += 1;
        if text.contains(&file_name) || text.contains(&work) {
            self.tally.errors_naming_the_file += 1;
        } else if self.tally.unnamed.len() < 5 {
            self.tally.unnamed.push(text.to_string());
        }
        let class = error_class(text, &self.work);
        if self.classes.insert(class.clone()) && self.samples.len() < 12 {
            self.samples.insert(class, text.replace(&work, "<work>"));
        }
    }

    /// Keeps the input of a finding (`<kind>-<number>-<file>`) and what it did.
    fn finding(&mut self, i: u64, kind: &str, note: &str) {
        let name = self.target.file_name();
        let kept = self.findings.join(format!("{kind}-{i}-{name}"));
        let _ = std::fs::create_dir_all(&self.findings);
        let _ = std::fs::copy(self.work.join(self.target.file), &kept);
        let _ = std::fs::write(kept.with_extension("txt"), format!("{kind}: {note}\n"));
        eprintln!("fuzz: {} input {i}: {kind}: {note} (input kept in {})", self.target.name, kept.display());
        if self.tally.findings.len() < 50 {
            self.tally.findings.push(format!("{kind} {i}: {note}"));
        }
    }
}

/// How a worker's run ended.
enum WorkerEnd {
    /// It exited (with this status) while on input `.1`, if any.
    Exited(std::process::ExitStatus, Option<u64>),
    /// It was killed: a hang, or the time was up.
    Killed,
}

/// Follows one worker until it exits, hangs or the time is up.
fn follow(
    progress: &mut Progress<'_>,
    running: &mut Running,
    next: &mut u64,
    deadline: Instant,
) -> Result<WorkerEnd, String> {
    let hang = Duration::from_millis(progress.hang_ms);
    let (mut current, mut ready) = (None::<(u64, Instant)>, false);
    let (started, mut last_report) = (Instant::now(), Instant::now());
    loop {
        if Instant::now() >= deadline {
            let _ = running.child.kill();
            return Ok(WorkerEnd::Killed);
        }
        match running.lines.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                let (word, rest) = line.split_once(' ').unwrap_or((line.as_str(), ""));
                match word {
                    "ready" => ready = true,
                    "fatal" => {
                        let _ = running.child.kill();
                        return Err(format!("target {}: {rest}", progress.target.name));
                    }
                    "start" => current = Some((rest.parse().unwrap_or(*next), Instant::now())),
                    "done" => {
                        current = None;
                        *next = progress.done(rest);
                    }
                    _ => {}
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => match current {
                Some((i, at)) if at.elapsed() >= hang => {
                    let _ = running.child.kill();
                    let _ = running.child.wait();
                    progress.tally.hangs += 1;
                    progress.tally.inputs += 1;
                    progress.finding(i, "hang", &format!("still running after {} ms", progress.hang_ms));
                    *next = i + 1;
                    return Ok(WorkerEnd::Killed);
                }
                None if !ready && started.elapsed() > Duration::from_secs(120) => {
                    let _ = running.child.kill();
                    return Err(format!(
                        "target {}: the worker did not start in 120 s",
                        progress.target.name
                    ));
                }
                _ => {}
            },
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = running.child.wait().map_err(|e| e.to_string())?;
                return Ok(WorkerEnd::Exited(status, current.map(|c| c.0)));
            }
        }
        if last_report.elapsed() > Duration::from_secs(15) {
            last_report = Instant::now();
            let t = &progress.tally;
            eprintln!(
                "fuzz: {} {} inputs, {} panics, {} crashes, {} hangs",
                progress.target.name, t.inputs, t.panics, t.crashes, t.hangs
            );
        }
    }
}

fn fuzz_target(
    exe: &Path,
    args: &Args,
    target: &targets::Target,
    inputs: u64,
    budget: Duration,
) -> Result<Tally, String> {
    let started = Instant::now();
    let mut progress = Progress {
        target,
        work: std::env::temp_dir().join(format!("pipebd-fuzz-{}-{}", std::process::id(), target.name)),
        findings: args.out.join("findings").join(target.name),
        hang_ms: if target.heavy { 5 * args.hang_ms } else { args.hang_ms },
        tally: Tally { target: target.name.to_string(), ..Default::default() },
        classes: BTreeSet::new(),
        samples: BTreeMap::new(),
    };
    let work = progress.work.clone();
    let mut next = 0u64;
    while next < inputs && started.elapsed() < budget {
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
        let mut running = start_worker(exe, args, target.name, next, inputs, &work)?;
        let end = follow(&mut progress, &mut running, &mut next, started + budget)?;
        let stderr = running.stderr.join().unwrap_or_default();
        match end {
            WorkerEnd::Killed => {}
            WorkerEnd::Exited(status, Some(i)) => {
                // The worker died inside an input: an abort or a crash.
                progress.tally.crashes += 1;
                progress.tally.inputs += 1;
                progress.finding(i, "crash", &format!("worker ended with {status}: {}", stderr.trim()));
                next = i + 1;
            }
            WorkerEnd::Exited(status, None) if status.code() == Some(RESTART as i32) => {}
            WorkerEnd::Exited(status, None) if status.success() => break,
            WorkerEnd::Exited(status, None) => {
                return Err(format!(
                    "target {}: the worker ended with {status}: {}",
                    target.name,
                    stderr.trim()
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    let mut tally = progress.tally;
    tally.distinct_errors = progress.classes.len();
    tally.samples = progress.samples.into_values().collect();
    tally.seconds = started.elapsed().as_secs_f64();
    Ok(tally)
}
