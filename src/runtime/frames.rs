//! The decoders of the frames that ranks exchange, callable on bytes alone,
//! and a valid frame of each kind: what `pipebd-fuzz` mutates and feeds
//! back. Not part of the library's API (hidden from its docs).

use burn::backend::Flex;
use burn::tensor::Tensor;
use pipebd_core::Activation;

use super::cluster::{decode_interrupt, decode_progress, encode_interrupt, encode_progress, PhaseEnd};
use super::messages::ProgressMsg;
use super::wire::{decode_activation, decode_state, encode_activation, encode_state, Reader, Writer};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::trace::{Span, SpanKind, WorkerSummary};
use crate::train::{MetricRow, TrainerState};

/// The kinds of frame a rank decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// A stage's progress (losses of a step) for rank 0.
    Progress,
    /// A rank's end of a phase: block states, metric rows, spans, summaries.
    PhaseEnd,
    /// One block's trainer state (weights, optimizer, step, losses).
    State,
    /// A boundary activation (flat, tokens with their mask, or maps).
    Activation,
    /// Rank 0's `auto` plan, or its failure to choose one.
    Plan,
    /// An interrupted rank's proposed stop step.
    Interrupt,
}

impl FrameKind {
    /// Every kind, in a fixed order.
    pub const ALL: [FrameKind; 6] = [
        FrameKind::Progress,
        FrameKind::PhaseEnd,
        FrameKind::State,
        FrameKind::Activation,
        FrameKind::Plan,
        FrameKind::Interrupt,
    ];

    /// A short name (`progress`, `phase-end`, ...).
    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Progress => "progress",
            FrameKind::PhaseEnd => "phase-end",
            FrameKind::State => "state",
            FrameKind::Activation => "activation",
            FrameKind::Plan => "plan",
            FrameKind::Interrupt => "interrupt",
        }
    }
}

/// Decodes `bytes` as a frame of `kind` with the decoder a rank uses
/// (activations onto the CPU backend); the decoded value is dropped.
pub fn decode(kind: FrameKind, bytes: &[u8]) -> Result<()> {
    match kind {
        FrameKind::Progress => decode_progress(bytes).map(drop),
        FrameKind::PhaseEnd => PhaseEnd::decode(bytes).map(drop),
        FrameKind::State => {
            let mut reader = Reader::new(bytes, "state");
            decode_state(&mut reader)?;
            reader.finish()
        }
        FrameKind::Activation => {
            let mut reader = Reader::new(bytes, "activation");
            decode_activation::<Flex>(&mut reader, &Default::default())?;
            reader.finish()
        }
        FrameKind::Plan => decode_plan(bytes).map(drop),
        FrameKind::Interrupt => decode_interrupt(bytes).map(drop).map_err(|message| {
            crate::Error::Transport { message: format!("an interrupt message: {message}") }
        }),
    }
}

/// Rank 0's `auto` plan, or why it could not choose one, as the
/// `Tag::Plan` message to the other ranks (JSON: `{"plan": ..}` or
/// `{"error": ".."}`).
pub fn encode_plan(plan: std::result::Result<&Plan, String>) -> Vec<u8> {
    let message = match plan {
        Ok(plan) => serde_json::json!({ "plan": plan }),
        Err(error) => serde_json::json!({ "error": error }),
    };
    serde_json::to_vec(&message).unwrap_or_default()
}

/// The plan (or rank 0's failure to choose one) in a `Tag::Plan` message.
pub fn decode_plan(bytes: &[u8]) -> Result<Plan> {
    let bad = |e: String| Error::Transport { message: format!("rank 0's plan does not decode: {e}") };
    let mut message: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    if let Some(error) = message.get("error").and_then(|e| e.as_str()) {
        return Err(Error::Peer { rank: 0, message: format!("could not choose a plan: {error}") });
    }
    let plan = message.get_mut("plan").ok_or_else(|| bad("no `plan` in the message".into()))?;
    serde_json::from_value(plan.take()).map_err(|e| bad(e.to_string()))
}

/// One valid frame of every kind, as a run would send it.
pub fn samples() -> Result<Vec<(FrameKind, Vec<u8>)>> {
    let state = TrainerState {
        weights: vec![1, 2, 3, 4, 5],
        optimizer: vec![9; 12],
        arch_optimizer: Some(vec![7; 3]),
        step: 41,
        recent_losses: vec![0.5, 0.25],
    };
    let progress = ProgressMsg { stage: 1, step: 12, losses: vec![(0, 0.75), (3, 1.5)] };
    let rows = vec![MetricRow { epoch: 1, step: 2, block: 3, loss: 0.125, lr: 1e-3 }];
    let spans = vec![Span {
        worker: 0,
        kind: SpanKind::TeacherForward,
        block: Some(1),
        start_us: 10,
        duration_us: 20,
    }];
    let workers: Vec<WorkerSummary> = Vec::new();
    let end = PhaseEnd {
        states: vec![(2, state.clone())],
        rows,
        spans,
        workers,
        checkpoints_written: 3,
        interrupted: 15,
    };
    let mut state_frame = Writer::default();
    encode_state(&mut state_frame, &state);
    let device = Default::default();
    let hidden = Tensor::<Flex, 3>::from_floats([[[1.0, 2.0], [3.0, 4.0]]], &device);
    let mask = Tensor::<Flex, 2>::from_floats([[1.0, 0.0]], &device);
    let mut activation = Writer::default();
    encode_activation(&mut activation, Activation::Tokens { hidden, mask })?;
    let plan = encode_plan(Ok(&crate::plan::Plan::ideal(3)));
    Ok(vec![
        (FrameKind::Progress, encode_progress(&progress)),
        (FrameKind::PhaseEnd, end.encode()),
        (FrameKind::State, state_frame.0),
        (FrameKind::Activation, activation.0),
        (FrameKind::Plan, plan),
        (FrameKind::Interrupt, encode_interrupt(1, 2, 17)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_decodes_and_damaged_frames_are_refused() {
        for (kind, bytes) in samples().unwrap() {
            decode(kind, &bytes).unwrap_or_else(|e| panic!("{}: {e}", kind.name()));
            // Cut short or with a byte too many: refused, not misread.
            assert!(decode(kind, &bytes[..bytes.len() - 1]).is_err(), "{}", kind.name());
            if kind != FrameKind::Plan {
                let mut longer = bytes.clone();
                longer.push(0);
                assert!(decode(kind, &longer).is_err(), "{}", kind.name());
            }
        }
        // Fuzzing's finding: a plan message that is JSON but not an object
        // made `message["plan"]` panic.
        for text in ["\"plan\"", "17", "[1, 2]", "{\"plan\": 3}"] {
            let error = decode(FrameKind::Plan, text.as_bytes()).unwrap_err().to_string();
            assert!(error.contains("plan does not decode"), "{text}: {error}");
        }
    }
}
