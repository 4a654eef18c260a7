//! The MiniLM teacher is the real all-MiniLM-L6-v2: same token ids and the
//! same sentence embeddings as the reference Python implementation
//! (sentence-transformers), recorded in `../shared/reference/minilm-l6.json`
//! and copied to `tests/data/minilm-l6-reference.json`.

use burn::backend::Flex;
use pipe_bd::eval::Network;
use pipe_bd::{forward_chain, Activation};
use pipebd_cli::config::RunConfig;
use pipebd_cli::zoo::{student_table, Zoo};
use pipebd_teachers::minilm::MiniLmTokenizer;
use pipebd_zoo::build_minilm;
use pipebd_zoo::text::sentence_embeddings;
use pipebd_zoo::text_scores::{cosine, TextReport};
use pipebd_zoo::Builtin;
use serde::Deserialize;

use crate::common;

#[derive(Deserialize)]
struct Reference {
    max_length: usize,
    sentences: Vec<Sentence>,
}

#[derive(Deserialize)]
struct Sentence {
    text: String,
    input_ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn reference() -> Reference {
    let path = common::repo().join("tests/data/minilm-l6-reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn config(layers_per_block: Option<Vec<usize>>, max_tokens: usize) -> RunConfig {
    let mut config = common::minilm_config(64, 16, 1, max_tokens);
    if let Some(groups) = layers_per_block {
        let groups = groups.iter().map(|&n| toml::Value::Integer(n as i64)).collect();
        config.teacher.options.insert("layers_per_block".into(), toml::Value::Array(groups));
    }
    config
}

#[test]
fn teacher_reproduces_the_reference_ids_and_embeddings() {
    let reference = reference();
    let config = config(None, reference.max_length);
    let tokenizer = MiniLmTokenizer::load(&pipebd_zoo::tokenizer_path(&config).unwrap()).unwrap();
    let device = Default::default();
    let (embeddings, teacher) = build_minilm::<Flex>(&config, &device).unwrap();
    let mut ids = Vec::new();
    for sentence in &reference.sentences {
        let ours = tokenizer.encode(&sentence.text, reference.max_length).unwrap();
        assert_eq!(ours, sentence.input_ids, "token ids of {:?}", sentence.text);
        ids.push(ours);
    }
    let run_teacher = |x| forward_chain(&teacher.blocks, x);
    let network = Network::new(&run_teacher, &teacher.specs);
    let ours = sentence_embeddings(&embeddings, &network, &ids, reference.max_length, &device, 3).unwrap();
    for (sentence, embedding) in reference.sentences.iter().zip(&ours) {
        let similarity = cosine(embedding, &sentence.embedding);
        assert!(similarity >= 0.9999, "cosine {similarity} for {:?}", sentence.text);
    }
}

#[test]
fn grouping_layers_into_blocks_does_not_change_the_teacher() {
    let reference = reference();
    let device = Default::default();
    let tokenizer = MiniLmTokenizer::load(&pipebd_zoo::tokenizer_path(&config(None, 32)).unwrap()).unwrap();
    let ids: Vec<Vec<u32>> =
        reference.sentences.iter().take(3).map(|s| tokenizer.encode(&s.text, 32).unwrap()).collect();
    let (embeddings, six) = build_minilm::<Flex>(&config(None, 32), &device).unwrap();
    let (_, three) = build_minilm::<Flex>(&config(Some(vec![2, 3, 1]), 32), &device).unwrap();
    assert_eq!(three.blocks.len(), 3);
    assert_eq!(
        three.specs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["layers1-2", "layers3-5", "layer6"]
    );
    let flops = |t: &pipe_bd::Teacher<Flex, _>| t.specs.iter().map(|s| s.flops).sum::<u64>();
    assert_eq!(flops(&six), flops(&three));
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let input = pipebd_zoo::text::embed_batch(&embeddings, &refs, 32, &device);
    let (Activation::Tokens { hidden: a, .. }, Activation::Tokens { hidden: b, .. }) =
        (forward_chain(&six.blocks, input.clone()).unwrap(), forward_chain(&three.blocks, input).unwrap())
    else {
        panic!("token states expected");
    };
    let diff = (a - b).abs().max().into_scalar();
    assert!(diff < 1e-5, "{diff}");
}

type Train = burn::backend::Autodiff<Flex>;

#[test]
fn a_student_pruned_to_the_teachers_full_size_is_the_teacher() {
    let device = Default::default();
    let mut config = config(None, 16);
    for student in &mut config.students {
        *student = student_table(&pipebd_students::StudentBlockConfig::Encoder {
            heads: 12,
            head_dim: 32,
            ffn: 1536,
            init: pipebd_students::EncoderInit::Teacher,
        })
        .unwrap();
    }
    let (embeddings, teacher) = build_minilm::<Flex>(&config, &device).unwrap();
    let students = Builtin.students::<Train>(&config, &teacher.specs, &device).unwrap();
    let stitched = pipe_bd::train::inference_blocks(&students);
    let ids: Vec<Vec<u32>> = vec![vec![101, 1996, 4248, 2829, 102], vec![101, 7592, 102]];
    let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let input = pipebd_zoo::text::embed_batch(&embeddings, &refs, 16, &device);
    let ours = forward_chain(&stitched, input.clone()).unwrap().into_tokens(0).unwrap().0;
    let theirs = forward_chain(&teacher.blocks, input).unwrap().into_tokens(0).unwrap().0;
    let diff = (ours - theirs).abs().max().into_scalar();
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn teacher_initialisation_refuses_a_student_wider_than_the_teacher() {
    let mut config = config(None, 16);
    config.students[2] = student_table(&pipebd_students::StudentBlockConfig::Encoder {
        heads: 12,
        head_dim: 32,
        ffn: 2048,
        init: pipebd_students::EncoderInit::Teacher,
    })
    .unwrap();
    let specs = Builtin.teacher_specs(&config).unwrap();
    let err = Builtin.students::<Train>(&config, &specs, &Default::default()).err().unwrap();
    let message = err.to_string();
    assert!(message.contains("block 3") && message.contains("ffn <= 1536"), "{message}");
}

/// The tiny text config of the schedule test: SGD, whose update is linear in
/// the gradient (Adam's normalisation would magnify float noise in
/// near-zero gradients into full-size steps).
fn sgd_config() -> RunConfig {
    let mut config = config(None, 16);
    config.optimizer.kind = pipe_bd::train::optim::OptimizerKind::Sgd;
    config.optimizer.lr = 0.5;
    config
}

/// The tiny text job of the schedule test, built once (pruning the students
/// from the teacher is most of its cost): the workload and the untrained
/// students every schedule starts from.
struct TextJob {
    config: RunConfig,
    workload: pipebd_cli::zoo::Workload<Flex, <Builtin as Zoo>::Teacher<Flex>>,
    students: pipe_bd::Students<Train, <Builtin as Zoo>::Student<Train>>,
}

impl TextJob {
    fn new() -> Self {
        let config = sgd_config();
        let workload = Builtin.workload::<Flex>(&config, &Default::default(), false).unwrap();
        let students =
            Builtin.students::<Train>(&config, &workload.teacher.specs, &Default::default()).unwrap();
        Self { config, workload, students }
    }

    /// Trains a copy of the untrained students under `plan` on `slots` CPU
    /// slots; returns their parameters.
    fn train(&self, plan: &pipe_bd::plan::Plan, slots: usize) -> Vec<Vec<f32>> {
        let (teacher, data) = (&self.workload.teacher, self.workload.train.as_ref());
        let options = pipe_bd::runtime::RuntimeSettings { threads_per_worker: 1, ..Default::default() };
        let output = pipe_bd::runtime::Distillation::new(teacher, self.students.clone(), data)
            .settings(self.config.train_settings())
            .devices(vec![Default::default(); slots])
            .runtime(options)
            .run(plan)
            .unwrap_or_else(|e| panic!("{}: {e}", plan.name));
        assert_eq!(output.log.steps, 4);
        output.students.blocks.iter().map(pipe_bd::flat_parameters::<Train, _>).collect()
    }
}

#[test]
fn every_schedule_trains_the_same_text_students() {
    use pipe_bd::plan::{flops_cost, Plan, StageSpec};
    let job = TextJob::new();
    let reference = job.train(&Plan::ideal(6), 1);
    let initial: Vec<Vec<f32>> =
        job.students.blocks.iter().map(pipe_bd::flat_parameters::<Train, _>).collect();
    let max_diff = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0f32, f32::max)
    };
    let moved = max_diff(&reference, &initial);
    assert!(moved > 1e-5, "training did not move the weights: {moved}");
    // Agreement means something only if the schedules land far closer to
    // ideal than training moved the weights: within 1% of that movement (and
    // never further than 1e-5), so weights that barely moved cannot pass.
    let tolerance = (moved / 100.0).min(1e-5);
    let config = config(None, 16);
    let specs = Builtin.teacher_specs(&config).unwrap();
    let students = Builtin.student_specs(&config, &specs).unwrap();
    let cost = flops_cost(&specs, &students);
    let mut plans: Vec<Plan> = ["dp", "ls", "tr", "tr-dpu"]
        .iter()
        .map(|name| Plan::named(name, 6, 2, &cost, &[]).unwrap())
        .collect();
    // One replicated stage: each replica takes half of every batch, whose
    // sentences have different numbers of real tokens.
    plans.push(Plan::hybrid(&[StageSpec { blocks: (1..=6).collect(), replicas: 2 }], 6, 2).unwrap());
    for plan in plans {
        let diff = max_diff(&reference, &job.train(&plan, 2));
        assert!(
            diff <= tolerance,
            "{} ({}) differs from ideal by {diff}; training moved the weights by {moved}",
            plan.name,
            plan.describe()
        );
    }
}

/// The mean embedding cosine to the teacher, on the held-out sentences of
/// `config`, of the students a run of `config` starts from (pruned from the
/// teacher, not trained), scored as the run scores its trained students.
fn untrained_cosine(config: &RunConfig) -> f64 {
    let mut config = config.clone();
    config.data.options.remove("probe");
    let device = Default::default();
    let workload = Builtin.workload::<Flex>(&config, &device, true).unwrap();
    let teacher = &workload.teacher;
    let students = Builtin.students::<Train>(&config, &teacher.specs, &device).unwrap();
    let blocks = pipe_bd::train::inference_blocks(&students);
    let (evaluation, specs) = (workload.evaluation.as_deref(), &teacher.specs[..]);
    let score =
        pipe_bd::eval::score(evaluation, (&teacher.blocks, specs), (&blocks, &students.specs), &device)
            .unwrap();
    score.figure("embedding_cosine").expect("a text workload scores sentence embeddings")
}

#[test]
fn a_text_run_reports_cosine_and_probe_and_eval_reproduces_them() {
    let mut config = config(None, 16);
    // Three passes over the 64 training sentences (12 steps), with PyTorch's
    // Adam epsilon: burn's 1e-5 damps the tiny per-element MSE gradients
    // (README), and the students must move measurably from their start.
    config.train.epochs = 3;
    config.optimizer.epsilon = 1e-8;
    let probe = pipebd_zoo::text::ProbeConfig {
        dir: common::repo().join("data/spam-assassin"),
        limit: Some(80),
        max_tokens: 24,
        test_fraction: 0.25,
    };
    config.data.options.insert("probe".into(), toml::Value::try_from(probe).unwrap());
    let start = untrained_cosine(&config);
    let out = tempfile::tempdir().unwrap();
    let report = pipebd_zoo::run_builtin(&config, out.path(), &Default::default(), &mut |_| {}).unwrap();
    let text: TextReport =
        report.section(TextReport::SECTION).unwrap().expect("a text run reports its text section");
    assert_eq!(text.heldout_sentences, 16);
    // The pruned start is already close to the teacher; training must bring
    // the stitched student closer still (a run that trains nothing ties, one
    // that follows a wrong gradient drifts away).
    let trained = text.embedding_cosine;
    eprintln!("embedding cosine to the teacher: pruned start {start:.5}, trained {trained:.5}");
    assert!(trained > start, "training took the embedding cosine from {start} (untrained) to {trained}");
    // Each pass sees the same 64 sentences (in another order): every block's
    // mean loss over the last pass is below its mean over the first.
    let csv = std::fs::read_to_string(out.path().join("metrics.csv")).unwrap();
    let rows: Vec<(usize, usize, f64)> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].parse().unwrap(), f[2].parse().unwrap(), f[3].parse().unwrap())
        })
        .collect();
    for block in 1..=6 {
        let mean = |epoch: usize| {
            let losses: Vec<f64> =
                rows.iter().filter(|r| r.0 == epoch && r.1 == block).map(|r| r.2).collect();
            assert_eq!(losses.len(), 4, "block {block}: steps logged in epoch {epoch}");
            losses.iter().sum::<f64>() / 4.0
        };
        let (first, last) = (mean(0), mean(2));
        assert!(last < first, "block {block}: mean loss {first} in the first pass, {last} in the last");
    }
    assert!((text.params_ratio - 1183872.0 / 1774464.0).abs() < 1e-9, "{}", text.params_ratio);
    let probe = text.probe.expect("probe configured");
    assert_eq!((probe.train_emails, probe.test_emails), (60, 20));
    // The saved student, reloaded, scores exactly what the run reported.
    let eval = pipebd_zoo::eval_builtin_run(out.path()).unwrap();
    let section = eval.sections.iter().find(|s| s.name == TextReport::SECTION).expect("text section");
    let again: TextReport = serde_json::from_value(section.value.clone()).unwrap();
    assert_eq!(again.heldout_sentences, text.heldout_sentences);
    assert!((again.embedding_cosine - text.embedding_cosine).abs() < 1e-6);
    assert_eq!(eval.student_accuracy, report.student_accuracy);
}

#[test]
fn the_torch_generator_is_refused_for_minilm_students() {
    let mut config = config(None, 16);
    config.generator = pipe_bd::rng::Generator::Torch;
    let error = pipebd_cli::zoo::Zoo::check(&pipebd_zoo::Builtin, &config).unwrap_err().to_string();
    assert!(error.contains("generator") && error.contains("native"), "{error}");
}

#[test]
fn teacher_block_loss_sets_every_mse_block_and_is_checked() {
    use pipebd_core::LossKind;
    let mut config = config(None, 16);
    assert!(Builtin.teacher_specs(&config).unwrap().iter().all(|s| s.loss == LossKind::Mse));
    for (name, kind) in [("nmse", LossKind::Nmse), ("nmse-token", LossKind::NmseToken)] {
        config.teacher.options.insert("block_loss".into(), toml::Value::String(name.into()));
        Builtin.check(&config).unwrap();
        let teacher = Builtin.teacher_specs(&config).unwrap();
        assert!(teacher.iter().all(|s| s.loss == kind), "{name}: {teacher:?}");
        let students = Builtin.student_specs(&config, &teacher).unwrap();
        assert!(
            students.iter().all(|s| s.loss == kind),
            "{name}: the students train on their teacher's loss"
        );
    }
    config.teacher.options.insert("block_loss".into(), toml::Value::String("l1".into()));
    let error = Builtin.check(&config).unwrap_err().to_string();
    assert!(error.contains("`l1`, expected one of `mse`, `nmse`, `nmse-token`"), "{error}");
}
