//! Dead letters: their format in `<stream>:dlq`, and the dedicated thread that
//! writes them.
//!
//! A dead letter carries everything needed to understand and replay the
//! event: the original entry id, stream, group, consumer, event_id, every
//! original field (`f:<name>`, raw bytes), the last reason, the kind, the
//! attempt count and history, and the first-failure and dead-at times.
//!
//! The XADD to the dead-letter stream and the XACK of the original entry go in
//! one atomic step (a Lua script that writes the letter only if the XACK
//! acked the entry): an event is never both dead and pending, nor acked and
//! missing, nor dead twice. The dead-letter stream is never trimmed by
//! taskhub.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::Receiver;

use crate::delivery::Attempt;
use crate::event::Fields;
use crate::redis_conn::RedisConn;
use crate::run::Shared;
use crate::stats::{Server, Stats};

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
}

impl Kind {
    /// All kinds.
    pub const ALL: [Kind; 4] = [
        Kind::Permanent,
        Kind::Exhausted,
        Kind::CrashLoop,
        Kind::Invalid,
    ];

    /// The name stored in the `kind` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Permanent => "permanent",
            Kind::Exhausted => "exhausted",
            Kind::CrashLoop => "crash_loop",
            Kind::Invalid => "invalid",
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
            fields: raw
                .iter()
                .filter_map(|(k, v)| {
                    k.strip_prefix(FIELD_PREFIX)
                        .map(|name| (name.to_vec(), v.clone()))
                })
                .collect(),
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

/// A dead letter on its way to the writer, with the in-flight key to release.
#[derive(Debug)]
pub(crate) struct Job {
    pub letter: DeadLetter,
    pub in_flight_key: String,
}

/// Writes a dead letter and acks its entry in one atomic step, but only if
/// the entry is still pending in the group; returns 1 when written, 0 when
/// not. The XADD comes before the XACK: a script is not rolled back, so if
/// the XADD fails the entry must still be pending (and is retried), never
/// acked and missing.
///
/// Two consumers can hold the same entry: its owner, held up past
/// `reclaim_min_idle` (by a PostgreSQL outage, say), and the consumer that
/// reclaimed it meanwhile. Both reach the same verdict on an invalid or
/// permanently failing event, and both used to write it: it was
/// dead-lettered twice (found by scripts/chaos.sh). Now the second one finds
/// the entry no longer pending and writes nothing. (A deleted group, NOGROUP,
/// also answers 0: the entry is gone, or is delivered again from the
/// recreated group.)
const WRITE_IF_PENDING: &str = "\
    local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) \
    if type(pending) ~= 'table' or #pending == 0 then return 0 end \
    redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3)) \
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) \
    return 1";

/// Lua's `unpack` takes fewer than 8,000 values: a letter with more fields
/// (an entry with about 4,000 fields) is written with MULTI/EXEC instead,
/// unconditionally, so it can still be dead-lettered twice in that race.
const MAX_SCRIPT_VALUES: usize = 7_900;

/// The call of [`WRITE_IF_PENDING`] that writes `letter` and acks its
/// entry; `None` for a letter too large for a script (see
/// [`MAX_SCRIPT_VALUES`]).
fn write_if_pending(letter: &DeadLetter, fields: &[(Vec<u8>, Vec<u8>)]) -> Option<redis::Cmd> {
    if fields.len() * 2 > MAX_SCRIPT_VALUES {
        return None;
    }
    let mut eval = redis::cmd("EVAL");
    eval.arg(WRITE_IF_PENDING)
        .arg(2)
        .arg(&letter.stream)
        .arg(dead_letter_stream(&letter.stream))
        .arg(&letter.group)
        .arg(&letter.original_id);
    for (k, v) in fields {
        eval.arg(k).arg(v);
    }
    Some(eval)
}

/// Writes a letter too large for a script, and acks its entry, in one
/// MULTI/EXEC (on a cluster, it goes to the node of the stream's hash slot).
fn write_large(
    conn: &mut RedisConn,
    letter: &DeadLetter,
    fields: &[(Vec<u8>, Vec<u8>)],
) -> redis::RedisResult<()> {
    let mut xadd = redis::cmd("XADD");
    xadd.arg(dead_letter_stream(&letter.stream)).arg("*");
    for (k, v) in fields {
        xadd.arg(k).arg(v);
    }
    redis::pipe()
        .atomic()
        .add_command(xadd)
        .ignore()
        .cmd("XACK")
        .arg(&letter.stream)
        .arg(&letter.group)
        .arg(&letter.original_id)
        .ignore()
        .query(conn)
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
        let mut written = Vec::new();
        loop {
            match write(shared, &batch) {
                Ok(w) => {
                    shared.health.up(Server::Redis);
                    attempt = 0;
                    written = w;
                    break;
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
                        for job in &batch {
                            shared.in_flight.finish(&job.in_flight_key);
                        }
                        batch.clear();
                        break;
                    }
                }
            }
        }
        for (i, job) in batch.into_iter().enumerate() {
            let l = &job.letter;
            if !written.get(i).copied().unwrap_or(true) {
                log::info!(
                    "{}/{}: not dead-lettered: the entry is no longer pending (another consumer reclaimed and finished it)",
                    l.stream,
                    l.original_id
                );
                shared.in_flight.finish(&job.in_flight_key);
                continue;
            }
            let counter = match l.kind {
                Kind::Permanent => &shared.stats.dead_permanent,
                Kind::Exhausted => &shared.stats.dead_exhausted,
                Kind::CrashLoop => &shared.stats.dead_crash_loop,
                Kind::Invalid => &shared.stats.dead_invalid,
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
            shared.in_flight.finish(&job.in_flight_key);
        }
    }
}

/// Writes `batch`; returns, per letter, whether it was written. The letters
/// go in one pipeline (one round trip per node on a cluster), the rare
/// letters too large for a script one at a time after it.
fn write(shared: &Shared, batch: &[Job]) -> redis::RedisResult<Vec<bool>> {
    let mut conn = shared.redis_conn()?;
    let mut pipe = conn.pipe();
    let mut scripted = Vec::with_capacity(batch.len());
    let mut large = Vec::new();
    for (i, job) in batch.iter().enumerate() {
        let fields = job.letter.to_fields();
        match write_if_pending(&job.letter, &fields) {
            Some(eval) => {
                pipe.add_command(eval);
                scripted.push(i);
            }
            None => large.push((i, fields)),
        }
    }
    let mut written = vec![true; batch.len()];
    if !scripted.is_empty() {
        let replies: Vec<redis::Value> = pipe.query(&mut conn)?;
        for (i, reply) in scripted.into_iter().zip(replies) {
            written[i] = !matches!(reply, redis::Value::Int(0));
        }
    }
    for (i, fields) in large {
        write_large(&mut conn, &batch[i].letter, &fields)?;
    }
    Ok(written)
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
