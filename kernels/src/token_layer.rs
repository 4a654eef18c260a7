//! [`TokenLayer`]: what the transformer layers of this crate have in common
//! for the blocks built from them (a teacher's stack of layers, a student
//! layer): token states in, token states out, under a padding mask.

use burn::tensor::Tensor;

use crate::FusedBackend;

/// A layer from `[batch, tokens, hidden]` token states to token states of
/// the same shape, under a `[batch, tokens]` mask (1 for real tokens, 0 for
/// padding): the encoder and the decoder layers.
pub trait TokenLayer<B: FusedBackend> {
    /// Runs the layer on `hidden` under `mask`.
    fn forward_tokens(&self, hidden: Tensor<B, 3>, mask: Tensor<B, 2>) -> Tensor<B, 3>;
}

impl<B: FusedBackend> TokenLayer<B> for crate::encoder::EncoderLayer<B> {
    fn forward_tokens(&self, hidden: Tensor<B, 3>, mask: Tensor<B, 2>) -> Tensor<B, 3> {
        self.forward(hidden, mask)
    }
}

impl<B: FusedBackend> TokenLayer<B> for crate::decoder::DecoderLayer<B> {
    fn forward_tokens(&self, hidden: Tensor<B, 3>, mask: Tensor<B, 2>) -> Tensor<B, 3> {
        self.forward(hidden, mask)
    }
}
