//! Classifier-head student blocks.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use pipebd_kernels::{linear, Epilogue, FusedBackend};

/// `flatten -> linear (features -> hidden) -> ReLU -> linear (hidden -> classes)`.
#[derive(Module, Debug)]
pub struct HeadBlock<B: FusedBackend> {
    hidden: Linear<B>,
    output: Linear<B>,
}

impl<B: FusedBackend> HeadBlock<B> {
    /// Builds the head; returns it with its forward FLOPs per sample.
    pub fn new(features: usize, hidden: usize, classes: usize, device: &B::Device) -> (Self, u64) {
        let flops = 2 * (features as u64 * hidden as u64 + hidden as u64 * classes as u64);
        let block = Self {
            hidden: LinearConfig::new(features, hidden).init(device),
            output: LinearConfig::new(hidden, classes).init(device),
        };
        (block, flops)
    }

    /// `[batch, c, h, w] -> [batch, classes]` logits.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let x: Tensor<B, 2> = x.flatten(1, 3);
        let fused = |layer: &Linear<B>, x, epilogue| {
            linear(x, layer.weight.val(), layer.bias.as_ref().map(|b| b.val()), epilogue)
        };
        fused(&self.output, fused(&self.hidden, x, Epilogue::Relu), Epilogue::Identity)
    }
}
