//! Convolutional student blocks.
//!
//! Each block ends at half the input resolution (like the teacher's conv
//! stages) through its [`Downsample`] mode: a final 2x2 max-pool, or stride 2
//! in its 3x3 convolution (the cheaper choice: everything after it runs on a
//! quarter of the pixels).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::PaddingConfig2d;
use burn::tensor::Tensor;
use pipebd_kernels::{conv2d_layer, conv2d_layer_pool, pointwise_conv, Epilogue, FusedBackend};

use crate::Downsample;

/// A 1x1 convolution.
fn pointwise(c_in: usize, c_out: usize) -> Conv2dConfig {
    Conv2dConfig::new([c_in, c_out], [1, 1])
}

/// A 3x3 convolution with `groups`, keeping the resolution, or halving it to
/// `floor(h/2) x floor(w/2)` with stride 2 (padding 1 on even sides, 0 on odd).
fn spatial(
    c_in: usize,
    c_out: usize,
    groups: usize,
    h: usize,
    w: usize,
    downsample: Downsample,
) -> Conv2dConfig {
    let config = Conv2dConfig::new([c_in, c_out], [3, 3]).with_groups(groups);
    if downsample == Downsample::Stride {
        let (ph, pw) = (usize::from(h.is_multiple_of(2)), usize::from(w.is_multiple_of(2)));
        config.with_stride([2, 2]).with_padding(PaddingConfig2d::Explicit(ph, pw, 0, 0))
    } else {
        config.with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
    }
}

/// A depthwise `k x k` convolution (`channels -> channels`), keeping the
/// resolution (padding `k/2`) or, with stride 2, giving `floor(h/2) x
/// floor(w/2)` (the padding the stride needs, the odd one at the top/left).
fn depthwise(channels: usize, kernel: usize, h: usize, w: usize, downsample: Downsample) -> Conv2dConfig {
    let config = Conv2dConfig::new([channels, channels], [kernel, kernel]).with_groups(channels);
    if downsample == Downsample::Stride {
        // (size + padding - kernel) / 2 + 1 = floor(size / 2).
        let total = |size: usize| (2 * (size / 2).max(1) + kernel).saturating_sub(size + 2);
        let (ph, pw) = (total(h), total(w));
        let padding = PaddingConfig2d::Explicit(ph - ph / 2, pw - pw / 2, ph / 2, pw / 2);
        config.with_stride([2, 2]).with_padding(padding)
    } else {
        let p = kernel / 2;
        config.with_padding(PaddingConfig2d::Explicit(p, p, p, p))
    }
}

fn final_pool(downsample: Downsample) -> Option<MaxPool2d> {
    (downsample == Downsample::Pool).then(|| MaxPool2dConfig::new([2, 2]).init())
}

/// Pixels the layers after the 3x3 convolution run on.
fn pixels_after_spatial(h: usize, w: usize, downsample: Downsample) -> u64 {
    let (oh, ow) = match downsample {
        Downsample::Stride => downsample.output(h, w),
        Downsample::Pool | Downsample::None => (h, w),
    };
    (oh * ow) as u64
}

/// A 1x1 convolution through the fused matmul kernel, with its activation.
fn fused_pointwise<B: FusedBackend>(conv: &Conv2d<B>, x: Tensor<B, 4>, relu: bool) -> Tensor<B, 4> {
    let epilogue = if relu { Epilogue::Relu } else { Epilogue::Identity };
    pointwise_conv(x, conv.weight.val(), conv.bias.as_ref().map(|b| b.val()), epilogue)
}

/// A 3x3 convolution through the fused op, with its activation.
fn fused_spatial<B: FusedBackend>(conv: &Conv2d<B>, x: Tensor<B, 4>, relu: bool) -> Tensor<B, 4> {
    conv2d_layer(conv, x, if relu { Epilogue::Relu } else { Epilogue::Identity })
}

/// The block's last 1x1 convolution with its ReLU and, when the block pools,
/// the final 2x2 max-pool (always kernel 2, stride 2: [`final_pool`]), as one
/// fused op where the backend has it.
fn project_and_pool<B: FusedBackend>(
    conv: &Conv2d<B>,
    x: Tensor<B, 4>,
    pool: &Option<MaxPool2d>,
) -> Tensor<B, 4> {
    match pool {
        Some(_) => conv2d_layer_pool(conv, x, Epilogue::Relu),
        None => fused_pointwise(conv, x, true),
    }
}

/// A plain conv block: `conv 3x3 (c_in -> width) -> ReLU -> conv 1x1 (width -> out) -> ReLU [-> pool]`.
#[derive(Module, Debug)]
pub struct ConvBlock<B: FusedBackend> {
    spatial: Conv2d<B>,
    project: Conv2d<B>,
    pool: Option<MaxPool2d>,
}

impl<B: FusedBackend> ConvBlock<B> {
    /// Builds the block for `c_in x h x w` inputs; returns it with its forward FLOPs per sample.
    pub fn new(
        c_in: usize,
        width: usize,
        c_out: usize,
        h: usize,
        w: usize,
        downsample: Downsample,
        device: &B::Device,
    ) -> (Self, u64) {
        let after = pixels_after_spatial(h, w, downsample);
        let flops = 2 * after * (width as u64 * c_in as u64 * 9 + c_out as u64 * width as u64);
        let block = Self {
            spatial: spatial(c_in, width, 1, h, w, downsample).init(device),
            project: pointwise(width, c_out).init(device),
            pool: final_pool(downsample),
        };
        (block, flops)
    }

    /// `[batch, c_in, h, w] -> [batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        project_and_pool(&self.project, fused_spatial(&self.spatial, x, true), &self.pool)
    }
}

/// A depthwise-separable block: `depthwise 3x3 -> [ReLU] -> pointwise 1x1 -> ReLU [-> pool]`.
#[derive(Module, Debug)]
pub struct SeparableBlock<B: FusedBackend> {
    depthwise: Conv2d<B>,
    pointwise: Conv2d<B>,
    inner_relu: bool,
    pool: Option<MaxPool2d>,
}

impl<B: FusedBackend> SeparableBlock<B> {
    /// Builds the block for `c_in x h x w` inputs; returns it with its forward FLOPs per sample.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        c_in: usize,
        depth_multiplier: usize,
        c_out: usize,
        h: usize,
        w: usize,
        inner_relu: bool,
        downsample: Downsample,
        device: &B::Device,
    ) -> (Self, u64) {
        let mid = c_in * depth_multiplier;
        let after = pixels_after_spatial(h, w, downsample);
        let flops = 2 * after * (mid as u64 * 9 + c_out as u64 * mid as u64);
        let block = Self {
            depthwise: spatial(c_in, mid, c_in, h, w, downsample).init(device),
            pointwise: pointwise(mid, c_out).init(device),
            inner_relu,
            pool: final_pool(downsample),
        };
        (block, flops)
    }

    /// `[batch, c_in, h, w] -> [batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = fused_spatial(&self.depthwise, x, self.inner_relu);
        project_and_pool(&self.pointwise, x, &self.pool)
    }
}

/// A Tucker-style bottleneck: `1x1 reduce -> [ReLU] -> 3x3 -> [ReLU] -> 1x1 expand -> ReLU [-> pool]`.
#[derive(Module, Debug)]
pub struct BottleneckBlock<B: FusedBackend> {
    reduce: Conv2d<B>,
    spatial: Conv2d<B>,
    expand: Conv2d<B>,
    inner_relu: bool,
    pool: Option<MaxPool2d>,
}

impl<B: FusedBackend> BottleneckBlock<B> {
    /// Builds the block for `c_in x h x w` inputs; returns it with its forward FLOPs per sample.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        c_in: usize,
        rank: usize,
        c_out: usize,
        h: usize,
        w: usize,
        inner_relu: bool,
        downsample: Downsample,
        device: &B::Device,
    ) -> (Self, u64) {
        let (ci, r, co) = (c_in as u64, rank as u64, c_out as u64);
        let after = pixels_after_spatial(h, w, downsample);
        let flops = 2 * ((h * w) as u64 * ci * r + after * (r * r * 9 + r * co));
        let block = Self {
            reduce: pointwise(c_in, rank).init(device),
            spatial: spatial(rank, rank, 1, h, w, downsample).init(device),
            expand: pointwise(rank, c_out).init(device),
            inner_relu,
            pool: final_pool(downsample),
        };
        (block, flops)
    }

    /// `[batch, c_in, h, w] -> [batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = fused_pointwise(&self.reduce, x, self.inner_relu);
        let x = fused_spatial(&self.spatial, x, self.inner_relu);
        project_and_pool(&self.expand, x, &self.pool)
    }
}

/// MobileNetV2's inverted residual: `1x1 expand (c_in -> c_in * expansion)
/// -> ReLU6 -> depthwise k x k -> ReLU6 -> 1x1 project (-> out)`, linear at
/// the end (no activation) [-> max-pool 2], plus the input when the shapes
/// allow it (no downsampling, `c_in == out`).
#[derive(Module, Debug)]
pub struct InvertedResidualBlock<B: FusedBackend> {
    expand: Conv2d<B>,
    depthwise: Conv2d<B>,
    project: Conv2d<B>,
    residual: bool,
    pool: Option<MaxPool2d>,
}

impl<B: FusedBackend> InvertedResidualBlock<B> {
    /// Builds the block for `c_in x h x w` inputs; returns it with its forward FLOPs per sample.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        c_in: usize,
        expansion: usize,
        kernel: usize,
        c_out: usize,
        h: usize,
        w: usize,
        downsample: Downsample,
        device: &B::Device,
    ) -> (Self, u64) {
        let mid = c_in * expansion;
        let after = pixels_after_spatial(h, w, downsample);
        let (ci, m, co, k) = (c_in as u64, mid as u64, c_out as u64, kernel as u64);
        let flops = 2 * ((h * w) as u64 * ci * m + after * (m * k * k + m * co));
        let block = Self {
            expand: pointwise(c_in, mid).init(device),
            depthwise: depthwise(mid, kernel, h, w, downsample).init(device),
            project: pointwise(mid, c_out).init(device),
            residual: downsample == Downsample::None && c_in == c_out,
            pool: final_pool(downsample),
        };
        (block, flops)
    }

    /// `[batch, c_in, h, w] -> [batch, c_out, h', w']`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let hidden = conv2d_layer(&self.expand, x.clone(), Epilogue::Relu6);
        let hidden = conv2d_layer(&self.depthwise, hidden, Epilogue::Relu6);
        let out = match self.pool {
            Some(_) => conv2d_layer_pool(&self.project, hidden, Epilogue::Identity),
            None => conv2d_layer(&self.project, hidden, Epilogue::Identity),
        };
        if self.residual {
            out + x
        } else {
            out
        }
    }
}
