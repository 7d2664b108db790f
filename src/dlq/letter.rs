//! A dead letter: its fields in `<stream>:dlq`, and its JSON form.
//!
//! A dead letter carries everything needed to understand and replay the
//! event: the original entry id, stream, group, consumer, event_id, every
//! original field (`f:<name>`, raw bytes; for an entry over the size limit,
//! the name and first bytes of each field), the last reason, the kind, the
//! attempt count and history, and the first-failure and dead-at times.
//!
//! Two kinds of letter may not hold the whole event: an `invalid` letter of
//! an entry over `--max-entry-bytes` (its fields cut to their first bytes),
//! and a `trimmed` letter of an entry deleted from its stream before the
//! worker held its fields (it keeps the `event_id` at most). Such a letter
//! says so in its `incomplete` field, and [`DeadLetter::incomplete`] tells
//! it from the letter itself, so letters written before that field existed
//! are judged the same way. Replay refuses them: the cut-down event would be
//! applied, recorded processed, and the true one skipped for ever after.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::event::{value_in, Fields, MOST_FIELDS, PREFIX};

/// One failed attempt, kept for the dead-letter history.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempt {
    /// 1-based attempt number across deliveries.
    pub attempt: u32,
    /// When it failed; for a run that started on a consumer and never
    /// finished ([`UNFINISHED_RUN`]), when it started; `None` for an
    /// earlier delivery known only by Redis's delivery count (the consumer
    /// stopped or crashed during it).
    pub at: Option<SystemTime>,
    /// What went wrong.
    pub error: String,
}

/// How a dead letter's history begins an attempt that started on a
/// consumer and never finished (the consumer crashed, or lost the entry,
/// while it ran): the consumer's name and the delivery follow.
pub const UNFINISHED_RUN: &str = "started on consumer ";

/// Why an event was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kind {
    /// The handler said retrying cannot help.
    Permanent,
    /// Every allowed attempt failed.
    Exhausted,
    /// The event was delivered more times than attempts are allowed without
    /// ever finishing: it most likely kills the process that handles it.
    CrashLoop,
    /// The entry breaks the message contract or cannot be decoded.
    Invalid,
    /// The entry was deleted from its stream (a producer's `MAXLEN`, an
    /// `XDEL`) while it was pending, before it could be applied: the letter
    /// keeps what was known of it.
    Trimmed,
}

impl Kind {
    /// All kinds.
    pub const ALL: [Kind; 5] = [
        Kind::Permanent,
        Kind::Exhausted,
        Kind::CrashLoop,
        Kind::Invalid,
        Kind::Trimmed,
    ];

    /// The name stored in the `kind` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Permanent => "permanent",
            Kind::Exhausted => "exhausted",
            Kind::CrashLoop => "crash_loop",
            Kind::Invalid => "invalid",
            Kind::Trimmed => "trimmed",
        }
    }

    /// Parses a stored kind name.
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// Parses a kind name, as stored (`crash_loop`) or typed (`crash-loop`,
/// any case).
impl std::str::FromStr for Kind {
    type Err = crate::Error;

    fn from_str(text: &str) -> Result<Kind, crate::Error> {
        Kind::parse(&text.trim().to_ascii_lowercase().replace('-', "_")).ok_or_else(|| {
            let names: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
            crate::Error::config(format!(
                "unknown kind {text:?} (expected one of {})",
                names.join(", ")
            ))
        })
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One dead letter, as written to and read from `<stream>:dlq`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Its entry id in the dead-letter stream (`None` before it is written).
    pub id: Option<String>,
    /// The entry id it had in the original stream.
    pub original_id: String,
    /// The original stream.
    pub stream: String,
    /// The consumer group that gave up on it.
    pub group: String,
    /// The consumer that gave up on it.
    pub consumer: String,
    /// Its event_id, when it had a readable one.
    pub event_id: Option<String>,
    /// Why it is dead.
    pub kind: Kind,
    /// The last error.
    pub reason: String,
    /// Attempts made.
    pub attempts: u32,
    /// Each attempt's error and time.
    pub history: Vec<Attempt>,
    /// When it first failed (ms since the Unix epoch).
    pub first_failed_at: u64,
    /// When it was dead-lettered (ms since the Unix epoch).
    pub dead_at: u64,
    /// Every original field, raw.
    pub fields: Fields,
}

pub use crate::redis::keys::dead_letter_stream;

/// Prefix of original fields inside a dead letter.
const FIELD_PREFIX: &[u8] = b"f:";

/// The field that says, in words, why a letter's original fields are not
/// the whole event (see [`DeadLetter::incomplete`]); absent when they are.
/// Written for the readers of the raw stream and of the archive: taskhub
/// itself judges each letter from its kind, reason and fields.
const INCOMPLETE: &str = "incomplete";

/// A letter whose entry had more fields than this keeps them all in one
/// field, [`PACKED_FIELDS`], so that the letter still fits the arguments of
/// the Lua script that writes it (Lua's `unpack` takes fewer than 8,000
/// values).
const MAX_INLINE_FIELDS: usize = 3_900;

/// The field holding the original fields of a very wide entry, each name
/// and value written as `<length>:<bytes>`.
const PACKED_FIELDS: &[u8] = b"packed_fields";

fn pack(fields: &Fields) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in fields {
        for part in [k, v] {
            out.extend_from_slice(part.len().to_string().as_bytes());
            out.push(b':');
            out.extend_from_slice(part);
        }
    }
    out
}

fn unpack(packed: &[u8]) -> Result<Fields, String> {
    let mut parts = Vec::new();
    let mut rest = packed;
    while !rest.is_empty() {
        let colon = rest
            .iter()
            .position(|b| *b == b':')
            .ok_or("packed_fields: no length")?;
        let len: usize = std::str::from_utf8(&rest[..colon])
            .ok()
            .and_then(|n| n.parse().ok())
            .ok_or("packed_fields: bad length")?;
        let end = colon
            .checked_add(1 + len)
            .filter(|end| *end <= rest.len())
            .ok_or("packed_fields: cut short")?;
        parts.push(rest[colon + 1..end].to_vec());
        rest = &rest[end..];
    }
    if parts.len() % 2 != 0 {
        return Err("packed_fields: a name without a value".into());
    }
    let mut fields = Vec::with_capacity(parts.len() / 2);
    let mut it = parts.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        fields.push((k, v));
    }
    Ok(fields)
}

/// The size in bytes and the field count of an entry cut down for being
/// over the size limit, from its `invalid` reason (see `Cut::reason` in
/// `event.rs`: "entry is B bytes in F fields, over the limit of L bytes;
/// the dead letter keeps the name and first 256 bytes..."); `None` for any
/// other reason.
fn cut_sizes(reason: &str) -> Option<(u64, u64)> {
    let keeps = format!("; the dead letter keeps the name and first {PREFIX} bytes");
    if !(reason.contains(", over the limit of ") && reason.contains(&keeps)) {
        return None;
    }
    let words: Option<Vec<&str>> = reason
        .strip_prefix("entry is ")
        .map(|rest| rest.split(' ').collect());
    match words.as_deref() {
        Some([bytes, "bytes", "in", fields, "fields,", ..]) => Some((
            bytes.parse().unwrap_or(u64::MAX),
            fields.parse().unwrap_or(u64::MAX),
        )),
        // Cut, but its sizes are unreadable: nothing says it is whole.
        _ => Some((u64::MAX, u64::MAX)),
    }
}

/// The longest `reason` a dead letter keeps, and the longest error of an
/// attempt in its history: a database error can quote the value it
/// refused, and a letter of a 300 KB payload whose reason and history
/// quoted it twice more was over the 256 KiB past which listings read
/// letters cut down, its history cut into something that is not JSON: no
/// listing, filter or bulk action saw it (found by a hostile tester). Both
/// fit whole in what a listing keeps of a field (`LETTER_KEEP` in
/// `read.rs`), and so does the history ([`HISTORY_MAX`]).
pub(crate) const REASON_MAX: usize = 2048;
pub(crate) const ATTEMPT_ERROR_MAX: usize = 512;

/// `text` cut to at most `max` bytes at a character boundary, saying how
/// much was left out.
pub(crate) fn bounded_text(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let total = text.len();
    let note = |kept: usize| format!(" … ({} more bytes)", total - kept);
    let mut keep = max.saturating_sub(note(0).len() + 4);
    while !text.is_char_boundary(keep) {
        keep -= 1;
    }
    text.truncate(keep);
    text.push_str(&note(keep));
    text
}

/// `t` in milliseconds since the epoch (0 before it).
pub(crate) fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How many of its first attempts, and of its last ones, a letter's
/// history keeps: `--max-attempts` has no upper bound, and a letter over
/// 256 KiB with more than about 28 attempts of long errors had its
/// history cut in listings, where no listing, filter or bulk action saw
/// it (found in review). The attempts left out show as a gap in the
/// numbers; the letter's `attempts` still counts them all.
pub(crate) const HISTORY_HEAD: usize = 4;
pub(crate) const HISTORY_TAIL: usize = 20;
/// The most a history keeps in all, in JSON (under what a listing keeps
/// of a field, `LETTER_KEEP` in `read.rs`): errors that JSON escapes
/// grow up to six times.
const HISTORY_MAX: usize = 14 * 1024;

/// The attempts of a letter's `history`, each with what a listing shows
/// before it where the history left attempts out (a gap in their
/// numbers): `dlq show` and the page both list them so.
pub fn with_gaps(history: &[Attempt]) -> impl Iterator<Item = (Option<String>, &Attempt)> {
    let mut next = 1;
    history.iter().map(move |a| {
        let gap = (a.attempt > next).then(|| {
            let n = a.attempt - next;
            let s = if n == 1 { "" } else { "s" };
            format!("({n} attempt{s} left out: a letter keeps its first and its last attempts)")
        });
        next = a.attempt.saturating_add(1);
        (gap, a)
    })
}

fn history_json(history: &[Attempt]) -> String {
    let item = |a: &Attempt| {
        serde_json::json!({
            "attempt": a.attempt,
            "at": a.at.map(millis),
            "error": a.error,
        })
        .to_string()
    };
    // The last attempt is always one of the last ones kept.
    let head = history.len().saturating_sub(1).min(HISTORY_HEAD);
    let tail = (history.len() - head).min(HISTORY_TAIL);
    let mut items: Vec<String> = history[..head].iter().map(item).collect();
    let mut last: Vec<String> = history[history.len() - tail..].iter().map(item).collect();
    // Past the most in all, the oldest of the last attempts go first, then
    // the latest of the first ones; the last attempt always stays.
    let size = |items: &[String], last: &[String]| {
        items.iter().chain(last).map(|i| i.len() + 1).sum::<usize>() + 1
    };
    while size(&items, &last) > HISTORY_MAX && items.len() + last.len() > 1 {
        if last.len() > 1 {
            last.remove(0);
        } else {
            items.pop();
        }
    }
    items.extend(last);
    format!("[{}]", items.join(","))
}

fn parse_history(text: &str) -> Result<Vec<Attempt>, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("history is not JSON: {e}"))?;
    let items = value.as_array().ok_or("history is not a JSON array")?;
    items
        .iter()
        .map(|item| {
            let attempt = item["attempt"]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or("history item without attempt")?;
            let at = match &item["at"] {
                serde_json::Value::Null => None,
                v => {
                    Some(UNIX_EPOCH + Duration::from_millis(v.as_u64().ok_or("bad history time")?))
                }
            };
            let error = item["error"]
                .as_str()
                .ok_or("history item without error")?
                .to_owned();
            Ok(Attempt { attempt, at, error })
        })
        .collect()
}

impl Attempt {
    /// Attempt `attempt` (1-based), failed at `at` with `error`.
    pub fn new(attempt: u32, at: Option<SystemTime>, error: impl Into<String>) -> Attempt {
        Attempt {
            attempt,
            at,
            error: error.into(),
        }
    }
}

impl DeadLetter {
    /// A letter for entry `original_id` of `stream`, holding its `fields`;
    /// the rest is empty or zero, to be filled in (as a tool that writes
    /// letters of its own, or a test, does).
    pub fn new(
        stream: &str,
        original_id: &str,
        kind: Kind,
        reason: impl Into<String>,
        fields: Fields,
    ) -> DeadLetter {
        DeadLetter {
            id: None,
            original_id: original_id.to_owned(),
            stream: stream.to_owned(),
            group: String::new(),
            consumer: String::new(),
            event_id: None,
            kind,
            reason: reason.into(),
            attempts: 0,
            history: Vec::new(),
            first_failed_at: 0,
            dead_at: 0,
            fields,
        }
    }

    /// This letter as one JSON object (what `taskhub dlq list --json`
    /// prints): ids, kind, reason and its fingerprint, times in ms and RFC
    /// 3339, the attempt history, and the original fields (text as strings,
    /// bytes that are not UTF-8 as `{"base64": ...}`).
    pub fn to_json(&self) -> serde_json::Value {
        crate::dlq::json::letter_json(self)
    }

    /// The fields written to the dead-letter stream.
    pub fn to_fields(&self) -> Fields {
        let mut out: Fields = Vec::with_capacity(12 + self.fields.len());
        let mut put = |k: &str, v: String| out.push((k.as_bytes().to_vec(), v.into_bytes()));
        put("original_id", self.original_id.clone());
        put("stream", self.stream.clone());
        put("group", self.group.clone());
        put("consumer", self.consumer.clone());
        if let Some(id) = &self.event_id {
            put("event_id", id.clone());
        }
        put("kind", self.kind.as_str().to_owned());
        put("reason", self.reason.clone());
        put("attempts", self.attempts.to_string());
        put("history", history_json(&self.history));
        put("first_failed_at", self.first_failed_at.to_string());
        put("dead_at", self.dead_at.to_string());
        if let Some(why) = self.incomplete() {
            put(INCOMPLETE, why);
        }
        if self.fields.len() > MAX_INLINE_FIELDS {
            out.push((PACKED_FIELDS.to_vec(), pack(&self.fields)));
            return out;
        }
        for (k, v) in &self.fields {
            let mut name = FIELD_PREFIX.to_vec();
            name.extend_from_slice(k);
            out.push((name, v.clone()));
        }
        out
    }

    /// Reads a dead letter back from its stream entry.
    pub fn from_fields(id: Option<String>, raw: &Fields) -> Result<DeadLetter, String> {
        let text = |name: &str| -> Result<String, String> {
            let v = value_in(raw, name.as_bytes())
                .ok_or_else(|| format!("dead letter without {name}"))?;
            String::from_utf8(v.to_vec()).map_err(|_| format!("{name} is not UTF-8"))
        };
        let number = |name: &str| -> Result<u64, String> {
            text(name)?
                .parse()
                .map_err(|_| format!("{name} is not a number"))
        };
        let kind_text = text("kind")?;
        Ok(DeadLetter {
            id,
            original_id: text("original_id")?,
            stream: text("stream")?,
            group: text("group")?,
            consumer: text("consumer")?,
            event_id: text("event_id").ok(),
            kind: Kind::parse(&kind_text).ok_or_else(|| format!("unknown kind {kind_text:?}"))?,
            reason: text("reason")?,
            attempts: u32::try_from(number("attempts")?).map_err(|_| "attempts too large")?,
            history: parse_history(&text("history")?)?,
            first_failed_at: number("first_failed_at")?,
            dead_at: number("dead_at")?,
            fields: match value_in(raw, PACKED_FIELDS) {
                Some(packed) if !packed.is_empty() => unpack(packed)?,
                Some(_) => Vec::new(),
                None => raw
                    .iter()
                    .filter_map(|(k, v)| {
                        k.strip_prefix(FIELD_PREFIX)
                            .map(|name| (name.to_vec(), v.clone()))
                    })
                    .collect(),
            },
        })
    }

    /// Why this letter's fields may not be the whole event (`None`: they
    /// are): replaying it would apply a cut-down event, and record it
    /// processed. Two cases:
    ///
    /// - an `invalid` letter of an entry over `--max-entry-bytes`, which
    ///   keeps the name and first 256 bytes of its first 64 fields (its
    ///   reason says so, with the entry's size and field count): incomplete
    ///   unless those show that nothing was cut;
    /// - a `trimmed` letter holding nothing but an `event_id`: the entry was
    ///   deleted from its stream before the worker held its fields, and the
    ///   letter keeps what was known of it (the id, at most). A `trimmed`
    ///   letter written while its event was being applied holds every field
    ///   and is complete. (One whose event had no field but its `event_id`
    ///   is taken for incomplete too: the letter cannot tell them apart.)
    pub fn incomplete(&self) -> Option<String> {
        match self.kind {
            Kind::Invalid => {
                let (bytes, fields) = cut_sizes(&self.reason)?;
                let kept: u64 = self
                    .fields
                    .iter()
                    .map(|(k, v)| (k.len() + v.len()) as u64)
                    .sum();
                if kept == bytes && self.fields.len() as u64 == fields {
                    return None;
                }
                Some(format!(
                    "kept only the first {PREFIX} bytes of each field, and at most {MOST_FIELDS} fields (entry over --max-entry-bytes)"
                ))
            }
            Kind::Trimmed => {
                if self.fields.iter().any(|(k, _)| k.as_slice() != b"event_id") {
                    return None;
                }
                let what = if self.fields.is_empty() {
                    "kept no field of the event"
                } else {
                    "kept only its event_id"
                };
                Some(format!(
                    "{what} (the entry was deleted from the stream while pending, before the worker held its fields)"
                ))
            }
            _ => None,
        }
    }

    /// An original field, raw.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        value_in(&self.fields, name.as_bytes())
    }
}
#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A permanent dead letter of entry 1-0 on stream `s`, with `fields`.
    pub(crate) fn sample_letter(fields: Fields) -> DeadLetter {
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
    fn long_error_texts_are_cut_at_a_character_boundary_saying_how_much() {
        assert_eq!(bounded_text("short".into(), 10), "short");
        let long = "é".repeat(1000); // 2000 bytes
        let cut = bounded_text(long, 100);
        assert!(cut.len() <= 100, "{}", cut.len());
        assert!(cut.ends_with(" more bytes)"), "{cut}");
        assert!(cut.starts_with("éé"));
        let (kept, rest) = cut.split_once(" … (").unwrap();
        let left_out: usize = rest.split(' ').next().unwrap().parse().unwrap();
        assert_eq!(kept.len() + left_out, 2000);
    }

    #[test]
    fn a_long_history_keeps_its_first_and_last_attempts_within_a_listing_s_cut() {
        let history = |n: u32, error: &str| -> Vec<Attempt> {
            (1..=n)
                .map(|i| Attempt::new(i, Some(UNIX_EPOCH), bounded_text(error.repeat(600), 512)))
                .collect()
        };
        let kept = |h: &[Attempt]| -> Vec<u32> {
            let text = history_json(h);
            assert!(text.len() <= HISTORY_MAX, "{}", text.len());
            parse_history(&text)
                .unwrap()
                .iter()
                .map(|a| a.attempt)
                .collect()
        };
        // Short: whole.
        assert_eq!(kept(&history(3, "e")), vec![1, 2, 3]);
        // Long: the first 4 and the last 20.
        let mut expected: Vec<u32> = (1..=4).collect();
        expected.extend(81..=100);
        assert_eq!(kept(&history(100, "e")), expected);
        // Errors JSON escapes six times over: fewer of the last, and the
        // last one always.
        let escaped = kept(&history(100, "\u{1}"));
        assert_eq!(escaped[..2], [1, 2]);
        assert_eq!(escaped.last(), Some(&100));
        assert!(escaped.len() < 24, "{escaped:?}");
        assert_eq!(kept(&[]), Vec::<u32>::new());
    }

    #[test]
    fn round_trip() {
        let letter = DeadLetter {
            id: Some("5-0".into()),
            original_id: "1-0".into(),
            stream: "s".into(),
            group: "g".into(),
            consumer: "c".into(),
            event_id: Some("e".into()),
            kind: Kind::Exhausted,
            reason: "downstream 500".into(),
            attempts: 3,
            history: vec![
                Attempt {
                    attempt: 1,
                    at: None,
                    error: "x".into(),
                },
                Attempt {
                    attempt: 2,
                    at: Some(UNIX_EPOCH + Duration::from_millis(5)),
                    error: "y".into(),
                },
            ],
            first_failed_at: 5,
            dead_at: 9,
            fields: vec![
                (b"event_id".to_vec(), b"e".to_vec()),
                (b"bin".to_vec(), vec![0, 255]),
            ],
        };
        let back = DeadLetter::from_fields(Some("5-0".into()), &letter.to_fields()).unwrap();
        assert_eq!(back, letter);
    }

    /// The letter the worker writes for `fields`, an entry over a limit of
    /// `limit` bytes (its reason as `event.rs` words it).
    fn oversize_letter(fields: Fields, limit: usize) -> DeadLetter {
        let limits = crate::event::Limits {
            max_event_id_bytes: 256,
            max_entry_bytes: limit,
        };
        let fields = fields.into_iter().collect();
        let parsed = crate::event::Event::parse("s".into(), "1-0".into(), fields, None, 1, limits);
        let Err((kept, why)) = parsed else {
            panic!("not refused as oversize")
        };
        DeadLetter {
            kind: Kind::Invalid,
            reason: why.to_string(),
            ..sample_letter(kept)
        }
    }

    #[test]
    fn an_oversize_letter_cut_down_is_incomplete_one_kept_whole_is_not() {
        let cut = oversize_letter(
            vec![
                (b"event_id".to_vec(), b"e".to_vec()),
                (b"payload".to_vec(), vec![b'A'; 1_500]),
            ],
            1_000,
        );
        assert_eq!(cut.field("payload").map(<[u8]>::len), Some(PREFIX));
        let why = cut.incomplete().expect("cut down");
        assert!(why.contains("first 256 bytes"), "{why}");
        // Written with the letter, and ignored when read back.
        let fields = cut.to_fields();
        assert!(fields
            .iter()
            .any(|(k, v)| k == b"incomplete" && v == why.as_bytes()));
        let back = DeadLetter::from_fields(Some("9-0".into()), &fields).unwrap();
        assert_eq!(back, cut);

        // Over the limit, but every field short: nothing cut.
        let whole = oversize_letter(
            vec![
                (b"event_id".to_vec(), b"e".to_vec()),
                (b"a".to_vec(), vec![b'B'; 200]),
                (b"b".to_vec(), vec![b'B'; 200]),
            ],
            300,
        );
        assert_eq!(whole.incomplete(), None);
        assert!(!whole.to_fields().iter().any(|(k, _)| k == b"incomplete"));

        // Over 64 fields: the rest were dropped.
        let wide: Fields = (0..70)
            .map(|i| (format!("f{i}").into_bytes(), b"x".to_vec()))
            .chain([(b"event_id".to_vec(), b"e".to_vec())])
            .collect();
        assert!(oversize_letter(wide, 100).incomplete().is_some());

        // Other invalid letters hold what the entry had.
        let other = DeadLetter {
            kind: Kind::Invalid,
            reason: "missing field event_id".into(),
            ..sample_letter(vec![(b"payload".to_vec(), b"p".to_vec())])
        };
        assert_eq!(other.incomplete(), None);
    }

    #[test]
    fn a_trimmed_letter_with_only_its_event_id_is_incomplete() {
        let trimmed = |fields: Fields| DeadLetter {
            kind: Kind::Trimmed,
            reason: crate::worker::delivery::TRIMMED.into(),
            ..sample_letter(fields)
        };
        let id_only = trimmed(vec![(b"event_id".to_vec(), b"e".to_vec())]);
        assert!(id_only
            .incomplete()
            .is_some_and(|w| w.contains("only its event_id")));
        assert!(trimmed(Vec::new())
            .incomplete()
            .is_some_and(|w| w.contains("no field")));
        let full = trimmed(vec![
            (b"event_id".to_vec(), b"e".to_vec()),
            (b"payload".to_vec(), b"p".to_vec()),
        ]);
        assert_eq!(full.incomplete(), None);
        // Other kinds hold the whole event.
        let permanent = sample_letter(vec![(b"event_id".to_vec(), b"e".to_vec())]);
        assert_eq!(permanent.incomplete(), None);
    }
}
