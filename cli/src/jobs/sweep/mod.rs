//! `pipebd sweep`: a grid of runs over a base config, resumable, with one
//! `sweep.csv` and a PNG plot of throughput and speedup over `dp`.
//!
//! A sweep file names a base run config and a `[grid]` of dotted config
//! fields, each with a list of values; every combination is one point:
//!
//! ```toml
//! base = "mnist-bench.toml"          # relative to the sweep file
//! out = "runs/sweep-mnist"           # relative to the working directory
//! x = "train.batch_size"             # the plotted axis (default: first non-schedule key)
//! [grid]
//! schedule = ["dp", "tr-dpu", "hybrid"]
//! "train.batch_size" = [128, 256]
//! ```
//!
//! Each finished point is appended to `sweep.csv` at once; a rerun skips
//! the points already there, so an interrupted sweep resumes where it stopped.

pub mod plot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::RunConfig;
use crate::jobs::run::{run, RunFlags};
use crate::zoo::Zoo;
use pipe_bd::error::{Error, Result};

/// A sweep file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    /// The base run config, relative to the sweep file.
    pub base: PathBuf,
    /// Output folder (relative to the working directory).
    pub out: PathBuf,
    /// The swept field drawn on the x axis.
    #[serde(default)]
    pub x: Option<String>,
    /// Dotted config field -> values.
    pub grid: BTreeMap<String, Vec<toml::Value>>,
}

/// One point of the grid: the value of each swept field.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// `(field, value)` in grid order.
    pub values: Vec<(String, toml::Value)>,
}

impl Point {
    /// `field=value,field=value`: the point's id in `sweep.csv`.
    pub fn id(&self) -> String {
        self.values.iter().map(|(k, v)| format!("{k}={}", plain(v))).collect::<Vec<_>>().join(",")
    }
}

fn plain(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string().replace(',', ";"),
    }
}

/// Every combination of the grid's values.
pub fn expand(grid: &BTreeMap<String, Vec<toml::Value>>) -> Vec<Point> {
    let mut points = vec![Point { values: Vec::new() }];
    for (key, values) in grid {
        points = points
            .into_iter()
            .flat_map(|p| {
                values.iter().map(move |v| {
                    let mut values = p.values.clone();
                    values.push((key.clone(), v.clone()));
                    Point { values }
                })
            })
            .collect();
    }
    points
}

/// The base config with the point's fields set; `path` names it in errors.
pub fn apply<Z: Zoo>(zoo: &Z, base: &toml::Table, point: &Point, path: &Path) -> Result<RunConfig> {
    let mut doc = base.clone();
    for (key, value) in &point.values {
        let mut table = &mut doc;
        let parts: Vec<&str> = key.split('.').collect();
        for part in &parts[..parts.len() - 1] {
            let entry =
                table.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = entry.as_table_mut().ok_or_else(|| Error::Config {
                path: path.to_path_buf(),
                line: None,
                field: Some(key.clone()),
                message: format!("`{part}` is not a table in the base config"),
            })?;
        }
        table.insert(parts[parts.len() - 1].to_string(), value.clone());
    }
    let text = toml::to_string(&doc).map_err(|e| Error::Config {
        path: path.to_path_buf(),
        line: None,
        field: None,
        message: e.to_string(),
    })?;
    zoo.parse_config(&text, &path.with_file_name(format!("{} [{}]", file_name(path), point.id())))
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// A TOML error's message, with its line when the parser gives one (its
/// short message alone is empty for some errors).
fn toml_message(e: &toml::de::Error) -> String {
    let short = e.message().trim();
    match e.span() {
        Some(span) if !short.is_empty() => format!("{short} (at byte {})", span.start),
        _ if !short.is_empty() => short.to_string(),
        _ => e.to_string().trim().replace('\n', " "),
    }
}

fn config_error(path: &Path, message: String) -> Error {
    Error::Config { path: path.to_path_buf(), line: None, field: None, message }
}

/// One row of `sweep.csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The point's id.
    pub id: String,
    /// Swept values, as written.
    pub values: Vec<String>,
    /// Training samples per second.
    pub samples_per_second: f64,
    /// Seconds per optimizer step.
    pub step_seconds: f64,
    /// Stitched student accuracy.
    pub student_accuracy: f64,
    /// The plan that ran.
    pub plan: String,
}

const FIXED_COLUMNS: [&str; 4] = ["samples_per_second", "step_seconds", "student_accuracy", "plan"];

/// The columns of a sweep over `keys`: the point, each swept field, then
/// the figures of [`Row`].
fn header(keys: &[String]) -> Vec<String> {
    let mut cols = vec!["point".to_string()];
    cols.extend(keys.iter().cloned());
    cols.extend(FIXED_COLUMNS.iter().map(|c| c.to_string()));
    cols
}

/// The cells of `row`, in [`header`]'s order.
fn record(row: &Row) -> Vec<String> {
    let mut cells = vec![row.id.clone()];
    cells.extend(row.values.iter().cloned());
    cells.push(format!("{:.3}", row.samples_per_second));
    cells.push(format!("{:.6}", row.step_seconds));
    cells.push(format!("{:.6}", row.student_accuracy));
    cells.push(row.plan.clone());
    cells
}

/// Writes `rows` as `sweep.csv` at `path` (atomically), header first.
fn write_rows(path: &Path, keys: &[String], rows: &[Row]) -> Result<()> {
    let header = header(keys);
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    crate::metrics::write_table(path, &header, rows.iter().map(record))
}

/// Appends `row` to the `sweep.csv` at `path` and syncs it to disk.
fn append_row(path: &Path, row: &Row) -> Result<()> {
    let failed = |e: csv::Error| Error::Data {
        path: path.to_path_buf(),
        message: format!("cannot append a row: {e}"),
    };
    let file =
        std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io("opening", path, e))?;
    let mut writer = csv::WriterBuilder::new().has_headers(false).from_writer(file);
    writer.write_record(record(row)).map_err(failed)?;
    let file = writer.into_inner().map_err(|e| Error::io("writing", path, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io("writing", path, e))
}

/// Reads the rows of an existing `sweep.csv` (none if it does not exist).
/// Only whole lines count: a last line without its newline was cut by an
/// interruption, and its point runs again.
pub fn read_rows(path: &Path, keys: &[String]) -> Result<Vec<Row>> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("reading", path, e)),
    };
    let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |last| last + 1);
    let bad = |message: String| Error::Data { path: path.to_path_buf(), message };
    let mut reader = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(&bytes[..whole]);
    let mut records = reader.records();
    let expected = header(keys);
    match records.next() {
        None => return Ok(Vec::new()),
        Some(Err(e)) => return Err(bad(format!("its header cannot be read: {e}"))),
        Some(Ok(found)) if found.iter().eq(expected.iter().map(String::as_str)) => {}
        Some(Ok(found)) => {
            return Err(bad(format!(
                "its columns `{}` are not this sweep's `{}`: use another `out` or remove the file",
                found.iter().collect::<Vec<_>>().join(","),
                expected.join(",")
            )))
        }
    }
    let mut rows = Vec::new();
    for record in records {
        let record = record.map_err(|e| bad(format!("cannot be read as CSV: {e}")))?;
        let line = record.position().map_or(0, |p| p.line());
        if record.len() != expected.len() {
            return Err(bad(format!(
                "line {line} has {} cells, the header {}",
                record.len(),
                expected.len()
            )));
        }
        let number = |i: usize| -> Result<f64> {
            record[i]
                .parse()
                .map_err(|_| bad(format!("line {line}: `{}` is not a number ({})", &record[i], expected[i])))
        };
        let n = keys.len();
        rows.push(Row {
            id: record[0].to_string(),
            values: (1..=n).map(|i| record[i].to_string()).collect(),
            samples_per_second: number(n + 1)?,
            step_seconds: number(n + 2)?,
            student_accuracy: number(n + 3)?,
            plan: record[n + 4].to_string(),
        });
    }
    Ok(rows)
}

/// The most points a sweep may have: a grid beyond it is refused before
/// any point is expanded (a typo such as `[1, 2, ..., 1000]` in three
/// fields would otherwise expand a billion configs).
pub const MAX_POINTS: usize = 1_000;

/// A sweep file read and checked: every point's config built and checked
/// by the zoo, nothing run or written.
pub struct LoadedSweep {
    /// The sweep file's settings.
    pub sweep: SweepConfig,
    /// The swept fields, in grid order.
    pub keys: Vec<String>,
    /// Every point with its config.
    pub points: Vec<(Point, RunConfig)>,
}

/// Reads the sweep at `path` and its base config and checks every point's
/// config (what `pipebd sweep` does before running any point).
pub fn load<Z: Zoo>(zoo: &Z, path: &Path) -> Result<LoadedSweep> {
    let text = pipe_bd::fsio::read_small_text(path)
        .map_err(|e| config_error(path, format!("cannot read the sweep file: {e}")))?;
    let sweep: SweepConfig = toml::from_str(&text).map_err(|e| config_error(path, toml_message(&e)))?;
    if sweep.grid.is_empty() || sweep.grid.values().any(|v| v.is_empty()) {
        return Err(config_error(
            path,
            "`[grid]` needs at least one field, each with at least one value".into(),
        ));
    }
    let count = sweep.grid.values().try_fold(1usize, |n, v| n.checked_mul(v.len()));
    if count.is_none_or(|n| n > MAX_POINTS) {
        let sizes: Vec<String> = sweep.grid.iter().map(|(k, v)| format!("{k}: {}", v.len())).collect();
        return Err(config_error(
            path,
            format!("`[grid]` has more than {MAX_POINTS} points ({}): split the sweep", sizes.join(" x ")),
        ));
    }
    let base_path = path.parent().unwrap_or(Path::new(".")).join(&sweep.base);
    let base_text = pipe_bd::fsio::read_small_text(&base_path).map_err(|e| {
        config_error(path, format!("cannot read the base config {}: {e}", base_path.display()))
    })?;
    let base: toml::Table =
        toml::from_str(&base_text).map_err(|e| config_error(&base_path, toml_message(&e)))?;
    let keys: Vec<String> = sweep.grid.keys().cloned().collect();
    let mut points = Vec::new();
    for point in expand(&sweep.grid) {
        let config = apply(zoo, &base, &point, &base_path)?;
        points.push((point, config));
    }
    Ok(LoadedSweep { sweep, keys, points })
}

/// Runs every point of the sweep at `path` not yet in its `sweep.csv`,
/// then draws `sweep.png`. `say` receives progress lines.
pub fn sweep<Z: Zoo>(zoo: &Z, path: &Path, say: &mut dyn FnMut(&str)) -> Result<Vec<Row>> {
    // Check every point's config before running any.
    let LoadedSweep { sweep, keys, points } = load(zoo, path)?;
    std::fs::create_dir_all(&sweep.out).map_err(|e| Error::io("creating directory", &sweep.out, e))?;
    let csv_path = sweep.out.join("sweep.csv");
    let mut rows = read_rows(&csv_path, &keys)?;
    // Rewrite what is valid (a line cut by an interruption is dropped), then append.
    write_rows(&csv_path, &keys, &rows)?;
    for (i, (point, config)) in points.iter().enumerate() {
        let id = point.id();
        if rows.iter().any(|r| r.id == id) {
            say(&format!("[{}/{}] {id}: already done", i + 1, points.len()));
            continue;
        }
        say(&format!("[{}/{}] {id}", i + 1, points.len()));
        let dir = sweep.out.join("points").join(format!("{i:03}"));
        let report = run(zoo, config, &dir, &RunFlags::default(), &mut |_| {})?;
        let row = Row {
            id: id.clone(),
            values: point.values.iter().map(|(_, v)| plain(v)).collect(),
            samples_per_second: report.samples_per_second,
            step_seconds: report.measured_step_seconds,
            student_accuracy: report.student_accuracy,
            plan: report.plan.clone(),
        };
        append_row(&csv_path, &row)?;
        rows.push(row);
    }
    let x = sweep
        .x
        .clone()
        .or_else(|| keys.iter().find(|k| *k != "schedule").cloned())
        .unwrap_or_else(|| keys[0].clone());
    let png = sweep.out.join("sweep.png");
    crate::jobs::sweep::plot::draw_sweep(&png, &rows, &keys, &x)?;
    say(&format!("wrote {} and {}", csv_path.display(), png.display()));
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_expands_to_every_combination() {
        let mut grid = BTreeMap::new();
        grid.insert("schedule".to_string(), vec!["dp".into(), "tr".into(), "hybrid".into()]);
        grid.insert("train.batch_size".to_string(), vec![128.into(), 256.into()]);
        let points = expand(&grid);
        assert_eq!(points.len(), 6);
        let ids: Vec<String> = points.iter().map(Point::id).collect();
        assert!(ids.contains(&"schedule=tr,train.batch_size=256".to_string()), "{ids:?}");
        let unique: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(unique.len(), 6);
    }

    #[test]
    fn rows_round_trip_through_the_csv_file_and_a_cut_last_line_is_dropped() {
        let keys = vec!["schedule".to_string(), "students".to_string()];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sweep.csv");
        let row = |id: &str, plan: &str| Row {
            id: id.into(),
            values: vec!["dp".into(), "[\"a, b\", 2]".into()],
            samples_per_second: 10.5,
            step_seconds: 0.125,
            student_accuracy: 0.875,
            plan: plan.into(),
        };
        let rows = [row("schedule=dp,students=[\"a, b\", 2]", "{1 | 2}"), row("schedule=tr", "{1-2}")];
        write_rows(&path, &keys, &rows[..1]).unwrap();
        append_row(&path, &rows[1]).unwrap();
        // An interruption in the middle of a third row's line.
        let mut text = std::fs::read(&path).unwrap();
        text.extend_from_slice(b"\"schedule=hybrid\",\"hyb");
        std::fs::write(&path, &text).unwrap();
        assert_eq!(read_rows(&path, &keys).unwrap(), rows);
    }

    #[test]
    fn a_damaged_sweep_csv_is_refused_with_its_path_and_line() {
        let keys = vec!["schedule".to_string()];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sweep.csv");
        let head = header(&keys).join(",");
        let cases = [
            (
                format!("{head}\ndp,dp,fast,0.1,0.9,plan\n"),
                "line 2: `fast` is not a number (samples_per_second)",
            ),
            (format!("{head}\ndp,dp,1,0.1\n"), "line 2 has 4 cells, the header 6"),
            ("point,batch,samples_per_second\n".to_string(), "are not this sweep's"),
        ];
        for (text, expected) in cases {
            std::fs::write(&path, text).unwrap();
            let error = read_rows(&path, &keys).unwrap_err().to_string();
            assert!(error.contains(expected) && error.contains("sweep.csv"), "{error}");
        }
        assert!(read_rows(&dir.path().join("none.csv"), &keys).unwrap().is_empty());
    }
}
