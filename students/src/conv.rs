//! Convolutional student blocks.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::PaddingConfig2d;
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

fn conv(c_in: usize, c_out: usize, kernel: usize, groups: usize) -> Conv2dConfig {
    let pad = kernel / 2;
    Conv2dConfig::new([c_in, c_out], [kernel, kernel])
        .with_groups(groups)
        .with_padding(PaddingConfig2d::Explicit(pad, pad, pad, pad))
}

fn optional_pool(pool: bool) -> Option<MaxPool2d> {
    pool.then(|| MaxPool2dConfig::new([2, 2]).init())
}

/// A plain conv block: `conv 3x3 (c_in -> width) -> ReLU -> conv 1x1 (width -> out) -> ReLU -> [pool]`.
#[derive(Module, Debug)]
pub struct ConvBlock<B: Backend> {
    spatial: Conv2d<B>,
    project: Conv2d<B>,
    pool: Option<MaxPool2d>,
}

impl<B: Backend> ConvBlock<B> {
    /// Builds the block for `c_in x h x w` inputs; returns it with its forward FLOPs per sample.
    pub fn new(
        c_in: usize,
        width: usize,
        c_out: usize,
        h: usize,
        w: usize,
        pool: bool,
        device: &B::Device,
    ) -> (Self, u64) {
        let hw = (h * w) as u64;
        let flops = 2 * hw * (width as u64 * c_in as u64 * 9 + c_out as u64 * width as u64);
        let block = Self {
            spatial: conv(c_in, width, 3, 1).init(device),
            project: conv(width, c_out, 1, 1).init(device),
            pool: optional_pool(pool),
        };
        (block, flops)
    }

    /// `[batch, c_in, h, w] -> [batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        maybe_pool(relu(self.project.forward(relu(self.spatial.forward(x)))), &self.pool)
    }
}

fn maybe_relu<B: Backend>(x: Tensor<B, 4>, apply: bool) -> Tensor<B, 4> {
    if apply {
        relu(x)
    } else {
        x
    }
}

fn maybe_pool<B: Backend>(x: Tensor<B, 4>, pool: &Option<MaxPool2d>) -> Tensor<B, 4> {
    match pool {
        Some(pool) => pool.forward(x),
        None => x,
    }
}

/// A depthwise-separable block: `depthwise 3x3 -> [ReLU] -> pointwise 1x1 -> ReLU -> [pool]`.
#[derive(Module, Debug)]
pub struct SeparableBlock<B: Backend> {
    depthwise: Conv2d<B>,
    pointwise: Conv2d<B>,
    inner_relu: bool,
    pool: Option<MaxPool2d>,
}

impl<B: Backend> SeparableBlock<B> {
    /// Builds the block for `c_in x h x w` inputs; returns it with its forward FLOPs per sample.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        c_in: usize,
        depth_multiplier: usize,
        c_out: usize,
        h: usize,
        w: usize,
        inner_relu: bool,
        pool: bool,
        device: &B::Device,
    ) -> (Self, u64) {
        let mid = c_in * depth_multiplier;
        let hw = (h * w) as u64;
        let flops = 2 * hw * (mid as u64 * 9 + c_out as u64 * mid as u64);
        let block = Self {
            depthwise: conv(c_in, mid, 3, c_in).init(device),
            pointwise: conv(mid, c_out, 1, 1).init(device),
            inner_relu,
            pool: optional_pool(pool),
        };
        (block, flops)
    }

    /// `[batch, c_in, h, w] -> [batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = maybe_relu(self.depthwise.forward(x), self.inner_relu);
        maybe_pool(relu(self.pointwise.forward(x)), &self.pool)
    }
}

/// A Tucker-style bottleneck: `1x1 reduce -> [ReLU] -> 3x3 -> [ReLU] -> 1x1 expand -> ReLU -> [pool]`.
#[derive(Module, Debug)]
pub struct BottleneckBlock<B: Backend> {
    reduce: Conv2d<B>,
    spatial: Conv2d<B>,
    expand: Conv2d<B>,
    inner_relu: bool,
    pool: Option<MaxPool2d>,
}

impl<B: Backend> BottleneckBlock<B> {
    /// Builds the block for `c_in x h x w` inputs; returns it with its forward FLOPs per sample.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        c_in: usize,
        rank: usize,
        c_out: usize,
        h: usize,
        w: usize,
        inner_relu: bool,
        pool: bool,
        device: &B::Device,
    ) -> (Self, u64) {
        let (c_in, r, c_out) = (c_in as u64, rank as u64, c_out as u64);
        let flops = 2 * (h * w) as u64 * (c_in * r + r * r * 9 + r * c_out);
        let block = Self {
            reduce: conv(c_in as usize, rank, 1, 1).init(device),
            spatial: conv(rank, rank, 3, 1).init(device),
            expand: conv(rank, c_out as usize, 1, 1).init(device),
            inner_relu,
            pool: optional_pool(pool),
        };
        (block, flops)
    }

    /// `[batch, c_in, h, w] -> [batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = maybe_relu(self.reduce.forward(x), self.inner_relu);
        let x = maybe_relu(self.spatial.forward(x), self.inner_relu);
        maybe_pool(relu(self.expand.forward(x)), &self.pool)
    }
}
