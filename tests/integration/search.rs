//! Blockwise architecture search. Mode `all`: candidates train at once under
//! every schedule to the same weights; a search run scores them on held-out
//! samples, `pipebd search` picks the optimum under a budget and writes a
//! config that starts from exactly the scored weights; a search run killed
//! with SIGKILL resumes to the same candidates and scores. Mode
//! `single-path`: every schedule trains the same supernet weights and
//! architecture logits; the logits move only through held-out steps; a
//! killed single-path search resumes to the same result, and `--argmax`
//! picks the logits' choice.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use pipe_bd::data::DatasetSlice;
use pipe_bd::plan::{flops_cost, Plan};
use pipe_bd::runtime::{Distillation, RuntimeSettings};
use pipe_bd::search::score::measure_candidates;
use pipe_bd::{flat_parameters, Block, Loss, Students};
use pipebd_cli::config::RunConfig;
use pipebd_cli::jobs::eval::{load_student_weights, load_students};
use pipebd_cli::jobs::search::{Objective, SearchScores};
use pipebd_cli::zoo::Zoo;
use pipebd_students::StudentBlock;
use pipebd_zoo::mnist::Split;
use pipebd_zoo::{build_teacher, Builtin};

use crate::common;

type B = Autodiff<Flex>;

/// Blocks 2 and 4 have candidates, blocks 1 and 3 one student each.
const STUDENTS: &str = r#"
[[students]]
kind = "conv"
width = 4
out_channels = 32

[[students]]
kind = "candidates"
candidates = [
  { kind = "bottleneck", rank = 8, out_channels = 64 },
  { kind = "separable", out_channels = 64 },
  { kind = "inverted", expansion = 3, kernel = 3, out_channels = 64, downsample = "stride" },
]

[[students]]
kind = "bottleneck"
rank = 8
out_channels = 128

[[students]]
kind = "candidates"
candidates = [
  { kind = "head", hidden = 32, classes = 10 },
  { kind = "head", hidden = 8, classes = 10 },
]
"#;

fn search_text(train_limit: usize, epochs: usize) -> String {
    let base = common::small_config(train_limit, 200, epochs);
    let students = base.find("[[students]]").unwrap();
    format!("{}{STUDENTS}", &base[..students])
}

/// The search config in mode `single-path`: an architecture step every 2
/// steps after the first quarter (`warmup`: fraction of the run).
fn single_path_text(train_limit: usize, epochs: usize, warmup: f64) -> String {
    let text = search_text(train_limit, epochs);
    let students = text.find("[[students]]").unwrap();
    format!(
        "{}[search]\nmode = \"single-path\"\narch_every = 2\narch_warmup = {warmup}\narch_lr = 0.05\n\n{}",
        &text[..students],
        &text[students..]
    )
}

fn flat(blocks: &[impl burn::module::Module<Flex>]) -> Vec<Vec<f32>> {
    blocks.iter().map(flat_parameters::<Flex, _>).collect()
}

/// Trains the search config in process under `plan` on `slots` CPU slots
/// (the runtime alone; the last 64 samples held out for a single-path
/// search's architecture steps).
fn train_students(config: &RunConfig, plan: &Plan, slots: usize) -> Students<B, StudentBlock<B>> {
    let device = Default::default();
    let data = pipebd_zoo::mnist::load(&config.data.dir, Split::Train, config.data.train_limit).unwrap();
    let trained_on = DatasetSlice::new(&data, 0, data.len() - 64);
    let held_out = DatasetSlice::new(&data, data.len() - 64, 64);
    let teacher = build_teacher::<Flex>(config, &device).unwrap();
    let students = Builtin.students::<B>(config, &teacher.specs, &device).unwrap();
    let output = Distillation::new(&teacher, students, &trained_on)
        .held_out(&held_out)
        .settings(config.train_settings())
        .devices(vec![device; slots])
        .runtime(RuntimeSettings { threads_per_worker: 1, ..Default::default() })
        .run(plan)
        .unwrap_or_else(|e| panic!("{}: {e}", plan.name));
    output.students
}

/// Every supernet block's architecture logits.
fn logits(students: &Students<B, StudentBlock<B>>) -> Vec<Vec<f32>> {
    students
        .blocks
        .iter()
        .filter_map(|b| b.arch_logits())
        .map(|alpha| alpha.into_data().iter::<f32>().collect())
        .collect()
}

/// Every block's parameters, candidates included.
fn parameters(students: &Students<B, StudentBlock<B>>) -> Vec<Vec<f32>> {
    students.blocks.iter().map(flat_parameters::<B, _>).collect()
}

#[test]
fn every_schedule_trains_every_candidate_to_the_same_weights() {
    let text = search_text(384, 1)
        .replace("kind = \"adam\"\nlr = 0.002", "kind = \"sgd\"\nlr = 0.5\nmomentum = 0.9");
    let config = RunConfig::parse(&text, Path::new("search.toml")).unwrap();
    let teacher = Builtin.teacher_specs(&config).unwrap();
    let specs = Builtin.student_specs(&config, &teacher).unwrap();
    let trained = train_students(&config, &Plan::ideal(4), 1);
    let reference = parameters(&trained);

    // Every candidate trained: each one's own parameters moved.
    let initial = Builtin.students::<B>(&config, &teacher, &Default::default()).unwrap();
    for k in [1, 3] {
        let before = initial.blocks[k].valid().candidates();
        let after = trained.blocks[k].valid().candidates();
        assert_eq!(after.len(), if k == 1 { 3 } else { 2 });
        for (c, (b, a)) in before.iter().zip(&after).enumerate() {
            let moved = common::max_abs_diff(&flat(std::slice::from_ref(b)), &flat(std::slice::from_ref(a)));
            assert!(moved > 1e-3, "block {} candidate {} did not train (moved {moved})", k + 1, c + 1);
        }
    }

    let cost = flops_cost(&teacher, &specs);
    for name in ["dp", "ls", "tr", "tr-dpu"] {
        let plan = Plan::named(name, 4, 2, &cost, &[]).unwrap();
        let other = parameters(&train_students(&config, &plan, 2));
        let diff = common::max_abs_diff(&reference, &other);
        assert!(diff <= 1e-4, "{name}: candidates differ from ideal by {diff}");
    }
}

#[test]
fn every_schedule_trains_the_same_supernets_and_alpha_moves_only_through_held_out_steps() {
    // 384 training samples at batch 64, 3 epochs: 18 steps, architecture
    // steps at 5, 7, ..., 17.
    let config = RunConfig::parse(&single_path_text(448, 3, 0.25), Path::new("search.toml")).unwrap();
    let teacher = Builtin.teacher_specs(&config).unwrap();
    let specs = Builtin.student_specs(&config, &teacher).unwrap();
    let trained = train_students(&config, &Plan::ideal(4), 1);
    let reference = parameters(&trained);
    let alpha = logits(&trained);
    assert_eq!(alpha.len(), 2, "blocks 2 and 4 are supernets, blocks 1 and 3 ordinary students");
    let moved = |a: &[f32]| a.iter().any(|x| x.abs() > 1e-3);
    assert!(alpha.iter().all(|a| moved(a)), "the architecture steps did not move alpha: {alpha:?}");

    let cost = flops_cost(&teacher, &specs);
    for name in ["dp", "ls", "tr", "tr-dpu"] {
        let plan = Plan::named(name, 4, 2, &cost, &[]).unwrap();
        let other = train_students(&config, &plan, 2);
        let diff = common::max_abs_diff(&reference, &parameters(&other));
        assert!(diff <= 1e-4, "{name}: supernet weights differ from ideal by {diff}");
        let diff = common::max_abs_diff(&alpha, &logits(&other));
        assert!(diff <= 1e-4, "{name}: alpha differs from ideal by {diff}");
    }

    // A warm-up of the whole run: no architecture step, alpha exactly where
    // it started while every candidate's weights trained.
    let config = RunConfig::parse(&single_path_text(448, 3, 1.0), Path::new("search.toml")).unwrap();
    let trained = train_students(&config, &Plan::ideal(4), 1);
    assert!(logits(&trained).iter().flatten().all(|&a| a == 0.0), "alpha moved without a held-out step");
    let initial = Builtin.students::<B>(&config, &teacher, &Default::default()).unwrap();
    let diff = common::max_abs_diff(&parameters(&initial), &parameters(&trained));
    assert!(diff > 1e-3, "the supernets did not train");
}

fn pipebd(args: &[&std::ffi::OsStr]) -> Command {
    let mut command = Command::new(common::pipebd_bin());
    command.args(args).env_remove(pipe_bd::fault::ENV).current_dir(common::repo());
    command
}

fn run_ok(args: &[&std::ffi::OsStr]) -> String {
    let output = pipebd(args).output().unwrap();
    assert!(output.status.success(), "pipebd failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The brute-force optimum of the summed normalised block losses: every
/// combination of candidates.
fn brute_force(scores: &SearchScores, budget: f64) -> Option<(f64, Vec<usize>)> {
    brute_force_of(scores, budget, |c| c.normalised_loss)
}

/// The brute-force optimum of the summed `loss` of the candidates.
fn brute_force_of(
    scores: &SearchScores,
    budget: f64,
    loss_of: impl Fn(&pipe_bd::search::score::CandidateScore) -> f64,
) -> Option<(f64, Vec<usize>)> {
    let mut best: Option<(f64, Vec<usize>)> = None;
    let counts: Vec<usize> = scores.blocks.iter().map(|b| b.candidates.len()).collect();
    let total: usize = counts.iter().product();
    for mut n in 0..total {
        let choice: Vec<usize> = counts
            .iter()
            .map(|&c| {
                let i = n % c;
                n /= c;
                i
            })
            .collect();
        let flops = scores.point(&choice, Objective::Block).flops;
        if flops as f64 > budget {
            continue;
        }
        let loss: f64 = scores.blocks.iter().zip(&choice).map(|(b, &c)| loss_of(&b.candidates[c])).sum();
        if best.as_ref().is_none_or(|(l, _)| loss < *l) {
            best = Some((loss, choice));
        }
    }
    best
}

#[test]
fn a_search_run_scores_its_candidates_and_the_chosen_config_starts_from_the_scored_weights() {
    let dir = tempfile::tempdir().unwrap();
    let config_path = write(dir.path(), "search.toml", &search_text(640, 1));
    let run_dir = dir.path().join("run");
    run_ok(&[
        "run".as_ref(),
        config_path.as_os_str(),
        "--out".as_ref(),
        run_dir.as_os_str(),
        "--quiet".as_ref(),
    ]);
    let report = pipebd_cli::report::RunReport::read(&run_dir).unwrap();
    assert_eq!(report.train_samples, 576, "10% of 640 samples held out");
    let scores = SearchScores::read(&run_dir).unwrap();
    assert_eq!(scores.held_out_samples, 64);
    let counts: Vec<usize> = scores.blocks.iter().map(|b| b.candidates.len()).collect();
    assert_eq!(counts, [1, 3, 1, 2]);
    let config = RunConfig::parse(&search_text(640, 1), &config_path).unwrap();
    let teacher_specs = Builtin.teacher_specs(&config).unwrap();
    let candidate_specs = Builtin.candidate_specs(&config, &teacher_specs).unwrap();
    for (k, block) in scores.blocks.iter().enumerate() {
        for (c, candidate) in block.candidates.iter().enumerate() {
            assert!(candidate.loss.is_finite() && candidate.loss > 0.0, "{candidate:?}");
            let output_loss = candidate.output_loss.expect("a replace-one-block output loss");
            assert!(output_loss.is_finite() && output_loss > 0.0, "{candidate:?}");
            assert!(candidate.latency_ms > 0.0, "{candidate:?}");
            if let Some(spec) = candidate_specs[k].get(c) {
                assert_eq!((candidate.flops, candidate.params), (spec.flops, spec.params));
            }
            assert!(run_dir.join(&candidate.weights).is_file(), "{:?}", candidate.weights);
        }
    }
    assert!(run_dir.join("search.csv").is_file());

    let (cheapest, expected) = chosen_under_a_budget(dir.path(), &run_dir, &scores);
    chosen_config_reloads_the_scored_weights(&chosen_path_in(dir.path()), &scores, &expected, &teacher_specs);
    budgets_refused_and_the_pareto_front(&run_dir, cheapest);
}

fn chosen_path_in(dir: &Path) -> PathBuf {
    dir.join("chosen.toml")
}

/// `pipebd search --budget` at half-way between the cheapest and the dearest
/// student picks what brute force picks, by held-out loss and by output
/// loss; returns the cheapest total FLOPs and the loss-chosen candidates.
fn chosen_under_a_budget(dir: &Path, run_dir: &Path, scores: &SearchScores) -> (u64, Vec<usize>) {
    // The choice under a budget between the cheapest and the dearest student.
    let (cheapest, dearest) = (
        scores.blocks.iter().map(|b| b.candidates.iter().map(|c| c.flops).min().unwrap()).sum::<u64>(),
        scores.blocks.iter().map(|b| b.candidates.iter().map(|c| c.flops).max().unwrap()).sum::<u64>(),
    );
    let budget = (cheapest + dearest) / 2;
    let chosen_path = chosen_path_in(dir);
    let said = run_ok(&[
        "search".as_ref(),
        run_dir.as_os_str(),
        "--budget".as_ref(),
        format!("flops={budget}").as_ref(),
        "--out".as_ref(),
        chosen_path.as_os_str(),
    ]);
    let (_, expected) = brute_force(scores, budget as f64).unwrap();
    let picks: Vec<String> = expected.iter().map(|c| (c + 1).to_string()).collect();
    assert!(said.contains(&format!("chosen candidates {}", picks.join("-"))), "{said}");
    // The same budget on the replace-one-block output losses.
    let output_path = dir.join("chosen-output.toml");
    let said = run_ok(&[
        "search".as_ref(),
        run_dir.as_os_str(),
        "--budget".as_ref(),
        format!("flops={budget}").as_ref(),
        "--objective".as_ref(),
        "output".as_ref(),
        "--out".as_ref(),
        output_path.as_os_str(),
    ]);
    let (_, by_output) = brute_force_of(scores, budget as f64, |c| c.output_loss.unwrap()).unwrap();
    let picks: Vec<String> = by_output.iter().map(|c| (c + 1).to_string()).collect();
    assert!(said.contains(&format!("chosen candidates {}", picks.join("-"))), "{said}");
    assert!(said.contains("summed replace-one-block output loss"), "{said}");

    (cheapest, expected)
}

/// The chosen config trains ordinary blocks from the chosen candidates'
/// weights: their held-out losses are the ones the search scored.
fn chosen_config_reloads_the_scored_weights(
    chosen_path: &Path,
    scores: &SearchScores,
    expected: &[usize],
    teacher_specs: &[pipe_bd::BlockSpec],
) {
    let chosen = Builtin.load_config(chosen_path, Default::default()).unwrap();
    assert!(!chosen.has_candidates());
    assert!(chosen.train.stitched_epochs >= 1);
    let device = Default::default();
    let students = Builtin.students::<B>(&chosen, teacher_specs, &device).unwrap();
    let students = load_student_weights(&chosen, students, &device).unwrap();
    let inner: Vec<_> = students.blocks.iter().map(|b| b.valid()).collect();
    let teacher = build_teacher::<Flex>(&chosen, &device).unwrap();
    let data = pipebd_zoo::mnist::load(&chosen.data.dir, Split::Train, chosen.data.train_limit).unwrap();
    let held_out = DatasetSlice::new(&data, 576, 64);
    let losses: Vec<Loss> = teacher_specs.iter().map(|t| Loss::new(t.loss)).collect();
    // The output loss: the last block's (no stitched output loss configured).
    let output_loss = *losses.last().unwrap();
    let measured = measure_candidates(
        &teacher.blocks,
        &inner,
        &losses,
        Some(&output_loss),
        &held_out,
        64,
        &device,
        &mut |_, _| {},
    )
    .unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * a.abs().max(b.abs());
    for (k, (block, &c)) in scores.blocks.iter().zip(expected).enumerate() {
        let (scored, again) = (block.candidates[c].loss, measured[k][0].loss);
        assert!(close(scored, again), "block {}: scored {scored}, reloaded {again}", k + 1);
        let (scored, again) = (block.candidates[c].output_loss.unwrap(), measured[k][0].output_loss.unwrap());
        assert!(close(scored, again), "block {}: output loss scored {scored}, reloaded {again}", k + 1);
        // The same, by hand: the teacher with only block k replaced, on all
        // 64 held-out samples at once.
        let batch: Vec<usize> = (0..64).collect();
        let input = pipe_bd::Dataset::batch(&held_out, &batch, &device).unwrap();
        let (mut ours, mut theirs) = (input.clone(), input);
        for (j, block) in teacher.blocks.iter().enumerate() {
            ours = if j == k { inner[j].forward(ours).unwrap() } else { block.forward(ours).unwrap() };
            theirs = block.forward(theirs).unwrap();
        }
        let by_hand: f32 =
            burn::tensor::ElementConversion::elem(output_loss.compute(ours, theirs).unwrap().into_scalar());
        assert!(close(again, f64::from(by_hand)), "block {}: measured {again}, by hand {by_hand}", k + 1);
    }
}

/// A budget below the cheapest student, and a malformed one, are refused;
/// the Pareto front runs cheapest first, each point strictly better than the
/// cheaper ones.
fn budgets_refused_and_the_pareto_front(run_dir: &Path, cheapest: u64) {
    let output = pipebd(&["search".as_ref(), run_dir.as_os_str(), "--budget".as_ref(), "flops=1".as_ref()])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("no student fits flops=1: the cheapest choice needs {cheapest}")),
        "{stderr}"
    );
    let output = pipebd(&["search".as_ref(), run_dir.as_os_str(), "--budget".as_ref(), "size=3".as_ref()])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&output.stderr).contains("budget `size=3`: unknown cost"));

    run_ok(&["search".as_ref(), run_dir.as_os_str(), "--pareto".as_ref(), "flops".as_ref()]);
    let csv = std::fs::read_to_string(run_dir.join("pareto.csv")).unwrap();
    let rows: Vec<(f64, u64)> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect();
    assert!(!rows.is_empty());
    assert_eq!(rows[0].1, cheapest);
    for pair in rows.windows(2) {
        assert!(pair[1].1 > pair[0].1 && pair[1].0 < pair[0].0, "{pair:?}");
    }
    assert!(run_dir.join("pareto.png").is_file());
    // Thinned to two points: the cheapest and the dearest of the front.
    let args = ["search", "--pareto", "flops", "--points", "2"].map(std::ffi::OsStr::new);
    run_ok(&[args[0], run_dir.as_os_str(), args[1], args[2], args[3], args[4]]);
    let thinned = std::fs::read_to_string(run_dir.join("pareto.csv")).unwrap();
    let flops: Vec<u64> =
        thinned.lines().skip(1).map(|l| l.split(',').nth(2).unwrap().parse().unwrap()).collect();
    let ends = if rows.len() == 1 { vec![rows[0].1] } else { vec![rows[0].1, rows[rows.len() - 1].1] };
    assert_eq!(flops, ends, "{thinned}");
}

/// Every float parameter of every saved student block (candidate sets whole).
fn saved_weights(run_dir: &Path) -> Vec<Vec<f32>> {
    let report = pipebd_cli::report::RunReport::read(run_dir).unwrap();
    let teacher = Builtin.teacher_specs(&report.config).unwrap();
    let (blocks, _) = load_students(&Builtin, run_dir, &report.config, &teacher).unwrap();
    flat(&blocks)
}

/// `pipebd run <config> --out <out> --quiet`.
fn run_args<'a>(config: &'a Path, out: &'a Path) -> [&'a std::ffi::OsStr; 5] {
    ["run".as_ref(), config.as_os_str(), "--out".as_ref(), out.as_os_str(), "--quiet".as_ref()]
}

#[test]
fn a_search_run_killed_with_sigkill_resumes_to_the_same_candidates_and_scores() {
    killed_and_resumed(&search_text(640, 6));
}

#[test]
fn a_single_path_search_killed_with_sigkill_resumes_to_the_same_supernets_and_alpha() {
    let (_dir, run) = killed_and_resumed(&single_path_text(640, 6, 0.25));
    // `--argmax` chooses each block's most probable candidate.
    let scores = SearchScores::read(&run).unwrap();
    let mut picks = Vec::new();
    for block in &scores.blocks {
        if block.candidates.len() == 1 {
            // An ordinary student (blocks 1 and 3): no architecture weights.
            assert_eq!(block.candidates[0].probability, None);
            picks.push("1".to_string());
            continue;
        }
        let probabilities: Vec<f64> = block.candidates.iter().map(|c| c.probability.unwrap()).collect();
        // The architecture steps moved the weights away from uniform.
        let spread = probabilities.iter().fold(0f64, |m, p| m.max(*p))
            - probabilities.iter().fold(1f64, |m, p| m.min(*p));
        assert!(spread > 1e-4, "the architecture weights never moved: {probabilities:?}");
        let best =
            (0..probabilities.len()).fold(0, |b, i| if probabilities[i] > probabilities[b] { i } else { b });
        picks.push((best + 1).to_string());
    }
    let said = run_ok(&["search".as_ref(), run.as_os_str(), "--argmax".as_ref()]);
    assert!(said.contains(&format!("chosen candidates {}", picks.join("-"))), "{said}");
    assert!(run.join("chosen.toml").is_file());
}

/// Runs `text` to the end, and again killed with SIGKILL after a checkpoint
/// and resumed; asserts that both end with the same weights and scores.
/// Returns the temporary folder and the resumed run's folder.
fn killed_and_resumed(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let text = text.replace(
        "device = \"cpu\"\n",
        "device = \"cpu\"\n\n[checkpoint]\nevery_steps = 2\nevery_minutes = 0.0\n",
    );
    let config = write(dir.path(), "search.toml", &text);
    let reference = dir.path().join("reference");
    run_ok(&run_args(&config, &reference));

    let killed = dir.path().join("killed");
    let mut child =
        pipebd(&run_args(&config, &killed)).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    common::kill_after_checkpoint(&mut child, &killed.join("checkpoints"), 10);
    assert!(!killed.join("search.json").exists(), "the run had finished: not killed mid-run");
    let mut resume = run_args(&config, &killed).to_vec();
    resume.extend(["--resume".as_ref(), killed.as_os_str()]);
    run_ok(&resume);

    let (a, b) = (saved_weights(&reference), saved_weights(&killed));
    let diff = common::max_abs_diff(&a, &b);
    assert!(diff <= 1e-5, "resumed candidates differ by {diff}");
    let (a, b) = (SearchScores::read(&reference).unwrap(), SearchScores::read(&killed).unwrap());
    for (x, y) in a.blocks.iter().zip(&b.blocks) {
        for (p, q) in x.candidates.iter().zip(&y.candidates) {
            assert!((p.loss - q.loss).abs() <= 1e-5 * p.loss, "block {}: {} vs {}", x.block, p.loss, q.loss);
            let (p, q) = (p.probability.unwrap_or(0.0), q.probability.unwrap_or(0.0));
            assert!((p - q).abs() <= 1e-6, "block {}: probability {p} vs {q}", x.block);
        }
    }
    (dir, killed)
}

#[test]
fn minilm_layers_search_among_pruned_encoders_and_skip() {
    use pipebd_students::{EncoderInit, StudentBlockConfig};
    let mut config = common::minilm_config(80, 8, 1, 16);
    let set = StudentBlockConfig::Candidates {
        candidates: vec![
            StudentBlockConfig::Encoder { heads: 2, head_dim: 32, ffn: 64, init: EncoderInit::Teacher },
            StudentBlockConfig::Skip,
        ],
    };
    let table = pipebd_cli::zoo::student_table(&set).unwrap();
    for student in &mut config.students {
        *student = table.clone();
    }
    let dir = tempfile::tempdir().unwrap();
    let config_path = write(dir.path(), "minilm-search.toml", &config.to_toml());
    let run_dir = dir.path().join("run");
    run_ok(&[
        "run".as_ref(),
        config_path.as_os_str(),
        "--out".as_ref(),
        run_dir.as_os_str(),
        "--quiet".as_ref(),
    ]);
    let scores = SearchScores::read(&run_dir).unwrap();
    assert_eq!(scores.held_out_samples, 8);
    assert_eq!(scores.blocks.len(), 6);
    for block in &scores.blocks {
        let [encoder, skip] = &block.candidates[..] else { panic!("two candidates per layer: {block:?}") };
        assert_eq!((skip.name.as_str(), skip.flops, skip.params), ("skip", 0, 0));
        assert!(skip.loss.is_finite() && skip.loss > 0.0, "the identity is not the teacher layer: {skip:?}");
        assert!(encoder.flops > 0 && encoder.params > 0 && encoder.loss.is_finite(), "{encoder:?}");
    }
    // No budget at all: every layer skipped, a valid config.
    let chosen_path = dir.path().join("chosen.toml");
    let said = run_ok(&[
        "search".as_ref(),
        run_dir.as_os_str(),
        "--budget".as_ref(),
        "flops=0".as_ref(),
        "--out".as_ref(),
        chosen_path.as_os_str(),
    ]);
    assert!(said.contains("chosen candidates 2-2-2-2-2-2"), "{said}");
    let chosen = Builtin.load_config(&chosen_path, Default::default()).unwrap();
    let teacher = Builtin.teacher_specs(&chosen).unwrap();
    let specs = Builtin.student_specs(&chosen, &teacher).unwrap();
    assert!(specs.iter().all(|s| s.name == "skip" && s.params == 0));

    // Room for half the encoders' FLOPs: the choice is the best of the 64
    // layer assignments within the budget (the summed normalised losses),
    // found here by trying them all.
    let budget: u64 = scores.blocks.iter().map(|b| b.candidates[0].flops).sum::<u64>() / 2;
    let mut best: Option<(f64, Vec<usize>)> = None;
    for mask in 0..1usize << scores.blocks.len() {
        let picks: Vec<usize> =
            (0..scores.blocks.len()).map(|k| if mask >> k & 1 == 1 { 0 } else { 1 }).collect();
        let flops: u64 = picks.iter().zip(&scores.blocks).map(|(&c, b)| b.candidates[c].flops).sum();
        let loss: f64 = picks.iter().zip(&scores.blocks).map(|(&c, b)| b.candidates[c].normalised_loss).sum();
        if flops <= budget && best.as_ref().is_none_or(|(l, _)| loss < *l) {
            best = Some((loss, picks));
        }
    }
    let (_, picks) = best.expect("skipping every layer fits any budget");
    let expected: Vec<String> = picks.iter().map(|c| (c + 1).to_string()).collect();
    let said = run_ok(&[
        "search".as_ref(),
        run_dir.as_os_str(),
        "--budget".as_ref(),
        format!("flops={budget}").as_ref(),
        "--out".as_ref(),
        chosen_path.as_os_str(),
    ]);
    assert!(said.contains(&format!("chosen candidates {}", expected.join("-"))), "budget {budget}: {said}");
}

#[test]
fn pipebd_bench_runs_a_single_path_search_on_its_training_split() {
    // 640 samples: 64 held out for the architecture steps, 576 trained on
    // (9 steps of 64 per epoch).
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "search.toml", &single_path_text(640, 1, 0.25));
    let out = dir.path().join("bench");
    run_ok(&[
        "bench".as_ref(),
        config.as_os_str(),
        "--schedules".as_ref(),
        "dp,tr-dpu".as_ref(),
        "--devices".as_ref(),
        "cpu,cpu".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("bench.json")).unwrap()).unwrap();
    assert_eq!(report["steps"], 9, "bench trains on the run's training split: {report}");
    let rows = report["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["schedule"].as_str().unwrap()).collect();
    assert_eq!(names, ["dp", "tr-dpu"]);
    for row in rows {
        assert!(row["seconds"].as_f64().unwrap() > 0.0, "{row}");
    }
}
