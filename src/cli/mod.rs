//! The `pipebd` command line, for any [`Zoo`]: `pipebd` itself is
//! [`run_with`]`(Builtin)`, and a user crate with its own teachers, students
//! and datasets gets the same commands for them with its own zoo (see
//! `examples/custom_zoo.rs`).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::config::Overrides;
use crate::train::Progress;
use crate::zoo::Zoo;
use crate::Error;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

mod print;

use print::{print_bench, print_blocks, print_resilience, print_text_report};

/// Pipelined parallel blockwise knowledge distillation.
#[derive(Parser)]
#[command(name = "pipebd", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Distil a student from a teacher as described by a run config (TOML).
    Run {
        /// The run config, e.g. experiments/mnist-cnn.toml.
        config: PathBuf,
        /// Folder that receives report.json, metrics.csv, the student weights
        /// and checkpoints/ (default: the --resume folder, else runs/latest);
        /// created if missing, and must not be a file.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Continue the run saved in this folder from the newest complete
        /// checkpoint of each block (a damaged one falls back to the older).
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Worker failures to survive by re-routing or re-planning (overrides
        /// `runtime.max_failures`); one more stops the run, checkpoints intact.
        #[arg(long)]
        max_failures: Option<usize>,
        /// Override the config's `device` (cpu, cuda[:N], wgpu[:N]).
        #[arg(long)]
        device: Option<String>,
        /// Override the config's device slots, comma-separated (e.g. cpu,cpu or cuda:0,cuda:1).
        #[arg(long, value_delimiter = ',')]
        devices: Option<Vec<String>>,
        /// Override the config's schedule (ideal, dp, ls, tr, tr-dpu, hybrid).
        #[arg(long)]
        schedule: Option<String>,
        /// Record every worker's spans to trace.json (Chrome trace format).
        #[arg(long)]
        trace: bool,
        /// Override the config's `train.epochs`.
        #[arg(long)]
        epochs: Option<usize>,
        /// Hide the progress bar.
        #[arg(long)]
        quiet: bool,
        /// How the processes of a run talk: `auto` (MPI when started by
        /// `mpirun`/`srun` with more than one rank), `local` (one process),
        /// `mpi` (needs a build with `--features mpi`).
        #[arg(long, default_value = "auto", value_parser = crate::runtime::transport::TransportChoice::parse)]
        transport: crate::runtime::transport::TransportChoice,
    },
    /// Time the same workload under several schedules side by side, with the
    /// speedups the single-device block costs predict.
    Bench {
        /// The run config (data, teacher, students, batch size, device slots).
        config: PathBuf,
        /// Schedules to compare, comma-separated (`hybrid` uses the config's [[stages]]).
        #[arg(long, value_delimiter = ',', default_value = "dp,ls,tr,tr-dpu")]
        schedules: Vec<String>,
        /// Override the config's device slots, comma-separated (e.g. cpu,cpu).
        #[arg(long, value_delimiter = ',')]
        devices: Option<Vec<String>>,
        /// Folder that receives bench.json and bench.csv.
        #[arg(long, default_value = "runs/bench")]
        out: PathBuf,
    },
    /// Measure every block's costs at the batch share of 1..W replicas (the planner's input).
    Profile {
        /// The run config (data, teacher, students, batch size, device slots).
        config: PathBuf,
        /// Override the config's device slots; W is their number.
        #[arg(long, value_delimiter = ',')]
        devices: Option<Vec<String>>,
        /// Where to write the profile.
        #[arg(long, default_value = "runs/profile.json")]
        out: PathBuf,
    },
    /// What a hand-off costs between threads and, under `mpirun -np 2`,
    /// between processes; the link fitted to it; and the simulated step time
    /// of 8, 16 and 64 ranks on that link and on 10 and 100 Gb/s links.
    Link {
        /// The run config (teacher, students, batch size).
        config: PathBuf,
        /// Round trips per message.
        #[arg(long, default_value_t = 20)]
        rounds: usize,
        /// Folder that receives link.json.
        #[arg(long, default_value = "runs/link")]
        out: PathBuf,
    },
    /// Choose stage cuts and replica counts for W device slots from a profile (AHD).
    Plan {
        /// A profile written by `pipebd profile`.
        profile: PathBuf,
        /// Number of device slots W to plan for (may exceed the profiled ones).
        #[arg(long)]
        devices: usize,
        /// Memory per device slot in bytes; stages that need more are rejected.
        #[arg(long)]
        memory_per_device: Option<u64>,
        /// How many plans to show, best first.
        #[arg(long, default_value_t = 5)]
        top: usize,
        /// Where to write the chosen plan (TOML, the runtime's `[[stages]]` format).
        #[arg(long, default_value = "runs/plan.toml")]
        out: PathBuf,
    },
    /// Run a grid of configs (resumable) and plot throughput and speedup.
    Sweep {
        /// The sweep file (`base`, `out`, `x` and a `[grid]` of dotted config fields).
        sweep: PathBuf,
    },
    /// Choose one trained candidate per block of a search run (a config
    /// whose blocks list `candidates`) under a budget, writing the chosen
    /// student as a run config; or, with --pareto, every budget's optimum.
    Search {
        /// The search run's folder (`pipebd run --out`), holding search.json.
        run_dir: PathBuf,
        /// The budget: flops=N (forward FLOPs per sample), params=N, or
        /// latency=MS (forward ms per batch, as measured by the run).
        #[arg(long)]
        budget: Option<String>,
        /// Where to write the chosen config (default: <run_dir>/chosen.toml).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Write pareto.csv and pareto.png into the run folder: the optimum
        /// of every budget on this cost (flops, params or latency).
        #[arg(long)]
        pareto: Option<String>,
        /// With --pareto: score each point's stitched student (the trained
        /// candidates, not finetuned) on the test set.
        #[arg(long)]
        evaluate: bool,
        /// Choose each block's candidate with the largest architecture
        /// weight (a single-path search's result) into chosen.toml.
        #[arg(long, conflicts_with = "budget")]
        argmax: bool,
        /// What --budget and --pareto minimise, summed over blocks: `block`
        /// (each candidate's held-out loss against its teacher block, over
        /// the best of its block's) or `output` (the teacher's output loss
        /// with only that block replaced: comparable across blocks).
        #[arg(long, default_value = "block")]
        objective: String,
    },
    /// Reload the student saved by `pipebd run` and score it on the test set.
    Eval {
        /// The run folder given to `pipebd run --out`.
        run_dir: PathBuf,
    },
    /// Score the config's teacher on the test set.
    EvalTeacher {
        /// The run config naming the teacher and the data.
        config: PathBuf,
    },
    /// Check the fused ops (losses, linear, convolutions, max-pool) against burn's ops, and time them
    Kernels {
        /// Where to run: cpu (flex: our native CPU paths, burn ops for the rest), wgpu[:N] or cuda[:N].
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Compare every fused op and its gradients with burn's unfused ops.
        #[arg(long)]
        check: bool,
        /// Time fused against unfused at the MNIST workload's sizes.
        #[arg(long)]
        bench: bool,
        /// Timed calls per case and side (the median is shown).
        #[arg(long, default_value_t = 10)]
        repeats: usize,
        /// Samples per batch of the timed cases.
        #[arg(long, default_value_t = 256)]
        batch: usize,
        /// Time only these ops (comma-separated name prefixes, e.g. conv3x3,adam-step).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Seed of the check's random inputs (default: drawn from the clock and printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Print every checked case, not one line per op and quantity.
        #[arg(long)]
        verbose: bool,
    },
    /// Check a config without running it: syntax, fields, student shapes,
    /// device, and that the data files and teacher weights are there and load.
    Check {
        /// The run config.
        config: PathBuf,
    },
    /// Write the students' initial weights (as a run with this config starts
    /// them) to JSON, one file per block: to start another framework's
    /// training from the same weights (bench/peers/mnist_cnn_torch.py --init).
    ExportInit {
        /// The run config.
        config: PathBuf,
        /// Folder that receives block-K.json.
        #[arg(long, default_value = "runs/init")]
        out: PathBuf,
    },
}

/// The `pipebd` command line with the built-in zoo ([`run_with`]`(Builtin)`).
///
/// Not generic, so the library compiles the whole engine for the built-in zoo
/// once, here, and `pipebd` and the tests link that copy: in a release build
/// every crate that names `Builtin` in a generic call compiles the engine for
/// it again (minutes for each).
pub fn run_builtin() -> ExitCode {
    run_with(crate::zoo::Builtin)
}

/// Parses the command line and runs the command with the teachers, students
/// and datasets of `zoo`; prints errors and returns the exit status (2 for
/// errors in the user's input, 1 otherwise).
pub fn run_with<Z: Zoo>(zoo: Z) -> ExitCode {
    let cli = Cli::parse();
    match execute(&zoo, cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match crate::runtime::transport::launcher_rank() {
                Some(rank) => eprintln!("error (rank {rank}): {e}"),
                None => eprintln!("error: {e}"),
            }
            if e.is_user_error() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// Ends this rank's part in a multi-process run: flushes its last messages
/// and shuts MPI down. After a failure a peer may be gone, and shutting down
/// waits for peers in some MPI libraries: the process then exits on its own
/// after a grace period rather than hang.
fn close_transport(transport: std::sync::Arc<dyn crate::runtime::transport::Transport>, failed: bool) {
    if failed {
        let rank = transport.rank();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(15));
            eprintln!("pipebd: rank {rank}: MPI did not shut down within 15 s of the failure; exiting");
            std::process::exit(1);
        });
    }
    drop(transport);
}

fn execute<Z: Zoo>(zoo: &Z, command: Command) -> Result<(), Error> {
    match command {
        Command::Run {
            config,
            out,
            resume,
            max_failures,
            device,
            devices,
            schedule,
            trace,
            epochs,
            quiet,
            transport,
        } => {
            let out = out.or_else(|| resume.clone()).unwrap_or_else(|| PathBuf::from("runs/latest"));
            let config = zoo.load_config(&config, Overrides { device, devices, schedule, epochs })?;
            let transport = crate::runtime::transport::open(transport)?;
            let rank = transport.as_ref().map_or(0, |t| t.rank());
            let mut view = ProgressView::new(quiet || rank != 0);
            let mut observer = |p: &Progress| view.show(p);
            let options = crate::run::RunFlags { trace, resume, max_failures };
            let report = crate::run::run_rank(zoo, &config, &out, &options, transport.clone(), &mut observer);
            view.finish();
            if let Some(transport) = transport {
                close_transport(transport, report.is_err());
            }
            let Some(report) = report? else {
                return Ok(());
            };
            println!(
                "run `{}`: schedule {} {} on {}",
                report.name, report.schedule, report.plan, report.device
            );
            match &report.text {
                None => println!(
                    "teacher accuracy {:.2}%  student accuracy {:.2}%  ({} test images)",
                    100.0 * report.teacher_accuracy,
                    100.0 * report.student_accuracy,
                    report.test_samples
                ),
                Some(text) => print_text_report(text),
            }
            print_blocks(&report.blocks);
            let resumed = if report.steps_run < report.steps {
                format!(" (of {}; the rest came from checkpoints)", report.steps)
            } else {
                String::new()
            };
            println!(
                "trained {} steps{resumed} in {:.1}s ({:.0} samples/s); whole run {:.1}s",
                report.steps_run, report.train_seconds, report.samples_per_second, report.wall_seconds
            );
            for w in &report.workers {
                println!(
                    "worker {} ({}, slot {}): busy {:.0}%",
                    w.worker,
                    w.role,
                    w.slot,
                    100.0 * w.busy_fraction
                );
            }
            if let Some(s) = &report.stitched {
                let losses: Vec<String> = s.final_losses.iter().map(|l| format!("{l:.5}")).collect();
                println!(
                    "then stitched ({} gradients): {} epochs, {} steps at lr {} in {:.1}s; final losses [{}]",
                    s.gradients.name(),
                    s.epochs,
                    s.steps,
                    s.lr,
                    s.seconds,
                    losses.join(" ")
                );
                if let (Some(kind), Some(value)) = (&s.output_loss, s.final_output_loss) {
                    let weight = s.output_weight.unwrap_or(1.0);
                    println!("  output loss {kind} (weight {weight}): {value:.5} over the last epoch");
                }
            }
            print_resilience(&report.resilience);
            let trace_note = if trace { ", trace.json" } else { "" };
            println!("wrote {}/report.json, metrics.csv, student/{trace_note}", out.display());
            if report.config.has_candidates() {
                println!(
                    "search: every candidate scored on the held-out {:.0}% of the training samples in \
                     {}/search.json and search.csv (weights in candidates/); choose with \
                     `pipebd search {} --budget flops=N`{} or `--pareto flops`",
                    100.0 * report.config.search.held_out,
                    out.display(),
                    out.display(),
                    if report.config.search.mode == crate::config::SearchMode::SinglePath {
                        ", `--argmax` (alpha's choice)"
                    } else {
                        ""
                    }
                );
            }
            Ok(())
        }
        Command::Link { config, rounds, out } => {
            let config = zoo.load_config(&config, Overrides::default())?;
            let transport =
                crate::runtime::transport::open(crate::runtime::transport::TransportChoice::Auto)?;
            let mut say = |line: &str| eprintln!("link: {line}");
            let report = crate::link::link_bench(zoo, &config, transport.clone(), rounds, &out, &mut say);
            if let Some(transport) = transport {
                close_transport(transport, report.is_err());
            }
            if let Some(report) = report? {
                print::print_link(&report);
                println!("wrote {}", out.join("link.json").display());
            }
            Ok(())
        }
        Command::Bench { config, schedules, devices, out } => {
            let config = zoo.load_config(&config, Overrides { devices, ..Default::default() })?;
            let mut say = |line: &str| eprintln!("bench: {line}");
            let report = crate::bench::bench(zoo, &config, &schedules, &out, &mut say)?;
            print_bench(&report);
            println!("wrote {}/bench.json and bench.csv", out.display());
            Ok(())
        }
        Command::Profile { config, devices, out } => {
            let config = zoo.load_config(&config, Overrides { devices, ..Default::default() })?;
            let slots = config.device_slots().len();
            let mut say = |line: &str| eprintln!("profile: {line}");
            let profile = crate::profile::profile(zoo, &config, slots, &out, &mut say)?;
            println!(
                "block  g  batch  teacher fwd (ms)  student step (ms)  grad avg (ms)  input (ms)  peak MiB"
            );
            let ms = |t: &Option<crate::profile::Timing>| {
                t.map_or("infeasible".to_string(), |t| {
                    format!("{:.2} ±{:.0}%", 1e3 * t.median, 100.0 * t.spread)
                })
            };
            for (k, row) in profile.entries.iter().enumerate() {
                for e in row {
                    println!(
                        "{:>5} {:>2} {:>6}  {:>16}  {:>17}  {:>13}  {:>10}  {:>8}",
                        k + 1,
                        e.replicas,
                        e.batch,
                        ms(&e.teacher_forward),
                        ms(&e.student_step),
                        ms(&e.gradient_average),
                        ms(&e.input_transfer),
                        e.peak_memory_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1048576.0))
                    );
                }
            }
            println!("wrote {}", out.display());
            Ok(())
        }
        Command::Plan { profile, devices, memory_per_device, top, out } => {
            let profile = crate::profile::Profile::read(&profile)?;
            let table = profile.cost_table(devices);
            let start = std::time::Instant::now();
            let plans = crate::planning::planner::plan(&table, devices, memory_per_device, top.max(1));
            let seconds = start.elapsed().as_secs_f64();
            let Some(best) = plans.first() else {
                return Err(Error::Plan {
                    plan: crate::Schedule::Auto.name().into(),
                    message: format!("no plan of the {} blocks on {devices} slots fits (memory limit {memory_per_device:?})", table.blocks()),
                });
            };
            println!("{} blocks on {devices} slots (searched in {:.3} ms):", table.blocks(), 1e3 * seconds);
            for (i, c) in plans.iter().enumerate() {
                let mark = if i == 0 { "chosen" } else { "      " };
                println!("{mark} {:<40} predicted {:.2} ms per step", c.describe(), 1e3 * c.step_seconds);
            }
            let text = best.to_toml(table.blocks(), devices);
            crate::fsio::write_atomic(&out, text.as_bytes())?;
            println!("wrote {}", out.display());
            Ok(())
        }
        Command::Sweep { sweep } => {
            let mut say = |line: &str| eprintln!("sweep: {line}");
            let rows = crate::sweep::sweep(zoo, &sweep, &mut say)?;
            println!("{:<48} {:>11} {:>9} {:>9}  plan", "point", "samples/s", "step ms", "accuracy");
            for r in &rows {
                println!(
                    "{:<48} {:>11.1} {:>9.1} {:>8.2}%  {}",
                    r.id,
                    r.samples_per_second,
                    1e3 * r.step_seconds,
                    100.0 * r.student_accuracy,
                    r.plan
                );
            }
            Ok(())
        }
        Command::Search { run_dir, budget, out, pareto, evaluate, argmax, objective } => {
            let choice = match (budget, argmax) {
                (Some(budget), _) => Some(Choice::Budget(budget)),
                (None, true) => Some(Choice::Argmax),
                (None, false) => None,
            };
            let objective = crate::choose::Objective::parse(&objective)?;
            search_command(zoo, &run_dir, choice, out, pareto.as_deref(), evaluate, objective)
        }
        Command::Eval { run_dir } => {
            let result = crate::eval::eval_run(zoo, &run_dir)?;
            if let Some(text) = &result.text {
                print_text_report(text);
                return Ok(());
            }
            println!(
                "student accuracy {:.2}% on {} test images (recorded at the end of training: {:.2}%)",
                100.0 * result.student_accuracy,
                result.test_samples,
                100.0 * result.recorded_accuracy
            );
            Ok(())
        }
        Command::EvalTeacher { config } => {
            let config = zoo.load_config(&config, Overrides::default())?;
            let (acc, n) = crate::eval::eval_teacher(zoo, &config)?;
            println!("teacher accuracy {:.2}% on {} test images", 100.0 * acc, n);
            Ok(())
        }
        Command::Kernels { device, check, bench, repeats, batch, only, seed, verbose } => {
            let (check, bench) = if check || bench { (check, bench) } else { (true, true) };
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            });
            let options = pipebd_kernels::bench::BenchOptions { repeats, batch, only };
            let report = crate::kernels::kernels(&device, check.then_some(seed), bench.then_some(options))?;
            if check {
                println!("fused ops against burn's ops on {} (seed {seed}):", report.device);
                if verbose {
                    print!("{}", pipebd_kernels::check::table(&report.checks));
                } else {
                    print!("{}", pipebd_kernels::check::summary(&report.checks));
                }
            }
            if bench {
                println!("fused against unfused on {}, median of {repeats} calls:", report.device);
                print!("{}", pipebd_kernels::bench::table(&report.timings));
            }
            let failed = report.checks.iter().filter(|r| !r.passed()).count();
            if failed > 0 {
                return Err(Error::Device {
                    device: report.device,
                    message: format!("{failed} kernel checks out of {} failed", report.checks.len()),
                });
            }
            Ok(())
        }
        Command::Check { config } => {
            let config = zoo.load_config(&config, Overrides::default())?;
            crate::preflight::preflight(zoo, &config)?;
            println!("{}: ok", config.name);
            Ok(())
        }
        Command::ExportInit { config, out } => {
            let config = zoo.load_config(&config, Overrides::default())?;
            let files = crate::eval::export_initial_weights(zoo, &config, &out)?;
            println!("wrote {} files: {}", files.len(), out.join("block-K.json").display());
            Ok(())
        }
    }
}

/// Seconds between progress lines when stderr is not a terminal.
const LOG_LINE_SECONDS: u64 = 30;

/// Training progress on stderr: a bar on a terminal, a line every
/// [`LOG_LINE_SECONDS`] otherwise (log files, batch schedulers), nothing
/// with `--quiet`.
struct ProgressView {
    bar: Option<ProgressBar>,
    lines: bool,
    start: std::time::Instant,
    last_line: std::time::Instant,
}

impl ProgressView {
    fn new(quiet: bool) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let bar = (!quiet && terminal).then(|| {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30}] {pos}/{len} steps (eta {eta}) {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        let now = std::time::Instant::now();
        Self { bar, lines: !quiet && !terminal, start: now, last_line: now }
    }

    fn show(&mut self, p: &Progress) {
        let per_phase = p.epochs * p.steps_per_epoch;
        let total = p.phases * per_phase;
        let done = p.phase * per_phase + p.epoch * p.steps_per_epoch + p.step_in_epoch + 1;
        let losses: Vec<String> = p.losses.iter().map(|l| format!("{l:.4}")).collect();
        let phase = if p.phases > 1 { format!("phase {}/{} ", p.phase + 1, p.phases) } else { String::new() };
        let message = format!("{phase}epoch {}/{} losses [{}]", p.epoch + 1, p.epochs, losses.join(" "));
        if let Some(bar) = &self.bar {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(message);
        } else if self.lines && (self.last_line.elapsed().as_secs() >= LOG_LINE_SECONDS || done == total) {
            self.last_line = std::time::Instant::now();
            eprintln!(
                "progress: {done}/{total} steps ({:.0}%) after {:.0}s, {message}",
                100.0 * done as f64 / total.max(1) as f64,
                self.start.elapsed().as_secs_f64()
            );
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// How `pipebd search` chooses one candidate per block.
enum Choice {
    /// `--budget kind=N`, as typed.
    Budget(String),
    /// `--argmax`.
    Argmax,
}

/// `pipebd search`: the budget's (or the architecture weights') choice into
/// chosen.toml and/or the Pareto front into pareto.csv and pareto.png.
fn search_command<Z: Zoo>(
    zoo: &Z,
    run_dir: &std::path::Path,
    choice: Option<Choice>,
    out: Option<PathBuf>,
    pareto: Option<&str>,
    evaluate: bool,
    objective: crate::choose::Objective,
) -> crate::error::Result<()> {
    use crate::choose::{self, Budget, CostKind, Objective, SearchScores};
    if choice.is_none() && pareto.is_none() {
        return Err(crate::error::Error::Search {
            message: "give --budget flops=N|params=N|latency=MS, --argmax, or --pareto flops|params|latency"
                .into(),
        });
    }
    let scores = SearchScores::read(run_dir)?;
    if let Some(choice) = choice {
        let (chosen, how, summed) = match choice {
            Choice::Budget(text) => {
                let budget: Budget = text.parse()?;
                (
                    choose::choose(&scores, run_dir, budget, objective)?,
                    format!(
                        "--budget {}={} --objective {}",
                        budget.kind.name(),
                        budget.limit,
                        objective.name()
                    ),
                    objective,
                )
            }
            Choice::Argmax => (choose::argmax(&scores, run_dir)?, "--argmax".to_string(), Objective::Block),
        };
        let path = out.unwrap_or_else(|| run_dir.join("chosen.toml"));
        choose::write_chosen(&path, &chosen, &how, run_dir, summed)?;
        let p = &chosen.point;
        println!(
            "chosen candidates {} (one per block): {} {:.4}, {} FLOPs/sample, {} params, {:.2} ms/batch",
            p.choice,
            summed.describe(),
            p.loss,
            p.flops,
            p.params,
            p.latency_ms
        );
        println!("wrote {} (finetune and evaluate it with `pipebd run {}`)", path.display(), path.display());
    }
    if let Some(kind) = pareto {
        let kind = CostKind::parse(kind)?;
        let front = choose::pareto(&scores, kind, objective)?;
        let first = vec![0; scores.blocks.len()];
        let mut reference = scores.point(&first, objective);
        let mut points: Vec<choose::ParetoPoint> = front.iter().map(|(_, p)| p.clone()).collect();
        if evaluate {
            let mut configs: Vec<_> =
                front.iter().map(|(s, _)| scores.chosen_config(run_dir, &s.choice)).collect();
            configs.push(scores.chosen_config(run_dir, &first));
            eprintln!("scoring {} stitched students on the test set...", configs.len());
            let accuracies = crate::eval::score_configs(zoo, &configs)?;
            for (point, accuracy) in points.iter_mut().chain([&mut reference]).zip(accuracies) {
                point.accuracy = Some(accuracy);
            }
        }
        println!(
            "{:>14} {:>10} {:>12} {:>10} {:>12} {:>9}",
            "choice", "loss", "flops", "params", "latency_ms", "accuracy"
        );
        for p in &points {
            let accuracy = p.accuracy.map(|a| format!("{:.2}%", 100.0 * a)).unwrap_or_default();
            println!(
                "{:>14} {:>10.4} {:>12} {:>10} {:>12.3} {:>9}",
                p.choice, p.loss, p.flops, p.params, p.latency_ms, accuracy
            );
        }
        let csv = choose::write_pareto_csv(run_dir, &points)?;
        let png = run_dir.join("pareto.png");
        let xy = |p: &choose::ParetoPoint| (p.cost(kind), p.loss, p.accuracy);
        let front_xy: Vec<_> = points.iter().map(xy).collect();
        crate::sweep::plot::draw_pareto(&png, kind.name(), &front_xy, Some(xy(&reference)))?;
        println!("wrote {} and {}", csv.display(), png.display());
    }
    Ok(())
}
