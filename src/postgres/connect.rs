//! Connections to Redis and PostgreSQL: the pools the workers share, the
//! readers' own long-blocking connections, and URL redaction for messages.
//!
//! Every connection has a timeout, so a server that stops answering turns into
//! an error instead of a thread that hangs forever. Pools do not test a
//! connection on check-out (that would cost a round trip per batch); a broken
//! connection is noticed by its next command and dropped by the pool.

use std::time::Duration;

use postgres_native_tls::MakeTlsConnector;

use crate::error::{Error, ErrorKind};
use crate::redact::redact;
use crate::redis::keys::{Identity, Namespace};
use crate::redis::{RedisClient, RedisConn};

/// Environment variable naming a PEM file with the CA certificate(s) that
/// `rediss://` servers are verified against (instead of the system store).
pub const REDIS_CA_FILE_ENV: &str = "TASKHUB_REDIS_CA_FILE";

/// How long to wait for a TCP connection or a pooled connection.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one ordinary Redis command may take before the connection is
/// considered lost.
pub(crate) const REDIS_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

type PlainManager = r2d2_postgres::PostgresConnectionManager<postgres::NoTls>;
type TlsManager = r2d2_postgres::PostgresConnectionManager<MakeTlsConnector>;

/// How the worker pool's connections are made: without TLS when the URL
/// says `sslmode=disable` (no OpenSSL context at all: it costs about 6 MB),
/// with it otherwise.
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

/// The TLS settings taken out of a PostgreSQL URL before rust-postgres parses
/// it: rust-postgres knows `sslmode=disable|prefer|require` only and no
/// `sslrootcert`.
#[derive(Debug, Default, PartialEq, Eq)]
struct PgTls {
    /// `verify-ca` or `verify-full` (verify-full also checks the host name).
    verify: Option<Verify>,
    /// `sslrootcert`: a PEM file with the CA certificate(s) to trust.
    root_cert: Option<String>,
    /// `sslmode=require` given.
    require: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    Ca,
    Full,
}

/// Splits `sslmode=verify-ca|verify-full` and `sslrootcert=...` off `url`
/// (URL form `postgres://...?sslmode=verify-full&sslrootcert=/ca.pem` or
/// key-value form `host=db sslmode=verify-full sslrootcert=/ca.pem`), and
/// returns what rust-postgres can parse: `sslmode=require` in their place.
fn split_pg_tls(url: &str) -> Result<(String, PgTls), String> {
    let mut tls = PgTls::default();
    let mut take = |key: &str, value: &str| -> Result<bool, String> {
        match (key, value) {
            ("sslmode", "verify-full") => tls.verify = Some(Verify::Full),
            ("sslmode", "verify-ca") => tls.verify = Some(Verify::Ca),
            ("sslmode", "require") => {
                tls.require = true;
                return Ok(false);
            }
            ("sslrootcert", "") => return Err("empty sslrootcert".into()),
            ("sslrootcert", v) => tls.root_cert = Some(v.to_owned()),
            _ => return Ok(false),
        }
        Ok(true)
    };
    let rebuilt = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let (base, rest) = match url.split_once('?') {
            Some((b, q)) => (b, q),
            None => return Ok((url.to_owned(), tls)),
        };
        let mut kept = Vec::new();
        for pair in rest.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v);
            if !take(k, &v)? {
                kept.push(pair.to_owned());
            }
        }
        if tls.verify.is_some() {
            kept.push("sslmode=require".into());
        }
        if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        }
    } else {
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            let (k, v) = word.split_once('=').unwrap_or((word, ""));
            let k = k.trim();
            if !take(k, v.trim_matches('\'').trim())? {
                kept.push(word.to_owned());
            }
        }
        if tls.verify.is_some() {
            kept.push("sslmode=require".into());
        }
        kept.join(" ")
    };
    Ok((rebuilt, tls))
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

/// The connection settings and the TLS connector for `url`.
///
/// Like libpq: `prefer` (rust-postgres' default) and `require` encrypt
/// without verifying the server's certificate (`require` with `sslrootcert`
/// verifies the chain, as libpq does); `verify-ca` verifies the chain,
/// `verify-full` the chain and the host name. Without `sslrootcert` the
/// system's CA store is used.
fn pg_config(url: &str) -> Result<(postgres::Config, Option<MakeTlsConnector>), Error> {
    let bad = |e: Box<dyn std::error::Error + Send + Sync>| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad PostgreSQL URL {:?}", redact(url)),
            e,
        )
    };
    let (rest, tls) = split_pg_tls(url).map_err(|e| bad(e.into()))?;
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
    if config.get_ssl_mode() == postgres::config::SslMode::Disable {
        return Ok((config, None));
    }
    let mut builder = native_tls::TlsConnector::builder();
    if let Some(path) = &tls.root_cert {
        let pem = std::fs::read(path).map_err(|e| {
            Error::with_source(
                ErrorKind::Config,
                format!("cannot read sslrootcert {path:?} of PostgreSQL URL"),
                e,
            )
        })?;
        let cert = native_tls::Certificate::from_pem(&pem).map_err(|e| {
            Error::with_source(
                ErrorKind::Config,
                format!("sslrootcert {path:?} is not a PEM certificate"),
                e,
            )
        })?;
        builder.add_root_certificate(cert);
        // Like libpq: with sslrootcert, that file is the whole trust store.
        builder.disable_built_in_roots(true);
    }
    let verify = tls
        .verify
        .or((tls.require && tls.root_cert.is_some()).then_some(Verify::Ca));
    match verify {
        Some(Verify::Full) => {}
        Some(Verify::Ca) => {
            builder.danger_accept_invalid_hostnames(true);
        }
        None => {
            builder.danger_accept_invalid_certs(true);
            builder.danger_accept_invalid_hostnames(true);
            // Nothing is verified: loading the system's CA store would only
            // cost memory (several MB with OpenSSL).
            builder.disable_built_in_roots(true);
        }
    }
    let connector = builder.build().map_err(|e| {
        Error::with_source(
            ErrorKind::Config,
            format!("cannot set up TLS for PostgreSQL at {}", redact(url)),
            e,
        )
    })?;
    Ok((config, Some(MakeTlsConnector::new(connector))))
}

/// One PostgreSQL connection (migrations, CLI commands).
pub(crate) fn postgres(url: &str) -> Result<postgres::Client, Error> {
    let (config, tls) = pg_config(url)?;
    connect_pg(&config, tls).map_err(|e| pg_unreachable(url, e))
}

fn connect_pg(
    config: &postgres::Config,
    tls: Option<MakeTlsConnector>,
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
/// "certificate verify failed") in `source()`.
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

/// Opens a Redis client for one server's `url` (no connection yet). A `rediss://` URL
/// uses TLS, verified against the system's CA store or, when the environment
/// variable `TASKHUB_REDIS_CA_FILE` names a PEM file, against that CA
/// (`rediss://host:port/#insecure` skips the verification).
pub(crate) fn redis_client(url: &str) -> Result<redis::Client, Error> {
    let bad = |e: redis::RedisError| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad Redis URL {:?}", redact(url)),
            e,
        )
    };
    let ca_file = std::env::var_os(REDIS_CA_FILE_ENV).filter(|v| !v.is_empty());
    match ca_file {
        Some(path) if url.starts_with("rediss://") => {
            let pem = std::fs::read(&path).map_err(|e| {
                Error::with_source(
                    ErrorKind::Config,
                    format!("cannot read {REDIS_CA_FILE_ENV} {path:?}"),
                    e,
                )
            })?;
            redis::Client::build_with_tls(
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            )
            .map_err(bad)
        }
        _ => redis::Client::open(url).map_err(bad),
    }
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
    use super::{split_pg_tls, PgTls, Verify};

    #[test]
    fn tls_settings_are_split_off_postgres_urls() {
        let (rest, tls) =
            split_pg_tls("postgres://u@db/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem")
                .unwrap();
        assert_eq!(rest, "postgres://u@db/app?sslmode=require");
        assert_eq!(
            tls,
            PgTls {
                verify: Some(Verify::Full),
                root_cert: Some("/etc/ca.pem".into()),
                require: false
            }
        );
        let (rest, tls) =
            split_pg_tls("postgres://db/app?application_name=x&sslmode=verify-ca").unwrap();
        assert_eq!(rest, "postgres://db/app?application_name=x&sslmode=require");
        assert_eq!(tls.verify, Some(Verify::Ca));
        let (rest, tls) = split_pg_tls("postgres://db/app?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://db/app?sslmode=require");
        assert!(tls.require && tls.verify.is_none());
        let (rest, tls) =
            split_pg_tls("host=db sslmode=verify-full sslrootcert=/ca.pem user=me").unwrap();
        assert_eq!(rest, "host=db user=me sslmode=require");
        assert_eq!(tls.root_cert.as_deref(), Some("/ca.pem"));
        assert_eq!(
            split_pg_tls("postgres://db/app").unwrap().0,
            "postgres://db/app"
        );
    }
}
