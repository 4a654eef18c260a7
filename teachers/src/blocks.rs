//! The built-in teachers behind the block API: [`pipebd_core::Block`] for
//! their blocks, one enum over them ([`TeacherBlock`]), and their specs.

use burn::module::Module;
use pipebd_core::{Activation, Block, BlockSpec, FusedBackend, LossKind, Result};
use pipebd_kernels::decoder::DecoderLayer;
use pipebd_kernels::encoder::EncoderLayer;

use crate::minilm;
use crate::mnist_cnn::{self, MnistBlock};
use crate::smollm2::LlamaSizes;

impl<B: FusedBackend> Block<B> for MnistBlock<B> {
    /// Feature maps in; feature maps out of a conv stage, logits out of the head.
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        let x = input.into_maps(0)?;
        Ok(match self {
            MnistBlock::Conv(stage) => Activation::Maps(stage.forward(x)),
            MnistBlock::Head(head) => Activation::Flat(head.forward(x)),
        })
    }
}

/// Consecutive encoder layers run as one block (the mask rides along).
#[derive(Module, Debug)]
pub struct EncoderStack<B: FusedBackend> {
    /// The layers, in order.
    pub layers: Vec<EncoderLayer<B>>,
}

impl<B: FusedBackend> Block<B> for EncoderStack<B> {
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        input.through_token_layers(&self.layers, 0)
    }
}

/// Consecutive decoder layers run as one block (the mask rides along).
#[derive(Module, Debug)]
pub struct DecoderStack<B: FusedBackend> {
    /// The layers, in order.
    pub layers: Vec<DecoderLayer<B>>,
}

impl<B: FusedBackend> Block<B> for DecoderStack<B> {
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        input.through_token_layers(&self.layers, 0)
    }
}

/// One block of a built-in teacher.
// Built once per run and moved rarely: boxing a variant would buy nothing
// and burn's `Module` derive wants the variants by value.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum TeacherBlock<B: FusedBackend> {
    /// A block of the MNIST CNN.
    Mnist(MnistBlock<B>),
    /// One or more consecutive MiniLM encoder layers.
    Encoder(EncoderStack<B>),
    /// One or more consecutive decoder layers of a Llama LLM.
    Decoder(DecoderStack<B>),
}

impl<B: FusedBackend> Block<B> for TeacherBlock<B> {
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>> {
        match self {
            TeacherBlock::Mnist(block) => block.forward(input),
            TeacherBlock::Encoder(stack) => stack.forward(input),
            TeacherBlock::Decoder(stack) => stack.forward(input),
        }
    }
}

/// Block specs of the MNIST CNN teacher (parameters counted on `blocks`).
pub fn mnist_specs<B: FusedBackend>(blocks: &[MnistBlock<B>]) -> Vec<BlockSpec> {
    let outputs = mnist_cnn::block_output_shapes();
    let flops = mnist_cnn::block_flops();
    let names = ["conv1", "conv2", "conv3", "head"];
    let mut input = mnist_cnn::INPUT_SHAPE.to_vec();
    let mut specs = Vec::new();
    for (k, block) in blocks.iter().enumerate() {
        let output = outputs[k].clone();
        specs.push(BlockSpec {
            name: names[k].to_string(),
            input_shape: input,
            loss: LossKind::for_block(&output, k + 1 == blocks.len()),
            output_shape: output.clone(),
            flops: flops[k],
            params: block.num_params(),
        });
        input = output;
    }
    specs
}

/// Block specs of a teacher of layers (each `[tokens, hidden]` to the same,
/// costing `flops` at `tokens` tokens and holding `params`) cut into
/// `groups` of consecutive layers: `layer3`, or `layers4-5` for a group.
fn layer_group_specs(
    groups: &[usize],
    tokens: usize,
    hidden: usize,
    flops: u64,
    params: usize,
) -> Vec<BlockSpec> {
    let mut first = 1;
    groups
        .iter()
        .map(|&n| {
            let name =
                if n == 1 { format!("layer{first}") } else { format!("layers{first}-{}", first + n - 1) };
            first += n;
            BlockSpec {
                name,
                input_shape: vec![tokens, hidden],
                output_shape: vec![tokens, hidden],
                flops: n as u64 * flops,
                params: n * params,
                loss: LossKind::Mse,
            }
        })
        .collect()
}

/// `layers` cut into blocks of `groups` consecutive layers, each made a
/// teacher block by `block`.
fn group_layers<L, B: FusedBackend>(
    layers: Vec<L>,
    groups: &[usize],
    block: impl Fn(Vec<L>) -> TeacherBlock<B>,
) -> Vec<TeacherBlock<B>> {
    let mut layers = layers.into_iter();
    groups.iter().map(|&n| block(layers.by_ref().take(n).collect())).collect()
}

/// Block specs of the MiniLM teacher cut into `groups` of consecutive
/// layers, for sequences of `tokens` tokens.
pub fn minilm_specs(groups: &[usize], tokens: usize) -> Vec<BlockSpec> {
    let layer = minilm::layer_config();
    layer_group_specs(groups, tokens, minilm::HIDDEN, layer.flops(tokens), layer.params())
}

/// MiniLM's encoder layers cut into blocks of `groups` consecutive layers.
pub fn minilm_blocks<B: FusedBackend>(
    layers: Vec<EncoderLayer<B>>,
    groups: &[usize],
) -> Vec<TeacherBlock<B>> {
    group_layers(layers, groups, |layers| TeacherBlock::Encoder(EncoderStack { layers }))
}

/// Block specs of a Llama teacher of `sizes` cut into `groups` of
/// consecutive decoder layers, for sequences of `tokens` tokens.
pub fn decoder_specs(sizes: &LlamaSizes, groups: &[usize], tokens: usize) -> Vec<BlockSpec> {
    let layer = &sizes.layer;
    layer_group_specs(groups, tokens, layer.hidden, layer.flops(tokens), layer.params())
}

/// A Llama teacher's decoder layers cut into blocks of `groups` consecutive layers.
pub fn decoder_blocks<B: FusedBackend>(
    layers: Vec<DecoderLayer<B>>,
    groups: &[usize],
) -> Vec<TeacherBlock<B>> {
    group_layers(layers, groups, |layers| TeacherBlock::Decoder(DecoderStack { layers }))
}
