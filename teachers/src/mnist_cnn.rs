//! The pretrained MNIST CNN teacher (PyPI `digit-recognizer-py==0.1.0`).
//!
//! Architecture, as stored in its state dict: three stages of
//! `conv 3x3 (padding 1) -> ReLU -> max-pool 2` (1->32, 32->64, 64->128
//! channels) followed by `linear 1152->256 -> ReLU -> linear 256->10`.
//!
//! It is cut into four blocks: the three conv stages (outputs `32x14x14`,
//! `64x7x7`, `128x3x3`) and the classifier head (10 logits). Inputs are
//! `1x28x28` images normalised as `(x/255 - 0.1307) / 0.3081`.

use std::path::Path;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use burn_store::{ModuleSnapshot, PytorchStore, PytorchStoreError};
use pipebd_kernels::{conv2d_layer_pool, Epilogue, FusedBackend};

use crate::TeacherError;

/// Per-sample input shape of the teacher: one 28x28 grey image.
pub const INPUT_SHAPE: [usize; 3] = [1, 28, 28];
/// Channels produced by the three conv stages.
pub const STAGE_CHANNELS: [usize; 3] = [32, 64, 128];
/// Width of the hidden layer of the classifier head.
pub const HEAD_HIDDEN: usize = 256;
/// Number of classes.
pub const CLASSES: usize = 10;
/// Mean used to normalise raw pixels scaled to [0, 1].
pub const PIXEL_MEAN: f32 = 0.1307;
/// Standard deviation used to normalise raw pixels scaled to [0, 1].
pub const PIXEL_STD: f32 = 0.3081;

/// The whole network, laid out exactly like the PyTorch module so that the
/// state dict loads by name (`conv_layers.{0,3,6}`, `fc_layers.{0,2}`; burn's
/// PyTorch store renumbers the Sequential indices to 0, 1, 2).
#[derive(Module, Debug)]
pub struct MnistCnn<B: Backend> {
    conv_layers: Vec<Conv2d<B>>,
    fc_layers: Vec<Linear<B>>,
}

/// One conv stage: `conv 3x3 -> ReLU -> max-pool 2`.
#[derive(Module, Debug)]
pub struct ConvStage<B: Backend> {
    conv: Conv2d<B>,
    pool: MaxPool2d,
}

impl<B: FusedBackend> ConvStage<B> {
    /// `[batch, c_in, h, w] -> [batch, c_out, h/2, w/2]` (the convolution, its
    /// ReLU and the 2x2 pool through the fused ops).
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        conv2d_layer_pool(&self.conv, x, Epilogue::Relu)
    }
}

/// The classifier head: `flatten -> linear -> ReLU -> linear`.
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
}

impl<B: Backend> Head<B> {
    /// `[batch, 128, 3, 3] -> [batch, 10]` logits.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let x: Tensor<B, 2> = x.flatten(1, 3);
        self.output.forward(relu(self.hidden.forward(x)))
    }
}

/// One block of the MNIST teacher.
#[derive(Module, Debug)]
pub enum MnistBlock<B: Backend> {
    /// A conv stage (blocks 1-3).
    Conv(ConvStage<B>),
    /// The classifier head (block 4).
    Head(Head<B>),
}

impl<B: Backend> MnistCnn<B> {
    /// A randomly initialised network of the teacher's architecture.
    pub fn init(device: &B::Device) -> Self {
        let mut in_channels = INPUT_SHAPE[0];
        let mut conv_layers = Vec::new();
        for out_channels in STAGE_CHANNELS {
            conv_layers.push(
                Conv2dConfig::new([in_channels, out_channels], [3, 3])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init(device),
            );
            in_channels = out_channels;
        }
        let flat = STAGE_CHANNELS[2] * 3 * 3;
        let fc_layers = vec![
            LinearConfig::new(flat, HEAD_HIDDEN).init(device),
            LinearConfig::new(HEAD_HIDDEN, CLASSES).init(device),
        ];
        Self { conv_layers, fc_layers }
    }

    /// Loads the published PyTorch state dict (`handwriting_model.pth`).
    ///
    /// Fails with [`TeacherError`] naming the file if it is missing, a folder,
    /// unreadable, not a PyTorch checkpoint, or does not provide every tensor
    /// of the model with the right shape.
    pub fn load_pytorch(path: &Path, device: &B::Device) -> Result<Self, TeacherError> {
        let bad = |message: String| TeacherError::BadWeights { path: path.to_path_buf(), message };
        if path.is_dir() {
            return Err(bad("is a folder, expected the PyTorch state dict file (`.pth`)".into()));
        }
        if !path.is_file() {
            return Err(TeacherError::MissingWeights { path: path.to_path_buf() });
        }
        // Tell a file we may not read apart from one that is not a checkpoint.
        std::fs::File::open(path).map_err(|e| bad(format!("cannot read: {e}")))?;
        let mut model = Self::init(device);
        let mut store = PytorchStore::from_file(path);
        let result = model.load_from(&mut store).map_err(|e| match e {
            PytorchStoreError::Reader(e) => bad(format!("not a PyTorch checkpoint, or a damaged one ({e})")),
            other => bad(other.to_string()),
        })?;
        if !result.missing.is_empty() || !result.errors.is_empty() {
            return Err(TeacherError::BadWeights {
                path: path.to_path_buf(),
                message: format!("missing tensors {:?}, errors {:?}", result.missing, result.errors),
            });
        }
        if result.applied.len() != 10 {
            return Err(TeacherError::BadWeights {
                path: path.to_path_buf(),
                message: format!(
                    "expected 10 tensors, loaded {}: {:?}",
                    result.applied.len(),
                    result.applied
                ),
            });
        }
        Ok(model)
    }

    /// Full forward pass: normalised images `[batch, 1, 28, 28]` to logits.
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let pool = MaxPool2dConfig::new([2, 2]).init();
        let mut x = images;
        for conv in &self.conv_layers {
            x = pool.forward(relu(conv.forward(x)));
        }
        let x: Tensor<B, 2> = x.flatten(1, 3);
        self.fc_layers[1].forward(relu(self.fc_layers[0].forward(x)))
    }

    /// Cuts the network into its four blocks (three conv stages, the head).
    pub fn into_blocks(self) -> Vec<MnistBlock<B>> {
        let pool = MaxPool2dConfig::new([2, 2]).init();
        let mut blocks: Vec<MnistBlock<B>> = self
            .conv_layers
            .into_iter()
            .map(|conv| MnistBlock::Conv(ConvStage { conv, pool: pool.clone() }))
            .collect();
        let mut fc = self.fc_layers.into_iter();
        if let (Some(hidden), Some(output)) = (fc.next(), fc.next()) {
            blocks.push(MnistBlock::Head(Head { hidden, output }));
        }
        blocks
    }
}

/// Per-sample output shape of each of the four blocks.
pub fn block_output_shapes() -> Vec<Vec<usize>> {
    vec![
        vec![STAGE_CHANNELS[0], 14, 14],
        vec![STAGE_CHANNELS[1], 7, 7],
        vec![STAGE_CHANNELS[2], 3, 3],
        vec![CLASSES],
    ]
}

/// Forward multiply-accumulates per sample of each block, times two (FLOPs).
pub fn block_flops() -> Vec<u64> {
    let conv = |c_in: u64, c_out: u64, hw: u64| 2 * hw * c_out * c_in * 9;
    vec![
        conv(1, 32, 28 * 28),
        conv(32, 64, 14 * 14),
        conv(64, 128, 7 * 7),
        2 * (1152 * HEAD_HIDDEN as u64 + HEAD_HIDDEN as u64 * CLASSES as u64),
    ]
}
