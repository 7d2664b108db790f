//! Dead letters as people read them: ages, times, one-line texts, the
//! probe's summary line; and the times people type (`2h`, RFC 3339).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use taskhub::dlq::Stats;

/// Milliseconds since the Unix epoch.
pub fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `ms` since the epoch as an RFC 3339 time to the second (raw past 9999).
pub fn time(ms: u64) -> String {
    const MAX_MS: u64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    if ms > MAX_MS {
        return format!("{ms} ms");
    }
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// A `SystemTime` as [`time`] shows it.
pub fn time_of(t: SystemTime) -> String {
    time(millis(t))
}

/// The one-line summary of `taskhub dlq check`.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_lines() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let at = |secs: u64| millis(now) - secs * 1000;
        assert_eq!(age(at(45), now), "45s");
        assert_eq!(age(at(3 * 3600 + 12 * 60), now), "3h12m");
        assert_eq!(age(at(2 * 86_400 + 4 * 3600), now), "2d4h");
        assert_eq!(age(millis(now) + 5000, now), "0s");
        assert_eq!(one_line("a\nb\u{1b}[31m", 100), "a b\\u{1b}[31m");
        assert_eq!(one_line("abcdef", 3), "abc…");
        assert_eq!(time(u64::MAX), format!("{} ms", u64::MAX));
    }
}
