//! Blockwise architecture search: choosing one trained candidate student per
//! block under a budget.
//!
//! Every block's candidates are scored on their own (held-out loss against
//! the teacher block, FLOPs, parameters, latency), and a student is one
//! candidate per block, so its loss and its cost are sums over blocks. The
//! choice is then a multiple-choice knapsack: minimise the summed loss with
//! the summed cost within a budget. [`select`] solves it exactly for any
//! real-valued costs by keeping, block by block, the Pareto frontier of
//! partial choices (no kept partial choice is both costlier and worse than
//! another); [`pareto_front`] gives the optimum of every budget at once.

pub mod score;

use crate::error::{Error, Result};

/// One candidate of one block, as the selection sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// What to minimise (lower is better), e.g. the held-out block loss
    /// divided by that of the block's reference candidate.
    pub loss: f64,
    /// What the budget bounds: FLOPs, parameters or seconds per step.
    pub cost: f64,
}

/// One candidate index per block, with the summed loss and cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The chosen candidate of each block (an index into that block's list).
    pub choice: Vec<usize>,
    /// The summed loss of the chosen candidates.
    pub loss: f64,
    /// The summed cost of the chosen candidates.
    pub cost: f64,
}

/// Checks that every block has candidates and every value is finite (and
/// every cost non-negative).
fn check(blocks: &[Vec<Candidate>]) -> Result<()> {
    let bad = |message: String| Err(Error::Search { message });
    if blocks.is_empty() {
        return bad("no blocks to choose candidates for".into());
    }
    for (b, candidates) in blocks.iter().enumerate() {
        if candidates.is_empty() {
            return bad(format!("block {} has no candidates", b + 1));
        }
        for (c, candidate) in candidates.iter().enumerate() {
            if !candidate.loss.is_finite() || !candidate.cost.is_finite() || candidate.cost < 0.0 {
                return bad(format!(
                    "block {} candidate {}: loss {} and cost {} (expected finite numbers, the cost >= 0)",
                    b + 1,
                    c + 1,
                    candidate.loss,
                    candidate.cost
                ));
            }
        }
    }
    Ok(())
}

/// The Pareto frontier of complete choices: sorted by cost, each strictly
/// lower in loss than every cheaper one. `cost_cap` drops any partial choice
/// that cannot be completed within it (`f64::INFINITY`: keep all).
fn frontier(blocks: &[Vec<Candidate>], cost_cap: f64) -> Vec<Selection> {
    // The cheapest possible cost of the blocks after each one.
    let mut cheapest_rest = vec![0.0; blocks.len() + 1];
    for b in (0..blocks.len()).rev() {
        let cheapest = blocks[b].iter().map(|c| c.cost).fold(f64::INFINITY, f64::min);
        cheapest_rest[b] = cheapest_rest[b + 1] + cheapest;
    }
    let mut partial = vec![Selection { choice: Vec::new(), loss: 0.0, cost: 0.0 }];
    for (b, candidates) in blocks.iter().enumerate() {
        let mut grown: Vec<Selection> = partial
            .iter()
            .flat_map(|p| {
                candidates.iter().enumerate().map(move |(i, c)| Selection {
                    choice: p.choice.iter().copied().chain([i]).collect(),
                    loss: p.loss + c.loss,
                    cost: p.cost + c.cost,
                })
            })
            // A hair of slack: the completed sum may round below the cap.
            .filter(|s| s.cost + cheapest_rest[b + 1] <= cost_cap + cost_cap.abs() * 1e-12)
            .collect();
        // Cheapest first; at equal cost the lower loss, then the smaller
        // choice, so the kept one is the same on every run.
        grown.sort_by(|a, b| {
            a.cost.total_cmp(&b.cost).then(a.loss.total_cmp(&b.loss)).then_with(|| a.choice.cmp(&b.choice))
        });
        partial.clear();
        for s in grown {
            if partial.last().is_none_or(|kept| s.loss < kept.loss) {
                partial.push(s);
            }
        }
    }
    partial
}

/// The choice with the lowest summed loss among those whose summed cost is
/// at most `budget` (ties: the cheaper, then the smaller indices); `None`
/// when even the cheapest choice is over the budget.
///
/// Fails naming the block and candidate when a block has no candidates or a
/// loss or cost is not a finite number (or a cost is negative).
pub fn select(blocks: &[Vec<Candidate>], budget: f64) -> Result<Option<Selection>> {
    check(blocks)?;
    // The frontier is sorted by cost with falling loss: its last element
    // within the budget is the optimum.
    Ok(frontier(blocks, budget).into_iter().rfind(|s| s.cost <= budget))
}

/// The optimum of every budget: the Pareto frontier of complete choices,
/// cheapest first, each with a strictly lower loss than every cheaper one.
pub fn pareto_front(blocks: &[Vec<Candidate>]) -> Result<Vec<Selection>> {
    check(blocks)?;
    Ok(frontier(blocks, f64::INFINITY))
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Every choice, by enumeration.
    fn brute_force(blocks: &[Vec<Candidate>], budget: f64) -> Option<(f64, f64)> {
        let mut best: Option<(f64, f64)> = None;
        let mut choice = vec![0usize; blocks.len()];
        loop {
            let loss: f64 = choice.iter().zip(blocks).map(|(i, b)| b[*i].loss).sum();
            let cost: f64 = choice.iter().zip(blocks).map(|(i, b)| b[*i].cost).sum();
            let better = best.is_none_or(|(l, c)| loss < l || (loss == l && cost < c));
            if cost <= budget && better {
                best = Some((loss, cost));
            }
            // The next choice, as an odometer.
            let mut b = 0;
            loop {
                if b == blocks.len() {
                    return best;
                }
                choice[b] += 1;
                if choice[b] < blocks[b].len() {
                    break;
                }
                choice[b] = 0;
                b += 1;
            }
        }
    }

    fn random_blocks(rng: &mut StdRng) -> Vec<Vec<Candidate>> {
        let blocks = rng.random_range(1..=4);
        (0..blocks)
            .map(|_| {
                let candidates = rng.random_range(1..=5);
                (0..candidates)
                    .map(|_| Candidate {
                        // Small integers give ties in loss and in cost.
                        loss: rng.random_range(0..6) as f64 * 0.5,
                        cost: rng.random_range(0..8) as f64,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn select_equals_brute_force_on_small_instances() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..2000 {
            let blocks = random_blocks(&mut rng);
            let budget = rng.random_range(0..24) as f64;
            let got = select(&blocks, budget).unwrap();
            let expected = brute_force(&blocks, budget);
            assert_eq!(got.as_ref().map(|s| (s.loss, s.cost)), expected, "{blocks:?} within {budget}");
            if let Some(s) = got {
                let loss: f64 = s.choice.iter().zip(&blocks).map(|(i, b)| b[*i].loss).sum();
                let cost: f64 = s.choice.iter().zip(&blocks).map(|(i, b)| b[*i].cost).sum();
                assert_eq!((loss, cost), (s.loss, s.cost), "the choice adds up to what it reports");
            }
        }
    }

    #[test]
    fn the_front_holds_the_optimum_of_every_budget() {
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..300 {
            let blocks = random_blocks(&mut rng);
            let front = pareto_front(&blocks).unwrap();
            assert!(front.windows(2).all(|w| w[0].cost < w[1].cost && w[0].loss > w[1].loss), "{front:?}");
            for budget in 0..24 {
                let budget = budget as f64;
                let best = front.iter().rfind(|s| s.cost <= budget).map(|s| (s.loss, s.cost));
                assert_eq!(best, brute_force(&blocks, budget), "{blocks:?} within {budget}");
            }
        }
    }

    #[test]
    fn bad_input_names_the_block_and_candidate() {
        let ok = Candidate { loss: 1.0, cost: 1.0 };
        let nan = Candidate { loss: f64::NAN, cost: 1.0 };
        let message = select(&[vec![ok], vec![ok, nan]], 5.0).unwrap_err().to_string();
        assert!(message.contains("block 2 candidate 2"), "{message}");
        let message = select(&[vec![ok], vec![]], 5.0).unwrap_err().to_string();
        assert!(message.contains("block 2 has no candidates"), "{message}");
        assert!(select(&[], 5.0).is_err());
        assert_eq!(select(&[vec![ok], vec![ok]], 1.5).unwrap(), None, "over budget");
    }
}
