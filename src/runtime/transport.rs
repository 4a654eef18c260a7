//! The seam between the runtime and the wire: how the workers of one run,
//! spread over several processes ("ranks"), hand each other bytes.
//!
//! Inside one process the runtime passes typed messages on crossbeam
//! channels and never touches this module. When a run spans processes
//! (`RuntimeSettings::transport`), every hand-off between workers of
//! different ranks (activations and masks, gradients for a stage leader,
//! updated blocks for followers, the `tr` barrier, progress, heartbeats, the
//! stop signal, the state of every block at the end of a phase) goes through
//! one [`Transport`]: a queue of byte messages per (peer, [`Tag`]), in order.
//! Two implementations: [`Loopback`] (ranks as threads of one process, for
//! tests and for trying a cluster plan on one machine) and, with the `mpi`
//! feature, `MpiTransport` (OpenMPI or any MPI library through rsmpi:
//! non-blocking sends, one probe loop per process). A device-to-device
//! implementation (NCCL) fits the same trait.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// What a message is; each kind is its own ordered stream per peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
pub enum Tag {
    /// A boundary activation (and its mask) for the next stage.
    Activation = 1,
    /// A follower's gradients for its stage leader.
    Gradients = 2,
    /// A stage leader's updated blocks for a follower.
    Modules = 3,
    /// Arrival at the `tr` step barrier.
    Barrier = 4,
    /// A stage leader's step done, for rank 0's progress display.
    Progress = 5,
    /// A rank is alive.
    Heartbeat = 6,
    /// A rank failed: every rank stops its phase.
    Stop = 7,
    /// The end of a phase on one rank: its leaders' block states, metric
    /// rows, spans and worker summaries.
    PhaseEnd = 8,
    /// The plan chosen by rank 0 (`auto`).
    Plan = 9,
    /// The run was interrupted (SIGINT, SIGTERM): the phase, the signal and
    /// the step this rank would stop at; every rank stops at the highest.
    Interrupt = 10,
    /// The receiver of a boundary activation took it: the sender may have
    /// one more in flight (`RuntimeSettings::channel_capacity` across ranks).
    Credit = 11,
    /// A rank's cost table (its own device's profile) for rank 0's `auto` plan.
    Profile = 12,
}

impl Tag {
    /// Every tag, for decoding.
    pub const ALL: [Tag; 12] = [
        Tag::Activation,
        Tag::Gradients,
        Tag::Modules,
        Tag::Barrier,
        Tag::Progress,
        Tag::Heartbeat,
        Tag::Stop,
        Tag::PhaseEnd,
        Tag::Plan,
        Tag::Interrupt,
        Tag::Credit,
        Tag::Profile,
    ];

    /// The tag with this wire number.
    pub fn from_wire(value: i32) -> Option<Tag> {
        Tag::ALL.into_iter().find(|t| *t as i32 == value)
    }
}

/// Byte messages between the ranks of one run. Messages from one peer
/// under one tag arrive in the order they were posted; posting never
/// blocks (the message is queued until the peer takes it).
pub trait Transport: Send + Sync + fmt::Debug {
    /// This process's rank, `0..ranks()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn ranks(&self) -> usize;
    /// Queues `bytes` for rank `to` under `tag`.
    fn post(&self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<()>;
    /// The next message from `from` under `tag`, waiting at most `wait`.
    fn receive(&self, from: usize, tag: Tag, wait: Duration) -> Result<Option<Vec<u8>>>;
    /// The next message under `tag` from any rank, waiting at most `wait`.
    fn receive_any(&self, tag: Tag, wait: Duration) -> Result<Option<(usize, Vec<u8>)>>;
}

/// Messages waiting to be taken, by (sender, tag), in order.
type Queues = HashMap<(usize, Tag), VecDeque<Vec<u8>>>;

/// Messages that have arrived at one rank, by (sender, tag), in order.
#[derive(Default)]
pub(crate) struct Inbox {
    queues: Mutex<Queues>,
    arrived: Condvar,
}

impl Inbox {
    /// Files a message that arrived from `from`.
    pub(crate) fn deliver(&self, from: usize, tag: Tag, bytes: Vec<u8>) {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues.entry((from, tag)).or_default().push_back(bytes);
        self.arrived.notify_all();
    }

    /// The first message matching `from` (any sender if `None`) and `tag`,
    /// waiting at most `wait`.
    pub(crate) fn take(&self, from: Option<usize>, tag: Tag, wait: Duration) -> Option<(usize, Vec<u8>)> {
        let deadline = Instant::now() + wait;
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let found = match from {
                Some(rank) => queues.get_mut(&(rank, tag)).and_then(|q| q.pop_front()).map(|m| (rank, m)),
                None => {
                    let mut keys: Vec<(usize, Tag)> =
                        queues.iter().filter(|(k, q)| k.1 == tag && !q.is_empty()).map(|(k, _)| *k).collect();
                    keys.sort();
                    keys.first().and_then(|k| queues.get_mut(k).and_then(|q| q.pop_front()).map(|m| (k.0, m)))
                }
            };
            if found.is_some() {
                return found;
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let (next, _) =
                self.arrived.wait_timeout(queues, deadline - now).unwrap_or_else(|p| p.into_inner());
            queues = next;
        }
    }
}

/// Ranks as threads of one process: every rank's inbox in one shared table.
/// For tests, and to try a cluster run's exact message flow on one machine.
pub struct Loopback {
    rank: usize,
    inboxes: Arc<Vec<Inbox>>,
}

impl fmt::Debug for Loopback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Loopback(rank {} of {})", self.rank, self.inboxes.len())
    }
}

impl Loopback {
    /// `ranks` connected transports, one per rank (hand each to its thread).
    pub fn group(ranks: usize) -> Vec<Arc<dyn Transport>> {
        let inboxes: Arc<Vec<Inbox>> = Arc::new((0..ranks).map(|_| Inbox::default()).collect());
        (0..ranks)
            .map(|rank| Arc::new(Loopback { rank, inboxes: inboxes.clone() }) as Arc<dyn Transport>)
            .collect()
    }
}

impl Transport for Loopback {
    fn rank(&self) -> usize {
        self.rank
    }
    fn ranks(&self) -> usize {
        self.inboxes.len()
    }
    fn post(&self, to: usize, tag: Tag, bytes: Vec<u8>) -> Result<()> {
        let inbox = self.inboxes.get(to).ok_or_else(|| Error::Transport {
            message: format!("rank {} posted to rank {to}, but there are {} ranks", self.rank, self.ranks()),
        })?;
        inbox.deliver(self.rank, tag, bytes);
        Ok(())
    }
    fn receive(&self, from: usize, tag: Tag, wait: Duration) -> Result<Option<Vec<u8>>> {
        Ok(self.inboxes[self.rank].take(Some(from), tag, wait).map(|(_, m)| m))
    }
    fn receive_any(&self, tag: Tag, wait: Duration) -> Result<Option<(usize, Vec<u8>)>> {
        Ok(self.inboxes[self.rank].take(None, tag, wait))
    }
}

/// A plan whose device slots do not match the run's ranks (one rank per slot).
pub fn rank_mismatch(plan: &crate::plan::Plan, ranks: usize) -> Error {
    let slots = |n: usize| format!("{n} device slot{}", if n == 1 { "" } else { "s" });
    Error::Plan {
        plan: plan.name.clone(),
        message: format!(
            "{} uses {}, one process (rank) each, but {ranks} ranks were started: \
             start it with `mpirun -np {}`, or give the config {}",
            plan.describe(),
            slots(plan.slots()),
            plan.slots(),
            slots(ranks)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_keeps_order_per_sender_and_tag() {
        let ranks = Loopback::group(3);
        ranks[1].post(0, Tag::Activation, vec![1]).unwrap();
        ranks[2].post(0, Tag::Activation, vec![2]).unwrap();
        ranks[1].post(0, Tag::Activation, vec![3]).unwrap();
        ranks[1].post(0, Tag::Progress, vec![4]).unwrap();
        let wait = Duration::from_millis(1);
        assert_eq!(ranks[0].receive(1, Tag::Activation, wait).unwrap(), Some(vec![1]));
        assert_eq!(ranks[0].receive(1, Tag::Activation, wait).unwrap(), Some(vec![3]));
        assert_eq!(ranks[0].receive(1, Tag::Activation, wait).unwrap(), None);
        assert_eq!(ranks[0].receive_any(Tag::Progress, wait).unwrap(), Some((1, vec![4])));
        assert_eq!(ranks[0].receive_any(Tag::Activation, wait).unwrap(), Some((2, vec![2])));
        assert!(ranks[0].post(7, Tag::Stop, Vec::new()).is_err());
    }

    #[test]
    fn a_receive_waits_for_a_message_from_another_thread() {
        let ranks = Loopback::group(2);
        let sender = ranks[1].clone();
        let handle = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            sender.post(0, Tag::Barrier, vec![9]).unwrap();
        });
        let got = ranks[0].receive(1, Tag::Barrier, Duration::from_secs(10)).unwrap();
        handle.join().unwrap();
        assert_eq!(got, Some(vec![9]));
    }
}
