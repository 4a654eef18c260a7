//! The one way `pipebd` talks to its user while it works: informative lines
//! (`auto: ...`, `bench: ...`), periodic lines of long work, training
//! progress, warnings and the final error, all on stderr through one
//! [`Reporter`]. `--quiet` silences the informative, periodic and progress
//! lines (never a warning or an error); `--log-format json` writes every
//! line as one JSON object (`time`, `level`, `source`, `message` and, for
//! progress, the step, totals, losses and rate), for batch schedulers and
//! log collectors. On a terminal in text format progress is a bar; elsewhere
//! it is a line every [`PERIOD`].
//!
//! The reporter is process-wide, as stderr is: the command line sets it up
//! once ([`init`]) and every job and zoo writes through [`reporter`].

use std::io::{IsTerminal, Write};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use pipe_bd::train::Progress;

/// How often a periodic line may be written (progress in a log file, the
/// long loops of a search or of a teacher's calibration).
pub const PERIOD: Duration = Duration::from_secs(30);

/// How the lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people: `source: message`, a progress bar on a terminal.
    #[default]
    Text,
    /// One JSON object per line, no bar.
    Json,
}

/// What a line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Info,
    Progress,
    Warning,
    Error,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Info => "info",
            Level::Progress => "progress",
            Level::Warning => "warning",
            Level::Error => "error",
        }
    }
}

/// Where the lines go and how (see the module docs).
pub struct Reporter {
    quiet: bool,
    format: LogFormat,
    /// Whether the output is a terminal (a bar instead of periodic lines).
    terminal: bool,
    /// The rank of a multi-process run, named in each JSON line.
    rank: Option<usize>,
    out: Mutex<Box<dyn Write + Send>>,
}

static REPORTER: OnceLock<Reporter> = OnceLock::new();

/// Sets up the process's reporter (the first call wins; later ones, and
/// [`reporter`] before any, keep the defaults: text, not quiet).
pub fn init(quiet: bool, format: LogFormat) {
    let _ = REPORTER.set(Reporter::to_stderr(quiet, format));
}

/// The process's reporter.
pub fn reporter() -> &'static Reporter {
    REPORTER.get_or_init(|| Reporter::to_stderr(false, LogFormat::Text))
}

impl Reporter {
    /// A reporter on stderr.
    pub fn to_stderr(quiet: bool, format: LogFormat) -> Self {
        Self {
            quiet,
            format,
            terminal: std::io::stderr().is_terminal(),
            rank: pipe_bd::runtime::launch::launcher_rank(),
            out: Mutex::new(Box::new(std::io::stderr())),
        }
    }

    /// A reporter writing into `out` (tests, or a log file of one's own).
    pub fn to_writer(quiet: bool, format: LogFormat, out: Box<dyn Write + Send>) -> Self {
        Self { quiet, format, terminal: false, rank: None, out: Mutex::new(out) }
    }

    /// Whether informative and progress lines are silenced (`--quiet`).
    pub fn is_quiet(&self) -> bool {
        self.quiet
    }

    /// An informative line from `source` (`auto`, `bench`, `init`, ...).
    pub fn info(&self, source: &str, message: &str) {
        if !self.quiet {
            self.write(Level::Info, source, message, None);
        }
    }

    /// An informative line, at most once per [`PERIOD`] of `throttle`
    /// (the message is only made when it is written).
    pub fn periodic(&self, throttle: &mut Throttle, source: &str, message: impl FnOnce() -> String) {
        if !self.quiet && throttle.due() {
            self.write(Level::Info, source, &message(), None);
        }
    }

    /// A warning: written even with `--quiet`.
    pub fn warn(&self, source: &str, message: &str) {
        self.write(Level::Warning, source, message, None);
    }

    /// The error a command ended with: always written.
    pub fn error(&self, message: &str) {
        self.write(Level::Error, "pipebd", message, None);
    }

    fn write(&self, level: Level, source: &str, message: &str, fields: Option<serde_json::Value>) {
        let line = match self.format {
            LogFormat::Text => match level {
                Level::Warning => format!("warning: {source}: {message}\n"),
                Level::Error => match self.rank {
                    Some(rank) => format!("error (rank {rank}): {message}\n"),
                    None => format!("error: {message}\n"),
                },
                Level::Info | Level::Progress => format!("{source}: {message}\n"),
            },
            LogFormat::Json => {
                let time = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
                let mut object = serde_json::json!({
                    "time": time,
                    "level": level.name(),
                    "source": source,
                    "message": message,
                });
                if let Some(rank) = self.rank {
                    object["rank"] = rank.into();
                }
                if let Some(serde_json::Value::Object(fields)) = fields {
                    object.as_object_mut().map(|o| o.extend(fields));
                }
                format!("{object}\n")
            }
        };
        // One write per line, so that the lines of several threads or
        // ranks never mix.
        let mut out = self.out.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let _ = out.write_all(line.as_bytes());
        let _ = out.flush();
    }
}

/// At most one line per [`PERIOD`]: the first call to [`Throttle::due`]
/// waits a period (a short loop writes nothing), then one per period.
#[derive(Debug)]
pub struct Throttle {
    last: Instant,
    period: Duration,
}

impl Default for Throttle {
    fn default() -> Self {
        Self::every(PERIOD)
    }
}

impl Throttle {
    /// A throttle of one line per `period`, counted from now.
    pub fn every(period: Duration) -> Self {
        Self { last: Instant::now(), period }
    }

    /// Whether a line is due now (and if so, the next one a period later).
    pub fn due(&mut self) -> bool {
        let due = self.last.elapsed() >= self.period;
        if due {
            self.last = Instant::now();
        }
        due
    }
}

/// Training progress: a bar on a terminal in text format, else a line
/// every [`PERIOD`] (and at the last step), with the samples per second
/// and the time left; nothing when quiet.
pub struct ProgressView {
    bar: Option<ProgressBar>,
    batch_size: usize,
    rate: StepRate,
    start: Instant,
    throttle: Throttle,
    /// False on ranks other than 0, whose progress rank 0 shows.
    shown: bool,
}

impl ProgressView {
    /// Progress of a run of `batch_size` samples per step (`shown`: false
    /// for a rank whose progress another shows).
    pub fn new(shown: bool, batch_size: usize) -> Self {
        let reporter = reporter();
        let shown = shown && !reporter.quiet;
        let bar = (shown && reporter.terminal && reporter.format == LogFormat::Text).then(|| {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        Self {
            bar,
            batch_size,
            rate: StepRate::default(),
            start: Instant::now(),
            throttle: Throttle::every(PERIOD),
            shown,
        }
    }

    /// Shows the progress after a step.
    pub fn show(&mut self, p: &Progress) {
        if !self.shown {
            return;
        }
        let per_phase = p.epochs * p.steps_per_epoch;
        let total = p.phases * per_phase;
        let done = p.phase * per_phase + p.epoch * p.steps_per_epoch + p.step_in_epoch + 1;
        let rate = self.rate.update(done, total, Instant::now());
        let speed = match rate {
            Some((steps_per_second, left)) => format!(
                "{:.0} samples/s, {} left, ",
                steps_per_second * self.batch_size as f64,
                duration_text(left)
            ),
            None => String::new(),
        };
        let losses: Vec<String> = p.losses.iter().map(|&l| loss_text(l.into())).collect();
        let phase = if p.phases > 1 { format!("phase {}/{} ", p.phase + 1, p.phases) } else { String::new() };
        let output = p.output_loss.map(|l| format!(" output {}", loss_text(l.into()))).unwrap_or_default();
        let message =
            format!("{speed}{phase}epoch {}/{} losses [{}]{output}", p.epoch + 1, p.epochs, losses.join(" "));
        if let Some(bar) = &self.bar {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(message);
            return;
        }
        if !(self.throttle.due() || done == total) {
            return;
        }
        let line = format!(
            "{done}/{total} steps ({:.0}%) after {}, {message}",
            100.0 * done as f64 / total.max(1) as f64,
            duration_text(self.start.elapsed().as_secs_f64())
        );
        let fields = serde_json::json!({
            "step": done,
            "total_steps": total,
            "phase": p.phase + 1,
            "epoch": p.epoch + 1,
            "epochs": p.epochs,
            "losses": p.losses,
            "output_loss": p.output_loss,
            "samples_per_second": rate.map(|(per_second, _)| per_second * self.batch_size as f64),
            "seconds_left": rate.map(|(_, left)| left),
        });
        reporter().write(Level::Progress, "progress", &line, Some(fields));
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// A loss as printed: four decimals, or four significant digits where
/// decimals would hide it (a normalized MSE of 6e-6 is not 0.0000).
pub fn loss_text(loss: f64) -> String {
    if loss == 0.0 || (1e-3..1e4).contains(&loss.abs()) || !loss.is_finite() {
        format!("{loss:.4}")
    } else {
        format!("{loss:.3e}")
    }
}

/// The rate of a stretch of steps, measured from the first step it saw (a
/// resumed run starts part-way; the stitched pass counts again from one).
#[derive(Debug, Default)]
struct StepRate {
    /// The first step seen of this stretch, and when.
    origin: Option<(usize, Instant)>,
    total: usize,
    /// The last step seen: a stretch that counts again from fewer steps
    /// (the stitched pass after as many blockwise steps) is a new one.
    last: usize,
}

impl StepRate {
    /// Records that `done` of `total` steps are done at `now`; returns the
    /// steps per second and the seconds left, once a step has passed since
    /// the first one seen.
    fn update(&mut self, done: usize, total: usize, now: Instant) -> Option<(f64, f64)> {
        let continues = self.origin.is_some() && total == self.total && done >= self.last;
        if !continues {
            self.origin = Some((done, now));
            self.total = total;
        }
        self.last = done;
        let (first, since) = self.origin?;
        let seconds = now.saturating_duration_since(since).as_secs_f64();
        if done <= first || seconds <= 0.0 {
            return None;
        }
        let steps_per_second = (done - first) as f64 / seconds;
        Some((steps_per_second, total.saturating_sub(done) as f64 / steps_per_second))
    }
}

/// Seconds as `45s`, `3m05s` or `2h07m`.
pub fn duration_text(seconds: f64) -> String {
    let whole = seconds.max(0.0).round() as u64;
    match whole {
        0..=59 => format!("{whole}s"),
        60..=3599 => format!("{}m{:02}s", whole / 60, whole % 60),
        _ => format!("{}h{:02}m", whole / 3600, whole % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Shared {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    #[test]
    fn quiet_silences_the_informative_lines_but_no_warning_or_error() {
        let out = Shared::default();
        let quiet = Reporter::to_writer(true, LogFormat::Text, Box::new(out.clone()));
        quiet.info("auto", "profiling");
        quiet.periodic(&mut Throttle::every(Duration::ZERO), "init", || "layer 3".into());
        quiet.warn("checkpoint", "kept the older one");
        quiet.error("no such file");
        assert_eq!(out.text(), "warning: checkpoint: kept the older one\nerror: no such file\n");
        let out = Shared::default();
        let loud = Reporter::to_writer(false, LogFormat::Text, Box::new(out.clone()));
        loud.info("auto", "profiling");
        loud.periodic(&mut Throttle::every(Duration::ZERO), "init", || "layer 3".into());
        assert_eq!(out.text(), "auto: profiling\ninit: layer 3\n");
    }

    #[test]
    fn json_lines_are_one_object_each_with_level_source_and_message() {
        let out = Shared::default();
        let json = Reporter::to_writer(false, LogFormat::Json, Box::new(out.clone()));
        json.info("bench", "schedule \"tr\" done");
        json.warn("search", "two blocks tie");
        json.error("bad config");
        let lines: Vec<serde_json::Value> =
            out.text().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(
            (lines[0]["level"].as_str(), lines[0]["source"].as_str(), lines[0]["message"].as_str()),
            (Some("info"), Some("bench"), Some("schedule \"tr\" done"))
        );
        assert_eq!(lines[1]["level"], "warning");
        assert_eq!(lines[2]["level"], "error");
        assert!(lines.iter().all(|l| l["time"].as_f64().unwrap() > 1.7e9));
    }

    #[test]
    fn a_throttle_lets_one_line_through_per_period() {
        let mut throttle = Throttle::every(Duration::from_secs(3600));
        assert!(!throttle.due(), "the first line waits a period");
        let mut open = Throttle::every(Duration::ZERO);
        assert!(open.due() && open.due());
        let out = Shared::default();
        let loud = Reporter::to_writer(false, LogFormat::Text, Box::new(out.clone()));
        loud.periodic(&mut throttle, "search", || unreachable!("not made when not due"));
        assert_eq!(out.text(), "");
    }

    #[test]
    fn the_rate_counts_from_the_first_step_seen_and_restarts_with_a_new_stretch() {
        let t0 = Instant::now();
        let mut rate = StepRate::default();
        // A resumed run: first seen at step 40 of 100.
        assert_eq!(rate.update(40, 100, t0), None, "no rate from one step");
        let (per_second, left) = rate.update(50, 100, t0 + Duration::from_secs(5)).unwrap();
        assert!((per_second - 2.0).abs() < 1e-9 && (left - 25.0).abs() < 1e-9, "{per_second} {left}");
        // The stitched pass: a new total, counted again from its first step.
        assert_eq!(rate.update(1, 10, t0 + Duration::from_secs(6)), None);
        let (per_second, left) = rate.update(5, 10, t0 + Duration::from_secs(8)).unwrap();
        assert!((per_second - 2.0).abs() < 1e-9 && (left - 2.5).abs() < 1e-9, "{per_second} {left}");
        // A stitched pass as long as the blockwise run: the same total, but
        // counted again from its own first step, not the blockwise one.
        let (_, _) = rate.update(10, 10, t0 + Duration::from_secs(10)).unwrap();
        assert_eq!(rate.update(1, 10, t0 + Duration::from_secs(100)), None);
        let (per_second, left) = rate.update(3, 10, t0 + Duration::from_secs(101)).unwrap();
        assert!((per_second - 2.0).abs() < 1e-9 && (left - 3.5).abs() < 1e-9, "{per_second} {left}");
    }

    #[test]
    fn durations_read_as_time() {
        assert_eq!(duration_text(44.6), "45s");
        assert_eq!(duration_text(185.0), "3m05s");
        assert_eq!(duration_text(7620.0), "2h07m");
        assert_eq!(duration_text(-1.0), "0s");
    }
}
