//! What the command line prints after a command.

use crate::reporter::loss_text;

/// Resume and failure lines after a run.
pub(super) fn print_resilience(log: &pipe_bd::runtime::recovery::ResilienceLog) {
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

pub(super) fn print_bench(report: &crate::jobs::bench::BenchReport) {
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

/// The per-block table after a run: names, parameters, FLOPs, how much
/// cheaper, final loss.
pub(super) fn print_blocks(blocks: &[crate::report::BlockReport]) {
    let teacher = blocks.iter().map(|b| b.teacher.len()).chain([7]).max().unwrap_or(7);
    let student = blocks.iter().map(|b| b.student.len()).chain([7]).max().unwrap_or(7);
    println!(
        "block  {:<teacher$}  {:<student$}  {:>17}  {:>19}  {:>7}  final loss",
        "teacher", "student", "params (t/s)", "FLOPs (t/s)", "cheaper"
    );
    let count = |n: u64| if n == 0 { "?".to_string() } else { n.to_string() };
    for b in blocks {
        let cheaper = b.flops_reduction.map_or("-".to_string(), |r| format!("{r:.1}x"));
        println!(
            "{:>5}  {:<teacher$}  {:<student$}  {:>17}  {:>19}  {:>7}  {}",
            b.block,
            b.teacher,
            b.student,
            format!("{}/{}", b.teacher_params, b.params),
            format!("{}/{}", count(b.teacher_flops), count(b.flops)),
            cheaper,
            loss_text(b.final_loss.into())
        );
    }
}

/// The hand-offs measured by `pipebd link`, the fitted link, and the
/// simulated cluster step times.
pub(super) fn print_link(report: &crate::jobs::link::LinkReport) {
    println!(
        "hand-offs of `{}` at batch {} (one way, measured side by side):",
        report.name, report.batch_size
    );
    println!("{:<28} {:>10} {:>14} {:>14} {:>8}", "message", "bytes", "threads (ms)", "ranks (ms)", "ratio");
    for h in &report.handoffs {
        let ranks = h.rank_seconds.map_or("-".to_string(), |s| format!("{:.3}", 1e3 * s));
        let ratio =
            h.rank_seconds.map_or("-".to_string(), |s| format!("{:.0}x", s / h.thread_seconds.max(1e-12)));
        println!(
            "{:<28} {:>10} {:>14.4} {:>14} {:>8}",
            h.message,
            h.bytes,
            1e3 * h.thread_seconds,
            ranks,
            ratio
        );
    }
    match &report.measured {
        Some(link) => println!(
            "link between ranks here: {:.1} us + bytes / {:.2} GB/s",
            1e6 * link.latency,
            link.bytes_per_second / 1e9
        ),
        None => {
            println!("(no ranks: run `mpirun -np 2 pipebd link <config>` for the column between processes)")
        }
    }
    println!("simulated (not measured): ranks with this machine's block costs");
    println!("{:>5}  {:<24} {:>10} {:>10} {:>8}  plan", "ranks", "link", "step (ms)", "dp (ms)", "vs dp");
    for p in &report.predictions {
        println!(
            "{:>5}  {:<24} {:>10.2} {:>10.2} {:>7.2}x  {}",
            p.ranks,
            p.link,
            1e3 * p.step_seconds,
            1e3 * p.dp_step_seconds,
            p.dp_step_seconds / p.step_seconds.max(1e-12),
            p.plan
        );
    }
}

/// What `pipebd run` prints after a run: the scores, the blocks, the
/// throughput, the workers, the stitched pass, the resilience log and where
/// the files went.
pub(super) fn print_run(report: &crate::report::RunReport, out: &std::path::Path, trace: bool) {
    println!("run `{}`: schedule {} {} on {}", report.name, report.schedule, report.plan, report.device);
    if report.sections.is_empty() {
        println!(
            "teacher accuracy {:.2}%  student accuracy {:.2}%  ({} test images)",
            100.0 * report.teacher_accuracy,
            100.0 * report.student_accuracy,
            report.test_samples
        );
    }
    for line in &report.section_lines {
        println!("{line}");
    }
    print_blocks(&report.blocks);
    let resumed = if report.steps_run < report.steps {
        format!(" (of {}; the rest came from checkpoints)", report.steps)
    } else {
        String::new()
    };
    if let Some(startup) = &report.startup {
        println!(
            "start-up: teacher and data {:.1}s, students {:.1}s (built and initialised)",
            startup.teacher_and_data_seconds, startup.students_seconds
        );
    }
    if report.steps == 0 && report.stitched.is_some() {
        println!(
            "no blockwise epochs (the stitched pass below is the training); whole run {:.1}s",
            report.wall_seconds
        );
    } else {
        println!(
            "trained {} steps{resumed} in {:.1}s ({:.1} samples/s); whole run {:.1}s",
            report.steps_run, report.train_seconds, report.samples_per_second, report.wall_seconds
        );
    }
    if let Some(bytes) = report.peak_memory_bytes {
        println!("peak memory {:.2} GB (resident, this process)", bytes as f64 / 1e9);
    }
    for w in &report.workers {
        println!("worker {} ({}, slot {}): busy {:.0}%", w.worker, w.role, w.slot, 100.0 * w.busy_fraction);
    }
    if let Some(s) = &report.stitched {
        let losses: Vec<String> = s.final_losses.iter().map(|&l| loss_text(l.into())).collect();
        println!(
            "then stitched ({} gradients): {} epoch{}, {} steps at lr {:.3e} in {:.1}s ({:.1} samples/s); \
             final losses [{}]",
            s.gradients.name(),
            s.epochs,
            if s.epochs == 1 { "" } else { "s" },
            s.steps,
            s.lr,
            s.seconds,
            s.samples_per_second,
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
}

/// `pipebd profile`'s table: one line per block and replica count.
pub(super) fn print_profile(profile: &crate::jobs::profile::Profile) {
    println!(
        "block  g  batch  teacher fwd (ms)  student step (ms)  grad avg (ms)  input (ms)  peak MiB  state MiB"
    );
    let ms = |t: &Option<crate::jobs::profile::Timing>| {
        t.map_or("infeasible".to_string(), |t| format!("{:.2} ±{:.0}%", 1e3 * t.median, 100.0 * t.spread))
    };
    for (k, row) in profile.entries.iter().enumerate() {
        for e in row {
            println!(
                "{:>5} {:>2} {:>6}  {:>16}  {:>17}  {:>13}  {:>10}  {:>8}  {:>9}",
                k + 1,
                e.replicas,
                e.batch,
                ms(&e.teacher_forward),
                ms(&e.student_step),
                ms(&e.gradient_average),
                ms(&e.input_transfer),
                e.peak_memory_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1048576.0)),
                e.state_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1048576.0))
            );
        }
    }
}

/// `pipebd sweep`'s table: one line per grid point.
pub(super) fn print_sweep(rows: &[crate::jobs::sweep::Row]) {
    println!("{:<48} {:>11} {:>9} {:>9}  plan", "point", "samples/s", "step ms", "accuracy");
    for r in rows {
        println!(
            "{:<48} {:>11.1} {:>9.1} {:>8.2}%  {}",
            r.id,
            r.samples_per_second,
            1e3 * r.step_seconds,
            100.0 * r.student_accuracy,
            r.plan
        );
    }
}

/// One timed kernel case as soon as it is measured (on stderr: the table
/// follows on stdout when every case is done).
pub(super) fn print_bench_progress(row: &pipebd_kernels::bench::BenchRow) {
    let line = format!(
        "timed {} {}: forward {:.2}x, forward+backward {:.2}x",
        row.op,
        row.case,
        row.forward_speedup(),
        row.train_speedup()
    );
    crate::reporter::reporter().info("kernels", &line);
}

/// The pictures drawn, one line.
pub(super) fn print_pictures(written: &[std::path::PathBuf]) {
    let names: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
    println!("drew {}", names.join(", "));
}

/// A search's Pareto front, one line per point.
pub(super) fn print_pareto(points: &[crate::jobs::search::ParetoPoint]) {
    let language = points.iter().any(|p| p.perplexity.is_some());
    let last =
        if language { format!("{:>10} {:>9}", "perplexity", "KL") } else { format!("{:>9}", "accuracy") };
    println!("{:>14} {:>10} {:>12} {:>10} {:>12} {last}", "choice", "loss", "flops", "params", "latency_ms");
    for p in points {
        let last = if language {
            let cell = |v: Option<f64>, digits: usize| v.map(|v| format!("{v:.digits$}")).unwrap_or_default();
            format!("{:>10} {:>9}", cell(p.perplexity, 2), cell(p.kl, 4))
        } else {
            format!("{:>9}", p.accuracy.map(|a| format!("{:.2}%", 100.0 * a)).unwrap_or_default())
        };
        println!(
            "{:>14} {:>10.4} {:>12} {:>10} {:>12.3} {last}",
            p.choice, p.loss, p.flops, p.params, p.latency_ms
        );
    }
}
