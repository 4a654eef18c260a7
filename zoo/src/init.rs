//! Students that start from their teacher's layers (`init = "teacher"`),
//! one loop for every kind of token layer ([`PrunedFrom`]: MiniLM's encoder
//! layers, SmolLM2's decoder layers). A calibration batch walks through
//! the teacher's layers; at each layer that students start from, the layer
//! is calibrated once (its neurons ranked, its refit targets computed) and
//! every student and candidate starting there is pruned from it and
//! refitted. Layers past the deepest one needed are never run, and blocks
//! that load saved `weights` are left alone.

use burn::backend::Flex;
use burn::tensor::Tensor;
use pipe_bd::{Error, Result};
use pipebd_cli::config::RunConfig;
use pipebd_students::{Candidate, StudentBlock, StudentBlockConfig};

/// The backend students are built on before a run moves them.
pub(crate) type Cpu = Flex;

/// A teacher layer that students are pruned from.
pub(crate) trait PrunedFrom: Sized {
    /// What calibrating one layer yields, shared by every student pruned
    /// from it.
    type Calibration;
    /// The pruned student layer.
    type Student;

    /// Calibrates this layer on its input `hidden` (real tokens per `mask`).
    fn calibrate(&self, hidden: &Tensor<Cpu, 3>, mask: &Tensor<Cpu, 2>) -> Self::Calibration;

    /// The student `config` of block `k` (zero-based) pruned from this
    /// layer and refitted to it; `None` when `config` does not start from
    /// the teacher.
    fn prune(
        &self,
        k: usize,
        config: &StudentBlockConfig,
        calibration: &Self::Calibration,
        hidden: &Tensor<Cpu, 3>,
        mask: &Tensor<Cpu, 2>,
    ) -> Result<Option<Self::Student>>;

    /// This layer's output on `hidden`: the next layer's input (from the
    /// calibration when there was one).
    fn next(
        &self,
        calibration: Option<Self::Calibration>,
        hidden: Tensor<Cpu, 3>,
        mask: &Tensor<Cpu, 2>,
    ) -> Tensor<Cpu, 3>;

    /// A pruned student as a whole block.
    fn block(student: Self::Student) -> StudentBlock<Cpu>;

    /// A pruned student as one candidate of a search block.
    fn candidate(student: Self::Student) -> Candidate<Cpu>;
}

/// The blocks (zero-based) whose student or a candidate of it starts from
/// the teacher (`wanted`), less those that load saved `weights` (they get
/// them after this: no need to prune them, nor to load the teacher).
pub(crate) fn blocks_from_teacher(
    config: &RunConfig,
    students: &[StudentBlockConfig],
    wanted: fn(&StudentBlockConfig) -> bool,
) -> Vec<usize> {
    let saved = config.student_weights();
    (0..students.len())
        .filter(|&k| saved.get(k).is_none_or(Option::is_none))
        .filter(|&k| wanted(&students[k]) || students[k].candidates().iter().any(wanted))
        .collect()
}

/// The teacher layers and the calibration batch entering the first of them.
pub(crate) struct Calibrated<'a, L> {
    /// The teacher's layers, in order.
    pub layers: &'a [L],
    /// The calibration batch's embeddings, `[sentences, tokens, hidden]`.
    pub hidden: Tensor<Cpu, 3>,
    /// Its real tokens, `[sentences, tokens]`.
    pub mask: Tensor<Cpu, 2>,
    /// The teacher's name, for the periodic progress line.
    pub teacher: &'a str,
}

/// Replaces the student (and candidates) of each block of `needed` whose
/// config starts from the teacher by its pruned and refitted teacher layer:
/// the first layer of its block, `first_layer(k)`.
pub(crate) fn init_from_layers<L: PrunedFrom>(
    teacher: Calibrated<'_, L>,
    needed: &[usize],
    first_layer: &dyn Fn(usize) -> usize,
    students: &[StudentBlockConfig],
    blocks: &mut [StudentBlock<Cpu>],
) -> Result<()> {
    let Calibrated { layers, mut hidden, mask, teacher } = teacher;
    let Some(deepest) = needed.iter().map(|&k| first_layer(k)).max() else { return Ok(()) };
    if deepest >= layers.len() {
        let k = needed.iter().copied().find(|&k| first_layer(k) == deepest).unwrap_or_default();
        return Err(Error::block(k + 1, "no teacher layer to initialise this student from"));
    }
    // Minutes for a search's 30 decoder layers: a line every half minute.
    let (start, mut throttle) = (std::time::Instant::now(), pipebd_cli::reporter::Throttle::default());
    for (n, layer) in layers.iter().enumerate().take(deepest + 1) {
        pipebd_cli::reporter::reporter().periodic(&mut throttle, "init", || {
            let seconds = start.elapsed().as_secs_f64();
            format!(
                "pruned and refitted the students of {n}/{} {teacher} layers after {seconds:.0}s",
                deepest + 1
            )
        });
        let here: Vec<usize> = needed.iter().copied().filter(|&k| first_layer(k) == n).collect();
        let calibration = (!here.is_empty()).then(|| layer.calibrate(&hidden, &mask));
        if let Some(calibration) = &calibration {
            for k in here {
                if let Some(student) = layer.prune(k, &students[k], calibration, &hidden, &mask)? {
                    blocks[k] = L::block(student);
                }
                if let StudentBlock::Candidates(set) = &mut blocks[k] {
                    for (c, candidate) in students[k].candidates().iter().enumerate() {
                        if let Some(student) = layer.prune(k, candidate, calibration, &hidden, &mask)? {
                            set.candidates[c] = L::candidate(student);
                        }
                    }
                }
            }
        }
        hidden = layer.next(calibration, hidden, &mask);
    }
    Ok(())
}
