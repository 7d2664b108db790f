//! Dead letters as people read them: ages, one-line texts, times, the
//! probe's summary line.

use std::time::SystemTime;

use crate::dlq::filter::Filter;
use crate::dlq::letter::{dead_letter_stream, millis};
use crate::dlq::redis_error;
use crate::dlq::stats::{stats, Stats};
use crate::error::Error;
use crate::redis::RedisConn;
/// A monitoring probe: `None` when `<stream>:dlq` holds nothing, else a
/// one-line summary (count, kinds, oldest age, latest reason).
pub fn check(conn: &mut RedisConn, stream: &str) -> Result<Option<String>, Error> {
    let dlq = dead_letter_stream(stream);
    let len: u64 = redis::cmd("XLEN")
        .arg(&dlq)
        .query(conn)
        .map_err(redis_error(&dlq))?;
    if len == 0 {
        return Ok(None);
    }
    let stats = stats(conn, stream, &Filter::default())?;
    Ok(Some(summary_line(&dlq, len, &stats, SystemTime::now())))
}

/// The one-line summary of [`check`], from its parts.
pub fn summary_line(dlq: &str, len: u64, stats: &Stats, now: SystemTime) -> String {
    let kinds: Vec<String> = stats
        .by_kind
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let mut line = format!(
        "{dlq}: {len} dead letter{}",
        if len == 1 { "" } else { "s" }
    );
    if !kinds.is_empty() {
        line.push_str(&format!(" ({})", kinds.join(", ")));
    }
    if stats.undecodable > 0 {
        line.push_str(&format!(", {} unreadable", stats.undecodable));
    }
    if let Some(oldest) = stats.oldest_dead_at {
        line.push_str(&format!(", oldest {} ago", age(oldest, now)));
    }
    if let Some(reason) = &stats.latest_reason {
        line.push_str(&format!(", latest reason: {}", one_line(reason, 200)));
    }
    line
}

/// Whole seconds from `at_ms` (ms since the epoch) to `now`; 0 for a time
/// in the future.
pub fn age_secs(at_ms: u64, now: SystemTime) -> u64 {
    millis(now).saturating_sub(at_ms) / 1000
}

/// A short age: `45s`, `12m`, `3h12m`, `2d4h`.
pub fn age(at_ms: u64, now: SystemTime) -> String {
    let secs = age_secs(at_ms, now);
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        s => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// `text` on one line, control characters escaped, cut to `max` characters.
pub fn one_line(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max.saturating_add(3)));
    for (n, c) in text.chars().enumerate() {
        if n == max {
            out.push('…');
            break;
        }
        match c {
            '\n' | '\r' | '\t' => out.push(' '),
            c if c.is_control() => out.extend(c.escape_default()),
            c => out.push(c),
        }
    }
    out
}
