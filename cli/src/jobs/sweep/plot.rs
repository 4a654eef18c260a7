//! The sweep plot: throughput and speedup over `dp` against the swept axis.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use crate::jobs::plot::{picture_error, register_font, series_color, short_number};
use crate::jobs::sweep::Row;
use pipe_bd::error::Result;

/// What one panel shows and how.
struct Panel<'p> {
    caption: &'p str,
    x_desc: &'p str,
    y_desc: &'p str,
    /// Around the data (else from zero).
    zoom: bool,
    legend: SeriesLabelPosition,
    /// The x values that were run, when x positions are their indices:
    /// each tick is labelled with its value.
    x_values: Option<&'p [String]>,
}

/// Draws `sweep.png`: left, samples per second against `x` (one line per
/// combination of the other swept fields); right, speedup over the `dp`
/// point with the same other values (when the sweep has `schedule = dp`).
pub fn draw_sweep(path: &Path, rows: &[Row], keys: &[String], x: &str) -> Result<()> {
    let fail = picture_error(path);
    register_font().map_err(&fail)?;
    let xi =
        keys.iter().position(|k| k == x).ok_or_else(|| fail(format!("`x = {x}` is not a swept field")))?;
    let schedule = keys.iter().position(|k| k == "schedule");
    let x_values = run_values(rows.iter().map(|r| r.values[xi].as_str()));
    let position = |value: &str| x_values.iter().position(|v| v == value).unwrap_or(0) as f64;
    // Fields with one value across the sweep say nothing in a legend.
    let varies: Vec<bool> = (0..keys.len())
        .map(|i| rows.iter().any(|r| rows.first().is_some_and(|f| f.values[i] != r.values[i])))
        .collect();
    let label = |row: &Row| -> String {
        keys.iter()
            .zip(&row.values)
            .enumerate()
            .filter(|(i, _)| *i != xi && varies[*i])
            .map(|(_, (k, v))| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut throughput: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut speedup: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for row in rows {
        let px = position(&row.values[xi]);
        throughput.entry(label(row)).or_default().push((px, row.samples_per_second));
        if let Some(si) = schedule {
            let baseline = rows.iter().find(|r| {
                r.values[si] == pipebd_core::Schedule::Dp.name()
                    && r.values.iter().enumerate().all(|(i, v)| i == si || *v == row.values[i])
            });
            if let Some(dp) = baseline {
                speedup
                    .entry(label(row))
                    .or_default()
                    .push((px, row.samples_per_second / dp.samples_per_second));
            }
        }
    }
    for series in throughput.values_mut().chain(speedup.values_mut()) {
        series.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let root = BitMapBackend::new(path, (1280, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let (left, right) = root.split_horizontally(640);
    let spec = |caption, y_desc| Panel {
        caption,
        x_desc: x,
        y_desc,
        zoom: false,
        legend: SeriesLabelPosition::LowerRight,
        x_values: Some(&x_values),
    };
    panel(&left, &throughput, &spec("throughput", "samples / s")).map_err(&fail)?;
    if speedup.is_empty() {
        right
            .titled("(no dp points: no speedup panel)", ("sans-serif", 18))
            .map_err(|e| fail(e.to_string()))?;
    } else {
        panel(&right, &speedup, &spec("speedup over dp", "speedup over dp")).map_err(&fail)?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

/// The distinct values of the swept field in axis order: numerically when
/// they are all numbers, else as they first appear.
fn run_values<'v>(values: impl Iterator<Item = &'v str>) -> Vec<String> {
    let mut distinct: Vec<String> = Vec::new();
    for value in values {
        if !distinct.iter().any(|d| d == value) {
            distinct.push(value.to_string());
        }
    }
    let numbers: Option<Vec<f64>> = distinct.iter().map(|v| v.parse::<f64>().ok()).collect();
    if let Some(numbers) = numbers {
        let mut paired: Vec<(f64, String)> = numbers.into_iter().zip(distinct).collect();
        paired.sort_by(|a, b| a.0.total_cmp(&b.0));
        distinct = paired.into_iter().map(|p| p.1).collect();
    }
    distinct
}

/// The label of the tick at `position` on an axis of `values` (positions
/// are indices; none between them).
fn value_tick(values: &[String], position: f64) -> String {
    let index = position.round();
    if (position - index).abs() > 1e-6 || index < 0.0 {
        return String::new();
    }
    values.get(index as usize).cloned().unwrap_or_default()
}

fn panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
    spec: &Panel,
) -> std::result::Result<(), String> {
    let Panel { caption, x_desc, y_desc, zoom, x_values, .. } = *spec;
    let points = series.values().flatten();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, 0.0f64);
    for &(px, py) in points {
        x0 = x0.min(px);
        x1 = x1.max(px);
        y0 = y0.min(py);
        y1 = y1.max(py);
    }
    // From zero, or (`zoom`) around the data.
    let (y0, y1) = if zoom {
        let pad = ((y1 - y0) * 0.1).max(1e-3);
        (y0 - pad, y1 + pad)
    } else {
        (0.0, (y1 * 1.15).max(1e-9))
    };
    let pad = ((x1 - x0) * 0.08).max(0.5);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), y0..y1)
        .map_err(|e| e.to_string())?;
    let ticks = |v: &f64| match x_values {
        Some(values) => value_tick(values, *v),
        None => short_number(*v),
    };
    // Twice as many ticks as values allows a tick at every value and none
    // closer (the labels between values are empty).
    let x_ticks = x_values.map_or(8, |values| 2 * values.len().max(1));
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_labels(x_ticks)
        .x_label_formatter(&ticks)
        .y_label_formatter(&|v| short_number(*v))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = series_color(i);
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name.clone())
            .legend(move |(lx, ly)| PathElement::new(vec![(lx, ly), (lx + 20, ly)], color.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| {
                // A lone point (a reference) as a larger ring, visible over a line.
                if points.len() == 1 {
                    Circle::new(p, 9, color.stroke_width(3))
                } else {
                    Circle::new(p, 4, color.filled())
                }
            }))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(spec.legend.clone())
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// Draws `pareto.png` of a search: left, the summed normalised held-out
/// loss of every budget's optimum against its cost; right, the stitched
/// accuracy of those students (when scored). `reference` is a student drawn
/// as its own series (the first candidates: the hand-written config).
///
/// `front` and `reference` are (cost, summed loss) points; each of
/// `metrics` (what `--evaluate` measured of the same points) gets a panel of
/// its own to the right, or one panel says nothing was evaluated.
pub fn draw_pareto(
    path: &Path,
    cost: &str,
    front: &[(f64, f64)],
    reference: Option<(f64, f64)>,
    metrics: &[Metric],
) -> Result<()> {
    let fail = picture_error(path);
    register_font().map_err(&fail)?;
    let front_name = "optimum of each budget".to_string();
    let reference_name = "first candidates (the hand-written student)".to_string();
    let mut loss: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let losses: Vec<f64> = front.iter().map(|p| p.1).collect();
    let (loss_limit, losses_left_out) = on_scale(&losses);
    loss.insert(front_name.clone(), front.iter().copied().filter(|p| p.1 <= loss_limit).collect());
    if let Some(point) = reference {
        loss.insert(reference_name.clone(), vec![point]);
    }
    let evaluated: Vec<&Metric> = metrics.iter().filter(|m| m.front.iter().any(Option::is_some)).collect();
    let panels = 1 + evaluated.len().max(1);
    let root = BitMapBackend::new(path, (640 * panels as u32, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let areas = root.split_evenly((1, panels));
    let spec =
        |caption, y_desc, legend| Panel { caption, x_desc: cost, y_desc, zoom: true, legend, x_values: None };
    let loss_caption = format!("held-out block losses{}", left_out(losses_left_out));
    let loss_panel = spec(loss_caption.as_str(), "summed normalised loss", SeriesLabelPosition::UpperRight);
    panel(&areas[0], &loss, &loss_panel).map_err(&fail)?;
    if evaluated.is_empty() {
        areas[1]
            .titled("(not evaluated: pipebd search --evaluate)", ("sans-serif", 18))
            .map_err(|e| fail(e.to_string()))?;
    }
    for (metric, area) in evaluated.iter().zip(&areas[1..]) {
        let scale = if metric.percent { 100.0 } else { 1.0 };
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        let scored: Vec<(f64, f64)> =
            front.iter().zip(&metric.front).filter_map(|(p, v)| Some((p.0, scale * (*v)?))).collect();
        // A share stays whole; a figure that grows without bound (a
        // perplexity of every layer skipped) would flatten the rest.
        let (limit, dropped) = if metric.percent {
            (f64::INFINITY, 0)
        } else {
            on_scale(&scored.iter().map(|p| p.1).collect::<Vec<_>>())
        };
        series.insert(front_name.clone(), scored.into_iter().filter(|p| p.1 <= limit).collect());
        if let (Some(point), Some(value)) = (reference, metric.reference) {
            series.insert(reference_name.clone(), vec![(point.0, scale * value)]);
        }
        let legend =
            if metric.percent { SeriesLabelPosition::LowerRight } else { SeriesLabelPosition::UpperRight };
        let caption = format!("stitched, not finetuned{}", left_out(dropped));
        let metric_panel = Panel {
            caption: &caption,
            x_desc: cost,
            y_desc: metric.name,
            zoom: true,
            legend,
            x_values: None,
        };
        panel(area, &series, &metric_panel).map_err(&fail)?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

/// The largest value a Pareto panel draws, four times the median of
/// `values` (so that the degenerate cheapest points, every block skipped,
/// do not flatten the rest), and how many values lie above it.
fn on_scale(values: &[f64]) -> (f64, usize) {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let Some(&median) = sorted.get(sorted.len() / 2) else { return (f64::INFINITY, 0) };
    let limit = if median > 0.0 { 4.0 * median } else { f64::INFINITY };
    (limit, values.iter().filter(|&&v| !(v <= limit)).count())
}

/// A caption's note of the points left off the scale.
fn left_out(count: usize) -> String {
    match count {
        0 => String::new(),
        1 => " (1 point off the scale)".into(),
        n => format!(" ({n} points off the scale)"),
    }
}

/// One figure `pipebd search --evaluate` measured of each Pareto point.
pub struct Metric {
    /// The axis label.
    pub name: &'static str,
    /// A share, drawn in percent.
    pub percent: bool,
    /// Its value at each point of the front (`None`: not measured).
    pub front: Vec<Option<f64>>,
    /// Its value for the reference point.
    pub reference: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::{on_scale, run_values, value_tick};

    #[test]
    fn pareto_panels_leave_out_the_runaway_points() {
        // The median of six is the upper middle one, 4: the limit is 16,
        // and 1e48 and 50 lie above it.
        assert_eq!(on_scale(&[1e48, 50.0, 4.0, 3.0, 2.0, 1.0]), (16.0, 2));
        assert_eq!(on_scale(&[f64::INFINITY, 2.0, 1.0]), (8.0, 1));
        assert_eq!(on_scale(&[]), (f64::INFINITY, 0));
    }

    #[test]
    fn the_axis_shows_the_values_that_were_run() {
        let values = run_values(["256", "128", "512", "128"].into_iter());
        assert_eq!(values, ["128", "256", "512"], "numbers in numeric order, each once");
        assert_eq!(value_tick(&values, 1.0), "256");
        assert_eq!(value_tick(&values, 1.5), "", "no label between two values");
        assert_eq!(value_tick(&values, 3.0), "");
        let names = run_values(["tr", "dp", "tr"].into_iter());
        assert_eq!(names, ["tr", "dp"], "names in the order they were run");
    }
}
