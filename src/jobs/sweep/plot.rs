//! The sweep plot: throughput and speedup over `dp` against the swept axis.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::jobs::sweep::Row;

/// Font files tried, in order, for the plot's text.
const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

fn register_font() -> std::result::Result<(), String> {
    static REGISTERED: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = FONTS.iter().find_map(|f| std::fs::read(f).ok()).ok_or_else(|| {
                format!(
                    "no font for the plot: install Debian's fonts-dejavu-core (looked for {})",
                    FONTS.join(", ")
                )
            })?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| "the DejaVu font file could not be read".to_string())
        })
        .clone()
}

/// Draws `sweep.png`: left, samples per second against `x` (one line per
/// combination of the other swept fields); right, speedup over the `dp`
/// point with the same other values (when the sweep has `schedule = dp`).
pub fn draw_sweep(path: &Path, rows: &[Row], keys: &[String], x: &str) -> Result<()> {
    let fail = |message: String| Error::Data { path: path.to_path_buf(), message };
    register_font().map_err(fail)?;
    let xi =
        keys.iter().position(|k| k == x).ok_or_else(|| fail(format!("`x = {x}` is not a swept field")))?;
    let schedule = keys.iter().position(|k| k == "schedule");
    // x positions: numbers as they are, anything else by order of appearance.
    let mut categories: Vec<String> = Vec::new();
    let position = |value: &str, categories: &mut Vec<String>| -> f64 {
        value.parse::<f64>().unwrap_or_else(|_| {
            if !categories.iter().any(|c| c == value) {
                categories.push(value.to_string());
            }
            categories.iter().position(|c| c == value).unwrap_or(0) as f64
        })
    };
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
        let px = position(&row.values[xi], &mut categories);
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
    panel(&left, &throughput, x, "samples / s", "throughput", false, SeriesLabelPosition::LowerRight)
        .map_err(fail)?;
    if speedup.is_empty() {
        right
            .titled("(no dp points: no speedup panel)", ("sans-serif", 18))
            .map_err(|e| fail(e.to_string()))?;
    } else {
        panel(
            &right,
            &speedup,
            x,
            "speedup over dp",
            "speedup over dp",
            false,
            SeriesLabelPosition::LowerRight,
        )
        .map_err(fail)?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

fn panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
    x: &str,
    y: &str,
    caption: &str,
    zoom: bool,
    legend: SeriesLabelPosition,
) -> std::result::Result<(), String> {
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
    chart.configure_mesh().x_desc(x).y_desc(y).draw().map_err(|e| e.to_string())?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
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
        .position(legend)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// Draws `pareto.png` of a search: left, the summed normalised held-out
/// loss of every budget's optimum against its cost; right, the stitched
/// accuracy of those students (when scored). `reference` is a student drawn
/// as its own series (the first candidates: the hand-written config).
pub fn draw_pareto(
    path: &Path,
    cost: &str,
    front: &[(f64, f64, Option<f64>)],
    reference: Option<(f64, f64, Option<f64>)>,
) -> Result<()> {
    let fail = |message: String| Error::Data { path: path.to_path_buf(), message };
    register_font().map_err(fail)?;
    let mut loss: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut accuracy: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let front_name = "optimum of each budget".to_string();
    loss.insert(front_name.clone(), front.iter().map(|p| (p.0, p.1)).collect());
    let scored: Vec<(f64, f64)> = front.iter().filter_map(|p| Some((p.0, 100.0 * p.2?))).collect();
    if !scored.is_empty() {
        accuracy.insert(front_name, scored);
    }
    if let Some((c, l, a)) = reference {
        let name = "first candidates (the hand-written student)".to_string();
        loss.insert(name.clone(), vec![(c, l)]);
        if let Some(a) = a {
            accuracy.insert(name, vec![(c, 100.0 * a)]);
        }
    }
    let root = BitMapBackend::new(path, (1280, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let (left, right) = root.split_horizontally(640);
    panel(
        &left,
        &loss,
        cost,
        "summed normalised loss",
        "held-out block losses",
        true,
        SeriesLabelPosition::UpperRight,
    )
    .map_err(fail)?;
    if accuracy.is_empty() {
        right
            .titled("(not evaluated: pipebd search --evaluate)", ("sans-serif", 18))
            .map_err(|e| fail(e.to_string()))?;
    } else {
        panel(
            &right,
            &accuracy,
            cost,
            "stitched accuracy (%)",
            "stitched, not finetuned",
            true,
            SeriesLabelPosition::LowerRight,
        )
        .map_err(fail)?;
    }
    root.present().map_err(|e| fail(e.to_string()))
}
