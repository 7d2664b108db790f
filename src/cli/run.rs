//! `taskhub run`: flags to a `Worker`, signals to its shutdown handle.

use super::report;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use taskhub::{
    Alerts, ErrorKind, HttpHandler, HttpServer, RetryBudget, SqlHandler, Worker, HTTP_BUDGET,
};

use super::duration;
use super::servers::Servers;

/// Headings of `taskhub run --help`.
const PROCESSING: &str = "Processing";
const HANDLER: &str = "The handler (SQL, or HTTP with --http-url)";
const RETRIES: &str = "Retries and reclaiming";
const ENDPOINT: &str = "HTTP endpoint (--http)";
const ALERTS: &str = "Dead-letter alerts";

/// Every flag also reads `TASKHUB_<FLAG>` (flags win).
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Stream to read (repeat for several; in the environment, separated
    /// by commas). One reader thread each.
    #[arg(long, default_value = "tasks:events", env = "TASKHUB_STREAM", value_delimiter = ',', help_heading = PROCESSING)]
    pub stream: Vec<String>,
    /// Consumer group (created when missing).
    #[arg(long, default_value = "workers", env = "TASKHUB_GROUP", help_heading = PROCESSING)]
    pub group: String,
    /// Consumer name, stable across restarts and unique per instance [default: host name].
    #[arg(long, env = "TASKHUB_CONSUMER", help_heading = PROCESSING)]
    pub consumer: Option<String>,
    /// Idempotency scope [default: the group].
    #[arg(long, env = "TASKHUB_SCOPE", help_heading = PROCESSING)]
    pub scope: Option<String>,
    /// Worker threads.
    #[arg(long, default_value_t = 8, env = "TASKHUB_WORKERS", help_heading = PROCESSING)]
    pub workers: usize,
    /// Entries per XREADGROUP, and so the largest batch.
    #[arg(long, default_value_t = 64, env = "TASKHUB_COUNT", help_heading = PROCESSING)]
    pub count: usize,
    /// XREADGROUP BLOCK in milliseconds; a shutdown is seen within this time
    /// (so it must be shorter than --shutdown-timeout).
    #[arg(long, default_value_t = 2000, env = "TASKHUB_BLOCK_MS", help_heading = PROCESSING)]
    pub block_ms: u64,
    /// Exit 0 once nothing new arrives and the group has nothing pending.
    #[arg(long, env = "TASKHUB_UNTIL_IDLE", help_heading = PROCESSING)]
    pub until_idle: bool,
    /// batch: one transaction per batch of new events (falls back to one per
    /// event for a batch that fails); per-event: one transaction per event.
    #[arg(long, env = "TASKHUB_MODE", default_value = "batch", help_heading = PROCESSING)]
    pub mode: taskhub::Mode,
    /// Largest accepted entry in bytes; larger ones are dead-lettered as invalid.
    #[arg(long, default_value_t = 1024 * 1024, env = "TASKHUB_MAX_ENTRY_BYTES", help_heading = PROCESSING)]
    pub max_entry_bytes: usize,
    /// Where a newly created group starts: 0 (whole stream) or $ (new entries only).
    #[arg(long, default_value = "0", env = "TASKHUB_START_ID", help_heading = PROCESSING)]
    pub start_id: String,
    /// Deadline for a graceful shutdown.
    #[arg(long, default_value = "30s", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_SHUTDOWN_TIMEOUT", help_heading = PROCESSING)]
    pub shutdown_timeout: Duration,

    /// SQL run per event in its transaction: $1 event_id, $2 payload, $3 fields as JSON.
    #[arg(long, default_value = taskhub::DEFAULT_STATEMENT, env = "TASKHUB_SQL", help_heading = HANDLER)]
    pub sql: String,
    /// POST each event to this URL instead of running SQL (body: the payload;
    /// header Idempotency-Key: the event_id). Only scheme://host:port/path
    /// is ever shown of it.
    #[arg(long, env = "TASKHUB_HTTP_URL", hide_env_values = true, conflicts_with = "sql", help_heading = HANDLER)]
    pub http_url: Option<String>,
    /// Read --http-url from this file (keeps its credentials out of argv).
    #[arg(long, env = "TASKHUB_HTTP_URL_FILE", value_name = "PATH", conflicts_with = "sql", help_heading = HANDLER)]
    pub http_url_file: Option<PathBuf>,
    /// A header sent with every --http-url request, such as
    /// 'Authorization: Bearer ...' (repeatable; in the environment, one per
    /// line; values are never shown).
    #[arg(long, value_name = "NAME: VALUE", env = "TASKHUB_HTTP_HEADER", value_delimiter = '\n', hide_env_values = true, help_heading = HANDLER)]
    pub http_header: Vec<String>,
    /// Read --http-header lines from this file, one header per line.
    #[arg(long, env = "TASKHUB_HTTP_HEADER_FILE", value_name = "PATH", help_heading = HANDLER)]
    pub http_header_file: Option<PathBuf>,
    /// Longest a handler's SQL statement (or --http-url request) may run;
    /// one cut short is a retryable failure.
    #[arg(long, default_value = "60s", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_HANDLER_TIMEOUT", help_heading = HANDLER)]
    pub handler_timeout: Duration,
    /// Timeout of one --http-url request (at most --handler-timeout).
    #[arg(long, default_value = "10s", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_HTTP_TIMEOUT", help_heading = HANDLER)]
    pub http_timeout: Duration,
    /// PEM file with the CA certificate(s) that https:// --http-url and
    /// --alert-webhook servers are verified against, instead of the system's store.
    #[arg(long, env = "TASKHUB_HTTP_CA_FILE", value_name = "PATH", value_parser = super::servers::path, help_heading = HANDLER)]
    pub http_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for the https:// --http-url and
    /// --alert-webhook servers; with --http-client-key.
    #[arg(long, env = "TASKHUB_HTTP_CLIENT_CERT", value_name = "PATH", value_parser = super::servers::path, requires = "http_client_key", help_heading = HANDLER)]
    pub http_client_cert: Option<PathBuf>,
    /// The private key (PEM) of --http-client-cert.
    #[arg(long, env = "TASKHUB_HTTP_CLIENT_KEY", value_name = "PATH", value_parser = super::servers::path, requires = "http_client_cert", help_heading = HANDLER)]
    pub http_client_key: Option<PathBuf>,

    /// All attempts of an event, the first included, before it is
    /// dead-lettered [default: 5; 8 with --http-url].
    #[arg(long, env = "TASKHUB_MAX_ATTEMPTS", help_heading = RETRIES)]
    pub max_attempts: Option<u32>,
    /// First retry delay, doubling per attempt, with jitter [default: 200ms;
    /// 1s with --http-url].
    #[arg(long, value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_BACKOFF_BASE", help_heading = RETRIES)]
    pub backoff_base: Option<Duration>,
    /// Longest retry delay [default: 30s; 60s with --http-url].
    #[arg(long, value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_BACKOFF_CAP", help_heading = RETRIES)]
    pub backoff_cap: Option<Duration>,
    /// Longest Retry-After honoured.
    #[arg(long, default_value = "2m", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_MAX_RETRY_AFTER", help_heading = RETRIES)]
    pub max_retry_after: Duration,
    /// How often to look for entries abandoned by dead consumers.
    #[arg(long, default_value = "30s", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_RECLAIM_INTERVAL", help_heading = RETRIES)]
    pub reclaim_interval: Duration,
    /// Idle time after which another consumer's pending entry is taken over;
    /// must exceed the longest retry wait (the larger of --backoff-cap and
    /// --max-retry-after) and 2s. A handler run may last longer: ownership
    /// is checked before each commit.
    #[arg(long, default_value = "5m", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_RECLAIM_MIN_IDLE", help_heading = RETRIES)]
    pub reclaim_min_idle: Duration,
    /// Lifetime of the Redis duplicate marker.
    #[arg(long, default_value = "24h", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_MARKER_TTL", help_heading = RETRIES)]
    pub marker_ttl: Duration,

    /// Serve /, /metrics, /healthz, /readyz and /dlq on this address (9090 means 127.0.0.1:9090).
    #[arg(long, value_name = "ADDR", env = "TASKHUB_HTTP", help_heading = ENDPOINT)]
    pub http: Option<String>,
    /// Token that enables the replay and delete buttons of the /dlq page (prefer the environment).
    #[arg(long, env = "TASKHUB_ADMIN_TOKEN", hide_env_values = true, help_heading = ENDPOINT)]
    pub admin_token: Option<String>,
    /// Token needed to read the pages (Authorization: Bearer, or the login
    /// form); required when --http is not loopback (the admin token works too).
    #[arg(long, env = "TASKHUB_READ_TOKEN", hide_env_values = true, help_heading = ENDPOINT)]
    pub read_token: Option<String>,

    /// POST a JSON alert here when a dead-letter stream becomes non-empty,
    /// grows or gets old (only its scheme, host and port are ever shown).
    #[arg(long, value_name = "URL", env = "TASKHUB_ALERT_WEBHOOK", hide_env_values = true, help_heading = ALERTS)]
    pub alert_webhook: Option<String>,
    /// Read --alert-webhook from this file.
    #[arg(long, env = "TASKHUB_ALERT_WEBHOOK_FILE", value_name = "PATH", help_heading = ALERTS)]
    pub alert_webhook_file: Option<PathBuf>,
    /// How often the dead-letter streams are checked for alerts.
    #[arg(long, default_value = "10s", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_ALERT_INTERVAL", help_heading = ALERTS)]
    pub alert_interval: Duration,
    /// Age of the oldest dead letter that raises an alert.
    #[arg(long, default_value = "1h", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_ALERT_AGE", help_heading = ALERTS)]
    pub alert_age: Duration,
    /// Least time between two webhook calls for one stream.
    #[arg(long, default_value = "1m", value_parser = duration, allow_hyphen_values = true, env = "TASKHUB_ALERT_MIN_GAP", help_heading = ALERTS)]
    pub alert_min_gap: Duration,
}

/// The contents of a secret's file, trimmed.
fn read_secret(path: &std::path::Path) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_owned())
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// `Name: value` lines as (name, value) pairs; blank lines and `#` comments
/// skipped.
/// The `Name: value` pairs of `--http-header` lines. A line without a
/// colon is refused by its number, never shown: it is most likely a value
/// (a token wrapped onto a line of its own, `Name=value`), a secret (a
/// hostile test found it echoed in the error).
fn header_lines(lines: &[String]) -> Result<Vec<(String, String)>, String> {
    lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .enumerate()
        .map(|(i, l)| {
            l.split_once(':')
                .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| {
                    format!(
                        "--http-header: header {} has no ':' (expected 'Name: value', one per line; not shown, as it may hold a secret)",
                        i + 1
                    )
                })
        })
        .collect()
}

pub fn run(servers: &Servers, mut args: RunArgs) -> Result<(), String> {
    if let Some(path) = &args.http_url_file {
        args.http_url = Some(read_secret(path)?);
    }
    if let Some(path) = &args.alert_webhook_file {
        args.alert_webhook = Some(read_secret(path)?);
    }
    if let Some(path) = &args.http_header_file {
        args.http_header
            .extend(read_secret(path)?.lines().map(str::to_owned));
    }
    let http_tls = super::servers::tls(
        &args.http_ca_file,
        &args.http_client_cert,
        &args.http_client_key,
    );
    let worker = build_worker(servers, &args, &http_tls)?;

    // First SIGINT/SIGTERM: graceful shutdown. Second: exit at once. The
    // signals are counted here: the worker shuts itself down too when its
    // start fails, and a first signal then was taken for a second (exit
    // 130, the start's error unsaid; found by a hostile test).
    let stop = worker.shutdown_handle();
    let signalled = Arc::new(AtomicBool::new(false));
    let seen = signalled.clone();
    ctrlc::set_handler(move || {
        if seen.swap(true, Ordering::SeqCst) {
            eprintln!("taskhub: second signal, exiting now (unfinished entries stay pending)");
            std::process::exit(130);
        }
        log::info!("taskhub: signal received, shutting down gracefully (again to force)");
        stop.shutdown();
    })
    .map_err(|e| format!("cannot install the signal handler: {e}"))?;

    // Beside the worker, watching it through its monitor; both stop when
    // it does.
    let monitor = worker.monitor();
    let mut alerts = Alerts::new()
        .tls(http_tls)
        .interval(args.alert_interval)
        .age(args.alert_age)
        .min_gap(args.alert_min_gap);
    if let Some(url) = &args.alert_webhook {
        alerts = alerts.webhook(url);
    }
    let alerts = alerts.start(&monitor).map_err(|e| report(&e))?;
    let http = match &args.http {
        Some(addr) => {
            let mut server = HttpServer::new(addr);
            if let Some(token) = &args.admin_token {
                server = server.admin_token(token);
            }
            if let Some(token) = &args.read_token {
                server = server.read_token(token);
            }
            match server.start(&monitor) {
                Ok(serving) => Some(serving),
                Err(e) => {
                    stop_and_join(&monitor, alerts, None);
                    return Err(report(&e));
                }
            }
        }
        None => None,
    };

    let result = worker.run();
    stop_and_join(&monitor, alerts, http);
    let summary = match result {
        // A signal during the start interrupts its connects (EINTR): a stop
        // asked for, not a failure of the start. (ctrlc runs the handler on
        // a thread of its own, which may come late; the worker waits up to a
        // second for its shutdown before it starts again after an
        // interrupted start, and the handler sets `signalled` first.)
        Err(e) if signalled.load(Ordering::SeqCst) && e.kind() != ErrorKind::ShutdownTimeout => {
            log::info!(
                "taskhub: stopped by the signal during start-up ({})",
                report(&e)
            );
            return Ok(());
        }
        result => result.map_err(|e| report(&e))?,
    };
    println!("{summary}");
    Ok(())
}

/// The worker `run`'s flags describe: the `--http-url` handler (with its
/// retry budget and headers) or the SQL one.
fn build_worker(
    servers: &Servers,
    args: &RunArgs,
    http_tls: &taskhub::Tls,
) -> Result<Worker, String> {
    let headers = header_lines(&args.http_header)?;
    if !headers.is_empty() && args.http_url.is_none() {
        return Err("--http-header needs --http-url".into());
    }
    check_durations(args)?;
    let mut builder = Worker::builder()
        .redis_url(&servers.redis_url)
        .redis_tls(servers.redis_tls())
        .database_url(&servers.database_url)
        .group(&args.group)
        .workers(args.workers)
        .count(args.count)
        .block(Duration::from_millis(args.block_ms))
        .until_idle(args.until_idle)
        .max_retry_after(args.max_retry_after)
        .reclaim_interval(args.reclaim_interval)
        .reclaim_min_idle(args.reclaim_min_idle)
        .marker_ttl(args.marker_ttl)
        .shutdown_timeout(args.shutdown_timeout)
        .max_entry_bytes(args.max_entry_bytes)
        .handler_timeout(args.handler_timeout)
        .start_id(&args.start_id)
        .mode(args.mode);
    for stream in &args.stream {
        builder = builder.stream(stream);
    }
    if let Some(consumer) = &args.consumer {
        builder = builder.consumer(consumer);
    }
    if let Some(scope) = &args.scope {
        builder = builder.scope(scope);
    }
    match &args.http_url {
        Some(url) => {
            let timeout = args.http_timeout.min(args.handler_timeout);
            let budget = RetryBudget::new(
                args.max_attempts.unwrap_or(HTTP_BUDGET.max_attempts),
                args.backoff_base.unwrap_or(HTTP_BUDGET.base),
                args.backoff_cap.unwrap_or(HTTP_BUDGET.cap),
            );
            let mut handler = HttpHandler::new(url, timeout, http_tls)
                .map_err(|e| report(&e))?
                .retry_budget(budget);
            for (name, value) in &headers {
                handler = handler
                    .header(name, value)
                    .map_err(|e| format!("--http-header {name}: {}", report(&e)))?;
            }
            builder.build(handler)
        }
        None => {
            if let Some(n) = args.max_attempts {
                builder = builder.max_attempts(n);
            }
            if let Some(base) = args.backoff_base {
                builder = builder.backoff_base(base);
            }
            if let Some(cap) = args.backoff_cap {
                builder = builder.backoff_cap(cap);
            }
            builder.build(SqlHandler::new(args.sql.clone()))
        }
    }
    .map_err(|e| report(&e))
}

/// The duration flags' checks that the library makes too, with the flags
/// named: `--shutdown-timeout` must be positive, and `--reclaim-min-idle`
/// must exceed the longest retry wait, saying which flag that wait comes
/// from. (With the SQL handler and no `--backoff-cap`, the library checks
/// against its default cap.)
fn check_durations(args: &RunArgs) -> Result<(), String> {
    let show = |d: Duration| humantime::format_duration(d).to_string();
    if args.shutdown_timeout.is_zero() {
        return Err(format!(
            "--shutdown-timeout must be positive, not {}: it is how long a graceful stop may \
             take, and a zero one fails every stop",
            show(args.shutdown_timeout)
        ));
    }
    let cap = match &args.http_url {
        Some(_) => Some(args.backoff_cap.unwrap_or(HTTP_BUDGET.cap)),
        None => args.backoff_cap,
    };
    let retry_after = args.max_retry_after;
    let (longest, from, other) = match cap {
        Some(cap) if cap > retry_after => (
            cap,
            "--backoff-cap",
            format!("--max-retry-after is {}", show(retry_after)),
        ),
        Some(cap) => (
            retry_after,
            "--max-retry-after",
            format!("--backoff-cap is {}", show(cap)),
        ),
        None => (
            retry_after,
            "--max-retry-after",
            "--backoff-cap at its default".to_owned(),
        ),
    };
    let min_idle = args.reclaim_min_idle;
    if min_idle >= Duration::from_secs(2) && min_idle <= longest {
        return Err(format!(
            "--reclaim-min-idle ({}) must exceed the longest retry wait ({}, from {from}; \
             {other}), or entries waiting for a retry would be taken over by other consumers: \
             raise --reclaim-min-idle or lower {from}",
            show(min_idle),
            show(longest)
        ));
    }
    Ok(())
}

fn stop_and_join(
    monitor: &taskhub::Monitor,
    alerts: std::thread::JoinHandle<()>,
    http: Option<taskhub::Serving>,
) {
    monitor.shutdown_handle().shutdown();
    let _ = alerts.join();
    if let Some(http) = http {
        http.join();
    }
}
