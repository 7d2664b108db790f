//! Connections to Redis and PostgreSQL: the pools the workers share, the
//! readers' own long-blocking connections, and URL redaction for messages.
//!
//! Every connection has a timeout, so a server that stops answering turns into
//! an error instead of a thread that hangs forever. Pools do not test a
//! connection on check-out (that would cost a round trip per batch); a broken
//! connection is noticed by its next command and dropped by the pool.

use std::time::Duration;

use crate::error::{Error, ErrorKind};

/// How long to wait for a TCP connection or a pooled connection.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one ordinary Redis command may take before the connection is
/// considered lost.
pub(crate) const REDIS_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) type PgManager = r2d2_postgres::PostgresConnectionManager<postgres::NoTls>;
pub(crate) type PgPool = r2d2::Pool<PgManager>;
pub(crate) type PgConn = r2d2::PooledConnection<PgManager>;
pub(crate) type RedisPool = r2d2::Pool<RedisManager>;

/// Returns `url` with any password replaced by `***`, for logs and errors.
pub fn redact(url: &str) -> String {
    // URL form: scheme://user:password@host/...
    let mut out = url.to_string();
    if let Some(scheme_end) = out.find("://") {
        let rest_start = scheme_end + 3;
        let authority_end = out[rest_start..]
            .find(['/', '?', '#'])
            .map_or(out.len(), |i| rest_start + i);
        if let Some(at) = out[rest_start..authority_end].rfind('@') {
            let userinfo = &out[rest_start..rest_start + at];
            if let Some(colon) = userinfo.find(':') {
                let start = rest_start + colon + 1;
                out.replace_range(start..rest_start + at, "***");
            }
        }
    }
    // Key-value form and query parameters: password=secret
    let mut result = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(i) = rest.find("password=") {
        let value_start = i + "password=".len();
        result.push_str(&rest[..value_start]);
        result.push_str("***");
        let value_end = rest[value_start..]
            .find([' ', '&'])
            .map_or(rest.len(), |j| value_start + j);
        rest = &rest[value_end..];
    }
    result.push_str(rest);
    result
}

fn pg_config(url: &str) -> Result<postgres::Config, Error> {
    let mut config: postgres::Config = url.parse().map_err(|e| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad PostgreSQL URL {:?}", redact(url)),
            e,
        )
    })?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    // A server that stops answering without closing the connection (a host
    // gone, a network partition) must turn into an error, not a worker
    // blocked for the kernel's 15-minute retransmission timeout.
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(Duration::from_secs(30));
    }
    if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        config.keepalives_idle(Duration::from_secs(30));
    }
    if config.get_application_name().is_none() {
        config.application_name("taskhub");
    }
    Ok(config)
}

/// One PostgreSQL connection (migrations, CLI commands).
pub(crate) fn postgres(url: &str) -> Result<postgres::Client, Error> {
    pg_config(url)?
        .connect(postgres::NoTls)
        .map_err(|e| pg_unreachable(url, e))
}

pub(crate) fn pg_unreachable(
    url: &str,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Error {
    Error::with_source(
        ErrorKind::Postgres,
        format!("cannot connect to PostgreSQL at {}", redact(url)),
        e,
    )
}

pub(crate) fn redis_unreachable(url: &str, e: redis::RedisError) -> Error {
    Error::with_source(
        ErrorKind::Redis,
        format!("cannot connect to Redis at {}", redact(url)),
        e,
    )
}

/// The PostgreSQL pool shared by the workers. Fails at once (after the
/// connect timeout) when the server cannot be reached.
pub(crate) fn postgres_pool(url: &str, size: u32) -> Result<PgPool, Error> {
    // One direct connection first: r2d2 would only report a timeout, this
    // names the cause (refused, authentication, unknown database...).
    drop(postgres(url)?);
    let manager = PgManager::new(pg_config(url)?, postgres::NoTls);
    pool_builder(size, "taskhub-pg-pool-{}")
        .build(manager)
        .map_err(|e| pg_unreachable(url, e))
}

/// The settings both pools share: no test on check-out (a broken connection
/// shows on its next command), a bounded wait, one named helper thread.
fn pool_builder<M: r2d2::ManageConnection>(size: u32, thread_name: &str) -> r2d2::Builder<M> {
    r2d2::Pool::builder()
        .max_size(size)
        .min_idle(Some(1))
        .test_on_check_out(false)
        .connection_timeout(CONNECT_TIMEOUT)
        .error_handler(Box::new(r2d2::NopErrorHandler))
        .thread_pool(std::sync::Arc::new(
            scheduled_thread_pool::ScheduledThreadPool::builder()
                .num_threads(1)
                .thread_name_pattern(thread_name)
                .build(),
        ))
}

/// Opens a Redis client for `url` (no connection yet).
pub(crate) fn redis_client(url: &str) -> Result<redis::Client, Error> {
    redis::Client::open(url).map_err(|e| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad Redis URL {:?}", redact(url)),
            e,
        )
    })
}

/// One Redis connection whose commands time out after `read_timeout`.
pub(crate) fn redis_connection(
    client: &redis::Client,
    read_timeout: Duration,
) -> redis::RedisResult<redis::Connection> {
    let conn = client.get_connection_with_timeout(CONNECT_TIMEOUT)?;
    conn.set_read_timeout(Some(read_timeout))?;
    conn.set_write_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
    Ok(conn)
}

/// r2d2 manager for Redis connections that carry read and write timeouts
/// (redis-rs' own r2d2 support opens connections without any).
#[derive(Debug, Clone)]
pub(crate) struct RedisManager {
    client: redis::Client,
}

impl r2d2::ManageConnection for RedisManager {
    type Connection = redis::Connection;
    type Error = redis::RedisError;

    fn connect(&self) -> Result<redis::Connection, redis::RedisError> {
        redis_connection(&self.client, REDIS_COMMAND_TIMEOUT)
    }

    fn is_valid(&self, conn: &mut redis::Connection) -> Result<(), redis::RedisError> {
        redis::cmd("PING").query::<()>(conn)
    }

    fn has_broken(&self, conn: &mut redis::Connection) -> bool {
        !redis::ConnectionLike::is_open(conn)
    }
}

/// The Redis pool shared by the workers, the retry, dead-letter and reclaim
/// threads. Fails at once when the server cannot be reached.
pub(crate) fn redis_pool(url: &str, size: u32) -> Result<RedisPool, Error> {
    let client = redis_client(url)?;
    // Check reachability with a real command so the error names the cause.
    let mut conn =
        redis_connection(&client, REDIS_COMMAND_TIMEOUT).map_err(|e| redis_unreachable(url, e))?;
    redis::cmd("PING")
        .query::<()>(&mut conn)
        .map_err(|e| redis_unreachable(url, e))?;
    drop(conn);
    pool_builder(size, "taskhub-redis-pool-{}")
        .build(RedisManager { client })
        .map_err(|e| {
            Error::with_source(
                ErrorKind::Redis,
                format!("cannot connect to Redis at {}", redact(url)),
                e,
            )
        })
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://user:s3cret@db:5432/app"),
            "postgres://user:***@db:5432/app"
        );
        assert_eq!(
            redact("redis://:pw@127.0.0.1:6379/0"),
            "redis://:***@127.0.0.1:6379/0"
        );
        assert_eq!(
            redact("host=db user=me password=hunter2 dbname=x"),
            "host=db user=me password=*** dbname=x"
        );
        assert_eq!(
            redact("postgres://db/app?password=x&sslmode=require"),
            "postgres://db/app?password=***&sslmode=require"
        );
        assert_eq!(redact("redis://127.0.0.1/"), "redis://127.0.0.1/");
        assert_eq!(redact("postgres://user@db/app"), "postgres://user@db/app");
    }
}
