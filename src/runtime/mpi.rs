//! The MPI [`Transport`] (cargo feature `mpi`): one thread per process owns
//! MPI (initialised there, `MPI_THREAD_FUNNELED`, finalised when the
//! transport is dropped) and runs one loop: it starts a non-blocking send for
//! every posted message, completes the sends in flight, and receives every
//! message that has arrived (matched probe, any source, any tag) into the
//! process's [`Inbox`]. Workers never call MPI themselves, so a slow peer
//! never blocks a worker that is not waiting for it, and two ranks sending
//! each other large messages at once cannot deadlock.
//!
//! Device tensors reach this layer as host bytes (the wire encoding reads
//! them back from the device); a CUDA-aware MPI or NCCL would be another
//! `Transport` that takes device buffers.

use std::fmt;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use mpi::request::{Request, StaticScope};
use mpi::traits::{Communicator, Destination, MatchedReceiveVec, Source};

use super::transport::{Inbox, Tag, Transport};
use crate::error::{Error, Result};

/// How long the loop waits for a post when it found nothing to do.
const IDLE: Duration = Duration::from_micros(100);
/// How long a closing transport waits for its last sends to complete.
const FLUSH: Duration = Duration::from_secs(10);

enum Command {
    Send { to: usize, tag: Tag, bytes: Vec<u8> },
    Close,
}

/// The processes started by `mpirun` (or srun, or any MPI launcher) as the
/// ranks of one run.
pub struct MpiTransport {
    rank: usize,
    ranks: usize,
    commands: Sender<Command>,
    inbox: Arc<Inbox>,
    failure: Arc<std::sync::Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MpiTransport(rank {} of {})", self.rank, self.ranks)
    }
}

impl MpiTransport {
    /// Initialises MPI on a thread of its own and returns this process's
    /// end. Fails when MPI cannot be initialised (not started by an MPI
    /// launcher, or initialised twice).
    pub fn start() -> Result<Self> {
        let (commands, queue) = unbounded();
        let inbox = Arc::new(Inbox::default());
        let failure = Arc::new(std::sync::Mutex::new(None));
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let thread_inbox = inbox.clone();
        let thread_failure = failure.clone();
        let thread = std::thread::Builder::new()
            .name("pipebd-mpi".into())
            .spawn(move || {
                let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled) else {
                    let _ = ready_tx.send(Err("MPI is already initialised in this process".to_string()));
                    return;
                };
                let world = universe.world();
                let _ = ready_tx.send(Ok((world.rank() as usize, world.size() as usize)));
                if let Err(message) = pump(&world, &queue, &thread_inbox) {
                    *thread_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(message);
                }
                drop(universe);
            })
            .map_err(|e| Error::Transport { message: format!("cannot start the MPI thread: {e}") })?;
        let (rank, ranks) = ready_rx
            .recv()
            .map_err(|_| Error::Transport { message: "the MPI thread ended while initialising".into() })?
            .map_err(|message| Error::Transport { message })?;
        Ok(Self { rank, ranks, commands, inbox, failure, thread: Some(thread) })
    }

    fn check(&self) -> Result<()> {
        match self.failure.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(message) => Err(Error::Transport { message: message.clone() }),
            None => Ok(()),
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Close);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn ranks(&self) -> usize {
        self.ranks
    }
    fn post(&self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<()> {
        self.check()?;
        if to >= self.ranks {
            return Err(Error::Transport {
                message: format!(
                    "rank {} posted to rank {to}, but there are {} ranks",
                    self.rank, self.ranks
                ),
            });
        }
        self.commands
            .send(Command::Send { to, tag, bytes })
            .map_err(|_| Error::Transport { message: "the MPI thread has ended".into() })
    }
    fn receive(&self, from: usize, tag: Tag, wait: Duration) -> Result<Option<Vec<u8>>> {
        self.check()?;
        Ok(self.inbox.take(Some(from), tag, wait).map(|(_, m)| m))
    }
    fn receive_any(&self, tag: Tag, wait: Duration) -> Result<Option<(usize, Vec<u8>)>> {
        self.check()?;
        Ok(self.inbox.take(None, tag, wait))
    }
}

/// A send in flight and its buffer, leaked for the request's `'static`
/// scope and reclaimed once the request completes.
struct InFlight {
    request: Request<'static, [u8], StaticScope>,
    buffer: *mut [u8],
}

/// Frees a send's buffer once its request has completed.
fn free(buffer: *mut [u8]) {
    // SAFETY: `buffer` came from `Box::leak` in `start_send` and the request
    // that borrowed it has completed, so nothing refers to it any more.
    drop(unsafe { Box::from_raw(buffer) });
}

fn start_send<C: Communicator>(world: &C, to: usize, tag: Tag, bytes: Vec<u8>) -> InFlight {
    let buffer: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
    let pointer: *mut [u8] = buffer;
    // SAFETY: the shared borrow handed to MPI and `pointer` alias the same
    // leaked allocation; it is only freed in `free`, after completion.
    let shared: &'static [u8] = unsafe { &*pointer };
    let request = world.process_at_rank(to as i32).immediate_send_with_tag(StaticScope, shared, tag as i32);
    InFlight { request, buffer: pointer }
}

/// The MPI thread's loop, until `Close` (then flushes the sends in flight).
fn pump<C: Communicator>(
    world: &C,
    queue: &Receiver<Command>,
    inbox: &Inbox,
) -> std::result::Result<(), String> {
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut closing: Option<Instant> = None;
    let mut idle = false;
    let mut pending: Option<Command> = None;
    loop {
        let mut busy = false;
        if idle {
            // Nothing moved last time: wait for a post (or the idle time,
            // then look for arrivals again).
            match queue.recv_timeout(IDLE) {
                Ok(command) => pending = Some(command),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => closing = closing.or(Some(Instant::now())),
            }
        }
        while closing.is_none() {
            let next = match pending.take() {
                Some(command) => Ok(command),
                None => queue.try_recv(),
            };
            match next {
                Ok(Command::Send { to, tag, bytes }) => {
                    in_flight.push(start_send(world, to, tag, bytes));
                    busy = true;
                }
                Ok(Command::Close) | Err(TryRecvError::Disconnected) => closing = Some(Instant::now()),
                Err(TryRecvError::Empty) => break,
            }
        }
        let mut still = Vec::with_capacity(in_flight.len());
        for send in in_flight {
            let InFlight { request, buffer } = send;
            match request.test() {
                Ok(_) => free(buffer),
                Err(request) => still.push(InFlight { request, buffer }),
            }
        }
        in_flight = still;
        while let Some(probed) = world.any_process().immediate_matched_probe() {
            let (bytes, status) = probed.matched_receive_vec::<u8>();
            let from = status.source_rank() as usize;
            match Tag::from_wire(status.tag()) {
                Some(tag) => inbox.deliver(from, tag, bytes),
                None => return Err(format!("rank {from} sent a message with unknown tag {}", status.tag())),
            }
            busy = true;
        }
        if let Some(since) = closing {
            if in_flight.is_empty() {
                return Ok(());
            }
            if since.elapsed() > FLUSH {
                // A peer that never receives: leave its buffers to the OS
                // rather than free memory MPI may still read.
                for send in in_flight {
                    std::mem::forget(send.request);
                }
                return Err(format!(
                    "sends to a peer did not complete within {} s of closing",
                    FLUSH.as_secs()
                ));
            }
        }
        idle = !busy;
    }
}
