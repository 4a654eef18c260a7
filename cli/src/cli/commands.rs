//! One function per command of the command line, each with what it needs
//! from the parsed arguments; the printing is `print`'s.

use std::path::{Path, PathBuf};

use super::{close_transport, print, RunCommand};
use crate::config::Overrides;
use crate::reporter::{reporter, ProgressView};
use crate::zoo::Zoo;
use crate::Error;
use pipe_bd::train::Progress;

/// `pipebd run`.
pub(super) fn run<Z: Zoo>(
    zoo: &Z,
    config: &Path,
    overrides: Overrides,
    flags: RunCommand,
) -> Result<(), Error> {
    let RunCommand { out, resume, max_failures, trace, transport } = flags;

    let out = out.or_else(|| resume.clone()).unwrap_or_else(|| std::path::PathBuf::from("runs/latest"));
    let config = zoo.load_config(config, overrides)?;
    let transport = pipe_bd::runtime::launch::open(transport)?;
    let rank = transport.as_ref().map_or(0, |t| t.rank());
    let ranks = transport.as_ref().map_or(1, |t| t.ranks());
    let interrupt = pipe_bd::runtime::interrupt::Interrupt::new();
    super::signals::stop_on_signals(&interrupt, rank == 0)?;
    let mut view = ProgressView::new(rank == 0, config.train.batch_size);
    let mut observer = |p: &Progress| view.show(p);
    let flags = crate::jobs::run::RunFlags { trace, resume, max_failures, interrupt: interrupt.clone() };
    let report = crate::jobs::run::run_rank(zoo, &config, &out, &flags, transport.clone(), &mut observer);
    view.finish();
    let report = report.map_err(|e| match e {
        Error::Interrupted { signal, completed_steps, most_steps, total_steps, checkpoints, .. } => {
            let resume_command = checkpoints
                .as_ref()
                .map(|_| super::signals::resume_command(&out, ranks))
                .filter(|_| rank == 0);
            Error::Interrupted {
                signal,
                completed_steps,
                most_steps,
                total_steps,
                checkpoints,
                resume_command,
            }
        }
        other => other,
    });
    let interrupted = matches!(report, Err(Error::Interrupted { .. }));
    if let Some(transport) = transport {
        close_transport(transport, report.is_err() && !interrupted);
        if interrupted && rank != 0 {
            // mpirun ends the job at the first rank that exits non-zero:
            // rank 0 first prints the resume command.
            std::thread::sleep(std::time::Duration::from_secs(3));
        }
    }
    if let (Ok(_), Some(signal)) = (&report, interrupt.requested()) {
        let name = pipe_bd::runtime::interrupt::signal_name(signal);
        reporter().info("pipebd", &format!("{name} came after the last step: the run is complete"));
    }
    let Some(report) = report? else {
        return Ok(());
    };
    print::print_run(&report, &out, trace);
    // The run's files are written; pictures that cannot be drawn (no font)
    // are a warning, and `pipebd plot` draws them later.
    match crate::jobs::plot::draw_run(&out, Some(&report)) {
        Ok(written) => print::print_pictures(&written),
        Err(e) => reporter().warn("plot", &e.to_string()),
    }
    Ok(())
}

/// `pipebd plot`.
pub(super) fn plot(run_dir: &Path) -> Result<(), Error> {
    let written = crate::jobs::plot::plot_run(run_dir)?;
    print::print_pictures(&written);
    Ok(())
}

/// `pipebd link`.
pub(super) fn link<Z: Zoo>(zoo: &Z, config: &Path, rounds: usize, out: &Path) -> Result<(), Error> {
    let config = zoo.load_config(config, Overrides::default())?;
    let transport = pipe_bd::runtime::launch::open(pipe_bd::runtime::launch::TransportChoice::Auto)?;
    let mut say = |line: &str| reporter().info("link", line);
    let report = crate::jobs::link::link_bench(zoo, &config, transport.clone(), rounds, out, &mut say);
    if let Some(transport) = transport {
        close_transport(transport, report.is_err());
    }
    if let Some(report) = report? {
        print::print_link(&report);
        println!("wrote {}", out.join("link.json").display());
    }
    Ok(())
}

/// `pipebd bench`.
pub(super) fn bench<Z: Zoo>(
    zoo: &Z,
    config: &Path,
    schedules: &[String],
    overrides: Overrides,
    out: &Path,
) -> Result<(), Error> {
    let config = zoo.load_config(config, overrides)?;
    let mut say = |line: &str| reporter().info("bench", line);
    let report = crate::jobs::bench::bench(zoo, &config, schedules, out, &mut say)?;
    print::print_bench(&report);
    println!("wrote {}/bench.json, bench.csv and bench.png", out.display());
    Ok(())
}

/// `pipebd profile`.
pub(super) fn profile<Z: Zoo>(
    zoo: &Z,
    config: &Path,
    devices: Option<Vec<String>>,
    out: &Path,
) -> Result<(), Error> {
    let config = zoo.load_config(config, Overrides { devices, ..Default::default() })?;
    let slots = config.device_slots().len();
    let mut say = |line: &str| reporter().info("profile", line);
    let profile = crate::jobs::profile::profile(zoo, &config, slots, out, &mut say)?;
    print::print_profile(&profile);
    println!("wrote {}", out.display());
    Ok(())
}

/// `pipebd plan`.
pub(super) fn plan(
    profile: &Path,
    devices: usize,
    memory_per_device: Option<u64>,
    top: usize,
    out: &Path,
) -> Result<(), Error> {
    let profile = crate::jobs::profile::Profile::read(profile)?;
    let table = profile.cost_table(devices);
    let start = std::time::Instant::now();
    let plans = pipe_bd::planning::planner::plan(&table, devices, memory_per_device, top.max(1));
    let seconds = start.elapsed().as_secs_f64();
    let Some(best) = plans.first() else {
        return Err(Error::Plan {
            plan: pipe_bd::Schedule::Auto.name().into(),
            message: format!(
                "no plan of the {} blocks on {devices} slots fits{}",
                table.blocks(),
                crate::jobs::profile::memory_limit_words("--memory-per-device", memory_per_device)
            ),
        });
    };
    println!("{} blocks on {devices} slots (searched in {:.3} ms):", table.blocks(), 1e3 * seconds);
    for (i, c) in plans.iter().enumerate() {
        let mark = if i == 0 { "chosen" } else { "      " };
        println!("{mark} {:<40} predicted {:.2} ms per step", c.describe(), 1e3 * c.step_seconds);
    }
    let text = crate::config::plan_as_toml(best, table.blocks(), devices);
    pipe_bd::fsio::write_atomic(out, text.as_bytes())?;
    println!("wrote {}", out.display());
    Ok(())
}

/// `pipebd sweep`.
pub(super) fn sweep<Z: Zoo>(zoo: &Z, sweep: &Path) -> Result<(), Error> {
    let mut say = |line: &str| reporter().info("sweep", line);
    let rows = crate::jobs::sweep::sweep(zoo, sweep, &mut say)?;
    print::print_sweep(&rows);
    Ok(())
}

/// `pipebd eval`.
pub(super) fn eval<Z: Zoo>(zoo: &Z, run_dir: &Path) -> Result<(), Error> {
    let result = crate::jobs::eval::eval_run(zoo, run_dir)?;
    if !result.sections.is_empty() {
        for line in result.sections.iter().flat_map(|s| &s.lines) {
            println!("{line}");
        }
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

/// `pipebd eval-teacher`.
pub(super) fn eval_teacher<Z: Zoo>(zoo: &Z, config: &Path) -> Result<(), Error> {
    let config = zoo.load_config(config, Overrides::default())?;
    let (acc, n) = crate::jobs::eval::eval_teacher(zoo, &config)?;
    println!("teacher accuracy {:.2}% on {} test images", 100.0 * acc, n);
    Ok(())
}

/// `pipebd export`.
pub(super) fn export<Z: Zoo>(zoo: &Z, request: &crate::jobs::export::ExportRequest) -> Result<(), Error> {
    let exported = zoo.export(request)?;
    println!("wrote {} ({:.1} MB)", exported.path.display(), exported.bytes as f64 / 1e6);
    for line in &exported.details {
        println!("  {line}");
    }
    Ok(())
}

/// `pipebd eval-gguf`.
pub(super) fn eval_gguf<Z: Zoo>(
    zoo: &Z,
    request: &crate::jobs::export::TextScoreRequest,
) -> Result<(), Error> {
    let score = zoo.score_model_file(request)?;
    println!(
        "perplexity {:.4} over {} scored tokens ({} windows of {} tokens, the text {} tokens) in {:.1}s",
        score.perplexity,
        score.scored_tokens,
        score.windows,
        request.context,
        score.text_tokens,
        score.seconds
    );
    Ok(())
}

/// `pipebd kernels`.
pub(super) fn kernels(
    device: &str,
    check: bool,
    bench: bool,
    options: pipebd_kernels::bench::BenchOptions,
    seed: Option<u64>,
    verbose: bool,
) -> Result<(), Error> {
    let (check, bench) = if check || bench { (check, bench) } else { (true, true) };
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    let repeats = options.repeats;
    let report = crate::jobs::kernels::kernels(device, check.then_some(seed), bench.then_some(options))?;
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

/// `pipebd check`.
pub(super) fn check<Z: Zoo>(zoo: &Z, config: &Path) -> Result<(), Error> {
    let config = crate::jobs::check::check_file(zoo, config)?;
    println!("{}: ok", config.name);
    Ok(())
}

/// `pipebd export-init`.
pub(super) fn export_init<Z: Zoo>(zoo: &Z, config: &Path, out: &Path) -> Result<(), Error> {
    let config = zoo.load_config(config, Overrides::default())?;
    let files = crate::jobs::eval::export_initial_weights(zoo, &config, out)?;
    println!("wrote {} files: {}", files.len(), out.join("block-K.json").display());
    Ok(())
}

/// How `pipebd search` chooses one candidate per block.
pub(super) enum Choice {
    /// `--budget kind=N`, as typed.
    Budget(String),
    /// `--argmax`.
    Argmax,
}

/// `pipebd search`: the budget's (or the architecture weights') choice into
/// chosen.toml and/or the Pareto front into pareto.csv and pareto.png.
pub(super) fn search<Z: Zoo>(
    zoo: &Z,
    run_dir: &std::path::Path,
    choice: Option<Choice>,
    out: Option<PathBuf>,
    pareto: Option<ParetoRequest>,
    objective: crate::jobs::search::Objective,
) -> pipe_bd::error::Result<()> {
    use crate::jobs::search::{self, Budget, CostKind, Objective, SearchScores};
    if choice.is_none() && pareto.is_none() {
        return Err(pipe_bd::error::Error::Search {
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
                    search::choose(&scores, run_dir, budget, objective)?,
                    format!(
                        "--budget {}={} --objective {}",
                        budget.kind.name(),
                        budget.limit,
                        objective.name()
                    ),
                    objective,
                )
            }
            Choice::Argmax => (search::argmax(&scores, run_dir)?, "--argmax".to_string(), Objective::Block),
        };
        let path = out.unwrap_or_else(|| run_dir.join("chosen.toml"));
        search::write_chosen(&path, &chosen, &how, run_dir, summed)?;
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
    if let Some(ParetoRequest { cost, evaluate, points }) = pareto {
        let kind = CostKind::parse(&cost)?;
        let mut front = search::pareto(&scores, kind, objective)?;
        if let Some(points) = points {
            front = search::thin_front(front, kind, points);
        }
        let first = vec![0; scores.blocks.len()];
        let mut reference = scores.point(&first, objective);
        let mut points: Vec<search::ParetoPoint> = front.iter().map(|(_, p)| p.clone()).collect();
        if evaluate {
            let mut configs: Vec<_> =
                front.iter().map(|(s, _)| scores.chosen_config(run_dir, &s.choice)).collect();
            configs.push(scores.chosen_config(run_dir, &first));
            reporter()
                .info("search", &format!("scoring {} stitched students on the test set...", configs.len()));
            let scored = crate::jobs::eval::score_configs(zoo, &configs)?;
            for (point, score) in points.iter_mut().chain([&mut reference]).zip(scored) {
                point.accuracy = Some(score.headline());
                point.perplexity = score.figure("perplexity");
                point.kl = score.figure("kl");
            }
        }
        print::print_pareto(&points);
        let csv = search::write_pareto_csv(run_dir, &points)?;
        let png = run_dir.join("pareto.png");
        let metrics = pareto_metrics(&points, &reference);
        let front: Vec<_> = points.iter().map(|p| (p.cost(kind), p.loss)).collect();
        let reference_xy = (reference.cost(kind), reference.loss);
        crate::jobs::sweep::plot::draw_pareto(&png, kind.name(), &front, Some(reference_xy), &metrics)?;
        println!("wrote {} and {}", csv.display(), png.display());
    }
    Ok(())
}

/// What `pipebd search --pareto` was asked for.
pub(super) struct ParetoRequest {
    /// The cost: flops, params or latency.
    pub cost: String,
    /// Score each point's stitched student.
    pub evaluate: bool,
    /// Keep at most this many points.
    pub points: Option<usize>,
}

/// The evaluated figures of a Pareto front as panels of `pareto.png`: the
/// stitched accuracy, or a language model's perplexity and KL.
fn pareto_metrics(
    points: &[crate::jobs::search::ParetoPoint],
    reference: &crate::jobs::search::ParetoPoint,
) -> Vec<crate::jobs::sweep::plot::Metric> {
    use crate::jobs::sweep::plot::Metric;
    let metric =
        |name: &'static str, percent: bool, of: fn(&crate::jobs::search::ParetoPoint) -> Option<f64>| {
            Metric { name, percent, front: points.iter().map(of).collect(), reference: of(reference) }
        };
    if points.iter().any(|p| p.perplexity.is_some()) {
        vec![
            metric("stitched perplexity", false, |p| p.perplexity),
            metric("mean KL to the teacher (nats/token)", false, |p| p.kl),
        ]
    } else {
        vec![metric("stitched accuracy (%)", true, |p| p.accuracy)]
    }
}
