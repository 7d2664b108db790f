//! [`Monitor`]: a read-only view of a running worker, for whatever watches
//! it from beside (the HTTP endpoint, the alerts, an embedding program's own
//! metrics): its counters, what it holds, whether its servers answer.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use crate::postgres::pool::{PgConn, PgPool};
use crate::redis::pool::{PooledRedis, RedisPool};
use crate::shutdown::Shutdown;
use crate::worker::flow::InFlight;
use crate::worker::stats::{Health, Stats, Summary, DURATION_BUCKETS};

/// Why a look got no connection: the others hold every place.
pub(crate) const BUSY: &str =
    "busy: other requests hold the connections the page may use; try again";

/// How long a look waits for a pooled connection.
const WAIT: Duration = Duration::from_secs(2);
/// How long a look waits for its place: requests queue behind the two that
/// run (a page of big letters takes a second or two) rather than fail.
const LOOK_WAIT: Duration = Duration::from_secs(10);

/// How many looks (page requests, alerts, an embedding program's) hold a
/// connection to each server at once; the pools have room for them beside
/// the worker's own. More would take the worker's connections and Redis's
/// time: sixteen clients asking the dead-letter page over and over slowed a
/// drain of 30,000 events from 1.7 s to 410 s.
pub(crate) const LOOKS: usize = 2;

/// The room the pools keep beside the worker's own: Redis for the looks and
/// the page's bulk action (one at a time, see `redis_conn_for_bulk`),
/// PostgreSQL for the looks.
pub(crate) const REDIS_ROOM: u32 = LOOKS as u32 + 1;
pub(crate) const PG_ROOM: u32 = LOOKS as u32;

/// Free places, taken with a bounded wait and given back when the [`Slot`]
/// is dropped.
#[derive(Debug)]
pub(crate) struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    pub fn new(places: usize) -> Arc<Slots> {
        Arc::new(Slots {
            free: Mutex::new(places),
            freed: Condvar::new(),
        })
    }

    /// A place, waiting for one up to `wait`, or until `stop()`; `None`
    /// if none came free.
    fn take(self: &Arc<Slots>, wait: Duration, stop: &dyn Fn() -> bool) -> Option<Slot> {
        let deadline = crate::shutdown::deadline_after(wait);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        while *free == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || stop() {
                return None;
            }
            free = self
                .freed
                .wait_timeout(free, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *free -= 1;
        Some(Slot(self.clone()))
    }
}

/// One place of [`Slots`].
#[derive(Debug)]
pub(crate) struct Slot(Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.0.freed.notify_one();
    }
}

/// A pooled connection held by a look, with its place: it dereferences to
/// the connection, and gives both back when dropped.
pub(crate) struct Look<C> {
    conn: C,
    /// None for the bulk action's connection, and once the worker stops.
    _slot: Option<Slot>,
}

impl<C: Deref> Deref for Look<C> {
    type Target = C::Target;

    fn deref(&self) -> &C::Target {
        &self.conn
    }
}

impl<C: DerefMut> DerefMut for Look<C> {
    fn deref_mut(&mut self) -> &mut C::Target {
        &mut self.conn
    }
}

/// A read-only view of a [`Worker`](crate::Worker), taken with
/// [`Worker::monitor`](crate::Worker::monitor) before `run()`. Cheap to
/// clone and to ask; until `run()` has connected, it answers as "starting".
#[derive(Clone)]
pub struct Monitor {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("streams", &self.streams())
            .field("group", &self.group())
            .field("in_flight", &self.in_flight())
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub stats: Arc<Stats>,
    pub health: Arc<Health>,
    pub flow: InFlight,
    pub shutdown: Shutdown,
    pub streams: Vec<String>,
    pub group: String,
    pub consumer: String,
    /// `--max-entry-bytes`: what a replay from the page may put back.
    pub max_entry_bytes: usize,
    pub started: SystemTime,
    /// The name of a thread that stopped unexpectedly, if any.
    pub thread_died: Mutex<Option<String>>,
    /// The retries waiting in this process.
    pub retrying: Arc<crate::worker::retry::Board>,
    /// The pools, once `run()` made them.
    pub servers: OnceLock<(RedisPool, PgPool)>,
    /// The places of the looks at Redis and at PostgreSQL ([`LOOKS`] each).
    pub looks: (Arc<Slots>, Arc<Slots>),
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

    /// The worker's `--max-entry-bytes`.
    pub(crate) fn max_entry_bytes(&self) -> usize {
        self.inner.max_entry_bytes
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
            // Past the looks' limit: a flood of page requests must not
            // make the worker look unready.
            let (redis, pg) = self.inner.servers.get().expect("checked above");
            let redis = checkout(redis).and_then(|mut c| {
                redis::cmd("PING")
                    .query::<()>(&mut *c)
                    .map_err(|e| e.to_string())
            });
            if let Err(e) = redis {
                problems.push(format!("redis: {}", crate::net::plain(&e)));
            }
            // Off the caller's thread when that is an async runtime's (a
            // health endpoint of an async server): the sync client starts
            // a runtime of its own, which panics inside another.
            let pg = crate::runtime::off_async(|| {
                checkout(pg).and_then(|mut c| {
                    c.simple_query("SELECT 1")
                        .map(drop)
                        .map_err(|e| e.to_string())
                })
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

    /// One of the worker's Redis connections, for the HTTP page and alerts:
    /// one of the [`LOOKS`] places.
    pub(crate) fn redis_conn(&self) -> Result<Look<PooledRedis>, String> {
        self.redis_conn_within(LOOK_WAIT)
    }

    /// [`Monitor::redis_conn`], waiting at most `wait` for a place.
    pub(crate) fn redis_conn_within(&self, wait: Duration) -> Result<Look<PooledRedis>, String> {
        let (redis, _) = self.inner.servers.get().ok_or("not connected yet")?;
        let slot = self.place(&self.inner.looks.0, wait)?;
        Ok(Look {
            conn: checkout(redis)?,
            _slot: slot,
        })
    }

    /// A Redis connection for the page's bulk action, which holds it for as
    /// long as the action runs (minutes, at its rate): not one of the
    /// looks' places, so the page and alerts keep theirs. The pools have
    /// room for it: the page runs one bulk action at a time.
    pub(crate) fn redis_conn_for_bulk(&self) -> Result<Look<PooledRedis>, String> {
        let (redis, _) = self.inner.servers.get().ok_or("not connected yet")?;
        Ok(Look {
            conn: checkout(redis)?,
            _slot: None,
        })
    }

    /// One of the worker's PostgreSQL sessions (read-only outside a
    /// transaction that says READ WRITE): one of the [`LOOKS`] places.
    pub(crate) fn pg_conn(&self) -> Result<Look<PgConn>, String> {
        let (_, pg) = self.inner.servers.get().ok_or("not connected yet")?;
        let slot = self.place(&self.inner.looks.1, LOOK_WAIT)?;
        Ok(Look {
            conn: checkout(pg)?,
            _slot: slot,
        })
    }

    /// A place among `slots`, waiting at most `wait`; none needed once the
    /// worker stops (its threads need no room any more, and what runs then,
    /// the alerts giving their lease back, must not wait behind the page).
    fn place(&self, slots: &Arc<Slots>, wait: Duration) -> Result<Option<Slot>, String> {
        let stopping = || self.inner.shutdown.is_shutdown();
        match slots.take(wait, &stopping) {
            Some(slot) => Ok(Some(slot)),
            None if stopping() => Ok(None),
            None => Err(BUSY.to_owned()),
        }
    }

    /// Runs `f` with one of the worker's PostgreSQL sessions (read-only
    /// outside a transaction that says READ WRITE); `None` when none came
    /// within about twelve seconds: the worker's own are never lent, and at
    /// most two looks (the HTTP page's, alerts', this method's callers')
    /// hold one at once, the others waiting for their place.
    ///
    /// Call it off async runtimes' threads (`spawn_blocking`): the sync
    /// `postgres` client starts a runtime of its own for each call, which
    /// panics inside another. ([`Monitor::ready`] moves its own question
    /// off such a thread.)
    pub fn with_postgres<T>(&self, f: impl FnOnce(&mut postgres::Client) -> T) -> Option<T> {
        let mut conn = self.pg_conn().ok()?;
        Some(f(&mut conn))
    }
}

#[cfg(test)]
impl Monitor {
    /// Connects the pools as `run()` would (small ones), for the tests of
    /// what watches a worker.
    pub(crate) fn connect_for_test(&self, redis_url: &str, database_url: &str) {
        let client = crate::redis::RedisClient::open(redis_url, &crate::Tls::default())
            .expect("the test Redis");
        let redis = crate::redis::pool::redis_pool(&client, redis_url, 4).expect("a Redis pool");
        let setup = crate::postgres::pool::Setup {
            namespace: Default::default(),
            statement_timeout: Duration::from_secs(5),
        };
        let pg = crate::postgres::pool::postgres_pool(database_url, 1, setup)
            .expect("a PostgreSQL pool");
        let _ = self.inner.servers.set((redis, pg));
    }

    /// How many of the looks' places at Redis are free now.
    pub(crate) fn free_redis_looks(&self) -> usize {
        *self.inner.looks.0.free.lock().unwrap()
    }
}

/// A connection of `pool`, waiting for one at most [`WAIT`].
fn checkout<M: r2d2::ManageConnection>(
    pool: &r2d2::Pool<M>,
) -> Result<r2d2::PooledConnection<M>, String> {
    pool.get_timeout(WAIT)
        .map_err(|e| format!("no connection: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_take_at_most_their_places_and_give_them_back() {
        let slots = Slots::new(2);
        let go_on = || false;
        let (a, b) = (slots.take(WAIT, &go_on), slots.take(WAIT, &go_on));
        assert!(a.is_some() && b.is_some());
        assert!(slots.take(Duration::from_millis(20), &go_on).is_none());
        // Asked to stop: no wait.
        let started = Instant::now();
        assert!(slots.take(Duration::from_secs(10), &|| true).is_none());
        assert!(started.elapsed() < Duration::from_secs(5));
        // One given back while another waits: the waiter gets it.
        let waiter = {
            let slots = slots.clone();
            std::thread::spawn(move || slots.take(Duration::from_secs(10), &|| false).is_some())
        };
        std::thread::sleep(Duration::from_millis(20));
        drop(a);
        assert!(waiter.join().unwrap());
        drop(b);
        assert!(slots.take(Duration::ZERO, &go_on).is_some());
    }
}
