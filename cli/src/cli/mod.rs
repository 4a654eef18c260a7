//! The `pipebd` command line, for any [`Zoo`]: `pipebd` itself is
//! [`run_with`]`(Builtin)`, and a user crate with its own teachers, students
//! and datasets gets the same commands for them with its own zoo (see
//! `examples/custom_zoo/`).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::config::Overrides;
use crate::reporter::LogFormat;
use crate::zoo::Zoo;
use crate::Error;
use clap::builder::PossibleValuesParser;
use clap::{Parser, Subcommand};
use pipe_bd::plan::Schedule;

mod commands;
mod print;
mod signals;

/// Pipelined parallel blockwise knowledge distillation.
#[derive(Parser)]
#[command(
    name = "pipebd",
    version,
    about = "Pipelined parallel blockwise knowledge distillation (Pipe-BD) on burn",
    long_about = None
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// No progress, no informative or periodic lines (warnings and errors
    /// are still written).
    #[arg(long, global = true)]
    quiet: bool,
    /// How stderr's lines are written: `text`, or `json` (one object per
    /// line: time, level, source, message; for log collectors and batch
    /// schedulers).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
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
        /// Override the config's schedule.
        #[arg(long, value_parser = PossibleValuesParser::new(Schedule::names()))]
        schedule: Option<String>,
        /// Record every worker's spans to trace.json (Chrome trace format).
        #[arg(long)]
        trace: bool,
        /// Override the config's `train.epochs`.
        #[arg(long)]
        epochs: Option<usize>,
        /// How the processes of a run talk: `auto` (MPI when started by
        /// `mpirun`/`srun` with more than one rank), `local` (one process),
        /// `mpi` (needs a build with `--features mpi`).
        #[arg(long, default_value = "auto", value_parser = pipe_bd::runtime::launch::TransportChoice::parse)]
        transport: pipe_bd::runtime::launch::TransportChoice,
    },
    /// Time the same workload under several schedules side by side, with the
    /// speedups the single-device block costs predict.
    Bench {
        /// The run config (data, teacher, students, batch size, device slots).
        config: PathBuf,
        /// Schedules to compare, comma-separated (`hybrid` uses the config's
        /// [[stages]]; default: the paper's baselines and its two schedules).
        #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(Schedule::names()))]
        schedules: Vec<String>,
        /// Override the config's device slots, comma-separated (e.g. cpu,cpu).
        #[arg(long, value_delimiter = ',')]
        devices: Option<Vec<String>>,
        /// Override the config's `data.train_limit`: bench a run's workload
        /// on fewer samples (fewer steps per schedule).
        #[arg(long)]
        train_limit: Option<usize>,
        /// Folder that receives bench.json, bench.csv and bench.png.
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
        /// With --pareto: keep at most this many points of the front, spread
        /// evenly over its cost range (the cheapest and the dearest always
        /// kept): a front of many blocks has hundreds, and --evaluate scores
        /// each.
        #[arg(long, value_parser = clap::value_parser!(u64).range(2..))]
        points: Option<u64>,
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
    /// Draw a run folder's pictures (again): losses.png from metrics.csv
    /// and, for a run with --trace, timeline.png from trace.json.
    Plot {
        /// The run folder given to `pipebd run --out`.
        run_dir: PathBuf,
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
    /// Write the student of a run folder (or, with --teacher, the teacher
    /// itself) as a model file another tool runs: decoder LLM students as
    /// GGUF files for llama.cpp.
    Export {
        /// The run folder given to `pipebd run --out` (omit with --teacher).
        #[arg(required_unless_present = "teacher", conflicts_with = "teacher")]
        run_dir: Option<PathBuf>,
        /// Export the teacher of this run config instead of a student.
        #[arg(long)]
        teacher: Option<PathBuf>,
        /// The file format.
        #[arg(long, default_value = "gguf")]
        format: String,
        /// How weights are stored: teacher (each tensor in its teacher
        /// tensor's type), f32, f16, q8_0 or q4_1.
        #[arg(long = "type", default_value = "teacher")]
        kind: String,
        /// The file to write.
        #[arg(long)]
        out: PathBuf,
        /// With --teacher: only its first N decoder layers (a smaller
        /// teacher of the same layers, e.g. one that fits a size limit).
        #[arg(long, value_name = "N", requires = "teacher")]
        first_layers: Option<usize>,
    },
    /// Score a GGUF model (an exported student, or any Llama or deci file)
    /// on a text with llama.cpp's perplexity protocol: non-overlapping
    /// windows of --context tokens, the second half of each scored, as
    /// `llama-perplexity -c N` does.
    EvalGguf {
        /// The GGUF file.
        model: PathBuf,
        /// A plain-text file (tokenized whole), or a Brown corpus folder: its
        /// held-out sentences (those no run trains on), one per line.
        #[arg(long)]
        text: PathBuf,
        /// Write the text as scored to this file (to give `llama-perplexity -f` the same text).
        #[arg(long)]
        save_text: Option<PathBuf>,
        /// Tokens per window.
        #[arg(long, default_value_t = 512)]
        context: usize,
        /// Score only the first N windows.
        #[arg(long)]
        chunks: Option<usize>,
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

/// Parses the command line and runs the command with the teachers, students
/// and datasets of `zoo`; prints errors and returns the exit status (2 for
/// errors in the user's input, 1 otherwise).
pub fn run_with<Z: Zoo>(zoo: Z) -> ExitCode {
    let cli = Cli::parse();
    crate::reporter::init(cli.quiet, cli.log_format);
    match execute(&zoo, cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            crate::reporter::reporter().error(&e.to_string());
            if let Error::Interrupted { signal, .. } = &e {
                ExitCode::from((128 + signal).clamp(1, 255) as u8)
            } else if e.is_user_error() {
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
fn close_transport(transport: std::sync::Arc<dyn pipe_bd::runtime::transport::Transport>, failed: bool) {
    if failed {
        let rank = transport.rank();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(15));
            let message = format!("rank {rank}: MPI did not shut down within 15 s of the failure; exiting");
            crate::reporter::reporter().warn("pipebd", &message);
            std::process::exit(1);
        });
    }
    drop(transport);
}

fn execute<Z: Zoo>(zoo: &Z, command: Command) -> Result<(), Error> {
    // Errors about a config that do not name its file get its name.
    let config_path = match &command {
        Command::Run { config, .. }
        | Command::Check { config }
        | Command::Bench { config, .. }
        | Command::Profile { config, .. } => Some(config.clone()),
        _ => None,
    };
    execute_command(zoo, command).map_err(|e| match &config_path {
        Some(path) => e.in_config(path),
        None => e,
    })
}

/// [`execute`] without the config file's name added to its errors: each
/// command's function ([`commands`]).
fn execute_command<Z: Zoo>(zoo: &Z, command: Command) -> Result<(), Error> {
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
            transport,
        } => {
            let flags = RunCommand { out, resume, max_failures, trace, transport };
            commands::run(
                zoo,
                &config,
                Overrides { device, devices, schedule, epochs, train_limit: None },
                flags,
            )
        }
        Command::Link { config, rounds, out } => commands::link(zoo, &config, rounds, &out),
        Command::Bench { config, schedules, devices, train_limit, out } => {
            let schedules = match schedules.is_empty() {
                true => Schedule::BENCHED.iter().map(|s| s.name().to_string()).collect(),
                false => schedules,
            };
            commands::bench(
                zoo,
                &config,
                &schedules,
                Overrides { devices, train_limit, ..Default::default() },
                &out,
            )
        }
        Command::Profile { config, devices, out } => commands::profile(zoo, &config, devices, &out),
        Command::Plan { profile, devices, memory_per_device, top, out } => {
            commands::plan(&profile, devices, memory_per_device, top, &out)
        }
        Command::Sweep { sweep } => commands::sweep(zoo, &sweep),
        Command::Search { run_dir, budget, out, pareto, evaluate, points, argmax, objective } => {
            let choice = match (budget, argmax) {
                (Some(budget), _) => Some(commands::Choice::Budget(budget)),
                (None, true) => Some(commands::Choice::Argmax),
                (None, false) => None,
            };
            let objective = crate::jobs::search::Objective::parse(&objective)?;
            let pareto = pareto.map(|cost| commands::ParetoRequest {
                cost,
                evaluate,
                points: points.map(|n| n as usize),
            });
            commands::search(zoo, &run_dir, choice, out, pareto, objective)
        }
        Command::Plot { run_dir } => commands::plot(&run_dir),
        Command::Eval { run_dir } => commands::eval(zoo, &run_dir),
        Command::EvalTeacher { config } => commands::eval_teacher(zoo, &config),
        Command::Export { run_dir, teacher, format, kind, out, first_layers } => {
            let source = match (run_dir, teacher) {
                (_, Some(config)) => crate::jobs::export::ExportSource::Teacher(config),
                (Some(run_dir), None) => crate::jobs::export::ExportSource::Run(run_dir),
                (None, None) => unreachable!("clap requires one"),
            };
            let request = crate::jobs::export::ExportRequest { source, format, kind, out, first_layers };
            commands::export(zoo, &request)
        }
        Command::EvalGguf { model, text, save_text, context, chunks } => commands::eval_gguf(
            zoo,
            &crate::jobs::export::TextScoreRequest { model, text, save_text, context, max_windows: chunks },
        ),
        Command::Kernels { device, check, bench, repeats, batch, only, seed, verbose } => commands::kernels(
            &device,
            check,
            bench,
            pipebd_kernels::bench::BenchOptions {
                repeats,
                batch,
                only,
                progress: Some(print::print_bench_progress),
            },
            seed,
            verbose,
        ),
        Command::Check { config } => commands::check(zoo, &config),
        Command::ExportInit { config, out } => commands::export_init(zoo, &config, &out),
    }
}

/// `pipebd run`'s flags besides the config overrides.
struct RunCommand {
    out: Option<PathBuf>,
    resume: Option<PathBuf>,
    max_failures: Option<usize>,
    trace: bool,
    transport: pipe_bd::runtime::launch::TransportChoice,
}
