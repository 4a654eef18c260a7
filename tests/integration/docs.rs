//! The README and the guide stay true to the code: every relative link
//! (README.md, ARCHITECTURE.md, docs/*.md) reaches a file that exists and,
//! with an anchor, a heading of that file; every `pipebd <command>` they
//! show is a command the binary knows (`pipebd <command> --help` exits 0).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::common;

/// The markdown files of the guide.
fn pages() -> Vec<PathBuf> {
    let root = common::repo();
    let mut pages = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap().flatten() {
        if entry.path().extension().is_some_and(|e| e == "md") {
            pages.push(entry.path());
        }
    }
    pages.sort();
    pages
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            lines.push(line);
        }
    }
    lines
}

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(page: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(page).unwrap();
    prose(&text)
        .into_iter()
        .filter_map(|l| l.strip_prefix('#').map(|h| h.trim_start_matches('#')))
        .map(slug)
        .collect()
}

/// The targets of `[text](target)` links on the prose lines of `text`.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                found.push(rest[..end].to_string());
                rest = &rest[end..];
            }
        }
    }
    found
}

#[test]
fn every_link_of_the_readme_and_the_guide_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for target in links(&text) {
            if target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file = if file.is_empty() { page.clone() } else { page.parent().unwrap().join(file) };
            checked += 1;
            if !file.exists() {
                broken.push(format!("{}: {target}: no such file", page.display()));
            } else if let Some(anchor) = anchor.filter(|_| file.extension().is_some_and(|e| e == "md")) {
                if !anchors(&file).contains(anchor) {
                    broken.push(format!("{}: {target}: no heading with that anchor", page.display()));
                }
            }
        }
    }
    assert!(checked >= 30, "only {checked} links found: is the guide there?");
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The code of `text`: its fenced blocks and its inline `code` spans.
fn code(text: &str) -> String {
    let mut code = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            code.push_str(line);
            code.push('\n');
        } else {
            for (i, span) in line.split('`').enumerate() {
                if i % 2 == 1 {
                    code.push_str(span);
                    code.push('\n');
                }
            }
        }
    }
    code
}

/// The subcommands named after `pipebd ` or `cargo run --release -- ` in
/// the code of `text`.
fn commands_shown(text: &str) -> BTreeSet<String> {
    let text = &code(text);
    let mut commands = BTreeSet::new();
    for prefix in ["pipebd ", "cargo run --release -- "] {
        for (at, _) in text.match_indices(prefix) {
            let word: String = text[at + prefix.len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '-')
                .collect();
            // `pipebd run`, not `pipebd-fuzz` or a prose word ending a sentence.
            let before = text[..at].chars().last();
            if word.len() > 1
                && !word.starts_with('-')
                && before.is_none_or(|c| !c.is_alphanumeric() && c != '-')
            {
                commands.insert(word);
            }
        }
    }
    commands
}

#[test]
fn every_command_the_readme_and_the_guide_show_is_one_pipebd_knows() {
    let mut shown = BTreeSet::new();
    for page in pages() {
        shown.extend(commands_shown(&std::fs::read_to_string(&page).unwrap()));
    }
    for expected in ["run", "eval", "plot", "search", "export", "check"] {
        assert!(shown.contains(expected), "the guide never shows `pipebd {expected}`: {shown:?}");
    }
    let mut unknown = Vec::new();
    for command in &shown {
        let (code, _, stderr) = common::pipebd(&[command, "--help"]);
        if code != 0 {
            unknown.push(format!("pipebd {command}: {}", stderr.lines().next().unwrap_or("")));
        }
    }
    assert!(unknown.is_empty(), "commands shown that pipebd does not know:\n{}", unknown.join("\n"));
}
