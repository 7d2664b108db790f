//! One Redis server or a Redis Cluster, behind one connection type.
//!
//! Everything else in the crate talks to a [`RedisConn`]. On a single server
//! it is a plain connection; on a cluster, redis-rs routes every command to
//! the node that owns its key's hash slot and follows `MOVED`/`ASK`
//! redirections after a resharding or a failover.
//!
//! What a cluster changes for us:
//! - A stream and its dead-letter stream (`<stream>:dlq`) must share a hash
//!   slot, because the dead letter and the ack are written by one Lua script:
//!   streams are named with a hash tag, like `{orders}` or `{orders}:events`.
//!   [`check_slots`] refuses other names with a message that says so.
//! - The duplicate markers (`th:<ns>:<len>:<scope>:<event_id>`, see
//!   `keys.rs`) spread over all slots: a pipeline of them is a [`Pipe`],
//!   which on a cluster sends one pipeline per node (in parallel on the
//!   wire, one round trip each). Since a marker hit skips PostgreSQL, a hit
//!   counts only when the reply proves it answers that key (`markers.rs`).

mod client;
mod conn;
pub(crate) mod keys;
pub(crate) mod markers;
mod packed;
pub(crate) mod pool;
mod script;
pub(crate) mod streams;

pub(crate) use client::{check_slots, connect, redis_unreachable, RedisClient};
pub(crate) use conn::is_redirection;
pub(crate) use conn::RedisConn;

/// Whether a Redis error means the connection or server is unavailable.
pub(crate) fn is_outage(err: &redis::RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
        || matches!(
            err.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading)
                | redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain)
                | redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown)
                | redis::ErrorKind::Server(redis::ServerErrorKind::MasterDown)
                | redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
                | redis::ErrorKind::ClusterConnectionNotFound
        )
        // A cluster's slot moved (failover, resharding): sent again on a
        // connection with a fresh slot map.
        || is_redirection(err)
}

/// A Redis failure inside a handler: an outage when the server is
/// unreachable, else retryable.
impl From<redis::RedisError> for crate::error::HandlerError {
    fn from(err: redis::RedisError) -> crate::error::HandlerError {
        let class = if is_outage(&err) {
            crate::error::FailureClass::Outage
        } else {
            crate::error::FailureClass::Retryable
        };
        crate::error::HandlerError::new(class, format!("redis: {err}"), Some(Box::new(err)))
    }
}
