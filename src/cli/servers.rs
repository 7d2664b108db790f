//! The servers every subcommand talks to: flags, environment, URL files.

use clap::Args;

#[derive(Args, Debug)]
pub struct Servers {
    /// Redis URL (`rediss://user:password@host:port` for TLS; the CA file
    /// in TASKHUB_REDIS_CA_FILE, else the system store). For a Redis
    /// Cluster, any node's URL (a cluster node is detected), or several
    /// separated by commas.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        global = true,
        hide_env_values = true
    )]
    pub redis_url: String,
    /// PostgreSQL URL (TLS: `?sslmode=require`, or
    /// `?sslmode=verify-full&sslrootcert=/path/ca.pem`).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres:taskhub@127.0.0.1:5432/taskhub",
        global = true,
        hide_env_values = true,
        hide_default_value = true
    )]
    pub database_url: String,
    /// Read the Redis URL from this file (keeps a password out of argv and
    /// the environment); wins over --redis-url.
    #[arg(long, env = "REDIS_URL_FILE", global = true, value_name = "PATH")]
    pub redis_url_file: Option<std::path::PathBuf>,
    /// Read the PostgreSQL URL from this file; wins over --database-url.
    #[arg(long, env = "DATABASE_URL_FILE", global = true, value_name = "PATH")]
    pub database_url_file: Option<std::path::PathBuf>,
}

impl Servers {
    /// Replaces the URLs by the contents of the URL files, when given.
    pub fn read_files(&mut self) -> Result<(), String> {
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
