//! What a phase of a multi-process run adds on each rank's main thread:
//! heartbeats to and from the other ranks, the stop signal carried across
//! processes, stage leaders' progress forwarded to rank 0, and at the end of
//! the phase the exchange that leaves every rank with every block's state
//! and rank 0 with every rank's metric rows, spans and worker summaries.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipebd_core::StudentModule;
use pipebd_kernels::DistillBackend;

use super::interrupt::Interrupt;
use super::messages::ProgressMsg;
use super::sync::{StepGate, Stop, POLL};
use super::transport::{Tag, Transport};
use super::wire::{decode_state, encode_state, Reader, Writer};
use crate::error::{Error, Result};
use crate::trace::{Span, WorkerSummary};
use crate::train::{BlockTrainer, MetricRow};

/// How often a rank tells the others it is alive.
const HEARTBEAT: Duration = Duration::from_millis(500);

/// One rank's watch over the others during a phase.
pub(super) struct ClusterWatch {
    transport: Arc<dyn Transport>,
    others: Vec<usize>,
    last_heard: BTreeMap<usize, Instant>,
    last_sent: Option<Instant>,
    silence_limit: f64,
    /// The stop signal was raised here and told to the others (or came from them).
    announced: bool,
    /// Agreeing on the step an interrupted phase stops at.
    agreement: StopAgreement,
}

/// One phase's agreement on where an interrupted run stops: each rank
/// closes its step gate, proposes one past the highest step started on it,
/// and opens the gate at the highest proposal once it has every rank's.
struct StopAgreement {
    interrupt: Interrupt,
    phase: usize,
    first_step: usize,
    proposed: Option<usize>,
    /// The other ranks' proposals for this phase.
    proposals: BTreeMap<usize, usize>,
}

impl ClusterWatch {
    /// The watch of phase `phase`, whose first step is `first_step`, over
    /// the other ranks of `transport`; an interrupt (requested here or
    /// received from a rank) is agreed on and set in `interrupt`.
    pub(super) fn new(
        transport: Arc<dyn Transport>,
        silence_limit: f64,
        interrupt: Interrupt,
        (phase, first_step): (usize, usize),
    ) -> Self {
        let me = transport.rank();
        let others: Vec<usize> = (0..transport.ranks()).filter(|&r| r != me).collect();
        let now = Instant::now();
        Self {
            last_heard: others.iter().map(|&r| (r, now)).collect(),
            others,
            transport,
            last_sent: None,
            silence_limit,
            announced: false,
            agreement: StopAgreement {
                interrupt,
                phase,
                first_step,
                proposed: None,
                proposals: BTreeMap::new(),
            },
        }
    }

    pub(super) fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Sends this rank's heartbeat when due, takes the others' heartbeats
    /// and stop messages, raises `stop` for a peer's failure or silence,
    /// tells the others about a failure here, and returns the progress
    /// messages that reached rank 0.
    pub(super) fn tick(&mut self, stop: &Stop, gate: &StepGate) -> Vec<ProgressMsg> {
        if let Err(error) = self.agree_on_interrupt(gate) {
            stop.raise(error);
        }
        match self.exchange(stop) {
            Ok(progress) => progress,
            Err(error) => {
                stop.raise(error);
                self.announce(stop);
                Vec::new()
            }
        }
    }

    fn exchange(&mut self, stop: &Stop) -> Result<Vec<ProgressMsg>> {
        let now = Instant::now();
        if self.last_sent.is_none_or(|t| now.duration_since(t) >= HEARTBEAT) {
            self.post_others(Tag::Heartbeat, &[])?;
            self.last_sent = Some(now);
        }
        while let Some((rank, _)) = self.transport.receive_any(Tag::Heartbeat, Duration::ZERO)? {
            self.last_heard.insert(rank, Instant::now());
        }
        while let Some((rank, bytes)) = self.transport.receive_any(Tag::Stop, Duration::ZERO)? {
            self.announced = true;
            stop.raise(Error::Peer { rank, message: String::from_utf8_lossy(&bytes).into_owned() });
        }
        if !stop.is_raised() {
            let silent = self
                .last_heard
                .iter()
                .map(|(&r, t)| (r, t.elapsed().as_secs_f64()))
                .find(|&(_, s)| s > self.silence_limit);
            if let Some((rank, seconds)) = silent {
                stop.raise(Error::Peer {
                    rank,
                    message: format!(
                        "no heartbeat for {seconds:.0} s (process killed, or its node or link lost)"
                    ),
                });
            }
        }
        self.announce(stop);
        let mut progress = Vec::new();
        while let Some((rank, bytes)) = self.transport.receive_any(Tag::Progress, Duration::ZERO)? {
            progress.push(decode_progress(&bytes).map_err(|e| Error::damaged_frame(rank, "progress", e))?);
        }
        Ok(progress)
    }

    /// Takes the other ranks' interrupt messages, proposes this rank's stop
    /// step once the run is interrupted (here or elsewhere), and opens the
    /// gate at the highest proposal once every rank's is in.
    fn agree_on_interrupt(&mut self, gate: &StepGate) -> Result<()> {
        let agreement = &mut self.agreement;
        while let Some((rank, bytes)) = self.transport.receive_any(Tag::Interrupt, Duration::ZERO)? {
            let (phase, signal, proposal) = decode_interrupt(&bytes).map_err(|message| Error::Peer {
                rank,
                message: format!("sent a damaged interrupt message: {message}"),
            })?;
            agreement.interrupt.request(signal);
            // A proposal of an earlier phase reached this one late: the
            // interrupt stands, the proposal is that phase's.
            if phase == agreement.phase {
                agreement.proposals.insert(rank, proposal);
            }
        }
        let Some(signal) = agreement.interrupt.requested() else {
            return Ok(());
        };
        let proposed = match agreement.proposed {
            Some(step) => step,
            None => {
                let step = gate.close(agreement.first_step);
                agreement.proposed = Some(step);
                let message = encode_interrupt(agreement.phase, signal, step);
                for &rank in &self.others {
                    self.transport.post(rank, Tag::Interrupt, message.clone())?;
                }
                step
            }
        };
        if agreement.proposals.len() == self.others.len() {
            gate.stop_at(agreement.proposals.values().copied().fold(proposed, usize::max));
        }
        Ok(())
    }

    /// Posts `bytes` under `tag` to every other rank.
    fn post_others(&self, tag: Tag, bytes: &[u8]) -> Result<()> {
        for &rank in &self.others {
            self.transport.post(rank, tag, bytes.to_vec())?;
        }
        Ok(())
    }

    /// Tells every other rank why this one stopped (once).
    fn announce(&mut self, stop: &Stop) {
        if self.announced || !stop.is_raised() {
            return;
        }
        self.announced = true;
        let message = stop.describe().unwrap_or_else(|| "stopped".into());
        let _ = self.post_others(Tag::Stop, message.as_bytes());
    }

    /// A stage leader's step done on this rank, for rank 0.
    pub(super) fn forward(&self, msg: &ProgressMsg) -> Result<()> {
        self.transport.post(0, Tag::Progress, encode_progress(msg))
    }

    /// Sends this rank's end of the phase to every other rank, then waits
    /// for theirs while keeping up heartbeats (and progress, on rank 0, fed
    /// to `on_progress`): a rank still training is alive, so there is no
    /// timeout but the others' silence. Returns the others' ends, or `None`
    /// when the stop signal was raised meanwhile.
    pub(super) fn finish_phase(
        &mut self,
        mine: &PhaseEnd,
        stop: &Stop,
        gate: &StepGate,
        on_progress: &mut dyn FnMut(ProgressMsg),
    ) -> Result<Option<Vec<PhaseEnd>>> {
        self.post_others(Tag::PhaseEnd, &mine.encode())?;
        let mut ends = BTreeMap::new();
        while ends.len() < self.others.len() {
            for msg in self.tick(stop, gate) {
                on_progress(msg);
            }
            if stop.is_raised() {
                return Ok(None);
            }
            for &rank in &self.others {
                if ends.contains_key(&rank) {
                    continue;
                }
                if let Some(bytes) = self.transport.receive(rank, Tag::PhaseEnd, Duration::ZERO)? {
                    let end = PhaseEnd::decode(&bytes)
                        .map_err(|e| Error::damaged_frame(rank, "end-of-phase", e))?;
                    ends.insert(rank, end);
                }
            }
            std::thread::sleep(POLL / 4);
        }
        for msg in self.tick(stop, gate) {
            on_progress(msg);
        }
        Ok(Some(ends.into_values().collect()))
    }
}

/// What one rank hands the others at the end of a phase.
pub(super) struct PhaseEnd {
    /// The state of every block whose stage leader ran here (zero-based block, state).
    pub(super) states: Vec<(usize, crate::train::TrainerState)>,
    pub(super) rows: Vec<MetricRow>,
    pub(super) spans: Vec<Span>,
    pub(super) workers: Vec<WorkerSummary>,
    pub(super) checkpoints_written: usize,
    /// The signal that had interrupted the run on this rank when it sent
    /// its end (0: none). Every rank reads the same ends, so every rank
    /// agrees whether the run goes on to its next phase.
    pub(super) interrupted: i32,
}

impl PhaseEnd {
    /// The states of `blocks` from `trainers`, with this rank's records of
    /// the phase (metric rows, spans, worker summaries, checkpoints written).
    pub(super) fn collect<B: DistillBackend, S: StudentModule<B>>(
        trainers: &[Option<BlockTrainer<B, S>>],
        blocks: &[usize],
        rows: Vec<MetricRow>,
        spans: Vec<Span>,
        workers: Vec<WorkerSummary>,
        checkpoints_written: usize,
        interrupted: Option<i32>,
    ) -> Result<Self> {
        let mut states = Vec::new();
        for &k in blocks {
            if let Some(trainer) = trainers.get(k).and_then(|t| t.as_ref()) {
                states.push((k, trainer.save_state()?));
            }
        }
        Ok(Self { states, rows, spans, workers, checkpoints_written, interrupted: interrupted.unwrap_or(0) })
    }

    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(self.states.len() as u64);
        for (k, state) in &self.states {
            w.u64(*k as u64);
            encode_state(&mut w, state);
        }
        let json = |v: serde_json::Result<Vec<u8>>| v.unwrap_or_default();
        w.bytes(&json(serde_json::to_vec(&self.rows)))
            .bytes(&json(serde_json::to_vec(&self.spans)))
            .bytes(&json(serde_json::to_vec(&self.workers)))
            .u64(self.checkpoints_written as u64)
            .u64(self.interrupted.max(0) as u64);
        w.0
    }

    pub(super) fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, "end of phase");
        let count = r.u64()? as usize;
        let mut states = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            let k = r.u64()? as usize;
            states.push((k, decode_state(&mut r)?));
        }
        let bad = |e: serde_json::Error| Error::Transport {
            message: format!("an end-of-phase message does not decode: {e}"),
        };
        let rows = serde_json::from_slice(r.bytes()?).map_err(bad)?;
        let spans = serde_json::from_slice(r.bytes()?).map_err(bad)?;
        let workers = serde_json::from_slice(r.bytes()?).map_err(bad)?;
        let checkpoints_written = r.u64()? as usize;
        let interrupted = r.u64()?.min(i32::MAX as u64) as i32;
        r.finish()?;
        Ok(Self { states, rows, spans, workers, checkpoints_written, interrupted })
    }
}

pub(super) fn encode_progress(msg: &ProgressMsg) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(msg.stage as u64).u64(msg.step as u64).u64(msg.losses.len() as u64);
    for (block, loss) in &msg.losses {
        w.u64(*block as u64).u64(loss.to_bits() as u64);
    }
    w.0
}

pub(super) fn decode_progress(bytes: &[u8]) -> Result<ProgressMsg> {
    let mut r = Reader::new(bytes, "progress");
    let stage = r.u64()? as usize;
    let step = r.u64()? as usize;
    let count = r.u64()? as usize;
    let mut losses = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        losses.push((r.u64()? as usize, f32::from_bits(r.u64()? as u32)));
    }
    r.finish()?;
    Ok(ProgressMsg { stage, step, losses })
}

/// An interrupt message: the phase, the signal, the proposed stop step.
pub(super) fn encode_interrupt(phase: usize, signal: i32, step: usize) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(phase as u64).u64(signal.max(1) as u64).u64(step as u64);
    w.0
}

pub(super) fn decode_interrupt(bytes: &[u8]) -> std::result::Result<(usize, i32, usize), String> {
    let mut r = Reader::new(bytes, "interrupt");
    let mut read = || r.u64().map_err(|e| e.to_string());
    let (phase, signal, step) = (read()?, read()?, read()?);
    r.finish().map_err(|e| e.to_string())?;
    let signal =
        i32::try_from(signal).ok().filter(|&s| s > 0).ok_or(format!("signal {signal} is not one"))?;
    Ok((phase as usize, signal, step as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interrupt_messages_round_trip_and_damaged_ones_are_refused() {
        let bytes = encode_interrupt(2, 15, 41);
        assert_eq!(decode_interrupt(&bytes), Ok((2, 15, 41)));
        assert!(decode_interrupt(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode_interrupt(&encode_interrupt(2, 15, 41)[..8]).is_err());
        let mut zero_signal = bytes.clone();
        zero_signal[8..16].fill(0);
        assert!(decode_interrupt(&zero_signal).is_err());
    }
}
