//! What a run measured, written where the user can find it: `report.json`
//! in the run's output folder (its loss log, `metrics.csv`, is [`crate::metrics`]'s).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use pipe_bd::error::{Error, Result};

/// Per-block figures of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockReport {
    /// One-based block number.
    pub block: usize,
    /// Teacher block name.
    pub teacher: String,
    /// Student block kind.
    pub student: String,
    /// Per-sample input shape.
    pub input_shape: Vec<usize>,
    /// Per-sample output shape.
    pub output_shape: Vec<usize>,
    /// Student parameters.
    pub params: usize,
    /// Teacher block parameters.
    pub teacher_params: usize,
    /// Student forward FLOPs per sample.
    pub flops: u64,
    /// Teacher block forward FLOPs per sample.
    pub teacher_flops: u64,
    /// Teacher FLOPs divided by student FLOPs (how much cheaper the student
    /// is); `None` where either count is unknown (0 in the spec).
    pub flops_reduction: Option<f64>,
    /// Mean training loss over the block's last blockwise steps (the
    /// stitched pass's, in a run without blockwise epochs).
    pub final_loss: f32,
    /// The loss the block was trained on (absent in reports of older
    /// versions); `losses.png` draws the MSE blocks on a log axis and the
    /// others on their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<pipebd_core::LossKind>,
}

/// Where a run's time before its first training step went.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Startup {
    /// Reading the data and loading the teacher (the zoo's workload).
    pub teacher_and_data_seconds: f64,
    /// Building the students: their initialisation from the teacher
    /// (pruning, least-squares refits) or from saved weights.
    pub students_seconds: f64,
}

/// What the stitched fine-tuning did (`train.stitched_epochs`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StitchedReport {
    /// Passes over the data.
    pub epochs: usize,
    /// Through the stitched chain or stopped at each block.
    pub gradients: pipe_bd::train::stitch::StitchedGradients,
    /// Optimizer steps per block.
    pub steps: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Wall time of the pass.
    pub seconds: f64,
    /// Samples per second over the pass (each sample through every block).
    #[serde(default)]
    pub samples_per_second: f64,
    /// Wall time of each step, in order (the first ones include warming
    /// up: allocations, first-touch of the optimizer state).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_seconds: Vec<f64>,
    /// Per block, the mean loss over its last steps (against the teacher,
    /// from stitched inputs).
    pub final_losses: Vec<f32>,
    /// The loss on the final output added to the block losses
    /// (`train.stitched_output_loss`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_loss: Option<String>,
    /// Its weight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_weight: Option<f64>,
    /// Its unweighted value averaged over the last epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_output_loss: Option<f32>,
    /// Weight of the block losses in the summed loss
    /// (`train.stitched_block_weight`; reports before it had 1).
    #[serde(default = "one")]
    pub block_weight: f64,
}

fn one() -> f64 {
    1.0
}

/// Everything `pipebd run` measured, plus the config that produced it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunReport {
    /// Run name from the config.
    pub name: String,
    /// Schedule used.
    pub schedule: String,
    /// The plan the run started with: stages per phase, e.g. `{1-2 | 3-4}`.
    pub plan: String,
    /// The plan the run ended on: differs from `plan` after a lost device
    /// was re-routed around or re-planned over (see `resilience`).
    #[serde(default)]
    pub final_plan: String,
    /// Device slots used, comma-separated.
    pub device: String,
    /// Top-1 accuracy of the teacher on the test split (text: the spam
    /// probe's accuracy on the teacher's embeddings; 0 without a probe).
    pub teacher_accuracy: f64,
    /// Top-1 accuracy of the stitched student on the test split (text: the
    /// spam probe's accuracy on the student's embeddings; 0 without a probe).
    pub student_accuracy: f64,
    /// Test samples scored (text: test emails of the probe).
    pub test_samples: usize,
    /// The zoo's own score sections by name (the built-in zoo: `text` for
    /// sentence-embedding teachers, `language` for decoder LLMs), each
    /// written as a key of its own at the top level of `report.json`. On
    /// reading, every top-level key this struct does not know lands here.
    #[serde(flatten)]
    pub sections: std::collections::BTreeMap<String, serde_json::Value>,
    /// What `pipebd run` prints for those sections (not written).
    #[serde(skip)]
    pub section_lines: Vec<String>,
    /// Training samples available.
    pub train_samples: usize,
    /// Optimizer steps per block.
    pub steps: usize,
    /// Optimizer steps this process ran (fewer after a `--resume`).
    #[serde(default)]
    pub steps_run: usize,
    /// Wall time of the whole run (loading, training, evaluation, saving).
    pub wall_seconds: f64,
    /// This process's peak resident memory over the run, in bytes (Linux's
    /// `VmHWM`; under MPI, rank 0's); `None` where the system does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
    /// Where the time before the first step went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<Startup>,
    /// Wall time of the training loop alone.
    pub train_seconds: f64,
    /// Training samples per second (each sample through every block) of
    /// the blockwise training; 0 for a run without blockwise steps (whose
    /// training is all in `stitched`).
    pub samples_per_second: f64,
    /// Measured seconds per optimizer step (training time / steps).
    pub measured_step_seconds: f64,
    /// Seconds per step the simulator predicted from the profile
    /// (`schedule = "auto"`).
    pub predicted_step_seconds: Option<f64>,
    /// Measured over predicted step time.
    pub measured_over_predicted: Option<f64>,
    /// Values (losses) read back to the host during the blockwise training,
    /// each a wait for the device's queue on a GPU: one per worker and
    /// logged step there, one per block and step on the CPU.
    #[serde(default)]
    pub host_reads: usize,
    /// Per-block figures.
    pub blocks: Vec<BlockReport>,
    /// Busy and idle time of each pipeline worker.
    pub workers: Vec<pipe_bd::trace::WorkerSummary>,
    /// The stitched fine-tuning after the blockwise epochs, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stitched: Option<StitchedReport>,
    /// Resume, failures survived and checkpoints written.
    #[serde(default)]
    pub resilience: pipe_bd::runtime::recovery::ResilienceLog,
    /// The configuration, echoed back.
    pub config: RunConfig,
}

impl RunReport {
    /// Writes `report.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self).map_err(|e| Error::Data {
            path: dir.join("report.json"),
            message: format!("cannot serialise the report: {e}"),
        })?;
        pipe_bd::fsio::write_atomic(&dir.join("report.json"), json.as_bytes())
    }

    /// The score section `name` read as a `T` (a zoo's own report type);
    /// `None` when the report has no such section.
    pub fn section<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<Option<T>> {
        let Some(value) = self.sections.get(name) else { return Ok(None) };
        serde_json::from_value(value.clone()).map(Some).map_err(|e| Error::Data {
            path: "report.json".into(),
            message: format!("its section `{name}` is not what was expected: {e}"),
        })
    }

    /// Reads `report.json` from a run folder.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("report.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io("reading", &path, e))?;
        serde_json::from_str(&text)
            .map_err(|e| Error::Data { path, message: format!("not a pipebd report: {e}") })
    }
}

/// This process's peak resident memory so far, in bytes: `VmHWM` of
/// `/proc/self/status` (Linux); `None` elsewhere or if it cannot be read.
pub fn peak_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
