//! Dead letters: their format in `<stream>:dlq`, and the dedicated thread that
//! writes them.
//!
//! A dead letter carries everything needed to understand and replay the
//! event: the original entry id, stream, group, consumer, event_id, every
//! original field (`f:<name>`, raw bytes), the last reason, the kind, the
//! attempt count and history, and the first-failure and dead-at times.
//!
//! The XADD to the dead-letter stream and the XACK of the original entry go in
//! one atomic step (a Lua script, [`WRITE_DEAD_LETTER`], that writes only
//! for the consumer that owns the entry, and only once per entry): an event
//! is never both dead and pending, nor acked and missing, nor dead twice.
//! The dead-letter stream is never trimmed by taskhub.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::Receiver;

use crate::event::Fields;
use crate::worker::delivery::Attempt;
use crate::worker::flow::Ticket;
use crate::worker::stats::{Server, Stats};
use crate::worker::Shared;

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

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One dead letter, as written to and read from `<stream>:dlq`.
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// The dead-letter stream of `stream`. With a hash tag in the stream name
/// (`{tasks}:events`), both land in the same Redis Cluster slot.
pub fn dead_letter_stream(stream: &str) -> String {
    format!("{stream}:dlq")
}

/// Prefix of original fields inside a dead letter.
const FIELD_PREFIX: &[u8] = b"f:";

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

/// `t` in milliseconds since the epoch (0 before it).
pub fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn history_json(history: &[Attempt]) -> String {
    let items: Vec<serde_json::Value> = history
        .iter()
        .map(|a| {
            serde_json::json!({
                "attempt": a.attempt,
                "at": a.at.map(millis),
                "error": a.error,
            })
        })
        .collect();
    serde_json::Value::Array(items).to_string()
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

impl DeadLetter {
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
            let v = raw
                .iter()
                .find(|(k, _)| k.as_slice() == name.as_bytes())
                .ok_or_else(|| format!("dead letter without {name}"))?;
            String::from_utf8(v.1.clone()).map_err(|_| format!("{name} is not UTF-8"))
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
            fields: match raw.iter().find(|(k, _)| k.as_slice() == PACKED_FIELDS) {
                Some((_, packed)) if !packed.is_empty() => unpack(packed)?,
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

    /// An original field, raw.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(k, _)| k.as_slice() == name.as_bytes())
            .map(|(_, v)| v.as_slice())
    }
}

/// A dead letter on its way to the writer.
#[derive(Debug)]
pub(crate) struct Job {
    pub letter: DeadLetter,
    /// The delivery count this consumer holds the entry with (its ticket's,
    /// when it has one, which follows later deliveries to this process): the
    /// letter is written only while the entry is still pending for this
    /// consumer with this count. `None` for an entry that already left the
    /// pending list (XAUTOCLAIM reports trimmed entries that way).
    pub token: Option<u64>,
    /// The entry's place in the in-flight set, released once written.
    pub ticket: Option<Ticket>,
}

/// Writes a dead letter and acks its entry in one atomic step, only while
/// this consumer owns the entry (pending for it, with the delivery count it
/// holds it with), and only once per entry. Returns 1 when written, 0 when
/// the entry is no longer this consumer's (another consumer claimed it, or
/// it was acked), 2 when it was dead-lettered before (then it is acked).
///
/// - Ownership: an owner that was slow past `reclaim_min_idle` and the
///   consumer that claimed the entry meanwhile can both reach a verdict;
///   only the current owner's counts. The delivery count is the fence: a
///   claim raises it, so a verdict reached before the entry changed hands,
///   even by the consumer that owns it again now, is refused.
/// - Once: the index `<stream>:dlq:index` records every entry written, so
///   an entry delivered again (its group destroyed and created again) is
///   not dead-lettered twice.
/// - The XADD comes before the XACK: a script is not rolled back, so if the
///   XADD fails the entry is still pending (and is retried), never acked
///   and missing.
///
/// KEYS: stream, dead-letter stream, index. ARGV: group, entry id, consumer,
/// delivery count (empty: no ownership check), then the letter's fields.
const WRITE_DEAD_LETTER: &str = r"
if redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then
    redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
    return 2
end
if ARGV[4] ~= '' then
    local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
    if type(p) ~= 'table' or #p == 0 or p[1][2] ~= ARGV[3]
        or p[1][4] ~= tonumber(ARGV[4]) then
        return 0
    end
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5))
redis.call('HSET', KEYS[3], ARGV[2], id)
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
return 1
";

/// The call of [`WRITE_DEAD_LETTER`] for one job.
fn write_command(job: &Job) -> redis::Cmd {
    let letter = &job.letter;
    let mut eval = redis::cmd("EVAL");
    eval.arg(WRITE_DEAD_LETTER)
        .arg(3)
        .arg(&letter.stream)
        .arg(dead_letter_stream(&letter.stream))
        .arg(crate::redis::keys::dead_letter_index(&letter.stream))
        .arg(&letter.group)
        .arg(&letter.original_id)
        .arg(&letter.consumer)
        .arg(
            job.ticket
                .as_ref()
                .and_then(Ticket::token)
                .or(job.token)
                .map(|n| n.to_string())
                .unwrap_or_default(),
        );
    for (k, v) in letter.to_fields() {
        eval.arg(k).arg(v);
    }
    eval
}

/// What the script answered for one letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    Now,
    NotOwned,
    Before,
}

/// The dead-letter writer thread: writes what the workers hand it, in
/// pipelined batches of atomic write-and-ack steps, retrying through Redis
/// outages.
/// Exits when every sender is gone and the channel is drained, or, during a
/// Redis outage, when a shutdown is asked for (what is left stays pending in
/// its stream and is delivered again: nothing is lost).
pub(crate) fn writer_thread(shared: &Shared, jobs: &Receiver<Job>) {
    let mut attempt = 0u32;
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while batch.len() < 128 {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let written = loop {
            match write(shared, &batch) {
                Ok(w) => {
                    shared.health.up(Server::Redis);
                    attempt = 0;
                    break w;
                }
                Err(e) => {
                    shared.health.down(Server::Redis, &e);
                    attempt += 1;
                    let wait = shared.outage_backoff(attempt);
                    if shared.shutdown.sleep(wait) && attempt > 3 {
                        log::error!(
                            "dead-letter writer: giving up on {} dead letters at shutdown; they stay pending and will be delivered again",
                            batch.len()
                        );
                        break Vec::new();
                    }
                }
            }
        };
        for (job, written) in batch.iter().zip(written) {
            report(shared, &job.letter, written);
        }
        // Written, or left pending at shutdown: either way they leave the
        // in-flight set.
        let tickets: Vec<Ticket> = batch.iter_mut().filter_map(|j| j.ticket.take()).collect();
        shared.in_flight.release_all(tickets);
    }
}

fn report(shared: &Shared, l: &DeadLetter, written: Written) {
    match written {
        Written::NotOwned => log::info!(
            "{}/{}: not dead-lettered: the entry is no longer this consumer's (another consumer claimed it, or it was finished)",
            l.stream,
            l.original_id
        ),
        Written::Before => log::info!(
            "{}/{}: dead-lettered before (its group was created again?); acked",
            l.stream,
            l.original_id
        ),
        Written::Now => {
            let counter = match l.kind {
                Kind::Permanent => &shared.stats.dead_permanent,
                Kind::Exhausted => &shared.stats.dead_exhausted,
                Kind::CrashLoop => &shared.stats.dead_crash_loop,
                Kind::Invalid => &shared.stats.dead_invalid,
                Kind::Trimmed => &shared.stats.dead_trimmed,
            };
            Stats::add(counter, 1);
            log::warn!(
                "{}/{}: dead-lettered ({}, event_id {:?}, {} attempts): {}",
                l.stream,
                l.original_id,
                l.kind,
                l.event_id.as_deref().unwrap_or(""),
                l.attempts,
                l.reason
            );
        }
    }
}

/// Writes `batch` in one pipeline (one round trip per node on a cluster);
/// returns what happened to each letter.
fn write(shared: &Shared, batch: &[Job]) -> redis::RedisResult<Vec<Written>> {
    let mut conn = shared.redis_conn()?;
    let mut pipe = conn.pipe();
    for job in batch {
        pipe.add_command(write_command(job));
    }
    let replies: Vec<i64> = pipe.query(&mut conn)?;
    Ok(replies
        .into_iter()
        .map(|r| match r {
            1 => Written::Now,
            2 => Written::Before,
            _ => Written::NotOwned,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
