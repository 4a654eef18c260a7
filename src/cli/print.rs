//! What the command line prints after a command.

/// Resume and failure lines after a run.
pub(super) fn print_resilience(log: &crate::runtime::recovery::ResilienceLog) {
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

/// The text part of a run report, as printed after `run` and `eval`.
pub(super) fn print_text_report(text: &crate::data::text::TextReport) {
    println!(
        "embedding cosine student/teacher {:.4} (lowest {:.4}) on {} held-out sentences",
        text.embedding_cosine, text.min_embedding_cosine, text.heldout_sentences
    );
    if !text.cosine_by_length.is_empty() {
        let parts: Vec<String> = text
            .cosine_by_length
            .iter()
            .map(|b| format!("{}-{}: {:.4} ({})", b.min_tokens, b.max_tokens, b.mean_cosine, b.sentences))
            .collect();
        println!("  by length in tokens (sentences): {}", parts.join(", "));
    }
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

pub(super) fn print_bench(report: &crate::bench::BenchReport) {
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
            "{:>5}  {:<teacher$}  {:<student$}  {:>17}  {:>19}  {:>7}  {:.5}",
            b.block,
            b.teacher,
            b.student,
            format!("{}/{}", b.teacher_params, b.params),
            format!("{}/{}", count(b.teacher_flops), count(b.flops)),
            cheaper,
            b.final_loss
        );
    }
}

/// The hand-offs measured by `pipebd link`, the fitted link, and the
/// simulated cluster step times.
pub(super) fn print_link(report: &crate::link::LinkReport) {
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
