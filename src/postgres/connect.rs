//! Connections to PostgreSQL: the URL (with libpq's TLS settings), one
//! connection for commands and migrations, and the errors that name the
//! server without its password.
//!
//! Every connection has a timeout, so a server that stops answering turns into
//! an error instead of a thread that hangs forever. Pools do not test a
//! connection on check-out (that would cost a round trip per batch); a broken
//! connection is noticed by its next command and dropped by the pool.

use std::time::Duration;

use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, ErrorKind};
use crate::net::CONNECT_TIMEOUT;
use crate::redact::redact;

/// The connection settings and the TLS connector for `url` (see
/// `tls/postgres.rs` for libpq's `sslmode` and the certificate files).
pub(crate) fn pg_config(url: &str) -> Result<(postgres::Config, Option<MakeRustlsConnect>), Error> {
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
    // PostgreSQL has no TLS over a Unix socket: build no TLS context where
    // it could never be used.
    let only_sockets = config
        .get_hosts()
        .iter()
        .all(|h| !matches!(h, postgres::config::Host::Tcp(_)));
    let connector = if only_sockets && !config.get_hosts().is_empty() {
        None
    } else {
        tls.connector()?
    };
    Ok((config, connector))
}

/// One PostgreSQL connection (migrations, CLI commands).
pub(crate) fn postgres(url: &str) -> Result<postgres::Client, Error> {
    let (config, tls) = pg_config(url)?;
    connect_pg(&config, tls).map_err(|e| pg_unreachable(url, e))
}

/// How long a server that accepted the connection may take to answer the
/// start-up handshake (authentication, the session's parameters).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects, within the connect timeout and [`ANSWER_TIMEOUT`] more. The
/// crate's connect timeout covers the TCP connection only: a server that
/// accepts it and never answers (a port that is not PostgreSQL's, a proxy
/// with no backend) held the start for ever, past SIGTERM (found by a
/// hostile test). So the connect runs on a thread of its own, which is
/// left behind when the server never answers.
pub(crate) fn connect_pg(
    config: &postgres::Config,
    tls: Option<MakeRustlsConnect>,
) -> Result<postgres::Client, Box<dyn std::error::Error + Send + Sync>> {
    let wait = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(CONNECT_TIMEOUT)
        + ANSWER_TIMEOUT;
    let (sent, answer) = crossbeam_channel::bounded(1);
    let config = config.clone();
    std::thread::Builder::new()
        .name("taskhub-pg-connect".into())
        .spawn(move || {
            let _ = sent.send(match tls {
                Some(tls) => config.connect(tls),
                None => config.connect(postgres::NoTls),
            });
        })?;
    match answer.recv_timeout(wait) {
        Ok(connected) => Ok(connected?),
        Err(_) => Err(format!(
            "the server took the connection but did not answer within {}s: is PostgreSQL listening on that port?",
            wait.as_secs()
        )
        .into()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_tls_context_is_built_for_a_unix_socket() {
        let (_, tls) = pg_config("postgres://u@%2Fvar%2Frun%2Fpostgresql/db").unwrap();
        assert!(tls.is_none());
        let (_, tls) = pg_config("host=/tmp dbname=db sslmode=prefer").unwrap();
        assert!(tls.is_none());
        let (_, tls) = pg_config("postgres://u@127.0.0.1/db").unwrap();
        assert!(tls.is_some(), "TCP with sslmode=prefer may use TLS");
        let (_, tls) = pg_config("postgres://u@127.0.0.1/db?sslmode=disable").unwrap();
        assert!(tls.is_none());
    }
}
