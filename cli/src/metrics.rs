//! `metrics.csv`: the one writer and the one reader of a run's loss log
//! (`epoch,step,block,loss,lr`, a row every `train.log_every` steps per
//! block; block 0 is the stitched student's output loss, when the stitched
//! pass has one). `pipebd run` writes it, `pipebd plot` and the tests read it.
//! Also [`write_table`], the writer of the other tables a command leaves
//! (`search.csv`, `pareto.csv`, `bench.csv`), quoted as CSV wants.

use std::path::Path;

use pipe_bd::error::{Error, Result};
use pipe_bd::train::MetricRow;

/// The file's name inside a run folder.
pub const METRICS_FILE: &str = "metrics.csv";

/// The header both sides agree on (the fields of [`MetricRow`], in order).
const HEADER: [&str; 5] = ["epoch", "step", "block", "loss", "lr"];

/// Writes `rows` as `dir/metrics.csv` (atomically: a crash leaves the old
/// file or the new one).
pub fn write_metrics(dir: &Path, rows: &[MetricRow]) -> Result<()> {
    let path = dir.join(METRICS_FILE);
    let mut writer = csv::Writer::from_writer(Vec::new());
    for row in rows {
        writer.serialize(row).map_err(|e| Error::Data { path: path.clone(), message: e.to_string() })?;
    }
    if rows.is_empty() {
        writer
            .write_record(HEADER)
            .map_err(|e| Error::Data { path: path.clone(), message: e.to_string() })?;
    }
    let bytes =
        writer.into_inner().map_err(|e| Error::Data { path: path.clone(), message: e.to_string() })?;
    pipe_bd::fsio::write_atomic(&path, &bytes)
}

/// Writes `header` and `rows` (each a cell per column, already formatted)
/// as the CSV file `path` (atomically); a cell with a comma or a quote is
/// quoted.
pub fn write_table(path: &Path, header: &[&str], rows: impl IntoIterator<Item = Vec<String>>) -> Result<()> {
    let failed = |e: csv::Error| Error::Data { path: path.to_path_buf(), message: e.to_string() };
    let mut writer = csv::Writer::from_writer(Vec::new());
    writer.write_record(header).map_err(failed)?;
    for row in rows {
        writer.write_record(&row).map_err(failed)?;
    }
    let bytes =
        writer.into_inner().map_err(|e| Error::Data { path: path.to_path_buf(), message: e.to_string() })?;
    pipe_bd::fsio::write_atomic(path, &bytes)
}

/// Reads a `metrics.csv` as [`write_metrics`] writes it; an error names the
/// line and the field that is not what a row holds.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricRow>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io("reading", path, e))?;
    let data_error = |message: String| Error::Data { path: path.to_path_buf(), message };
    let mut reader =
        csv::ReaderBuilder::new().trim(csv::Trim::All).from_reader(std::io::BufReader::new(file));
    let header = reader.headers().map_err(|e| data_error(e.to_string()))?.clone();
    if header.iter().ne(HEADER) {
        return Err(data_error(format!(
            "expected the header `{}`, found `{}`",
            HEADER.join(","),
            header.iter().collect::<Vec<_>>().join(",")
        )));
    }
    let mut rows = Vec::new();
    for row in reader.deserialize::<MetricRow>() {
        rows.push(row.map_err(|e| data_error(describe(&e)))?);
    }
    if rows.is_empty() {
        return Err(data_error("no rows: nothing was logged".into()));
    }
    Ok(rows)
}

/// A CSV error as `line N: <field> ...`.
fn describe(error: &csv::Error) -> String {
    let line = error.position().map_or_else(String::new, |p| format!("line {}: ", p.line()));
    match error.kind() {
        csv::ErrorKind::Deserialize { err, .. } => {
            let field = err.field().and_then(|f| HEADER.get(f as usize)).map_or("a field", |name| name);
            format!("{line}the {field} is not what a row holds ({})", err.kind())
        }
        csv::ErrorKind::UnequalLengths { len, .. } => {
            format!("{line}expected {} comma-separated fields, found {len}", HEADER.len())
        }
        _ => format!("{line}{error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_written_are_the_rows_read() {
        let dir = tempfile::tempdir().unwrap();
        let rows = vec![
            MetricRow { epoch: 0, step: 0, block: 1, loss: 0.5, lr: 1e-3 },
            MetricRow { epoch: 0, step: 0, block: 0, loss: 2.25e-7, lr: 3.3e-5 },
            MetricRow { epoch: 1, step: 17, block: 30, loss: f32::MAX, lr: 0.0 },
        ];
        write_metrics(dir.path(), &rows).unwrap();
        let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
        assert!(text.starts_with("epoch,step,block,loss,lr\n"), "{text}");
        let read = read_metrics(&dir.path().join(METRICS_FILE)).unwrap();
        let key = |r: &MetricRow| (r.epoch, r.step, r.block, r.loss.to_bits(), r.lr.to_bits());
        assert_eq!(read.iter().map(key).collect::<Vec<_>>(), rows.iter().map(key).collect::<Vec<_>>());
    }

    #[test]
    fn a_table_quotes_what_needs_quoting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        let rows = vec![vec!["encoder(heads=2, ffn=64)".to_string(), "0.5".into(), String::new()]];
        write_table(&path, &["name", "loss", "kl"], rows).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "name,loss,kl\n\"encoder(heads=2, ffn=64)\",0.5,\n");
    }

    #[test]
    fn a_bad_metrics_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(METRICS_FILE);
        std::fs::write(&path, "epoch,step,block,loss,lr\n0,0,1,0.5,0.001\n0,1,x,0.4,0.001\n").unwrap();
        let error = read_metrics(&path).unwrap_err().to_string();
        assert!(error.contains("line 3") && error.contains("block"), "{error}");
        std::fs::write(&path, "epoch,step,block,loss,lr\n0,0,1,0.5\n").unwrap();
        let error = read_metrics(&path).unwrap_err().to_string();
        assert!(error.contains("line 2") && error.contains("5 comma-separated fields"), "{error}");
        std::fs::write(&path, "epoch,step,loss\n0,0,0.5\n").unwrap();
        let error = read_metrics(&path).unwrap_err().to_string();
        assert!(error.contains("expected the header"), "{error}");
        std::fs::write(&path, "epoch,step,block,loss,lr\n").unwrap();
        assert!(read_metrics(&path).unwrap_err().to_string().contains("no rows"));
    }
}
