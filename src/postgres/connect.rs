//! Connections to PostgreSQL: the URL (with libpq's TLS settings), one
//! connection for commands and migrations, and the errors that name the
//! server without its password.
//!
//! Every connection has a timeout, so a server that stops answering turns into
//! an error instead of a thread that hangs forever. Pools do not test a
//! connection on check-out (that would cost a round trip per batch); a broken
//! connection is noticed by its next command and dropped by the pool.

use std::time::Duration;

use postgres_native_tls::MakeTlsConnector;

use crate::error::{Error, ErrorKind};
use crate::net::{percent_decode, CONNECT_TIMEOUT};
use crate::redact::redact;

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

/// The connection settings and the TLS connector for `url`.
///
/// Like libpq: `prefer` (rust-postgres' default) and `require` encrypt
/// without verifying the server's certificate (`require` with `sslrootcert`
/// verifies the chain, as libpq does); `verify-ca` verifies the chain,
/// `verify-full` the chain and the host name. Without `sslrootcert` the
/// system's CA store is used.
pub(crate) fn pg_config(url: &str) -> Result<(postgres::Config, Option<MakeTlsConnector>), Error> {
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

pub(crate) fn connect_pg(
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
