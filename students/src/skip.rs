//! The identity student block (`kind = "skip"`).

use burn::module::Module;
use pipebd_core::FusedBackend;

#[cfg(doc)]
use crate::config::StudentBlockConfig;

/// The identity block ([`StudentBlockConfig::Skip`]).
#[derive(Module, Debug)]
pub struct SkipBlock<B: FusedBackend> {
    backend: std::marker::PhantomData<B>,
}

impl<B: FusedBackend> SkipBlock<B> {
    /// The identity.
    pub fn new() -> Self {
        Self { backend: std::marker::PhantomData }
    }
}

impl<B: FusedBackend> Default for SkipBlock<B> {
    fn default() -> Self {
        Self::new()
    }
}
