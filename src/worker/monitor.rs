//! [`Monitor`]: a read-only view of a running worker, for whatever watches
//! it from beside (the HTTP endpoint, the alerts, an embedding program's own
//! metrics): its counters, what it holds, whether its servers answer.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use crate::postgres::pool::{PgConn, PgPool};
use crate::redis::pool::{PooledRedis, RedisPool};
use crate::shutdown::Shutdown;
use crate::worker::flow::InFlight;
use crate::worker::stats::{Health, Stats, Summary, DURATION_BUCKETS};

/// How long a look waits for a pooled connection.
const WAIT: Duration = Duration::from_secs(2);

/// A read-only view of a [`Worker`](crate::Worker), taken with
/// [`Worker::monitor`](crate::Worker::monitor) before `run()`. Cheap to
/// clone and to ask; until `run()` has connected, it answers as "starting".
#[derive(Clone)]
pub struct Monitor {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub stats: Arc<Stats>,
    pub health: Arc<Health>,
    pub flow: InFlight,
    pub shutdown: Shutdown,
    pub streams: Vec<String>,
    pub group: String,
    pub consumer: String,
    pub started: SystemTime,
    /// The name of a thread that stopped unexpectedly, if any.
    pub thread_died: Mutex<Option<String>>,
    /// The retries waiting in this process.
    pub retrying: Arc<crate::worker::retry::Board>,
    /// The pools, once `run()` made them.
    pub servers: OnceLock<(RedisPool, PgPool)>,
}

/// The handler durations, as a Prometheus histogram: cumulative counts per
/// upper bound (seconds), then the count of every call and their sum.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Durations {
    /// (upper bound in seconds, calls that took at most that long).
    pub buckets: Vec<(f64, u64)>,
    /// All calls.
    pub count: u64,
    /// Their total time, in seconds.
    pub sum_seconds: f64,
}

impl Monitor {
    /// What the worker did so far.
    pub fn summary(&self) -> Summary {
        self.inner.stats.snapshot()
    }

    /// What the worker did so far with the events of `stream` (handler
    /// panics are only counted in [`summary`](Monitor::summary)).
    pub fn summary_of(&self, stream: &str) -> Summary {
        self.inner.stats.snapshot_of(stream)
    }

    /// Entries read and not finished (parked retries included).
    pub fn in_flight(&self) -> usize {
        self.inner.flow.len()
    }

    /// How long the handler's calls took.
    pub fn handler_durations(&self) -> Durations {
        let (counts, sum_seconds) = self.inner.stats.handler_seconds.read();
        Durations {
            buckets: DURATION_BUCKETS.iter().copied().zip(counts).collect(),
            count: counts[counts.len() - 1],
            sum_seconds,
        }
    }

    /// The streams, group and consumer name of the worker.
    pub fn streams(&self) -> &[String] {
        &self.inner.streams
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.inner.group
    }

    /// This instance's consumer name.
    pub fn consumer(&self) -> &str {
        &self.inner.consumer
    }

    /// When the worker was made.
    pub fn started(&self) -> SystemTime {
        self.inner.started
    }

    /// Whether a shutdown was asked for.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown.is_shutdown()
    }

    /// The shutdown handle the worker stops on.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.inner.shutdown.clone()
    }

    /// The deliveries waiting for a retry in this process: how many, and
    /// the 100 due first (earliest first). Updated a few times a second.
    pub fn retrying(&self) -> (usize, Vec<crate::worker::retry::Retrying>) {
        self.inner.retrying.read()
    }

    /// The thread that stopped unexpectedly (the worker then shuts down).
    pub fn dead_thread(&self) -> Option<String> {
        self.inner
            .thread_died
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether the worker can do its work now: connected, not shutting
    /// down, every thread alive, and Redis and PostgreSQL answering (each
    /// asked through the worker's pools). The reasons it cannot, otherwise,
    /// one line each, starting with what is wrong (`redis: ...`).
    pub fn ready(&self) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        if self.inner.servers.get().is_none() {
            problems.push("starting: not connected yet".to_owned());
        } else {
            let redis = self.redis_conn().and_then(|mut c| {
                redis::cmd("PING")
                    .query::<()>(&mut *c)
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = redis {
                problems.push(format!("redis: {e}"));
            }
            let pg = self.pg_conn().and_then(|mut c| {
                c.simple_query("SELECT 1")
                    .map(drop)
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = pg {
                problems.push(format!("postgres: {e}"));
            }
        }
        if self.is_shutting_down() {
            problems.push("shutting down".to_owned());
        }
        if let Some(name) = self.dead_thread() {
            problems.push(format!("thread {name} stopped"));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }

    /// One of the worker's Redis connections, for the HTTP page and alerts.
    pub(crate) fn redis_conn(&self) -> Result<PooledRedis, String> {
        let (redis, _) = self.inner.servers.get().ok_or("not connected yet")?;
        redis
            .get_timeout(WAIT)
            .map_err(|e| format!("no connection: {e}"))
    }

    /// One of the worker's PostgreSQL sessions (read-only outside a
    /// transaction that says READ WRITE).
    pub(crate) fn pg_conn(&self) -> Result<PgConn, String> {
        let (_, pg) = self.inner.servers.get().ok_or("not connected yet")?;
        pg.get_timeout(WAIT)
            .map_err(|e| format!("no connection: {e}"))
    }

    /// Runs `f` with one of the worker's PostgreSQL sessions (read-only
    /// outside a transaction that says READ WRITE).
    pub fn with_postgres<T>(&self, f: impl FnOnce(&mut postgres::Client) -> T) -> Option<T> {
        let mut conn = self.pg_conn().ok()?;
        Some(f(&mut conn))
    }
}
