//! The pictures of a run folder: `losses.png` (each block's loss over the
//! steps, from `metrics.csv`) and, for a traced run, `timeline.png` (what
//! every worker did during a few steady steps, from `trace.json`). The
//! sweep's and the search's plots ([`crate::jobs::sweep`], `pareto.png`) and
//! `bench.png` share the font and colours defined here.

pub mod losses;
pub mod timeline;

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::report::RunReport;
use pipe_bd::error::{Error, Result};

/// Font files tried, in order, for the pictures' text.
const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Steady steps a timeline shows: enough to see the pipeline's rhythm, few
/// enough that each span stays wide enough to read.
pub const TIMELINE_STEPS: usize = 3;

/// Registers the DejaVu font as plotters' `sans-serif` once per process;
/// the error names the package that provides it.
pub(crate) fn register_font() -> std::result::Result<(), String> {
    static REGISTERED: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = FONTS.iter().find_map(|f| std::fs::read(f).ok()).ok_or_else(|| {
                format!(
                    "no font for the pictures: install Debian's fonts-dejavu-core (looked for {})",
                    FONTS.join(", ")
                )
            })?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| "the DejaVu font file could not be read".to_string())
        })
        .clone()
}

/// The colour of the `i`-th series of a picture (block `i + 1` in
/// `losses.png`): the same block has the same colour in every panel.
pub(crate) fn series_color(i: usize) -> RGBAColor {
    Palette99::pick(i).to_rgba()
}

/// A number as a short tick label: `1.5M`, `350k`, `12`, `0.25`,
/// `0.00015`, `2.5e-5`: three significant digits at most (trailing zeros
/// cut), so that the ticks of one axis (multiples of 1, 2, 2.5 or 5 times a
/// power of ten) never read alike.
pub(crate) fn short_number(value: f64) -> String {
    let magnitude = value.abs();
    let trim = |text: String| {
        if text.contains('.') {
            text.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            text
        }
    };
    if magnitude >= 1e9 {
        format!("{}G", trim(format!("{:.2}", value / 1e9)))
    } else if magnitude >= 1e6 {
        format!("{}M", trim(format!("{:.2}", value / 1e6)))
    } else if magnitude >= 1e4 {
        format!("{}k", trim(format!("{:.1}", value / 1e3)))
    } else if magnitude >= 1.0 || magnitude == 0.0 {
        trim(format!("{value:.2}"))
    } else if magnitude >= 1e-4 {
        // Three significant digits: 0.25, 0.000125.
        let decimals = (2 - magnitude.log10().floor() as i32).max(0) as usize;
        trim(format!("{value:.decimals$}"))
    } else {
        let text = format!("{value:.2e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        format!("{}e{exponent}", trim(mantissa.to_string()))
    }
}

/// The error of a picture that could not be drawn at `path`.
pub(crate) fn picture_error(path: &Path) -> impl Fn(String) -> Error + '_ {
    move |message| Error::Data {
        path: path.to_path_buf(),
        message: format!("cannot draw the picture: {message}"),
    }
}

/// Draws the pictures of the run folder `run_dir` (written by `pipebd run`):
/// `losses.png` from `metrics.csv` (with `report.json`, when there is one,
/// for each block's loss kind and the stitched pass) and, when the run was
/// traced, `timeline.png` from `trace.json`. Returns the files written.
pub fn plot_run(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let report = run_dir.join("report.json").is_file().then(|| RunReport::read(run_dir)).transpose()?;
    draw_run(run_dir, report.as_ref())
}

/// [`plot_run`] with the run's report already in hand (`pipebd run` right
/// after writing it), or none (an older or a foreign run: every block is
/// drawn as MSE).
pub fn draw_run(run_dir: &Path, report: Option<&RunReport>) -> Result<Vec<PathBuf>> {
    let metrics = run_dir.join("metrics.csv");
    if !metrics.is_file() {
        return Err(Error::Data {
            path: metrics,
            message: "no metrics.csv here: is this the folder given to `pipebd run --out`?".into(),
        });
    }
    let rows = crate::metrics::read_metrics(&metrics)?;
    // The report tells the loss kinds and where the stitched pass begins.
    let (kinds, blockwise_steps) = match report {
        Some(report) => (
            report.blocks.iter().map(|b| b.loss).collect(),
            report.stitched.is_some().then_some(report.steps),
        ),
        None => (Vec::new(), None),
    };
    let curves = losses::LossCurves::from_rows(&rows, &kinds, blockwise_steps);
    let mut written = Vec::new();
    let losses_png = run_dir.join("losses.png");
    let title = report.map_or_else(
        || "training losses".to_string(),
        |r| format!("{}: {} on {}", r.name, r.schedule, r.device),
    );
    losses::draw_losses(&losses_png, &curves, &title)?;
    written.push(losses_png);
    let trace = run_dir.join("trace.json");
    if trace.is_file() {
        let timeline = timeline::Timeline::read(&trace)?;
        let title = report.map_or_else(
            || "pipeline timeline".to_string(),
            |r| format!("{} {}: {:.1} ms per step", r.schedule, r.plan, 1e3 * r.measured_step_seconds),
        );
        let group = timeline::TimelineGroup { title, timeline };
        let timeline_png = run_dir.join("timeline.png");
        timeline::draw_timelines(&timeline_png, std::slice::from_ref(&group))?;
        written.push(timeline_png);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::short_number;

    #[test]
    fn short_numbers_keep_their_value() {
        assert_eq!(short_number(1_500_000.0), "1.5M");
        assert_eq!(short_number(350_000.0), "350k");
        assert_eq!(short_number(12.0), "12");
        assert_eq!(short_number(0.25), "0.25");
        assert_eq!(short_number(0.0005), "0.0005");
        assert_eq!(short_number(0.000025), "2.5e-5");
        assert_eq!(short_number(0.0), "0");
        assert_eq!(short_number(2.5e9), "2.5G");
        assert_eq!(short_number(0.00015), "0.00015");
        assert_eq!(short_number(1.25e-5), "1.25e-5");
    }

    /// What `losses.png` of a SmolLM2 run showed: two learning-rate ticks
    /// both read "0.0002". Ticks are multiples of 1, 2, 2.5 or 5 times a power
    /// of ten; over any axis every tick must read differently.
    #[test]
    fn the_ticks_of_an_axis_never_read_alike() {
        for exponent in -8..=7 {
            for unit in [1.0, 2.0, 2.5, 5.0] {
                let step = unit * 10f64.powi(exponent);
                let labels: Vec<String> = (0..=12).map(|i| short_number(i as f64 * step)).collect();
                let distinct: std::collections::BTreeSet<&String> = labels.iter().collect();
                assert_eq!(distinct.len(), labels.len(), "step {step:e}: {labels:?}");
            }
        }
    }
}
