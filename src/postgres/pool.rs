//! The PostgreSQL pool of the worker threads: r2d2_postgres' managers,
//! plus what every new session is set up with and a way to drop one whose
//! session is unusable although it is not closed.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::Error;
use crate::net::pool_builder;
use crate::postgres::connect::{
    answer_wait, bounded_connect, connect_pg, pg_config, pg_unreachable,
};
use crate::redis::keys::{Identity, Namespace};

type PlainManager = r2d2_postgres::PostgresConnectionManager<postgres::NoTls>;
type TlsManager = r2d2_postgres::PostgresConnectionManager<MakeRustlsConnect>;

/// How the worker pool's connections are made: without TLS when the URL
/// says `sslmode=disable` (no TLS context at all), with it otherwise. Shared
/// with the thread each connect runs on (see `bounded_connect`).
#[derive(Clone)]
enum Connector {
    Plain(Arc<PlainManager>),
    Tls(Arc<TlsManager>),
}

/// What every new connection of the worker pool is set up with: the
/// statement timeout (`--handler-timeout`); read-only as the default for
/// transactions (taskhub's own start READ WRITE, so a handler that ends the
/// transaction itself with COMMIT or ROLLBACK cannot go on writing outside
/// it: see `apply.rs`); and a look at which database history it reached, so
/// the duplicate markers follow it (see `keys.rs`).
#[derive(Clone)]
pub(crate) struct Setup {
    pub namespace: Namespace,
    pub statement_timeout: Duration,
}

impl Setup {
    /// Sets the session up; returns which database history it reached
    /// and when the server started (see [`PgClient::server_started`]). The
    /// history is for the caller to pass to the namespace
    /// ([`Setup::observe`]) once it takes the connection: one made on a
    /// thread left behind (see `bounded_connect`) may answer late, from a
    /// server that is no longer the one in use (an old primary).
    fn apply(
        &self,
        client: &mut postgres::Client,
    ) -> Result<(Option<Identity>, Option<String>), postgres::Error> {
        let sql = format!(
            "SET statement_timeout = {}; SET default_transaction_read_only = on; {}; \
             SELECT pg_postmaster_start_time()::text",
            self.statement_timeout.as_millis(),
            Identity::QUERY
        );
        let messages = client.simple_query(&sql)?;
        let mut rows = messages.iter().filter_map(|m| match m {
            postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        });
        let identity = rows.next().map(|row| {
            let text = |i: usize| row.get(i).unwrap_or_default().to_owned();
            Identity {
                system_identifier: text(0),
                database_oid: text(1),
                timeline: text(2),
                filenode: text(3),
            }
        });
        let started = rows.next().and_then(|row| row.get(0)).map(str::to_owned);
        Ok((identity, started))
    }

    /// Tells the markers' namespace which database history a connection
    /// in use reached (see `keys.rs`).
    fn observe(&self, identity: Option<&Identity>) {
        if let Some(identity) = identity {
            self.namespace.observe(identity);
        }
    }
}

/// The r2d2 manager of the worker pool: r2d2_postgres' managers, plus the
/// set-up above and a way to drop a connection whose session is unusable
/// (read-only) although it is not closed.
pub(crate) struct PgManager {
    connector: Connector,
    setup: Setup,
    /// How long one connect, its set-up included, may take.
    wait: Duration,
}

/// A pooled PostgreSQL client; [`discard`](PgClient::discard) makes the
/// pool close it instead of reusing it.
pub(crate) struct PgClient {
    client: postgres::Client,
    discard: bool,
    server_started: Option<String>,
}

impl PgClient {
    /// When the server of this session started (`pg_postmaster_start_time`):
    /// a session lost on a server that has started again since was lost to
    /// the restart (see `worker/fail.rs`).
    pub fn server_started(&self) -> Option<&str> {
        self.server_started.as_deref()
    }

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

/// Why the pool could not make a connection.
#[derive(Debug)]
pub(crate) struct ConnectError(Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl r2d2::ManageConnection for PgManager {
    type Connection = PgClient;
    type Error = ConnectError;

    /// Connects and sets the session up within a bound (see
    /// `bounded_connect`).
    fn connect(&self) -> Result<PgClient, ConnectError> {
        let (connector, setup) = (self.connector.clone(), self.setup.clone());
        let (client, (identity, server_started)) = bounded_connect(self.wait, move || {
            let mut client = match &connector {
                Connector::Plain(m) => m.connect()?,
                Connector::Tls(m) => m.connect()?,
            };
            let set_up = setup.apply(&mut client)?;
            Ok((client, set_up))
        })
        .map_err(ConnectError)?;
        self.setup.observe(identity.as_ref());
        Ok(PgClient {
            client,
            discard: false,
            server_started,
        })
    }

    fn is_valid(&self, conn: &mut PgClient) -> Result<(), ConnectError> {
        conn.client
            .simple_query("")
            .map(|_| ())
            .map_err(|e| ConnectError(Box::new(e)))
    }

    fn has_broken(&self, conn: &mut PgClient) -> bool {
        conn.discard || conn.client.is_closed()
    }
}

/// The PostgreSQL pool shared by the workers.
pub(crate) type PgPool = r2d2::Pool<PgManager>;
/// A connection of that pool; it dereferences to a `postgres::Client`.
pub(crate) type PgConn = r2d2::PooledConnection<PgManager>;

/// The PostgreSQL pool shared by the workers. Fails at once (after the
/// connect timeout) when the server cannot be reached.
pub(crate) fn postgres_pool(url: &str, size: u32, setup: Setup) -> Result<PgPool, Error> {
    // One direct connection first: r2d2 would only report a timeout, this
    // names the cause (refused, authentication, unknown database...).
    let (config, tls) = pg_config(url)?;
    let mut probe = connect_pg(&config, tls.clone()).map_err(|e| pg_unreachable(url, e))?;
    let (identity, _) = setup
        .apply(&mut probe)
        .map_err(|e| pg_unreachable(url, e))?;
    setup.observe(identity.as_ref());
    drop(probe);
    let wait = answer_wait(&config);
    let connector = match tls {
        Some(tls) => Connector::Tls(Arc::new(TlsManager::new(config, tls))),
        None => Connector::Plain(Arc::new(PlainManager::new(config, postgres::NoTls))),
    };
    pool_builder(size, "taskhub-pg-pool-{}")
        .build(PgManager {
            connector,
            setup,
            wait,
        })
        .map_err(|e| pg_unreachable(url, e))
}

/// The tests' shared PostgreSQL server, database `postgres` (as in
/// `tests/support/databases.rs`).
#[cfg(test)]
pub(crate) fn test_url() -> String {
    std::env::var("TASKHUB_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres:taskhub@127.0.0.1:5432/postgres".into())
}
