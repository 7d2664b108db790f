//! The `taskhub` binary: parses flags, sets up logging and signals, calls the
//! library, maps errors to exit codes (0 ok, 1 failure, 2 usage).

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use taskhub::{HttpHandler, Producer, SqlHandler, Worker};

mod cli;

/// Exactly-once effects from Redis Streams, with retries and dead letters.
#[derive(Parser, Debug)]
#[command(name = "taskhub", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    servers: Servers,
    /// Log lines as text or as JSON objects (one per line). RUST_LOG sets the level.
    #[arg(
        long,
        global = true,
        env = "TASKHUB_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr; the library only uses the `log` facade.
fn init_logging(format: LogFormat) {
    let mut builder = env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("info,postgres=warn,tokio_postgres=warn"),
    );
    match format {
        LogFormat::Text => builder.format_timestamp_millis(),
        LogFormat::Json => builder.format(|buf, record| {
            let line = serde_json::json!({
                "ts": humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
                "level": record.level().as_str(),
                "target": record.target(),
                "msg": record.args().to_string(),
            });
            writeln!(buf, "{line}")
        }),
    };
    builder.init();
}

#[derive(Args, Debug)]
struct Servers {
    /// Redis URL.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        global = true,
        hide_env_values = true
    )]
    redis_url: String,
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres:taskhub@127.0.0.1:5432/taskhub",
        global = true,
        hide_env_values = true,
        hide_default_value = true
    )]
    database_url: String,
    /// Read the Redis URL from this file (keeps a password out of argv and
    /// the environment); wins over --redis-url.
    #[arg(long, env = "REDIS_URL_FILE", global = true, value_name = "PATH")]
    redis_url_file: Option<std::path::PathBuf>,
    /// Read the PostgreSQL URL from this file; wins over --database-url.
    #[arg(long, env = "DATABASE_URL_FILE", global = true, value_name = "PATH")]
    database_url_file: Option<std::path::PathBuf>,
}

impl Servers {
    /// Replaces the URLs by the contents of the URL files, when given.
    fn read_files(&mut self) -> Result<(), String> {
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

#[derive(Subcommand, Debug)]
enum Command {
    /// Apply the database migrations (safe to run from several instances at once).
    Migrate,
    /// Consume streams and apply each event's effect exactly once.
    Run(Box<RunArgs>),
    /// Add events to a stream: JSON lines on stdin, or --count demo events.
    Produce(ProduceArgs),
    /// Dead letters: stats, list, show, replay, purge, archive, check.
    #[command(long_about = cli::dlq::LONG_ABOUT)]
    Dlq(Box<cli::dlq::DlqArgs>),
    /// List a group's consumers (pending entries, idle time), or remove one that left for good.
    Consumers(ConsumersArgs),
}

#[derive(Args, Debug)]
struct ConsumersArgs {
    /// The stream.
    #[arg(long, default_value = "tasks:events")]
    stream: String,
    /// The consumer group.
    #[arg(long, default_value = "workers")]
    group: String,
    /// Remove this consumer; refused while it has pending entries (they
    /// would become unclaimable).
    #[arg(long, value_name = "NAME")]
    remove: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn consumers(servers: &Servers, args: ConsumersArgs) -> Result<(), String> {
    if let Some(name) = &args.remove {
        taskhub::remove_consumer(&servers.redis_url, &args.stream, &args.group, name)
            .map_err(|e| e.to_string())?;
        println!(
            "removed consumer {name} from {}/{}",
            args.stream, args.group
        );
        return Ok(());
    }
    let list = taskhub::consumers(&servers.redis_url, &args.stream, &args.group)
        .map_err(|e| e.to_string())?;
    if args.json {
        let items: Vec<serde_json::Value> = list
            .iter()
            .map(|c| serde_json::json!({"name": c.name, "pending": c.pending, "idle_ms": c.idle.as_millis() as u64}))
            .collect();
        println!("{}", serde_json::Value::Array(items));
        return Ok(());
    }
    let width = list.iter().map(|c| c.name.len()).max().unwrap_or(4).max(8);
    println!("{:<width$}  {:>8}  {:>12}", "consumer", "pending", "idle");
    for c in &list {
        let idle = humantime::format_duration(std::time::Duration::from_secs(c.idle.as_secs()))
            .to_string();
        println!("{:<width$}  {:>8}  {:>12}", c.name, c.pending, idle);
    }
    Ok(())
}

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{e} (expected a duration such as 20ms, 1s or 5m)"))
}

#[derive(Args, Debug)]
struct RunArgs {
    /// Stream to read (repeat for several streams; one reader thread each).
    #[arg(long, default_value = "tasks:events")]
    stream: Vec<String>,
    /// Consumer group (created when missing).
    #[arg(long, default_value = "workers")]
    group: String,
    /// Consumer name, stable across restarts and unique per instance [default: host name].
    #[arg(long, env = "TASKHUB_CONSUMER")]
    consumer: Option<String>,
    /// Idempotency scope [default: the group].
    #[arg(long)]
    scope: Option<String>,
    /// Worker threads.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Entries per XREADGROUP, and so the largest batch.
    #[arg(long, default_value_t = 64)]
    count: usize,
    /// XREADGROUP BLOCK in milliseconds; a shutdown is seen within this time.
    #[arg(long, default_value_t = 2000)]
    block_ms: u64,
    /// Exit 0 once nothing new arrives and the group has nothing pending.
    #[arg(long)]
    until_idle: bool,
    /// SQL run per event in its transaction: $1 event_id, $2 payload, $3 fields as JSON.
    #[arg(long, default_value = taskhub::DEFAULT_STATEMENT)]
    sql: String,
    /// POST each event to this URL instead of running SQL (body: the payload;
    /// header Idempotency-Key: the event_id).
    #[arg(long, conflicts_with = "sql")]
    http_url: Option<String>,
    /// Timeout of one --http-url request.
    #[arg(long, default_value = "10s", value_parser = duration, allow_hyphen_values = true)]
    http_timeout: Duration,
    /// batch: one transaction per batch of new events (falls back to one per
    /// event for a batch that fails); per-event: one transaction per event.
    #[arg(long, env = "TASKHUB_MODE", default_value = "batch")]
    mode: taskhub::Mode,
    /// All attempts of an event, the first included, before it is dead-lettered.
    #[arg(long, default_value_t = 5)]
    max_attempts: u32,
    /// First retry delay (doubles per attempt, equal jitter).
    #[arg(long, default_value = "200ms", value_parser = duration, allow_hyphen_values = true)]
    backoff_base: Duration,
    /// Longest retry delay.
    #[arg(long, default_value = "30s", value_parser = duration, allow_hyphen_values = true)]
    backoff_cap: Duration,
    /// Longest Retry-After honoured.
    #[arg(long, default_value = "2m", value_parser = duration, allow_hyphen_values = true)]
    max_retry_after: Duration,
    /// How often to look for entries abandoned by dead consumers.
    #[arg(long, default_value = "30s", value_parser = duration, allow_hyphen_values = true)]
    reclaim_interval: Duration,
    /// Idle time after which another consumer's pending entry is taken over;
    /// must exceed the longest handler run and retry wait.
    #[arg(long, default_value = "5m", value_parser = duration, allow_hyphen_values = true)]
    reclaim_min_idle: Duration,
    /// Lifetime of the Redis duplicate marker.
    #[arg(long, default_value = "24h", value_parser = duration, allow_hyphen_values = true)]
    marker_ttl: Duration,
    /// Deadline for a graceful shutdown.
    #[arg(long, default_value = "30s", value_parser = duration, allow_hyphen_values = true)]
    shutdown_timeout: Duration,
    /// Largest accepted entry in bytes; larger ones are dead-lettered as invalid.
    #[arg(long, default_value_t = 1024 * 1024)]
    max_entry_bytes: usize,
    /// Serve /metrics, /healthz, /readyz and /dlq on this address (9090 means 127.0.0.1:9090).
    #[arg(long, value_name = "ADDR")]
    http: Option<String>,
    /// Token that enables the replay and delete buttons of the /dlq page (prefer the environment).
    #[arg(long, env = "TASKHUB_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// POST a JSON alert here when a dead-letter stream becomes non-empty, grows or gets old.
    #[arg(long, value_name = "URL")]
    alert_webhook: Option<String>,
    /// How often the dead-letter streams are checked for alerts.
    #[arg(long, default_value = "10s", value_parser = duration, allow_hyphen_values = true)]
    alert_interval: Duration,
    /// Age of the oldest dead letter that raises an alert.
    #[arg(long, default_value = "1h", value_parser = duration, allow_hyphen_values = true)]
    alert_age: Duration,
    /// Least time between two webhook calls for one stream.
    #[arg(long, default_value = "1m", value_parser = duration, allow_hyphen_values = true)]
    alert_min_gap: Duration,
    /// Where a newly created group starts: 0 (whole stream) or $ (new entries only).
    #[arg(long, default_value = "0")]
    start_id: String,
}

#[derive(Args, Debug)]
struct ProduceArgs {
    /// Stream to add to.
    #[arg(long, default_value = "tasks:events")]
    stream: String,
    /// Add this many demo events instead of reading stdin.
    #[arg(long)]
    count: Option<u64>,
    /// Approximate payload size of demo events, in bytes.
    #[arg(long, default_value_t = 200)]
    payload_bytes: usize,
    /// Do not print the entry ids.
    #[arg(long, short)]
    quiet: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let mut cli = cli;
    if let Err(message) = cli.servers.read_files() {
        eprintln!("taskhub: error: {message}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Migrate => taskhub::migrate(&cli.servers.database_url)
            .map(|n| println!("migrations applied: {n}"))
            .map_err(|e| e.to_string()),
        Command::Run(args) => run(&cli.servers, *args),
        Command::Produce(args) => produce(&cli.servers, args),
        Command::Consumers(args) => consumers(&cli.servers, args),
        Command::Dlq(args) => {
            match cli::dlq::run(&cli.servers.redis_url, &cli.servers.database_url, *args) {
                Ok(code) => return code,
                Err(message) => Err(message),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("taskhub: error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(servers: &Servers, args: RunArgs) -> Result<(), String> {
    let mut builder = Worker::builder()
        .redis_url(&servers.redis_url)
        .database_url(&servers.database_url)
        .group(&args.group)
        .workers(args.workers)
        .count(args.count)
        .block(Duration::from_millis(args.block_ms))
        .until_idle(args.until_idle)
        .max_attempts(args.max_attempts)
        .backoff_base(args.backoff_base)
        .backoff_cap(args.backoff_cap)
        .max_retry_after(args.max_retry_after)
        .reclaim_interval(args.reclaim_interval)
        .reclaim_min_idle(args.reclaim_min_idle)
        .marker_ttl(args.marker_ttl)
        .shutdown_timeout(args.shutdown_timeout)
        .max_entry_bytes(args.max_entry_bytes)
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
    if let Some(addr) = &args.http {
        builder = builder.http(addr);
    }
    if let Some(token) = &args.admin_token {
        builder = builder.admin_token(token);
    }
    if let Some(url) = &args.alert_webhook {
        builder = builder.alert_webhook(url);
    }
    builder = builder
        .alert_interval(args.alert_interval)
        .alert_age(args.alert_age)
        .alert_min_gap(args.alert_min_gap);
    let worker = match &args.http_url {
        Some(url) => builder.build(HttpHandler::new(url, args.http_timeout)),
        None => builder.build(SqlHandler::new(args.sql)),
    }
    .map_err(|e| e.to_string())?;

    // First SIGINT/SIGTERM: graceful shutdown. Second: exit at once.
    let stop = worker.shutdown_handle();
    ctrlc::set_handler(move || {
        if stop.is_shutdown() {
            eprintln!("taskhub: second signal, exiting now (unfinished entries stay pending)");
            std::process::exit(130);
        }
        log::info!("taskhub: signal received, shutting down gracefully (again to force)");
        stop.shutdown();
    })
    .map_err(|e| format!("cannot install the signal handler: {e}"))?;

    let summary = worker.run().map_err(|e| e.to_string())?;
    println!("{summary}");
    Ok(())
}

fn produce(servers: &Servers, args: ProduceArgs) -> Result<(), String> {
    let mut producer =
        Producer::connect(&servers.redis_url, &args.stream).map_err(|e| e.to_string())?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut flush = |batch: &mut Vec<Vec<(String, String)>>| -> Result<(), String> {
        if batch.is_empty() {
            return Ok(());
        }
        let ids = producer.send_batch(batch).map_err(|e| e.to_string())?;
        batch.clear();
        if !args.quiet {
            for id in ids {
                writeln!(out, "{id}").map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    let mut batch = Vec::with_capacity(1000);
    if let Some(count) = args.count {
        let filler = "x".repeat(args.payload_bytes.saturating_sub(90));
        for n in 0..count {
            let event_id = uuid::Uuid::new_v4().to_string();
            let payload = serde_json::json!({"n": n, "kind": "demo", "message": format!("demo event {n}"), "pad": filler}).to_string();
            batch.push(vec![
                ("event_id".into(), event_id),
                ("payload".into(), payload),
            ]);
            if batch.len() == 1000 {
                flush(&mut batch)?;
            }
        }
    } else {
        for (number, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.map_err(|e| format!("stdin: {e}"))?;
            if line.trim().is_empty() {
                continue;
            }
            batch.push(
                fields_from_json(&line).map_err(|e| format!("stdin line {}: {e}", number + 1))?,
            );
            if batch.len() == 1000 {
                flush(&mut batch)?;
            }
        }
    }
    flush(&mut batch)
}

/// One JSON object → stream fields. `event_id` defaults to a new UUID;
/// string values are kept as they are, other values as JSON text.
fn fields_from_json(line: &str) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(map) = value else {
        return Err(
            "expected a JSON object such as {\"event_id\":\"e1\",\"payload\":\"...\"}".into(),
        );
    };
    let mut fields = Vec::with_capacity(map.len() + 1);
    if !map.contains_key("event_id") {
        fields.push(("event_id".to_owned(), uuid::Uuid::new_v4().to_string()));
    }
    for (k, v) in map {
        let text = match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        fields.push((k, text));
    }
    Ok(fields)
}
