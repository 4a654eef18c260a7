//! The `pipebd` command line: a thin layer over the `pipe_bd` library.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use pipe_bd::config::{Overrides, RunConfig};
use pipe_bd::train::Progress;
use pipe_bd::Error;

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
    /// Check the fused kernels (losses, fused linear) against burn's ops, and time them.
    Kernels {
        /// Where to run: cpu (the burn-op fallback), wgpu[:N] or cuda[:N].
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match execute(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            if e.is_user_error() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// Resume and failure lines after a run.
fn print_resilience(log: &pipe_bd::runtime::recovery::ResilienceLog) {
    for r in &log.resumed {
        let from = match &r.checkpoint {
            Some(path) => format!("step {} ({})", r.step, path.display()),
            None => "scratch (no checkpoint)".into(),
        };
        println!("block {} resumed from {from}", r.block);
        for refused in &r.refused {
            println!("  refused a newer checkpoint: {refused}");
        }
    }
    for f in &log.failures {
        println!(
            "failure: stage {} replica {} (slot {}): {}\n  {}; plan {} -> {}; {} block steps lost, detected after {:.1}s, back where it was {:.1}s later",
            f.stage,
            f.replica,
            f.slot,
            f.error,
            f.action,
            f.old_plan,
            f.new_plan,
            f.steps_lost,
            f.detection_seconds,
            f.recovery_seconds
        );
    }
}

fn execute(command: Command) -> Result<(), Error> {
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
        } => {
            let out = out.or_else(|| resume.clone()).unwrap_or_else(|| PathBuf::from("runs/latest"));
            let config = RunConfig::load_with(&config, Overrides { device, devices, schedule, epochs })?;
            let bar = progress_bar(quiet);
            let mut observer = |p: &Progress| {
                if let Some(bar) = &bar {
                    let per_phase = p.epochs * p.steps_per_epoch;
                    bar.set_length((p.phases * per_phase) as u64);
                    bar.set_position(
                        (p.phase * per_phase + p.epoch * p.steps_per_epoch + p.step_in_epoch + 1) as u64,
                    );
                    let losses: Vec<String> = p.losses.iter().map(|l| format!("{l:.4}")).collect();
                    let phase = if p.phases > 1 {
                        format!("phase {}/{} ", p.phase + 1, p.phases)
                    } else {
                        String::new()
                    };
                    bar.set_message(format!(
                        "{phase}epoch {}/{} losses [{}]",
                        p.epoch + 1,
                        p.epochs,
                        losses.join(" ")
                    ));
                }
            };
            let options = pipe_bd::run::RunFlags { trace, resume, max_failures };
            let report = pipe_bd::run::run(&config, &out, &options, &mut observer)?;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
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
            println!(
                "block  teacher  student     params (t/s)       FLOPs (t/s)         cheaper  final loss"
            );
            for b in &report.blocks {
                println!(
                    "{:>5}  {:<7}  {:<9} {:>8}/{:<8} {:>9}/{:<9} {:>7.1}x  {:.5}",
                    b.block,
                    b.teacher,
                    b.student,
                    b.teacher_params,
                    b.params,
                    b.teacher_flops,
                    b.flops,
                    b.flops_reduction,
                    b.final_loss
                );
            }
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
            }
            print_resilience(&report.resilience);
            let trace_note = if trace { ", trace.json" } else { "" };
            println!("wrote {}/report.json, metrics.csv, student/{trace_note}", out.display());
            Ok(())
        }
        Command::Bench { config, schedules, devices, out } => {
            let config = RunConfig::load_with(&config, Overrides { devices, ..Default::default() })?;
            let mut say = |line: &str| eprintln!("bench: {line}");
            let report = pipe_bd::bench::bench(&config, &schedules, &out, &mut say)?;
            print_bench(&report);
            println!("wrote {}/bench.json and bench.csv", out.display());
            Ok(())
        }
        Command::Profile { config, devices, out } => {
            let config = RunConfig::load_with(&config, Overrides { devices, ..Default::default() })?;
            let slots = config.device_slots().len();
            let mut say = |line: &str| eprintln!("profile: {line}");
            let profile = pipe_bd::profile::profile(&config, slots, &out, &mut say)?;
            println!(
                "block  g  batch  teacher fwd (ms)  student step (ms)  grad avg (ms)  input (ms)  peak MiB"
            );
            let ms = |t: &Option<pipe_bd::profile::Timing>| {
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
            let profile = pipe_bd::profile::Profile::read(&profile)?;
            let table = profile.cost_table(devices);
            let start = std::time::Instant::now();
            let plans = pipe_bd::planning::planner::plan(&table, devices, memory_per_device, top.max(1));
            let seconds = start.elapsed().as_secs_f64();
            let Some(best) = plans.first() else {
                return Err(Error::Plan {
                    plan: pipe_bd::Schedule::Auto.name().into(),
                    message: format!("no plan of the {} blocks on {devices} slots fits (memory limit {memory_per_device:?})", table.blocks()),
                });
            };
            println!("{} blocks on {devices} slots (searched in {:.3} ms):", table.blocks(), 1e3 * seconds);
            for (i, c) in plans.iter().enumerate() {
                let mark = if i == 0 { "chosen" } else { "      " };
                println!("{mark} {:<40} predicted {:.2} ms per step", c.describe(), 1e3 * c.step_seconds);
            }
            let text = best.to_toml(table.blocks(), devices);
            pipe_bd::fsio::write_atomic(&out, text.as_bytes())?;
            println!("wrote {}", out.display());
            Ok(())
        }
        Command::Sweep { sweep } => {
            let mut say = |line: &str| eprintln!("sweep: {line}");
            let rows = pipe_bd::sweep::sweep(&sweep, &mut say)?;
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
        Command::Eval { run_dir } => {
            let result = pipe_bd::eval::eval_run(&run_dir)?;
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
            let config = RunConfig::load(&config)?;
            let (acc, n) = pipe_bd::eval::eval_teacher(&config)?;
            println!("teacher accuracy {:.2}% on {} test images", 100.0 * acc, n);
            Ok(())
        }
        Command::Kernels { device, check, bench, repeats, seed, verbose } => {
            let (check, bench) = if check || bench { (check, bench) } else { (true, true) };
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            });
            let report = pipe_bd::kernels::kernels(&device, check.then_some(seed), bench.then_some(repeats))?;
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
            let config = RunConfig::load(&config)?;
            pipe_bd::preflight::preflight(&config)?;
            println!("{}: ok", config.name);
            Ok(())
        }
    }
}

/// The text part of a run report, as printed after `run` and `eval`.
fn print_text_report(text: &pipe_bd::data::text::TextReport) {
    println!(
        "embedding cosine student/teacher {:.4} (lowest {:.4}) on {} held-out sentences",
        text.embedding_cosine, text.min_embedding_cosine, text.heldout_sentences
    );
    if let Some(p) = &text.probe {
        println!(
            "spam probe: teacher {:.2}%  student {:.2}%  ({} train / {} test emails, {:.0}% spam)",
            100.0 * p.teacher_accuracy,
            100.0 * p.student_accuracy,
            p.train_emails,
            p.test_emails,
            100.0 * p.test_spam_fraction
        );
    }
    println!(
        "student/teacher: {:.2}x parameters, {:.2}x FLOPs (encoder layers, {} tokens per sequence)",
        text.params_ratio, text.flops_ratio, text.max_tokens
    );
}

fn print_bench(report: &pipe_bd::bench::BenchReport) {
    println!(
        "{} on {} ({} intra-op threads per worker), batch {}, {} steps per block",
        report.name,
        report.devices.join(","),
        report.threads_per_worker,
        report.batch_size,
        report.steps
    );
    println!("profiled costs per step at the full batch, one replica (ms):");
    for c in &report.block_costs {
        println!(
            "  block {}: teacher forward {:.1}, student step {:.1}",
            c.block,
            1e3 * c.teacher_forward,
            1e3 * c.student_step
        );
    }
    println!("ideal (one slot): {:.2} s", report.ideal_seconds);
    println!(
        "{:<8} {:>8} {:>10} {:>8} {:>9} {:>6} {:>9} {:>9} {:>6} {:>7} {:>11} {:>8}  plan",
        "schedule",
        "seconds",
        "samples/s",
        "speedup",
        "simulated",
        "model",
        "step ms",
        "sim ms",
        "ratio",
        "effic.",
        "idle/sim",
        "peak MiB"
    );
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}x"));
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    for r in &report.rows {
        println!(
            "{:<8} {:>8.2} {:>10.1} {:>8} {:>9} {:>6} {:>9.1} {:>9.1} {:>6.2} {:>6.0}% {:>4.0}%/{:>3.0}%  {:>8}  {}",
            r.schedule,
            r.seconds,
            r.samples_per_second,
            opt(r.speedup_over_dp),
            opt(r.predicted_speedup_over_dp),
            opt(r.cost_model_speedup_over_dp),
            1e3 * r.measured_step_seconds,
            1e3 * r.predicted_step_seconds,
            r.measured_over_predicted,
            100.0 * r.pipeline_efficiency,
            100.0 * max(&r.idle_fractions),
            100.0 * max(&r.predicted_idle_fractions),
            r.peak_rss_bytes.map_or("-".into(), |b| format!("{:.0}", b as f64 / 1048576.0)),
            r.plan
        );
    }
}

fn progress_bar(quiet: bool) -> Option<ProgressBar> {
    if quiet || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps (eta {eta}) {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    Some(bar)
}
