//! The last step of blockwise architecture search (`pipebd search`): the
//! scores a search run wrote (`search.json`), one candidate per block chosen
//! under a budget (`chosen.toml`, an ordinary run config that starts from
//! the trained candidates), and the optimum of every budget (`pareto.csv`,
//! `pareto.png`), optionally scored as stitched students.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use pipe_bd::error::{Error, Result};
use pipe_bd::search::score::BlockScores;
use pipe_bd::search::{pareto_front, select, Candidate, Selection};

/// What a search run writes as `search.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchScores {
    /// The run's config (the base of `chosen.toml`).
    pub config: RunConfig,
    /// Held-out samples the losses are means over.
    pub held_out_samples: usize,
    /// Batch size of the latency measurements.
    pub batch_size: usize,
    /// Per block.
    pub blocks: Vec<BlockScores>,
}

/// File name of the scores in a run folder.
pub const SCORES_FILE: &str = "search.json";

impl SearchScores {
    /// Writes `search.json` and `search.csv` into `run_dir`.
    pub fn write(&self, run_dir: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Search { message: format!("cannot write the scores as JSON: {e}") })?;
        pipe_bd::fsio::write_atomic(&run_dir.join(SCORES_FILE), json.as_bytes())?;
        let header = [
            "block",
            "candidate",
            "name",
            "loss",
            "normalised_loss",
            "output_loss",
            "flops",
            "params",
            "latency_ms",
            "probability",
        ];
        let cell = |v: Option<f64>| v.map(|v| v.to_string()).unwrap_or_default();
        let rows = self.blocks.iter().flat_map(|block| {
            block.candidates.iter().map(move |c| {
                vec![
                    block.block.to_string(),
                    c.candidate.to_string(),
                    c.name.clone(),
                    c.loss.to_string(),
                    c.normalised_loss.to_string(),
                    cell(c.output_loss),
                    c.flops.to_string(),
                    c.params.to_string(),
                    c.latency_ms.to_string(),
                    cell(c.probability),
                ]
            })
        });
        crate::metrics::write_table(&run_dir.join("search.csv"), &header, rows)
    }

    /// Reads `search.json` from a run folder (or the file itself).
    pub fn read(path: &Path) -> Result<Self> {
        let file = if path.is_dir() { path.join(SCORES_FILE) } else { path.to_path_buf() };
        let text = std::fs::read_to_string(&file).map_err(|e| {
            Error::io(
                "reading the search scores (written by `pipebd run` of a config with candidates)",
                &file,
                e,
            )
        })?;
        serde_json::from_str(&text).map_err(|e| Error::Search {
            message: format!("{}: not the scores of a search run: {e}", file.display()),
        })
    }
}

/// What a budget bounds: the chosen student's summed forward FLOPs per
/// sample, its parameters, or its summed forward latency per batch (ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CostKind {
    /// Forward FLOPs per sample.
    Flops,
    /// Trainable parameters.
    Params,
    /// Forward milliseconds per batch, as measured by the search run.
    Latency,
}

impl CostKind {
    /// The name as written in `--budget` and `--by`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Flops => "flops",
            Self::Params => "params",
            Self::Latency => "latency",
        }
    }

    /// Parses `flops`, `params` or `latency`.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "flops" => Ok(Self::Flops),
            "params" => Ok(Self::Params),
            "latency" => Ok(Self::Latency),
            other => Err(Error::Search {
                message: format!("unknown cost `{other}`: expected flops, params or latency"),
            }),
        }
    }

    fn of(self, c: &pipe_bd::search::score::CandidateScore) -> f64 {
        match self {
            Self::Flops => c.flops as f64,
            Self::Params => c.params as f64,
            Self::Latency => c.latency_ms,
        }
    }
}

/// What the selection minimises, summed over blocks (`--objective`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Objective {
    /// Each candidate's held-out loss against its own teacher block, over
    /// the best of its block's (`normalised_loss`): DNA's ranking.
    #[default]
    Block,
    /// Each candidate's replace-one-block output loss (`output_loss`):
    /// Puzzle's score, what the candidate's error does to the final output.
    /// Comparable across blocks, so a budget goes where it matters most.
    Output,
}

impl Objective {
    /// The name as written in `--objective`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Block => "block",
            Self::Output => "output",
        }
    }

    /// Parses `block` or `output`.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "block" => Ok(Self::Block),
            "output" => Ok(Self::Output),
            other => Err(Error::Search {
                message: format!("unknown objective `{other}`: expected block or output"),
            }),
        }
    }

    /// What it sums, in words.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Block => "summed normalised held-out block loss",
            Self::Output => "summed replace-one-block output loss",
        }
    }
}

/// A bound on one cost: `flops=2.5e6`, `params=40000`, `latency=3.5`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// What is bounded.
    pub kind: CostKind,
    /// The largest allowed sum over blocks.
    pub limit: f64,
}

impl std::str::FromStr for Budget {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |why: &str| Error::Search {
            message: format!(
                "budget `{text}`: {why}; expected flops=N, params=N or latency=MS (e.g. flops=2.5e6)"
            ),
        };
        let (kind, limit) = text.split_once('=').ok_or_else(|| bad("no `=`"))?;
        let kind = CostKind::parse(kind).map_err(|_| bad("unknown cost"))?;
        let limit: f64 = limit.trim().parse().map_err(|_| bad("the limit is not a number"))?;
        if !(limit >= 0.0 && limit.is_finite()) {
            return Err(bad("the limit must be a finite number >= 0"));
        }
        Ok(Self { kind, limit })
    }
}

impl SearchScores {
    /// Every block's candidates as the selection sees them: the
    /// `objective`'s loss, and the cost `kind`. Fails when the scores lack
    /// the objective's loss (output losses are absent from older runs).
    pub fn candidates(&self, kind: CostKind, objective: Objective) -> Result<Vec<Vec<Candidate>>> {
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let mut candidates = Vec::with_capacity(b.candidates.len());
            for c in &b.candidates {
                candidates.push(Candidate { loss: objective_loss(b.block, c, objective)?, cost: kind.of(c) });
            }
            blocks.push(candidates);
        }
        Ok(blocks)
    }

    /// The student of one choice (zero-based candidate per block): its
    /// summed `objective` loss, FLOPs, parameters and latency.
    pub fn point(&self, choice: &[usize], objective: Objective) -> ParetoPoint {
        let mut point = ParetoPoint {
            choice: choice.iter().map(|c| (c + 1).to_string()).collect::<Vec<_>>().join("-"),
            loss: 0.0,
            flops: 0,
            params: 0,
            latency_ms: 0.0,
            accuracy: None,
            perplexity: None,
            kl: None,
        };
        for (block, &c) in self.blocks.iter().zip(choice) {
            let candidate = &block.candidates[c];
            point.loss += objective_loss(block.block, candidate, objective).unwrap_or(f64::NAN);
            point.flops += candidate.flops;
            point.params += candidate.params;
            point.latency_ms += candidate.latency_ms;
        }
        point
    }

    /// The run config of one choice: the search run's, with each block's
    /// student the chosen candidate, starting from its trained weights in
    /// `run_dir`, at least one stitched epoch after the blockwise ones, and
    /// named `<name>-chosen`.
    pub fn chosen_config(&self, run_dir: &Path, choice: &[usize]) -> RunConfig {
        let mut config = self.config.clone();
        config.name = format!("{}-chosen", self.config.name);
        config.students = self
            .blocks
            .iter()
            .zip(choice)
            .map(|(block, &c)| {
                let candidate = &block.candidates[c];
                let mut table = toml_table(&candidate.table);
                let weights = run_dir.join(&candidate.weights);
                table.insert("weights".into(), toml::Value::String(weights.display().to_string()));
                table
            })
            .collect();
        config.search = Default::default();
        // Finetune, then the stitched pass: each block learns from the
        // blocks chosen before it (at least one epoch of it).
        config.train.stitched_epochs = config.train.stitched_epochs.max(1);
        config
    }
}

/// One candidate's loss under `objective` (`block` is its block's number).
fn objective_loss(
    block: usize,
    candidate: &pipe_bd::search::score::CandidateScore,
    objective: Objective,
) -> Result<f64> {
    match objective {
        Objective::Block => Ok(candidate.normalised_loss),
        Objective::Output => candidate.output_loss.ok_or_else(|| Error::Search {
            message: format!(
                "block {block} candidate {}: no output loss in the scores (a search run before \
                 replace-one-block scores were measured): rerun it, or `pipebd run <config> --resume <run>` \
                 to score it again, or choose with --objective block",
                candidate.candidate
            ),
        }),
    }
}

/// The optimum of one budget, and the config that trains it.
#[derive(Debug, Clone)]
pub struct Chosen {
    /// The chosen student: its candidates, loss, FLOPs, parameters, latency.
    pub point: ParetoPoint,
    /// The run config of the choice.
    pub config: RunConfig,
}

/// Picks one candidate per block of the search run in `run_dir` (whose
/// `scores` these are), minimising the summed `objective` loss within
/// `budget`.
pub fn choose(scores: &SearchScores, run_dir: &Path, budget: Budget, objective: Objective) -> Result<Chosen> {
    let blocks = scores.candidates(budget.kind, objective)?;
    let selection = select(&blocks, budget.limit)?.ok_or_else(|| {
        let cheapest: f64 =
            blocks.iter().map(|b| b.iter().map(|c| c.cost).fold(f64::INFINITY, f64::min)).sum();
        Error::Search {
            message: format!(
                "no student fits {}={}: the cheapest choice needs {}",
                budget.kind.name(),
                budget.limit,
                cheapest
            ),
        }
    })?;
    Ok(Chosen {
        point: scores.point(&selection.choice, objective),
        config: scores.chosen_config(run_dir, &selection.choice),
    })
}

/// The architecture a single-path search ends with: in each block the
/// candidate with the largest architecture weight (DNA's argmax path; a
/// block with one candidate keeps it).
pub fn argmax(scores: &SearchScores, run_dir: &Path) -> Result<Chosen> {
    let mut choice = Vec::with_capacity(scores.blocks.len());
    for block in &scores.blocks {
        if block.candidates.len() == 1 {
            choice.push(0);
            continue;
        }
        let mut best: Option<(usize, f64)> = None;
        for (c, candidate) in block.candidates.iter().enumerate() {
            let Some(p) = candidate.probability else {
                return Err(Error::Search {
                    message: format!(
                        "block {} has no architecture weights: --argmax needs a run with `[search] mode = \"single-path\"` \
                         (use --budget for mode `all`)",
                        block.block
                    ),
                });
            };
            if best.is_none_or(|(_, b)| p > b) {
                best = Some((c, p));
            }
        }
        choice.push(best.map_or(0, |(c, _)| c));
    }
    Ok(Chosen {
        point: scores.point(&choice, Objective::Block),
        config: scores.chosen_config(run_dir, &choice),
    })
}

/// One point of the Pareto front.
#[derive(Debug, Clone, Serialize)]
pub struct ParetoPoint {
    /// One-based candidate per block, e.g. `1-3-2-1`.
    pub choice: String,
    /// The summed objective loss (by default the normalised held-out block
    /// loss; see [`Objective`]).
    pub loss: f64,
    /// Summed forward FLOPs per sample.
    pub flops: u64,
    /// Summed parameters.
    pub params: usize,
    /// Summed forward latency per batch (ms).
    pub latency_ms: f64,
    /// Stitched accuracy of the trained candidates, not finetuned (when
    /// evaluated; text: the probe's; language models: top-1 agreement
    /// with the teacher).
    pub accuracy: Option<f64>,
    /// Language models, when evaluated: the stitched student's held-out
    /// perplexity (the score's figure `perplexity`, if its zoo gives one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
    /// Language models, when evaluated: its mean `KL(teacher || student)`
    /// per next token (the score's figure `kl`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
}

impl ParetoPoint {
    /// The point's cost of `kind`.
    pub fn cost(&self, kind: CostKind) -> f64 {
        match kind {
            CostKind::Flops => self.flops as f64,
            CostKind::Params => self.params as f64,
            CostKind::Latency => self.latency_ms,
        }
    }
}

/// The optimum of every budget on cost `kind`, cheapest first.
pub fn pareto(
    scores: &SearchScores,
    kind: CostKind,
    objective: Objective,
) -> Result<Vec<(Selection, ParetoPoint)>> {
    let front = pareto_front(&scores.candidates(kind, objective)?)?;
    Ok(front
        .into_iter()
        .map(|selection| {
            let point = scores.point(&selection.choice, objective);
            (selection, point)
        })
        .collect())
}

/// At most `points` (at least 2) of `front` (cheapest first), spread
/// evenly over its range of cost `kind`: for each of `points` evenly spaced
/// costs, the dearest point that costs no more (the cheapest and the
/// dearest point always kept, none twice).
pub fn thin_front(
    front: Vec<(Selection, ParetoPoint)>,
    kind: CostKind,
    points: usize,
) -> Vec<(Selection, ParetoPoint)> {
    let points = points.max(2);
    if front.len() <= points {
        return front;
    }
    let cost = |i: usize| front[i].1.cost(kind);
    let (low, high) = (cost(0), cost(front.len() - 1));
    let mut kept: Vec<usize> = (0..points)
        .map(|j| {
            let target = low + (high - low) * j as f64 / (points - 1) as f64;
            (0..front.len()).rev().find(|&i| cost(i) <= target + 1e-9 * high.abs()).unwrap_or(0)
        })
        .collect();
    kept.dedup();
    let mut taken = vec![false; front.len()];
    for &i in &kept {
        taken[i] = true;
    }
    front.into_iter().zip(taken).filter(|(_, keep)| *keep).map(|(point, _)| point).collect()
}

/// Writes `pareto.csv` into `dir`.
pub fn write_pareto_csv(dir: &Path, points: &[ParetoPoint]) -> Result<PathBuf> {
    let header = ["choice", "loss", "flops", "params", "latency_ms", "accuracy", "perplexity", "kl"];
    let cell = |v: Option<f64>| v.map(|a| a.to_string()).unwrap_or_default();
    let rows = points.iter().map(|p| {
        vec![
            p.choice.to_string(),
            p.loss.to_string(),
            p.flops.to_string(),
            p.params.to_string(),
            p.latency_ms.to_string(),
            cell(p.accuracy),
            cell(p.perplexity),
            cell(p.kl),
        ]
    });
    let path = dir.join("pareto.csv");
    crate::metrics::write_table(&path, &header, rows)?;
    Ok(path)
}

/// Writes the chosen config as TOML to `path`, with a header saying where
/// it came from.
/// `how` is the choosing flag as typed (`--budget flops=1000`, `--argmax`).
/// `objective` is what `chosen.point.loss` sums.
pub fn write_chosen(
    path: &Path,
    chosen: &Chosen,
    how: &str,
    run_dir: &Path,
    objective: Objective,
) -> Result<()> {
    let header = format!(
        "# Chosen by `pipebd search {} {how}` from that run's candidates:\n\
         # {} {:.4}, {} FLOPs per sample, {} parameters.\n\
         # `pipebd run` on this file finetunes the chosen candidates from their\n\
         # trained weights (each block's `weights`) for `train.epochs`, then trains\n\
         # them stitched for `train.stitched_epochs`, and evaluates the student.\n",
        run_dir.display(),
        objective.describe(),
        chosen.point.loss,
        chosen.point.flops,
        chosen.point.params,
    );
    let text = format!("{header}{}", chosen.config.to_toml());
    pipe_bd::fsio::write_atomic(path, text.as_bytes())
}

/// A candidate's table as `search.json` keeps it (a JSON object), back as
/// the TOML table it was configured as.
fn toml_table(object: &serde_json::Map<String, serde_json::Value>) -> toml::Table {
    object.iter().filter_map(|(key, value)| Some((key.clone(), toml::Value::try_from(value).ok()?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn front(costs: &[u64]) -> Vec<(Selection, ParetoPoint)> {
        costs
            .iter()
            .enumerate()
            .map(|(i, &flops)| {
                let selection = Selection { choice: vec![i], loss: 0.0, cost: flops as f64 };
                let point = ParetoPoint {
                    choice: i.to_string(),
                    loss: (costs.len() - i) as f64,
                    flops,
                    params: 0,
                    latency_ms: 0.0,
                    accuracy: None,
                    perplexity: None,
                    kl: None,
                };
                (selection, point)
            })
            .collect()
    }

    fn kept(points: &[(Selection, ParetoPoint)]) -> Vec<u64> {
        points.iter().map(|(_, p)| p.flops).collect()
    }

    #[test]
    fn a_thinned_front_spreads_over_the_costs() {
        let costs = [10, 11, 12, 13, 20, 30, 31, 40, 50];
        // Targets 10, 30, 50: the dearest point at or under each.
        assert_eq!(kept(&thin_front(front(&costs), CostKind::Flops, 3)), [10, 30, 50]);
        // Targets 10, 20, 30, 40, 50.
        assert_eq!(kept(&thin_front(front(&costs), CostKind::Flops, 5)), [10, 20, 30, 40, 50]);
        // A short front stays whole.
        assert_eq!(kept(&thin_front(front(&[10, 50]), CostKind::Flops, 3)), [10, 50]);
        assert_eq!(kept(&thin_front(front(&[10, 11, 50]), CostKind::Flops, 2)), [10, 50]);
        // Targets 10, 30, 50 over 10, 11, 12, 50: 30 falls back to 12.
        assert_eq!(kept(&thin_front(front(&[10, 11, 12, 50]), CostKind::Flops, 3)), [10, 12, 50]);
    }
}
