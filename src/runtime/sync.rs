//! The synchronisation primitives of a phase: the stop signal, the
//! workers' heartbeats, the step barrier, and channel waits that give way
//! to the stop signal and time out.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};

use super::messages::{Peer, Sink, Source};
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
        Sink::Remote(peer) => Ok(peer.transport.post(peer.rank, tag, encode(message)?)?),
    }
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
        Source::Remote(peer) => Ok(decode(receive_remote(peer, tag, stop, timeout, what)?)?),
    }
}
