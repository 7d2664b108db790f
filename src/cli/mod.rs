//! Subcommands of the binary that are more than a call into the library, and
//! what they share: output that tolerates a closed pipe, and text tables.

pub mod consumers;
pub mod dlq;
pub mod docs;
pub mod format;
pub mod produce;
pub mod prune;
pub mod run;
pub mod servers;
pub mod status;

use std::io::Write;

/// Writes `text` to stdout. A reader that went away (`| head`) is not an
/// error worth a message.
pub fn print(text: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(format!("cannot write to stdout: {e}")),
    }
}

/// Plain text columns aligned with spaces (the last one is not padded).
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            text.push_str(cell);
            if i + 1 < widths.len() {
                let pad = widths[i].saturating_sub(cell.chars().count());
                text.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// A library error and its causes on one line, "what: why: why".
pub fn report(e: &taskhub::Error) -> String {
    e.chain()
}

/// Parses a duration flag (`20ms`, `1s`, `5m`).
pub fn duration(s: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{e} (expected a duration such as 20ms, 1s or 5m)"))
}

/// Parses the one stream a command works on. `run` takes several, as a
/// comma-separated `TASKHUB_STREAM` (which every command reads, so that one
/// environment file serves them all): such a list here names no stream.
pub fn one_stream(s: &str) -> Result<String, String> {
    if s.contains(',') {
        return Err(format!(
            "{s:?} names several streams (TASKHUB_STREAM or --stream); this command takes one: give it with --stream"
        ));
    }
    Ok(s.to_owned())
}

/// Parses a count of things done per step (`--chunk`, `--batch`): 0 would
/// do nothing, step after step.
pub fn per_step(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("0 would do nothing at each step; give at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{e} (expected a whole number of at least 1)")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn table_aligns_columns() {
        let t = super::table(
            &["ID", "KIND", "REASON"],
            &[
                vec!["1-0".into(), "exhausted".into(), "boom".into()],
                vec!["22-0".into(), "invalid".into(), "x".into()],
            ],
        );
        assert_eq!(
            t,
            "ID    KIND       REASON\n1-0   exhausted  boom\n22-0  invalid    x\n"
        );
    }
}
