//! Two instances under one consumer name: told, not refused.
//!
//! A consumer name must be unique per instance (and stable across its
//! restarts): two processes started with the same `--consumer` (say two on
//! one host, both with the default, the host name) share one pending list,
//! so each re-reads the other's unfinished entries when it starts, and
//! `taskhub consumers` shows one consumer where two run. PostgreSQL keeps
//! the outcomes exact, but the operator should know. Redis cannot tell them
//! apart, nor tell either from a restart, so each reader keeps a record of
//! its instance, `keys::consumer_record` (a random token, the process id
//! and the host), and writes it again every [`EVERY`] with `SET ... GET`,
//! which returns what was there. Another token there on a later refresh
//! means another instance wrote it since: a warning (once a minute) and a
//! counter. On the first write, another token is not a sign: it may be the
//! record of a process this one replaces (killed, or stopped less than the
//! TTL ago), which never writes again. Two round trips per stream every few
//! seconds (the record, and `XGROUP CREATECONSUMER` so that the consumer
//! is in its group before its first read returns anything), none on the
//! path of an event.
//!
//! The record also publishes the instance's `--max-entry-bytes`: `dlq
//! replay` keeps to the smallest that the instances reading a stream
//! publish ([`smallest_published_limit`]), since an entry put back larger
//! would be cut down into a letter that cannot be replayed. A reader that
//! stops deletes its record ([`NameCheck::forget`]), so that a stopped
//! instance's limit does not hold a replay back.

use std::cell::Cell;
use std::time::{Duration, Instant};

use crate::redis::RedisConn;
use crate::worker::context::Common;
use crate::worker::stats::Stats;

/// How often a reader writes its record.
pub(crate) const EVERY: Duration = Duration::from_secs(5);
/// How often a clash is logged at warn level.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// A reader's record of its instance.
pub(crate) struct NameCheck {
    key: String,
    /// (stream, group, consumer).
    member: (String, String, String),
    /// `<token> max-entry-bytes <n> pid <pid> on <host>` (see
    /// [`published_limit`]).
    value: String,
    token: String,
    /// How long the record outlives its last write.
    ttl: Duration,
    /// Whether a write went through: the first one's find is no sign.
    written: Cell<bool>,
    /// When the next write is due: [`EVERY`] after the last try, whatever
    /// came of it.
    due: Cell<Option<Instant>>,
    warned: Cell<Option<Instant>>,
    /// Set when the Redis user may not write the record.
    off: Cell<bool>,
    /// Whether a skipped turn was said at info level (once).
    skip_told: Cell<bool>,
    /// Outages of the check in a row (see `refresh`).
    outages: Cell<u32>,
    /// For the message.
    who: String,
}

impl NameCheck {
    /// The check of `consumer` in `group` on `stream`, for an instance
    /// known by `token`; `block`: how long the reader's read may block
    /// (the record must outlive a refresh that waits for one);
    /// `max_entry_bytes`: its `--max-entry-bytes`, which the record
    /// publishes for `dlq replay`.
    pub fn new(
        token: &str,
        (group, stream, consumer): (&str, &str, &str),
        block: Duration,
        max_entry_bytes: usize,
    ) -> Self {
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        NameCheck {
            key: crate::redis::keys::consumer_record(group, stream, consumer),
            member: (stream.to_owned(), group.to_owned(), consumer.to_owned()),
            value: format!(
                "{token} max-entry-bytes {max_entry_bytes} pid {} on {host}",
                std::process::id()
            ),
            token: token.to_owned(),
            ttl: 3 * (EVERY + block),
            written: Cell::new(false),
            due: Cell::new(None),
            warned: Cell::new(None),
            off: Cell::new(false),
            skip_told: Cell::new(false),
            outages: Cell::new(0),
            who: format!("consumer {consumer:?} of group {group:?} on {stream:?}"),
        }
    }

    /// Writes the record when it is due; warns when another instance wrote
    /// it since the last write. It must never keep a reader from reading.
    /// A refusal that lasts (a user that may not write `th:*`, a server
    /// before Redis 6.2 without `SET ... GET`) turns the check off, said
    /// once. Any other refusal (a full `maxmemory` under `noeviction`, a
    /// busy script) skips this turn. A lost connection is returned: the
    /// caller drops that connection (a late reply would answer its next
    /// command) and reads on a new one, without backing off, since in a
    /// cluster the record may live on another node than the stream.
    pub fn refresh(&self, common: &Common, c: &mut RedisConn) -> redis::RedisResult<()> {
        let now = Instant::now();
        if self.off.get() || self.due.get().is_some_and(|due| now < due) {
            return Ok(());
        }
        self.due.set(Some(now + EVERY));
        // The consumer is in its group from the start, not only once a read
        // returned entries (Redis 7.0 creates it then), so that an idle
        // instance is seen where its record is looked up (`dlq replay`) and
        // in `taskhub consumers`. A lost connection is returned; a refusal
        // (a group deleted meanwhile: the read creates it again) is not
        // this check's to report.
        let (stream, group, consumer) = &self.member;
        let created = redis::cmd("XGROUP")
            .arg("CREATECONSUMER")
            .arg(stream)
            .arg(group)
            .arg(consumer)
            .query::<i64>(c);
        if let Err(e) = created {
            if crate::redis::is_outage(&e) {
                return Err(e);
            }
        }
        let ttl = u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX);
        let before: Option<String> = match redis::cmd("SET")
            .arg(&self.key)
            .arg(&self.value)
            .arg("PX")
            .arg(ttl)
            .arg("GET")
            .query(c)
        {
            Ok(before) => before,
            Err(e) if crate::redis::is_outage(&e) => {
                // In a cluster the record's node may be down while the
                // stream's answers: each try may wait out a timeout, so
                // the tries space out (10 s, 20 s, ... up to 80 s).
                let n = self.outages.get().saturating_add(1);
                self.outages.set(n);
                self.due.set(Some(now + EVERY * (1 << n.min(4))));
                return Err(e);
            }
            Err(e) if refused_for_good(&e) => {
                log::info!(
                    "redis: cannot check that no other instance runs as {} ({e}); the check is off",
                    self.who
                );
                self.off.set(true);
                return Ok(());
            }
            Err(e) => {
                // Said once at info level: a refusal that never passes
                // (a renamed SET, the record's key of another type) would
                // otherwise keep the check off unseen.
                let level = if self.skip_told.replace(true) {
                    log::Level::Debug
                } else {
                    log::Level::Info
                };
                log::log!(
                    level,
                    "redis: the record of {} was not written this time ({e}); tried again in {}s",
                    self.who,
                    EVERY.as_secs()
                );
                return Ok(());
            }
        };
        self.outages.set(0);
        let first = !self.written.replace(true);
        let Some(other) = before.filter(|b| !first && !self.is_ours(b)) else {
            return Ok(());
        };
        Stats::add(&common.stats.name_clashes, 1);
        if self
            .warned
            .get()
            .is_none_or(|at| at.elapsed() >= WARN_EVERY)
        {
            self.warned.set(Some(Instant::now()));
            // `pid <pid> on <host>`, as it is written after the limit.
            let other = other.find("pid ").map_or("", |at| &other[at..]);
            log::warn!(
                "another instance runs as {} ({other:?}; this one is pid {}): two instances under one consumer name share one pending list, so each re-reads the other's unfinished entries when it starts and `taskhub consumers` shows one consumer where two run (outcomes stay exactly once); give each instance a consumer name of its own (--consumer or TASKHUB_CONSUMER) that it keeps across restarts",
                self.who,
                std::process::id()
            );
        }
        Ok(())
    }

    /// Deletes the record if it is still this instance's, when its reader
    /// stops: a stopped instance publishes no limit (see
    /// [`smallest_published_limit`]). Waits at most a second for Redis: a
    /// record left behind expires with its TTL. (Its consumer stays in the
    /// group, as one that read does: `taskhub consumers --prune-idle`
    /// removes those of instances gone for good.)
    pub fn forget(&self, c: &mut RedisConn) {
        if self.off.get() || !self.written.get() {
            return;
        }
        let _ = c.set_read_timeout(Duration::from_secs(1));
        let mut forget = redis::cmd("EVAL");
        forget.arg(FORGET).arg(1).arg(&self.key).arg(&self.value);
        if let Err(e) = forget.query::<i64>(c) {
            log::debug!("{}: its record is left to expire ({e})", self.who);
        }
    }

    fn is_ours(&self, value: &str) -> bool {
        value.split(' ').next() == Some(self.token.as_str())
    }
}

/// Deletes the record KEYS[1] if it holds ARGV[1] (this instance's).
const FORGET: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// The `--max-entry-bytes` a consumer record says its instance reads with
/// (`None` for a record of a version that did not say).
fn published_limit(record: &str) -> Option<usize> {
    let head = record.split(" on ").next()?;
    let mut words = head.split(' ');
    words.find(|w| *w == "max-entry-bytes")?;
    words.next()?.parse().ok()
}

/// The smallest `--max-entry-bytes` that the instances reading `stream`
/// now publish in their records (in any group), or `None` when none does
/// (none runs, the check is off, or they are of a version before it): an
/// entry larger than that is cut down by such a worker and dead-lettered
/// as `invalid`, which cannot be replayed, so `dlq replay` keeps to it. A
/// record outlives its instance by at most its TTL (about 30 s), and
/// speaks only for the lower limit meanwhile. One `XINFO` per group, then
/// the records in one pipeline.
pub(crate) fn smallest_published_limit(
    conn: &mut RedisConn,
    stream: &str,
) -> Result<Option<usize>, crate::error::Error> {
    let redis_error =
        |e| crate::error::Error::with_source(crate::error::ErrorKind::Redis, stream.to_owned(), e);
    let mut keys = Vec::new();
    for group in crate::redis::streams::group_names(conn, stream).map_err(redis_error)? {
        let Ok(group) = String::from_utf8(group) else {
            continue; // no worker runs under a name that is not UTF-8
        };
        for consumer in crate::consumers::list_consumers(conn, stream, &group)? {
            keys.push(crate::redis::keys::consumer_record(
                &group,
                stream,
                &consumer.name,
            ));
        }
    }
    if keys.is_empty() {
        return Ok(None);
    }
    let mut pipe = conn.pipe();
    for key in &keys {
        pipe.cmd("GET").arg(key);
    }
    let records: Vec<Option<String>> = pipe.query(conn).map_err(redis_error)?;
    Ok(records
        .iter()
        .flatten()
        .filter_map(|r| published_limit(r))
        .min())
}

/// Whether Redis will refuse the record's `SET ... GET` every time: the
/// user may not write it (`NOPERM`), or the server does not know the `GET`
/// option (before 6.2: a syntax error).
fn refused_for_good(e: &redis::RedisError) -> bool {
    match e.code() {
        Some("NOPERM") => true,
        Some("ERR") => e.detail().is_some_and(|d| {
            let d = d.to_ascii_lowercase();
            d.contains("syntax error") || d.contains("wrong number of arguments")
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{published_limit, refused_for_good};

    #[test]
    fn a_record_says_its_limit_and_an_older_one_none() {
        let token = "0f0e0d0c-aaaa-bbbb-cccc-000000000000";
        assert_eq!(
            published_limit(&format!("{token} max-entry-bytes 3000 pid 42 on host-1")),
            Some(3000)
        );
        // A host name that reads like the field does not count.
        assert_eq!(
            published_limit(&format!("{token} pid 42 on max-entry-bytes 7")),
            None
        );
        assert_eq!(published_limit(&format!("{token} pid 42 on host-1")), None);
        assert_eq!(
            published_limit(&format!("{token} max-entry-bytes x pid 42 on h")),
            None
        );
    }
    use crate::redis::streams::tests::conn;

    #[test]
    fn only_a_refusal_that_lasts_turns_the_check_off() {
        let mut c = conn();
        let key = format!("th:test:name-check:{}", std::process::id());
        // What a server before 6.2 answers `SET ... GET`.
        let syntax = redis::cmd("SET")
            .arg(&key)
            .arg("v")
            .arg("GETX")
            .query::<()>(&mut c)
            .unwrap_err();
        assert!(refused_for_good(&syntax), "{syntax}");
        // Another kind of refusal: skipped, not for good.
        let _: () = redis::cmd("RPUSH")
            .arg(&key)
            .arg("x")
            .query(&mut c)
            .unwrap();
        let wrong = redis::cmd("SET")
            .arg(&key)
            .arg("v")
            .arg("GET")
            .query::<()>(&mut c)
            .unwrap_err();
        let _: () = redis::cmd("DEL").arg(&key).query(&mut c).unwrap();
        assert!(!refused_for_good(&wrong), "{wrong}");
    }
}
