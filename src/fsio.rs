//! Durable file writes: every file the engine leaves behind (reports,
//! checkpoints, traces, plans) is written through here, so that a crash
//! never leaves a half-written file under its final name.

use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// Writes `contents` to `path` through a temporary file and a rename, so a
/// crash never leaves a half-written file under the final name. Creates the
/// parent folder if needed.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating directory", dir, e))?;
    }
    let tmp = path.with_extension("tmp");
    write_synced(&tmp, contents)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("renaming into", path, e))
}

/// Writes `contents` to `path` and flushes it to disk before returning.
pub fn write_synced(path: &Path, contents: &[u8]) -> Result<()> {
    let mut file = std::fs::File::create(path).map_err(|e| Error::io("creating", path, e))?;
    file.write_all(contents).map_err(|e| Error::io("writing", path, e))?;
    file.sync_all().map_err(|e| Error::io("flushing", path, e))
}

/// Makes a rename inside `dir` durable. Not every platform can open a
/// folder, so this is best effort.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The most bytes a config or sweep file may have (a config of 150
/// candidate blocks is about 15 KB).
pub const MAX_TEXT_FILE: u64 = 16 << 20;

/// Reads a small text file (a config, a sweep): a regular file of at most
/// [`MAX_TEXT_FILE`] bytes, so that a path such as `/dev/zero` or a FIFO is
/// refused instead of read forever.
pub fn read_small_text(path: &Path) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    if meta.len() > MAX_TEXT_FILE {
        let message = format!("{} bytes, more than the {MAX_TEXT_FILE} a config may have", meta.len());
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, message));
    }
    std::fs::read_to_string(path)
}
