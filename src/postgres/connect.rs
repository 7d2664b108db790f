//! Connections to PostgreSQL: the URL (with libpq's TLS settings), one
//! connection for commands and migrations, and the errors that name the
//! server without its password.
//!
//! Every connect has a timeout, so a server that stops answering it turns
//! into an error instead of a thread that hangs forever (see
//! `bounded_connect`; a session that stops answering later, behind a proxy
//! that keeps the connection open, is not bounded: see the README,
//! "Failure model"). Pools do not test a
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
    let config = config.clone();
    bounded_connect(answer_wait(&config), move || match tls {
        Some(tls) => config.connect(tls),
        None => config.connect(postgres::NoTls),
    })
}

/// How long a connect with `config` may take in all: its connect timeout
/// and [`ANSWER_TIMEOUT`].
pub(crate) fn answer_wait(config: &postgres::Config) -> Duration {
    config
        .get_connect_timeout()
        .copied()
        .unwrap_or(CONNECT_TIMEOUT)
        + ANSWER_TIMEOUT
}

/// Connects still waiting for their server's answer.
static LEFT_WAITING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// When the last connect past [`MOST_LEFT_WAITING`] was let through.
static LAST_PAST_CAP: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
/// A pool that keeps trying through a black hole that never closes (a proxy
/// whose backend hung) leaves a thread per try, which only ends when its
/// connection does. Past this many waiting, a connect is tried once a
/// minute (the rest fail at once), so the threads left grow by one a minute
/// at most, and the pool never stops trying for good: a cap that refused
/// every connect while its threads waited cut the worker off from
/// PostgreSQL for ever (found by a review).
const MOST_LEFT_WAITING: usize = 8;
const PAST_CAP_EVERY: Duration = Duration::from_secs(60);

/// Whether another connect may start now, with `waiting` connects still
/// waiting and the last one past the cap let through at `last`.
fn may_try(waiting: usize, last: Option<std::time::Instant>, now: std::time::Instant) -> bool {
    waiting < MOST_LEFT_WAITING || last.is_none_or(|at| now.duration_since(at) >= PAST_CAP_EVERY)
}

/// Runs `connect` (a connect, and what the new session needs before use)
/// on a thread of its own and waits for it at most `wait`; the thread is
/// left behind when the server never answers. The worker pool's
/// connections are made this way too: r2d2 makes them on one thread of its
/// own, and a connect that never returned there left the pool without
/// PostgreSQL for good, the server long back (found by a hostile test:
/// every connection reset, those of the next 8 s taken by a proxy that
/// never answered).
pub(crate) fn bounded_connect<T: Send + 'static>(
    wait: Duration,
    connect: impl FnOnce() -> Result<T, postgres::Error> + Send + 'static,
) -> Result<T, Box<dyn std::error::Error + Send + Sync>> {
    use std::sync::atomic::Ordering::SeqCst;
    {
        let mut last = LAST_PAST_CAP
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (waiting, now) = (LEFT_WAITING.load(SeqCst), std::time::Instant::now());
        if !may_try(waiting, *last, now) {
            return Err(format!(
                "{waiting} connections still wait for the server's answer (a proxy that accepts connections and never answers?); trying again within a minute"
            )
            .into());
        }
        if waiting >= MOST_LEFT_WAITING {
            *last = Some(now);
            log::error!(
                "postgres: {waiting} connections were never answered (a proxy that accepts connections and never answers?); trying once a minute"
            );
        }
        // Counted under the lock: two callers cannot both pass the cap.
        LEFT_WAITING.fetch_add(1, SeqCst);
    }
    let (sent, answer) = crossbeam_channel::bounded(1);
    let spawned = std::thread::Builder::new()
        .name("taskhub-pg-connect".into())
        .spawn(move || {
            let connected = connect();
            LEFT_WAITING.fetch_sub(1, SeqCst);
            let _ = sent.send(connected);
        });
    if let Err(e) = spawned {
        LEFT_WAITING.fetch_sub(1, SeqCst);
        return Err(e.into());
    }
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
    fn past_the_cap_a_connect_is_tried_once_a_minute() {
        let now = std::time::Instant::now();
        assert!(may_try(0, None, now));
        assert!(may_try(MOST_LEFT_WAITING - 1, Some(now), now));
        // At the cap: the first is let through, then one a minute.
        assert!(may_try(MOST_LEFT_WAITING, None, now));
        assert!(!may_try(
            MOST_LEFT_WAITING + 3,
            Some(now),
            now + Duration::from_secs(59)
        ));
        assert!(may_try(
            MOST_LEFT_WAITING + 3,
            Some(now),
            now + PAST_CAP_EVERY
        ));
    }

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
