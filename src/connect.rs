//! Connections to Redis and PostgreSQL: the pools the workers share, the
//! readers' own long-blocking connections, and URL redaction for messages.
//!
//! Every connection has a timeout, so a server that stops answering turns into
//! an error instead of a thread that hangs forever. Pools do not test a
//! connection on check-out (that would cost a round trip per batch); a broken
//! connection is noticed by its next command and dropped by the pool.

use std::time::Duration;

use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, ErrorKind};
use crate::keys::{Identity, Namespace};
use crate::redis_conn::{RedisClient, RedisConn};
use crate::tls::Tls;

/// How long to wait for a TCP connection or a pooled connection.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one ordinary Redis command may take before the connection is
/// considered lost.
pub(crate) const REDIS_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

type PlainManager = r2d2_postgres::PostgresConnectionManager<postgres::NoTls>;
type TlsManager = r2d2_postgres::PostgresConnectionManager<MakeRustlsConnect>;

/// How the worker pool's connections are made: without TLS when the URL
/// says `sslmode=disable` (no TLS context at all), with it otherwise.
enum Connector {
    Plain(PlainManager),
    Tls(TlsManager),
}

/// What every new connection of the worker pool is set up with: the
/// statement timeout (`--handler-timeout`); read-only as the default for
/// transactions (taskhub's own start READ WRITE, so a handler that ends the
/// transaction itself with COMMIT or ROLLBACK cannot go on writing outside
/// it: see `apply.rs`); and a look at which database history it reached, so
/// the duplicate markers follow it (see `keys.rs`).
pub(crate) struct Setup {
    pub namespace: Namespace,
    pub statement_timeout: Duration,
}

impl Setup {
    fn apply(&self, client: &mut postgres::Client) -> Result<(), postgres::Error> {
        let sql = format!(
            "SET statement_timeout = {}; SET default_transaction_read_only = on; {}",
            self.statement_timeout.as_millis(),
            Identity::QUERY
        );
        let messages = client.simple_query(&sql)?;
        let row = messages.iter().find_map(|m| match m {
            postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        });
        if let Some(row) = row {
            let text = |i: usize| row.get(i).unwrap_or_default().to_owned();
            self.namespace.observe(&Identity {
                system_identifier: text(0),
                database_oid: text(1),
                timeline: text(2),
                filenode: text(3),
            });
        }
        Ok(())
    }
}

/// The r2d2 manager of the worker pool: r2d2_postgres' managers, plus the
/// set-up above and a way to drop a connection whose session is unusable
/// (read-only) although it is not closed.
pub(crate) struct PgManager {
    connector: Connector,
    setup: Setup,
}

/// A pooled PostgreSQL client; [`discard`](PgClient::discard) makes the
/// pool close it instead of reusing it.
pub(crate) struct PgClient {
    client: postgres::Client,
    discard: bool,
}

impl PgClient {
    /// The session is not fit for reuse (say, read-only after a failover):
    /// the pool closes it when it comes back.
    pub fn discard(&mut self) {
        self.discard = true;
    }
}

impl std::ops::Deref for PgClient {
    type Target = postgres::Client;

    fn deref(&self) -> &postgres::Client {
        &self.client
    }
}

impl std::ops::DerefMut for PgClient {
    fn deref_mut(&mut self) -> &mut postgres::Client {
        &mut self.client
    }
}

impl r2d2::ManageConnection for PgManager {
    type Connection = PgClient;
    type Error = postgres::Error;

    fn connect(&self) -> Result<PgClient, postgres::Error> {
        let mut client = match &self.connector {
            Connector::Plain(m) => m.connect()?,
            Connector::Tls(m) => m.connect()?,
        };
        self.setup.apply(&mut client)?;
        Ok(PgClient {
            client,
            discard: false,
        })
    }

    fn is_valid(&self, conn: &mut PgClient) -> Result<(), postgres::Error> {
        conn.client.simple_query("").map(|_| ())
    }

    fn has_broken(&self, conn: &mut PgClient) -> bool {
        conn.discard || conn.client.is_closed()
    }
}

/// The PostgreSQL pool shared by the workers.
pub(crate) type PgPool = r2d2::Pool<PgManager>;
/// A connection of that pool; it dereferences to a `postgres::Client`.
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

/// `%XX` escapes decoded (for a path in a URL query).
pub(crate) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Some(b) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every byte but `A-Z a-z 0-9 - _ . ~` as `%XX` (for a URL query value or
/// a cookie value).
pub(crate) fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The connection settings and the TLS connector for `url` (see
/// `tls/postgres.rs` for libpq's `sslmode` and the certificate files).
fn pg_config(url: &str) -> Result<(postgres::Config, Option<MakeRustlsConnect>), Error> {
    let bad = |e: Box<dyn std::error::Error + Send + Sync>| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad PostgreSQL URL {:?}", redact(url)),
            e,
        )
    };
    let (rest, tls) = crate::tls::pg_tls(url).map_err(|e| bad(e.into()))?;
    let mut config: postgres::Config = rest.parse().map_err(|e| bad(Box::new(e)))?;
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
    Ok((config, tls.connector()?))
}

/// One PostgreSQL connection (migrations, CLI commands).
pub(crate) fn postgres(url: &str) -> Result<postgres::Client, Error> {
    let (config, tls) = pg_config(url)?;
    connect_pg(&config, tls).map_err(|e| pg_unreachable(url, e))
}

fn connect_pg(
    config: &postgres::Config,
    tls: Option<MakeRustlsConnect>,
) -> Result<postgres::Client, postgres::Error> {
    match tls {
        Some(tls) => config.connect(tls),
        None => config.connect(postgres::NoTls),
    }
}

pub(crate) fn pg_unreachable(
    url: &str,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Error {
    Error::with_source(
        ErrorKind::Postgres,
        format!("cannot connect to PostgreSQL at {}", redact(url)),
        WithCauses(e.into()),
    )
}

/// An error whose `Display` also shows its causes: rust-postgres prints
/// only "error performing TLS handshake" and keeps the reason (such as
/// "invalid peer certificate: UnknownIssuer") in `source()`.
#[derive(Debug)]
struct WithCauses(Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for WithCauses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let more = c.to_string();
            if !more.is_empty() && !text.contains(&more) {
                text.push_str(": ");
                text.push_str(&more);
            }
            cause = c.source();
        }
        f.write_str(&text)
    }
}

impl std::error::Error for WithCauses {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
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
pub(crate) fn postgres_pool(url: &str, size: u32, setup: Setup) -> Result<PgPool, Error> {
    // One direct connection first: r2d2 would only report a timeout, this
    // names the cause (refused, authentication, unknown database...).
    let (config, tls) = pg_config(url)?;
    let mut probe = connect_pg(&config, tls.clone()).map_err(|e| pg_unreachable(url, e))?;
    setup
        .apply(&mut probe)
        .map_err(|e| pg_unreachable(url, e))?;
    drop(probe);
    let connector = match tls {
        Some(tls) => Connector::Tls(TlsManager::new(config, tls)),
        None => Connector::Plain(PlainManager::new(config, postgres::NoTls)),
    };
    pool_builder(size, "taskhub-pg-pool-{}")
        .build(PgManager { connector, setup })
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

/// Opens a Redis client for one server's `url` (no connection yet). A
/// `rediss://` URL uses TLS, verified with `tls` (its CA file, else the
/// system's store; `rediss://host:port/#insecure` skips the verification).
pub(crate) fn redis_client(url: &str, tls: &Tls) -> Result<redis::Client, Error> {
    let bad = |e: redis::RedisError| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad Redis URL {:?}", redact(url)),
            e,
        )
    };
    if !is_tls_url(url) {
        return redis::Client::open(url).map_err(bad);
    }
    match crate::tls::redis_certificates(tls)? {
        Some(certificates) => redis::Client::build_with_tls(url, certificates).map_err(bad),
        None => redis::Client::open(url).map_err(bad),
    }
}

/// Whether `url` is a Redis URL with TLS (`rediss://`, or valkey's
/// `valkeys://`).
pub(crate) fn is_tls_url(url: &str) -> bool {
    let scheme = url.split("://").next().unwrap_or_default();
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}

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
