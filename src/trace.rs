//! Timed spans of the pipeline workers, their busy/idle summary, and the
//! Chrome trace-event export (`trace.json`, opens in chrome://tracing or
//! Perfetto).

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::fsio::write_atomic;

/// What a worker was doing during a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// Building a batch from the dataset.
    DataLoad,
    /// One teacher block's forward pass.
    TeacherForward,
    /// One student block's forward and backward pass (loss included).
    StudentForwardBackward,
    /// One student block's optimizer step.
    OptimizerStep,
    /// Waiting for room in the channel to the next stage.
    SendWait,
    /// Waiting for the previous stage's activation.
    RecvWait,
    /// Waiting at the global barrier before the optimizer step (`tr`).
    BarrierWait,
    /// Averaging gradients with the other replicas of the stage.
    GradientAverage,
    /// Writing the stage's block checkpoints.
    Checkpoint,
}

impl SpanKind {
    /// Every kind, in display order.
    pub const ALL: [SpanKind; 9] = [
        SpanKind::DataLoad,
        SpanKind::TeacherForward,
        SpanKind::StudentForwardBackward,
        SpanKind::OptimizerStep,
        SpanKind::SendWait,
        SpanKind::RecvWait,
        SpanKind::BarrierWait,
        SpanKind::GradientAverage,
        SpanKind::Checkpoint,
    ];

    /// The snake_case name used in traces.
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::DataLoad => "data_load",
            SpanKind::TeacherForward => "teacher_forward",
            SpanKind::StudentForwardBackward => "student_forward_backward",
            SpanKind::OptimizerStep => "optimizer_step",
            SpanKind::SendWait => "send_wait",
            SpanKind::RecvWait => "recv_wait",
            SpanKind::BarrierWait => "barrier_wait",
            SpanKind::GradientAverage => "gradient_average",
            SpanKind::Checkpoint => "checkpoint",
        }
    }

    /// The kind named `name` in a trace ([`SpanKind::name`]), if any.
    pub fn from_name(name: &str) -> Option<SpanKind> {
        SpanKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// True for waiting, false for work.
    pub fn is_idle(self) -> bool {
        matches!(
            self,
            SpanKind::SendWait | SpanKind::RecvWait | SpanKind::BarrierWait | SpanKind::GradientAverage
        )
    }
}

/// One timed span of one worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Span {
    /// Worker number (thread id in the trace).
    pub worker: usize,
    /// What it was doing.
    pub kind: SpanKind,
    /// One-based block, when the span is about one block.
    pub block: Option<usize>,
    /// Microseconds since the run started.
    pub start_us: u64,
    /// Duration in microseconds.
    pub duration_us: u64,
}

/// Records the spans of one worker.
#[derive(Debug)]
pub struct SpanRecorder {
    worker: usize,
    origin: Instant,
    /// The spans so far.
    pub spans: Vec<Span>,
}

impl SpanRecorder {
    /// A recorder for `worker`, timing from `origin`.
    pub fn new(worker: usize, origin: Instant) -> Self {
        Self { worker, origin, spans: Vec::new() }
    }

    /// Runs `f` and records it as a span.
    pub fn time<T>(&mut self, kind: SpanKind, block: Option<usize>, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.record(kind, block, start);
        out
    }

    /// Records a span that began at `start` and ends now.
    pub fn record(&mut self, kind: SpanKind, block: Option<usize>, start: Instant) {
        let start_us = start.duration_since(self.origin).as_micros() as u64;
        let duration_us = start.elapsed().as_micros() as u64;
        self.spans.push(Span { worker: self.worker, kind, block, start_us, duration_us });
    }
}

/// Busy and idle time of one worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerSummary {
    /// Worker number.
    pub worker: usize,
    /// Stage (one-based) and replica (zero-based) it ran, e.g. `stage 2 replica 0`.
    pub role: String,
    /// Device slot.
    pub slot: usize,
    /// Seconds spent computing.
    pub busy_seconds: f64,
    /// Seconds spent waiting (channels, barrier, gradient averaging).
    pub idle_seconds: f64,
    /// Wall-clock seconds the worker lived.
    pub wall_seconds: f64,
    /// `busy / wall`.
    pub busy_fraction: f64,
    /// `1 - busy / wall` (waiting plus untracked time).
    pub idle_fraction: f64,
    /// Values (losses) it read back to the host: on a GPU each waits for
    /// the device's queue, and a worker reads once per logged step there.
    #[serde(default)]
    pub host_reads: usize,
}

/// Summarises one worker's spans.
pub fn summarise(
    worker: usize,
    role: String,
    slot: usize,
    spans: &[Span],
    wall_seconds: f64,
    host_reads: usize,
) -> WorkerSummary {
    let (mut busy, mut idle) = (0u64, 0u64);
    for s in spans.iter().filter(|s| s.worker == worker) {
        if s.kind.is_idle() {
            idle += s.duration_us;
        } else {
            busy += s.duration_us;
        }
    }
    let busy_seconds = busy as f64 * 1e-6;
    let wall = wall_seconds.max(1e-9);
    WorkerSummary {
        worker,
        role,
        slot,
        busy_seconds,
        idle_seconds: idle as f64 * 1e-6,
        wall_seconds,
        busy_fraction: (busy_seconds / wall).min(1.0),
        idle_fraction: (1.0 - busy_seconds / wall).max(0.0),
        host_reads,
    }
}

#[derive(Serialize)]
struct TraceEvent<'a> {
    name: String,
    cat: &'a str,
    ph: &'a str,
    ts: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<u64>,
    pid: u32,
    tid: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<serde_json::Value>,
}

/// The name of a worker's row in traces and timelines:
/// `worker 3: stage 2 replica 0 (slot 1)`.
pub fn worker_name(worker: &WorkerSummary) -> String {
    format!("worker {}: {} (slot {})", worker.worker, worker.role, worker.slot)
}

/// Writes spans as Chrome trace-event JSON (`{"traceEvents": [...]}`), one
/// thread per worker, named by [`worker_name`].
pub fn write_chrome_trace(path: &Path, spans: &[Span], workers: &[WorkerSummary]) -> Result<()> {
    let mut events: Vec<TraceEvent> = workers
        .iter()
        .map(|worker| TraceEvent {
            name: "thread_name".into(),
            cat: "__metadata",
            ph: "M",
            ts: 0,
            dur: None,
            pid: 1,
            tid: worker.worker,
            args: Some(serde_json::json!({ "name": worker_name(worker) })),
        })
        .collect();
    for s in spans {
        let name = match s.block {
            Some(b) => format!("{} b{b}", s.kind.name()),
            None => s.kind.name().to_string(),
        };
        events.push(TraceEvent {
            name,
            cat: s.kind.name(),
            ph: "X",
            ts: s.start_us,
            dur: Some(s.duration_us.max(1)),
            pid: 1,
            tid: s.worker,
            args: s.block.map(|b| serde_json::json!({ "block": b })),
        });
    }
    let json = serde_json::to_vec(&serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }))
        .map_err(|e| crate::Error::Data { path: path.to_path_buf(), message: e.to_string() })?;
    write_atomic(path, &json)
}
