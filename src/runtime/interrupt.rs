//! A request to stop a run early and keep its work: what Ctrl-C (SIGINT)
//! and a batch scheduler's SIGTERM become.
//!
//! The runtime never stops a worker in the middle of a step. When an
//! [`Interrupt`] is requested, the phase's watchdog closes the step gate
//! ([`super::sync::StepGate`]): no worker starts a step past the highest one
//! any worker has started, every step already started is finished (its
//! relay, gradients and update), each stage leader writes a checkpoint of
//! every block it trains, and the run returns [`crate::Error::Interrupted`]
//! with the step reached and where the checkpoints are, so that `--resume`
//! continues it to the same weights as an uninterrupted run. Across
//! processes the ranks agree on the stop step first (each proposes the
//! highest step started on it, and all stop after the highest proposal).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A shared flag that asks a run to stop after the steps in flight. Clone it
/// into a signal handler (or any thread) and into
/// [`super::RuntimeSettings::interrupt`]; `request` may be called any number
/// of times and from any thread (the first reason is kept).
#[derive(Debug, Clone, Default)]
pub struct Interrupt(Arc<AtomicUsize>);

impl Interrupt {
    /// A flag nobody has raised yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the run to stop. `signal` is the reason as a Unix signal number
    /// (2 for SIGINT, 15 for SIGTERM; any positive number from a library
    /// caller), which the command line turns into the exit code 128 + signal.
    pub fn request(&self, signal: i32) {
        let reason = signal.max(1) as usize;
        let _ = self.0.compare_exchange(0, reason, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The reason given to the first [`Interrupt::request`], if any.
    pub fn requested(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            signal => Some(signal.min(i32::MAX as usize) as i32),
        }
    }

    /// The flag itself (0, or the signal number), for signal handlers that
    /// store into an atomic (`signal_hook::flag::register_usize`).
    pub fn flag(&self) -> Arc<AtomicUsize> {
        self.0.clone()
    }
}

/// The name of a signal number, for messages (`SIGINT`, `SIGTERM`, or
/// `signal N`).
pub fn signal_name(signal: i32) -> String {
    match signal {
        1 => "SIGHUP".into(),
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        10 => "SIGUSR1".into(),
        12 => "SIGUSR2".into(),
        n => format!("signal {n}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_reason_is_kept() {
        let interrupt = Interrupt::new();
        assert_eq!(interrupt.requested(), None);
        let handler = interrupt.clone();
        handler.request(15);
        handler.request(2);
        assert_eq!(interrupt.requested(), Some(15));
        assert_eq!(signal_name(15), "SIGTERM");
    }
}
