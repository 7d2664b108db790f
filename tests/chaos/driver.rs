//! The chaos driver of `scripts/chaos.sh`: it produces the mixed events, runs
//! as one of the worker processes, waits for the group to drain, and checks
//! the end state. Each subcommand is one step of the script:
//!
//! - `setup`: migrations plus the table the "permanent" events violate;
//! - `produce`: adds the events at a steady rate with explicit entry ids (so
//!   a write cut by a Redis restart is retried without a second copy) and
//!   writes a manifest (JSON lines) of every entry and its expected outcome;
//! - `work`: a worker embedding the library, with the same flags as
//!   `taskhub run` (`--mode` / `TASKHUB_MODE` included) and a handler whose
//!   behaviour depends on the payload: `plain` inserts its notification;
//!   `transient` fails with a retryable error until it has been called `k`
//!   times (the count lives in Redis, so it survives the rollback and the
//!   process); `permanent` violates a CHECK constraint (SQLSTATE 23514);
//!   `panic` panics on every call, `panic-once` on the first only; `abort`
//!   kills the whole process (a crash loop); a payload that is not JSON is
//!   invalid;
//!   `killer` terminates its own PostgreSQL backend (a statement that kills
//!   its session: a crash loop of the database kind); `slow` fails slowly
//!   (1.5 s) with a `Retry-After` `k` times, so that its retries outlast a
//!   short `--reclaim-min-idle` and another instance claims it meanwhile;
//! - `proxy`: the TCP fault proxy of the tests (`tests/support/proxy.rs`,
//!   included by path) between each worker process and each server, driven
//!   through command files: delay, drop (FIN), reset (RST), freeze half-open,
//!   refuse;
//! - `trim`: XTRIM MINID of the stream just past one of its pending entries,
//!   so only delivered entries (acked or pending) are deleted, and records
//!   the MINID for the check;
//! - `settle`: waits until everything was delivered and nothing is pending;
//! - `check`: loads the manifest and the dead-letter stream into PostgreSQL
//!   and checks, per entry and per event_id, with SQL, that every event has
//!   its expected outcome exactly once; prints the summary table; exits 1 on
//!   any violation.
//!
//! Not meant to be run by hand: see `scripts/chaos.sh`.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};

// The same proxy the tests use: written once, included by path.
#[path = "../support/proxy.rs"]
mod proxy;
use rand::{Rng, SeedableRng};
use taskhub::dlq::UNFINISHED_RUN;
use taskhub::{Event, Handler, HandlerError, SqlHandler, Tx, Worker};

#[derive(Parser)]
struct Cli {
    /// Redis URL.
    #[arg(long, env = "REDIS_URL", global = true, default_value = "")]
    redis_url: String,
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", global = true, default_value = "")]
    database_url: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Setup,
    Produce(ProduceArgs),
    Work(Box<WorkArgs>),
    Settle(SettleArgs),
    Check(CheckArgs),
    Proxy(ProxyArgs),
    Trim(TrimArgs),
    Destroy(DestroyArgs),
}

#[derive(Args)]
struct DestroyArgs {
    #[arg(long)]
    stream: String,
    #[arg(long)]
    group: String,
    /// The file to append the ids pending at the destroy to (the check
    /// reads it).
    #[arg(long)]
    record: std::path::PathBuf,
}

#[derive(Args)]
struct ProxyArgs {
    /// Where to write `<name>.port` and read `<name>.cmd`.
    #[arg(long)]
    dir: std::path::PathBuf,
    /// `<name>=<host:port>` of a target, repeated.
    #[arg(long = "route", required = true)]
    routes: Vec<String>,
}

#[derive(Args)]
struct TrimArgs {
    #[arg(long)]
    stream: String,
    #[arg(long)]
    group: String,
    /// Cut just past the n-th oldest pending entry (or the last one, if
    /// fewer are pending).
    #[arg(long, default_value_t = 20)]
    pending: usize,
    /// The file to append the MINID to (the check reads it).
    #[arg(long)]
    record: std::path::PathBuf,
}

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| e.to_string())
}

#[derive(Args)]
struct ProduceArgs {
    #[arg(long)]
    stream: String,
    #[arg(long)]
    events: usize,
    /// Spread the events over this many seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Events that kill their process (crash loops).
    #[arg(long, default_value_t = 1)]
    aborts: usize,
    /// Events that kill their PostgreSQL session (crash loops too).
    #[arg(long, default_value_t = 1)]
    killers: usize,
    /// A second stream that gets the same entries (a second deployment).
    #[arg(long)]
    also_stream: Option<String>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The workers' --max-entry-bytes, to size the oversized entries.
    #[arg(long, default_value_t = 65536)]
    max_entry_bytes: usize,
    /// Where to write the manifest (JSON lines).
    #[arg(long)]
    manifest: std::path::PathBuf,
}

#[derive(Args)]
struct WorkArgs {
    #[arg(long)]
    stream: String,
    #[arg(long)]
    group: String,
    #[arg(long)]
    consumer: String,
    #[arg(long, default_value_t = 4)]
    workers: usize,
    #[arg(long, default_value_t = 64)]
    count: usize,
    #[arg(long, default_value_t = 200)]
    block_ms: u64,
    #[arg(long, env = "TASKHUB_MODE", default_value = "batch")]
    mode: taskhub::Mode,
    #[arg(long, default_value_t = 4)]
    max_attempts: u32,
    #[arg(long, default_value = "50ms", value_parser = duration)]
    backoff_base: Duration,
    #[arg(long, default_value = "1s", value_parser = duration)]
    backoff_cap: Duration,
    #[arg(long, default_value = "1s", value_parser = duration)]
    max_retry_after: Duration,
    #[arg(long, default_value = "1s", value_parser = duration)]
    reclaim_interval: Duration,
    #[arg(long, default_value = "5s", value_parser = duration)]
    reclaim_min_idle: Duration,
    #[arg(long, default_value = "20s", value_parser = duration)]
    shutdown_timeout: Duration,
    #[arg(long, default_value_t = 65536)]
    max_entry_bytes: usize,
}

#[derive(Args)]
struct SettleArgs {
    #[arg(long)]
    stream: String,
    #[arg(long)]
    group: String,
    #[arg(long, default_value = "300s", value_parser = duration)]
    timeout: Duration,
}

#[derive(Args)]
struct CheckArgs {
    #[arg(long)]
    stream: String,
    #[arg(long)]
    group: String,
    #[arg(long)]
    manifest: std::path::PathBuf,
    #[arg(long)]
    max_attempts: u32,
    /// Figures of the run, for the table.
    #[arg(long, default_value = "")]
    mode: String,
    #[arg(long, default_value_t = 0)]
    kills: u64,
    #[arg(long, default_value_t = 0)]
    abort_deaths: u64,
    #[arg(long, default_value_t = 0)]
    redis_restarts: u64,
    #[arg(long, default_value_t = 0)]
    pg_restarts: u64,
    #[arg(long, default_value_t = 0)]
    killed_for_good: u64,
    /// Entries the worker killed for good held when it died.
    #[arg(long, default_value_t = 0)]
    orphaned: u64,
    #[arg(long, default_value_t = 0)]
    reclaimed: u64,
    #[arg(long, default_value_t = 0.0)]
    elapsed: f64,
    /// The MINIDs of the XTRIMs of the run (`trim --record`), if any.
    #[arg(long)]
    trims: Option<std::path::PathBuf>,
    /// The ids pending at each XGROUP DESTROY (`destroy --record`), if any.
    #[arg(long)]
    destroyed: Option<std::path::PathBuf>,
    /// More figures of the run, `label=value`, for the table.
    #[arg(long = "figure")]
    figures: Vec<String>,
    /// The run's directory: the supervisors' exit records (`run/exits.<i>`,
    /// "status unix-ms" per exit of consumer `c<i>`) and the workers' logs
    /// (`w<i>.log`), the evidence for each crash a dead letter's history
    /// charges to a consumer.
    #[arg(long)]
    run_dir: Option<std::path::PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    let result = match cli.command {
        Command::Setup => setup(&cli.database_url),
        Command::Produce(a) => produce(&cli.redis_url, &a),
        Command::Work(a) => work(&cli.redis_url, &cli.database_url, &a),
        Command::Settle(a) => settle(&cli.redis_url, &a),
        Command::Check(a) => check(&cli.redis_url, &cli.database_url, &a),
        Command::Proxy(a) => run_proxy(&a),
        Command::Trim(a) => trim(&cli.redis_url, &a),
        Command::Destroy(a) => destroy(&cli.redis_url, &a),
    };
    if let Err(e) = result {
        eprintln!("taskhub-chaos: error: {e}");
        std::process::exit(1);
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

// ---------------------------------------------------------------------------
// setup

fn setup(db_url: &str) -> Res<()> {
    taskhub::migrate(db_url)?;
    let mut client = postgres::Client::connect(db_url, postgres::NoTls)?;
    client.batch_execute(
        "CREATE TABLE IF NOT EXISTS chaos_rejects (
             event_id text NOT NULL,
             amount int NOT NULL CHECK (amount >= 0)
         )",
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------
// produce

/// What should become of an entry.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Expect {
    Apply,
    Permanent,
    Exhausted,
    CrashLoop,
    Invalid,
}

impl Expect {
    fn as_str(self) -> &'static str {
        match self {
            Expect::Apply => "apply",
            Expect::Permanent => "permanent",
            Expect::Exhausted => "exhausted",
            Expect::CrashLoop => "crash_loop",
            Expect::Invalid => "invalid",
        }
    }
}

/// One produced entry.
struct Entry {
    chaos_id: String,
    kind: String,
    event_id: Option<String>,
    expect: Expect,
    /// A fragment the dead letter's reason must contain.
    reason: &'static str,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Res<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?))
        .collect()
}

fn payload(kind: &str, k: u32, chaos_id: &str, rng: &mut impl Rng) -> String {
    let pad_len = rng.random_range(20..400);
    let text: String = "taskhub chaos \"quoted\" 'single' <b>é漢🙂</b> \\ "
        .chars()
        .cycle()
        .take(pad_len)
        .collect();
    serde_json::json!({"id": chaos_id, "kind": kind, "k": k, "text": text}).to_string()
}

/// The events: mostly plain, with every kind of trouble mixed in at random.
fn plan(args: &ProduceArgs) -> Vec<Entry> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let n = args.events;
    // The crash loops sit in the middle of the run, where there is traffic.
    let mut abort_at: Vec<usize> = (0..args.aborts.min(n))
        .map(|i| n / 4 + (i * n / 2) / args.aborts.max(1))
        .collect();
    abort_at.sort();
    // The session killers a little later, away from the aborts.
    let mut killer_at: Vec<usize> = (0..args.killers.min(n))
        .map(|i| n / 3 + (i * n / 2) / args.killers.max(1) + 1)
        .filter(|i| abort_at.binary_search(i).is_err())
        .collect();
    killer_at.sort();
    let mut plain_ids: Vec<String> = Vec::new();
    let mut invalid_variant = 0usize;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let chaos_id = format!("c{i:06}");
        let event_id = format!("ev-{i:06}");
        let roll: f64 = rng.random();
        let simple = |kind: &str, expect, reason, k, rng: &mut rand::rngs::StdRng| {
            let p = payload(kind, k, &chaos_id, rng);
            Entry {
                chaos_id: chaos_id.clone(),
                kind: if k > 0 {
                    format!("{kind}:{k}")
                } else {
                    kind.to_owned()
                },
                event_id: Some(event_id.clone()),
                expect,
                reason,
                fields: vec![
                    (b"event_id".to_vec(), event_id.clone().into_bytes()),
                    (b"payload".to_vec(), p.into_bytes()),
                    (b"chaos_id".to_vec(), chaos_id.clone().into_bytes()),
                ],
            }
        };
        let entry = if abort_at.binary_search(&i).is_ok() {
            simple("abort", Expect::CrashLoop, "", 0, &mut rng)
        } else if killer_at.binary_search(&i).is_ok() {
            simple("killer", Expect::CrashLoop, "", 0, &mut rng)
        } else if roll > 0.994 {
            let k = rng.random_range(1..=2);
            simple("slow", Expect::Apply, "", k, &mut rng)
        } else if roll < 0.02 {
            let v = invalid_variant;
            invalid_variant += 1;
            invalid(v, &chaos_id, &event_id, args.max_entry_bytes, &mut rng)
        } else if roll < 0.05 {
            simple("permanent", Expect::Permanent, "23514", 0, &mut rng)
        } else if roll < 0.15 {
            let k = rng.random_range(1..=2);
            simple("transient", Expect::Apply, "", k, &mut rng)
        } else if roll < 0.16 {
            simple("panic", Expect::Exhausted, "panicked", 0, &mut rng)
        } else if roll < 0.17 {
            simple("panic-once", Expect::Apply, "", 0, &mut rng)
        } else if roll < 0.20 && !plain_ids.is_empty() {
            // The same event sent again: at most one effect in total.
            let again = plain_ids[rng.random_range(0..plain_ids.len())].clone();
            let p = payload("plain", 0, &chaos_id, &mut rng);
            Entry {
                chaos_id: chaos_id.clone(),
                kind: "resent".into(),
                event_id: Some(again.clone()),
                expect: Expect::Apply,
                reason: "",
                fields: vec![
                    (b"event_id".to_vec(), again.into_bytes()),
                    (b"payload".to_vec(), p.into_bytes()),
                    (b"chaos_id".to_vec(), chaos_id.clone().into_bytes()),
                ],
            }
        } else {
            plain_ids.push(event_id.clone());
            simple("plain", Expect::Apply, "", 0, &mut rng)
        };
        out.push(entry);
    }
    out
}

/// Entries that break the message contract, and one whose payload the
/// handler rejects as invalid.
fn invalid(
    variant: usize,
    chaos_id: &str,
    event_id: &str,
    max_entry_bytes: usize,
    rng: &mut impl Rng,
) -> Entry {
    let p = payload("plain", 0, chaos_id, rng).into_bytes();
    let cid = (b"chaos_id".to_vec(), chaos_id.as_bytes().to_vec());
    let (kind, id, reason, fields): (&str, Option<String>, &'static str, Vec<_>) = match variant % 7
    {
        0 => (
            "invalid-missing-id",
            None,
            "missing field event_id",
            vec![(b"payload".to_vec(), p), cid],
        ),
        1 => (
            "invalid-empty-id",
            None,
            "empty event_id",
            vec![
                (b"event_id".to_vec(), vec![]),
                (b"payload".to_vec(), p),
                cid,
            ],
        ),
        2 => {
            let id = format!("{event_id}\nline");
            (
                "invalid-control",
                None,
                "control characters",
                vec![
                    (b"event_id".to_vec(), id.into_bytes()),
                    (b"payload".to_vec(), p),
                    cid,
                ],
            )
        }
        3 => {
            let mut id = vec![0xff, 0xfe];
            id.extend_from_slice(event_id.as_bytes());
            (
                "invalid-not-utf8",
                None,
                "not UTF-8",
                vec![(b"event_id".to_vec(), id), (b"payload".to_vec(), p), cid],
            )
        }
        4 => {
            let big = vec![b'x'; max_entry_bytes + 1000];
            (
                "invalid-too-big",
                None,
                "over the limit",
                vec![
                    (b"event_id".to_vec(), event_id.as_bytes().to_vec()),
                    (b"payload".to_vec(), big),
                    cid,
                ],
            )
        }
        5 => {
            let id = format!("{event_id}-{}", "i".repeat(300));
            (
                "invalid-long-id",
                None,
                "over the limit",
                vec![
                    (b"event_id".to_vec(), id.into_bytes()),
                    (b"payload".to_vec(), p),
                    cid,
                ],
            )
        }
        _ => (
            "invalid-payload",
            Some(event_id.to_owned()),
            "payload is not JSON",
            vec![
                (b"event_id".to_vec(), event_id.as_bytes().to_vec()),
                (b"payload".to_vec(), b"{not json".to_vec()),
                cid,
            ],
        ),
    };
    Entry {
        chaos_id: chaos_id.to_owned(),
        kind: kind.to_owned(),
        event_id: id,
        expect: Expect::Invalid,
        reason,
        fields,
    }
}

fn redis_conn(url: &str) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::open(url)?;
    let conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(conn)
}

fn xadd_cmd(stream: &str, id: &str, fields: &[(Vec<u8>, Vec<u8>)]) -> redis::Cmd {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg(id);
    for (k, v) in fields {
        cmd.arg(k).arg(v);
    }
    cmd
}

/// Adds `entries` with their explicit ids, through Redis restarts: after an
/// error each entry is sent again alone, and "ID equal or smaller" means the
/// earlier try had written it.
fn send_chunk(
    url: &str,
    conn: &mut Option<redis::Connection>,
    streams: &[&str],
    entries: &[(String, &Entry)],
) -> Res<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut one_by_one = false;
    loop {
        if Instant::now() > deadline {
            return Err("Redis did not come back within 120 s".into());
        }
        let c = match conn.as_mut() {
            Some(c) => c,
            None => match redis_conn(url) {
                Ok(c) => conn.insert(c),
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            },
        };
        let result: redis::RedisResult<()> = if one_by_one {
            entries.iter().try_for_each(|(id, e)| {
                streams.iter().try_for_each(|stream| {
                    match xadd_cmd(stream, id, &e.fields).query::<String>(c) {
                        Ok(_) => Ok(()),
                        Err(err) if err.to_string().contains("equal or smaller") => Ok(()),
                        Err(err) => Err(err),
                    }
                })
            })
        } else {
            let mut pipe = redis::pipe();
            for (id, e) in entries {
                for stream in streams {
                    pipe.add_command(xadd_cmd(stream, id, &e.fields)).ignore();
                }
            }
            pipe.query(c)
        };
        match result {
            Ok(()) => return Ok(()),
            Err(e) => {
                eprintln!("chaos produce: {e}; sending the chunk again");
                *conn = None;
                one_by_one = true;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

fn produce(url: &str, args: &ProduceArgs) -> Res<()> {
    let entries = plan(args);
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    let ids: Vec<String> = (0..entries.len()).map(|i| format!("{base}-{i}")).collect();
    // The manifest first, so that whatever reached the stream is in it.
    let mut manifest = std::io::BufWriter::new(std::fs::File::create(&args.manifest)?);
    for (id, e) in ids.iter().zip(&entries) {
        let fields: Vec<[String; 2]> = e.fields.iter().map(|(k, v)| [hex(k), hex(v)]).collect();
        let line = serde_json::json!({
            "chaos_id": e.chaos_id,
            "entry_id": id,
            "kind": e.kind,
            "event_id": e.event_id,
            "expect": e.expect.as_str(),
            "reason": e.reason,
            "fields": fields,
        });
        writeln!(manifest, "{line}")?;
    }
    manifest.flush()?;
    drop(manifest);

    let mut streams = vec![args.stream.as_str()];
    streams.extend(args.also_stream.as_deref());
    let mut conn = None;
    let started = Instant::now();
    let chunk = 50;
    let per_chunk = Duration::from_secs_f64(args.seconds * chunk as f64 / entries.len() as f64);
    let all: Vec<(String, &Entry)> = ids.into_iter().zip(&entries).collect();
    for (n, part) in all.chunks(chunk).enumerate() {
        send_chunk(url, &mut conn, &streams, part)?;
        let due = per_chunk * (n as u32 + 1);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    eprintln!(
        "chaos produce: {} entries in {:.1} s",
        entries.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// work

/// The chaos handler: behaviour chosen by the payload's `kind`.
struct Chaos {
    redis: redis::Client,
    conns: std::sync::Mutex<Vec<redis::Connection>>,
    /// The effect of a plain event: the built-in statement, which its
    /// `handle` runs too. Handing it out through `sql_effect` puts the
    /// one-round-trip transactions under every fault of the run.
    sql: SqlHandler,
    /// The effect of every other plain event in batch mode: the same row,
    /// through a statement of the handler's own, which taskhub runs for a
    /// whole batch in one call (`SqlHandler::handle_batch`); so the calls
    /// that undo a failed statement are under every fault too.
    custom: SqlHandler,
}

/// The statement of [`Chaos::custom`]: the built-in statement's effect,
/// written another way.
const CUSTOM_SQL: &str = "INSERT INTO notifications (event_id, payload) SELECT $1, $2::text";

impl Chaos {
    /// Counts a call of `event` in Redis (outside the transaction, so a
    /// rollback does not undo it) and returns the count. Per stream: each
    /// deployment counts its own calls.
    fn count_call(&self, event: &Event) -> Result<u64, HandlerError> {
        let pooled = self.conns.lock().unwrap().pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => self
                .redis
                .get_connection_with_timeout(Duration::from_secs(2))?,
        };
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let n: u64 = redis::cmd("INCR")
            .arg(format!(
                "chaos:calls:{}:{}",
                event.stream(),
                event.event_id()
            ))
            .query(&mut conn)?;
        self.conns.lock().unwrap().push(conn);
        Ok(n)
    }
}

impl Handler for Chaos {
    fn handle(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        let payload = event.payload().unwrap_or("");
        let value: serde_json::Value = serde_json::from_str(payload)
            .map_err(|e| HandlerError::invalid(format!("payload is not JSON: {e}")))?;
        let kind = value["kind"].as_str().unwrap_or("plain");
        let id = event.event_id();
        // The effect comes first, so every failure below has something to
        // roll back.
        let insert =
            tx.prepare_cached("INSERT INTO notifications (event_id, payload) VALUES ($1, $2)")?;
        tx.execute(&insert, &[&id, &payload])?;
        match kind {
            "transient" => {
                let k = value["k"].as_u64().unwrap_or(1);
                let n = self.count_call(event)?;
                if n <= k {
                    let e = HandlerError::retryable(format!("chaos: transient failure {n} of {k}"));
                    return Err(if n % 2 == 0 {
                        e.with_retry_after(Duration::from_millis(300))
                    } else {
                        e
                    });
                }
            }
            "permanent" => {
                // SQLSTATE 23514 (check_violation): permanent.
                tx.execute(
                    "INSERT INTO chaos_rejects (event_id, amount) VALUES ($1, -1)",
                    &[&id],
                )?;
            }
            "panic" => panic!("chaos: {id} panics on every call"),
            "slow" => {
                // Fails slowly, then asks for a wait: its retries outlast
                // the other instances' --reclaim-min-idle.
                let k = value["k"].as_u64().unwrap_or(1);
                let n = self.count_call(event)?;
                if n <= k {
                    std::thread::sleep(Duration::from_millis(1500));
                    return Err(
                        HandlerError::retryable(format!("chaos: slow failure {n} of {k}"))
                            .with_retry_after(Duration::from_secs(1)),
                    );
                }
            }
            "killer" => {
                // The statement kills its own session, on every call.
                tx.batch_execute("SELECT pg_terminate_backend(pg_backend_pid())")?;
            }
            "panic-once" if self.count_call(event)? == 1 => {
                panic!("chaos: {id} panics on its first call")
            }
            "abort" => {
                eprintln!("chaos-abort: {id}");
                std::process::abort();
            }
            _ => {}
        }
        Ok(())
    }

    /// The plain events whose effect is [`CUSTOM_SQL`] go to that
    /// handler's batch form together (their failures named by their place
    /// in `events`), the others to `handle`, one by one.
    fn handle_batch(&self, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        let custom: Vec<usize> = (0..events.len())
            .filter(|i| {
                self.sql_effect(events[*i])
                    .is_some_and(|s| std::ptr::eq(s, &self.custom))
            })
            .collect();
        let batch: Vec<&Event> = custom.iter().map(|i| events[*i]).collect();
        self.custom
            .handle_batch(&batch, tx)
            .map_err(|e| match e.event_index() {
                Some(k) if k < custom.len() => e.for_event(custom[k]),
                _ => e,
            })?;
        for (i, event) in events.iter().enumerate() {
            if !custom.contains(&i) {
                self.handle(event, tx).map_err(|e| e.for_event(i))?;
            }
        }
        Ok(())
    }

    /// A plain event's whole effect is the built-in statement (see
    /// `handle`): taskhub may run it in one round trip. Every other one
    /// (by its id's last byte) has [`CUSTOM_SQL`] instead.
    fn sql_effect(&self, event: &Event) -> Option<&SqlHandler> {
        let value: serde_json::Value = serde_json::from_str(event.payload()?).ok()?;
        let special = [
            "transient",
            "permanent",
            "panic",
            "slow",
            "killer",
            "panic-once",
            "abort",
        ];
        let kind = value["kind"].as_str().unwrap_or("plain");
        if special.contains(&kind) {
            return None;
        }
        match event.event_id().bytes().last().unwrap_or(0) % 2 {
            0 => Some(&self.sql),
            _ => Some(&self.custom),
        }
    }

    fn name(&self) -> &str {
        "chaos"
    }
}

fn work(redis_url: &str, db_url: &str, a: &WorkArgs) -> Res<()> {
    let handler = Chaos {
        redis: redis::Client::open(redis_url)?,
        conns: std::sync::Mutex::new(Vec::new()),
        sql: SqlHandler::default(),
        custom: SqlHandler::new(CUSTOM_SQL),
    };
    let worker = Worker::builder()
        .redis_url(redis_url)
        .database_url(db_url)
        .stream(&a.stream)
        .group(&a.group)
        .consumer(&a.consumer)
        .workers(a.workers)
        .count(a.count)
        .block(Duration::from_millis(a.block_ms))
        .mode(a.mode)
        .max_attempts(a.max_attempts)
        .backoff_base(a.backoff_base)
        .backoff_cap(a.backoff_cap)
        .max_retry_after(a.max_retry_after)
        .reclaim_interval(a.reclaim_interval)
        .reclaim_min_idle(a.reclaim_min_idle)
        .shutdown_timeout(a.shutdown_timeout)
        .max_entry_bytes(a.max_entry_bytes)
        .build(handler)?;
    let stop = worker.shutdown_handle();
    ctrlc::set_handler(move || stop.shutdown())?;
    let summary = worker.run()?;
    println!("{summary}");
    Ok(())
}

// ---------------------------------------------------------------------------
// settle

/// `(pending, last-delivered-id)` of the group and the stream's last id.
fn group_state(
    conn: &mut redis::Connection,
    stream: &str,
    group: &str,
) -> Res<(u64, String, String)> {
    let groups: Vec<HashMap<String, redis::Value>> =
        redis::cmd("XINFO").arg("GROUPS").arg(stream).query(conn)?;
    let g = groups
        .into_iter()
        .find(
            |g| matches!(g.get("name"), Some(redis::Value::BulkString(n)) if n == group.as_bytes()),
        )
        .ok_or("group not found")?;
    let pending = match g.get("pending") {
        Some(redis::Value::Int(n)) => *n as u64,
        other => return Err(format!("pending: {other:?}").into()),
    };
    let delivered = match g.get("last-delivered-id") {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        other => return Err(format!("last-delivered-id: {other:?}").into()),
    };
    let info: HashMap<String, redis::Value> =
        redis::cmd("XINFO").arg("STREAM").arg(stream).query(conn)?;
    let last = match info.get("last-generated-id") {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        other => return Err(format!("last-generated-id: {other:?}").into()),
    };
    Ok((pending, delivered, last))
}

fn settle(url: &str, a: &SettleArgs) -> Res<()> {
    let deadline = Instant::now() + a.timeout;
    let mut quiet = 0;
    let mut last_report = Instant::now();
    loop {
        let state = redis_conn(url)
            .map_err(|e| e.into())
            .and_then(|mut c| group_state(&mut c, &a.stream, &a.group));
        match &state {
            Ok((0, delivered, last)) if delivered == last => quiet += 1,
            _ => quiet = 0,
        }
        if quiet >= 3 {
            return Ok(());
        }
        if last_report.elapsed() > Duration::from_secs(10) {
            eprintln!("chaos settle: {state:?}");
            last_report = Instant::now();
        }
        if Instant::now() > deadline {
            return Err(format!("not settled within {:?}: {state:?}", a.timeout).into());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

// ---------------------------------------------------------------------------
// check

struct Manifest {
    chaos_id: String,
    entry_id: String,
    kind: String,
    event_id: Option<String>,
    expect: String,
    reason: String,
    fields: Vec<(Vec<u8>, Vec<u8>)>,
}

fn read_manifest(path: &std::path::Path) -> Res<Vec<Manifest>> {
    let file = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut out = Vec::new();
    for line in file.lines() {
        let v: serde_json::Value = serde_json::from_str(&line?)?;
        let s = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
        let fields = v["fields"]
            .as_array()
            .ok_or("fields")?
            .iter()
            .map(|pair| {
                Ok((
                    unhex(pair[0].as_str().ok_or("name")?)?,
                    unhex(pair[1].as_str().ok_or("value")?)?,
                ))
            })
            .collect::<Res<Vec<_>>>()?;
        out.push(Manifest {
            chaos_id: s("chaos_id"),
            entry_id: s("entry_id"),
            kind: s("kind"),
            event_id: v["event_id"].as_str().map(str::to_owned),
            expect: s("expect"),
            reason: s("reason"),
            fields,
        });
    }
    Ok(out)
}

/// The checks, as SQL over `chaos_expected`, `chaos_dlq`, `notifications`
/// and `processed_events`: (name, counts as, query returning offending rows).
///
/// Entries deleted by the run's XTRIMs (`chaos_expected.trimmed`) were all
/// delivered before (the cut is at a pending entry): each has its expected
/// outcome, or, if it was still pending, a `trimmed` dead letter instead,
/// never both. One still pending when an XGROUP DESTROY wiped the pending
/// list (`gone`) may have no outcome at all: nothing records that it ever
/// existed. An effect belongs to the entry whose payload it holds.
const CHECKS: &[(&str, &str, &str)] = &[
    (
        "applied events without an effect",
        "lost",
        // Lost unless every entry of the event that should apply was
        // trimmed while pending (and has its trimmed letter, or is gone).
        "SELECT DISTINCT e.event_id FROM chaos_expected e
         WHERE e.expect = 'apply'
           AND NOT EXISTS (SELECT 1 FROM notifications n WHERE n.event_id = e.event_id)
           AND NOT EXISTS (SELECT 1 FROM chaos_dlq d WHERE d.event_id = e.event_id AND d.excused)
           AND EXISTS (SELECT 1 FROM chaos_expected o
                       WHERE o.event_id = e.event_id AND o.expect = 'apply' AND NOT o.gone
                         AND NOT (o.trimmed AND EXISTS (SELECT 1 FROM chaos_dlq d
                                  WHERE d.original_id = o.entry_id AND d.kind = 'trimmed')))",
    ),
    (
        "events with more than one effect",
        "duplicated",
        "SELECT event_id || ' x' || count(*) FROM notifications GROUP BY event_id HAVING count(*) > 1",
    ),
    (
        "entries to dead-letter missing from the DLQ",
        "lost",
        "SELECT e.chaos_id FROM chaos_expected e
         WHERE e.expect <> 'apply' AND NOT e.gone
           AND NOT EXISTS (SELECT 1 FROM chaos_dlq d WHERE d.original_id = e.entry_id)",
    ),
    (
        "entries dead-lettered more than once",
        "duplicated",
        "SELECT original_id || ' x' || count(*) FROM chaos_dlq GROUP BY original_id HAVING count(*) > 1",
    ),
    (
        "dead letters of entries that should apply",
        "wrong",
        "SELECT d.original_id || ' ' || d.kind || ': ' || d.reason FROM chaos_dlq d
         LEFT JOIN chaos_expected e ON e.entry_id = d.original_id
         WHERE e.entry_id IS NULL
            OR (e.expect = 'apply' AND NOT (e.trimmed AND d.kind = 'trimmed') AND NOT d.excused)",
    ),
    (
        "attempts charged to a run whose consumer neither crashed nor lost the entry",
        "wrong",
        // A dead letter's history names each run that started and never
        // finished: its consumer must have died of a signal after the run
        // started, or said it lost the entry (taken over while it ran).
        "SELECT original_id || ': ' || run FROM chaos_runs WHERE NOT proven",
    ),
    (
        "dead letters of the wrong kind or without the expected reason",
        "wrong",
        // An always-panicking event whose process is killed while it waits
        // for its retries can also end as a crash loop: its failures in the
        // dead process are not known to the next one.
        "SELECT e.chaos_id || ' ' || e.kind || ' -> ' || d.kind || ': ' || d.reason
         FROM chaos_dlq d JOIN chaos_expected e ON e.entry_id = d.original_id
         WHERE e.expect <> 'apply'
           AND CASE WHEN d.kind = 'trimmed' AND e.trimmed THEN false
                    WHEN d.kind = e.expect THEN strpos(d.reason, e.reason) = 0 OR d.reason = ''
                    WHEN e.kind = 'panic' AND d.kind = 'crash_loop' THEN d.reason = ''
                    ELSE true END",
    ),
    (
        "dead letters without the original fields and full payload",
        "wrong",
        // A trimmed letter holds what was known of a deleted entry.
        "SELECT d.original_id FROM chaos_dlq d WHERE NOT d.fields_intact AND d.kind <> 'trimmed'",
    ),
    (
        "exhausted dead letters without max-attempts attempts",
        "wrong",
        "SELECT d.original_id || ' attempts=' || d.attempts FROM chaos_dlq d
         WHERE d.kind = 'exhausted' AND d.attempts <> $1",
    ),
    (
        "events both dead-lettered and applied",
        "wrong",
        // A trimmed letter speaks for its entry alone: the event may have
        // been applied by another entry of it (a resent one).
        "SELECT DISTINCT d.event_id FROM chaos_dlq d
         WHERE (EXISTS (SELECT 1 FROM notifications n WHERE n.event_id = d.event_id)
                OR EXISTS (SELECT 1 FROM processed_events p WHERE p.event_id = d.event_id))
           AND NOT (d.kind = 'trimmed'
                    AND (SELECT count(*) FROM chaos_expected e WHERE e.event_id = d.event_id) > 1)",
    ),
    (
        "entries both dead-lettered and applied",
        "wrong",
        // Including a trimmed entry committed and then deleted before its
        // ack (a crash or an outage between COMMIT and XACK): its claimer
        // reads its event id back from the in-flight ids and finds it in
        // processed_events.
        "SELECT d.original_id || ' ' || d.kind FROM chaos_dlq d
         JOIN chaos_expected e ON e.entry_id = d.original_id
         JOIN chaos_effects n ON n.chaos_id = e.chaos_id",
    ),
    (
        "effects of events that should have none",
        "wrong",
        "SELECT DISTINCT n.event_id FROM notifications n
         WHERE NOT EXISTS (SELECT 1 FROM chaos_expected e
                           WHERE e.event_id = n.event_id AND e.expect = 'apply')",
    ),
    (
        "effects without their processed_events row",
        "wrong",
        "SELECT DISTINCT n.event_id FROM notifications n
         WHERE NOT EXISTS (SELECT 1 FROM processed_events p WHERE p.event_id = n.event_id)",
    ),
];

fn check(redis_url: &str, db_url: &str, a: &CheckArgs) -> Res<()> {
    let manifest = read_manifest(&a.manifest)?;
    // Entries below the highest MINID were deleted by an XTRIM.
    let minid = match &a.trims {
        Some(path) if path.exists() => std::fs::read_to_string(path)?.lines().map(id_key).max(),
        _ => None,
    };
    let trimmed = |entry_id: &str| minid.is_some_and(|m| id_key(entry_id) < m);
    // Pending when a destroy wiped the pending list: if trimmed too, gone.
    let destroyed: std::collections::HashSet<String> = match &a.destroyed {
        Some(path) if path.exists() => std::fs::read_to_string(path)?
            .lines()
            .map(str::to_owned)
            .collect(),
        _ => Default::default(),
    };
    let gone = |entry_id: &str| trimmed(entry_id) && destroyed.contains(entry_id);
    let trimmed_entries = manifest.iter().filter(|m| trimmed(&m.entry_id)).count() as u64;
    let by_entry: HashMap<&str, &Manifest> =
        manifest.iter().map(|m| (m.entry_id.as_str(), m)).collect();
    let mut conn = redis_conn(redis_url)?;
    let (pending, delivered, last) = group_state(&mut conn, &a.stream, &a.group)?;
    let xlen: u64 = redis::cmd("XLEN").arg(&a.stream).query(&mut conn)?;
    let dlq: Vec<(String, taskhub::Fields)> = redis::cmd("XRANGE")
        .arg(taskhub::dlq::dead_letter_stream(&a.stream))
        .arg("-")
        .arg("+")
        .query(&mut conn)?;

    let mut db = postgres::Client::connect(db_url, postgres::NoTls)?;
    db.batch_execute(
        "DROP TABLE IF EXISTS chaos_expected, chaos_dlq, chaos_effects;
         CREATE TABLE chaos_expected (chaos_id text PRIMARY KEY, entry_id text UNIQUE NOT NULL,
             kind text NOT NULL, event_id text, expect text NOT NULL, reason text NOT NULL,
             trimmed bool NOT NULL, gone bool NOT NULL);
         CREATE TABLE chaos_dlq (dlq_id text PRIMARY KEY, original_id text NOT NULL,
             event_id text, kind text NOT NULL, reason text NOT NULL, attempts int NOT NULL,
             fields_intact bool NOT NULL, excused bool NOT NULL);
         DROP TABLE IF EXISTS chaos_runs;
         CREATE TABLE chaos_runs (original_id text NOT NULL, run text NOT NULL,
             proven bool NOT NULL);",
    )?;
    let mut tx = db.transaction()?;
    let ins = tx.prepare("INSERT INTO chaos_expected VALUES ($1, $2, $3, $4, $5, $6, $7, $8)")?;
    for m in &manifest {
        tx.execute(
            &ins,
            &[
                &m.chaos_id,
                &m.entry_id,
                &m.kind,
                &m.event_id,
                &m.expect,
                &m.reason,
                &trimmed(&m.entry_id),
                &gone(&m.entry_id),
            ],
        )?;
    }
    let ins = tx.prepare("INSERT INTO chaos_dlq VALUES ($1, $2, $3, $4, $5, $6, $7, $8)")?;
    let ins_run = tx.prepare("INSERT INTO chaos_runs VALUES ($1, $2, $3)")?;
    let evidence = match &a.run_dir {
        Some(dir) => Evidence::read(dir, &a.stream)?,
        None => Evidence::default(),
    };
    let mut undecodable = Vec::new();
    for (id, fields) in &dlq {
        let letter = match taskhub::DeadLetter::from_fields(Some(id.clone()), fields) {
            Ok(l) => l,
            Err(e) => {
                undecodable.push(format!("{id}: {e}"));
                continue;
            }
        };
        // Every original field, byte for byte, the full payload included;
        // for an entry over the size limit, the name and first 256 bytes of
        // each of its first 64 fields.
        let intact = by_entry.get(letter.original_id.as_str()).is_some_and(|m| {
            if m.kind != "invalid-too-big" {
                return m.fields == letter.fields;
            }
            let cut = |b: &[u8]| b[..b.len().min(256)].to_vec();
            let want: Vec<(Vec<u8>, Vec<u8>)> = m
                .fields
                .iter()
                .take(64)
                .map(|(k, v)| (cut(k), cut(v)))
                .collect();
            want == letter.fields
        });
        // The runs its history charges as crashes, each with its evidence:
        // a crash of its consumer before that consumer's next attempt (or
        // the letter), or that consumer saying it lost the entry. (Runs of
        // two consumers may overlap: one claims an entry queued behind
        // another's run past the min-idle.)
        let consumer_of = |a: &taskhub::dlq::Attempt| {
            match a.error.strip_prefix(UNFINISHED_RUN) {
                Some(run) => run.split(" (delivery ").next().map(str::to_owned),
                // This process's own failures: the letter's consumer's.
                None if a.at.is_some() => Some(letter.consumer.clone()),
                None => None,
            }
        };
        let mut unnamed = 0;
        let mut runs = Vec::new();
        for (i, attempt) in letter.history.iter().enumerate() {
            if attempt.error.starts_with("delivered but never finished") {
                unnamed += 1;
            } else if let Some(run) = attempt.error.strip_prefix(UNFINISHED_RUN) {
                let consumer = run.split(" (delivery ").next().unwrap_or_default();
                let at = attempt.at.map(unix_ms);
                let until = letter.history[i + 1..]
                    .iter()
                    .filter(|later| consumer_of(later).as_deref() == Some(consumer))
                    .find_map(|later| later.at.map(unix_ms))
                    .unwrap_or(letter.dead_at as i64);
                let proven =
                    at.is_some_and(|at| evidence.proves(consumer, at, until, &letter.original_id));
                tx.execute(
                    &ins_run,
                    &[
                        &letter.original_id,
                        &format!("{consumer} at {at:?}"),
                        &proven,
                    ],
                )?;
                runs.push(proven);
            }
        }
        // An event that should apply, dead-lettered as exhausted because
        // crashes took the attempts its own failures left: at most the one
        // unnamed charge of its first deliveries, and every named one
        // proven (a crash of that consumer, or its run taken over).
        let failures = letter.history.len() - unnamed - runs.len();
        let charged = unnamed + runs.len();
        let k = by_entry
            .get(letter.original_id.as_str())
            .and_then(|m| m.fields.iter().find(|(n, _)| n == b"payload"))
            .and_then(|(_, v)| serde_json::from_slice::<serde_json::Value>(v).ok())
            .and_then(|v| v["k"].as_u64())
            .unwrap_or(0) as usize;
        // (`panic-once` fails once, whatever its k.)
        let k = match by_entry.get(letter.original_id.as_str()) {
            Some(m) if m.kind == "panic-once" => k.max(1),
            _ => k,
        };
        let excused = letter.kind == taskhub::dlq::Kind::Exhausted
            && charged > 0
            && runs.iter().all(|p| *p)
            && unnamed <= 1
            && failures <= k;
        tx.execute(
            &ins,
            &[
                id,
                &letter.original_id,
                &letter.event_id,
                &letter.kind.as_str(),
                &letter.reason,
                &(letter.attempts as i32),
                &intact,
                &excused,
            ],
        )?;
    }
    tx.commit()?;
    // Which entry made each effect (its payload names it), indexed: the
    // checks below ask per entry.
    db.batch_execute(
        "DROP TABLE IF EXISTS chaos_effects;
         CREATE TABLE chaos_effects AS
             SELECT DISTINCT payload::jsonb ->> 'id' AS chaos_id FROM notifications;
         CREATE INDEX ON chaos_effects (chaos_id);
         CREATE INDEX ON chaos_expected (event_id);
         CREATE INDEX ON chaos_dlq (original_id);
         ANALYZE chaos_effects, chaos_expected, chaos_dlq;",
    )?;

    let mut lost = 0u64;
    let mut duplicated = 0u64;
    let mut wrong = 0u64;
    let mut report = Vec::new();
    for (name, class, sql) in CHECKS {
        let rows = if sql.contains("$1") {
            db.query(*sql, &[&(a.max_attempts as i32)])?
        } else {
            db.query(*sql, &[])?
        };
        let n = rows.len() as u64;
        match *class {
            "lost" => lost += n,
            "duplicated" => duplicated += n,
            _ => wrong += n,
        }
        if n > 0 {
            let examples: Vec<String> =
                rows.iter().take(5).map(|r| r.get::<_, String>(0)).collect();
            report.push(format!("VIOLATION {name}: {n}, e.g. {examples:?}"));
        }
    }
    if !undecodable.is_empty() {
        wrong += undecodable.len() as u64;
        report.push(format!(
            "VIOLATION undecodable dead letters: {undecodable:?}"
        ));
    }
    if pending != 0 || delivered != last {
        wrong += 1;
        report.push(format!(
            "VIOLATION group not drained: pending={pending} last-delivered={delivered} last={last}"
        ));
    }
    let left = manifest.len() as u64 - trimmed_entries;
    if xlen != left {
        lost += left.saturating_sub(xlen);
        report.push(format!(
            "VIOLATION the stream has {xlen} entries, {} were produced and {trimmed_entries} trimmed",
            manifest.len()
        ));
    }

    fn count(db: &mut postgres::Client, sql: &str) -> Res<i64> {
        Ok(db.query_one(sql, &[])?.get(0))
    }
    // Gone entries without any outcome (no letter, and no effect of theirs).
    let gone_silent = count(
        &mut db,
        "SELECT count(*) FROM chaos_expected e WHERE e.gone
           AND NOT EXISTS (SELECT 1 FROM chaos_dlq d WHERE d.original_id = e.entry_id)
           AND NOT EXISTS (SELECT 1 FROM chaos_effects n WHERE n.chaos_id = e.chaos_id)",
    )?;
    let applied = count(
        &mut db,
        "SELECT count(DISTINCT event_id) FROM notifications",
    )?;
    // Events that should apply, but not those whose every entry that should
    // apply was trimmed while pending (with its trimmed letter) or gone, and
    // not applied by itself before.
    let expected_applied = count(
        &mut db,
        "SELECT count(DISTINCT e.event_id) FROM chaos_expected e
         WHERE e.expect = 'apply'
           AND NOT EXISTS (SELECT 1 FROM chaos_dlq d WHERE d.event_id = e.event_id AND d.excused)
           AND EXISTS (SELECT 1 FROM chaos_expected o
                       WHERE o.event_id = e.event_id AND o.expect = 'apply'
                         AND (EXISTS (SELECT 1 FROM chaos_effects n
                                      WHERE n.chaos_id = o.chaos_id)
                              OR NOT (o.gone OR (o.trimmed AND EXISTS (SELECT 1 FROM chaos_dlq d
                                  WHERE d.original_id = o.entry_id AND d.kind = 'trimmed')))))",
    )?;
    let trimmed_after_applied = count(
        &mut db,
        "SELECT count(*) FROM chaos_dlq d
         JOIN chaos_expected e ON e.entry_id = d.original_id
         WHERE d.kind = 'trimmed' AND e.trimmed
           AND EXISTS (SELECT 1 FROM chaos_effects n WHERE n.chaos_id = e.chaos_id)",
    )?;
    let by_kind: Vec<(String, i64)> = db
        .query(
            "SELECT kind, count(*) FROM chaos_dlq GROUP BY kind ORDER BY kind",
            &[],
        )?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // Entries to dead-letter (not gone ones without a letter), plus the
    // trimmed letters of entries that should have applied.
    let expected_dead = count(
        &mut db,
        "SELECT count(*) FROM chaos_expected e
         WHERE (e.expect <> 'apply' AND (NOT e.gone
                OR EXISTS (SELECT 1 FROM chaos_dlq d WHERE d.original_id = e.entry_id)))
            OR (e.expect = 'apply' AND e.trimmed
                AND EXISTS (SELECT 1 FROM chaos_dlq d
                            WHERE d.original_id = e.entry_id AND d.kind = 'trimmed'))
            OR EXISTS (SELECT 1 FROM chaos_dlq d WHERE d.original_id = e.entry_id AND d.excused)",
    )?;
    let excused = count(&mut db, "SELECT count(*) FROM chaos_dlq WHERE excused")?;
    let runs = count(&mut db, "SELECT count(*) FROM chaos_runs")?;
    let kinds: Vec<(String, i64)> = db
        .query(
            "SELECT split_part(kind, ':', 1), count(*) FROM chaos_expected GROUP BY 1 ORDER BY 1",
            &[],
        )?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let kinds_text: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let dead_text: Vec<String> = by_kind.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let rows: Vec<(&str, String)> = vec![
        ("mode", a.mode.clone()),
        ("events (stream entries)", manifest.len().to_string()),
        ("  by kind", kinds_text.join(", ")),
        ("SIGKILLs of workers (restarted)", a.kills.to_string()),
        ("crash-loop aborts (restarted)", a.abort_deaths.to_string()),
        ("workers killed for good", a.killed_for_good.to_string()),
        (
            "  entries they held / reclaimed by others",
            format!("{} / {}", a.orphaned, a.reclaimed),
        ),
        (
            "Redis restarts (SIGKILL, AOF)",
            a.redis_restarts.to_string(),
        ),
        ("PostgreSQL restarts (immediate)", a.pg_restarts.to_string()),
        (
            "entries trimmed (XTRIM, all delivered before)",
            trimmed_entries.to_string(),
        ),
        (
            "  of which pending at a group destroy, no outcome",
            gone_silent.to_string(),
        ),
        (
            "  trimmed letters beside their effect (must be 0)",
            trimmed_after_applied.to_string(),
        ),
        (
            "applied (event_ids with an effect)",
            format!("{applied} (expected {expected_applied})"),
        ),
        (
            "dead-lettered",
            format!(
                "{} (expected {expected_dead}): {}",
                dlq.len(),
                dead_text.join(", ")
            ),
        ),
        (
            "  exhausted by proven crashes, though they should apply",
            excused.to_string(),
        ),
        ("runs charged as crashes in dead letters", runs.to_string()),
        ("pending at the end", pending.to_string()),
        ("lost (must be 0)", lost.to_string()),
        ("duplicated (must be 0)", duplicated.to_string()),
        ("other violations (must be 0)", wrong.to_string()),
        ("elapsed", format!("{:.1} s", a.elapsed)),
    ];
    // The script's own figures go after the faults above.
    let extra: Vec<(String, String)> = a
        .figures
        .iter()
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let at = rows
        .iter()
        .position(|(k, _)| k.starts_with("applied"))
        .unwrap_or(rows.len());
    let mut rows: Vec<(&str, String)> = rows;
    for (i, (k, v)) in extra.iter().enumerate() {
        rows.insert(at + i, (k.as_str(), v.clone()));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!("{}", "-".repeat(width + 40));
    for (k, v) in &rows {
        println!("{k:<width$}  {v}");
    }
    println!("{}", "-".repeat(width + 40));
    for line in &report {
        println!("{line}");
    }
    if lost + duplicated + wrong > 0 {
        return Err(
            format!("{lost} lost, {duplicated} duplicated, {wrong} other violations").into(),
        );
    }
    println!("chaos check: OK");
    Ok(())
}

// ---------------------------------------------------------------------------
// proxy

/// Runs one fault proxy per route until killed. For each route `<name>` it
/// writes the port it listens on to `<dir>/<name>.port`, and polls
/// `<dir>/<name>.cmd` (written whole, then renamed into place) for one
/// command: `pass`, `delay <ms>`, `freeze`, `drop`, `reset`, `refuse on`,
/// `refuse off`. It logs each command it obeys.
fn run_proxy(a: &ProxyArgs) -> Res<()> {
    let mut proxies = Vec::new();
    for route in &a.routes {
        let (name, target) = route.split_once('=').ok_or("--route name=host:port")?;
        let p = proxy::Proxy::start(target.parse()?);
        let tmp = a.dir.join(format!("{name}.port.tmp"));
        std::fs::write(&tmp, p.port().to_string())?;
        std::fs::rename(&tmp, a.dir.join(format!("{name}.port")))?;
        proxies.push((name.to_owned(), p));
    }
    loop {
        for (name, p) in &proxies {
            let path = a.dir.join(format!("{name}.cmd"));
            let Ok(cmd) = std::fs::read_to_string(&path) else {
                continue;
            };
            std::fs::remove_file(&path)?;
            let words: Vec<&str> = cmd.split_whitespace().collect();
            match words.as_slice() {
                ["pass"] => p.pass(),
                ["delay", ms] => p.delay(Duration::from_millis(ms.parse()?)),
                ["freeze"] => p.freeze(),
                ["drop"] => p.drop_all(),
                ["reset"] => p.reset_all(),
                ["refuse", on] => p.refuse(*on == "on"),
                _ => {
                    eprintln!("chaos proxy {name}: unknown command {cmd:?}");
                    continue;
                }
            }
            eprintln!(
                "chaos proxy {name}: {} ({} connections open)",
                cmd.trim(),
                p.connections()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------
// trim

/// XTRIM MINID just past a pending entry, in one step: every entry it
/// deletes is at or below a pending one, so it was delivered (the group
/// delivers in id order), acked or pending; none is lost unseen. The cut is
/// past the last of the first 100 pending entries that has been idle for a
/// second (one waiting for a retry, or held by a stalled process: the cases
/// that end as `trimmed` dead letters), else past the n-th.
/// Returns `{minid, deleted}`, or `{}` when nothing is pending.
const TRIM: &str = r"
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 100)
if #p == 0 then return {} end
local cut = math.min(#p, tonumber(ARGV[2]))
for i = 1, #p do
    if p[i][3] >= 1000 then cut = math.max(cut, i) end
end
local last = p[cut][1]
local dash = string.find(last, '-')
local minid = string.sub(last, 1, dash) .. tostring(tonumber(string.sub(last, dash + 1)) + 1)
local n = redis.call('XTRIM', KEYS[1], 'MINID', minid)
return {minid, n}
";

fn trim(url: &str, a: &TrimArgs) -> Res<()> {
    let mut conn = redis_conn(url)?;
    // Waits (a little) for a moment when something is pending.
    let mut reply: Vec<redis::Value> = Vec::new();
    for _ in 0..100 {
        reply = redis::cmd("EVAL")
            .arg(TRIM)
            .arg(1)
            .arg(&a.stream)
            .arg(&a.group)
            .arg(a.pending)
            .query(&mut conn)?;
        if !reply.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (minid, deleted) = match reply.as_slice() {
        [redis::Value::BulkString(id), redis::Value::Int(n)] => {
            (String::from_utf8_lossy(id).into_owned(), *n)
        }
        _ => {
            println!("0 nothing pending");
            return Ok(());
        }
    };
    let mut record = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&a.record)?;
    writeln!(record, "{minid}")?;
    println!("{deleted} {minid}");
    Ok(())
}

/// XGROUP DESTROY, in one step with the list of what was pending then:
/// an entry deleted from the stream (XTRIM) and still pending at the
/// destroy is gone with no trace; no consumer can ever learn of it, so it
/// can have no outcome.
const DESTROY: &str = r"
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000000)
redis.call('XGROUP', 'DESTROY', KEYS[1], ARGV[1])
local ids = {}
for i = 1, #p do ids[i] = p[i][1] end
return ids
";

fn destroy(url: &str, a: &DestroyArgs) -> Res<()> {
    let mut conn = redis_conn(url)?;
    let ids: Vec<String> = redis::cmd("EVAL")
        .arg(DESTROY)
        .arg(1)
        .arg(&a.stream)
        .arg(&a.group)
        .query(&mut conn)?;
    let mut record = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&a.record)?;
    for id in &ids {
        writeln!(record, "{id}")?;
    }
    println!("{} pending", ids.len());
    Ok(())
}

fn unix_ms(at: std::time::SystemTime) -> i64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// What the run's directory says of each consumer: when its processes
/// exited and how, and when it said it lost an entry.
#[derive(Default)]
struct Evidence {
    /// Consumer -> (unix ms, exit status) of each exit, in order.
    exits: HashMap<String, Vec<(i64, i32)>>,
    /// (consumer, entry id) -> when its log said the entry was taken from
    /// it (unix ms).
    lost: HashMap<(String, String), Vec<i64>>,
}

impl Evidence {
    /// Reads `run/exits.<i>` ("status unix-ms" per exit of consumer `c<i>`)
    /// and `w<i>.log` (the worker's log, at info level) for each `i`.
    fn read(dir: &std::path::Path, stream: &str) -> Res<Evidence> {
        let mut evidence = Evidence::default();
        for i in 1.. {
            let exits = dir.join(format!("run/exits.{i}"));
            let log = dir.join(format!("w{i}.log"));
            if !exits.exists() && !log.exists() {
                break;
            }
            let consumer = format!("c{i}");
            if let Ok(text) = std::fs::read_to_string(&exits) {
                let list = text
                    .lines()
                    .filter_map(|l| {
                        let (rc, at) = l.split_once(' ')?;
                        Some((at.parse().ok()?, rc.parse().ok()?))
                    })
                    .collect();
                evidence.exits.insert(consumer.clone(), list);
            }
            let Ok(text) = std::fs::read(&log) else {
                continue;
            };
            // What a worker says when an entry is taken from it (its run,
            // its retry or its dead letter: see `fail.rs`, `retry.rs`,
            // `dead_letter.rs`), or left pending unsure; or when its run
            // ended in a letter another consumer had written meanwhile (a
            // run that kept losing its session, claimed while it waited).
            let lost = [
                "taken over by another consumer",
                "no longer pending for this consumer",
                "the entry is no longer this consumer's",
                "cannot tell yet whether it was applied",
                "dead-lettered before",
            ];
            let prefix = format!(" {stream}/");
            for line in String::from_utf8_lossy(&text).lines() {
                if !lost.iter().any(|l| line.contains(l)) {
                    continue;
                }
                // "[2026-12-07T17:50:56.593Z INFO  taskhub::...] <stream>/<entry>: ..."
                let at = line
                    .get(1..25)
                    .and_then(|t| humantime::parse_rfc3339(t).ok())
                    .map(unix_ms);
                let entry = line
                    .split(&prefix)
                    .nth(1)
                    .and_then(|rest| rest.split_once(':'))
                    .map(|(entry, _)| entry.to_owned());
                if let (Some(at), Some(entry)) = (at, entry) {
                    evidence
                        .lost
                        .entry((consumer.clone(), entry))
                        .or_default()
                        .push(at);
                }
            }
        }
        Ok(evidence)
    }

    /// Whether the run of `entry` that `consumer` started at `at` (unix ms)
    /// never finished for a reason seen: that consumer's process died of a
    /// signal (SIGKILL, an abort) between `at` and `until` (its next
    /// attempt, or the dead letter), not in a graceful stop; or it said,
    /// after `at`, that the entry was taken from it.
    fn proves(&self, consumer: &str, at: i64, until: i64, entry: &str) -> bool {
        let crashed = self
            .exits
            .get(consumer)
            .and_then(|exits| exits.iter().find(|(t, _)| *t >= at))
            .is_some_and(|(t, rc)| *t <= until && *rc >= 128);
        let lost = self
            .lost
            .get(&(consumer.to_owned(), entry.to_owned()))
            .is_some_and(|times| times.iter().any(|t| *t >= at));
        crashed || lost
    }
}

/// `<ms>-<seq>` as a pair, for comparing entry ids.
fn id_key(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}
