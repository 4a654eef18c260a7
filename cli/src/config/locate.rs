//! Which line and field of a config file an error is about.

use std::path::Path;

use pipe_bd::error::Error;

/// What is wrong with one field of a config, as a zoo reports it
/// ([`crate::zoo::Zoo::check_config`]); the config loader adds the file
/// and line.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigIssue {
    /// The table (`"data"`, `"teacher"`, `"students"`, `"custom"`; `""` for
    /// the top level).
    pub table: String,
    /// The key within it (`""` for the whole table).
    pub key: String,
    /// For `students`: which entry (zero-based).
    pub entry: Option<usize>,
    /// What is wrong, and what was expected.
    pub message: String,
}

impl ConfigIssue {
    /// An issue with `table.key`.
    pub fn new(table: &str, key: &str, message: String) -> Self {
        Self { table: table.into(), key: key.into(), entry: None, message }
    }

    /// An issue with entry `entry` (zero-based) of the array of tables `table`.
    pub fn in_entry(table: &str, entry: usize, message: String) -> Self {
        Self { table: table.into(), key: String::new(), entry: Some(entry), message }
    }

    /// The dotted field name (`data.dataset`, `students[2]`).
    pub fn field(&self) -> String {
        let table = match self.entry {
            Some(k) => format!("{}[{k}]", self.table),
            None => self.table.clone(),
        };
        match (table.is_empty(), self.key.is_empty()) {
            (true, _) => self.key.clone(),
            (false, true) => table,
            (false, false) => format!("{table}.{}", self.key),
        }
    }

    /// The issue as an error about the config at `path` (`line` where known).
    pub fn into_error(self, path: &Path, line: Option<usize>) -> Error {
        Error::Config { path: path.to_path_buf(), line, field: Some(self.field()), message: self.message }
    }

    /// The issue as an error about a config that did not come from a file
    /// (no path or line to give; the field is named).
    pub fn into_plain_error(self) -> Error {
        self.into_error(Path::new("config"), None)
    }

    /// The line of `text` the issue is about, where it can be found.
    pub(super) fn line_in(&self, text: &str) -> Option<usize> {
        match self.entry {
            Some(k) => {
                let header = text
                    .lines()
                    .enumerate()
                    .filter(|(_, l)| {
                        l.trim().starts_with("[[") && header_name(l.trim()).as_deref() == Some(&self.table)
                    })
                    .nth(k)?
                    .0
                    + 1;
                Some(refine_line(text, header, &self.message))
            }
            None => find_key_line(text, &self.table, &self.key),
        }
    }
}

/// Turns a TOML parse error into an [`Error::Config`] with line and field.
pub(super) fn parse_error(text: &str, path: &Path, error: &toml::de::Error) -> Error {
    let message = error.message().trim().to_string();
    let line = error.span().map(|span| refine_line(text, line_of(text, span.start), &message));
    let field = line.and_then(|l| field_at_line(text, l));
    Error::Config { path: path.to_path_buf(), line, field, message }
}

/// serde reports errors inside internally tagged tables (the `[[students]]`
/// entries) at the start of the whole array; move such an error to the line
/// that holds the offending key (`unknown field `x``) or value (`unknown
/// variant `x``), searching forward from `line`.
fn refine_line(text: &str, line: usize, message: &str) -> usize {
    let Some(token) = message.split('`').nth(1) else {
        return line;
    };
    let is_key = message.contains("unknown field");
    let is_value = message.contains("unknown variant");
    if !is_key && !is_value {
        return line;
    }
    text.lines()
        .enumerate()
        .skip(line.saturating_sub(1))
        .find(|(_, raw)| {
            let mut parts = raw.splitn(2, '=');
            let key = parts.next().unwrap_or("").trim();
            let value = parts.next().unwrap_or("").trim();
            if is_key {
                key == token
            } else {
                value.trim_matches('"') == token
            }
        })
        .map_or(line, |(i, _)| i + 1)
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The dotted `table.key` written on `line` (one-based), if that line is a
/// `key = value` entry; the table name if it is a header or inside a table.
/// Entries of an array of tables are numbered: `students[2].rank`.
fn field_at_line(text: &str, line: usize) -> Option<String> {
    let mut table = String::new();
    let mut array_counts: std::collections::HashMap<String, usize> = Default::default();
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if let Some(name) = header_name(l) {
            table = if l.starts_with("[[") {
                let count = array_counts.entry(name.clone()).or_insert(0);
                *count += 1;
                format!("{name}[{}]", *count - 1)
            } else {
                name
            };
            if i + 1 == line {
                return Some(table);
            }
            continue;
        }
        if i + 1 == line {
            let key = l.split('=').next()?.trim();
            if key.is_empty() || key.starts_with('#') {
                return (!table.is_empty()).then_some(table);
            }
            return Some(if table.is_empty() { key.to_string() } else { format!("{table}.{key}") });
        }
    }
    None
}

fn header_name(line: &str) -> Option<String> {
    let inner = line
        .strip_prefix("[[")
        .and_then(|s| s.split("]]").next())
        .or_else(|| line.strip_prefix('[').and_then(|s| s.split(']').next()))?;
    Some(inner.trim().to_string())
}

/// Line (one-based) where `key` is set inside `[table]` ("" for the top level).
pub(super) fn find_key_line(text: &str, table: &str, key: &str) -> Option<usize> {
    let mut current = String::new();
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if let Some(name) = header_name(l) {
            current = name;
            if current == table && key.is_empty() {
                return Some(i + 1);
            }
            continue;
        }
        if current == table && l.split('=').next().map(str::trim) == Some(key) {
            return Some(i + 1);
        }
    }
    None
}
