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
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{bounded, unbounded};

use crate::backoff::Backoff;
use crate::config::{Builder, Config, Mode};
use crate::error::{Error, ErrorKind};
use crate::event::Limits;
use crate::handler::Handler;
use crate::postgres::blockers::Watch;
use crate::postgres::connect;
use crate::postgres::pool::{postgres_pool, PgPool, Setup};
use crate::redis::keys::Namespace;
use crate::redis::pool::{redis_pool, RedisPool};
use crate::redis::streams;
use crate::redis::RedisClient;
use crate::shutdown::Shutdown;

pub(crate) mod ack;
pub(crate) mod apply;
pub(crate) mod context;
pub(crate) mod dead_letter;
pub(crate) mod delivery;
pub(crate) mod fail;
pub(crate) mod flow;
pub(crate) mod gather;
pub(crate) mod monitor;
pub(crate) mod name_check;
pub(crate) mod pool;
pub(crate) mod process;
pub(crate) mod read;
pub(crate) mod reclaim;
pub(crate) mod retry;
pub(crate) mod stats;

use context::{Claim, Common};
use dead_letter::Writer;
use flow::InFlight;
use monitor::{Monitor, PG_ROOM, REDIS_ROOM};
use name_check::NameCheck;
use process::{Settings, Stage};
use read::Reader;
use reclaim::Reclaimer;
use retry::Retrier;
use stats::{Health, Stats, Summary};

/// A configured worker: reads its streams and applies each event exactly once
/// until its [`Shutdown`] fires.
pub struct Worker {
    config: Config,
    handler: Arc<dyn Handler>,
    monitor: Monitor,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The configuration's Debug hides passwords.
        f.debug_struct("Worker")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Builder {
    /// Validates the configuration and returns a worker that runs `handler`.
    /// Nothing is connected yet; [`Worker::run`] does that.
    pub fn build(self, handler: impl Handler) -> Result<Worker, Error> {
        let budget = handler.retry_budget();
        let config = self.validate_for(budget.as_ref().map(|b| b.cap))?;
        if let Some(budget) = budget {
            check_budget(&budget)?;
        }
        Ok(Worker::new(config, Arc::new(handler)))
    }
}

/// A handler's retry budget obeys the worker's rules (its cap against
/// the min-idle: `Builder::validate_for`).
fn check_budget(budget: &crate::handler::RetryBudget) -> Result<(), Error> {
    if budget.max_attempts == 0 {
        return Err(Error::config(
            "the handler's max attempts must be at least 1",
        ));
    }
    if budget.base.is_zero() || budget.cap < budget.base {
        return Err(Error::config(format!(
            "the handler's backoff base must be positive and not above its cap ({:?} > {:?})",
            budget.base, budget.cap
        )));
    }
    Ok(())
}

impl Worker {
    /// Starts configuring a worker.
    pub fn builder() -> Builder {
        Builder::default()
    }

    pub(crate) fn new(config: Config, handler: Arc<dyn Handler>) -> Worker {
        let monitor = Monitor {
            inner: Arc::new(monitor::Inner {
                stats: Arc::new(Stats::new(&config.streams)),
                health: Arc::new(Health::default()),
                flow: InFlight::new(config.max_in_flight(), config.max_in_flight_bytes()),
                shutdown: Shutdown::new(),
                streams: config.streams.clone(),
                group: config.group.clone(),
                consumer: config.consumer.clone(),
                max_entry_bytes: config.max_entry_bytes,
                started: SystemTime::now(),
                thread_died: Mutex::new(None),
                retrying: Arc::default(),
                servers: OnceLock::new(),
                looks: (
                    monitor::Slots::new(monitor::LOOKS),
                    monitor::Slots::new(monitor::LOOKS),
                ),
            }),
        };
        Worker {
            config,
            handler,
            monitor,
        }
    }

    /// A handle that stops [`run`](Worker::run) gracefully from any thread.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.monitor.inner.shutdown.clone()
    }

    /// A read-only view of this worker for what watches it from beside (an
    /// HTTP endpoint, alerts, metrics), valid before, during and after
    /// [`run`](Worker::run).
    pub fn monitor(&self) -> Monitor {
        self.monitor.clone()
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
    ///
    /// It blocks: from async code, call it from `spawn_blocking`. Called on
    /// an async runtime's own thread it still works (its PostgreSQL client
    /// cannot start there, so it runs on a thread of its own), but holds
    /// that thread until it returns.
    pub fn run(self) -> Result<Summary, Error> {
        crate::runtime::off_async(|| self.run_here())
    }

    fn run_here(self) -> Result<Summary, Error> {
        let mut result = self.connect_and_run();
        // A start that a stop and continue interrupted (SIGSTOP then
        // SIGCONT interrupt reads with a timeout: EINTR) is made again,
        // twice at most. Not after a signal that asks for a shutdown, which
        // interrupts them too: it has a second to say so (its handler may
        // run on a thread of its own, as ctrlc's does).
        for _ in 0..2 {
            let Err(e) = &result else { break };
            let start_up = matches!(e.kind(), ErrorKind::Redis | ErrorKind::Postgres);
            if !start_up || !crate::net::interrupted(&e.chain()) {
                break;
            }
            let shutdown = &self.monitor.inner.shutdown;
            if shutdown.sleep(Duration::from_secs(1)) {
                break;
            }
            log::warn!(
                "taskhub: the start was interrupted ({}); starting again",
                e.chain()
            );
            result = self.connect_and_run();
        }
        if result.is_err() {
            // Whatever failed, nothing must keep running in an embedding
            // program after run() returned (threads that did start stop;
            // their entries stay pending).
            self.monitor.inner.shutdown.shutdown();
        }
        result
    }

    fn connect_and_run(&self) -> Result<Summary, Error> {
        let config = &self.config;
        let redis_client = RedisClient::open(&config.redis_url, &config.redis_tls)?;
        if redis_client.is_cluster() {
            crate::redis::check_slots(&config.streams)?;
            log::info!("redis: a Redis Cluster (hash slots checked for every stream)");
        }
        let redis = redis_pool(
            &redis_client,
            &config.redis_url,
            config.workers as u32 + 4 + REDIS_ROOM,
        )?;
        let namespace = Namespace::default();
        let setup = Setup {
            namespace: namespace.clone(),
            statement_timeout: config.handler_timeout,
        };
        let pg = postgres_pool(
            &config.database_url,
            config.workers as u32 + 1 + PG_ROOM,
            setup,
        )?;
        let shutdown = &self.monitor.inner.shutdown;
        match check_schema(&pg, config, self.handler.as_ref(), shutdown) {
            // Stopped while the check waited (for a lock, say): nothing read.
            Err(Checked::Cancelled) => {
                let summary = self.monitor.inner.stats.snapshot();
                log::info!("taskhub: stopped during the start-up check; {summary}");
                return Ok(summary);
            }
            Err(Checked::Failed(e)) => return Err(e),
            Ok(()) => {}
        }
        if wait_while_loading(&redis, shutdown) {
            let summary = self.monitor.inner.stats.snapshot();
            log::info!("taskhub: stopped while Redis loaded its data; {summary}");
            return Ok(summary);
        }
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
                streams::check_keys(&mut conn, stream, &config.group)
                    .map_err(|why| Error::new(ErrorKind::Redis, format!("{stream}: {why}")))?;
            }
        }
        if let Ok(mut conn) = redis.get() {
            warn_if_evicting(&mut conn);
        }
        if config.handler_timeout >= config.reclaim_min_idle {
            log::warn!(
                "taskhub: --handler-timeout {} is not below --reclaim-min-idle {}: a handler run longer than the min-idle loses its entries to another consumer, which runs them again (one effect still, but a run that is always that long never ends); keep the min-idle above the longest run",
                humantime::format_duration(config.handler_timeout),
                humantime::format_duration(config.reclaim_min_idle)
            );
        }
        let _ = self.monitor.inner.servers.set((redis.clone(), pg.clone()));
        log::info!(
            "taskhub: consumer {} of group {} reading {} with {} workers ({})",
            config.consumer,
            config.group,
            config.streams.join(", "),
            config.workers,
            self.handler.name()
        );
        if let Some(identity) = namespace.identity() {
            log::info!(
                "postgres: {identity}; duplicate markers in namespace {}",
                namespace.get()
            );
        }
        let m = &self.monitor.inner;
        let common = Common {
            redis,
            stats: m.stats.clone(),
            health: m.health.clone(),
            shutdown: m.shutdown.clone(),
        };
        let parts = Parts {
            common,
            flow: m.flow.clone(),
            redis_client,
            pg,
            namespace,
        };
        self.start_and_run(parts)
    }
}

/// What the threads are made of, once connected.
struct Parts {
    common: Common,
    flow: InFlight,
    redis_client: RedisClient,
    pg: PgPool,
    namespace: Namespace,
}

/// Checks that the schema is there and lets the handler check its own
/// (`Handler::on_start`). Both take locks on their tables, which another
/// session may hold for long: a watch says who, and cancels on a shutdown.
fn check_schema(
    pg: &PgPool,
    config: &Config,
    handler: &dyn Handler,
    shutdown: &Shutdown,
) -> Result<(), Checked> {
    drop(
        pg.get()
            .map_err(|e| connect::pg_unreachable(&config.database_url, e))?,
    );
    // The handler's start-up check gets a plain session: pooled ones are
    // read-only outside taskhub's transactions, and a handler may create
    // what it needs here.
    let mut conn = connect::postgres(&config.database_url)?;
    let what = format!("the start-up check (of the {} handler)", handler.name());
    let watch = Watch::begin(&mut conn, pg.clone(), shutdown.clone(), what);
    let checked = check_tables(&mut conn, handler, &config.database_url);
    match (checked, watch.end()) {
        (Err(_), true) => Err(Checked::Cancelled),
        (checked, _) => Ok(checked?),
    }
}

/// Why the start-up check did not pass.
enum Checked {
    /// The watch cancelled it for a shutdown.
    Cancelled,
    Failed(Error),
}

impl From<Error> for Checked {
    fn from(e: Error) -> Checked {
        Checked::Failed(e)
    }
}

fn check_tables(
    conn: &mut postgres::Client,
    handler: &dyn Handler,
    database_url: &str,
) -> Result<(), Error> {
    conn.simple_query("SELECT scope, event_id FROM processed_events LIMIT 0")
        .map_err(|e| {
            // Named (host:port/dbname, never the password), so a run
            // against another database than the migrated one shows.
            Error::with_source(
                ErrorKind::Postgres,
                format!(
                    "table processed_events is missing or unreadable in {}; run `taskhub \
                     migrate` on that database first",
                    crate::redact::redact(database_url)
                ),
                e,
            )
        })?;
    handler.on_start(conn).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("{} handler: {e}", handler.name()),
        )
    })?;
    Ok(())
}

/// Warns when Redis may evict keys that are not caches: with an
/// `allkeys-*` policy and a memory limit, a stream or its pending list
/// could vanish under memory pressure (the `volatile-*` policies only evict
/// keys with a TTL: the duplicate markers, which are a cache). Silent when
/// `CONFIG` is not allowed (managed services, ACL users).
fn warn_if_evicting(conn: &mut crate::redis::RedisConn) {
    let config: redis::RedisResult<std::collections::HashMap<String, String>> =
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory*")
            .query(conn);
    let Ok(config) = config else { return };
    let policy = config.get("maxmemory-policy").map_or("", String::as_str);
    let limit = config.get("maxmemory").map_or("0", String::as_str);
    if policy.starts_with("allkeys-") && limit != "0" {
        log::warn!(
            "redis: maxmemory-policy is {policy} with maxmemory {limit}: under memory pressure Redis may evict streams, pending lists and dead letters, and events would be lost; use noeviction (or a volatile-* policy, which only evicts the duplicate markers)"
        );
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(|e| {
            Error::with_source(ErrorKind::Thread, format!("cannot start thread {name}"), e)
        })
}

/// The threads of a running worker, by stage.
struct Threads {
    readers: Vec<JoinHandle<()>>,
    /// One flag per reader: its last read found nothing new.
    idle_flags: Vec<Arc<AtomicBool>>,
    reclaimer: JoinHandle<()>,
    retrier: JoinHandle<()>,
    workers: Vec<JoinHandle<()>>,
    dlq: JoinHandle<()>,
}

impl Worker {
    fn start_and_run(&self, parts: Parts) -> Result<Summary, Error> {
        let common = parts.common.clone();
        let flow = parts.flow.clone();
        let threads = self.start_threads(parts)?;
        let thread_died = self.watch(&common, &flow, &threads);
        self.stop(threads)?;
        let summary = common.stats.snapshot();
        log::info!("taskhub: stopped; {summary}");
        match thread_died {
            Some(name) => Err(Error::new(
                ErrorKind::Thread,
                format!("thread {name} stopped unexpectedly"),
            )),
            None => Ok(summary),
        }
    }

    /// Starts every thread, from the end of the pipeline to its start, so
    /// each stage's consumer exists before its producer.
    fn start_threads(&self, parts: Parts) -> Result<Threads, Error> {
        let config = &self.config;
        let Parts {
            common,
            flow,
            redis_client,
            pg,
            namespace,
        } = parts;
        let claim = Claim {
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            limits: Limits {
                max_event_id_bytes: config.max_event_id_bytes,
                max_entry_bytes: config.max_entry_bytes,
            },
        };
        let (jobs_tx, jobs_rx) = bounded(config.workers);
        let (retry_tx, retry_rx) = unbounded();
        let (dead_tx, dead_rx) = unbounded();

        let dlq = {
            let writer = Writer {
                common: common.clone(),
                flow: flow.clone(),
            };
            spawn("taskhub-dlq".into(), move || {
                dead_letter::writer_thread(writer, &dead_rx)
            })?
        };
        let stage = Arc::new(Stage {
            common: common.clone(),
            flow: flow.clone(),
            pg,
            namespace,
            handler: self.handler.clone(),
            settings: settings(config, self.handler.retry_budget()),
            suspects: Mutex::new(()),
            gathered: Default::default(),
        });
        let namespace = stage.namespace.clone();
        let mut workers = Vec::new();
        for i in 0..config.workers {
            let (s, rx, r, d) = (
                stage.clone(),
                jobs_rx.clone(),
                retry_tx.clone(),
                dead_tx.clone(),
            );
            workers.push(spawn(format!("taskhub-worker-{i}"), move || {
                pool::worker_thread(s, &rx, r, d)
            })?);
        }
        drop((jobs_rx, retry_tx, dead_tx, stage));
        let retrier = {
            let retrier = Retrier {
                common: common.clone(),
                claim: claim.clone(),
                parts: jobs_per_read(config, &*self.handler),
                board: self.monitor.inner.retrying.clone(),
                still_ours: {
                    let backoff = settings(config, self.handler.retry_budget()).backoff;
                    crate::worker::retry::still_ours(
                        config.reclaim_min_idle,
                        backoff.cap.max(backoff.max_retry_after),
                    )
                },
            };
            let tx = jobs_tx.clone();
            spawn("taskhub-retry".into(), move || retrier.run(&retry_rx, &tx))?
        };
        let reclaimer = {
            let reclaimer = Reclaimer {
                common: common.clone(),
                flow: flow.clone(),
                claim: claim.clone(),
                streams: config.streams.iter().map(|s| s.as_str().into()).collect(),
                count: config.count,
                interval: config.reclaim_interval,
                min_idle: config.reclaim_min_idle,
            };
            let tx = jobs_tx.clone();
            spawn("taskhub-reclaim".into(), move || reclaimer.run(&tx))?
        };
        let mut readers = Vec::new();
        let mut idle_flags = Vec::new();
        // This start's token in its consumer records (see `name_check.rs`).
        let token = format!("{:016x}", rand::random::<u64>());
        for (i, stream) in config.streams.iter().enumerate() {
            let idle = Arc::new(AtomicBool::new(false));
            idle_flags.push(idle.clone());
            let reader = Reader {
                common: common.clone(),
                client: redis_client.clone(),
                flow: flow.clone(),
                claim: claim.clone(),
                stream: stream.as_str().into(),
                count: config.count,
                parts: jobs_per_read(config, &*self.handler),
                block: config.block,
                start_id: config.start_id.clone(),
                idle,
                namespace: namespace.clone(),
                scope: config.scope().to_owned(),
                name: NameCheck::new(
                    &token,
                    (&claim.group, stream, &claim.consumer),
                    config.block,
                    claim.limits.max_entry_bytes,
                ),
            };
            let tx = jobs_tx.clone();
            readers.push(spawn(format!("taskhub-reader-{i}"), move || {
                reader.run(&tx)
            })?);
        }
        Ok(Threads {
            readers,
            idle_flags,
            reclaimer,
            retrier,
            workers,
            dlq,
        })
    }

    /// Waits for a shutdown; with `until_idle`, makes one when there is no
    /// work. A thread that stops on its own shuts everything down; its name
    /// is returned.
    fn watch(&self, common: &Common, flow: &InFlight, threads: &Threads) -> Option<String> {
        let config = &self.config;
        let shutdown = &common.shutdown;
        // When `--until-idle` last said what it waits for.
        let mut told: Option<Instant> = None;
        while !shutdown.sleep(Duration::from_millis(100)) {
            if let Some(dead) = threads
                .readers
                .iter()
                .chain(&threads.workers)
                .chain([&threads.dlq, &threads.retrier, &threads.reclaimer])
                .find(|h| h.is_finished())
            {
                let name = dead.thread().name().unwrap_or("?").to_owned();
                log::error!("{name}: thread stopped unexpectedly; shutting down");
                *self
                    .monitor
                    .inner
                    .thread_died
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(name.clone());
                shutdown.shutdown();
                return Some(name);
            }
            if !config.until_idle {
                continue;
            }
            match idle(common, flow, config, &threads.idle_flags) {
                Idle::Yes => {
                    log::info!("taskhub: idle (nothing new, nothing pending); stopping");
                    shutdown.shutdown();
                }
                // Said once a minute: otherwise a wait of minutes (for
                // --reclaim-min-idle) looks like a hang.
                Idle::Pending(n)
                    if told.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) =>
                {
                    told = Some(Instant::now());
                    log::info!(
                        "taskhub: --until-idle waits: nothing new, but {n} entries of group {} are pending (retries waiting here, or another consumer's, which this one takes over once idle for --reclaim-min-idle, {})",
                        config.group,
                        humantime::format_duration(config.reclaim_min_idle)
                    );
                }
                _ => {}
            }
        }
        None
    }

    /// Joins the threads in the pipeline's order, within the shutdown
    /// timeout: readers and the reclaimer stop within one BLOCK period, the
    /// retry thread within its tick; then the jobs channel closes, the
    /// workers drain it and exit, and finally the dead-letter writer drains
    /// and exits.
    fn stop(&self, threads: Threads) -> Result<(), Error> {
        let timeout = self.config.shutdown_timeout;
        let deadline = crate::shutdown::deadline_after(timeout);
        let Threads {
            readers,
            reclaimer,
            retrier,
            workers,
            dlq,
            ..
        } = threads;
        let stages = [readers, vec![reclaimer, retrier], workers, vec![dlq]];
        for stage in stages {
            for handle in stage {
                while !handle.is_finished() {
                    if Instant::now() >= deadline {
                        return Err(Error::new(
                            ErrorKind::ShutdownTimeout,
                            format!(
                                "shutdown did not finish within {timeout:?} ({} still running); entries not finished stay pending, but a thread still running may yet finish what it holds (commit and ack) unless the process ends",
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
        Ok(())
    }
}

/// What the processing stage follows: the configuration, with the
/// handler's own retry budget when it has one.
fn settings(config: &Config, budget: Option<crate::handler::RetryBudget>) -> Settings {
    let (max_attempts, base, cap) = match budget {
        Some(b) => (b.max_attempts, b.base, b.cap),
        None => (config.max_attempts, config.backoff_base, config.backoff_cap),
    };
    Settings {
        mode: config.mode,
        scope: config.scope().to_owned(),
        group: config.group.clone(),
        consumer: config.consumer.clone(),
        max_attempts,
        marker_ttl: config.marker_ttl,
        ack_batch: (config.count / 4).max(1),
        count: config.count,
        handler_timeout: config.handler_timeout,
        reclaim_min_idle: config.reclaim_min_idle,
        fused_timeout: (config.reclaim_min_idle.saturating_sub(delivery::FRESH) / 2)
            .min(config.handler_timeout),
        backoff: Backoff {
            base,
            cap,
            max_retry_after: config.max_retry_after,
        },
    }
}

/// Idle: every reader saw nothing new, nothing is in flight here, and the
/// group has nothing pending on any stream.
/// What `--until-idle` sees.
enum Idle {
    /// Reading, or events in flight (or Redis does not answer).
    No,
    /// Nothing new and nothing in flight, but this many entries of the
    /// group still pending.
    Pending(u64),
    Yes,
}

fn idle(common: &Common, flow: &InFlight, config: &Config, readers: &[Arc<AtomicBool>]) -> Idle {
    if !readers.iter().all(|i| i.load(Ordering::SeqCst)) || flow.len() > 0 {
        return Idle::No;
    }
    let Ok(mut conn) = common.redis_conn() else {
        return Idle::No;
    };
    let mut pending = 0;
    for stream in &config.streams {
        match streams::pending_count(&mut conn, stream, &config.group) {
            Ok(n) => pending += n,
            Err(_) => return Idle::No,
        }
    }
    match pending {
        0 => Idle::Yes,
        n => Idle::Pending(n),
    }
}

/// Into how many jobs a reader cuts each read: one per worker when events
/// are applied one by one, so the events of a read run side by side instead
/// of queueing behind each other in one worker; one batch otherwise.
fn jobs_per_read(config: &Config, handler: &dyn Handler) -> usize {
    if config.mode == Mode::Batch && handler.supports_batches() {
        1
    } else {
        config.workers
    }
}

/// Waits while Redis loads its data: after a restart it answers every
/// command with `LOADING` until it is done (seconds, minutes for a large
/// dataset), which is no reason for a start to fail (it blamed the group
/// it could not create). Said at once, then every 30 s; a shutdown stops
/// the wait (`true`). Any other answer ends it: what follows reports it.
fn wait_while_loading(redis: &RedisPool, shutdown: &Shutdown) -> bool {
    let began = std::time::Instant::now();
    let mut said: Option<std::time::Instant> = None;
    loop {
        let loading = redis.get().is_ok_and(|mut conn| {
            redis::cmd("PING").query::<()>(&mut *conn).is_err_and(|e| {
                e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading)
            })
        });
        if !loading {
            return false;
        }
        if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
            log::warn!(
                "redis: loading its data (LOADING); waiting for it ({}s so far; SIGTERM stops)",
                began.elapsed().as_secs()
            );
            said = Some(std::time::Instant::now());
        }
        if shutdown.sleep(Duration::from_millis(200)) {
            return true;
        }
    }
}
