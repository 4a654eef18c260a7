//! The student block types, from the `student_kinds!` table of the zoo's
//! kinds: [`StudentBlock`] (one block of any kind, or a candidate set),
//! [`Candidate`] (one block of any kind but a set) and [`CandidateSet`] (the
//! candidates of one teacher block with their architecture logits), with
//! their forward passes and their [`Block`] implementations. The three types
//! are one recursive family (a block may be a set of candidates, a candidate
//! converts back to a block), so they live together.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use pipebd_core::{Activation, Block, Error as CoreError, FusedBackend};
use pipebd_kernels::decoder::DecoderLayer;
use pipebd_kernels::encoder::EncoderLayer;
use pipebd_kernels::TokenLayer;

#[cfg(doc)]
use crate::config::StudentBlockConfig;
use crate::conv::{BottleneckBlock, ConvBlock, InvertedResidualBlock, SeparableBlock};
use crate::head::HeadBlock;
use crate::skip::SkipBlock;

/// The candidates of a `candidates` block ([`StudentBlockConfig::Candidates`]):
/// ordinary student blocks for the same teacher block, trained at once
/// (search mode `all`) or one sampled per step (`single-path`, a supernet
/// with one cell whose ops are the candidates).
#[derive(Module, Debug)]
pub struct CandidateSet<B: FusedBackend> {
    /// The candidates, in configured order.
    pub candidates: Vec<Candidate<B>>,
    /// Architecture logits, one per candidate (zeros at the start: every
    /// candidate equally likely). Only a `single-path` search trains them;
    /// the set's forward follows the largest.
    pub alpha: Param<Tensor<B, 1>>,
}

impl<B: FusedBackend> CandidateSet<B> {
    /// A set of `candidates` with uniform architecture logits.
    pub fn new(candidates: Vec<Candidate<B>>, device: &B::Device) -> Self {
        let alpha = Param::from_tensor(Tensor::zeros([candidates.len()], device));
        Self { candidates, alpha }
    }

    /// Index of the candidate with the largest logit (the first on ties):
    /// the architecture a search ends with.
    pub fn argmax(&self) -> usize {
        let alpha: Vec<f32> = self.alpha.val().into_data().iter::<f32>().collect();
        let mut best = 0;
        for (i, &a) in alpha.iter().enumerate() {
            if a > alpha[best] {
                best = i;
            }
        }
        best
    }

    /// The output of the candidate with the largest architecture logit.
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>, CoreError> {
        match self.candidates.get(self.argmax()) {
            Some(chosen) => chosen.forward(input),
            None => Err(CoreError::block("a `candidates` student block has no candidates")),
        }
    }
}

/// How one block kind of the zoo maps an activation: its output, or the
/// input handed back when the block cannot take it (the caller names the
/// kind in the error).
trait ZooForward<B: FusedBackend> {
    fn forward_activation(&self, input: Activation<B>) -> Result<Activation<B>, Activation<B>>;
}

/// Conv kinds: feature maps to feature maps.
macro_rules! maps_to_maps {
    ($($block:ident),*) => {$(
        impl<B: FusedBackend> ZooForward<B> for $block<B> {
            fn forward_activation(&self, input: Activation<B>) -> Result<Activation<B>, Activation<B>> {
                match input {
                    Activation::Maps(x) => Ok(Activation::Maps(self.forward(x))),
                    other => Err(other),
                }
            }
        }
    )*};
}
maps_to_maps!(ConvBlock, SeparableBlock, BottleneckBlock, InvertedResidualBlock);

impl<B: FusedBackend> ZooForward<B> for HeadBlock<B> {
    fn forward_activation(&self, input: Activation<B>) -> Result<Activation<B>, Activation<B>> {
        match input {
            Activation::Maps(x) => Ok(Activation::Flat(self.forward(x))),
            other => Err(other),
        }
    }
}

/// Transformer layers: token states to token states; the mask travels on.
macro_rules! tokens_to_tokens {
    ($($layer:ident),*) => {$(
        impl<B: FusedBackend> ZooForward<B> for $layer<B> {
            fn forward_activation(&self, input: Activation<B>) -> Result<Activation<B>, Activation<B>> {
                match input {
                    Activation::Tokens { hidden, mask } => {
                        Ok(Activation::Tokens { hidden: self.forward_tokens(hidden, mask.clone()), mask })
                    }
                    other => Err(other),
                }
            }
        }
    )*};
}

tokens_to_tokens!(EncoderLayer, DecoderLayer);

impl<B: FusedBackend> ZooForward<B> for SkipBlock<B> {
    fn forward_activation(&self, input: Activation<B>) -> Result<Activation<B>, Activation<B>> {
        Ok(input)
    }
}

/// Declares the zoo's block kinds once. Each line is a kind: its variant,
/// its module type (which implements `ZooForward`) and its name in TOML.
/// From the list come [`Candidate`] (every kind), [`StudentBlock`] (every
/// kind and a candidate set), their `kind()` names, the conversions between
/// them and their forward passes. A new kind is its module type, one line
/// here, and its [`StudentBlockConfig`] variant with its `init`.
macro_rules! student_kinds {
    ($($(#[$doc:meta])* $variant:ident($module:ty) = $name:literal,)*) => {
        /// One candidate of a [`CandidateSet`]: a student block of any kind
        /// but `candidates` (a separate type: burn's records cannot nest a
        /// type in itself).
        // As `StudentBlock`: built once per run, moved rarely.
        #[allow(clippy::large_enum_variant)]
        #[derive(Module, Debug)]
        pub enum Candidate<B: FusedBackend> {
            $($(#[$doc])* $variant($module),)*
        }

        /// One student block of any zoo kind.
        // Built once per run and moved rarely: boxing a variant would buy
        // nothing and burn's `Module` derive wants the variants by value.
        #[allow(clippy::large_enum_variant)]
        #[derive(Module, Debug)]
        pub enum StudentBlock<B: FusedBackend> {
            $($(#[$doc])* $variant($module),)*
            /// See [`StudentBlockConfig::Candidates`].
            Candidates(CandidateSet<B>),
        }

        impl<B: FusedBackend> Candidate<B> {
            /// The kind name as written in TOML.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => $name,)*
                }
            }

            /// The candidate as an ordinary student block (sharing its
            /// parameters: gradients through the copy reach them).
            pub fn to_block(&self) -> StudentBlock<B> {
                match self.clone() {
                    $(Self::$variant(b) => StudentBlock::$variant(b),)*
                }
            }

            /// An ordinary student block as a candidate; `None` for a candidate set.
            pub fn from_block(block: StudentBlock<B>) -> Option<Self> {
                match block {
                    $(StudentBlock::$variant(b) => Some(Self::$variant(b)),)*
                    StudentBlock::Candidates(_) => None,
                }
            }

            fn forward_kind(&self, input: Activation<B>) -> Result<Activation<B>, CoreError> {
                match self {
                    $(Self::$variant(b) => b.forward_activation(input).map_err(|input| wrong_input($name, &input)),)*
                }
            }
        }

        impl<B: FusedBackend> StudentBlock<B> {
            /// The kind name as written in TOML.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => $name,)*
                    Self::Candidates(_) => "candidates",
                }
            }

            fn forward_kind(&self, input: Activation<B>) -> Result<Activation<B>, CoreError> {
                match self {
                    $(Self::$variant(b) => b.forward_activation(input).map_err(|input| wrong_input($name, &input)),)*
                    Self::Candidates(set) => set.forward(input),
                }
            }
        }
    };
}

student_kinds! {
    /// See [`StudentBlockConfig::Conv`].
    Conv(ConvBlock<B>) = "conv",
    /// See [`StudentBlockConfig::Separable`].
    Separable(SeparableBlock<B>) = "separable",
    /// See [`StudentBlockConfig::Bottleneck`].
    Bottleneck(BottleneckBlock<B>) = "bottleneck",
    /// See [`StudentBlockConfig::Inverted`].
    Inverted(InvertedResidualBlock<B>) = "inverted",
    /// See [`StudentBlockConfig::Head`].
    Head(HeadBlock<B>) = "head",
    /// See [`StudentBlockConfig::Encoder`].
    Encoder(EncoderLayer<B>) = "encoder",
    /// See [`StudentBlockConfig::Decoder`].
    Decoder(DecoderLayer<B>) = "decoder",
    /// See [`StudentBlockConfig::Skip`].
    Skip(SkipBlock<B>) = "skip",
}

/// The error for a block of kind `kind` given an input it cannot take.
fn wrong_input<B: FusedBackend>(kind: &str, input: &Activation<B>) -> CoreError {
    CoreError::block(format!("a `{kind}` student block cannot take input of shape {:?}", input.dims()))
}

impl<B: FusedBackend> Block<B> for Candidate<B> {
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>, CoreError> {
        self.forward_kind(input)
    }
}

impl<B: FusedBackend> Block<B> for StudentBlock<B> {
    /// See the kinds of [`StudentBlockConfig`]; a candidate set gives the
    /// output of its candidate with the largest architecture logit (the
    /// first while they are equal, as in search mode `all`).
    fn forward(&self, input: Activation<B>) -> Result<Activation<B>, CoreError> {
        self.forward_kind(input)
    }

    /// A candidate set sums its candidates' losses (each on its own
    /// output); any other block takes the loss of its output.
    fn distill_loss(
        &self,
        input: Activation<B>,
        target: Activation<B>,
        loss: &pipebd_core::Loss,
    ) -> Result<burn::tensor::Tensor<B, 1>, CoreError> {
        let Self::Candidates(set) = self else {
            let output = self.forward(input)?;
            return self.loss(output, target, loss);
        };
        let mut total: Option<burn::tensor::Tensor<B, 1>> = None;
        for candidate in &set.candidates {
            let output = candidate.forward(input.clone())?;
            let own = candidate.loss(output, target.clone(), loss)?;
            total = Some(match total {
                None => own,
                Some(sum) => sum.add(own),
            });
        }
        total.ok_or_else(|| CoreError::block("a `candidates` student block has no candidates"))
    }

    fn candidates(&self) -> Vec<Self> {
        match self {
            Self::Candidates(set) => set.candidates.iter().map(Candidate::to_block).collect(),
            _ => Vec::new(),
        }
    }

    fn arch_logits(&self) -> Option<Tensor<B, 1>> {
        match self {
            Self::Candidates(set) => Some(set.alpha.val()),
            _ => None,
        }
    }
}
