//! One optimizer per block, and the learning-rate schedule.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{Adam, AdamConfig, GradientsParams, MultiGradientsParams, Optimizer, Sgd, SgdConfig};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder, RecorderError};
use pipebd_kernels::DistillBackend;
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
}

impl<B: DistillBackend, M: AutodiffModule<B>> BlockOptimizer<B, M> {
    /// A fresh optimizer as configured.
    pub fn new(config: &OptimizerConfig) -> Self {
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
        }
    }

    /// The optimizer state (moments per parameter id) as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, RecorderError> {
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        match self {
            Self::Sgd(o) => Recorder::<B>::record(&recorder, o.to_record(), ()),
            Self::Adam(o) => Recorder::<B>::record(&recorder, o.to_record(), ()),
        }
    }

    /// This optimizer with the state of [`Self::to_bytes`] loaded onto `device`.
    pub fn with_bytes(self, bytes: Vec<u8>, device: &B::Device) -> Result<Self, RecorderError> {
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
        Ok(match self {
            Self::Sgd(o) => Self::Sgd(o.load_record(Recorder::<B>::load(&recorder, bytes, device)?)),
            Self::Adam(o) => Self::Adam(o.load_record(Recorder::<B>::load(&recorder, bytes, device)?)),
        })
    }

    /// One update with the sum of several replicas' gradients.
    pub fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        match self {
            Self::Sgd(o) => o.step_multi(lr, module, grads),
            Self::Adam(o) => o.step_multi(lr, module, grads),
        }
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
