//! The Redis pool shared by the worker threads, the retry and dead-letter
//! threads and the reclaimer (the readers keep connections of their own).

use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind};
use crate::net::{pool_builder, REDIS_COMMAND_TIMEOUT};
use crate::redact::redact;
use crate::redis::client::RedisClient;
use crate::redis::conn::RedisConn;

/// The pool.
pub(crate) type RedisPool = r2d2::Pool<RedisManager>;
/// A connection of that pool; it dereferences to a [`RedisConn`].
pub(crate) type PooledRedis = r2d2::PooledConnection<RedisManager>;

/// r2d2 manager for Redis connections (to one server or a cluster) that
/// carry read and write timeouts (redis-rs' own r2d2 support opens
/// connections without any).
#[derive(Clone)]
pub(crate) struct RedisManager {
    client: RedisClient,
}

/// A connection of the pool, with when it was last given back: one that
/// sat idle longer than [`IDLE_CHECK`] is asked a PING before it is handed
/// out. A server with a `timeout` closes connections idle that long, and
/// the first command after a quiet spell met a closed connection, which
/// the worker took for an outage: an error logged and a pause, on every
/// burst, with Redis up all along (found by a hostile test). Busy
/// connections are handed out with no round trip.
pub(crate) struct Pooled {
    conn: RedisConn,
    back_at: Instant,
}

impl std::ops::Deref for Pooled {
    type Target = RedisConn;

    fn deref(&self) -> &RedisConn {
        &self.conn
    }
}

impl std::ops::DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut RedisConn {
        &mut self.conn
    }
}

/// How long a pooled connection may sit idle before it is checked on its
/// way out: the shortest `timeout` Redis takes is 1 s. Under a load of
/// more than an event a second the connections come back sooner; below
/// it, a round trip more per event costs nothing that shows.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// How long that check waits for its PING's answer.
const IDLE_PING: Duration = Duration::from_millis(500);

impl r2d2::ManageConnection for RedisManager {
    type Connection = Pooled;
    type Error = redis::RedisError;

    fn connect(&self) -> Result<Pooled, redis::RedisError> {
        Ok(Pooled {
            conn: self.client.connect(REDIS_COMMAND_TIMEOUT)?,
            back_at: Instant::now(),
        })
    }

    /// Called on check-out (the pool tests every connection it hands out).
    /// The PING waits at most [`IDLE_PING`]: a server that closed the
    /// connection answers at once, and r2d2 tests idle connections one
    /// after another inside `get`, where a server that never answers
    /// would cost the command timeout each (found in review). On a
    /// cluster, redis-rs sends PING to every primary and reconnects a node
    /// on its own: no PING.
    fn is_valid(&self, conn: &mut Pooled) -> Result<(), redis::RedisError> {
        if conn.back_at.elapsed() < IDLE_CHECK {
            return Ok(());
        }
        match &mut conn.conn {
            RedisConn::Single { conn: c, .. } => {
                c.set_read_timeout(Some(IDLE_PING))?;
                let answered = redis::cmd("PING").query::<()>(c);
                c.set_read_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
                answered
            }
            RedisConn::Cluster { .. } => Ok(()),
        }
    }

    /// Called when a connection is given back.
    fn has_broken(&self, conn: &mut Pooled) -> bool {
        conn.back_at = Instant::now();
        conn.is_broken()
    }
}

/// The Redis pool shared by the workers, the retry, dead-letter and reclaim
/// threads. `client` was checked when it was opened.
pub(crate) fn redis_pool(client: &RedisClient, url: &str, size: u32) -> Result<RedisPool, Error> {
    pool_builder(size, "taskhub-redis-pool-{}")
        .test_on_check_out(true)
        .build(RedisManager {
            client: client.clone(),
        })
        .map_err(|e| {
            Error::with_source(
                ErrorKind::Redis,
                format!("cannot connect to Redis at {}", redact(url)),
                e,
            )
        })
}
