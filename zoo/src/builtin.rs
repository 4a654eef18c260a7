//! The built-in zoo ([`Builtin`]), from config sections: the teachers of
//! `pipebd-teachers` and the students of `pipebd-students` (both implement
//! the block API of `pipebd-core` themselves) built into a [`Teacher`] and
//! [`Students`], with their data.
//!
//! Each teacher's own code is its module's ([`crate::mnist_cnn`],
//! [`crate::minilm`], [`crate::smollm2`]); this one keeps the [`Zoo`] impl,
//! the checks of the config that every teacher shares, the students'
//! building, and [`TeacherKind`]: the one place that picks the teacher of a
//! config and sends each per-teacher question to its module. A new teacher
//! is its module, a variant of [`TeacherKind`] with its arms, and the
//! students it takes.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use pipebd_core::{check_against_teacher, check_block_count, BlockSpec, OutputHead, Students, Teacher};
use pipebd_kernels::{DistillBackend, FusedBackend};
use pipebd_students::{EncoderInit, StudentBlock, StudentBlockConfig};
use pipebd_teachers::minilm::{LAYERS as MINILM_LAYERS, MAX_POSITIONS};
use pipebd_teachers::TeacherBlock;

use pipe_bd::{Error, Result};
use pipebd_cli::config::{ConfigIssue, RunConfig};
use pipebd_cli::jobs::export::{ExportRequest, Exported, TextScore, TextScoreRequest};
use pipebd_cli::zoo::{parse_options, parse_students, Workload, Zoo};

use crate::options::{grouped_layers, DataOptions, TeacherOptions};
use crate::smollm2::SMOLLM2;
use crate::text::ProbeConfig;
use crate::{minilm, mnist_cnn, smollm2, Lift};

/// The built-in teacher a config names, picked once ([`TeacherKind::of`]);
/// each method answers one per-teacher question from that teacher's module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TeacherKind {
    /// The MNIST CNN on MNIST-format images ([`crate::mnist_cnn`]).
    MnistCnn,
    /// MiniLM on the Brown corpus ([`crate::minilm`]).
    MiniLm,
    /// The decoder LLM SmolLM2-135M on the Brown corpus ([`crate::smollm2`]).
    SmolLm2,
}

impl TeacherKind {
    /// Every built-in teacher, in the order the config errors list them.
    const ALL: [Self; 3] = [Self::MnistCnn, Self::MiniLm, Self::SmolLm2];

    /// The teacher of `config`: `teacher.kind = "smollm2-135m"`, else
    /// MiniLM on `data.dataset = "brown"`, else the MNIST CNN (a config
    /// whose kind does not fit its dataset is refused by
    /// [`Zoo::check_config`]).
    pub(crate) fn of(config: &RunConfig) -> Self {
        if smollm2::is_decoder(config) {
            Self::SmolLm2
        } else if config.data.dataset == crate::text::DATASET {
            Self::MiniLm
        } else {
            Self::MnistCnn
        }
    }

    /// Its `teacher.kind`.
    fn name(self) -> &'static str {
        match self {
            Self::MnistCnn => mnist_cnn::KIND,
            Self::MiniLm => minilm::KIND,
            Self::SmolLm2 => SMOLLM2,
        }
    }

    /// The `data.dataset` it is distilled on.
    fn dataset(self) -> &'static str {
        match self {
            Self::MnistCnn => crate::mnist::DATASET,
            Self::MiniLm | Self::SmolLm2 => crate::text::DATASET,
        }
    }

    /// The datasets of the built-in teachers, each once, in order.
    fn datasets() -> Vec<&'static str> {
        let mut datasets: Vec<&'static str> = Vec::new();
        for teacher in Self::ALL {
            if !datasets.contains(&teacher.dataset()) {
                datasets.push(teacher.dataset());
            }
        }
        datasets
    }

    /// Layers that `teacher.layers_per_block` groups (one block each by
    /// default): SmolLM2's are its file's (see [`smollm2::teacher_layers`]).
    /// The MNIST CNN has no layers option: a `layers_per_block` given for it
    /// is checked against MiniLM's count, as it always was.
    fn layers(self, config: &RunConfig) -> usize {
        match self {
            Self::SmolLm2 => smollm2::teacher_layers(config),
            Self::MiniLm | Self::MnistCnn => MINILM_LAYERS,
        }
    }

    /// Blocks it is cut into under `options` (the teacher of `config`).
    fn blocks(self, config: &RunConfig, options: &TeacherOptions) -> usize {
        match self {
            Self::MnistCnn => mnist_cnn::blocks(),
            Self::MiniLm | Self::SmolLm2 => {
                options.layers_per_block.as_ref().map_or_else(|| self.layers(config), Vec::len)
            }
        }
    }

    /// Whether its students may be drawn by `generator = "torch"` (built of
    /// Conv2d and Linear layers only).
    fn takes_torch_generator(self) -> bool {
        self == Self::MnistCnn
    }

    /// Why a student (or candidate) of kind `kind` cannot stand in for
    /// block `k` (zero-based) of this teacher, if it cannot: a bidirectional
    /// `encoder` for a decoder LLM (it would see the tokens it predicts), a
    /// `decoder` for any other teacher.
    fn refused_student(self, config: &RunConfig, k: usize, kind: &str) -> Option<String> {
        match (self, kind) {
            (Self::SmolLm2, "encoder") => Some(smollm2::encoder_student_refused(k)),
            (Self::MnistCnn | Self::MiniLm, "decoder") => {
                Some(smollm2::decoder_student_refused(k, &config.teacher.kind))
            }
            _ => None,
        }
    }

    /// Its block specs, cheaply (no large weight file read).
    fn specs(self, config: &RunConfig) -> Result<Vec<BlockSpec>> {
        match self {
            Self::MnistCnn => mnist_cnn::specs(config),
            Self::MiniLm => minilm::specs(config),
            Self::SmolLm2 => smollm2::specs(config),
        }
    }

    /// It with its weights on `device`, cut into the configured blocks.
    fn build<B: FusedBackend>(self, config: &RunConfig, device: &B::Device) -> Result<BuiltinTeacher<B>> {
        match self {
            Self::MnistCnn => mnist_cnn::build_teacher(config, device),
            Self::MiniLm => Ok(minilm::build_minilm(config, device)?.1),
            Self::SmolLm2 => Ok(smollm2::build_smollm2(config, device)?.teacher),
        }
    }

    /// Loads the config's training data, teacher and evaluation data on
    /// `device`. With `with_evaluation = false` the held-out and probe data
    /// are skipped.
    fn workload<B: FusedBackend>(
        self,
        config: &RunConfig,
        device: &B::Device,
        with_evaluation: bool,
    ) -> Result<Workload<B, TeacherBlock<B>>> {
        match self {
            Self::MnistCnn => mnist_cnn::load_workload(config, device, with_evaluation),
            Self::MiniLm => minilm::load_workload(config, device, with_evaluation),
            Self::SmolLm2 => smollm2::load_decoder_workload(config, device, with_evaluation),
        }
    }

    /// Replaces the students (and candidates) of `students` that start from
    /// the teacher (`init = "teacher"`) in `blocks` by its layers, pruned to
    /// their size.
    fn init_from_teacher(
        self,
        config: &RunConfig,
        students: &[StudentBlockConfig],
        blocks: &mut [StudentBlock<burn::backend::Flex>],
    ) -> Result<()> {
        match self {
            // Its students start at random (an `encoder`, the one kind
            // pruned from MiniLM, does not fit its image blocks).
            Self::MnistCnn => Ok(()),
            Self::MiniLm => minilm::init_from_teacher(config, students, blocks),
            Self::SmolLm2 => smollm2::init_decoders_from_teacher(config, students, blocks),
        }
    }

    /// Checks that the files a config names are there and what they should be,
    /// without reading what training reads: the MNIST files' headers and sizes
    /// and the MNIST teacher's weights (loaded on the CPU: 1.5 MB), or the
    /// Brown corpus' file list, the probe's folder, MiniLM's safetensors header and its
    /// tokenizer. Every error names the file.
    fn check_inputs(self, config: &RunConfig) -> Result<()> {
        match self {
            Self::MnistCnn => mnist_cnn::check_inputs(config),
            Self::MiniLm => minilm::check_inputs(config),
            Self::SmolLm2 => smollm2::check_inputs(config),
        }
    }

    /// Training samples of `config`, where known without loading them.
    fn train_samples(self, config: &RunConfig) -> Result<Option<usize>> {
        match self {
            Self::MnistCnn => mnist_cnn::train_samples(config),
            // Counting the corpus's sentences means reading it: only a limit is known.
            Self::MiniLm | Self::SmolLm2 => Ok(config.data.train_limit),
        }
    }

    /// Whether a frozen head follows its last block (SmolLM2's LM head).
    fn has_output_head(self) -> bool {
        self == Self::SmolLm2
    }

    /// The frozen head after its last block, if it has one.
    fn output_head<B: DistillBackend>(
        self,
        config: &RunConfig,
        device: &B::Device,
    ) -> Result<Option<Box<dyn OutputHead<B>>>> {
        match self {
            Self::SmolLm2 => Ok(Some(smollm2::output_head(config, device)?)),
            Self::MnistCnn | Self::MiniLm => Ok(None),
        }
    }
}

/// Text teacher layers per block: `teacher.layers_per_block`, or one each.
pub fn layers_per_block(config: &RunConfig) -> Result<Vec<usize>> {
    grouped_layers(config, TeacherKind::of(config).layers(config))
}

/// Builds the teacher named in the config on `device`, with its weights.
pub fn build_teacher<B: FusedBackend>(
    config: &RunConfig,
    device: &B::Device,
) -> Result<Teacher<B, TeacherBlock<B>>> {
    TeacherKind::of(config).build(config, device)
}

/// `config` with every student built at random (`init = "random"`, no
/// `weights` file): the saved records replace the weights anyway, and the
/// teacher init (pruning and a least-squares refit on the training data)
/// would take half a minute for nothing.
pub(crate) fn architecture_only(config: &RunConfig) -> RunConfig {
    fn shapes_only(table: &mut toml::Table) {
        table.remove("weights");
        let kind = table.get("kind").and_then(|k| k.as_str());
        if table.contains_key("init") || matches!(kind, Some("decoder" | "encoder")) {
            table.insert("init".into(), toml::Value::String("random".into()));
        }
        if let Some(toml::Value::Array(candidates)) = table.get_mut("candidates") {
            candidates.iter_mut().filter_map(toml::Value::as_table_mut).for_each(shapes_only);
        }
    }
    let mut shapes = config.clone();
    shapes.students.iter_mut().for_each(shapes_only);
    shapes
}

/// [`pipebd_cli::jobs::run::run`] with the built-in zoo, compiled once in this
/// library (see [`crate::cli`]): callers outside it should prefer this to
/// `run(&Builtin, ...)`.
pub fn run_builtin(
    config: &RunConfig,
    out_dir: &Path,
    options: &pipebd_cli::jobs::run::RunFlags,
    observer: &mut dyn FnMut(&pipe_bd::train::Progress),
) -> Result<pipebd_cli::report::RunReport> {
    pipebd_cli::jobs::run::run(&Builtin, config, out_dir, options, observer)
}

/// [`pipebd_cli::jobs::eval::eval_run`] with the built-in zoo.
pub fn eval_builtin_run(run_dir: &Path) -> Result<pipebd_cli::jobs::eval::EvalResult> {
    pipebd_cli::jobs::eval::eval_run(&Builtin, run_dir)
}

/// A built-in teacher, cut into blocks.
pub type BuiltinTeacher<B> = Teacher<B, TeacherBlock<B>>;

/// Specs of the student blocks described by `configs`, built for the
/// teacher's input shapes. Fails on a block whose shapes do not match.
/// Students initialised from the teacher are checked against it too.
fn specs_of(configs: &[StudentBlockConfig], teacher: &[BlockSpec]) -> Result<Vec<BlockSpec>> {
    // Building draws initial weights: not from under a concurrent build.
    let _rng = pipe_bd::rng::burn_rng_lock();
    let (_, specs) = init_student_blocks::<burn::backend::Flex>(configs, teacher, &Default::default())?;
    Ok(specs)
}

fn init_student_blocks<B: FusedBackend>(
    configs: &[StudentBlockConfig],
    teacher: &[BlockSpec],
    device: &B::Device,
) -> Result<(Vec<StudentBlock<B>>, Vec<BlockSpec>)> {
    check_block_count(configs.len(), teacher.len())?;
    let mut blocks = Vec::new();
    let mut specs = Vec::new();
    for (k, (config, t)) in configs.iter().zip(teacher).enumerate() {
        let built = config.init::<B>(k + 1, &t.input_shape, device).lift()?;
        specs.push(BlockSpec {
            name: config.kind().to_string(),
            input_shape: t.input_shape.clone(),
            output_shape: built.output_shape.clone(),
            flops: built.flops,
            params: built.module.num_params(),
            loss: t.loss,
        });
        blocks.push(built.module);
    }
    check_against_teacher(&specs, teacher)?;
    Ok((blocks, specs))
}

/// Fails unless student `k` (zero-based), if it starts from the teacher
/// (`init = "teacher"`: an `encoder` pruned from MiniLM, a `decoder` from
/// SmolLM2), fits inside the teacher layer it is pruned from.
fn check_teacher_init(k: usize, student: &StudentBlockConfig) -> Result<()> {
    if let StudentBlockConfig::Decoder { init: EncoderInit::Teacher, .. } = student {
        return smollm2::check_decoder_init(k, student);
    }
    minilm::check_teacher_init(k, student)
}

/// Builds the config's student blocks on `device` (random weights seeded by
/// `config.seed`, or pruned from the teacher where asked) and checks them
/// against the teacher.
///
/// The initial weights are made on the CPU (flex) and copied to `device`, so
/// one seed gives the same students on every backend (a wgpu or cuda run
/// starts from exactly the weights of the CPU run).
fn build_students<B: DistillBackend>(
    config: &RunConfig,
    teacher: &[BlockSpec],
    device: &B::Device,
) -> Result<Students<B, StudentBlock<B>>> {
    let (configs, seed) = (&student_configs(config)?, config.seed);
    let cpu = Default::default();
    // burn's CPU backend draws from one process-wide generator: hold it from
    // seeding to the last module built (the target modules below, built on
    // that backend too, included), so that concurrent builds stay reproducible.
    let _rng = pipe_bd::rng::burn_rng_lock();
    let (cpu_blocks, specs) = {
        <burn::backend::Flex as burn::tensor::backend::Backend>::seed(&cpu, seed);
        let (mut blocks, specs) = init_student_blocks::<burn::backend::Flex>(configs, teacher, &cpu)?;
        TeacherKind::of(config).init_from_teacher(config, configs, &mut blocks)?;
        if config.generator == pipe_bd::rng::Generator::Torch {
            let mut rng = pipe_bd::rng::TorchRng::new(seed);
            blocks = blocks
                .into_iter()
                .enumerate()
                .map(|(k, block)| {
                    pipe_bd::rng::init_like_torch(block, &mut rng).map_err(|e| Error::block(k + 1, e))
                })
                .collect::<Result<Vec<_>>>()?;
        }
        // burn initialises parameters lazily, at first use: draw them now, in order.
        let records: Vec<_> = blocks.into_iter().map(|b| b.into_record()).collect();
        (records, specs)
    };
    // Load into modules of the autodiff backend itself: a record loaded into an
    // inner-backend module would come back untrainable (require_grad unset).
    let (targets, _) = init_student_blocks::<B>(configs, teacher, device)?;
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let blocks = cpu_blocks
        .into_iter()
        .zip(targets)
        .enumerate()
        .map(|(k, (record, target))| {
            let failed = |e: burn::record::RecorderError| {
                Error::block(k + 1, format!("copying the initial student weights to the device failed: {e}"))
            };
            let bytes = recorder.record(record, ()).map_err(failed)?;
            let record = recorder.load(bytes, device).map_err(failed)?;
            Ok(target.load_record(record))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Students::new(blocks, specs, teacher)?)
}

/// The built-in zoo: the MNIST CNN teacher on MNIST/Fashion-MNIST images
/// (`data.dataset = "mnist"`, `teacher.kind = "mnist-cnn"`), MiniLM and
/// SmolLM2 on the Brown corpus (`"brown"`; `"minilm-l6"`, `"smollm2-135m"`),
/// with the students of `pipebd-students` (`[[students]] kind = "conv" |
/// "separable" | "bottleneck" | "inverted" | "head" | "encoder" | "decoder"
/// | "skip"`). `pipebd` itself is `cli::run_with(Builtin)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Builtin;

impl Zoo for Builtin {
    type Teacher<B: FusedBackend> = TeacherBlock<B>;
    type Student<B: DistillBackend> = StudentBlock<B>;

    fn data_options(&self) -> &'static [&'static str] {
        DataOptions::KEYS
    }

    fn teacher_options(&self) -> &'static [&'static str] {
        TeacherOptions::KEYS
    }

    /// Students built at random: pruning and the refit are skipped.
    fn config_for_saved_weights(&self, config: &RunConfig) -> RunConfig {
        architecture_only(config)
    }

    /// Decoder students (and SmolLM2 itself) as GGUF files for llama.cpp.
    fn export(&self, request: &ExportRequest) -> Result<Exported> {
        crate::export::export(self, request)
    }

    /// A Llama or `deci` GGUF file's perplexity, llama.cpp's way.
    fn score_model_file(&self, request: &TextScoreRequest) -> Result<TextScore> {
        crate::export::score_model_file(request)
    }

    /// `data.max_tokens` and `teacher.layers_per_block` (the probe and the
    /// tokenizer's path do not change what the students learn).
    fn checkpoint_identity(&self, config: &RunConfig) -> BTreeMap<String, serde_json::Value> {
        let option = |options: &toml::Table, key: &str| serde_json::json!(options.get(key));
        BTreeMap::from([
            ("data.max_tokens".to_string(), option(&config.data.options, "max_tokens")),
            ("teacher.layers_per_block".to_string(), option(&config.teacher.options, "layers_per_block")),
            ("teacher.block_loss".to_string(), option(&config.teacher.options, "block_loss")),
        ])
    }

    fn check_config(&self, config: &RunConfig) -> std::result::Result<(), ConfigIssue> {
        let data = &config.data;
        let datasets = TeacherKind::datasets();
        if !datasets.contains(&data.dataset.as_str()) {
            return Err(ConfigIssue::new(
                "data",
                "dataset",
                format!("unknown dataset `{}`: expected `{}`", data.dataset, datasets.join("` or `")),
            ));
        }
        let expected: Vec<&str> =
            TeacherKind::ALL.iter().filter(|t| t.dataset() == data.dataset).map(|t| t.name()).collect();
        if !expected.contains(&config.teacher.kind.as_str()) {
            let expected_teacher = expected.join("` or `");
            return Err(ConfigIssue::new(
                "teacher",
                "kind",
                format!(
                    "teacher `{}` does not fit dataset `{}`: expected `{expected_teacher}`",
                    config.teacher.kind, data.dataset
                ),
            ));
        }
        let teacher = TeacherKind::of(config);
        if config.generator == pipe_bd::rng::Generator::Torch && !teacher.takes_torch_generator() {
            return Err(ConfigIssue::new(
                "",
                "generator",
                "`torch` draws students built of Conv2d and Linear layers only (the MNIST zoo); \
                 MiniLM's students have embeddings and layer norms: use `native`"
                    .into(),
            ));
        }
        if !config.custom.is_empty() {
            return Err(ConfigIssue::new(
                "custom",
                "",
                "the built-in teachers and students take no [custom] settings".into(),
            ));
        }
        let options: DataOptions = parse_options("data", &data.options)?;
        let teacher_options: TeacherOptions = parse_options("teacher", &config.teacher.options)?;
        let positions = 2..=MAX_POSITIONS;
        if let Some(tokens) = options.max_tokens {
            if !positions.contains(&tokens) {
                return Err(ConfigIssue::new(
                    "data",
                    "max_tokens",
                    format!("must be in 2..=512, got {tokens}"),
                ));
            }
        }
        if let Some(probe) = &options.probe {
            check_probe(teacher, probe)?;
        }
        if let Some(groups) = &teacher_options.layers_per_block {
            let layers = teacher.layers(config);
            if groups.contains(&0) || groups.iter().sum::<usize>() != layers {
                return Err(ConfigIssue::new(
                    "teacher",
                    "layers_per_block",
                    format!("must be positive and add up to the teacher's {layers} layers, got {groups:?}"),
                ));
            }
        }
        let students: Vec<StudentBlockConfig> = parse_students(config)?;
        check_student_kinds(config, teacher, &students)?;
        let teacher_blocks = teacher.blocks(config, &teacher_options);
        if students.len() != teacher_blocks {
            return Err(ConfigIssue::new(
                "students",
                "",
                format!(
                    "the teacher `{}` has {teacher_blocks} blocks but {} student blocks are configured: \
                     give one [[students]] entry per teacher block",
                    config.teacher.kind,
                    students.len()
                ),
            ));
        }
        Ok(())
    }

    fn teacher_specs(&self, config: &RunConfig) -> Result<Vec<BlockSpec>> {
        TeacherKind::of(config).specs(config)
    }

    fn student_specs(&self, config: &RunConfig, teacher: &[BlockSpec]) -> Result<Vec<BlockSpec>> {
        let configs = student_configs(config)?;
        for (k, student) in configs.iter().enumerate() {
            check_teacher_init(k, student)?;
            for candidate in student.candidates() {
                check_teacher_init(k, candidate)?;
            }
        }
        specs_of(&configs, teacher)
    }

    fn candidate_specs(&self, config: &RunConfig, teacher: &[BlockSpec]) -> Result<Vec<Vec<BlockSpec>>> {
        let configs = student_configs(config)?;
        check_block_count(configs.len(), teacher.len())?;
        let device = Default::default();
        let _rng = pipe_bd::rng::burn_rng_lock();
        configs
            .iter()
            .zip(teacher)
            .enumerate()
            .map(|(k, (student, t))| {
                student
                    .candidates()
                    .iter()
                    .map(|candidate| {
                        let built =
                            candidate.init::<burn::backend::Flex>(k + 1, &t.input_shape, &device).lift()?;
                        Ok(BlockSpec {
                            name: candidate.kind().to_string(),
                            input_shape: t.input_shape.clone(),
                            output_shape: built.output_shape,
                            flops: built.flops,
                            params: built.module.num_params(),
                            loss: t.loss,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect()
    }

    fn check_inputs(&self, config: &RunConfig) -> Result<()> {
        TeacherKind::of(config).check_inputs(config)
    }

    fn train_samples(&self, config: &RunConfig) -> Result<Option<usize>> {
        TeacherKind::of(config).train_samples(config)
    }

    fn workload<B: FusedBackend>(
        &self,
        config: &RunConfig,
        device: &B::Device,
        with_evaluation: bool,
    ) -> Result<Workload<B, TeacherBlock<B>>> {
        TeacherKind::of(config).workload(config, device, with_evaluation)
    }

    fn students<B: DistillBackend>(
        &self,
        config: &RunConfig,
        teacher: &[BlockSpec],
        device: &B::Device,
    ) -> Result<Students<B, StudentBlock<B>>> {
        build_students(config, teacher, device)
    }

    fn has_output_head(&self, config: &RunConfig) -> bool {
        TeacherKind::of(config).has_output_head()
    }

    fn output_head<B: DistillBackend>(
        &self,
        config: &RunConfig,
        device: &B::Device,
    ) -> Result<Option<Box<dyn OutputHead<B>>>> {
        TeacherKind::of(config).output_head(config, device)
    }
}

/// Checks the `[data.probe]` table of `config`.
fn check_probe(teacher: TeacherKind, probe: &ProbeConfig) -> std::result::Result<(), ConfigIssue> {
    if teacher == TeacherKind::SmolLm2 {
        return Err(ConfigIssue::new(
            "data",
            "probe",
            format!("the spam probe scores sentence embeddings of `minilm-l6`, not of `{SMOLLM2}`"),
        ));
    }
    if !(2..=MAX_POSITIONS).contains(&probe.max_tokens) {
        let message = format!("must be in 2..=512, got {}", probe.max_tokens);
        return Err(ConfigIssue::new("data.probe", "max_tokens", message));
    }
    if !(probe.test_fraction > 0.0 && probe.test_fraction < 1.0) {
        let message = format!("must be in (0, 1), got {}", probe.test_fraction);
        return Err(ConfigIssue::new("data.probe", "test_fraction", message));
    }
    if probe.limit == Some(0) {
        let message = "must be at least 1 (leave it out to use every email)".to_string();
        return Err(ConfigIssue::new("data.probe", "limit", message));
    }
    Ok(())
}

/// Refuses student kinds that cannot stand in for the teacher's layers: a
/// bidirectional `encoder` for a decoder LLM (it would see the tokens it
/// predicts), a `decoder` for MiniLM.
fn check_student_kinds(
    config: &RunConfig,
    teacher: TeacherKind,
    students: &[StudentBlockConfig],
) -> std::result::Result<(), ConfigIssue> {
    for (k, student) in students.iter().enumerate() {
        for kind in std::iter::once(student).chain(student.candidates()).map(StudentBlockConfig::kind) {
            if let Some(message) = teacher.refused_student(config, k, kind) {
                return Err(ConfigIssue::in_entry("students", k, message));
            }
        }
    }
    Ok(())
}

/// The config's `[[students]]` tables as the built-in student configs.
fn student_configs(config: &RunConfig) -> Result<Vec<StudentBlockConfig>> {
    parse_students(config).map_err(ConfigIssue::into_plain_error)
}
