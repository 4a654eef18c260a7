//! `losses.png`: each block's loss over the optimizer steps (a log axis for
//! the blocks trained on the MSE, a linear one for the soft-target
//! cross-entropy of a logits head), the stitched student's output loss in a
//! panel of its own when the stitched pass has one (the loss that pass
//! minimises), the learning rate beneath, the epochs and the stitched pass
//! marked. With many blocks (a 30-layer LLM) the few worst are named in
//! distinct colours and the rest drawn in grey. Everything drawn comes from
//! `metrics.csv`, so a resumed run draws the steps it logged.

use std::collections::BTreeMap;
use std::path::Path;

use pipebd_core::LossKind;
use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{picture_error, register_font, short_number};
use pipe_bd::error::Result;
use pipe_bd::train::MetricRow;

/// Size of `losses.png` in pixels.
pub const LOSSES_SIZE: (u32, u32) = (1280, 900);

/// One block's logged series.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockCurve {
    /// One-based block.
    pub block: usize,
    /// What it was trained on, when known (the run's report).
    pub kind: Option<LossKind>,
    /// `(step, loss)` in step order: the blockwise steps, then the
    /// stitched pass's.
    pub losses: Vec<(usize, f32)>,
    /// `(step, learning rate)` at the same steps.
    pub lrs: Vec<(usize, f64)>,
}

/// The series `losses.png` draws.
#[derive(Debug, Clone, PartialEq)]
pub struct LossCurves {
    /// Per block, in block order.
    pub blocks: Vec<BlockCurve>,
    /// The first logged step of every epoch after a part's first (of the
    /// blockwise epochs and of the stitched pass's).
    pub epoch_starts: Vec<usize>,
    /// The step the stitched pass starts at, when its rows are there.
    pub stitched_from: Option<usize>,
    /// The stitched student's output loss `(step, loss)` (metrics.csv's
    /// block 0), when the stitched pass has one.
    pub output: Vec<(usize, f32)>,
}

impl LossCurves {
    /// The curves of `rows` (metrics.csv). `kinds[k]` is block `k + 1`'s
    /// loss where known; `blockwise_steps`, for a run with a stitched pass,
    /// is where its rows begin (they continue the step count).
    pub fn from_rows(rows: &[MetricRow], kinds: &[Option<LossKind>], blockwise_steps: Option<usize>) -> Self {
        let mut by_block: BTreeMap<usize, Vec<&MetricRow>> = BTreeMap::new();
        for row in rows {
            by_block.entry(row.block).or_default().push(row);
        }
        let mut output: Vec<(usize, f32)> =
            by_block.remove(&0).unwrap_or_default().iter().map(|r| (r.step, r.loss)).collect();
        output.sort_by_key(|p| p.0);
        let blocks = by_block
            .into_iter()
            .map(|(block, mut rows)| {
                rows.sort_by_key(|r| r.step);
                BlockCurve {
                    block,
                    kind: kinds.get(block.wrapping_sub(1)).copied().flatten(),
                    losses: rows.iter().map(|r| (r.step, r.loss)).collect(),
                    lrs: rows.iter().map(|r| (r.step, r.lr)).collect(),
                }
            })
            .collect();
        let stitched_from = blockwise_steps.filter(|&from| rows.iter().any(|r| r.step >= from));
        let stitched = |step: usize| stitched_from.is_some_and(|from| step >= from);
        // Epoch of every logged step, in step order.
        let epochs: BTreeMap<usize, usize> = rows.iter().map(|r| (r.step, r.epoch)).collect();
        let epoch_starts = epochs
            .iter()
            .zip(epochs.iter().skip(1))
            .filter(|(before, after)| before.1 != after.1 && stitched(*before.0) == stitched(*after.0))
            .map(|(_, after)| *after.0)
            .collect();
        Self { blocks, epoch_starts, stitched_from, output }
    }

    fn last_step(&self) -> usize {
        self.blocks.iter().filter_map(|b| b.losses.last()).map(|p| p.0).max().unwrap_or(0)
    }
}

/// Blocks named in a colour of their own and in the legend: a run with more
/// (a 30-layer LLM) names its worst by their last loss and draws the rest
/// in grey, so that no two named blocks share a colour.
pub const MOST_NAMED_BLOCKS: usize = 8;

/// The named blocks' colours, all distinct (Tableau's ten).
const NAMED_COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The unnamed blocks' colour.
const OTHER_BLOCKS: RGBColor = RGBColor(200, 200, 200);

/// The output loss's colour (it has a panel of its own).
const OUTPUT_COLOR: RGBColor = RGBColor(0, 0, 0);

/// The blocks `losses.png` names, in block order: every block when there
/// are at most [`MOST_NAMED_BLOCKS`], else those with the highest last loss.
pub fn named_blocks(curves: &LossCurves) -> Vec<usize> {
    let last = |c: &BlockCurve| c.losses.iter().rev().map(|p| p.1).find(|l| l.is_finite()).unwrap_or(0.0);
    let mut ranked: Vec<(f32, usize)> = curves.blocks.iter().map(|c| (last(c), c.block)).collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut named: Vec<usize> = ranked.into_iter().take(MOST_NAMED_BLOCKS).map(|(_, block)| block).collect();
    named.sort_unstable();
    named
}

/// How each series is drawn: a named block's colour (distinct among the
/// named), grey for the rest; the same block looks the same in every panel.
pub struct Looks {
    named: BTreeMap<usize, RGBColor>,
    others: usize,
}

impl Looks {
    /// The looks of `curves`' blocks.
    pub fn of(curves: &LossCurves) -> Self {
        let named: BTreeMap<usize, RGBColor> = named_blocks(curves)
            .into_iter()
            .enumerate()
            .map(|(i, block)| (block, NAMED_COLORS[i % NAMED_COLORS.len()]))
            .collect();
        Self { others: curves.blocks.len() - named.len(), named }
    }

    /// Block `block`'s colour, and its legend label when it is named
    /// (block 0: the stitched student's output).
    pub fn of_block(&self, block: usize) -> (RGBColor, Option<String>) {
        match (block, self.named.get(&block)) {
            (0, _) => (OUTPUT_COLOR, Some("stitched student's output".into())),
            (_, Some(&color)) => (color, Some(format!("block {block}"))),
            (_, None) => (OTHER_BLOCKS, None),
        }
    }
}

/// A vertical mark across a panel: an epoch's start or the stitched pass's.
struct Mark {
    step: f64,
    label: String,
    color: RGBAColor,
}

/// One panel of the picture: its series and axes.
struct Panel<'c> {
    caption: &'c str,
    y_desc: &'c str,
    /// `(block, points)`: the colour is the block's.
    series: Vec<(usize, Vec<(f64, f64)>)>,
    legend: bool,
}

/// Draws `losses.png` at `path` from `curves`, titled `title`.
pub fn draw_losses(path: &Path, curves: &LossCurves, title: &str) -> Result<()> {
    let fail = picture_error(path);
    register_font().map_err(&fail)?;
    let looks = Looks::of(curves);
    let points = |curve: &BlockCurve| -> Vec<(f64, f64)> {
        curve.losses.iter().map(|&(s, l)| (s as f64, l as f64)).filter(|p| p.1.is_finite()).collect()
    };
    let is_cross_entropy = |c: &&BlockCurve| c.kind == Some(LossKind::SoftTargetCrossEntropy);
    let log_blocks: Vec<(usize, Vec<(f64, f64)>)> = curves
        .blocks
        .iter()
        .filter(|c| !is_cross_entropy(c))
        .map(|c| (c.block, points(c).into_iter().filter(|p| p.1 > 0.0).collect()))
        .collect();
    let ce_blocks: Vec<(usize, Vec<(f64, f64)>)> =
        curves.blocks.iter().filter(is_cross_entropy).map(|c| (c.block, points(c))).collect();
    let output: Vec<(usize, Vec<(f64, f64)>)> = if curves.output.is_empty() {
        Vec::new()
    } else {
        vec![(
            0,
            curves.output.iter().map(|&(s, l)| (s as f64, l as f64)).filter(|p| p.1.is_finite()).collect(),
        )]
    };
    // One learning-rate line per distinct schedule (usually one for all).
    let mut lrs: Vec<(usize, Vec<(f64, f64)>)> = Vec::new();
    for c in &curves.blocks {
        let line: Vec<(f64, f64)> = c.lrs.iter().map(|&(s, lr)| (s as f64, lr)).collect();
        if !lrs.iter().any(|(_, l)| *l == line) {
            lrs.push((c.block, line));
        }
    }
    let marks = marks_of(curves);
    let x_max = (curves.last_step() as f64).max(1.0);

    let root = BitMapBackend::new(path, LOSSES_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let root = root.titled(title, ("sans-serif", 24)).map_err(|e| fail(e.to_string()))?;
    let height = root.dim_in_pixel().1 as i32;
    let (losses_area, lr_area) = root.split_vertically(height * 3 / 4);
    let panels = [
        (!output.is_empty()).then(|| Panel {
            caption: "stitched student's output loss (what the stitched pass minimises)",
            y_desc: "output loss",
            series: output,
            legend: false,
        }),
        (!log_blocks.is_empty() || ce_blocks.is_empty()).then(|| Panel {
            caption: "block losses against the teacher (log scale)",
            y_desc: "loss (MSE)",
            series: log_blocks,
            legend: true,
        }),
        (!ce_blocks.is_empty()).then(|| Panel {
            caption: "head: soft-target cross-entropy",
            y_desc: "loss (soft CE)",
            series: ce_blocks,
            legend: true,
        }),
    ];
    let panels: Vec<Panel> = panels.into_iter().flatten().collect();
    for (area, panel) in losses_area.split_evenly((panels.len(), 1)).iter().zip(&panels) {
        // Losses fall over decades: a log axis keeps the later steps
        // visible, wherever every value is positive.
        let (lo, hi) = value_range(&panel.series);
        if lo > 0.0 {
            draw_panel(area, x_max, (lo / 1.5..hi * 1.5).log_scale(), panel, &marks, &looks)
                .map_err(&fail)?;
        } else {
            draw_panel(area, x_max, lo.min(0.0)..(hi * 1.1).max(1e-6), panel, &marks, &looks)
                .map_err(&fail)?;
        }
    }
    let (_, hi) = value_range(&lrs);
    let lr_legend = lrs.len() > 1;
    let panel = Panel { caption: "learning rate", y_desc: "lr", series: lrs, legend: lr_legend };
    draw_panel(&lr_area, x_max, 0.0..(hi * 1.1).max(1e-12), &panel, &marks, &looks).map_err(&fail)?;
    root.present().map_err(|e| fail(e.to_string()))
}

/// The epochs' starts and the stitched pass's, as marks.
fn marks_of(curves: &LossCurves) -> Vec<Mark> {
    let mut marks: Vec<Mark> = curves
        .epoch_starts
        .iter()
        .map(|&s| Mark {
            step: s as f64,
            label: "next epoch".into(),
            color: RGBColor(120, 120, 120).to_rgba(),
        })
        .collect();
    if let Some(from) = curves.stitched_from {
        marks.push(Mark { step: from as f64, label: "stitched pass".into(), color: BLACK.to_rgba() });
    }
    marks
}

/// Smallest and largest value of the series (1 and 1 when empty).
fn value_range(series: &[(usize, Vec<(f64, f64)>)]) -> (f64, f64) {
    let values = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo.is_finite() && hi.is_finite() {
        (lo, hi)
    } else {
        (1.0, 1.0)
    }
}

fn draw_panel<Y>(
    area: &DrawingArea<BitMapBackend, Shift>,
    x_max: f64,
    y_range: Y,
    panel: &Panel,
    marks: &[Mark],
    looks: &Looks,
) -> std::result::Result<(), String>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let mut chart = ChartBuilder::on(area)
        .caption(panel.caption, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max, y_range)
        .map_err(|e| e.to_string())?;
    let (y_lo, y_hi) = {
        let range = chart.y_range();
        (range.start, range.end)
    };
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc(panel.y_desc)
        .x_labels(12)
        .y_labels(6)
        .x_label_formatter(&|v| short_number(*v))
        .y_label_formatter(&|v| short_number(*v))
        .draw()
        .map_err(|e| e.to_string())?;
    for mark in marks {
        let line = vec![(mark.step, y_lo), (mark.step, y_hi)];
        chart.draw_series(LineSeries::new(line, mark.color.stroke_width(1))).map_err(|e| e.to_string())?;
        // The label just right of the line, below the top edge.
        let label = EmptyElement::at((mark.step, y_hi))
            + Text::new(mark.label.clone(), (4, 2), ("sans-serif", 13).into_font().color(&mark.color));
        chart.draw_series(std::iter::once(label)).map_err(|e| e.to_string())?;
    }
    // The grey blocks first, so that the named ones are drawn over them.
    let mut series: Vec<&(usize, Vec<(f64, f64)>)> = panel.series.iter().collect();
    series.sort_by_key(|(block, _)| looks.of_block(*block).1.is_some());
    let mut others_labelled = false;
    for (block, points) in series {
        let (color, label) = looks.of_block(*block);
        let width = if label.is_some() { 2 } else { 1 };
        let drawn = chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(width)))
            .map_err(|e| e.to_string())?;
        let label = match label {
            Some(label) => Some(label),
            None if !others_labelled && looks.others > 0 => {
                others_labelled = true;
                Some(format!("{} other blocks", looks.others))
            }
            None => None,
        };
        if let (true, Some(label)) = (panel.legend, label) {
            drawn
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
    }
    if panel.legend && !panel.series.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(epoch: usize, step: usize, block: usize, loss: f32) -> MetricRow {
        MetricRow { epoch, step, block, loss, lr: 1e-3 }
    }

    #[test]
    fn curves_follow_the_rows_and_mark_epochs_and_the_stitched_pass() {
        // Two blocks, two blockwise epochs of 4 steps logged every 2, then a
        // stitched pass of one epoch (its epoch count starts again at 0).
        let mut rows = Vec::new();
        for (epoch, step) in [(0, 0), (0, 2), (1, 4), (1, 6), (0, 8), (0, 9)] {
            for block in [1, 2] {
                rows.push(row(epoch, step, block, (10 + step * block) as f32));
            }
        }
        let kinds = [Some(LossKind::Mse), Some(LossKind::SoftTargetCrossEntropy)];
        let curves = LossCurves::from_rows(&rows, &kinds, Some(8));
        assert_eq!(curves.blocks.len(), 2);
        assert_eq!(curves.blocks[1].kind, Some(LossKind::SoftTargetCrossEntropy));
        assert_eq!(
            curves.blocks[0].losses,
            vec![(0, 10.0), (2, 12.0), (4, 14.0), (6, 16.0), (8, 18.0), (9, 19.0)]
        );
        assert_eq!(curves.epoch_starts, vec![4], "the stitched pass's epoch 0 is not an epoch boundary");
        assert_eq!(curves.stitched_from, Some(8));
        // Without a stitched pass in the report, nothing is marked as one.
        let curves = LossCurves::from_rows(&rows[..8], &[], None);
        assert_eq!((curves.stitched_from, curves.blocks[0].kind), (None, None));
    }

    /// A 30-block run with a stitched output loss (what
    /// `experiments/smollm2-chosen.toml` draws): the output loss has its own
    /// curve, at most MOST_NAMED_BLOCKS blocks are named (the worst by their
    /// last loss), each in a colour no other named block has, the rest grey.
    #[test]
    fn a_thirty_block_run_names_its_worst_blocks_and_draws_its_output_loss() {
        let mut rows = Vec::new();
        for step in 0..20 {
            for block in 1..=30 {
                // Block b ends at loss b % 11 + 1: the worst end at 11, 10, ...
                let last = (block % 11 + 1) as f32;
                rows.push(row(0, step, block, last * (1.0 + (20 - step) as f32)));
            }
            rows.push(row(0, step, 0, 5.0 / (1 + step) as f32));
        }
        let curves = LossCurves::from_rows(&rows, &[], None);
        assert_eq!(curves.blocks.len(), 30, "block 0 is not a block");
        assert_eq!(curves.output.len(), 20);
        assert_eq!(curves.output[0], (0, 5.0));
        let named = named_blocks(&curves);
        assert_eq!(named.len(), MOST_NAMED_BLOCKS);
        // Ends at 11: blocks 10, 21; at 10: 9, 20; at 9: 8, 19, 30; at 8: 7 (of 7, 18, 29).
        assert_eq!(named, vec![7, 8, 9, 10, 19, 20, 21, 30]);
        let looks = Looks::of(&curves);
        let colors: std::collections::BTreeSet<(u8, u8, u8)> =
            named.iter().map(|&b| looks.of_block(b).0).map(|c| (c.0, c.1, c.2)).collect();
        assert_eq!(colors.len(), named.len(), "every named block has its own colour");
        assert_eq!(looks.of_block(1), (OTHER_BLOCKS, None), "an unnamed block is grey, without a label");
        assert!(looks.of_block(0).1.is_some(), "the output loss is labelled");
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("losses.png");
        draw_losses(&png, &curves, "thirty blocks").unwrap();
        assert!(std::fs::metadata(&png).unwrap().len() > 1000);
    }

    #[test]
    fn a_run_with_few_blocks_names_them_all() {
        let rows: Vec<MetricRow> = (1..=4).map(|b| row(0, 0, b, b as f32)).collect();
        let curves = LossCurves::from_rows(&rows, &[], None);
        assert_eq!(named_blocks(&curves), vec![1, 2, 3, 4]);
        assert!(curves.output.is_empty());
    }
}
