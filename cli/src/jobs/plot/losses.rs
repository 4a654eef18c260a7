//! `losses.png`: each block's loss over the optimizer steps (a log axis for
//! the blocks trained on the MSE, a linear one for the soft-target
//! cross-entropy of a logits head), the learning rate beneath, the epochs
//! and the stitched pass marked. Everything drawn comes from `metrics.csv`,
//! so a resumed run draws the steps it logged.

use std::collections::BTreeMap;
use std::path::Path;

use pipebd_core::LossKind;
use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{picture_error, register_font, series_color, short_number};
use pipe_bd::error::{Error, Result};
use pipe_bd::train::MetricRow;

/// Size of `losses.png` in pixels.
pub const LOSSES_SIZE: (u32, u32) = (1280, 900);

/// Reads `metrics.csv` (`epoch,step,block,loss,lr`, as `pipebd run`
/// writes it); the error names the line that is not such a row.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricRow>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))?;
    let mut lines = text.lines().enumerate();
    let header = lines.next().map(|(_, h)| h.trim());
    if header != Some("epoch,step,block,loss,lr") {
        return Err(Error::Data {
            path: path.to_path_buf(),
            message: format!("expected the header `epoch,step,block,loss,lr`, found {header:?}"),
        });
    }
    let mut rows = Vec::new();
    for (i, line) in lines.filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |what: &str| Error::Data {
            path: path.to_path_buf(),
            message: format!("line {}: {what} in `{line}`", i + 1),
        };
        let fields: Vec<&str> = line.trim().split(',').collect();
        let [epoch, step, block, loss, lr] = fields[..] else {
            return Err(bad("expected 5 comma-separated fields"));
        };
        rows.push(MetricRow {
            epoch: epoch.parse().map_err(|_| bad("the epoch is not a whole number"))?,
            step: step.parse().map_err(|_| bad("the step is not a whole number"))?,
            block: block.parse().map_err(|_| bad("the block is not a whole number"))?,
            loss: loss.parse().map_err(|_| bad("the loss is not a number"))?,
            lr: lr.parse().map_err(|_| bad("the learning rate is not a number"))?,
        });
    }
    if rows.is_empty() {
        return Err(Error::Data { path: path.to_path_buf(), message: "no rows: nothing was logged".into() });
    }
    Ok(rows)
}

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
        Self { blocks, epoch_starts, stitched_from }
    }

    fn last_step(&self) -> usize {
        self.blocks.iter().filter_map(|b| b.losses.last()).map(|p| p.0).max().unwrap_or(0)
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
    // One learning-rate line per distinct schedule (usually one for all).
    let mut lrs: Vec<(usize, Vec<(f64, f64)>)> = Vec::new();
    for c in &curves.blocks {
        let line: Vec<(f64, f64)> = c.lrs.iter().map(|&(s, lr)| (s as f64, lr)).collect();
        if !lrs.iter().any(|(_, l)| *l == line) {
            lrs.push((c.block, line));
        }
    }
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
    let x_max = (curves.last_step() as f64).max(1.0);

    let root = BitMapBackend::new(path, LOSSES_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let root = root.titled(title, ("sans-serif", 24)).map_err(|e| fail(e.to_string()))?;
    let height = root.dim_in_pixel().1 as i32;
    let (losses_area, lr_area) = root.split_vertically(height * 3 / 4);
    let (log_area, ce_area) = match (log_blocks.is_empty(), ce_blocks.is_empty()) {
        (false, false) => {
            let (a, b) = losses_area.split_vertically(losses_area.dim_in_pixel().1 * 3 / 5);
            (Some(a), Some(b))
        }
        (true, false) => (None, Some(losses_area)),
        _ => (Some(losses_area), None),
    };
    if let Some(area) = log_area {
        let (lo, hi) = value_range(&log_blocks);
        let panel = Panel {
            caption: "block losses against the teacher (log scale)",
            y_desc: "loss (MSE)",
            series: log_blocks,
            legend: true,
        };
        draw_panel(&area, x_max, (lo / 1.5..hi * 1.5).log_scale(), &panel, &marks).map_err(&fail)?;
    }
    if let Some(area) = ce_area {
        // Distilled logits come close to the teacher's within a few hundred
        // steps: on a log axis the rest of the curve stays visible.
        let (lo, hi) = value_range(&ce_blocks);
        let positive = lo > 0.0;
        let panel = Panel {
            caption: if positive {
                "head: soft-target cross-entropy (log scale)"
            } else {
                "head: soft-target cross-entropy"
            },
            y_desc: "loss (soft CE)",
            series: ce_blocks,
            legend: true,
        };
        if positive {
            draw_panel(&area, x_max, (lo / 1.5..hi * 1.5).log_scale(), &panel, &marks).map_err(&fail)?;
        } else {
            draw_panel(&area, x_max, lo.min(0.0)..(hi * 1.1).max(1e-6), &panel, &marks).map_err(&fail)?;
        }
    }
    let (_, hi) = value_range(&lrs);
    let lr_legend = lrs.len() > 1;
    let panel = Panel { caption: "learning rate", y_desc: "lr", series: lrs, legend: lr_legend };
    draw_panel(&lr_area, x_max, 0.0..(hi * 1.1).max(1e-12), &panel, &marks).map_err(&fail)?;
    root.present().map_err(|e| fail(e.to_string()))
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
    for (block, points) in &panel.series {
        let color = series_color(block - 1);
        let series = chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        if panel.legend {
            series
                .label(format!("block {block}"))
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

    #[test]
    fn a_bad_metrics_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.csv");
        std::fs::write(&path, "epoch,step,block,loss,lr\n0,0,1,0.5,0.001\n0,1,x,0.4,0.001\n").unwrap();
        let error = read_metrics(&path).unwrap_err().to_string();
        assert!(error.contains("line 3") && error.contains("block"), "{error}");
    }
}
