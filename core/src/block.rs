//! The [`Block`] trait, [`BlockSpec`], and the [`Teacher`] and [`Students`]
//! that hold blocks with their specs.

use burn::module::{AutodiffModule, Module};
use burn::tensor::Tensor;
use pipebd_kernels::{DistillBackend, FusedBackend};
use serde::{Deserialize, Serialize};

use crate::activation::Activation;
use crate::error::{panic_message, Error, Result};
use crate::loss::{Loss, LossKind};

/// A teacher or student block as the engine sees it: a burn [`Module`] that
/// maps a batch to a batch.
///
/// Implement it generically over the backend (`impl<B: FusedBackend>
/// Block<B> for MyBlock<B>`): the teacher runs on the inner (non-autodiff)
/// backend, students train on the autodiff backend and are evaluated on its
/// inner backend, so one implementation serves all three. Errors may name
/// block 0 ([`Error::block`]); the engine puts the block's number in.
pub trait Block<B: FusedBackend>: Module<B> {
    /// Runs the block on one batch.
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>>;

    /// The distillation loss of this (student) block's output against the
    /// teacher's. The default computes `loss` (the kind in the block's spec,
    /// at the run's temperature); override it for a custom loss, for example
    /// a feature-map loss with attention transfer. It must reduce to one
    /// element and stay differentiable with respect to `student`.
    fn loss(&self, student: Activation<B>, teacher: Activation<B>, loss: &Loss) -> Result<Tensor<B, 1>> {
        loss.compute(student, teacher)
    }

    /// The training loss of this (student) block for one batch: the
    /// teacher block's `input` in, its output `target` to match. The default
    /// is [`Block::loss`] of [`Block::forward`]; a block that trains several
    /// candidates at once (blockwise architecture search) sums its
    /// candidates' losses here, so that one backward pass gives each
    /// candidate exactly the gradient of its own loss.
    fn distill_loss(&self, input: Activation<B>, target: Activation<B>, loss: &Loss) -> Result<Tensor<B, 1>> {
        let output = self.forward(input)?;
        self.loss(output, target, loss)
    }

    /// The candidate students this block trains at once (blockwise
    /// architecture search), in the order they were configured, as blocks
    /// of this type sharing the candidates' parameters; empty for an
    /// ordinary block (the default). The engine scores each candidate on
    /// held-out data and saves it on its own (a saved candidate loads into
    /// an ordinary block of its kind).
    fn candidates(&self) -> Vec<Self>
    where
        Self: Sized,
    {
        Vec::new()
    }

    /// The architecture logits `alpha` of a single-path supernet block, one
    /// per entry of [`Block::candidates`]: a `single-path` search samples
    /// one candidate per step from `softmax(alpha)` and trains `alpha` on
    /// held-out batches. `None` (the default) for a block that is not a
    /// supernet. The tensor must be the block's own parameter (so that a
    /// gradient reaching it is the block's), and the block's
    /// [`Block::forward`] should follow `alpha`'s largest entry.
    fn arch_logits(&self) -> Option<Tensor<B, 1>> {
        None
    }
}

/// A trainable student block: a [`Block`] on the autodiff backend whose
/// inference copy ([`AutodiffModule::valid`]) is a [`Block`] on the inner
/// backend. Implemented for every such module.
pub trait StudentModule<B: DistillBackend>:
    Block<B> + AutodiffModule<B, InnerModule: Block<B::InnerBackend>>
{
}

impl<B, S> StudentModule<B> for S
where
    B: DistillBackend,
    S: Block<B> + AutodiffModule<B>,
    S::InnerModule: Block<B::InnerBackend>,
{
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
    /// Forward FLOPs per sample (two per multiply-accumulate); 0 when not
    /// known (the planner then balances by measured costs only).
    pub flops: u64,
    /// Trainable parameters.
    pub params: usize,
    /// Loss used to train a student for this block.
    pub loss: LossKind,
}

impl BlockSpec {
    /// The spec of `module` for inputs of per-sample shape `input_shape`:
    /// the output shape from a forward pass of one zero sample on `device`
    /// (a module that cannot take that input, even one that panics, is an
    /// error),
    /// the parameters counted, the loss MSE and the FLOPs unknown (0; set
    /// them with [`BlockSpec::with_flops`] where the planner should use them).
    pub fn infer<B: FusedBackend, M: Block<B>>(
        name: impl Into<String>,
        module: &M,
        input_shape: &[usize],
        device: &B::Device,
    ) -> Result<Self> {
        let input = Activation::zeros(1, input_shape, device)?;
        // A module given input it cannot take may panic inside burn (a
        // matmul of the wrong width): that is the caller's shape error.
        let output = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| module.forward(input)))
            .map_err(|payload| {
                let why = panic_message(payload.as_ref());
                Error::block(format!("cannot take per-sample input of shape {input_shape:?}: {why}"))
            })??;
        Ok(Self {
            name: name.into(),
            input_shape: input_shape.to_vec(),
            output_shape: output.dims()[1..].to_vec(),
            flops: 0,
            params: module.num_params(),
            loss: LossKind::Mse,
        })
    }

    /// The same spec with `flops` forward FLOPs per sample.
    pub fn with_flops(self, flops: u64) -> Self {
        Self { flops, ..self }
    }

    /// The same spec with another loss.
    pub fn with_loss(self, loss: LossKind) -> Self {
        Self { loss, ..self }
    }
}

/// Fails unless `spec.params` is what `module` has (block `k`, zero-based).
fn check_params<B: FusedBackend, M: Module<B>>(k: usize, module: &M, spec: &BlockSpec) -> Result<()> {
    let counted = module.num_params();
    if counted == spec.params {
        return Ok(());
    }
    Err(Error::Block {
        block: k + 1,
        message: format!(
            "spec `{}` declares {} parameters but the module has {counted}",
            spec.name, spec.params
        ),
    })
}

/// Fails unless `module` (block `k`, zero-based) produces the output shape
/// its spec declares, for one zero sample of the declared input shape on the
/// module's own device. Modules without parameters are taken at their word.
fn check_output_shape<B: FusedBackend, M: Block<B>>(k: usize, module: &M, spec: &BlockSpec) -> Result<()> {
    let Some(device) = module.devices().into_iter().next() else {
        return Ok(());
    };
    let produced = BlockSpec::infer(spec.name.clone(), module, &spec.input_shape, &device)
        .map_err(|e| e.at_block(k + 1))?
        .output_shape;
    if produced == spec.output_shape {
        return Ok(());
    }
    Err(Error::Block {
        block: k + 1,
        message: format!(
            "spec `{}` declares output shape {:?} but the module produces {produced:?}",
            spec.name, spec.output_shape
        ),
    })
}

/// A frozen teacher cut into blocks, on the inner backend `B`.
#[derive(Debug, Clone)]
pub struct Teacher<B: FusedBackend, T: Block<B>> {
    /// The blocks, in order.
    pub blocks: Vec<T>,
    /// One spec per block.
    pub specs: Vec<BlockSpec>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: FusedBackend, T: Block<B>> Teacher<B, T> {
    /// A teacher from its blocks and their specs. Consecutive specs must
    /// chain (output shape of block k is the input shape of block k+1), and
    /// each spec's parameter count and output shape must be its module's
    /// (one zero sample runs through each block to check).
    pub fn new(blocks: Vec<T>, specs: Vec<BlockSpec>) -> Result<Self> {
        for (k, (block, spec)) in blocks.iter().zip(&specs).enumerate() {
            check_params(k, block, spec)?;
            check_output_shape(k, block, spec)?;
        }
        Self::chained(blocks, specs)
    }

    /// A teacher from blocks and specs known to describe them: checks only
    /// that there is one spec per block and that the specs chain.
    fn chained(blocks: Vec<T>, specs: Vec<BlockSpec>) -> Result<Self> {
        if blocks.len() != specs.len() || blocks.is_empty() {
            return Err(Error::block(format!(
                "teacher has {} blocks but {} specs",
                blocks.len(),
                specs.len()
            )));
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

    /// A teacher whose specs are inferred from its modules
    /// ([`BlockSpec::infer`]): one zero sample of `input_shape` runs through
    /// the chain. Blocks are named `block1`, `block2`, ...; the last block
    /// is trained with the soft-target cross-entropy when its output is a
    /// flat vector (logits), every other with the MSE.
    pub fn from_blocks(blocks: Vec<T>, input_shape: &[usize], device: &B::Device) -> Result<Self> {
        let mut specs = Vec::with_capacity(blocks.len());
        let mut input = input_shape.to_vec();
        for (k, block) in blocks.iter().enumerate() {
            let spec = BlockSpec::infer(format!("block{}", k + 1), block, &input, device)
                .map_err(|e| e.at_block(k + 1))?;
            let loss = LossKind::for_block(&spec.output_shape, k + 1 == blocks.len());
            input = spec.output_shape.clone();
            specs.push(spec.with_loss(loss));
        }
        // The specs were just measured on these modules.
        Self::chained(blocks, specs)
    }

    /// The same teacher with block `k`'s forward FLOPs per sample set to
    /// `flops[k]`: what [`Teacher::from_blocks`] cannot infer, and what the
    /// report's size ratios and a FLOPs-balanced plan read. Fails unless
    /// there is one count per block.
    pub fn with_flops(mut self, flops: &[u64]) -> Result<Self> {
        set_flops(&mut self.specs, flops)?;
        Ok(self)
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

impl<B: DistillBackend, S: StudentModule<B>> Students<B, S> {
    /// Pairs student blocks with their specs and checks them against the
    /// teacher's: same number of blocks, same input and output shapes, and
    /// each spec's parameter count is its module's.
    pub fn new(blocks: Vec<S>, specs: Vec<BlockSpec>, teacher_specs: &[BlockSpec]) -> Result<Self> {
        check_against_teacher(&specs, teacher_specs)?;
        if blocks.len() != specs.len() {
            return Err(Error::block(format!("{} student modules but {} specs", blocks.len(), specs.len())));
        }
        for (k, (block, spec)) in blocks.iter().zip(&specs).enumerate() {
            check_params(k, block, spec)?;
        }
        Ok(Self { blocks, specs, _backend: std::marker::PhantomData })
    }

    /// Students whose specs are inferred from their modules, each on its
    /// teacher block's input shape ([`BlockSpec::infer`]), named after the
    /// teacher's blocks and trained with the teacher block's loss; then
    /// checked as by [`Students::new`].
    pub fn from_blocks(blocks: Vec<S>, teacher_specs: &[BlockSpec], device: &B::Device) -> Result<Self> {
        check_block_count(blocks.len(), teacher_specs.len())?;
        let mut specs = Vec::with_capacity(blocks.len());
        for (k, (block, t)) in blocks.iter().zip(teacher_specs).enumerate() {
            let spec = BlockSpec::infer(format!("student-{}", t.name), block, &t.input_shape, device)
                .map_err(|e| e.at_block(k + 1))?
                .with_loss(t.loss);
            // In block order: the first block that does not fit is the one named.
            check_against_teacher(std::slice::from_ref(&spec), std::slice::from_ref(t)).map_err(
                |e| match e {
                    Error::ShapeMismatch { what, student, teacher, .. } => {
                        Error::ShapeMismatch { block: k + 1, what, student, teacher }
                    }
                    other => other,
                },
            )?;
            specs.push(spec);
        }
        Self::new(blocks, specs, teacher_specs)
    }

    /// The same students with block `k`'s forward FLOPs per sample set to
    /// `flops[k]` (see [`Teacher::with_flops`]).
    pub fn with_flops(mut self, flops: &[u64]) -> Result<Self> {
        set_flops(&mut self.specs, flops)?;
        Ok(self)
    }
}

/// Sets each spec's FLOPs from `flops` (one count per spec).
fn set_flops(specs: &mut [BlockSpec], flops: &[u64]) -> Result<()> {
    if flops.len() != specs.len() {
        return Err(Error::block(format!("{} FLOPs counts given for {} blocks", flops.len(), specs.len())));
    }
    for (spec, &count) in specs.iter_mut().zip(flops) {
        spec.flops = count;
    }
    Ok(())
}

/// Fails unless there are as many student blocks as teacher blocks.
pub fn check_block_count(students: usize, teacher: usize) -> Result<()> {
    if students == teacher {
        return Ok(());
    }
    Err(Error::BlockCount { students, teacher })
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
pub fn forward_chain<B: FusedBackend, M: Block<B>>(
    blocks: &[M],
    input: Activation<B>,
) -> Result<Activation<B>> {
    let mut x = input;
    for (k, block) in blocks.iter().enumerate() {
        x = block.forward(x).map_err(|e| e.at_block(k + 1))?;
    }
    Ok(x)
}

/// Every float parameter of a module in visiting order, as (shape, values).
pub fn parameter_tensors<B: burn::tensor::backend::Backend, M: Module<B>>(
    module: &M,
) -> Vec<(Vec<usize>, Vec<f32>)> {
    struct Collect(Vec<(Vec<usize>, Vec<f32>)>);
    impl<B: burn::tensor::backend::Backend> burn::module::ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            let tensor = param.val();
            self.0.push((tensor.dims().to_vec(), tensor.into_data().iter::<f32>().collect()));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// Every float parameter of a module, flattened in visiting order (for
/// comparing two trainings of the same architecture).
pub fn flat_parameters<B: burn::tensor::backend::Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    parameter_tensors(module).into_iter().flat_map(|(_, values)| values).collect()
}
