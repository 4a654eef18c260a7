//! One optimizer per block, and the learning-rate schedule.

use std::collections::HashMap;
use std::marker::PhantomData;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::{MomentumConfig, MomentumState};
use burn::optim::record::AdaptorRecord;
use burn::optim::{
    Adam, AdamConfig, AdamState, AdaptiveMomentumState, GradientsParams, MultiGradientsParams, Optimizer,
    Sgd, SgdConfig, SgdState,
};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Record, Recorder, RecorderError};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};
use pipebd_kernels::{
    AdamRule, DistillBackend, FusedBackend, ParamSlot, ParamState, SgdMomentum, SgdRule, UpdateRule,
};
use serde::{Deserialize, Serialize};

/// Optimizer family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    /// SGD with (optionally Nesterov) momentum and weight decay.
    Sgd,
    /// Adam.
    Adam,
}

/// Learning-rate schedule over the optimizer steps of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LrSchedule {
    /// The same rate for every step.
    Constant,
    /// Cosine decay from `lr` to `min_lr` over all steps.
    Cosine,
}

/// Per-block optimizer settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// `sgd` or `adam`.
    pub kind: OptimizerKind,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine schedule.
    #[serde(default)]
    pub min_lr: f64,
    /// `cosine` (default) or `constant`.
    #[serde(default = "default_lr_schedule")]
    pub schedule: LrSchedule,
    /// SGD momentum (default 0.9).
    #[serde(default = "default_momentum")]
    pub momentum: f64,
    /// Nesterov momentum for SGD (default true).
    #[serde(default = "default_true")]
    pub nesterov: bool,
    /// L2 weight decay (default 0).
    #[serde(default)]
    pub weight_decay: f64,
    /// Adam's epsilon (default 1e-5, burn's). Per-element MSE losses over
    /// wide activations have tiny gradients; below about 1e-5 they are
    /// damped by this term, so token-state students use 1e-8 (PyTorch's).
    #[serde(default = "default_epsilon")]
    pub epsilon: f64,
}

fn default_epsilon() -> f64 {
    1e-5
}
fn default_lr_schedule() -> LrSchedule {
    LrSchedule::Cosine
}
fn default_momentum() -> f64 {
    0.9
}
fn default_true() -> bool {
    true
}

impl Default for OptimizerConfig {
    /// Adam at 0.002 with cosine decay to 0 and epsilon 1e-5: the
    /// quickstart's settings.
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Adam,
            lr: 0.002,
            min_lr: 0.0,
            schedule: default_lr_schedule(),
            momentum: default_momentum(),
            nesterov: true,
            weight_decay: 0.0,
            epsilon: default_epsilon(),
        }
    }
}

/// The optimizer of one student block.
#[derive(Clone)]
pub enum BlockOptimizer<B: DistillBackend, M: AutodiffModule<B>> {
    /// SGD with momentum and weight decay.
    Sgd(OptimizerAdaptor<Sgd<B::InnerBackend>, M, B>),
    /// Adam.
    Adam(OptimizerAdaptor<Adam, M, B>),
    /// Either rule through the backend's one-pass update over the whole
    /// block (backends with [`FusedBackend::FUSED_OPTIMIZER`]: CubeCL, and flex for Adam).
    Fused(FusedOptimizer<B, M>),
}

impl<B: DistillBackend, M: AutodiffModule<B>> BlockOptimizer<B, M> {
    /// A fresh optimizer as configured: on backends with a fused update
    /// ([`FusedBackend::FUSED_OPTIMIZER`]) one pass per block and step, else
    /// burn's optimizers; the same rule either way, and the same records.
    pub fn new(config: &OptimizerConfig) -> Self {
        if <B::InnerBackend as FusedBackend>::FUSED_OPTIMIZER {
            return Self::Fused(FusedOptimizer::new(config));
        }
        let decay = (config.weight_decay > 0.0).then(|| WeightDecayConfig::new(config.weight_decay as f32));
        match config.kind {
            OptimizerKind::Sgd => {
                let momentum = (config.momentum > 0.0).then_some(MomentumConfig {
                    momentum: config.momentum,
                    dampening: 0.0,
                    nesterov: config.nesterov,
                });
                Self::Sgd(SgdConfig::new().with_momentum(momentum).with_weight_decay(decay).init())
            }
            OptimizerKind::Adam => Self::Adam(
                AdamConfig::new().with_weight_decay(decay).with_epsilon(config.epsilon as f32).init(),
            ),
        }
    }

    /// Adam with the given betas and epsilon, no weight decay (the
    /// architecture optimizer of a single-path search).
    pub fn adam(beta_1: f32, beta_2: f32, epsilon: f32) -> Self {
        Self::Adam(AdamConfig::new().with_beta_1(beta_1).with_beta_2(beta_2).with_epsilon(epsilon).init())
    }

    /// One update of `module` with `grads` at learning rate `lr`.
    pub fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        match self {
            Self::Sgd(o) => o.step(lr, module, grads),
            Self::Adam(o) => o.step(lr, module, grads),
            Self::Fused(o) => o.step(lr, module, Grads::Single(grads)),
        }
    }

    /// The optimizer state (moments per parameter id) as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, RecorderError> {
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        match self {
            Self::Sgd(o) => Recorder::<B>::record(&recorder, o.to_record(), ()),
            Self::Adam(o) => Recorder::<B>::record(&recorder, o.to_record(), ()),
            Self::Fused(o) => o.to_bytes(),
        }
    }

    /// This optimizer with the state of [`Self::to_bytes`] loaded onto `device`.
    pub fn with_bytes(self, bytes: Vec<u8>, device: &B::Device) -> Result<Self, RecorderError> {
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        Ok(match self {
            Self::Sgd(o) => Self::Sgd(o.load_record(Recorder::<B>::load(&recorder, bytes, device)?)),
            Self::Adam(o) => Self::Adam(o.load_record(Recorder::<B>::load(&recorder, bytes, device)?)),
            Self::Fused(o) => Self::Fused(o.with_bytes(bytes, device)?),
        })
    }

    /// One update with the sum of several replicas' gradients.
    pub fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        match self {
            Self::Sgd(o) => o.step_multi(lr, module, grads),
            Self::Adam(o) => o.step_multi(lr, module, grads),
            Self::Fused(o) => o.step(lr, module, Grads::Multi(grads)),
        }
    }
}

/// burn's record of an Adam adaptor (per parameter id: time and moments).
type AdamRecords<B, M> = <OptimizerAdaptor<Adam, M, B> as Optimizer<M, B>>::Record;
/// burn's record of an SGD adaptor (per parameter id: the velocity).
type SgdRecords<B, M> =
    <OptimizerAdaptor<Sgd<<B as AutodiffBackend>::InnerBackend>, M, B> as Optimizer<M, B>>::Record;

/// Records read from a checkpoint, turned into states when their parameters
/// are next stepped (a state's tensor rank is known only then).
#[derive(Clone)]
enum Loaded<B: DistillBackend, M: AutodiffModule<B>> {
    Adam(AdamRecords<B, M>),
    Sgd(SgdRecords<B, M>),
}

/// Adam or SGD over a whole block in one update
/// ([`FusedBackend::optimizer_step`]): burn's rules to the operation, and
/// the state in burn's records, so a checkpoint written here resumes with
/// burn's optimizers (another backend) and the other way round.
#[derive(Clone)]
pub struct FusedOptimizer<B: DistillBackend, M: AutodiffModule<B>> {
    rule: UpdateRule,
    states: HashMap<ParamId, ParamState<B::InnerBackend>>,
    loaded: Option<Loaded<B, M>>,
    module: PhantomData<M>,
}

/// The gradients of one step: one replica's, or every replica's (summed in
/// burn's order).
pub enum Grads {
    /// One set.
    Single(GradientsParams),
    /// Several replicas' sets.
    Multi(MultiGradientsParams),
}

impl Grads {
    fn remove<B: burn::tensor::backend::Backend, const D: usize>(
        &mut self,
        id: ParamId,
    ) -> Option<Tensor<B, D>> {
        match self {
            Self::Single(grads) => grads.remove::<B, D>(id),
            Self::Multi(grads) => grads.remove::<B, D>(id).map(|(grad, _)| grad),
        }
    }
}

impl<B: DistillBackend, M: AutodiffModule<B>> FusedOptimizer<B, M> {
    /// A fresh optimizer for `config`.
    pub fn new(config: &OptimizerConfig) -> Self {
        let weight_decay = (config.weight_decay > 0.0).then_some(config.weight_decay as f32);
        let rule = match config.kind {
            OptimizerKind::Adam => UpdateRule::Adam(AdamRule {
                // burn's AdamConfig defaults.
                beta_1: 0.9,
                beta_2: 0.999,
                epsilon: config.epsilon as f32,
                weight_decay,
            }),
            OptimizerKind::Sgd => UpdateRule::Sgd(SgdRule {
                momentum: (config.momentum > 0.0).then_some(SgdMomentum {
                    momentum: config.momentum,
                    dampening: 0.0,
                    nesterov: config.nesterov,
                }),
                weight_decay,
            }),
        };
        Self { rule, states: HashMap::new(), loaded: None, module: PhantomData }
    }

    /// One update of every parameter of `module` that has a gradient.
    pub fn step(&mut self, lr: f64, module: M, mut grads: Grads) -> M {
        let mut collect =
            Collect::<B, M> { optimizer: self, grads: &mut grads, slots: Vec::new(), ids: Vec::new() };
        module.visit(&mut collect);
        let Collect { slots, ids, .. } = collect;
        let updates = <B::InnerBackend as FusedBackend>::optimizer_step(slots, &self.rule, lr);
        let mut values = HashMap::with_capacity(updates.len());
        for (id, update) in ids.into_iter().zip(updates) {
            values.insert(id, update.param);
            match update.state {
                Some(state) => self.states.insert(id, state),
                None => self.states.remove(&id),
            };
        }
        module.map(&mut Apply::<B> { values })
    }

    /// The state of parameter `id` (rank `D`, on `device`): kept, or from a
    /// loaded record.
    fn take_state<const D: usize>(
        &mut self,
        id: ParamId,
        device: &burn::tensor::Device<B::InnerBackend>,
    ) -> Option<ParamState<B::InnerBackend>> {
        if let Some(state) = self.states.remove(&id) {
            return Some(state);
        }
        let primitive = |t: Tensor<B::InnerBackend, D>| t.into_primitive().tensor();
        match self.loaded.as_mut()? {
            Loaded::Adam(records) => {
                let state: AdamState<B::InnerBackend, D> = records.remove(&id)?.into_state();
                let m = state.momentum;
                Some(ParamState {
                    first: primitive(m.moment_1),
                    second: Some(primitive(m.moment_2)),
                    time: m.time,
                })
            }
            Loaded::Sgd(records) => {
                let state: SgdState<B::InnerBackend, D> = records.remove(&id)?.into_state();
                let momentum = state.momentum?;
                // burn keeps the velocity private to its record: read it through
                // the record's item (a copy through the host, on resume only).
                let item = Record::<B::InnerBackend>::into_item::<FullPrecisionSettings>(momentum);
                let velocity = <Tensor<B::InnerBackend, D> as Record<B::InnerBackend>>::from_item::<
                    FullPrecisionSettings,
                >(item.velocity, device);
                Some(ParamState { first: primitive(velocity), second: None, time: 1 })
            }
        }
    }

    /// The state as burn's records (the bytes burn's own optimizer writes).
    fn to_bytes(&self) -> Result<Vec<u8>, RecorderError> {
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        match self.rule {
            UpdateRule::Adam(_) => {
                let mut records: AdamRecords<B, M> = match &self.loaded {
                    Some(Loaded::Adam(records)) => records.clone(),
                    _ => Default::default(),
                };
                for (id, state) in &self.states {
                    records.insert(*id, adam_record::<B>(state));
                }
                Recorder::<B>::record(&recorder, records, ())
            }
            UpdateRule::Sgd(_) => {
                let mut records: SgdRecords<B, M> = match &self.loaded {
                    Some(Loaded::Sgd(records)) => records.clone(),
                    _ => Default::default(),
                };
                for (id, state) in &self.states {
                    records.insert(*id, sgd_record::<B>(state));
                }
                Recorder::<B>::record(&recorder, records, ())
            }
        }
    }

    /// This optimizer with the state of [`Self::to_bytes`] (or of burn's
    /// own optimizer) loaded onto `device`.
    fn with_bytes(mut self, bytes: Vec<u8>, device: &B::Device) -> Result<Self, RecorderError> {
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        self.states.clear();
        self.loaded = Some(match self.rule {
            UpdateRule::Adam(_) => Loaded::Adam(Recorder::<B>::load(&recorder, bytes, device)?),
            UpdateRule::Sgd(_) => Loaded::Sgd(Recorder::<B>::load(&recorder, bytes, device)?),
        });
        Ok(self)
    }
}

/// `D`-ranked tensor of a state primitive.
fn ranked<B: burn::tensor::backend::Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// burn's Adam record of one parameter's state.
fn adam_record<B: DistillBackend>(state: &ParamState<B::InnerBackend>) -> AdaptorRecord<Adam, B> {
    fn of<B: DistillBackend, const D: usize>(state: &ParamState<B::InnerBackend>) -> AdaptorRecord<Adam, B> {
        let second = state.second.clone().expect("an Adam state has a second moment");
        let momentum = AdaptiveMomentumState::new(
            state.time,
            ranked::<_, D>(state.first.clone()),
            ranked::<_, D>(second),
        );
        AdaptorRecord::from_state::<D>(AdamState::new(momentum))
    }
    match state.first.shape().num_dims() {
        1 => of::<B, 1>(state),
        2 => of::<B, 2>(state),
        3 => of::<B, 3>(state),
        4 => of::<B, 4>(state),
        5 => of::<B, 5>(state),
        rank => panic!("a parameter of rank {rank}: the fused optimizer records ranks 1 to 5"),
    }
}

/// burn's SGD record of one parameter's velocity.
fn sgd_record<B: DistillBackend>(
    state: &ParamState<B::InnerBackend>,
) -> AdaptorRecord<Sgd<B::InnerBackend>, B> {
    fn of<B: DistillBackend, const D: usize>(
        state: &ParamState<B::InnerBackend>,
    ) -> AdaptorRecord<Sgd<B::InnerBackend>, B> {
        let velocity = MomentumState::new(ranked::<_, D>(state.first.clone()));
        AdaptorRecord::from_state::<D>(SgdState::new(Some(velocity)))
    }
    match state.first.shape().num_dims() {
        1 => of::<B, 1>(state),
        2 => of::<B, 2>(state),
        3 => of::<B, 3>(state),
        4 => of::<B, 4>(state),
        5 => of::<B, 5>(state),
        rank => panic!("a parameter of rank {rank}: the fused optimizer records ranks 1 to 5"),
    }
}

/// Gathers every parameter that has a gradient into the update's slots.
struct Collect<'a, B: DistillBackend, M: AutodiffModule<B>> {
    optimizer: &'a mut FusedOptimizer<B, M>,
    grads: &'a mut Grads,
    slots: Vec<ParamSlot<B::InnerBackend>>,
    ids: Vec<ParamId>,
}

impl<B: DistillBackend, M: AutodiffModule<B>> ModuleVisitor<B> for Collect<'_, B, M> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let value = param.val().inner();
        let grad = if grad.device() == value.device() { grad } else { grad.to_device(&value.device()) };
        let state = self.optimizer.take_state::<D>(param.id, &value.device());
        self.slots.push(ParamSlot {
            param: value.into_primitive().tensor(),
            grad: grad.into_primitive().tensor(),
            state,
        });
        self.ids.push(param.id);
    }
}

/// Puts the updated values in place of the parameters (same ids).
struct Apply<B: DistillBackend> {
    values: HashMap<ParamId, FloatTensor<B::InnerBackend>>,
}

impl<B: DistillBackend> ModuleMapper<B> for Apply<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = match self.values.remove(&id) {
            Some(value) => {
                let updated = Tensor::<B, D>::from_inner(ranked::<B::InnerBackend, D>(value));
                if tensor.is_require_grad() {
                    updated.require_grad()
                } else {
                    updated
                }
            }
            None => tensor,
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// The learning rate of a block at each of its optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrPlan {
    /// Constant or cosine.
    pub schedule: LrSchedule,
    /// Peak rate.
    pub lr: f64,
    /// Final rate (cosine only).
    pub min_lr: f64,
    /// Steps the block will take in the whole run.
    pub total_steps: usize,
}

impl LrPlan {
    /// The plan for `total_steps` steps under `config`.
    pub fn new(config: &OptimizerConfig, total_steps: usize) -> Self {
        Self { schedule: config.schedule, lr: config.lr, min_lr: config.min_lr, total_steps }
    }

    /// Learning rate at zero-based step `step`.
    pub fn at(&self, step: usize) -> f64 {
        match self.schedule {
            LrSchedule::Constant => self.lr,
            LrSchedule::Cosine => {
                let progress = step as f64 / self.total_steps.max(1) as f64;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
                self.min_lr + (self.lr - self.min_lr) * cosine
            }
        }
    }
}
