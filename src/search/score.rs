//! Scoring the trained candidates of a search run: each candidate's loss
//! against its teacher block on held-out samples, and its forward latency,
//! next to its FLOPs and parameters (`pipebd_cli::jobs::search` writes them as
//! `search.json` and `search.csv` and chooses among them).

use std::path::PathBuf;
use std::time::Instant;

use pipebd_core::{Block, BlockSpec, Dataset, Loss};
use serde::{Deserialize, Serialize};

use crate::device::wait_for;
use crate::error::{relabel, Error, Result};

/// One candidate of one block, scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    /// One-based candidate number within its block.
    pub candidate: usize,
    /// The candidate's name (its kind for the built-in zoo).
    pub name: String,
    /// Its `[[students]]` table as configured (what `chosen.toml` gets),
    /// as the JSON object `search.json` holds.
    pub table: serde_json::Map<String, serde_json::Value>,
    /// Its trained weights, relative to the run folder.
    pub weights: PathBuf,
    /// Mean loss against the teacher block on the held-out samples (the
    /// block's training loss: MSE, or the soft-target cross-entropy).
    pub loss: f64,
    /// `loss` over the smallest `loss` among the block's candidates (1 for
    /// the best): what the selection sums over blocks by default.
    pub normalised_loss: f64,
    /// Puzzle's replace-one-block score: the loss of the *teacher's* final
    /// output with only this block replaced by the candidate, against the
    /// unchanged teacher's, on the held-out samples (the run's
    /// `train.stitched_output_loss`, else the last block's loss). Unlike
    /// `loss` it counts what the candidate's error does to the output, so
    /// it is comparable across blocks (`pipebd search --objective output`).
    /// Absent in the scores of runs before it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_loss: Option<f64>,
    /// Forward FLOPs per sample (0 when the zoo does not know them).
    pub flops: u64,
    /// Trainable parameters.
    pub params: usize,
    /// Median forward time of one batch of `batch_size` samples, in
    /// milliseconds, on the run's first device.
    pub latency_ms: f64,
    /// A single-path search's architecture weight of the candidate,
    /// `softmax(alpha)` of its block at the end of the search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probability: Option<f64>,
}

/// The candidates of one teacher block, scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockScores {
    /// One-based block number.
    pub block: usize,
    /// The teacher block's name, FLOPs and parameters.
    pub teacher: String,
    /// The teacher block's forward FLOPs per sample.
    pub teacher_flops: u64,
    /// The teacher block's parameters.
    pub teacher_params: usize,
    /// The candidates (an ordinary block: itself, as the only candidate).
    pub candidates: Vec<CandidateScore>,
}

/// What [`measure_candidates`] measures of one candidate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// Mean held-out loss against the teacher block's output.
    pub loss: f64,
    /// Median forward time of one batch, in milliseconds.
    pub latency_ms: f64,
    /// Mean held-out loss of the teacher's final output with only this
    /// block replaced by the candidate (when an output loss was given).
    pub output_loss: Option<f64>,
}

/// The held-out loss and the forward latency of every block's candidates
/// (an ordinary block counts as its own single candidate), in block and
/// candidate order: the teacher's blocks relay the held-out samples, each
/// candidate is run on its teacher block's input and scored against its
/// output with `losses[k]`, in chunks of `batch_size`. With `output_loss`,
/// the candidate's output also goes on through the teacher's later blocks,
/// and the final output is scored against the teacher's with it (Puzzle's
/// replace-one-block score). `progress` is told, after each chunk, how many
/// of the chunks are done (the replace-one-block score of 30 blocks takes
/// minutes).
pub fn measure_candidates<B, T, S>(
    teacher: &[T],
    students: &[S],
    losses: &[Loss],
    output_loss: Option<&Loss>,
    held_out: &dyn Dataset<B>,
    batch_size: usize,
    device: &B::Device,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Vec<Measured>>>
where
    B: pipebd_kernels::FusedBackend,
    T: Block<B>,
    S: Block<B>,
{
    let members: Vec<Vec<S>> = students
        .iter()
        .map(|student| {
            let candidates = student.candidates();
            if candidates.is_empty() {
                vec![student.clone()]
            } else {
                candidates
            }
        })
        .collect();
    if held_out.is_empty() {
        return Err(Error::Search { message: "no held-out samples to score the candidates on".into() });
    }
    let scalar = |t: burn::tensor::Tensor<B, 1>| -> f64 {
        let value: f32 = burn::tensor::ElementConversion::elem(t.into_scalar());
        f64::from(value)
    };
    let mut sums: Vec<Vec<f64>> = members.iter().map(|m| vec![0.0; m.len()]).collect();
    let mut output_sums = sums.clone();
    let mut first_inputs = Vec::with_capacity(students.len());
    let indices: Vec<usize> = (0..held_out.len()).collect();
    let chunks = indices.len().div_ceil(batch_size.max(1));
    for (chunk_number, chunk) in indices.chunks(batch_size.max(1)).enumerate() {
        // The teacher's activations: the input, then every block's output.
        let mut relay = vec![held_out.batch(chunk, device)?];
        for (k, block) in teacher.iter().enumerate() {
            let x = relay[k].clone();
            relay.push(block.forward(x).map_err(|e| relabel(e, k + 1))?);
        }
        let last = teacher.len();
        for (k, block_members) in members.iter().enumerate() {
            for (c, member) in block_members.iter().enumerate() {
                let output = member.forward(relay[k].clone()).map_err(|e| relabel(e, k + 1))?;
                let loss = member
                    .loss(output.clone(), relay[k + 1].clone(), &losses[k])
                    .map_err(|e| relabel(e, k + 1))?;
                sums[k][c] += scalar(loss) * chunk.len() as f64;
                if let Some(output_loss) = output_loss {
                    let mut y = output;
                    for (j, later) in teacher.iter().enumerate().skip(k + 1) {
                        y = later.forward(y).map_err(|e| relabel(e, j + 1))?;
                    }
                    let loss = output_loss.compute(y, relay[last].clone()).map_err(|e| relabel(e, last))?;
                    output_sums[k][c] += scalar(loss) * chunk.len() as f64;
                }
            }
            if chunk_number == 0 {
                first_inputs.push(relay[k].clone());
            }
        }
        progress(chunk_number + 1, chunks);
    }
    let samples = held_out.len() as f64;
    let mut scores = Vec::with_capacity(students.len());
    for (k, input) in first_inputs.into_iter().enumerate() {
        let mut block = Vec::new();
        for (c, member) in members[k].iter().enumerate() {
            let latency = median_seconds(|| {
                let output = member.forward(input.clone()).map_err(|e| relabel(e, k + 1))?;
                wait_for(output);
                Ok(())
            })?;
            block.push(Measured {
                loss: sums[k][c] / samples,
                latency_ms: latency * 1e3,
                output_loss: output_loss.map(|_| output_sums[k][c] / samples),
            });
        }
        scores.push(block);
    }
    Ok(scores)
}

/// Median wall time of `f` over a few runs after one warm-up.
fn median_seconds(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(5);
    for _ in 0..5 {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Puts the measurements together with what is known of each candidate:
/// `tables[k]` are block k's candidate tables (one, its own, for an
/// ordinary block), `specs[k]` their specs, `weights[k]` where they are saved.
pub fn block_scores(
    teacher: &[BlockSpec],
    measured: &[Vec<Measured>],
    tables: &[Vec<serde_json::Map<String, serde_json::Value>>],
    specs: &[Vec<BlockSpec>],
    weights: &[Vec<PathBuf>],
) -> Vec<BlockScores> {
    teacher
        .iter()
        .enumerate()
        .map(|(k, t)| {
            let best = measured[k].iter().map(|m| m.loss).fold(f64::INFINITY, f64::min);
            let candidates = measured[k]
                .iter()
                .enumerate()
                .map(|(c, &Measured { loss, latency_ms, output_loss })| CandidateScore {
                    candidate: c + 1,
                    name: specs[k][c].name.clone(),
                    table: tables[k][c].clone(),
                    weights: weights[k][c].clone(),
                    loss,
                    normalised_loss: if best > 0.0 { loss / best } else { 1.0 },
                    flops: specs[k][c].flops,
                    params: specs[k][c].params,
                    latency_ms,
                    output_loss,
                    probability: None,
                })
                .collect();
            BlockScores {
                block: k + 1,
                teacher: t.name.clone(),
                teacher_flops: t.flops,
                teacher_params: t.params,
                candidates,
            }
        })
        .collect()
}
