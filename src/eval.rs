//! Scoring trained students next to their teacher ([`Evaluate`]: top-1
//! accuracy for classifiers, or a zoo's own metric) and saving and loading
//! their weights as burn records (`student/block-K.mpk` in a run folder).

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use pipebd_core::{forward_chain, Activation, Block, BlockSpec, Dataset, Samples, StudentModule, Students};
use pipebd_kernels::{DistillBackend, FusedBackend};

use crate::data::ImageDataset;
use crate::error::{Error, Result};
/// Test images per evaluation chunk.
const EVAL_CHUNK: usize = 1000;

/// How good a stitched student is, next to its teacher: an accuracy each
/// (0 where the zoo's metric is not one), and the sections a zoo adds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Score {
    /// Teacher accuracy: top-1 on the test samples (or what the zoo scores
    /// as an accuracy, e.g. a downstream probe's).
    pub teacher_accuracy: f64,
    /// Stitched student accuracy, scored like the teacher's.
    pub student_accuracy: f64,
    /// Test samples the accuracies were measured on (0: no accuracy).
    pub test_samples: usize,
    /// The zoo's own figures (embedding cosines, perplexity...), each
    /// written to `report.json` under its name and printed after a run.
    pub sections: Vec<ScoreSection>,
}

/// A part of a [`Score`] that a zoo defines: its figures as JSON (written to
/// `report.json` under `name`), the lines `pipebd run` and `pipebd eval`
/// print for it, and the named figures a search's Pareto table can show.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreSection {
    /// Its key in `report.json` (e.g. `language`).
    pub name: String,
    /// Its figures, as written to `report.json`.
    pub value: serde_json::Value,
    /// What is printed for it, one line each.
    pub lines: Vec<String>,
    /// Figures by name for tables (e.g. `perplexity`, `kl`).
    pub figures: Vec<(String, f64)>,
    /// The one figure that stands for the student where the score has no
    /// accuracy (no test samples): e.g. the mean embedding cosine.
    pub headline: Option<f64>,
}

impl ScoreSection {
    /// A section named `name` holding `value` (any serde type: a zoo's own
    /// report struct), printed as `lines`; no figures, no headline. (A value
    /// serde cannot write as JSON, such as a map with non-text keys, is
    /// written as `{"unwritable": reason}`.)
    pub fn new<T: serde::Serialize>(name: &str, value: &T, lines: Vec<String>) -> Self {
        let value = serde_json::to_value(value)
            .unwrap_or_else(|e| serde_json::json!({ "unwritable": e.to_string() }));
        Self { name: name.to_string(), value, lines, figures: Vec::new(), headline: None }
    }

    /// The same section with the figure `name` added.
    pub fn with_figure(mut self, name: &str, value: f64) -> Self {
        self.figures.push((name.to_string(), value));
        self
    }

    /// The same section standing for the student with `value` where the
    /// score has no accuracy.
    pub fn with_headline(mut self, value: f64) -> Self {
        self.headline = Some(value);
        self
    }
}

/// A network as an evaluation runs it: its blocks in turn, and their specs.
pub struct Network<'a, B: FusedBackend> {
    forward: &'a dyn Fn(Activation<B>) -> pipebd_core::Result<Activation<B>>,
    /// The specs of its blocks, in order.
    pub specs: &'a [BlockSpec],
}

impl<'a, B: FusedBackend> Network<'a, B> {
    /// The network that runs `forward` and has blocks of `specs`.
    pub fn new(
        forward: &'a dyn Fn(Activation<B>) -> pipebd_core::Result<Activation<B>>,
        specs: &'a [BlockSpec],
    ) -> Self {
        Self { forward, specs }
    }

    /// Runs every block on `input`.
    pub fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        Ok((self.forward)(input)?)
    }

    /// How many blocks it has (the last one's number, in errors).
    pub fn blocks(&self) -> usize {
        self.specs.len()
    }
}

/// How a zoo scores a trained student next to its teacher
/// (`pipebd_cli::zoo::Workload::evaluation`): [`TopOneAccuracy`] for
/// classifiers, the built-in zoo's `SentenceEmbeddings` for text, or a zoo's
/// own test set and metric.
pub trait Evaluate<B: FusedBackend> {
    /// Scores `teacher` and the stitched `student` on `device`.
    fn score(&self, teacher: &Network<'_, B>, student: &Network<'_, B>, device: &B::Device) -> Result<Score>;

    /// Scores the teacher alone (`pipebd eval-teacher`): its accuracy and
    /// the test samples it was scored on.
    fn score_teacher(&self, teacher: &Network<'_, B>, device: &B::Device) -> Result<(f64, usize)>;
}

/// Samples with a class each: what top-1 accuracy needs besides the
/// inputs ([`Dataset::batch`]). `ImageDataset` has it; implement it for a
/// labelled dataset of your own to score it with [`TopOneAccuracy`].
pub trait ClassLabels: Samples {
    /// The class of each sample of `indices`.
    fn classes(&self, indices: &[usize]) -> Vec<i64>;
}

impl ClassLabels for ImageDataset {
    fn classes(&self, indices: &[usize]) -> Vec<i64> {
        self.labels_at(indices).into_iter().map(i64::from).collect()
    }
}

/// Classification: top-1 accuracy of the last block's logits on a labelled
/// test set (any [`Dataset`] with [`ClassLabels`]; MNIST's images by default).
pub struct TopOneAccuracy<D = ImageDataset>(pub D);

impl<B: FusedBackend, D: Dataset<B> + ClassLabels> Evaluate<B> for TopOneAccuracy<D> {
    fn score(&self, teacher: &Network<'_, B>, student: &Network<'_, B>, device: &B::Device) -> Result<Score> {
        Ok(Score {
            teacher_accuracy: accuracy(teacher, &self.0, device, EVAL_CHUNK)?,
            student_accuracy: accuracy(student, &self.0, device, EVAL_CHUNK)?,
            test_samples: self.0.len(),
            sections: Vec::new(),
        })
    }

    fn score_teacher(&self, teacher: &Network<'_, B>, device: &B::Device) -> Result<(f64, usize)> {
        Ok((accuracy(teacher, &self.0, device, EVAL_CHUNK)?, self.0.len()))
    }
}

/// Top-1 accuracy of `network`'s logits on `data`, `chunk` samples at a time.
pub fn accuracy<B: FusedBackend, D: Dataset<B> + ClassLabels + ?Sized>(
    network: &Network<'_, B>,
    data: &D,
    device: &B::Device,
    chunk: usize,
) -> Result<f64> {
    let indices: Vec<usize> = (0..data.len()).collect();
    let mut correct = 0usize;
    for part in indices.chunks(chunk.max(1)) {
        let x = network.forward(data.batch(part, device)?)?;
        let Activation::Flat(logits) = x else {
            return Err(Error::block(
                network.blocks(),
                format!("the last block must produce logits [batch, classes], got {:?}", x.dims()),
            ));
        };
        let predicted: Vec<i64> = logits.argmax(1).into_data().iter::<i64>().collect();
        let labels = data.classes(part);
        correct += predicted.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(correct as f64 / data.len().max(1) as f64)
}

/// Scores the teacher's blocks and the stitched student's blocks with
/// `evaluation` (`None`: nothing to score, every figure 0).
pub fn score<B, T, S>(
    evaluation: Option<&dyn Evaluate<B>>,
    (teacher, teacher_specs): (&[T], &[BlockSpec]),
    (student, student_specs): (&[S], &[BlockSpec]),
    device: &B::Device,
) -> Result<Score>
where
    B: FusedBackend,
    T: Block<B>,
    S: Block<B>,
{
    let Some(evaluation) = evaluation else {
        return Ok(Score::default());
    };
    let run_teacher = |x| forward_chain(teacher, x);
    let run_student = |x| forward_chain(student, x);
    let teacher = Network::new(&run_teacher, teacher_specs);
    let student = Network::new(&run_student, student_specs);
    evaluation.score(&teacher, &student, device)
}

/// Path of block `k`'s (zero-based) saved weights inside a run folder.
pub fn student_record_path(run_dir: &Path, k: usize) -> PathBuf {
    run_dir.join("student").join(format!("block-{}.mpk", k + 1))
}

fn recorder() -> NamedMpkFileRecorder<FullPrecisionSettings> {
    NamedMpkFileRecorder::<FullPrecisionSettings>::new()
}

/// Saves `module` as a burn record at `path` (its folder created).
fn save_record<B: burn::tensor::backend::Backend, M: Module<B>>(module: M, path: &Path) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating directory", dir, e))?;
    }
    // The recorder appends the extension itself.
    module
        .save_file(path.with_extension(""), &recorder())
        .map_err(|e| Error::Record { path: path.to_path_buf(), message: e.to_string() })
}

/// Loads the record at `path` into `module`; a missing file is an error
/// saying `missing`, a record that does not fit one prefixed by `context`.
pub fn load_record<B: burn::tensor::backend::Backend, M: Module<B>>(
    module: M,
    path: &Path,
    device: &B::Device,
    missing: &str,
    context: &str,
) -> Result<M> {
    if !path.is_file() {
        return Err(Error::RecordInput { path: path.to_path_buf(), message: missing.to_string() });
    }
    module
        .load_file(path.with_extension(""), &recorder(), device)
        .map_err(|e| Error::RecordInput { path: path.to_path_buf(), message: format!("{context}{e}") })
}

/// Saves every trained student block (inference copy) as a burn record.
pub fn save_students<B: DistillBackend, S: StudentModule<B>>(
    run_dir: &Path,
    students: &Students<B, S>,
) -> Result<()> {
    for (k, block) in students.blocks.iter().enumerate() {
        save_record(block.valid(), &student_record_path(run_dir, k))?;
    }
    Ok(())
}

/// Where a search run saves candidate `c` of block `k` (both zero-based),
/// relative to the run folder.
pub fn candidate_record_path(k: usize, c: usize) -> PathBuf {
    Path::new("candidates").join(format!("block-{}", k + 1)).join(format!("candidate-{}.mpk", c + 1))
}

/// Saves each candidate of every block that has candidates (inference
/// copies) as `candidates/block-K/candidate-C.mpk` in `run_dir`.
pub fn save_candidates<B: DistillBackend, S: StudentModule<B>>(
    run_dir: &Path,
    students: &Students<B, S>,
) -> Result<()> {
    for (k, block) in students.blocks.iter().enumerate() {
        let inference = block.valid();
        for (c, candidate) in inference.candidates().into_iter().enumerate() {
            save_record(candidate, &run_dir.join(candidate_record_path(k, c)))?;
        }
    }
    Ok(())
}

/// Loads the weights [`save_students`] wrote into `run_dir` into `blocks`
/// (modules of the same architecture, e.g. freshly built ones): any block
/// type, the built-in zoo's or your own.
pub fn load_student_records<B: burn::tensor::backend::Backend, M: Module<B>>(
    run_dir: &Path,
    blocks: Vec<M>,
    device: &B::Device,
) -> Result<Vec<M>> {
    let mut loaded = Vec::with_capacity(blocks.len());
    for (k, block) in blocks.into_iter().enumerate() {
        let missing = "missing: was this run folder written by `pipebd run` or `eval::save_students`?";
        loaded.push(load_record(block, &student_record_path(run_dir, k), device, missing, "")?);
    }
    Ok(loaded)
}

impl Score {
    /// The one figure a search's Pareto front shows: the student's
    /// accuracy, or without test samples the first section's headline
    /// (text without a probe: the mean embedding cosine).
    pub fn headline(&self) -> f64 {
        let section_headline = || self.sections.iter().find_map(|s| s.headline);
        match (self.test_samples, section_headline()) {
            (0, Some(headline)) => headline,
            _ => self.student_accuracy,
        }
    }

    /// The section named `name`, if the zoo added one.
    pub fn section(&self, name: &str) -> Option<&ScoreSection> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// The figure named `name` of the first section that has one.
    pub fn figure(&self, name: &str) -> Option<f64> {
        self.sections.iter().flat_map(|s| &s.figures).find(|(n, _)| n == name).map(|&(_, v)| v)
    }
}
