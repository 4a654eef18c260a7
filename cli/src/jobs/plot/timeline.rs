//! `timeline.png` (a traced run) and `bench.png` (every benched schedule):
//! one row per pipeline worker, its spans coloured by kind over a window of
//! a few steady-state steps, the share of that window the worker spent not
//! computing printed beside it. The picture of the Pipe-BD paper's schedule
//! figure, from a run of ours.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{picture_error, register_font, TIMELINE_STEPS};
use pipe_bd::error::{Error, Result};
use pipe_bd::trace::{worker_name, Span, SpanKind, WorkerSummary};

/// Width of the timeline pictures in pixels.
pub const TIMELINE_WIDTH: u32 = 1400;
/// Height of one worker's row.
const ROW_HEIGHT: u32 = 34;
/// Height of a group's caption and time axis together.
const GROUP_FRAME: u32 = 110;
/// Height of the legend above the groups.
const LEGEND_HEIGHT: u32 = 70;

/// One span of a timeline row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimelineSpan {
    /// What the worker did.
    pub kind: SpanKind,
    /// The block it was about, if one.
    pub block: Option<usize>,
    /// Microseconds since the run started.
    pub start_us: u64,
    /// Duration in microseconds.
    pub duration_us: u64,
}

impl TimelineSpan {
    fn end_us(&self) -> u64 {
        self.start_us + self.duration_us
    }

    /// Microseconds of this span inside `window`.
    fn overlap(&self, window: (u64, u64)) -> u64 {
        self.end_us().min(window.1).saturating_sub(self.start_us.max(window.0))
    }
}

/// One worker's row.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineRow {
    /// Worker number (thread id of the trace).
    pub worker: usize,
    /// Its name: `worker 1: stage 2 replica 0 (slot 1)`.
    pub name: String,
    /// Its spans in start order.
    pub spans: Vec<TimelineSpan>,
}

/// What every worker of a run did, row by row.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// One row per worker, in worker order.
    pub rows: Vec<TimelineRow>,
}

impl Timeline {
    /// The timeline of a run's `spans`, one row per worker of `workers`.
    pub fn new(spans: &[Span], workers: &[WorkerSummary]) -> Self {
        let mut rows: Vec<TimelineRow> = workers
            .iter()
            .map(|w| TimelineRow { worker: w.worker, name: worker_name(w), spans: Vec::new() })
            .collect();
        rows.sort_by_key(|r| r.worker);
        for s in spans {
            if let Some(row) = rows.iter_mut().find(|r| r.worker == s.worker) {
                row.spans.push(TimelineSpan {
                    kind: s.kind,
                    block: s.block,
                    start_us: s.start_us,
                    duration_us: s.duration_us,
                });
            }
        }
        for row in &mut rows {
            row.spans.sort_by_key(|s| s.start_us);
        }
        Self { rows }
    }

    /// Reads the timeline from a `trace.json` that `pipebd run --trace`
    /// wrote: a row per named thread, a span per complete (`X`) event.
    pub fn read(path: &Path) -> Result<Self> {
        let bad = |message: String| Error::Data { path: path.to_path_buf(), message };
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("reading", path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let events = json["traceEvents"]
            .as_array()
            .ok_or_else(|| bad("no `traceEvents` list: not a Chrome trace".into()))?;
        let mut rows: Vec<TimelineRow> = Vec::new();
        let mut spans: Vec<(usize, TimelineSpan)> = Vec::new();
        for (i, event) in events.iter().enumerate() {
            let worker =
                event["tid"].as_u64().ok_or_else(|| bad(format!("event {i} has no `tid`")))? as usize;
            match event["ph"].as_str() {
                Some("M") => {
                    let name = event["args"]["name"].as_str().unwrap_or_default().to_string();
                    rows.push(TimelineRow { worker, name, spans: Vec::new() });
                }
                Some("X") => {
                    let category = event["cat"].as_str().unwrap_or_default();
                    let kind = SpanKind::from_name(category)
                        .ok_or_else(|| bad(format!("event {i}: unknown span kind `{category}`")))?;
                    let (Some(start_us), Some(duration_us)) = (event["ts"].as_u64(), event["dur"].as_u64())
                    else {
                        return Err(bad(format!("event {i}: a span needs `ts` and `dur` in microseconds")));
                    };
                    let block = event["args"]["block"].as_u64().map(|b| b as usize);
                    spans.push((worker, TimelineSpan { kind, block, start_us, duration_us }));
                }
                _ => {}
            }
        }
        rows.sort_by_key(|r| r.worker);
        for (worker, span) in spans {
            match rows.iter_mut().find(|r| r.worker == worker) {
                Some(row) => row.spans.push(span),
                None => return Err(bad(format!("a span of thread {worker}, which has no name event"))),
            }
        }
        for row in &mut rows {
            row.spans.sort_by_key(|s| s.start_us);
        }
        Ok(Self { rows })
    }

    /// First start and last end of any span (`(0, 0)` without spans).
    pub fn extent(&self) -> (u64, u64) {
        let spans = self.rows.iter().flat_map(|r| &r.spans);
        let start = spans.clone().map(|s| s.start_us).min().unwrap_or(0);
        let end = spans.map(TimelineSpan::end_us).max().unwrap_or(0);
        (start, end)
    }

    /// A window of `steps` steady steps, in microseconds: on the row with
    /// the most optimizer steps, from the end of one optimizer step of its
    /// first block to the end of the one `steps` later, taken from the
    /// middle of the run (away from the pipeline's fill and drain). The
    /// whole run when it has too few steps for that.
    pub fn steady_window(&self, steps: usize) -> (u64, u64) {
        let optimizer_steps = |row: &TimelineRow| -> Vec<u64> {
            let first_block =
                row.spans.iter().filter(|s| s.kind == SpanKind::OptimizerStep).map(|s| s.block).min();
            row.spans
                .iter()
                .filter(|s| s.kind == SpanKind::OptimizerStep && Some(s.block) == first_block)
                .map(TimelineSpan::end_us)
                .collect()
        };
        // The first of the rows with the most steps.
        let ends = self
            .rows
            .iter()
            .map(optimizer_steps)
            .min_by_key(|e| std::cmp::Reverse(e.len()))
            .unwrap_or_default();
        if steps == 0 || ends.len() <= steps {
            return self.extent();
        }
        let first = (ends.len() - steps) / 2;
        (ends[first], ends[first + steps])
    }

    /// The rows with a span in `window`: a multi-phase plan's workers of
    /// the other phases have none there.
    pub fn active_in(&self, window: (u64, u64)) -> Timeline {
        let active = |row: &&TimelineRow| row.spans.iter().any(|s| s.overlap(window) > 0);
        Timeline { rows: self.rows.iter().filter(active).cloned().collect() }
    }

    /// Per row, the share of `window` it spent not computing (waiting, or
    /// outside any span).
    pub fn idle_shares(&self, window: (u64, u64)) -> Vec<f64> {
        let length = window.1.saturating_sub(window.0).max(1) as f64;
        self.rows
            .iter()
            .map(|row| {
                let busy: u64 =
                    row.spans.iter().filter(|s| !s.kind.is_idle()).map(|s| s.overlap(window)).sum();
                (1.0 - busy as f64 / length).clamp(0.0, 1.0)
            })
            .collect()
    }
}

/// One titled group of rows in a timeline picture: a run, or one schedule
/// of a bench.
#[derive(Debug, Clone)]
pub struct TimelineGroup {
    /// The group's caption (schedule, plan, step times).
    pub title: String,
    /// Its workers' spans.
    pub timeline: Timeline,
}

/// Height in pixels of a picture of `groups`.
pub fn timeline_height(groups: &[TimelineGroup]) -> u32 {
    LEGEND_HEIGHT + groups.iter().map(group_height).sum::<u32>()
}

/// The window a group is drawn over and the rows drawn: those active in it.
fn steady_view(group: &TimelineGroup) -> ((u64, u64), Timeline) {
    let window = group.timeline.steady_window(TIMELINE_STEPS);
    (window, group.timeline.active_in(window))
}

fn group_height(group: &TimelineGroup) -> u32 {
    GROUP_FRAME + ROW_HEIGHT * steady_view(group).1.rows.len() as u32
}

/// The colour of a span kind: work in blues and greens, waiting in warm
/// colours.
pub fn kind_color(kind: SpanKind) -> RGBColor {
    match kind {
        SpanKind::DataLoad => RGBColor(140, 140, 140),
        SpanKind::TeacherForward => RGBColor(66, 133, 244),
        SpanKind::StudentForwardBackward => RGBColor(52, 168, 83),
        SpanKind::OptimizerStep => RGBColor(0, 96, 86),
        SpanKind::SendWait => RGBColor(251, 188, 5),
        SpanKind::RecvWait => RGBColor(234, 67, 53),
        SpanKind::BarrierWait => RGBColor(156, 39, 176),
        SpanKind::GradientAverage => RGBColor(233, 120, 170),
        SpanKind::Checkpoint => RGBColor(40, 40, 40),
    }
}

/// Draws `groups` one under the other into `path` (`timeline.png`,
/// `bench.png`), each over its own window of [`TIMELINE_STEPS`] steady
/// steps, with a legend of the span kinds on top.
pub fn draw_timelines(path: &Path, groups: &[TimelineGroup]) -> Result<()> {
    let fail = picture_error(path);
    register_font().map_err(&fail)?;
    let root = BitMapBackend::new(path, (TIMELINE_WIDTH, timeline_height(groups))).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
    let (legend, mut rest) = root.split_vertically(LEGEND_HEIGHT);
    let kinds: Vec<SpanKind> = SpanKind::ALL
        .into_iter()
        .filter(|k| {
            groups.iter().any(|g| g.timeline.rows.iter().any(|r| r.spans.iter().any(|s| s.kind == *k)))
        })
        .collect();
    draw_legend(&legend, &kinds).map_err(&fail)?;
    for group in groups {
        let (area, below) = rest.split_vertically(group_height(group));
        draw_group(&area, group).map_err(&fail)?;
        rest = below;
    }
    root.present().map_err(|e| fail(e.to_string()))
}

fn draw_legend(
    area: &DrawingArea<BitMapBackend, Shift>,
    kinds: &[SpanKind],
) -> std::result::Result<(), String> {
    let style = ("sans-serif", 15).into_font().color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
    let (mut x, y) = (20, 22);
    for kind in kinds {
        let swatch = Rectangle::new([(x, y - 8), (x + 18, y + 8)], kind_color(*kind).filled());
        area.draw(&swatch).map_err(|e| e.to_string())?;
        let label = kind.name().replace('_', " ");
        area.draw(&Text::new(label.clone(), (x + 24, y), style.clone())).map_err(|e| e.to_string())?;
        x += 24 + area.estimate_text_size(&label, &style).map_err(|e| e.to_string())?.0 as i32 + 24;
    }
    let note = format!(
        "{TIMELINE_STEPS} steady steps from the middle of each run; idle: share of that window not computing \
         (waits, and time outside any span)"
    );
    area.draw(&Text::new(note, (20, 52), style)).map_err(|e| e.to_string())
}

fn draw_group(
    area: &DrawingArea<BitMapBackend, Shift>,
    group: &TimelineGroup,
) -> std::result::Result<(), String> {
    let (window, shown) = steady_view(group);
    let rows = &shown.rows;
    let idle = shown.idle_shares(window);
    let hidden = group.timeline.rows.len() - rows.len();
    let title = match hidden {
        0 => group.title.clone(),
        _ => format!("{} (+{hidden} workers of other phases, idle here)", group.title),
    };
    // The largest caption size that fits the width (a long multi-phase plan).
    let width = area.dim_in_pixel().0 as f64 - 20.0;
    let fits = |size: u32| {
        let style = ("sans-serif", size).into_font().color(&BLACK);
        area.estimate_text_size(&title, &style).is_ok_and(|(w, _)| f64::from(w) <= width)
    };
    let caption_size = [19, 17, 15, 13].into_iter().find(|&size| fits(size)).unwrap_or(12);
    let ms = |us: u64| us.saturating_sub(window.0) as f64 / 1e3;
    let length_ms = ms(window.1).max(1e-3);
    let n = rows.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(&title, ("sans-serif", caption_size))
        .margin(10)
        .margin_right(110)
        .x_label_area_size(40)
        .y_label_area_size(330)
        .build_cartesian_2d(0.0..length_ms, 0.0..n)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_labels(12)
        .x_desc(format!("ms from the window's start (at {:.1} ms into training)", window.0 as f64 / 1e3))
        .draw()
        .map_err(|e| e.to_string())?;
    // Worker 0 on top.
    let top = |i: usize| n - i as f64;
    for (i, row) in rows.iter().enumerate() {
        let visible = row.spans.iter().filter(|s| s.overlap(window) > 0).map(|s| {
            let x0 = ms(s.start_us.max(window.0));
            let x1 = ms(s.end_us().min(window.1));
            Rectangle::new([(x0, top(i) - 0.15), (x1, top(i) - 0.85)], kind_color(s.kind).filled())
        });
        chart.draw_series(visible).map_err(|e| e.to_string())?;
    }
    // The block of each span wide enough to carry its number.
    let block_style = ("sans-serif", 13).into_font().color(&WHITE).pos(Pos::new(HPos::Center, VPos::Center));
    let pixels_per_ms = chart.backend_coord(&(length_ms, 0.0)).0 - chart.backend_coord(&(0.0, 0.0)).0;
    let pixels_per_ms = pixels_per_ms as f64 / length_ms;
    for (i, row) in rows.iter().enumerate() {
        let labels = row.spans.iter().filter(|s| s.overlap(window) > 0).filter_map(|s| {
            let (x0, x1) = (ms(s.start_us.max(window.0)), ms(s.end_us().min(window.1)));
            let wide = (x1 - x0) * pixels_per_ms >= 28.0;
            let block = s.block.filter(|_| wide)?;
            Some(Text::new(format!("b{block}"), ((x0 + x1) / 2.0, top(i) - 0.5), block_style.clone()))
        });
        chart.draw_series(labels).map_err(|e| e.to_string())?;
    }
    let base = area.get_base_pixel();
    let label_style = ("sans-serif", 15).into_font().color(&BLACK);
    for (i, (row, idle)) in rows.iter().zip(&idle).enumerate() {
        let (x, y) = chart.backend_coord(&(0.0, top(i) - 0.5));
        let name = Text::new(
            row.name.clone(),
            (x - base.0 - 8, y - base.1),
            label_style.clone().pos(Pos::new(HPos::Right, VPos::Center)),
        );
        area.draw(&name).map_err(|e| e.to_string())?;
        let (x, y) = chart.backend_coord(&(length_ms, top(i) - 0.5));
        let share = Text::new(
            format!("idle {:.0}%", 100.0 * idle),
            (x - base.0 + 8, y - base.1),
            label_style.clone().pos(Pos::new(HPos::Left, VPos::Center)),
        );
        area.draw(&share).map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(kind: SpanKind, block: Option<usize>, start_us: u64, duration_us: u64) -> TimelineSpan {
        TimelineSpan { kind, block, start_us, duration_us }
    }

    /// Two workers over ten steps of 100 us: worker 0 computes 70 us of
    /// each step (teacher 20, student 40, optimizer 10) and sends for 30;
    /// worker 1 waits 80 us for the activation, then computes 20.
    fn two_stage_timeline(steps: u64) -> Timeline {
        let mut rows = vec![
            TimelineRow { worker: 0, name: "worker 0: stage 1 replica 0 (slot 0)".into(), spans: Vec::new() },
            TimelineRow { worker: 1, name: "worker 1: stage 2 replica 0 (slot 1)".into(), spans: Vec::new() },
        ];
        for step in 0..steps {
            let t = 100 * step;
            rows[0].spans.extend([
                span(SpanKind::TeacherForward, Some(1), t, 20),
                span(SpanKind::StudentForwardBackward, Some(1), t + 20, 40),
                span(SpanKind::OptimizerStep, Some(1), t + 60, 10),
                span(SpanKind::SendWait, None, t + 70, 30),
            ]);
            rows[1].spans.extend([
                span(SpanKind::RecvWait, None, t, 80),
                span(SpanKind::StudentForwardBackward, Some(2), t + 80, 15),
                span(SpanKind::OptimizerStep, Some(2), t + 95, 5),
            ]);
        }
        Timeline { rows }
    }

    #[test]
    fn the_window_is_steps_from_the_middle_and_idle_shares_count_the_waits() {
        let timeline = two_stage_timeline(10);
        // Optimizer steps end at 70, 170, ..., 970 on worker 0 and at 100,
        // ..., 1000 on worker 1 (equally many: the first row wins). Ten
        // steps, three shown: from the end of the fourth to the seventh's.
        assert_eq!(timeline.steady_window(3), (370, 670));
        // In any whole number of steps worker 0 computes 70%, worker 1 20%.
        let idle = timeline.idle_shares((370, 670));
        assert!((idle[0] - 0.3).abs() < 1e-9 && (idle[1] - 0.8).abs() < 1e-9, "{idle:?}");
        // A worker of a later phase is not drawn in this window.
        let mut phased = timeline.clone();
        let later = TimelineRow {
            worker: 2,
            name: "worker 2".into(),
            spans: vec![span(SpanKind::OptimizerStep, Some(3), 2000, 5)],
        };
        phased.rows.push(later);
        assert_eq!(phased.active_in((370, 670)), timeline);
        // Too few steps for a window: the whole run.
        let short = two_stage_timeline(3);
        assert_eq!(short.steady_window(3), (0, 300));
        assert_eq!(short.extent(), (0, 300));
    }

    #[test]
    fn rows_come_from_the_workers_and_their_spans() {
        let workers: Vec<WorkerSummary> = (0..2)
            .map(|w| pipe_bd::trace::summarise(w, format!("stage {} replica 0", w + 1), w, &[], 1.0, 0))
            .collect();
        let spans = vec![
            Span { worker: 1, kind: SpanKind::RecvWait, block: None, start_us: 5, duration_us: 3 },
            Span { worker: 0, kind: SpanKind::TeacherForward, block: Some(1), start_us: 0, duration_us: 4 },
            Span { worker: 1, kind: SpanKind::OptimizerStep, block: Some(2), start_us: 1, duration_us: 2 },
        ];
        let timeline = Timeline::new(&spans, &workers);
        assert_eq!(timeline.rows[1].name, "worker 1: stage 2 replica 0 (slot 1)");
        let kinds: Vec<SpanKind> = timeline.rows[1].spans.iter().map(|s| s.kind).collect();
        assert_eq!(kinds, vec![SpanKind::OptimizerStep, SpanKind::RecvWait], "in start order");
        assert_eq!(timeline.rows[0].spans.len(), 1);
    }
}
