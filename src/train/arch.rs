//! Single-path architecture search (DNA on a ProxylessNAS supernet): which
//! steps update the architecture logits, which held-out batch they use, and
//! which candidate a step samples.
//!
//! Everything here is a pure function of the settings, the seed, the block
//! and the step, so every schedule (and a resumed run) samples the same
//! paths and takes its architecture steps at the same places.

use serde::{Deserialize, Serialize};

/// How a single-path search trains its supernet blocks (blocks whose
/// [`pipebd_core::Block::arch_logits`] is `Some`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SinglePath {
    /// An architecture step every this many training steps (at least 1).
    pub arch_every: usize,
    /// Fraction of the run's steps before the first architecture step
    /// (DNA: a quarter of the epochs).
    pub warmup: f64,
    /// Adam's learning rate for the architecture logits (betas 0 and
    /// 0.999, epsilon 1e-8, constant rate).
    pub arch_lr: f64,
}

impl Default for SinglePath {
    /// DNA's settings: every 5 steps after a quarter of the run, lr 1e-3.
    fn default() -> Self {
        Self { arch_every: 5, warmup: 0.25, arch_lr: 1e-3 }
    }
}

impl SinglePath {
    /// The first step with an architecture step, in a run of `total_steps`.
    pub fn first_arch_step(&self, total_steps: usize) -> usize {
        (self.warmup.clamp(0.0, 1.0) * total_steps as f64).ceil() as usize
    }

    /// The zero-based index of the architecture step taken before training
    /// step `step`, or `None` when `step` has none.
    pub fn arch_step_at(&self, step: usize, total_steps: usize) -> Option<usize> {
        let first = self.first_arch_step(total_steps);
        let every = self.arch_every.max(1);
        (step >= first && (step - first) % every == 0).then(|| (step - first) / every)
    }

    /// Architecture steps in a run of `total_steps`.
    pub fn arch_steps(&self, total_steps: usize) -> usize {
        let first = self.first_arch_step(total_steps);
        if first >= total_steps {
            0
        } else {
            (total_steps - 1 - first) / self.arch_every.max(1) + 1
        }
    }
}

/// Which random draw a path serves: a training step's, or an architecture
/// step's (the two never share a draw).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draw {
    /// The path trained on training step `step`.
    Train,
    /// The path whose gates carry the architecture gradient.
    Arch,
}

/// The candidate drawn from `probabilities` (which sum to about 1) for
/// `block` (zero-based) at `step`: a function of `(seed, block, step,
/// draw)` only, so every schedule, replica and resumed run draws the same.
pub fn sample_path(seed: u64, block: usize, step: usize, draw: Draw, probabilities: &[f64]) -> usize {
    let salt = match draw {
        Draw::Train => 0x5452_4149_4e00_0000,
        Draw::Arch => 0x4152_4348_0000_0000,
    };
    let mut state = seed ^ salt;
    for part in [block as u64, step as u64] {
        state = splitmix64(state ^ part.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }
    // 53 random bits -> uniform in [0, 1).
    let uniform = (splitmix64(state) >> 11) as f64 / (1u64 << 53) as f64;
    let total: f64 = probabilities.iter().sum();
    let mut cumulative = 0.0;
    for (i, p) in probabilities.iter().enumerate() {
        cumulative += p / total;
        if uniform < cumulative {
            return i;
        }
    }
    probabilities.len().saturating_sub(1)
}

/// `softmax(logits)` in f64.
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let exp: Vec<f64> = logits.iter().map(|&a| (a as f64 - max).exp()).collect();
    let total: f64 = exp.iter().sum();
    exp.into_iter().map(|e| e / total).collect()
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_a_function_of_seed_block_and_step() {
        let probabilities = [0.2, 0.5, 0.3];
        let draw = |seed, block| -> Vec<usize> {
            (0..200).map(|step| sample_path(seed, block, step, Draw::Train, &probabilities)).collect()
        };
        assert_eq!(draw(7, 1), draw(7, 1));
        assert_ne!(draw(7, 1), draw(8, 1), "another seed draws other paths");
        assert_ne!(draw(7, 1), draw(7, 2), "another block draws other paths");
        let arch: Vec<usize> = (0..200).map(|s| sample_path(7, 1, s, Draw::Arch, &probabilities)).collect();
        assert_ne!(draw(7, 1), arch, "architecture steps draw on their own");
    }

    #[test]
    fn paths_follow_the_probabilities() {
        let probabilities = softmax(&[0.0, 1.0, -1.0, 0.5]);
        let draws = 40_000;
        let mut counts = [0usize; 4];
        for step in 0..draws {
            counts[sample_path(3, 0, step, Draw::Train, &probabilities)] += 1;
        }
        for (i, (&count, p)) in counts.iter().zip(&probabilities).enumerate() {
            let share = count as f64 / draws as f64;
            // Four standard deviations of a binomial share.
            let tolerance = 4.0 * (p * (1.0 - p) / draws as f64).sqrt();
            assert!((share - p).abs() <= tolerance, "candidate {i}: drawn {share}, probability {p}");
        }
        // A candidate with probability 0 is never drawn.
        assert!((0..1000).all(|s| sample_path(1, 0, s, Draw::Train, &[0.5, 0.0, 0.5]) != 1));
    }

    #[test]
    fn architecture_steps_start_after_the_warmup_and_repeat() {
        let settings = SinglePath { arch_every: 5, warmup: 0.25, arch_lr: 1e-3 };
        let steps: Vec<usize> = (0..40).filter(|&s| settings.arch_step_at(s, 40).is_some()).collect();
        assert_eq!(steps, [10, 15, 20, 25, 30, 35]);
        assert_eq!(settings.arch_steps(40), steps.len());
        assert_eq!(settings.arch_step_at(20, 40), Some(2));
        let never = SinglePath { warmup: 1.0, ..settings };
        assert_eq!(never.arch_steps(40), 0);
        assert!((0..40).all(|s| never.arch_step_at(s, 40).is_none()));
    }
}
