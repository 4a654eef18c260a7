//! [`Dataset`]: the training samples as the runtime sees them.

use burn::tensor::backend::Backend;

use crate::activation::Activation;
use crate::error::Result;

/// How many samples a dataset holds: apart from [`Dataset`], which is
/// generic over the backend, so that `data.len()` needs no backend type.
pub trait Samples {
    /// Number of samples.
    fn len(&self) -> usize;

    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Training samples as the runtime sees them: a length ([`Samples`]), and
/// the first block's input for any set of sample indices.
///
/// Implement both for your own data to train through the engine
/// (`runtime::Distillation`). Only the workers of a pipeline's first stage
/// call [`Dataset::batch`]: they turn sample indices into the first block's
/// input on their device. Return [`crate::Error::Data`] for a sample that
/// cannot be read; the run stops with that message.
pub trait Dataset<B: Backend>: Samples + Send + Sync {
    /// The first block's input for samples `indices`, on `device`.
    fn batch(&self, indices: &[usize], device: &B::Device) -> Result<Activation<B>>;
}
