//! The synchronisation primitives of a phase: the stop signal, the
//! workers' heartbeats, the step barrier, and channel waits that give way
//! to the stop signal and time out.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};

use super::messages::{Peer, Sink, Source, Window};
use super::transport::Tag;
use crate::error::{Error, Result};

/// How often a waiting worker looks at the stop signal.
pub(super) const POLL: Duration = Duration::from_millis(20);

/// The first error of a phase, and the flag every wait polls.
pub(super) struct Stop {
    raised: AtomicBool,
    first: Mutex<Option<(Error, Instant)>>,
}

impl Stop {
    pub(super) fn new() -> Self {
        Self { raised: AtomicBool::new(false), first: Mutex::new(None) }
    }
    pub(super) fn raise(&self, error: Error) {
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some((error, Instant::now()));
        }
        self.raised.store(true, Ordering::SeqCst);
    }
    pub(super) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::SeqCst)
    }
    /// The first error's message, leaving it in place.
    pub(super) fn describe(&self) -> Option<String> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(e, _)| e.to_string())
    }
    pub(super) fn take(&self) -> Option<(Error, Instant)> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// A worker's sign of life, read by the phase's watchdog: when it last
/// moved, and whether it is waiting for a peer (which is not its fault).
pub(super) struct Heartbeat {
    origin: Instant,
    last_ms: AtomicU64,
    waiting: AtomicUsize,
    pub(super) finished: AtomicBool,
    pub(super) step: AtomicUsize,
}

impl Heartbeat {
    pub(super) fn new(origin: Instant) -> Self {
        Self {
            origin,
            last_ms: AtomicU64::new(origin.elapsed().as_millis() as u64),
            waiting: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
            step: AtomicUsize::new(0),
        }
    }
    pub(super) fn beat(&self) {
        self.last_ms.store(self.origin.elapsed().as_millis() as u64, Ordering::SeqCst);
    }
    /// Marks a wait for a peer until the guard is dropped.
    pub(super) fn waiting(&self) -> WaitGuard<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        WaitGuard(self)
    }
    /// Seconds since the last beat, if the worker is working (not waiting, not done).
    pub(super) fn silent_for(&self) -> Option<f64> {
        if self.finished.load(Ordering::SeqCst) || self.waiting.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let now = self.origin.elapsed().as_millis() as u64;
        Some(now.saturating_sub(self.last_ms.load(Ordering::SeqCst)) as f64 / 1e3)
    }
}

pub(super) struct WaitGuard<'a>(&'a Heartbeat);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.0.beat();
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Why a worker stopped early: its own error, or someone else's.
pub(super) enum Halt {
    Stopped,
    Failed(Error),
}

impl From<Error> for Halt {
    fn from(e: Error) -> Self {
        Halt::Failed(e)
    }
}

pub(super) type Flow<T> = std::result::Result<T, Halt>;

/// A global barrier with a timeout that also gives way to the stop signal.
/// In a multi-process run each rank has one worker of the phase, and the
/// barrier is an exchange of arrival messages with the other ranks.
pub(super) struct StepBarrier {
    parties: usize,
    state: Mutex<(u64, usize)>,
    turned: Condvar,
    /// The other ranks of the phase, in a multi-process run.
    peers: Vec<Peer>,
}

impl StepBarrier {
    pub(super) fn new(parties: usize) -> Self {
        Self { parties, state: Mutex::new((0, 0)), turned: Condvar::new(), peers: Vec::new() }
    }

    /// The barrier of this rank's one worker with the workers of `peers`.
    pub(super) fn across(peers: Vec<Peer>) -> Self {
        Self { peers, ..Self::new(1) }
    }

    pub(super) fn wait(&self, stop: &Stop, timeout: Duration, who: &str) -> Flow<()> {
        for peer in &self.peers {
            peer.transport.post(peer.rank, Tag::Barrier, Vec::new())?;
        }
        for peer in &self.peers {
            let what = || format!("{who} waited at the step barrier for rank {}", peer.rank);
            receive_remote(peer, Tag::Barrier, stop, timeout, what)?;
        }
        let start = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let generation = state.0;
        state.1 += 1;
        if state.1 == self.parties {
            state.0 += 1;
            state.1 = 0;
            self.turned.notify_all();
            return Ok(());
        }
        loop {
            let (next, _) = self.turned.wait_timeout(state, POLL).unwrap_or_else(|p| p.into_inner());
            state = next;
            if state.0 != generation {
                return Ok(());
            }
            if stop.is_raised() {
                return Err(Halt::Stopped);
            }
            if start.elapsed() > timeout {
                return Err(Halt::Failed(Error::Timeout {
                    message: format!("{who} waited {:.0} s at the step barrier", timeout.as_secs_f64()),
                }));
            }
        }
    }
}

/// Receives from `rx`, polling the stop signal; gives up after `timeout`
/// with a timeout naming `what` was awaited.
pub(super) fn receive<M>(
    rx: &Receiver<M>,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<M> {
    let attempt = || match rx.recv_timeout(POLL) {
        Ok(m) => Ok(Some(m)),
        Err(RecvTimeoutError::Timeout) => Ok(None),
        Err(RecvTimeoutError::Disconnected) => Err(Halt::Stopped),
    };
    wait_for(attempt, stop, timeout, what)
}

/// Repeats `attempt` (each waits up to one poll) until it yields a message,
/// the stop signal is raised, or `timeout` has passed.
fn wait_for<M>(
    mut attempt: impl FnMut() -> Flow<Option<M>>,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<M> {
    let start = Instant::now();
    loop {
        if let Some(m) = attempt()? {
            return Ok(m);
        }
        if stop.is_raised() {
            return Err(Halt::Stopped);
        }
        if start.elapsed() > timeout {
            return Err(Halt::Failed(Error::Timeout {
                message: format!("{} (waited {:.0} s)", what(), timeout.as_secs_f64()),
            }));
        }
    }
}

/// Sends on `tx`, polling the stop signal; gives up after `timeout` with a
/// timeout naming `what` was blocked.
pub(super) fn send<M>(
    tx: &Sender<M>,
    mut message: M,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<()> {
    let start = Instant::now();
    loop {
        match tx.send_timeout(message, POLL) {
            Ok(()) => return Ok(()),
            Err(SendTimeoutError::Timeout(m)) => {
                if stop.is_raised() {
                    return Err(Halt::Stopped);
                }
                if start.elapsed() > timeout {
                    return Err(Halt::Failed(Error::Timeout {
                        message: format!("{} (blocked {:.0} s)", what(), timeout.as_secs_f64()),
                    }));
                }
                message = m;
            }
            Err(SendTimeoutError::Disconnected(_)) => return Err(Halt::Stopped),
        }
    }
}

/// Receives the next message under `tag` from `peer`, polling the stop
/// signal; gives up after `timeout`.
pub(super) fn receive_remote(
    peer: &Peer,
    tag: Tag,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<Vec<u8>> {
    wait_for(|| Ok(peer.transport.receive(peer.rank, tag, POLL)?), stop, timeout, what)
}

/// Sends `message` to a sink: on its channel, or encoded (`encode`) to
/// another rank under `tag` (which never blocks).
pub(super) fn send_to<M>(
    sink: &Sink<M>,
    message: M,
    tag: Tag,
    encode: impl FnOnce(M) -> Result<Vec<u8>>,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<()> {
    match sink {
        Sink::Local(tx) => send(tx, message, stop, timeout, what),
        Sink::Remote(peer, window) => {
            if tag == Tag::Activation {
                wait_for_credit(peer, window, stop, timeout, what)?;
            }
            Ok(peer.transport.post(peer.rank, tag, encode(message)?)?)
        }
    }
}

/// Waits until `window` lets one more activation go to `peer` (taking the
/// credits `peer` has sent back), then counts it as in flight.
fn wait_for_credit(
    peer: &Peer,
    window: &Window,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<()> {
    let attempt = || {
        while window.in_flight.get() > 0 {
            let wait = if window.in_flight.get() < window.capacity { Duration::ZERO } else { POLL };
            match peer.transport.receive(peer.rank, Tag::Credit, wait)? {
                Some(_) => window.in_flight.set(window.in_flight.get() - 1),
                None => break,
            }
        }
        Ok((window.in_flight.get() < window.capacity).then_some(()))
    };
    wait_for(attempt, stop, timeout, what)?;
    window.in_flight.set(window.in_flight.get() + 1);
    Ok(())
}

/// Receives a message from a source: its channel, or another rank's
/// message under `tag`, decoded by `decode`.
pub(super) fn receive_from<M>(
    source: &Source<M>,
    tag: Tag,
    decode: impl FnOnce(Vec<u8>) -> Result<M>,
    stop: &Stop,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Flow<M> {
    match source {
        Source::Local(rx) => receive(rx, stop, timeout, what),
        Source::Remote(peer) => {
            let bytes = receive_remote(peer, tag, stop, timeout, what)?;
            if tag == Tag::Activation {
                peer.transport.post(peer.rank, Tag::Credit, Vec::new())?;
            }
            let what = format!("{tag:?}").to_lowercase();
            Ok(decode(bytes).map_err(|e| Error::damaged_frame(peer.rank, &what, e))?)
        }
    }
}

/// Where an interrupted phase stops: workers pass the gate at the start of
/// every step; once it is closed, no step past the highest one already
/// started begins. Within one process the watchdog closes it and sets the
/// stop step at once; across processes it stays closed (workers wait at it)
/// until the ranks have agreed on the stop step ([`super::cluster`]).
pub(super) struct StepGate {
    state: Mutex<GateState>,
    opened: Condvar,
}

#[derive(Default)]
struct GateState {
    /// The highest step a worker of this process has started.
    highest_started: Option<usize>,
    closed: bool,
    /// No worker starts this step or a later one.
    stop_at: Option<usize>,
}

impl StepGate {
    pub(super) fn new() -> Self {
        Self { state: Mutex::new(GateState::default()), opened: Condvar::new() }
    }

    /// Called by a worker before `step`: true to run it, false to stop
    /// before it (the run was interrupted); waits while the gate is closed
    /// without a stop step, giving way to the stop signal.
    pub(super) fn enter(&self, step: usize, stop: &Stop) -> Flow<bool> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(stop_at) = state.stop_at {
                return Ok(step < stop_at);
            }
            if !state.closed {
                state.highest_started = Some(state.highest_started.map_or(step, |h| h.max(step)));
                return Ok(true);
            }
            if stop.is_raised() {
                return Err(Halt::Stopped);
            }
            let (next, _) = self.opened.wait_timeout(state, POLL).unwrap_or_else(|p| p.into_inner());
            state = next;
        }
    }

    /// Closes the gate (once) and returns the step this process would stop
    /// at: one past the highest step started here, or `first_step` when
    /// none has started.
    pub(super) fn close(&self, first_step: usize) -> usize {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.closed = true;
        state.highest_started.map_or(first_step, |h| h + 1)
    }

    /// Opens the closed gate with the stop step: workers before it go on,
    /// the others stop. The first stop step set is kept.
    pub(super) fn stop_at(&self, step: usize) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.closed = true;
        state.stop_at.get_or_insert(step);
        self.opened.notify_all();
    }

    /// Whether the gate has been closed (a stop step is set or being agreed).
    pub(super) fn is_closed(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).closed
    }
}

#[cfg(test)]
mod gate_tests {
    use super::*;

    #[test]
    fn no_step_starts_past_the_highest_started_once_closed() {
        let gate = StepGate::new();
        let stop = Stop::new();
        assert!(gate.enter(3, &stop).ok().unwrap());
        assert!(gate.enter(5, &stop).ok().unwrap());
        assert_eq!(gate.close(3), 6);
        gate.stop_at(6);
        // A slower worker still finishes the steps up to the stop step.
        assert!(gate.enter(4, &stop).ok().unwrap());
        assert!(!gate.enter(6, &stop).ok().unwrap());
        gate.stop_at(9);
        assert!(!gate.enter(7, &stop).ok().unwrap(), "the first stop step is kept");
        let untouched = StepGate::new();
        assert_eq!(untouched.close(7), 7, "nothing started: stop before the first step");
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;
    use crate::runtime::transport::Loopback;

    #[test]
    fn a_sender_to_another_rank_keeps_at_most_the_capacity_in_flight() {
        let ranks = Loopback::group(2);
        let peer = |rank: usize, of: usize| Peer { transport: ranks[of].clone(), rank };
        let sink: Sink<Vec<u8>> =
            Sink::Remote(peer(1, 0), Window { capacity: 2, in_flight: Default::default() });
        let source: Source<Vec<u8>> = Source::Remote(peer(0, 1));
        let stop = Stop::new();
        let short = Duration::from_millis(200);
        let send = |byte: u8| send_to(&sink, vec![byte], Tag::Activation, Ok, &stop, short, || "send".into());
        let take = || receive_from(&source, Tag::Activation, Ok, &stop, short, || "receive".into());
        assert!(send(1).is_ok() && send(2).is_ok());
        match send(3) {
            Err(Halt::Failed(Error::Timeout { message })) => assert!(message.contains("send"), "{message}"),
            _ => panic!("a third activation went out with two untaken"),
        }
        assert_eq!(take().ok(), Some(vec![1]));
        assert!(send(3).is_ok(), "a taken activation frees its place");
        assert_eq!(take().ok(), Some(vec![2]));
        assert_eq!(take().ok(), Some(vec![3]));
    }

    #[test]
    fn a_damaged_frame_from_another_rank_is_an_error_naming_that_rank() {
        let ranks = Loopback::group(3);
        let source: Source<Vec<u8>> = Source::Remote(Peer { transport: ranks[0].clone(), rank: 2 });
        ranks[2].post(0, Tag::Activation, vec![1, 2, 3]).unwrap();
        let stop = Stop::new();
        let refuse =
            |_: Vec<u8>| -> Result<Vec<u8>> { Err(Error::Transport { message: "cut short".into() }) };
        let wait = Duration::from_secs(5);
        match receive_from(&source, Tag::Activation, refuse, &stop, wait, || "receive".into()) {
            Err(Halt::Failed(error)) => {
                let text = error.to_string();
                assert!(text.starts_with("rank 2: sent a damaged activation message"), "{text}");
                assert!(text.contains("cut short"), "{text}");
            }
            _ => panic!("a damaged frame was taken"),
        }
    }
}
