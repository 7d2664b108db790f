//! What the stages of the worker share, handed to each one explicitly: the
//! stop flag, the counters, the servers' health and the Redis pool
//! ([`Common`]), and who claims entries with which limits ([`Claim`]).
//! Each stage's file starts with the struct of what that stage holds;
//! nothing reaches back up to the main loop.

use std::sync::Arc;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::event::Limits;
use crate::redis::pool::{PooledRedis, RedisPool};
use crate::redis::RedisConn;
use crate::shutdown::Shutdown;
use crate::worker::stats::{Health, Server, Stats};

/// What every thread of the worker uses.
#[derive(Clone)]
pub(crate) struct Common {
    /// Connections for everything but the readers' blocking reads.
    pub redis: RedisPool,
    pub stats: Arc<Stats>,
    pub health: Arc<Health>,
    pub shutdown: Shutdown,
}

/// The consumer that reads and claims entries, and the limits an entry must
/// respect.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    pub group: String,
    pub consumer: String,
    pub limits: Limits,
}

/// Wait before reconnecting after the `n`th consecutive failure to reach a
/// server.
pub(crate) fn outage_backoff(n: u32) -> Duration {
    const OUTAGE: Backoff = Backoff {
        base: Duration::from_millis(100),
        cap: Duration::from_secs(5),
        max_retry_after: Duration::ZERO,
    };
    OUTAGE.delay(n, None)
}

impl Common {
    /// A pooled Redis connection; a pool that cannot give one is an outage.
    pub fn redis_conn(&self) -> redis::RedisResult<PooledRedis> {
        self.redis.get().map_err(|e| {
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("no Redis connection: {e}"),
            ))
        })
    }

    /// Runs `f` with a pooled Redis connection, retrying through outages.
    /// `None` when a shutdown interrupted the wait, or after three failures
    /// that are not an outage (out of memory, a refused command: the
    /// entries stay pending and come back by reclaim).
    pub fn with_redis<T>(
        &self,
        mut f: impl FnMut(&mut RedisConn) -> redis::RedisResult<T>,
    ) -> Option<T> {
        let mut failures = 0u32;
        loop {
            match self.redis_conn().and_then(|mut conn| f(&mut conn)) {
                Ok(value) => {
                    if failures > 0 {
                        self.health.up(Server::Redis);
                    }
                    return Some(value);
                }
                Err(e) => {
                    failures += 1;
                    if crate::redis::is_outage(&e) {
                        self.health.down(Server::Redis, &e);
                    } else {
                        log::error!("redis: {e}");
                        if failures >= 3 {
                            return None;
                        }
                    }
                    if self.shutdown.sleep(outage_backoff(failures)) {
                        return None;
                    }
                }
            }
        }
    }
}
