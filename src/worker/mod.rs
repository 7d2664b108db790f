//! This is the main loop: [`Worker::run`] connects, starts every thread, waits
//! for a shutdown, then stops the threads in pipeline order and joins them.
//!
//! ```text
//!  taskhub-reader-N ──┐                         ┌─► ack (process.rs)
//!  taskhub-reclaim ───┼─► bounded channel ─► taskhub-worker-N ─┼─► taskhub-retry ─┐
//!  taskhub-retry ─────┘        (jobs)                          └─► taskhub-dlq    │
//!        ▲                                                                        │
//!        └────────────────────────────────────────────────────────────────────────┘
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded};

use crate::backoff::Backoff;
use crate::config::{Builder, Config};
use crate::error::{Error, ErrorKind};
use crate::event::Limits;
use crate::handler::Handler;
use crate::http::{server as http_server, wire as http_wire};
use crate::postgres::connect;
use crate::postgres::pool::{postgres_pool, PgPool, Setup};
use crate::redis::keys::Namespace;
use crate::redis::pool::{redis_pool, RedisPool};
use crate::redis::streams;
use crate::redis::RedisClient;
use crate::shutdown::Shutdown;
use crate::worker::flow::InFlight;
use crate::worker::stats::{Health, Stats, Summary};

pub(crate) mod ack;
pub(crate) mod alert;
pub(crate) mod apply;
pub(crate) mod dead_letter;
pub(crate) mod delivery;
pub(crate) mod flow;
pub(crate) mod pool;
pub(crate) mod process;
pub(crate) mod read;
pub(crate) mod reclaim;
pub(crate) mod retry;
pub(crate) mod stats;

/// A configured worker: reads its streams and applies each event exactly once
/// until its [`Shutdown`] fires.
pub struct Worker {
    config: Config,
    handler: Arc<dyn Handler>,
    shutdown: Shutdown,
}

/// What every thread shares.
pub(crate) struct Shared {
    pub config: Config,
    pub handler: Arc<dyn Handler>,
    pub redis_client: RedisClient,
    pub redis: RedisPool,
    pub pg: PgPool,
    pub stats: Stats,
    pub health: Health,
    pub in_flight: InFlight,
    /// The duplicate markers' namespace: the database history they speak
    /// for, followed by every new PostgreSQL connection.
    pub namespace: Namespace,
    pub shutdown: Shutdown,
    pub backoff: Backoff,
    pub limits: Limits,
    pub reader_idle: Vec<AtomicBool>,
    /// The name of a thread that stopped unexpectedly, if any.
    pub thread_died: Mutex<Option<String>>,
    /// Held while a redelivered entry (a suspect) is applied: see
    /// `Processor::apply_one`.
    pub suspects: Mutex<()>,
}

impl Shared {
    pub fn dead_thread(&self) -> Option<String> {
        self.thread_died
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn redis_conn(&self) -> redis::RedisResult<crate::redis::pool::PooledRedis> {
        self.redis.get().map_err(|e| {
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("no Redis connection: {e}"),
            ))
        })
    }

    /// Wait before reconnecting after the `n`th consecutive failure.
    pub fn outage_backoff(&self, n: u32) -> Duration {
        const OUTAGE: Backoff = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(5),
            max_retry_after: Duration::ZERO,
        };
        OUTAGE.delay(n, None)
    }
}

impl Worker {
    /// Starts configuring a worker.
    pub fn builder() -> Builder {
        Builder::default()
    }

    pub(crate) fn new(config: Config, handler: Arc<dyn Handler>) -> Worker {
        Worker {
            config,
            handler,
            shutdown: Shutdown::new(),
        }
    }

    /// A handle that stops [`run`](Worker::run) gracefully from any thread.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// The validated configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Connects, runs until the shutdown handle fires (or, with
    /// `until_idle`, until there is nothing left to do), then stops
    /// gracefully: readers stop, workers finish and acknowledge what they
    /// hold, every thread is joined. Returns what was done.
    ///
    /// Fails at once when Redis or PostgreSQL cannot be reached at start-up
    /// or the schema is missing, and with [`ErrorKind::ShutdownTimeout`] when
    /// the threads do not finish within the shutdown deadline (nothing is
    /// acked that was not committed either way).
    pub fn run(self) -> Result<Summary, Error> {
        let config = self.config;
        let webhook = alert::webhook_agent(&config)?;
        let redis_client = RedisClient::open(&config.redis_url, &config.redis_tls)?;
        if redis_client.is_cluster() {
            crate::redis::check_slots(&config.streams)?;
            log::info!("redis: a Redis Cluster (hash slots checked for every stream)");
        }
        let redis = redis_pool(&redis_client, &config.redis_url, config.workers as u32 + 4)?;
        let namespace = Namespace::default();
        let setup = Setup {
            namespace: namespace.clone(),
            statement_timeout: config.handler_timeout,
        };
        let pg = postgres_pool(&config.database_url, config.workers as u32 + 1, setup)?;
        check_schema(&pg, &config, self.handler.as_ref())?;
        {
            let mut conn = redis
                .get()
                .map_err(|e| Error::with_source(ErrorKind::Redis, "no Redis connection", e))?;
            for stream in &config.streams {
                streams::ensure_group(&mut conn, stream, &config.group, &config.start_id).map_err(
                    |e| {
                        Error::with_source(
                            ErrorKind::Redis,
                            format!("{stream}: cannot create group {}", config.group),
                            e,
                        )
                    },
                )?;
            }
        }
        let shared = Arc::new(Shared {
            redis_client,
            redis,
            pg,
            stats: Stats::default(),
            health: Health::default(),
            in_flight: InFlight::new(config.max_in_flight(), config.max_in_flight_bytes()),
            namespace,
            shutdown: self.shutdown.clone(),
            backoff: Backoff {
                base: config.backoff_base,
                cap: config.backoff_cap,
                max_retry_after: config.max_retry_after,
            },
            limits: Limits {
                max_event_id_bytes: config.max_event_id_bytes,
                max_entry_bytes: config.max_entry_bytes,
            },
            reader_idle: config
                .streams
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            thread_died: Mutex::new(None),
            suspects: Mutex::new(()),
            handler: self.handler,
            config,
        });
        log::info!(
            "taskhub: consumer {} of group {} reading {} with {} workers ({})",
            shared.config.consumer,
            shared.config.group,
            shared.config.streams.join(", "),
            shared.config.workers,
            shared.handler.name()
        );
        if let Some(identity) = shared.namespace.identity() {
            log::info!(
                "postgres: {identity}; duplicate markers in namespace {}",
                shared.namespace.get()
            );
        }
        run_threads(&shared, webhook)
    }
}

fn check_schema(pg: &PgPool, config: &Config, handler: &dyn Handler) -> Result<(), Error> {
    drop(
        pg.get()
            .map_err(|e| connect::pg_unreachable(&config.database_url, e))?,
    );
    // The handler's start-up check gets a plain session: pooled ones are
    // read-only outside taskhub's transactions, and a handler may create
    // what it needs here.
    let mut conn = connect::postgres(&config.database_url)?;
    conn.simple_query("SELECT scope, event_id FROM processed_events LIMIT 0")
        .map_err(|e| {
            Error::with_source(
                ErrorKind::Postgres,
                "table processed_events is missing or unreadable; run `taskhub migrate` first",
                e,
            )
        })?;
    handler.on_start(&mut conn).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("{} handler: {e}", handler.name()),
        )
    })?;
    Ok(())
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(|e| {
            Error::with_source(ErrorKind::Thread, format!("cannot start thread {name}"), e)
        })
}

fn run_threads(shared: &Arc<Shared>, webhook: Option<ureq::Agent>) -> Result<Summary, Error> {
    let result = start_and_run(shared, webhook);
    if result.is_err() {
        // A thread that could not start: stop the ones that did (their
        // entries stay pending), so nothing keeps running in an embedding
        // program after run() returned.
        shared.shutdown.shutdown();
    }
    result
}

fn start_and_run(shared: &Arc<Shared>, webhook: Option<ureq::Agent>) -> Result<Summary, Error> {
    let config = &shared.config;
    let http = match &config.http {
        Some(addr) => {
            let listener = http_wire::bind(addr).map_err(|e| {
                Error::with_source(ErrorKind::Config, format!("cannot serve HTTP on {addr}"), e)
            })?;
            log::info!("http: serving /metrics, /healthz, /readyz and /dlq on http://{addr}");
            let s = shared.clone();
            Some(spawn("taskhub-http".into(), move || {
                http_server::http_thread(&s, &listener)
            })?)
        }
        None => None,
    };
    let (jobs_tx, jobs_rx) = bounded(config.workers);
    let (retry_tx, retry_rx) = unbounded();
    let (dead_tx, dead_rx) = unbounded();

    // Started from the end of the pipeline to its start, so each stage's
    // consumer exists before its producer.
    let dlq = {
        let (s, rx) = (shared.clone(), dead_rx);
        spawn("taskhub-dlq".into(), move || {
            dead_letter::writer_thread(&s, &rx)
        })?
    };
    let mut workers = Vec::new();
    for i in 0..config.workers {
        let (s, rx, r, d) = (
            shared.clone(),
            jobs_rx.clone(),
            retry_tx.clone(),
            dead_tx.clone(),
        );
        workers.push(spawn(format!("taskhub-worker-{i}"), move || {
            pool::worker_thread(s, &rx, r, d)
        })?);
    }
    drop((jobs_rx, retry_tx, dead_tx));
    let retrier = {
        let (s, rx, tx) = (shared.clone(), retry_rx, jobs_tx.clone());
        spawn("taskhub-retry".into(), move || {
            retry::retry_thread(&s, &rx, &tx)
        })?
    };
    let reclaimer = {
        let (s, tx) = (shared.clone(), jobs_tx.clone());
        spawn("taskhub-reclaim".into(), move || {
            reclaim::reclaim_thread(&s, &tx)
        })?
    };
    let alerter = {
        let s = shared.clone();
        spawn("taskhub-alert".into(), move || {
            alert::alert_thread(&s, webhook.as_ref())
        })?
    };
    let mut readers = Vec::new();
    for i in 0..config.streams.len() {
        let (s, tx) = (shared.clone(), jobs_tx.clone());
        readers.push(spawn(format!("taskhub-reader-{i}"), move || {
            read::reader_thread(&s, i, &tx)
        })?);
    }
    drop(jobs_tx);

    // Wait for a shutdown; with until_idle, make one when there is no work.
    let mut thread_died = None;
    while !shared.shutdown.sleep(Duration::from_millis(100)) {
        if let Some(dead) = readers
            .iter()
            .chain(&workers)
            .chain([&dlq, &retrier, &reclaimer, &alerter])
            .chain(http.as_ref())
            .find(|h| h.is_finished())
        {
            let name = dead.thread().name().unwrap_or("?").to_owned();
            log::error!("{name}: thread stopped unexpectedly; shutting down");
            *shared.thread_died.lock().unwrap_or_else(|e| e.into_inner()) = Some(name.clone());
            thread_died = Some(name);
            shared.shutdown.shutdown();
            break;
        }
        if config.until_idle && is_idle(shared) {
            log::info!("taskhub: idle (nothing new, nothing pending); stopping");
            shared.shutdown.shutdown();
        }
    }

    // Readers and the reclaimer stop within one BLOCK period, the retry
    // thread within its tick; then the jobs channel closes, the workers drain
    // it and exit, and finally the dead-letter writer drains and exits.
    let deadline = Instant::now() + config.shutdown_timeout;
    let stages = [
        readers,
        vec![reclaimer, retrier, alerter],
        workers,
        vec![dlq],
        http.into_iter().collect(),
    ];
    for stage in stages {
        for handle in stage {
            while !handle.is_finished() {
                if Instant::now() >= deadline {
                    return Err(Error::new(
                        ErrorKind::ShutdownTimeout,
                        format!(
                            "shutdown did not finish within {:?} ({} still running); unfinished entries stay pending",
                            config.shutdown_timeout,
                            handle.thread().name().unwrap_or("a thread")
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let name = handle.thread().name().unwrap_or("?").to_owned();
            if handle.join().is_err() {
                log::error!("{name}: thread panicked");
            }
        }
    }
    let summary = shared.stats.snapshot();
    log::info!("taskhub: stopped; {summary}");
    match thread_died {
        Some(name) => Err(Error::new(
            ErrorKind::Thread,
            format!("thread {name} stopped unexpectedly"),
        )),
        None => Ok(summary),
    }
}

/// Idle: every reader saw nothing new, nothing is in flight here, and the
/// group has nothing pending on any stream.
fn is_idle(shared: &Shared) -> bool {
    if !shared.reader_idle.iter().all(|i| i.load(Ordering::SeqCst)) || shared.in_flight.len() > 0 {
        return false;
    }
    let Ok(mut conn) = shared.redis_conn() else {
        return false;
    };
    shared.config.streams.iter().all(|stream| {
        streams::pending_count(&mut conn, stream, &shared.config.group).is_ok_and(|n| n == 0)
    })
}
