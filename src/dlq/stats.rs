//! Counting dead letters: by kind, and by reason [`fingerprint`] (the
//! reason with its numbers and ids masked, so the same failure counts once).

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use crate::dlq::filter::Filter;
use crate::dlq::letter::{dead_letter_stream, DeadLetter, Kind};
use crate::dlq::read::{scan, PAGE};
use crate::error::Error;
use crate::redis::RedisConn;

/// A reason fingerprint and how many dead letters have it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReasonCount {
    /// The reason with numbers, hex ids and UUIDs masked as `#`.
    pub fingerprint: String,
    /// Dead letters with this fingerprint.
    pub count: u64,
    /// The reason of the newest of them, unmasked.
    pub example: String,
}

/// Counts over a dead-letter stream.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Dead letters matched.
    pub count: u64,
    /// Entries of the stream that are not readable dead letters.
    pub undecodable: u64,
    /// Count per consumer group (several groups reading one stream share
    /// its dead-letter stream), largest first.
    pub by_group: Vec<(String, u64)>,
    /// Count per kind, largest first.
    pub by_kind: Vec<(Kind, u64)>,
    /// Count per reason fingerprint, largest first.
    pub by_reason: Vec<ReasonCount>,
    /// The earliest `dead_at` (ms since the Unix epoch).
    pub oldest_dead_at: Option<u64>,
    /// The latest `dead_at` (ms since the Unix epoch).
    pub newest_dead_at: Option<u64>,
    /// The reason of the newest entry.
    pub latest_reason: Option<String>,
    /// Where a count limited in entries or time stopped (the counts cover
    /// what is newer); `None` when everything was counted.
    pub stopped_at: Option<String>,
}

/// Counts the dead letters of `stream` that `filter` matches (its limit and
/// cursor are honoured too).
pub fn stats(conn: &mut RedisConn, stream: &str, filter: &Filter) -> Result<Stats, Error> {
    stats_within(conn, stream, filter, None)
}

/// [`stats`], stopping after `budget` (entries looked at, time) if given.
pub(crate) fn stats_within(
    conn: &mut RedisConn,
    stream: &str,
    filter: &Filter,
    budget: Option<(usize, Duration)>,
) -> Result<Stats, Error> {
    let dlq = dead_letter_stream(stream);
    let mut stats = Stats::default();
    let mut kinds: HashMap<Kind, u64> = HashMap::new();
    let mut groups: HashMap<String, u64> = HashMap::new();
    let mut reasons: HashMap<String, (u64, String, usize)> = HashMap::new();
    let scanned = scan(
        conn,
        &dlq,
        filter.before.as_deref(),
        PAGE,
        budget,
        |id, fields| {
            let Ok(letter) = DeadLetter::from_fields(Some(id), &fields) else {
                stats.undecodable += 1;
                return true;
            };
            if !filter.matches(&letter) {
                return true;
            }
            stats.count += 1;
            *kinds.entry(letter.kind).or_default() += 1;
            match groups.get_mut(&letter.group) {
                Some(n) => *n += 1,
                None => {
                    groups.insert(letter.group.clone(), 1);
                }
            }
            let order = reasons.len();
            reasons
                .entry(fingerprint(&letter.reason))
                .or_insert_with(|| (0, letter.reason.clone(), order))
                .0 += 1;
            stats.oldest_dead_at = Some(
                stats
                    .oldest_dead_at
                    .map_or(letter.dead_at, |t| t.min(letter.dead_at)),
            );
            stats.newest_dead_at = Some(
                stats
                    .newest_dead_at
                    .map_or(letter.dead_at, |t| t.max(letter.dead_at)),
            );
            if stats.latest_reason.is_none() {
                stats.latest_reason = Some(letter.reason);
            }
            filter.limit.is_none_or(|n| stats.count < n as u64)
        },
    )?;
    stats.stopped_at = scanned.stopped_at;
    stats.by_group = groups.into_iter().collect();
    stats
        .by_group
        .sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    stats.by_kind = kinds.into_iter().collect();
    stats
        .by_kind
        .sort_by(|a, b| b.1.cmp(&a.1).then(a.0.as_str().cmp(b.0.as_str())));
    let mut by_reason: Vec<(String, (u64, String, usize))> = reasons.into_iter().collect();
    by_reason.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.1 .2.cmp(&b.1 .2)));
    stats.by_reason = by_reason
        .into_iter()
        .map(|(fingerprint, (count, example, _))| ReasonCount {
            fingerprint,
            count,
            example,
        })
        .collect();
    Ok(stats)
}

/// The reason with what varies between occurrences masked as `#`: UUIDs,
/// and words made of hex digits holding at least one digit (numbers, hex
/// ids, `0x...`), or a number and a unit (`200ms`). Words with other
/// letters (`22P02`, `HTTP2`, `sha256`) stay.
/// `"HTTP 503 for order 1234"` → `"HTTP # for order #"`.
pub fn fingerprint(reason: &str) -> String {
    static UUID: OnceLock<regex::Regex> = OnceLock::new();
    let uuid = UUID.get_or_init(|| {
        regex::Regex::new(r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
            .expect("valid regex")
    });
    let text = uuid.replace_all(reason, "#");
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        let body = word
            .strip_prefix("0x")
            .or_else(|| word.strip_prefix("0X"))
            .unwrap_or(word);
        let digits = word.bytes().take_while(u8::is_ascii_digit).count();
        let unit = &word[digits..];
        if body.bytes().any(|b| b.is_ascii_digit()) && body.bytes().all(|b| b.is_ascii_hexdigit()) {
            out.push('#');
        } else if digits > 0 && unit.len() <= 3 && unit.bytes().all(|b| b.is_ascii_alphabetic()) {
            // A number with a unit: 5s, 200ms, 10KB.
            out.push('#');
            out.push_str(unit);
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_mask_numbers_and_ids() {
        assert_eq!(fingerprint("HTTP 503 for order 1234"), "HTTP # for order #");
        assert_eq!(
            fingerprint("event 6f1c2a7e-8b1d-4c2e-9a33-0c5d7e9f1a2b failed"),
            "event # failed"
        );
        assert_eq!(fingerprint("object deadbeef01 missing"), "object # missing");
        assert_eq!(fingerprint("at 0x7ffe12 (attempt3)"), "at # (attempt3)");
        assert_eq!(fingerprint("no digits here"), "no digits here");
        assert_eq!(
            fingerprint("retry after 1.5s, not 200ms"),
            "retry after #.#s, not #ms"
        );
        assert_eq!(
            fingerprint("postgres 22P02: bad \"p2\" in row 17, order_12"),
            "postgres 22P02: bad \"p2\" in row #, order_#"
        );
    }
}
