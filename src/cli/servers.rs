//! The servers every subcommand talks to: flags, environment, URL files,
//! and the TLS files for Redis.

use std::path::PathBuf;

use clap::Args;

/// The heading of these flags in `--help`.
const CONNECTIONS: &str = "Connections";

#[derive(Args, Debug)]
pub struct Servers {
    /// Redis URL (`rediss://user:password@host:port` for TLS, verified
    /// against --redis-ca-file, else the system's store). For a Redis
    /// Cluster, any node's URL (a cluster node is detected), or several
    /// separated by commas.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        global = true,
        help_heading = CONNECTIONS,
        hide_env_values = true
    )]
    pub redis_url: String,
    /// PostgreSQL URL (TLS: `?sslmode=require`, or
    /// `?sslmode=verify-full&sslrootcert=/path/ca.pem`; a client
    /// certificate: `&sslcert=/path/client.pem&sslkey=/path/client.key`).
    /// Neither given (nor DATABASE_URL_FILE):
    /// postgres://postgres:taskhub@127.0.0.1:5432/taskhub, and said so at
    /// start.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "",
        global = true,
        help_heading = CONNECTIONS,
        hide_env_values = true,
        hide_default_value = true
    )]
    pub database_url: String,
    /// Read the Redis URL from this file (keeps a password out of argv and
    /// the environment); wins over --redis-url.
    #[arg(long, env = "REDIS_URL_FILE", global = true, value_name = "PATH", help_heading = CONNECTIONS)]
    pub redis_url_file: Option<std::path::PathBuf>,
    /// Read the PostgreSQL URL from this file; wins over --database-url.
    #[arg(long, env = "DATABASE_URL_FILE", global = true, value_name = "PATH", help_heading = CONNECTIONS)]
    pub database_url_file: Option<std::path::PathBuf>,
    /// PEM file with the CA certificate(s) that rediss:// servers (one
    /// server or a cluster) are verified against, instead of the system's
    /// store.
    #[arg(
        long,
        env = "TASKHUB_REDIS_CA_FILE",
        global = true,
        help_heading = CONNECTIONS,
        value_name = "PATH",
        value_parser = path
    )]
    pub redis_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for rediss:// servers that require one
    /// (`tls-auth-clients yes`); with --redis-client-key.
    #[arg(
        long,
        env = "TASKHUB_REDIS_CLIENT_CERT",
        global = true,
        help_heading = CONNECTIONS,
        value_name = "PATH",
        value_parser = path,
        requires = "redis_client_key"
    )]
    pub redis_client_cert: Option<PathBuf>,
    /// The private key (PEM) of --redis-client-cert.
    #[arg(
        long,
        env = "TASKHUB_REDIS_CLIENT_KEY",
        global = true,
        help_heading = CONNECTIONS,
        value_name = "PATH",
        value_parser = path,
        requires = "redis_client_cert"
    )]
    pub redis_client_key: Option<PathBuf>,
}

/// The database used when no URL is given (DATABASE_URL, --database-url,
/// DATABASE_URL_FILE): the one of the README's local set-up. A command that
/// uses it says so at start.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres:taskhub@127.0.0.1:5432/taskhub";

/// What may be said of [`DEFAULT_DATABASE_URL`]: host, port, database and
/// user, never the password.
fn default_database() -> String {
    let url = url::Url::parse(DEFAULT_DATABASE_URL).expect("the default URL parses");
    format!(
        "host {}, port {}, database {}, user {}",
        url.host_str().unwrap_or_default(),
        url.port().unwrap_or(5432),
        url.path().trim_start_matches('/'),
        url.username()
    )
}

/// A path flag. An empty value (`TASKHUB_REDIS_CA_FILE=` in an env file)
/// is taken, and means "not set" (see [`tls`]).
pub fn path(value: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(value))
}

/// A `Tls` of the library from the flags; empty paths are not set.
pub fn tls(
    ca_file: &Option<PathBuf>,
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
) -> taskhub::Tls {
    let given = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
    let mut tls = taskhub::Tls::default();
    if let Some(ca) = given(ca_file) {
        tls = tls.ca_file(ca);
    }
    match (given(cert), given(key)) {
        (Some(cert), Some(key)) => tls = tls.client_cert(cert, key),
        (None, None) => {}
        // clap makes sure both flags are given, not that both are non-empty.
        _ => log::warn!("tls: a client certificate needs both its file and its key; not used"),
    }
    tls
}

impl Servers {
    /// The TLS files for Redis.
    pub fn redis_tls(&self) -> taskhub::Tls {
        tls(
            &self.redis_ca_file,
            &self.redis_client_cert,
            &self.redis_client_key,
        )
    }

    /// Replaces the URLs by the contents of the URL files, when given; with
    /// no database URL at all, takes [`DEFAULT_DATABASE_URL`] and, for a
    /// command that uses the database, logs which one that is.
    pub fn read_files(&mut self, uses_database: bool) -> Result<(), String> {
        if self.database_url_file.is_none() && self.database_url.is_empty() {
            self.database_url = DEFAULT_DATABASE_URL.to_owned();
            if uses_database {
                log::info!(
                    "database: DATABASE_URL is not set, so the default is used: {} (set \
                     DATABASE_URL, --database-url or DATABASE_URL_FILE for another)",
                    default_database()
                );
            }
        }
        for (file, url) in [
            (&self.redis_url_file, &mut self.redis_url),
            (&self.database_url_file, &mut self.database_url),
        ] {
            if let Some(path) = file {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                *url = text.trim().to_owned();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_database_is_said_without_its_password() {
        let said = default_database();
        assert_eq!(
            said,
            "host 127.0.0.1, port 5432, database taskhub, user postgres"
        );
    }
}
