//! The Redis pool shared by the worker threads, the retry and dead-letter
//! threads and the reclaimer (the readers keep connections of their own).

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

impl r2d2::ManageConnection for RedisManager {
    type Connection = RedisConn;
    type Error = redis::RedisError;

    fn connect(&self) -> Result<RedisConn, redis::RedisError> {
        self.client.connect(REDIS_COMMAND_TIMEOUT)
    }

    fn is_valid(&self, conn: &mut RedisConn) -> Result<(), redis::RedisError> {
        redis::cmd("PING").query::<()>(conn)
    }

    fn has_broken(&self, conn: &mut RedisConn) -> bool {
        conn.is_broken()
    }
}

/// The Redis pool shared by the workers, the retry, dead-letter and reclaim
/// threads. `client` was checked when it was opened.
pub(crate) fn redis_pool(client: &RedisClient, url: &str, size: u32) -> Result<RedisPool, Error> {
    pool_builder(size, "taskhub-redis-pool-{}")
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
