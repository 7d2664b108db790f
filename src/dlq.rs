//! Operating a dead-letter stream (`<stream>:dlq`): what `taskhub dlq` does,
//! as plain functions over a Redis connection (and a PostgreSQL client where
//! one is needed), so a program or a web page can do the same.
//!
//! - [`list`] reads dead letters newest first, through a [`Filter`] (kind,
//!   reason substring or regex, time window, original fields, limit, and a
//!   `before` cursor for pagination); [`show`] reads one; [`stats`] counts
//!   them by kind and by reason [`fingerprint`]; [`check`] is the one-line
//!   summary of a monitoring probe.
//! - [`replay`] puts dead letters back on their original stream with every
//!   original field (so the same `event_id`) plus the audit fields
//!   `replayed_from`, `replayed_at` and `replay_count`. The XADD and the XDEL
//!   from the dead-letter stream happen in one server-side script: atomic
//!   like MULTI/EXEC, but conditional, which MULTI/EXEC cannot be: an entry
//!   that is already gone (replayed or purged by someone else meanwhile) is
//!   not added again, and an XADD that fails deletes nothing. Events whose
//!   effect was already committed are skipped by the normal idempotency layer
//!   when a worker reads them; the report says how many there are, checked in
//!   `processed_events` (the arbiter) when PostgreSQL is at hand (else not
//!   checked).
//! - [`purge`] deletes dead letters.
//! - [`archive`] moves dead letters older than a cutoff to the
//!   `dead_letters_archive` table or to a JSONL file, in chunks: copy (commit,
//!   or write + fsync), read the copy back and compare, and only then XDEL
//!   what was verified. An interruption at any moment leaves every entry in
//!   the stream, in the archive, or in both; never in neither. Running the
//!   archive again finishes the job (the table ignores rows it already has;
//!   a file may then hold an entry twice: readers key on
//!   `(stream, dead_letter_id)`).

use crate::redis_conn::RedisConn;
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::connect;
pub use crate::dead_letter::millis;
use crate::dead_letter::{dead_letter_stream, DeadLetter, Kind};
use crate::error::{Error, ErrorKind};
use crate::event::{parse_entries, Fields};
use crate::fault::{self, Point};

/// Entries read per XREVRANGE page.
const PAGE: usize = 500;
/// Entries fetched, checked and replayed or removed per round trip.
const CHUNK: usize = 100;

/// Audit fields added to a replayed entry (and dropped from the original
/// fields first, so a second replay does not repeat them).
pub const REPLAY_FIELDS: [&str; 3] = ["replayed_from", "replayed_at", "replay_count"];

// ---------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------

/// A Redis connection with the library's timeouts, for these functions
/// (with `tls` for a `rediss://` URL).
pub fn connect_redis(redis_url: &str, tls: &crate::Tls) -> Result<RedisConn, Error> {
    crate::redis_conn::connect(redis_url, tls)
}

/// A PostgreSQL client with the library's connect timeout.
pub fn connect_postgres(database_url: &str) -> Result<postgres::Client, Error> {
    connect::postgres(database_url)
}

fn redis_error(what: &str) -> impl Fn(redis::RedisError) -> Error + '_ {
    move |e| Error::with_source(ErrorKind::Redis, format!("{what}: Redis command failed"), e)
}

fn pg_error(what: &str) -> impl Fn(postgres::Error) -> Error + '_ {
    move |e| Error::with_source(ErrorKind::Postgres, what.to_owned(), e)
}

fn bad_input(message: impl Into<String>) -> Error {
    Error::config(message)
}

// ---------------------------------------------------------------------------
// Filters
// ---------------------------------------------------------------------------

/// How a reason is matched: a substring, or a regular expression.
#[derive(Debug, Clone)]
pub struct ReasonMatch(ReasonInner);

#[derive(Debug, Clone)]
enum ReasonInner {
    Substring(String),
    Regex(regex::Regex),
}

impl ReasonMatch {
    /// Reasons containing `text` (case-sensitive).
    pub fn substring(text: &str) -> ReasonMatch {
        ReasonMatch(ReasonInner::Substring(text.to_owned()))
    }

    /// Reasons matching the regular expression `pattern` (Rust `regex`
    /// syntax, unanchored; `(?i)` makes it case-insensitive).
    pub fn regex(pattern: &str) -> Result<ReasonMatch, Error> {
        regex::Regex::new(pattern)
            .map(|r| ReasonMatch(ReasonInner::Regex(r)))
            .map_err(|e| bad_input(format!("bad reason regex {pattern:?}: {e}")))
    }

    /// Whether `reason` matches.
    pub fn matches(&self, reason: &str) -> bool {
        match &self.0 {
            ReasonInner::Substring(s) => reason.contains(s.as_str()),
            ReasonInner::Regex(r) => r.is_match(reason),
        }
    }
}

/// Which dead letters an operation applies to. Every criterion given must
/// match; the default matches everything.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Any of these kinds (empty: any kind).
    pub kinds: Vec<Kind>,
    /// The reason matches.
    pub reason: Option<ReasonMatch>,
    /// Dead-lettered at or after this time (`dead_at`).
    pub since: Option<SystemTime>,
    /// Dead-lettered at or before this time (`dead_at`).
    pub until: Option<SystemTime>,
    /// Original fields equal to these values (name, value).
    pub fields: Vec<(String, String)>,
    /// At most this many (the newest).
    pub limit: Option<usize>,
    /// Only entries with a dead-letter id lower than this one (older): the
    /// cursor of the next page is the id of the last entry of a page.
    pub before: Option<String>,
}

impl Filter {
    /// Whether `letter` passes every criterion (the limit and the cursor
    /// aside).
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        (self.kinds.is_empty() || self.kinds.contains(&letter.kind))
            && self
                .reason
                .as_ref()
                .is_none_or(|r| r.matches(&letter.reason))
            && self.since.is_none_or(|t| letter.dead_at >= millis(t))
            && self.until.is_none_or(|t| letter.dead_at <= millis(t))
            && self
                .fields
                .iter()
                .all(|(k, v)| letter.field(k) == Some(v.as_bytes()))
    }

    /// Whether no criterion is set (the filter matches every entry).
    pub fn is_everything(&self) -> bool {
        self.kinds.is_empty()
            && self.reason.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.fields.is_empty()
            && self.limit.is_none()
            && self.before.is_none()
    }
}

/// The dead letters an operation applies to: listed ids, or a filter.
#[derive(Debug, Clone)]
pub enum Selection {
    /// These dead-letter ids, in this order.
    Ids(Vec<String>),
    /// Every entry the filter matches.
    Filter(Filter),
}

/// Parses a kind name (`crash-loop` is accepted for `crash_loop`).
pub fn parse_kind(text: &str) -> Result<Kind, Error> {
    Kind::parse(&text.trim().to_ascii_lowercase().replace('-', "_")).ok_or_else(|| {
        let names: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
        bad_input(format!(
            "unknown kind {text:?} (expected one of {})",
            names.join(", ")
        ))
    })
}

/// Parses a point in time: a duration ago (`90s`, `2h`, `3d`) or an RFC 3339
/// time (`2024-05-01T12:00:00Z`, `2024-05-01T14:00:00+02:00`, or a date
/// `2024-05-01`, UTC midnight).
pub fn parse_time(text: &str, now: SystemTime) -> Result<SystemTime, Error> {
    let text = text.trim();
    if let Ok(ago) = humantime::parse_duration(text) {
        return now
            .checked_sub(ago)
            .ok_or_else(|| bad_input(format!("{text:?} ago is before the epoch")));
    }
    let bad = || {
        bad_input(format!(
            "bad time {text:?} (expected a duration ago such as 2h, or an RFC 3339 time such as 2024-05-01T12:00:00Z)"
        ))
    };
    let mut body = text.to_owned();
    if body.len() == 10 {
        body.push_str("T00:00:00Z");
    }
    // humantime reads UTC only: take a numeric offset off and apply it.
    let mut offset_secs: i64 = 0;
    if body.len() > 19 && !body.ends_with('Z') && !body.ends_with('z') {
        let cut = body.len() - 6;
        let tail = &body[cut..];
        let b = tail.as_bytes();
        if (b[0] == b'+' || b[0] == b'-') && b[3] == b':' {
            let h: i64 = tail[1..3].parse().map_err(|_| bad())?;
            let m: i64 = tail[4..6].parse().map_err(|_| bad())?;
            offset_secs = (h * 3600 + m * 60) * if b[0] == b'-' { -1 } else { 1 };
            body.truncate(cut);
        }
    }
    let local = humantime::parse_rfc3339_weak(&body).map_err(|_| bad())?;
    let shifted = if offset_secs >= 0 {
        local.checked_sub(Duration::from_secs(offset_secs.unsigned_abs()))
    } else {
        local.checked_add(Duration::from_secs(offset_secs.unsigned_abs()))
    };
    shifted.ok_or_else(bad)
}

/// Whether `id` looks like a stream entry id (`1700000000000-0` or
/// `1700000000000`).
pub(crate) fn valid_id(id: &str) -> bool {
    let mut parts = id.splitn(2, '-');
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    parts.next().is_some_and(digits) && parts.next().is_none_or(digits)
}

fn check_ids(ids: &[String]) -> Result<(), Error> {
    match ids.iter().find(|id| !valid_id(id)) {
        Some(id) => Err(bad_input(format!(
            "{id:?} is not a dead-letter id (they look like 1700000000000-0)"
        ))),
        None => Ok(()),
    }
}

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

/// Walks the dead-letter stream newest first, from `before` (exclusive) or
/// the end, a page per round trip, until `visit` returns false.
fn scan(
    conn: &mut RedisConn,
    dlq: &str,
    before: Option<&str>,
    mut visit: impl FnMut(String, Fields) -> bool,
) -> Result<(), Error> {
    if let Some(id) = before {
        check_ids(std::slice::from_ref(&id.to_owned()))?;
    }
    let mut end = before.map_or_else(|| "+".to_owned(), |id| format!("({id}"));
    loop {
        let value: redis::Value = redis::cmd("XREVRANGE")
            .arg(dlq)
            .arg(&end)
            .arg("-")
            .arg("COUNT")
            .arg(PAGE)
            .query(conn)
            .map_err(redis_error(dlq))?;
        let entries = parse_entries(value)
            .map_err(|e| Error::new(ErrorKind::Redis, format!("{dlq}: {e}")))?;
        let n = entries.len();
        let Some(last) = entries.last() else {
            return Ok(());
        };
        end = format!("({}", last.id);
        for entry in entries {
            if let Some(fields) = entry.fields {
                if !visit(entry.id, fields) {
                    return Ok(());
                }
            }
        }
        if n < PAGE {
            return Ok(());
        }
    }
}

fn decode(id: String, fields: &Fields, dlq: &str) -> Option<DeadLetter> {
    match DeadLetter::from_fields(Some(id.clone()), fields) {
        Ok(letter) => Some(letter),
        Err(why) => {
            log::warn!("{dlq}/{id}: not a readable dead letter ({why}); skipped");
            None
        }
    }
}

/// The dead letters of `stream` (in `<stream>:dlq`) that `filter` matches,
/// newest first. Entries that cannot be decoded are skipped with a warning.
pub fn list(conn: &mut RedisConn, stream: &str, filter: &Filter) -> Result<Vec<DeadLetter>, Error> {
    let mut out = Vec::new();
    each_match(conn, stream, filter, |letter| out.push(letter))?;
    Ok(out)
}

/// Calls `f` with each dead letter `filter` matches, newest first, up to its
/// limit.
fn each_match(
    conn: &mut RedisConn,
    stream: &str,
    filter: &Filter,
    mut f: impl FnMut(DeadLetter),
) -> Result<(), Error> {
    let dlq = dead_letter_stream(stream);
    if filter.limit == Some(0) {
        return Ok(());
    }
    let mut n = 0;
    scan(conn, &dlq, filter.before.as_deref(), |id, fields| {
        if let Some(letter) = decode(id, &fields, &dlq) {
            if filter.matches(&letter) {
                f(letter);
                n += 1;
            }
        }
        filter.limit.is_none_or(|limit| n < limit)
    })
}

/// Ids of the entries `filter` matches, newest first (only the ids are kept,
/// so a large selection costs little memory).
fn matching_ids(conn: &mut RedisConn, stream: &str, filter: &Filter) -> Result<Vec<String>, Error> {
    let mut ids = Vec::new();
    each_match(conn, stream, filter, |letter| ids.extend(letter.id))?;
    Ok(ids)
}

/// Reads entries by id in one round trip: `None` for ids not in the stream.
fn fetch(conn: &mut RedisConn, dlq: &str, ids: &[String]) -> Result<Vec<Option<Fields>>, Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for id in ids {
        pipe.cmd("XRANGE")
            .arg(dlq)
            .arg(id)
            .arg(id)
            .arg("COUNT")
            .arg(1);
    }
    let replies: Vec<redis::Value> = pipe.query(conn).map_err(redis_error(dlq))?;
    replies
        .into_iter()
        .map(|reply| {
            let mut entries = parse_entries(reply)
                .map_err(|e| Error::new(ErrorKind::Redis, format!("{dlq}: {e}")))?;
            Ok(entries.pop().and_then(|e| e.fields))
        })
        .collect()
}

/// One dead letter by its id in `<stream>:dlq`; `None` when it is not there.
pub fn show(conn: &mut RedisConn, stream: &str, id: &str) -> Result<Option<DeadLetter>, Error> {
    let dlq = dead_letter_stream(stream);
    let ids = [id.to_owned()];
    check_ids(&ids)?;
    match fetch(conn, &dlq, &ids)?.pop().flatten() {
        None => Ok(None),
        Some(fields) => DeadLetter::from_fields(Some(id.to_owned()), &fields)
            .map(Some)
            .map_err(|why| {
                Error::new(
                    ErrorKind::Redis,
                    format!("{dlq}/{id}: not a readable dead letter: {why}"),
                )
            }),
    }
}

// ---------------------------------------------------------------------------
// Stats and check
// ---------------------------------------------------------------------------

/// A reason fingerprint and how many dead letters have it.
#[derive(Debug, Clone, PartialEq, Eq)]
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
pub struct Stats {
    /// Dead letters matched.
    pub count: u64,
    /// Entries of the stream that are not readable dead letters.
    pub undecodable: u64,
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
}

/// Counts the dead letters of `stream` that `filter` matches (its limit and
/// cursor are honoured too).
pub fn stats(conn: &mut RedisConn, stream: &str, filter: &Filter) -> Result<Stats, Error> {
    let dlq = dead_letter_stream(stream);
    let mut stats = Stats::default();
    let mut kinds: HashMap<Kind, u64> = HashMap::new();
    let mut reasons: HashMap<String, (u64, String, usize)> = HashMap::new();
    scan(conn, &dlq, filter.before.as_deref(), |id, fields| {
        let Ok(letter) = DeadLetter::from_fields(Some(id), &fields) else {
            stats.undecodable += 1;
            return true;
        };
        if !filter.matches(&letter) {
            return true;
        }
        stats.count += 1;
        *kinds.entry(letter.kind).or_default() += 1;
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
    })?;
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

// ---------------------------------------------------------------------------
// JSON
// ---------------------------------------------------------------------------

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Raw fields as a JSON object: a UTF-8 value (without NUL, which
/// PostgreSQL's jsonb refuses) as a string, any other as `{"hex": "..."}`; a
/// name that is not UTF-8 as `hex:<hex>`. `None` when two fields share a name
/// (an object cannot keep both).
pub fn fields_json(fields: &[(Vec<u8>, Vec<u8>)]) -> Option<Map<String, Value>> {
    let mut map = Map::with_capacity(fields.len());
    for (k, v) in fields {
        let key = match std::str::from_utf8(k) {
            Ok(s) if !s.contains('\0') => s.to_owned(),
            _ => format!("hex:{}", hex(k)),
        };
        let value = match std::str::from_utf8(v) {
            Ok(s) if !s.contains('\0') => Value::String(s.to_owned()),
            _ => json!({ "hex": hex(v) }),
        };
        if map.insert(key, value).is_some() {
            return None;
        }
    }
    Some(map)
}

/// A time in ms since the epoch as RFC 3339 (with milliseconds when
/// `with_millis`), or `"<n> ms"` for a time humantime cannot format (year
/// 10000 and later): a corrupted field must not crash a command or a page.
pub fn format_time(ms: u64, with_millis: bool) -> String {
    const MAX_MS: u64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    if ms > MAX_MS {
        return format!("{ms} ms");
    }
    let t = UNIX_EPOCH + Duration::from_millis(ms);
    if with_millis {
        humantime::format_rfc3339_millis(t).to_string()
    } else {
        humantime::format_rfc3339_seconds(t).to_string()
    }
}

fn rfc3339(ms: u64) -> String {
    format_time(ms, true)
}

/// A dead letter as one JSON object, for tools (`taskhub dlq list --json`)
/// and pages: ids, kind, reason and its fingerprint, times in ms and RFC 3339,
/// the attempt history, and the original fields (see [`fields_json`]).
pub fn letter_json(letter: &DeadLetter) -> Value {
    let history: Vec<Value> = letter
        .history
        .iter()
        .map(|a| {
            let at = a.at.map(millis);
            json!({
                "attempt": a.attempt,
                "at": at,
                "at_rfc3339": at.map(rfc3339),
                "error": a.error,
            })
        })
        .collect();
    let fields = fields_json(&letter.fields).unwrap_or_else(|| {
        // Repeated names: keep them all, suffixed with their position.
        let mut map = Map::new();
        for (i, (k, v)) in letter.fields.iter().enumerate() {
            let one = fields_json(&[(k.clone(), v.clone())]).unwrap_or_default();
            for (name, value) in one {
                map.insert(format!("{name}#{i}"), value);
            }
        }
        map
    });
    json!({
        "id": letter.id,
        "original_id": letter.original_id,
        "stream": letter.stream,
        "group": letter.group,
        "consumer": letter.consumer,
        "event_id": letter.event_id,
        "kind": letter.kind.as_str(),
        "reason": letter.reason,
        "fingerprint": fingerprint(&letter.reason),
        "attempts": letter.attempts,
        "first_failed_at": letter.first_failed_at,
        "first_failed_at_rfc3339": rfc3339(letter.first_failed_at),
        "dead_at": letter.dead_at,
        "dead_at_rfc3339": rfc3339(letter.dead_at),
        "history": history,
        "fields": fields,
    })
}

// ---------------------------------------------------------------------------
// Replay
// ---------------------------------------------------------------------------

/// How a replay runs.
#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    /// Report what would happen; change nothing.
    pub dry_run: bool,
    /// At most this many entries per second (`None`: as fast as possible).
    pub rate: Option<f64>,
    /// The idempotency scope to check (default: each dead letter's group,
    /// which is the worker's default scope).
    pub scope: Option<String>,
}

/// Where "already processed" was looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessedCheck {
    /// `processed_events` in PostgreSQL: the truth. (The Redis markers are
    /// not asked: they speak for one database, which only PostgreSQL can
    /// name; without it, nothing is checked.)
    Postgres,
}

impl ProcessedCheck {
    /// `postgres` or `redis-marker`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessedCheck::Postgres => "postgres",
        }
    }
}

/// One dead letter of a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayItem {
    /// Its dead-letter id.
    pub id: String,
    /// Its event_id, when it has one.
    pub event_id: Option<String>,
    /// The stream it goes back to.
    pub stream: String,
    /// Its effect is already committed: the worker will skip it as a
    /// duplicate.
    pub already_processed: bool,
    /// Its new entry id in `stream` (`None` in a dry run or on failure).
    pub replayed_as: Option<String>,
    /// Why it could not be replayed (it stays in the dead-letter stream).
    pub error: Option<String>,
}

/// What a replay did (or, in a dry run, would do).
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    /// Nothing was changed.
    pub dry_run: bool,
    /// The dead letters found, in the order they were handled.
    pub items: Vec<ReplayItem>,
    /// Ids asked for that are not (or no longer) in the dead-letter stream.
    pub not_found: Vec<String>,
    /// Where "already processed" was looked up (`None`: nothing to check).
    pub checked_with: Option<ProcessedCheck>,
}

impl ReplayReport {
    /// Entries put back on their stream (in a dry run: that would be).
    pub fn replayed(&self) -> usize {
        self.items
            .iter()
            .filter(|i| i.error.is_none() && (self.dry_run || i.replayed_as.is_some()))
            .count()
    }

    /// Of those, how many the worker will skip as already processed.
    pub fn already_processed(&self) -> usize {
        self.items
            .iter()
            .filter(|i| i.error.is_none() && i.already_processed)
            .count()
    }

    /// Entries that could not be replayed (they stay dead letters).
    pub fn failed(&self) -> usize {
        self.items.iter().filter(|i| i.error.is_some()).count()
    }
}

/// XADD to the original stream and XDEL from the dead-letter stream, as one
/// atomic step, only when the dead letter is still there. The XADD comes
/// first: if it fails (say the key is not a stream), nothing was changed.
/// KEYS: dead-letter stream, original stream. ARGV: dead-letter id, then
/// field, value, field, value...
const REPLAY_SCRIPT: &str = r"
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return false end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], ARGV[1])
return id
";

/// The fields a replayed entry carries: the original ones (earlier audit
/// fields dropped) and the new audit fields.
pub fn replay_fields(letter: &DeadLetter, now: SystemTime) -> Fields {
    let previous: u64 = letter
        .field("replay_count")
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut fields: Fields = letter
        .fields
        .iter()
        .filter(|(k, _)| !REPLAY_FIELDS.iter().any(|a| a.as_bytes() == k.as_slice()))
        .cloned()
        .collect();
    let audit = [
        letter.id.clone().unwrap_or_default(),
        millis(now).to_string(),
        (previous + 1).to_string(),
    ];
    for (name, value) in REPLAY_FIELDS.iter().zip(audit) {
        fields.push((name.as_bytes().to_vec(), value.into_bytes()));
    }
    fields
}

/// Which of `letters` are already processed, in their scopes.
fn already_processed(
    pg: Option<&mut postgres::Client>,
    letters: &[DeadLetter],
    scope: Option<&str>,
) -> Result<Vec<bool>, Error> {
    if letters.is_empty() {
        return Ok(Vec::new());
    }
    let scope_of = |l: &DeadLetter| scope.unwrap_or(&l.group).to_owned();
    match pg {
        Some(pg) => {
            let mut by_scope: HashMap<String, Vec<String>> = HashMap::new();
            for l in letters {
                if let Some(id) = &l.event_id {
                    by_scope.entry(scope_of(l)).or_default().push(id.clone());
                }
            }
            let mut done: HashSet<(String, String)> = HashSet::new();
            for (scope, ids) in by_scope {
                let rows = pg
                    .query(
                        "SELECT event_id FROM processed_events WHERE scope = $1 AND event_id = ANY($2)",
                        &[&scope, &ids],
                    )
                    .map_err(pg_error("cannot read processed_events"))?;
                for row in rows {
                    done.insert((scope.clone(), row.get(0)));
                }
            }
            Ok(letters
                .iter()
                .map(|l| {
                    l.event_id
                        .as_ref()
                        .is_some_and(|id| done.contains(&(scope_of(l), id.clone())))
                })
                .collect())
        }
        None => Ok(vec![false; letters.len()]),
    }
}

/// Puts the selected dead letters of `stream` back on their original stream
/// (see the module documentation). With `pg`, "already processed" is looked
/// up in `processed_events`, else not at all. `progress` is called
/// with (done, total) after each chunk. A filter selection is replayed oldest
/// first; ids in the order given.
pub fn replay(
    conn: &mut RedisConn,
    mut pg: Option<&mut postgres::Client>,
    stream: &str,
    selection: &Selection,
    options: &ReplayOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ReplayReport, Error> {
    if let Some(rate) = options.rate {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(bad_input(format!(
                "bad rate {rate}: expected a positive number"
            )));
        }
    }
    let dlq = dead_letter_stream(stream);
    let ids = selected_ids(conn, stream, selection)?;
    let total = ids.len();
    let mut report = ReplayReport {
        dry_run: options.dry_run,
        checked_with: pg.is_some().then_some(ProcessedCheck::Postgres),
        ..ReplayReport::default()
    };
    let started = Instant::now();
    let mut sent = 0usize;
    let mut done = 0usize;
    for chunk in ids.chunks(CHUNK) {
        let done_sent = sent;
        let fetched = fetch(conn, &dlq, chunk).map_err(|e| progress_error(e, &report, total))?;
        let mut letters = Vec::with_capacity(chunk.len());
        for (id, fields) in chunk.iter().zip(fetched) {
            let letter = fields.map(|f| DeadLetter::from_fields(Some(id.clone()), &f));
            match letter {
                None => report.not_found.push(id.clone()),
                Some(Ok(letter)) => letters.push(letter),
                Some(Err(why)) => report.items.push(ReplayItem {
                    id: id.clone(),
                    event_id: None,
                    stream: stream.to_owned(),
                    already_processed: false,
                    replayed_as: None,
                    error: Some(format!("not a readable dead letter: {why}")),
                }),
            }
        }
        let processed = already_processed(pg.as_deref_mut(), &letters, options.scope.as_deref())
            .map_err(|e| progress_error(e, &report, total))?;
        let items: Vec<ReplayItem> = letters
            .iter()
            .zip(&processed)
            .map(|(l, &p)| ReplayItem {
                id: l.id.clone().unwrap_or_default(),
                event_id: l.event_id.clone(),
                stream: l.stream.clone(),
                already_processed: p,
                replayed_as: None,
                error: None,
            })
            .collect();
        if options.dry_run {
            report.items.extend(items);
        } else {
            // Without a rate, one round trip per chunk; with one, one entry
            // at a time, each at its due time.
            let group = if options.rate.is_some() { 1 } else { CHUNK };
            let mut items = items.into_iter();
            for letters in letters.chunks(group) {
                if let Some(rate) = options.rate {
                    let due = started + Duration::from_secs_f64(sent as f64 / rate);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
                let now = SystemTime::now();
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for l in letters {
                    let mut eval = redis::cmd("EVAL");
                    eval.arg(REPLAY_SCRIPT)
                        .arg(2)
                        .arg(&dlq)
                        .arg(&l.stream)
                        .arg(l.id.as_deref().unwrap_or_default());
                    for (k, v) in replay_fields(l, now) {
                        eval.arg(k).arg(v);
                    }
                    pipe.add_command(eval);
                }
                let results: Vec<redis::RedisResult<Option<String>>> = pipe
                    .query(conn)
                    .map_err(|e| progress_error(redis_error(&dlq)(e), &report, total))?;
                sent += letters.len();
                for (mut item, result) in items.by_ref().take(letters.len()).zip(results) {
                    match result {
                        Ok(Some(new_id)) => item.replayed_as = Some(new_id),
                        // Replayed or purged by someone else since it was read.
                        Ok(None) => {
                            report.not_found.push(item.id);
                            continue;
                        }
                        Err(e) => item.error = Some(format!("replay failed: {e}")),
                    }
                    report.items.push(item);
                }
                if options.rate.is_some() {
                    progress(done + sent - done_sent, total);
                }
            }
        }
        done += chunk.len();
        progress(done, total);
    }
    Ok(report)
}

/// An error in the middle of a bulk operation, with how far it got.
fn progress_error(e: Error, report: &ReplayReport, total: usize) -> Error {
    let done = report.replayed();
    if done == 0 || report.dry_run {
        return e;
    }
    Error::with_source(
        e.kind(),
        format!("stopped after replaying {done} of {total} dead letters"),
        e,
    )
}

/// The ids a selection names: given ids as they are (checked), a filter's
/// matches oldest first.
fn selected_ids(
    conn: &mut RedisConn,
    stream: &str,
    selection: &Selection,
) -> Result<Vec<String>, Error> {
    match selection {
        Selection::Ids(ids) => {
            check_ids(ids)?;
            let mut seen = HashSet::new();
            Ok(ids.iter().filter(|id| seen.insert(*id)).cloned().collect())
        }
        Selection::Filter(filter) => {
            let mut ids = matching_ids(conn, stream, filter)?;
            ids.reverse();
            Ok(ids)
        }
    }
}

// ---------------------------------------------------------------------------
// Purge
// ---------------------------------------------------------------------------

/// What a purge did (or, in a dry run, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Nothing was removed.
    pub dry_run: bool,
    /// Entries removed (in a dry run: that would be).
    pub removed: usize,
    /// Ids asked for that are not in the dead-letter stream.
    pub not_found: Vec<String>,
}

/// Deletes the selected dead letters of `stream` (a dry run only counts
/// them).
pub fn purge(
    conn: &mut RedisConn,
    stream: &str,
    selection: &Selection,
    dry_run: bool,
) -> Result<PurgeReport, Error> {
    let dlq = dead_letter_stream(stream);
    let ids = selected_ids(conn, stream, selection)?;
    let mut report = PurgeReport {
        dry_run,
        ..PurgeReport::default()
    };
    for chunk in ids.chunks(CHUNK * 5) {
        if dry_run {
            for (id, fields) in chunk.iter().zip(fetch(conn, &dlq, chunk)?) {
                match fields {
                    Some(_) => report.removed += 1,
                    None => report.not_found.push(id.clone()),
                }
            }
            continue;
        }
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.cmd("XDEL").arg(&dlq).arg(id);
        }
        let deleted: Vec<u64> = pipe.query(conn).map_err(redis_error(&dlq))?;
        for (id, n) in chunk.iter().zip(deleted) {
            if n == 0 {
                report.not_found.push(id.clone());
            } else {
                report.removed += 1;
            }
        }
    }
    Ok(report)
}

// ---------------------------------------------------------------------------
// Archive
// ---------------------------------------------------------------------------

/// Where [`archive`] copies dead letters to.
pub enum ArchiveTarget<'a> {
    /// The `dead_letters_archive` table (see `migrations/`).
    Postgres(&'a mut postgres::Client),
    /// A JSONL file, appended to (created when missing).
    File(&'a Path),
}

/// What an archive did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArchiveReport {
    /// Entries selected (older than the cutoff and matching the filter).
    pub selected: usize,
    /// Entries copied, verified and removed from the dead-letter stream.
    pub archived: usize,
    /// Entries left in the dead-letter stream, with why.
    pub kept: Vec<(String, String)>,
}

/// One archive record: the table's columns, and a JSONL line.
struct Record {
    id: String,
    event_id: Option<String>,
    kind: Option<String>,
    reason: Option<String>,
    /// The whole dead-letter entry, raw fields as a JSON object.
    fields: Value,
}

fn no_nul(s: &str) -> String {
    s.replace('\0', "\u{fffd}")
}

impl Record {
    fn line(&self, stream: &str, archived_at: &str) -> String {
        json!({
            "stream": stream,
            "dead_letter_id": self.id,
            "event_id": self.event_id,
            "kind": self.kind,
            "reason": self.reason,
            "archived_at": archived_at,
            "fields": self.fields,
        })
        .to_string()
    }
}

/// Moves the dead letters of `stream` that `filter` matches (typically
/// `until` = now − age) to `target`, oldest first, `chunk` at a time: copy,
/// verify the copy, and only then delete from the stream. Entries whose copy
/// cannot be verified stay in the stream and are listed in the report.
pub fn archive(
    conn: &mut RedisConn,
    stream: &str,
    filter: &Filter,
    mut target: ArchiveTarget<'_>,
    chunk: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ArchiveReport, Error> {
    let dlq = dead_letter_stream(stream);
    let mut ids = matching_ids(conn, stream, filter)?;
    ids.reverse();
    let total = ids.len();
    let mut report = ArchiveReport {
        selected: total,
        ..ArchiveReport::default()
    };
    let mut done = 0;
    for ids in ids.chunks(chunk.max(1)) {
        let mut records = Vec::with_capacity(ids.len());
        for (id, fields) in ids.iter().zip(fetch(conn, &dlq, ids)?) {
            let Some(fields) = fields else {
                continue; // removed meanwhile: nothing to archive
            };
            let Some(map) = fields_json(&fields) else {
                report.kept.push((
                    id.clone(),
                    "two fields share a name; JSON cannot keep both".into(),
                ));
                continue;
            };
            let text = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k.as_slice() == name.as_bytes())
                    .map(|(_, v)| no_nul(&String::from_utf8_lossy(v)))
            };
            records.push(Record {
                id: id.clone(),
                event_id: text("event_id"),
                kind: text("kind"),
                reason: text("reason"),
                fields: Value::Object(map),
            });
        }
        let verified = match &mut target {
            ArchiveTarget::Postgres(pg) => copy_to_postgres(pg, stream, &records),
            ArchiveTarget::File(path) => copy_to_file(path, stream, &records),
        }
        .map_err(|e| {
            if report.archived == 0 {
                e
            } else {
                Error::with_source(
                    e.kind(),
                    format!(
                        "stopped after archiving {} of {total} dead letters",
                        report.archived
                    ),
                    e,
                )
            }
        })?;
        let mut to_delete = Vec::with_capacity(records.len());
        for (record, ok) in records.iter().zip(verified) {
            if ok {
                to_delete.push(record.id.clone());
            } else {
                report.kept.push((
                    record.id.clone(),
                    "the archive holds a different copy, or none; not removed".into(),
                ));
            }
        }
        if let Some(first) = to_delete.first() {
            fault::hit(Point::ArchiveAfterCopy, first);
            let deleted: u64 = redis::cmd("XDEL")
                .arg(&dlq)
                .arg(&to_delete)
                .query(conn)
                .map_err(redis_error(&dlq))?;
            log::debug!("{dlq}: archived {} (removed {deleted})", to_delete.len());
            report.archived += to_delete.len();
        }
        done += ids.len();
        progress(done, total);
    }
    Ok(report)
}

/// Inserts the records (existing rows are kept) and commits, then reads them
/// back: `true` for each record whose row holds exactly its fields.
fn copy_to_postgres(
    pg: &mut postgres::Client,
    stream: &str,
    records: &[Record],
) -> Result<Vec<bool>, Error> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    let event_ids: Vec<Option<&str>> = records.iter().map(|r| r.event_id.as_deref()).collect();
    let kinds: Vec<Option<&str>> = records.iter().map(|r| r.kind.as_deref()).collect();
    let reasons: Vec<Option<&str>> = records.iter().map(|r| r.reason.as_deref()).collect();
    let fields: Vec<&Value> = records.iter().map(|r| &r.fields).collect();
    let mut tx = pg
        .transaction()
        .map_err(pg_error("archive: cannot begin a transaction"))?;
    tx.execute(
        "INSERT INTO dead_letters_archive (stream, dead_letter_id, event_id, kind, reason, fields) \
         SELECT $1, t.id, t.event_id, t.kind, t.reason, t.fields \
         FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::jsonb[]) \
              AS t(id, event_id, kind, reason, fields) \
         ON CONFLICT (stream, dead_letter_id) DO NOTHING",
        &[&stream, &ids, &event_ids, &kinds, &reasons, &fields],
    )
    .map_err(pg_error(
        "archive: cannot insert into dead_letters_archive (did `taskhub migrate` run?)",
    ))?;
    tx.commit().map_err(pg_error("archive: cannot commit"))?;
    let rows = pg
        .query(
            "SELECT dead_letter_id, fields FROM dead_letters_archive \
             WHERE stream = $1 AND dead_letter_id = ANY($2)",
            &[&stream, &ids],
        )
        .map_err(pg_error("archive: cannot read dead_letters_archive back"))?;
    let stored: HashMap<String, Value> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    Ok(records
        .iter()
        .map(|r| stored.get(&r.id) == Some(&r.fields))
        .collect())
}

fn file_error<'a>(path: &'a Path, what: &str) -> impl Fn(std::io::Error) -> Error + 'a {
    let what = what.to_owned();
    move |e| {
        Error::with_source(
            ErrorKind::Config,
            format!("archive file {}: {what}", path.display()),
            e,
        )
    }
}

/// Opens the archive file, to append (created with mode 0600: dead letters
/// carry payloads) or to read back. A symbolic link at `path` is refused
/// (`O_NOFOLLOW`): whoever can write the directory must not be able to
/// point the archive at another file.
fn open_archive(path: &Path, append: bool) -> Result<File, Error> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut options = OpenOptions::new();
    options.read(true).custom_flags(libc::O_NOFOLLOW);
    if append {
        options.create(true).append(true).mode(0o600);
    }
    options.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            Error::with_source(
                ErrorKind::Config,
                format!(
                    "archive file {}: is a symbolic link; refusing to follow it (give the real path)",
                    path.display()
                ),
                e,
            )
        } else {
            file_error(path, if append { "cannot open" } else { "cannot reopen" })(e)
        }
    })
}

/// Appends the records as JSON lines, fsyncs, then reads what was appended
/// back: `true` for each record found with exactly its fields.
fn copy_to_file(path: &Path, stream: &str, records: &[Record]) -> Result<Vec<bool>, Error> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let created = std::fs::symlink_metadata(path).is_err();
    let mut file = open_archive(path, true)?;
    let start = file
        .metadata()
        .map_err(file_error(path, "cannot stat"))?
        .len();
    let mut buf = String::new();
    if start > 0 {
        // A line cut short by an earlier interruption must not swallow ours.
        let mut last = [0u8; 1];
        file.seek(SeekFrom::Start(start - 1))
            .and_then(|_| file.read_exact(&mut last))
            .map_err(file_error(path, "cannot read"))?;
        if last[0] != b'\n' {
            buf.push('\n');
        }
    }
    let archived_at = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
    for r in records {
        buf.push_str(&r.line(stream, &archived_at));
        buf.push('\n');
    }
    file.write_all(buf.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(file_error(path, "cannot write"))?;
    if created {
        // Make the new directory entry durable too.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(file_error(path, "cannot sync its directory"))?;
        }
    }
    // Read back through a fresh handle, from where this write began.
    let mut back = String::new();
    let mut reader = open_archive(path, false)?;
    reader
        .seek(SeekFrom::Start(start))
        .and_then(|_| reader.read_to_string(&mut back))
        .map_err(file_error(path, "cannot read back"))?;
    let mut found: HashMap<String, Value> = HashMap::new();
    for line in back.lines() {
        let Ok(Value::Object(mut doc)) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if doc.get("stream").and_then(Value::as_str) != Some(stream) {
            continue;
        }
        if let (Some(Value::String(id)), Some(fields)) =
            (doc.remove("dead_letter_id"), doc.remove("fields"))
        {
            found.insert(id, fields);
        }
    }
    Ok(records
        .iter()
        .map(|r| found.get(&r.id) == Some(&r.fields))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A permanent dead letter of entry 1-0 on stream `s`, with `fields`.
    fn sample_letter(fields: Fields) -> DeadLetter {
        DeadLetter {
            id: Some("9-0".into()),
            original_id: "1-0".into(),
            stream: "s".into(),
            group: "g".into(),
            consumer: "c".into(),
            event_id: Some("e".into()),
            kind: Kind::Permanent,
            reason: "r".into(),
            attempts: 1,
            history: Vec::new(),
            first_failed_at: 1,
            dead_at: 2,
            fields,
        }
    }

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

    #[test]
    fn times_parse_as_ago_or_rfc3339() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            parse_time("2h", now).unwrap(),
            now - Duration::from_secs(7200)
        );
        let utc = parse_time("2024-05-01T12:00:00Z", now).unwrap();
        assert_eq!(parse_time("2024-05-01T14:00:00+02:00", now).unwrap(), utc);
        assert_eq!(parse_time("2024-05-01T10:30:00-01:30", now).unwrap(), utc);
        assert_eq!(
            parse_time("2024-05-01", now).unwrap(),
            utc - Duration::from_secs(12 * 3600)
        );
        assert!(parse_time("yesterday", now).is_err());
    }

    #[test]
    fn ids_are_checked() {
        assert!(valid_id("1700000000000-0"));
        assert!(valid_id("1700000000000"));
        assert!(!valid_id("abc"));
        assert!(!valid_id("1-"));
        assert!(!valid_id(""));
    }

    #[test]
    fn times_past_year_9999_are_shown_raw_not_a_crash() {
        assert_eq!(format_time(0, true), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_time(1_500, false), "1970-01-01T00:00:01Z");
        assert_eq!(format_time(u64::MAX, true), format!("{} ms", u64::MAX));
        let letter = DeadLetter {
            first_failed_at: u64::MAX,
            dead_at: 253_402_300_800_000,
            ..sample_letter(Vec::new())
        };
        let json = letter_json(&letter);
        assert_eq!(json["dead_at_rfc3339"], "253402300800000 ms");
    }

    #[test]
    fn replay_fields_replace_earlier_audit_fields() {
        let letter = sample_letter(vec![
            (b"event_id".to_vec(), b"e".to_vec()),
            (b"replayed_from".to_vec(), b"3-0".to_vec()),
            (b"replay_count".to_vec(), b"2".to_vec()),
            (b"bin".to_vec(), vec![0, 255]),
        ]);
        let fields = replay_fields(&letter, UNIX_EPOCH + Duration::from_millis(42));
        let get = |n: &str| {
            let all: Vec<&Vec<u8>> = fields
                .iter()
                .filter(|(k, _)| k.as_slice() == n.as_bytes())
                .map(|(_, v)| v)
                .collect();
            assert_eq!(all.len(), 1, "{n} once");
            all[0].clone()
        };
        assert_eq!(get("event_id"), b"e");
        assert_eq!(get("bin"), vec![0, 255]);
        assert_eq!(get("replayed_from"), b"9-0");
        assert_eq!(get("replayed_at"), b"42");
        assert_eq!(get("replay_count"), b"3");
    }

    #[test]
    fn fields_json_is_lossless_or_refuses() {
        let map = fields_json(&[
            (b"a".to_vec(), b"x".to_vec()),
            (b"b".to_vec(), vec![0, 255]),
            (b"c".to_vec(), b"nul\0".to_vec()),
        ])
        .unwrap();
        assert_eq!(map["a"], "x");
        assert_eq!(map["b"], json!({"hex": "00ff"}));
        assert_eq!(map["c"], json!({"hex": "6e756c00"}));
        assert!(fields_json(&[
            (b"a".to_vec(), b"1".to_vec()),
            (b"a".to_vec(), b"2".to_vec())
        ])
        .is_none());
    }
}
