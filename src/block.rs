//! The block API: what a teacher or student block is to the engine.
//!
//! A block is a burn [`Module`] with one extra method, [`Block::forward`],
//! which maps an [`Activation`] (a batch of per-sample tensors of any rank the
//! engine knows) to the next one. Teacher blocks implement `Block` on the
//! inner (non-autodiff) backend; student blocks implement it on the autodiff
//! backend *and* on its inner backend (for evaluation). What the engine needs
//! to know about a block besides its module lives in a [`BlockSpec`].
//!
//! To plug in your own blocks, derive `Module` for your type, implement
//! [`Block`] for it, and hand the engine a [`Teacher`] / [`Students`] built
//! from your modules and their specs (see `ARCHITECTURE.md`).

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use pipebd_kernels::{DistillBackend, FusedBackend};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A batch of activations flowing between blocks. The first dimension is
/// always the batch.
#[derive(Debug, Clone)]
pub enum Activation<B: Backend> {
    /// `[batch, features]`, for example logits.
    Flat(Tensor<B, 2>),
    /// Token states `[batch, tokens, features]` with their `[batch, tokens]`
    /// mask (1 for real tokens, 0 for padding), which travels with them.
    Tokens {
        /// The states.
        hidden: Tensor<B, 3>,
        /// 1 for real tokens, 0 for padding.
        mask: Tensor<B, 2>,
    },
    /// `[batch, channels, height, width]`.
    Maps(Tensor<B, 4>),
}

impl<B: Backend> Activation<B> {
    /// Full shape, batch first.
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Self::Flat(t) => t.dims().to_vec(),
            Self::Tokens { hidden, .. } => hidden.dims().to_vec(),
            Self::Maps(t) => t.dims().to_vec(),
        }
    }

    /// Number of samples in the batch.
    pub fn batch_size(&self) -> usize {
        self.dims()[0]
    }

    /// The feature maps, or an error naming `block` if this is another rank.
    pub fn into_maps(self, block: usize) -> Result<Tensor<B, 4>> {
        match self {
            Self::Maps(t) => Ok(t),
            other => Err(Error::Block {
                block,
                message: format!("expected feature maps [batch, c, h, w], got shape {:?}", other.dims()),
            }),
        }
    }

    /// The token states and their mask, or an error naming `block` if this
    /// is another kind.
    pub fn into_tokens(self, block: usize) -> Result<(Tensor<B, 3>, Tensor<B, 2>)> {
        match self {
            Self::Tokens { hidden, mask } => Ok((hidden, mask)),
            other => Err(Error::Block {
                block,
                message: format!(
                    "expected token states [batch, tokens, hidden], got shape {:?}",
                    other.dims()
                ),
            }),
        }
    }

    /// Moves the activation to `device`.
    pub fn to_device(self, device: &B::Device) -> Self {
        match self {
            Self::Flat(t) => Self::Flat(t.to_device(device)),
            Self::Tokens { hidden, mask } => {
                Self::Tokens { hidden: hidden.to_device(device), mask: mask.to_device(device) }
            }
            Self::Maps(t) => Self::Maps(t.to_device(device)),
        }
    }

    /// Samples `start..start + len` of the batch.
    pub fn narrow_batch(self, start: usize, len: usize) -> Self {
        match self {
            Self::Flat(t) => Self::Flat(t.narrow(0, start, len)),
            Self::Tokens { hidden, mask } => {
                Self::Tokens { hidden: hidden.narrow(0, start, len), mask: mask.narrow(0, start, len) }
            }
            Self::Maps(t) => Self::Maps(t.narrow(0, start, len)),
        }
    }

    /// Concatenates batches of the same kind along the batch dimension.
    /// Returns `None` for an empty list or mixed kinds.
    pub fn cat_batch(parts: Vec<Self>) -> Option<Self> {
        let first = parts.first()?;
        Some(match first {
            Self::Flat(_) => Self::Flat(Tensor::cat(
                parts
                    .into_iter()
                    .map(|p| match p {
                        Self::Flat(t) => Some(t),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?,
                0,
            )),
            Self::Tokens { .. } => {
                let (hidden, mask): (Vec<_>, Vec<_>) = parts
                    .into_iter()
                    .map(|p| match p {
                        Self::Tokens { hidden, mask } => Some((hidden, mask)),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?
                    .into_iter()
                    .unzip();
                Self::Tokens { hidden: Tensor::cat(hidden, 0), mask: Tensor::cat(mask, 0) }
            }
            Self::Maps(_) => Self::Maps(Tensor::cat(
                parts
                    .into_iter()
                    .map(|p| match p {
                        Self::Maps(t) => Some(t),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()?,
                0,
            )),
        })
    }
}

impl<B: DistillBackend> Activation<B> {
    /// Lifts an activation computed on the inner backend (for example by the
    /// frozen teacher) into the autodiff backend as a constant: no gradient
    /// flows back through it.
    pub fn from_inner(inner: Activation<B::InnerBackend>) -> Self {
        match inner {
            Activation::Flat(t) => Self::Flat(Tensor::from_inner(t)),
            Activation::Tokens { hidden, mask } => {
                Self::Tokens { hidden: Tensor::from_inner(hidden), mask: Tensor::from_inner(mask) }
            }
            Activation::Maps(t) => Self::Maps(Tensor::from_inner(t)),
        }
    }
}

/// A teacher or student block as the engine sees it.
///
/// `forward` maps a batch to a batch; `block` numbers in errors are filled in
/// by the engine, so implementations may report `0` and let the caller
/// re-label (the engine does so through [`Error::Block`]).
pub trait Block<B: Backend>: Module<B> {
    /// Runs the block on one batch.
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>>;
}

/// How a block's student output is compared with the teacher's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossKind {
    /// Mean squared error over all elements (over real tokens only for
    /// token states: padding is masked out).
    Mse,
    /// Soft-target cross-entropy against the teacher's softmax (logits blocks).
    SoftTargetCrossEntropy,
}

/// What the engine knows about a block besides its module.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockSpec {
    /// Human-readable name (`conv1`, `separable`, ...).
    pub name: String,
    /// Per-sample input shape (batch dimension excluded).
    pub input_shape: Vec<usize>,
    /// Per-sample output shape (batch dimension excluded).
    pub output_shape: Vec<usize>,
    /// Forward FLOPs per sample (two per multiply-accumulate).
    pub flops: u64,
    /// Trainable parameters.
    pub params: usize,
    /// Loss used to train a student for this block.
    pub loss: LossKind,
}

/// A frozen teacher cut into blocks, on the inner backend `B`.
#[derive(Debug, Clone)]
pub struct Teacher<B: Backend, T: Block<B>> {
    /// The blocks, in order.
    pub blocks: Vec<T>,
    /// One spec per block.
    pub specs: Vec<BlockSpec>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: Backend, T: Block<B>> Teacher<B, T> {
    /// A teacher from its blocks and their specs. Consecutive specs must
    /// chain (output shape of block k is the input shape of block k+1).
    pub fn new(blocks: Vec<T>, specs: Vec<BlockSpec>) -> Result<Self> {
        if blocks.len() != specs.len() || blocks.is_empty() {
            return Err(Error::Block {
                block: 0,
                message: format!("teacher has {} blocks but {} specs", blocks.len(), specs.len()),
            });
        }
        for (k, pair) in specs.windows(2).enumerate() {
            if pair[0].output_shape != pair[1].input_shape {
                return Err(Error::ShapeMismatch {
                    block: k + 2,
                    what: "input (teacher chain)",
                    student: pair[1].input_shape.clone(),
                    teacher: pair[0].output_shape.clone(),
                });
            }
        }
        Ok(Self { blocks, specs, _backend: std::marker::PhantomData })
    }

    /// Runs the whole teacher and returns its final output.
    pub fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        forward_chain(&self.blocks, input)
    }
}

/// The student blocks with their specs, on the autodiff backend `B`.
#[derive(Debug, Clone)]
pub struct Students<B: DistillBackend, S: StudentModule<B>> {
    /// The blocks, in order.
    pub blocks: Vec<S>,
    /// One spec per block.
    pub specs: Vec<BlockSpec>,
    _backend: std::marker::PhantomData<B>,
}

/// A trainable student block: a [`Block`] on the autodiff backend whose
/// inference copy is a [`Block`] on the inner backend.
pub trait StudentModule<B: DistillBackend>:
    Block<B> + burn::module::AutodiffModule<B, InnerModule: Block<B::InnerBackend>>
{
}

impl<B, S> StudentModule<B> for S
where
    B: DistillBackend,
    S: Block<B> + burn::module::AutodiffModule<B>,
    S::InnerModule: Block<B::InnerBackend>,
{
}

impl<B: DistillBackend, S: StudentModule<B>> Students<B, S> {
    /// Pairs student blocks with their specs and checks them against the
    /// teacher's: same number of blocks, same input and output shapes.
    pub fn new(blocks: Vec<S>, specs: Vec<BlockSpec>, teacher_specs: &[BlockSpec]) -> Result<Self> {
        check_against_teacher(&specs, teacher_specs)?;
        if blocks.len() != specs.len() {
            return Err(Error::Block {
                block: 0,
                message: format!("{} student modules but {} specs", blocks.len(), specs.len()),
            });
        }
        Ok(Self { blocks, specs, _backend: std::marker::PhantomData })
    }
}

/// Fails unless there are as many student blocks as teacher blocks.
pub fn check_block_count(students: usize, teacher: usize) -> Result<()> {
    if students == teacher {
        return Ok(());
    }
    Err(Error::Block {
        block: students.min(teacher) + 1,
        message: format!("the teacher has {teacher} blocks but {students} student blocks are configured"),
    })
}

/// Checks student specs against teacher specs block by block.
pub fn check_against_teacher(student: &[BlockSpec], teacher: &[BlockSpec]) -> Result<()> {
    check_block_count(student.len(), teacher.len())?;
    for (k, (s, t)) in student.iter().zip(teacher).enumerate() {
        if s.input_shape != t.input_shape {
            return Err(Error::ShapeMismatch {
                block: k + 1,
                what: "input",
                student: s.input_shape.clone(),
                teacher: t.input_shape.clone(),
            });
        }
        if s.output_shape != t.output_shape {
            return Err(Error::ShapeMismatch {
                block: k + 1,
                what: "output",
                student: s.output_shape.clone(),
                teacher: t.output_shape.clone(),
            });
        }
    }
    Ok(())
}

/// Runs `blocks` one after another (a whole teacher, or stitched students).
pub fn forward_chain<B: Backend, M: Block<B>>(blocks: &[M], input: Activation<B>) -> Result<Activation<B>> {
    let mut x = input;
    for (k, block) in blocks.iter().enumerate() {
        x = block.forward(x).map_err(|e| relabel(e, k + 1))?;
    }
    Ok(x)
}

/// Puts the right block number on a block error raised with `block: 0`.
pub(crate) fn relabel(error: Error, block: usize) -> Error {
    match error {
        Error::Block { block: 0, message } => Error::Block { block, message },
        other => other,
    }
}

/// The distillation loss of one block.
pub fn block_loss<B: FusedBackend>(
    kind: LossKind,
    student: Activation<B>,
    teacher: Activation<B>,
    block: usize,
) -> Result<Tensor<B, 1>> {
    use pipebd_kernels::loss;
    let mismatch = |s: &Activation<B>, t: &Activation<B>| Error::Block {
        block,
        message: format!("student output {:?} and teacher output {:?} differ", s.dims(), t.dims()),
    };
    if student.dims() != teacher.dims() {
        return Err(mismatch(&student, &teacher));
    }
    match (kind, student, teacher) {
        (LossKind::Mse, Activation::Flat(s), Activation::Flat(t)) => Ok(loss::mse(s, t)),
        (LossKind::Mse, Activation::Tokens { hidden: s, mask }, Activation::Tokens { hidden: t, .. }) => {
            Ok(loss::masked_mse(s, t, mask))
        }
        (LossKind::Mse, Activation::Maps(s), Activation::Maps(t)) => Ok(loss::mse(s, t)),
        (LossKind::SoftTargetCrossEntropy, Activation::Flat(s), Activation::Flat(t)) => {
            Ok(loss::soft_target_cross_entropy(s, t))
        }
        (kind, s, t) => Err(Error::Block {
            block,
            message: format!("loss {kind:?} cannot compare {:?} with {:?}", s.dims(), t.dims()),
        }),
    }
}

/// Every float parameter of a module, flattened in visiting order (for
/// comparing two trainings of the same architecture).
pub fn flat_parameters<B: Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl<B: Backend> burn::module::ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            self.0.extend(param.val().into_data().iter::<f32>());
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}
