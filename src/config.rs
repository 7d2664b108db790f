//! Configuration: one [`Builder`] whose `Default` holds every default, and
//! `build()` that validates it.

use std::fmt;
use std::time::Duration;

use crate::error::Error;
use crate::redact::redact;
use crate::tls::Tls;

/// The validated settings of a [`Worker`](crate::Worker). Build one with [`Worker::builder`](crate::Worker::builder).
#[derive(Clone)]
pub struct Config {
    pub(crate) redis_url: String,
    pub(crate) database_url: String,
    pub(crate) redis_tls: Tls,
    pub(crate) streams: Vec<String>,
    pub(crate) group: String,
    pub(crate) consumer: String,
    pub(crate) scope: Option<String>,
    pub(crate) start_id: String,
    pub(crate) workers: usize,
    pub(crate) count: usize,
    pub(crate) block: Duration,
    pub(crate) marker_ttl: Duration,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) until_idle: bool,
    pub(crate) max_attempts: u32,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_cap: Duration,
    pub(crate) max_retry_after: Duration,
    pub(crate) reclaim_interval: Duration,
    pub(crate) reclaim_min_idle: Duration,
    pub(crate) max_event_id_bytes: usize,
    pub(crate) max_entry_bytes: usize,
    pub(crate) handler_timeout: Duration,
    pub(crate) mode: Mode,
}

/// How events are committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// One transaction per event.
    PerEvent,
    /// One transaction per batch of first deliveries (set-based dedup
    /// insert, the handler's batch form, one COMMIT); a batch that fails is
    /// rolled back and its events applied one by one.
    Batch,
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "per-event" => Ok(Mode::PerEvent),
            "batch" => Ok(Mode::Batch),
            other => Err(format!("unknown mode {other:?} (batch or per-event)")),
        }
    }
}

impl Config {
    /// The idempotency scope: the configured one, else the group.
    pub fn scope(&self) -> &str {
        self.scope.as_deref().unwrap_or(&self.group)
    }

    /// The consumer name of this instance.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The streams read.
    pub fn streams(&self) -> &[String] {
        &self.streams
    }

    /// At most this many entries are read but not finished at once.
    pub(crate) fn max_in_flight(&self) -> usize {
        self.workers * self.count * 2
    }

    /// About this many bytes of entry fields are held at once (one read
    /// more at worst): a full read of entries at the size limit, and no
    /// less than 8 MiB.
    pub(crate) fn max_in_flight_bytes(&self) -> usize {
        (self.count.saturating_mul(self.max_entry_bytes)).max(8 << 20)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("redis_url", &redact(&self.redis_url))
            .field("database_url", &redact(&self.database_url))
            .field("redis_tls", &self.redis_tls)
            .field("streams", &self.streams)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("scope", &self.scope())
            .field("start_id", &self.start_id)
            .field("workers", &self.workers)
            .field("count", &self.count)
            .field("block", &self.block)
            .field("marker_ttl", &self.marker_ttl)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("until_idle", &self.until_idle)
            .field("max_attempts", &self.max_attempts)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_cap", &self.backoff_cap)
            .field("max_retry_after", &self.max_retry_after)
            .field("reclaim_interval", &self.reclaim_interval)
            .field("reclaim_min_idle", &self.reclaim_min_idle)
            .field("max_event_id_bytes", &self.max_event_id_bytes)
            .field("max_entry_bytes", &self.max_entry_bytes)
            .field("handler_timeout", &self.handler_timeout)
            .field("mode", &self.mode)
            .finish()
    }
}

/// The default consumer name: the host name, which stays the same across
/// restarts of one instance. Run a second instance on the same host with its
/// own `consumer` name.
pub(crate) fn default_consumer_name() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    if host.is_empty() {
        "taskhub".to_owned()
    } else {
        host
    }
}

/// Builds a [`Worker`](crate::Worker). Every setter documents its default.
#[derive(Debug, Clone)]
pub struct Builder {
    config: Config,
}

impl Default for Builder {
    fn default() -> Builder {
        Builder {
            config: Config {
                redis_url: "redis://127.0.0.1:6379".into(),
                database_url: "postgres://postgres:taskhub@127.0.0.1:5432/taskhub".into(),
                redis_tls: Tls::default(),
                streams: Vec::new(),
                group: "workers".into(),
                consumer: default_consumer_name(),
                scope: None,
                start_id: "0".into(),
                workers: 8,
                count: 64,
                block: Duration::from_secs(2),
                marker_ttl: Duration::from_secs(24 * 3600),
                shutdown_timeout: Duration::from_secs(30),
                until_idle: false,
                max_attempts: 5,
                backoff_base: Duration::from_millis(200),
                backoff_cap: Duration::from_secs(30),
                max_retry_after: Duration::from_secs(120),
                reclaim_interval: Duration::from_secs(30),
                reclaim_min_idle: Duration::from_secs(300),
                max_event_id_bytes: 256,
                max_entry_bytes: 1024 * 1024,
                handler_timeout: Duration::from_secs(60),
                mode: Mode::Batch,
            },
        }
    }
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $ty) -> Builder {
            self.config.$name = value.into();
            self
        }
    };
}

impl Builder {
    setter!(
        /// Redis URL (`redis://[user:password@]host:port[/db]`, `rediss://`
        /// for TLS). For a Redis Cluster, any node's URL (detected with
        /// `INFO cluster`) or several separated by commas.
        /// Defaults to `redis://127.0.0.1:6379`.
        redis_url: &str
    );
    setter!(
        /// PostgreSQL URL or key-value string. TLS settings are libpq's URL
        /// parameters: `sslmode` (`disable`, `prefer`, `require`,
        /// `verify-ca`, `verify-full`), `sslrootcert` (the CA file), `sslcert`
        /// and `sslkey` (a client certificate).
        /// Defaults to `postgres://postgres:taskhub@127.0.0.1:5432/taskhub`.
        database_url: &str
    );
    setter!(
        /// TLS files for a `rediss://` URL, one server or a cluster: the CA
        /// to verify the servers with, and a client certificate.
        /// Defaults to none: the system's trust store, no client certificate.
        redis_tls: Tls
    );
    setter!(
        /// The consumer group; created (with MKSTREAM) when missing.
        /// Defaults to `workers`.
        group: &str
    );
    setter!(
        /// This instance's consumer name. It must be stable across restarts
        /// (its pending entries are re-read at start) and unique among running
        /// instances. Defaults to the host name.
        consumer: &str
    );
    setter!(
        /// Where a new group starts reading: `0` (the whole stream) or `$`
        /// (only new entries). Defaults to `0`.
        start_id: &str
    );
    setter!(
        /// Number of worker threads. Defaults to 8.
        workers: usize
    );
    setter!(
        /// Entries per XREADGROUP (`COUNT`), and so the largest batch.
        /// Defaults to 64.
        count: usize
    );
    setter!(
        /// How long one XREADGROUP blocks (`BLOCK`); a shutdown is seen within
        /// this time. Defaults to 2 s.
        block: Duration
    );
    setter!(
        /// Lifetime of the Redis duplicate marker. Defaults to 24 h.
        marker_ttl: Duration
    );
    setter!(
        /// How long a graceful shutdown may take; must be positive.
        /// Defaults to 30 s.
        shutdown_timeout: Duration
    );
    setter!(
        /// Stop once nothing new arrives and the group has nothing pending.
        /// Defaults to false.
        until_idle: bool
    );
    setter!(
        /// All attempts of one event, the first included, before it is
        /// dead-lettered; Redis deliveries count too. Defaults to 5.
        max_attempts: u32
    );
    setter!(
        /// First retry delay; doubles with each attempt. Defaults to 200 ms.
        backoff_base: Duration
    );
    setter!(
        /// Longest retry delay. Defaults to 30 s.
        backoff_cap: Duration
    );
    setter!(
        /// Longest `Retry-After` honoured; a longer one is cut to this.
        /// Defaults to 120 s.
        max_retry_after: Duration
    );
    setter!(
        /// How often the reclaimer runs XAUTOCLAIM. Defaults to 30 s.
        reclaim_interval: Duration
    );
    setter!(
        /// How long an entry must sit unacknowledged before another consumer
        /// may take it over. At least 2 s, and longer than the longest single
        /// retry wait (`backoff_cap`, `max_retry_after`). A handler run or
        /// a wait that outlasts it is safe: an entry held for over a second
        /// is checked (and its idle time reset) before it is committed, and
        /// a holder that lost it to another consumer stops working on it.
        /// Defaults to 300 s.
        reclaim_min_idle: Duration
    );
    setter!(
        /// Longest a handler's SQL statement may run (PostgreSQL's
        /// `statement_timeout` on every worker connection; the `--http-url`
        /// handler's requests too). A statement cancelled by it is a
        /// retryable failure. Defaults to 60 s.
        handler_timeout: Duration
    );
    setter!(
        /// Batch or per-event commits. Defaults to [`Mode::Batch`].
        mode: Mode
    );
    setter!(
        /// Longest accepted `event_id`, in bytes. Defaults to 256.
        max_event_id_bytes: usize
    );
    setter!(
        /// Largest accepted entry (all names and values), in bytes.
        /// Defaults to 1 MiB.
        max_entry_bytes: usize
    );

    /// Adds a stream to read; one reader thread per stream. At least one is
    /// required. Defaults to none.
    pub fn stream(mut self, stream: &str) -> Builder {
        self.config.streams.push(stream.to_owned());
        self
    }

    /// The idempotency scope: events are applied once per scope. Defaults to
    /// the group name, so two groups reading one stream each apply their own
    /// effect once.
    pub fn scope(mut self, scope: &str) -> Builder {
        self.config.scope = Some(scope.to_owned());
        self
    }

    /// Checks the configuration without building a worker, for a handler
    /// that backs off as the worker does: one with a retry budget of its own
    /// (`HttpHandler`) has its cap checked against the min-idle instead of
    /// the worker's, which [`build`](Builder::build) does.
    pub fn validate(self) -> Result<Config, Error> {
        self.validate_for(None)
    }

    /// [`validate`](Builder::validate) for a handler whose own retry
    /// `budget`, if any, replaces the worker's backoff: its cap, not the
    /// worker's (unused, perhaps its default), is the longest backoff wait.
    /// (Checked against the worker's, a `--http-url` run with
    /// `--backoff-cap 1s` was refused any min-idle up to the 30 s it never
    /// set; found by a hostile test.)
    pub(crate) fn validate_for(self, budget: Option<Duration>) -> Result<Config, Error> {
        let c = self.config;
        let err = |m: String| Err(Error::config(m));
        if c.streams.is_empty() {
            return err("at least one stream is required".into());
        }
        for name in c.streams.iter().chain([&c.group, &c.consumer]) {
            if name.is_empty() || name.chars().any(char::is_control) {
                return err(format!(
                    "names must be non-empty and free of control characters: {name:?}"
                ));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for s in &c.streams {
            if !seen.insert(s) {
                return err(format!("stream {s:?} is given twice"));
            }
            // Its entries are letters, not events: consumed, each would be
            // applied as an event (inserted as one) and acked, gone from the
            // dead letters for good.
            if let Some(of) = s.strip_suffix(":dlq") {
                // One shell word (control characters are refused above).
                let of = format!("'{}'", of.replace('\'', "'\\''"));
                return err(format!(
                    "stream {s:?} is the dead-letter stream of {of}: its letters are not events \
                     (see them with `taskhub dlq --stream {of} list`, put them back with \
                     `taskhub dlq --stream {of} replay`)"
                ));
            }
        }
        if c.scope.as_deref() == Some("") {
            return err("scope must not be empty".into());
        }
        if c.start_id != "0" && c.start_id != "$" {
            return err(format!("start id must be 0 or $, not {:?}", c.start_id));
        }
        if c.workers == 0 || c.workers > 1024 {
            return err(format!(
                "workers must be between 1 and 1024, not {}",
                c.workers
            ));
        }
        if c.count == 0 || c.count > 10_000 {
            return err(format!(
                "count must be between 1 and 10000, not {}",
                c.count
            ));
        }
        if c.block < Duration::from_millis(1) || c.block > Duration::from_secs(60) {
            return err(format!(
                "block must be between 1 ms and 60 s, not {:?}",
                c.block
            ));
        }
        if c.shutdown_timeout.is_zero() {
            return err(
                "shutdown timeout must be positive: it is how long a graceful stop may take, \
                 and a zero one fails every stop"
                    .into(),
            );
        }
        if c.marker_ttl < Duration::from_secs(1) {
            return err("marker TTL must be at least 1 s".into());
        }
        if c.max_attempts == 0 {
            return err("max attempts must be at least 1".into());
        }
        if c.backoff_base.is_zero() || c.backoff_cap < c.backoff_base {
            return err(format!(
                "backoff base must be positive and not above the cap ({:?} > {:?})",
                c.backoff_base, c.backoff_cap
            ));
        }
        if c.reclaim_interval.is_zero() {
            return err("reclaim interval must be positive".into());
        }
        if c.handler_timeout < Duration::from_millis(1) {
            return err("handler timeout must be at least 1 ms".into());
        }
        // PostgreSQL's statement_timeout is a 32-bit count of milliseconds.
        if c.handler_timeout > Duration::from_millis(i32::MAX as u64) {
            return err(format!(
                "handler timeout must be at most 24 days (PostgreSQL's statement_timeout), not {:?}",
                c.handler_timeout
            ));
        }
        // Sent to Redis as milliseconds (XAUTOCLAIM) and seconds (SET EX).
        const TEN_YEARS: Duration = Duration::from_secs(10 * 365 * 86_400);
        for (name, d) in [
            ("reclaim min-idle", c.reclaim_min_idle),
            ("marker TTL", c.marker_ttl),
        ] {
            if d > TEN_YEARS {
                return err(format!("{name} must be at most 10 years, not {d:?}"));
            }
        }
        if c.reclaim_min_idle < Duration::from_secs(2) {
            return err(format!(
                "reclaim min-idle must be at least 2s, not {:?} (entries held for up to 1 s are \
                 committed without asking Redis whether another consumer took them over)",
                c.reclaim_min_idle
            ));
        }
        let (cap, whose) = match budget {
            Some(cap) => (cap, "the handler's backoff cap"),
            None => (c.backoff_cap, "the backoff cap"),
        };
        let longest_wait = cap.max(c.max_retry_after);
        if c.reclaim_min_idle <= longest_wait {
            // Say which settings make up the figure, so the user knows what
            // to change (`taskhub run`: --backoff-cap, --max-retry-after).
            return err(format!(
                "reclaim min-idle ({:?}) must exceed the longest retry wait ({:?}: the larger of \
                 {whose}, {:?}, and the max retry-after, {:?}), or entries waiting for a \
                 retry would be taken over by other consumers; raise the min-idle or lower those",
                c.reclaim_min_idle, longest_wait, cap, c.max_retry_after
            ));
        }
        if c.max_event_id_bytes == 0 || c.max_event_id_bytes > 2048 {
            return err(
                "max event_id bytes must be between 1 and 2048 (a PostgreSQL index limit)".into(),
            );
        }
        // The key of processed_events is (scope, event_id); PostgreSQL's
        // B-tree index refuses a row over 2,704 bytes, and every event of a
        // scope too long for the longest id failed, retryable, until it
        // was dead-lettered (found by a hostile test).
        let scope = c.scope.as_deref().unwrap_or(&c.group);
        if scope.len() + c.max_event_id_bytes > KEY_MAX {
            return err(format!(
                "the scope ({} bytes{}) and the longest event_id ({} bytes) make a \
                 processed_events key over what its index takes: keep their sum within {KEY_MAX} bytes",
                scope.len(),
                if c.scope.is_none() { ", the group's name" } else { "" },
                c.max_event_id_bytes
            ));
        }
        if c.max_entry_bytes == 0 {
            return err("max entry bytes must be positive".into());
        }
        // An idle reader sees a stop when its blocking read returns: a
        // block as long as the shutdown timeout failed every graceful stop
        // of an idle worker (found by a hostile test).
        if c.block >= c.shutdown_timeout {
            return err(format!(
                "block ({:?}) must be shorter than the shutdown timeout ({:?}): an idle reader \
                 sees a stop only when its blocking read returns",
                c.block, c.shutdown_timeout
            ));
        }
        Ok(c)
    }
}

/// The most bytes of a scope and an event id together (the index of
/// `processed_events` takes rows up to 2,704 bytes, headers included).
const KEY_MAX: usize = 2600;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_once_a_stream_is_given() {
        assert!(Builder::default().validate().is_err());
        let c = Builder::default().stream("s").validate().unwrap();
        assert_eq!(c.scope(), "workers");
        assert_eq!(c.max_attempts, 5);
    }

    #[test]
    fn bad_values_are_rejected_with_a_message() {
        let b = || Builder::default().stream("s");
        for (builder, needle) in [
            (b().workers(0), "workers"),
            (b().count(0), "count"),
            (b().block(Duration::ZERO), "block"),
            (b().max_attempts(0), "attempts"),
            (
                b().backoff_base(Duration::from_secs(9))
                    .backoff_cap(Duration::from_secs(1)),
                "backoff",
            ),
            (b().reclaim_min_idle(Duration::from_secs(1)), "min-idle"),
            (
                b().reclaim_min_idle(Duration::from_secs(60)),
                "max retry-after",
            ),
            (b().shutdown_timeout(Duration::ZERO), "shutdown timeout"),
            (
                b().block(Duration::from_secs(60))
                    .shutdown_timeout(Duration::from_secs(20)),
                "shorter than the shutdown timeout",
            ),
            (
                b().scope(&"s".repeat(700)).max_event_id_bytes(2048),
                "processed_events key",
            ),
            (b().group(&"g".repeat(2600)), "the group's name"),
            (b().stream("s"), "twice"),
            (b().start_id("7"), "start id"),
            (
                b().handler_timeout(Duration::from_secs(40 * 86_400)),
                "24 days",
            ),
            (b().marker_ttl(Duration::MAX), "marker TTL must be at most"),
            (
                b().reclaim_min_idle(Duration::MAX),
                "min-idle must be at most",
            ),
            (
                Builder::default().stream("orders:dlq"),
                "the dead-letter stream of 'orders'",
            ),
        ] {
            let e = builder.validate().unwrap_err();
            assert!(
                e.to_string().contains(needle),
                "{e} should mention {needle}"
            );
        }
    }

    #[test]
    fn debug_hides_passwords() {
        let c = Builder::default()
            .stream("s")
            .database_url("postgres://u:secret@h/db")
            .redis_url("redis://:hunter2@h:6379")
            .validate()
            .unwrap();
        let text = format!("{c:?}");
        assert!(
            !text.contains("secret") && !text.contains("hunter2"),
            "{text}"
        );
        // A worker and its monitor show what they run, no password either.
        let worker = crate::Worker::builder()
            .stream("orders")
            .group("billing")
            .database_url("postgres://u:secret@h/db")
            .redis_url("redis://:hunter2@h:6379")
            .build(crate::SqlHandler::default())
            .unwrap();
        for text in [format!("{worker:?}"), format!("{:?}", worker.monitor())] {
            assert!(
                text.contains("orders") && text.contains("billing"),
                "{text}"
            );
            assert!(
                !text.contains("secret") && !text.contains("hunter2"),
                "{text}"
            );
        }
    }
}
