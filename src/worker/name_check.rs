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
//! TTL ago), which never writes again. One round trip per stream every few
//! seconds, none on the path of an event.

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
    /// `<token> pid <pid> on <host>`.
    value: String,
    token: String,
    /// How long the record outlives its last write.
    ttl: Duration,
    written: Cell<Option<Instant>>,
    warned: Cell<Option<Instant>>,
    /// Set when the Redis user may not write the record.
    off: Cell<bool>,
    /// For the message.
    who: String,
}

impl NameCheck {
    /// The check of `consumer` in `group` on `stream`, for an instance
    /// known by `token`; `block`: how long the reader's read may block
    /// (the record must outlive a refresh that waits for one).
    pub fn new(token: &str, group: &str, stream: &str, consumer: &str, block: Duration) -> Self {
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        NameCheck {
            key: crate::redis::keys::consumer_record(group, stream, consumer),
            value: format!("{token} pid {} on {host}", std::process::id()),
            token: token.to_owned(),
            ttl: 3 * (EVERY + block),
            written: Cell::new(None),
            warned: Cell::new(None),
            off: Cell::new(false),
            who: format!("consumer {consumer:?} of group {group:?} on {stream:?}"),
        }
    }

    /// Writes the record when it is due; warns when another instance wrote
    /// it since the last write. A lost connection is the caller's to handle,
    /// as for a read; any other error (a user that may not write `th:*`, a
    /// server before Redis 6.2 without `SET ... GET`) turns the check off,
    /// said once: it must never keep a reader from reading.
    pub fn refresh(&self, common: &Common, c: &mut RedisConn) -> redis::RedisResult<()> {
        if self.off.get() || self.written.get().is_some_and(|at| at.elapsed() < EVERY) {
            return Ok(());
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
            Err(e) if crate::redis::is_outage(&e) => return Err(e),
            Err(e) => {
                log::info!(
                    "redis: cannot check that no other instance runs as {} ({e}); the check is off",
                    self.who
                );
                self.off.set(true);
                return Ok(());
            }
        };
        let first = self.written.replace(Some(Instant::now())).is_none();
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
            let other = other.split_once(' ').map_or("", |(_, rest)| rest);
            log::warn!(
                "another instance runs as {} ({other:?}; this one is pid {}): two instances under one consumer name share one pending list, so each re-reads the other's unfinished entries when it starts and `taskhub consumers` shows one consumer where two run (outcomes stay exactly once); give each instance a consumer name of its own (--consumer or TASKHUB_CONSUMER) that it keeps across restarts",
                self.who,
                std::process::id()
            );
        }
        Ok(())
    }

    fn is_ours(&self, value: &str) -> bool {
        value.split(' ').next() == Some(self.token.as_str())
    }
}
