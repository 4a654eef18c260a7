//! `pipebd link`: what a hand-off between workers costs on threads and
//! between processes, and what that cost means for a cluster.
//!
//! 1. Measured, side by side in one run: every message a pipelined run of
//!    the config hands on (the activation after each teacher block at the
//!    full batch; each student block's gradients, the same size as its
//!    updated weights) ping-ponged between two threads over a channel (what
//!    a one-process run does: the tensor moves, nothing is copied) and, when
//!    started by `mpirun -np 2`, between two ranks through the transport
//!    (encoded, sent, received and decoded, as the runtime does).
//! 2. A link model `seconds = latency + bytes / bandwidth` fitted to the
//!    ranks' times (least squares).
//! 3. Simulated, not measured: the best plan and its step time for 8, 16
//!    and 64 ranks, each with this machine's measured block costs (the
//!    config's profile), for the measured link and for cluster links of
//!    10 and 100 Gb/s: every input hand-off costs `latency + bytes /
//!    bandwidth`, and a stage leader's gradient exchange with `g - 1`
//!    followers `2 (g - 1)` such messages of the block's size.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::Flex;
use pipebd_core::{Activation, BlockSpec};
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::jobs::profile::{cached_profile, plan_from_candidate};
use crate::zoo::Zoo;
use pipe_bd::error::{Error, Result};
use pipe_bd::fsio::write_atomic;
use pipe_bd::plan::Plan;
use pipe_bd::planning::planner::{plan as best_plans, CostTable};
use pipe_bd::planning::simulate::simulate;
use pipe_bd::runtime::transport::{Tag, Transport};
use pipe_bd::runtime::wire::{decode_activation, encode_activation, Reader, Writer};

/// One kind of message of a pipelined run, and what handing it on cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HandOff {
    /// What it is (`activation after block 2`, `gradients of block 3`).
    pub message: String,
    /// Bytes on the wire.
    pub bytes: usize,
    /// Seconds, one way, between two threads of one process.
    pub thread_seconds: f64,
    /// Seconds, one way, between two ranks (`None`: not started by an MPI launcher).
    pub rank_seconds: Option<f64>,
}

/// `seconds = latency + bytes / bytes_per_second`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LinkModel {
    /// What the link is.
    pub name: &'static str,
    /// Seconds per message.
    pub latency: f64,
    /// Bytes per second.
    pub bytes_per_second: f64,
}

impl LinkModel {
    fn seconds(&self, bytes: f64) -> f64 {
        self.latency + bytes / self.bytes_per_second
    }
}

/// The simulator's step time for a cluster of `ranks` on one link.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterPrediction {
    /// Ranks (device slots).
    pub ranks: usize,
    /// The link's name.
    pub link: String,
    /// The planner's best plan.
    pub plan: String,
    /// Its simulated seconds per step.
    pub step_seconds: f64,
    /// Data parallelism's simulated seconds per step on the same ranks.
    pub dp_step_seconds: f64,
}

/// What `pipebd link` measured and predicted (`link.json`).
#[derive(Debug, Clone, Serialize)]
pub struct LinkReport {
    /// The config's name.
    pub name: String,
    /// Global batch size.
    pub batch_size: usize,
    /// Every hand-off measured.
    pub handoffs: Vec<HandOff>,
    /// The link fitted to the ranks' times (`None` without ranks).
    pub measured: Option<LinkModel>,
    /// Simulated step times for larger clusters.
    pub predictions: Vec<ClusterPrediction>,
}

/// Ranks of the predictions.
pub const CLUSTER_RANKS: [usize; 3] = [8, 16, 64];

/// The cluster links of the predictions (assumed latencies: TCP over 10 Gb/s
/// Ethernet; an RDMA fabric at 100 Gb/s).
pub const CLUSTER_LINKS: [LinkModel; 2] = [
    LinkModel { name: "10 Gb/s", latency: 25e-6, bytes_per_second: 10e9 / 8.0 },
    LinkModel { name: "100 Gb/s", latency: 3e-6, bytes_per_second: 100e9 / 8.0 },
];

/// Measures and predicts for `config`. With a `transport` (`mpirun -np 2`),
/// rank 1 only answers rank 0's messages and returns `None`.
pub fn link_bench<Z: Zoo>(
    zoo: &Z,
    config: &RunConfig,
    transport: Option<Arc<dyn Transport>>,
    rounds: usize,
    out_dir: &Path,
    say: &mut dyn FnMut(&str),
) -> Result<Option<LinkReport>> {
    let teacher = zoo.teacher_specs(config)?;
    let students = zoo.student_specs(config, &teacher)?;
    let batch = config.train.batch_size;
    let rounds = rounds.max(1);
    let messages = messages(&teacher, &students, batch)?;
    if let Some(t) = &transport {
        if t.ranks() != 2 {
            return Err(Error::Transport {
                message: format!("`pipebd link` measures between 2 ranks; started with {}", t.ranks()),
            });
        }
        if t.rank() == 1 {
            echo(t.as_ref(), messages.len() * rounds)?;
            return Ok(None);
        }
    }
    let mut handoffs = Vec::new();
    for (name, activation) in &messages {
        let thread_seconds = ping_pong_threads(activation, rounds);
        let rank_seconds = match &transport {
            Some(t) => Some(ping_pong_ranks(t.as_ref(), activation, rounds)?),
            None => None,
        };
        let bytes = encoded(activation)?.len();
        say(&format!("{name}: {bytes} bytes"));
        handoffs.push(HandOff { message: name.clone(), bytes, thread_seconds, rank_seconds });
    }
    let measured = fit(&handoffs);
    let profile = cached_profile(zoo, config, say)?;
    let mut links: Vec<LinkModel> = measured.into_iter().collect();
    links.extend(CLUSTER_LINKS);
    let mut predictions = Vec::new();
    for &ranks in &CLUSTER_RANKS {
        for link in &links {
            let costs = with_link(profile.cost_table(ranks), &teacher, &students, batch, link);
            predictions.push(predict(&costs, ranks, link.name, config)?);
        }
    }
    let report = LinkReport { name: config.name.clone(), batch_size: batch, handoffs, measured, predictions };
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io("creating directory", out_dir, e))?;
    let path = out_dir.join("link.json");
    let json = serde_json::to_vec_pretty(&report)
        .map_err(|e| Error::Transport { message: format!("cannot write link.json: {e}") })?;
    write_atomic(&path, &json)?;
    Ok(Some(report))
}

/// The messages of a pipelined run: the activation after each teacher block
/// but the last (the full batch), and each block's gradients (a flat tensor
/// of its parameter count). Their values do not change what moving them costs.
fn messages(
    teacher: &[BlockSpec],
    students: &[BlockSpec],
    batch: usize,
) -> Result<Vec<(String, Activation<Flex>)>> {
    let device = Default::default();
    let mut out = Vec::new();
    for (k, spec) in teacher.iter().enumerate().take(teacher.len().saturating_sub(1)) {
        let activation = Activation::zeros(batch, &spec.output_shape, &device)?;
        out.push((format!("activation after block {}", k + 1), activation));
    }
    for (k, spec) in students.iter().enumerate() {
        let gradients = Activation::zeros(1, &[spec.params.max(1)], &device)?;
        out.push((format!("gradients of block {}", k + 1), gradients));
    }
    Ok(out)
}

fn encoded(activation: &Activation<Flex>) -> Result<Vec<u8>> {
    let mut w = Writer::default();
    encode_activation(&mut w, activation.clone())?;
    Ok(w.0)
}

/// One-way seconds of moving `activation` between two threads over bounded channels.
fn ping_pong_threads(activation: &Activation<Flex>, rounds: usize) -> f64 {
    let (to_b, at_b) = crossbeam_channel::bounded::<Activation<Flex>>(1);
    let (to_a, at_a) = crossbeam_channel::bounded::<Activation<Flex>>(1);
    let echo = std::thread::spawn(move || {
        while let Ok(message) = at_b.recv() {
            if to_a.send(message).is_err() {
                break;
            }
        }
    });
    let start = Instant::now();
    let mut message = activation.clone();
    for _ in 0..rounds {
        if to_b.send(message).is_err() {
            break;
        }
        match at_a.recv() {
            Ok(back) => message = back,
            Err(_) => break,
        }
    }
    let seconds = start.elapsed().as_secs_f64() / (2 * rounds) as f64;
    drop(to_b);
    let _ = echo.join();
    seconds
}

const WAIT: Duration = Duration::from_secs(60);

fn receive(transport: &dyn Transport, from: usize) -> Result<Vec<u8>> {
    transport.receive(from, Tag::Activation, WAIT)?.ok_or_else(|| Error::Timeout {
        message: format!("rank {} heard nothing from rank {from} for {} s", transport.rank(), WAIT.as_secs()),
    })
}

/// One-way seconds of handing `activation` to rank 1 and back, encoded and
/// decoded on each side as the runtime does.
fn ping_pong_ranks(transport: &dyn Transport, activation: &Activation<Flex>, rounds: usize) -> Result<f64> {
    let device = Default::default();
    let start = Instant::now();
    let mut message = activation.clone();
    for _ in 0..rounds {
        transport.post(1, Tag::Activation, encoded(&message)?)?;
        let bytes = receive(transport, 1)?;
        let mut reader = Reader::new(&bytes, "activation");
        message = decode_activation::<Flex>(&mut reader, &device)?;
    }
    Ok(start.elapsed().as_secs_f64() / (2 * rounds) as f64)
}

/// Rank 1: decodes and returns each of rank 0's `count` messages.
fn echo(transport: &dyn Transport, count: usize) -> Result<()> {
    let device = Default::default();
    for _ in 0..count {
        let bytes = receive(transport, 0)?;
        let mut reader = Reader::new(&bytes, "activation");
        let message = decode_activation::<Flex>(&mut reader, &device)?;
        transport.post(0, Tag::Activation, encoded(&message)?)?;
    }
    // Let the last answer leave before this rank shuts MPI down.
    std::thread::sleep(Duration::from_millis(200));
    Ok(())
}

/// Least-squares `seconds = latency + bytes / bandwidth` over the ranks' times.
fn fit(handoffs: &[HandOff]) -> Option<LinkModel> {
    let points: Vec<(f64, f64)> =
        handoffs.iter().filter_map(|h| h.rank_seconds.map(|s| (h.bytes as f64, s))).collect();
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 || sxy <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    Some(LinkModel {
        name: "measured (this machine)",
        latency: (my - slope * mx).max(0.0),
        bytes_per_second: 1.0 / slope,
    })
}

/// `costs` with every hand-off between ranks priced by `link`: the input of
/// block `k > 0` at `batch / g` samples, and a stage leader's exchange with
/// its `g - 1` followers (their gradients in, the updated blocks out).
fn with_link(
    mut costs: CostTable,
    teacher: &[BlockSpec],
    students: &[BlockSpec],
    batch: usize,
    link: &LinkModel,
) -> CostTable {
    for k in 0..costs.blocks() {
        for gi in 0..costs.max_replicas() {
            let g = gi + 1;
            if k > 0 {
                let per_sample: usize = teacher[k - 1].output_shape.iter().product();
                let bytes = (batch / g).max(1) * per_sample * 4;
                costs.input_transfer[k][gi] = link.seconds(bytes as f64);
            }
            let block_bytes = (students[k].params * 4) as f64;
            costs.gradient_average[k][gi] = 2.0 * (g - 1) as f64 * link.seconds(block_bytes);
        }
    }
    costs
}

fn predict(costs: &CostTable, ranks: usize, link: &str, config: &RunConfig) -> Result<ClusterPrediction> {
    let blocks = costs.blocks();
    let no_plan = || Error::Plan {
        plan: "auto".into(),
        message: format!("no plan for {blocks} blocks on {ranks} ranks"),
    };
    let best = best_plans(costs, ranks, config.runtime.memory_per_device, 1);
    let plan = plan_from_candidate(best.first().ok_or_else(no_plan)?, blocks, ranks)?;
    let data_load = costs.input_transfer.first().cloned().unwrap_or_default();
    let steps = 100;
    let capacity = config.runtime.channel_capacity;
    let step = simulate(&plan, costs, &data_load, steps, capacity).ok_or_else(no_plan)?.step_seconds;
    let dp = simulate(&Plan::dp(blocks, ranks), costs, &data_load, steps, capacity)
        .ok_or_else(no_plan)?
        .step_seconds;
    Ok(ClusterPrediction {
        ranks,
        link: link.to_string(),
        plan: plan.describe(),
        step_seconds: step,
        dp_step_seconds: dp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_link_from_exact_times() {
        let link = LinkModel { name: "x", latency: 2e-5, bytes_per_second: 1e9 };
        let handoffs: Vec<HandOff> = [1_000usize, 100_000, 1_000_000]
            .iter()
            .map(|&bytes| HandOff {
                message: String::new(),
                bytes,
                thread_seconds: 0.0,
                rank_seconds: Some(link.seconds(bytes as f64)),
            })
            .collect();
        let fitted = fit(&handoffs).unwrap();
        assert!((fitted.latency - 2e-5).abs() < 1e-9, "{fitted:?}");
        assert!((fitted.bytes_per_second / 1e9 - 1.0).abs() < 1e-6, "{fitted:?}");
        assert!(fit(&handoffs[..1]).is_none());
    }
}
