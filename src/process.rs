//! Step 2 of a message's path: apply each event's effect exactly once, then
//! acknowledge it. This is where the guarantee is made.
//!
//! For a batch of one stream, in this order:
//! 1. invalid entries go to the dead-letter writer;
//! 2. fast path: one pipelined round trip asks Redis for the
//!    `processed:<scope>:<event_id>` markers; a marked event is a duplicate;
//! 3. for every other event, one PostgreSQL transaction: insert
//!    `(scope, event_id)` into `processed_events` with `ON CONFLICT DO
//!    NOTHING`; 0 rows means duplicate; 1 row means run the handler in the
//!    same transaction, then COMMIT;
//! 4. after the commits, one pipelined round trip sets the markers (with a
//!    TTL) and XACKs everything finished.
//!
//! The marker is written only after PostgreSQL committed, so it is a cache of
//! the truth and never a lock: a crash anywhere leaves the entry pending, and
//! its redelivery finds the `processed_events` row. Nothing is acked that was
//! not committed. Failures go to the retry thread or the dead-letter writer.

use crate::redis_conn::RedisConn;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use crossbeam_channel::Sender;

use crate::config::Mode;
use crate::connect::PgConn;
use crate::dead_letter::{self, DeadLetter, Kind};
use crate::delivery::{Attempt, Delivery, Job};
use crate::error::{FailureClass, HandlerError};
use crate::event::Event;
use crate::fault::{self, Point};
use crate::handler::{catch_panic, prepare_cached as prepare, StatementCache, Tx};
use crate::retry::Retry;
use crate::run::Shared;
use crate::stats::{Server, Stats};

const INSERT_PROCESSED: &str =
    "INSERT INTO processed_events (scope, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";
const INSERT_PROCESSED_BATCH: &str = "INSERT INTO processed_events (scope, event_id) \
     SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING RETURNING event_id";

/// Deliveries finished by a batch (to ack), and which need a marker.
#[derive(Default)]
struct Finished {
    deliveries: Vec<Delivery>,
    to_mark: Vec<usize>,
}

impl Finished {
    fn push(&mut self, delivery: Delivery, mark: bool) {
        if mark {
            self.to_mark.push(self.deliveries.len());
        }
        self.deliveries.push(delivery);
    }
}

/// The outcome of applying one event.
enum Applied {
    /// The effect was committed now.
    New,
    /// The effect had been committed before.
    Duplicate,
    /// Delivered more often than attempts are allowed, never applied.
    CrashLoop,
}

/// The state of one worker thread: its PostgreSQL connection with its
/// prepared statements, and the channels to the retry and dead-letter threads.
pub(crate) struct Processor {
    shared: Arc<Shared>,
    pg: Option<PgConn>,
    cache: StatementCache,
    retry: Sender<Retry>,
    dead: Sender<dead_letter::Job>,
    /// Share of batched events whose failure rolled a batch back (moving
    /// average); it sizes the batches.
    failure_rate: f64,
}

/// The marker key of an event.
pub(crate) fn marker_key(scope: &str, event_id: &str) -> String {
    format!("processed:{scope}:{event_id}")
}

impl Processor {
    pub fn new(
        shared: Arc<Shared>,
        retry: Sender<Retry>,
        dead: Sender<dead_letter::Job>,
    ) -> Processor {
        Processor {
            shared,
            pg: None,
            cache: StatementCache::new(),
            retry,
            dead,
            failure_rate: 0.0,
        }
    }

    pub fn retry_sender(&self) -> Sender<Retry> {
        self.retry.clone()
    }

    pub fn dead_sender(&self) -> Sender<dead_letter::Job> {
        self.dead.clone()
    }

    /// Processes one job: entries of one stream.
    pub fn process(&mut self, job: Job) {
        let Some(first) = job.first() else { return };
        let stream = first.stream.clone();
        let mut valid = Vec::with_capacity(job.len());
        for delivery in job {
            match &delivery.body {
                Ok(_) => valid.push(delivery),
                Err((_, why)) => {
                    let reason = why.to_string();
                    self.dead_letter(delivery, Kind::Invalid, reason);
                }
            }
        }
        if valid.is_empty() {
            return;
        }
        // Step 2: the fast path.
        let Some(marked) = self.with_redis(|conn, scope| {
            let mut pipe = conn.pipe();
            for d in &valid {
                pipe.cmd("EXISTS")
                    .arg(marker_key(scope, event(d).event_id()));
            }
            pipe.query::<Vec<bool>>(conn)
        }) else {
            return self.abandon(valid);
        };
        // Step 3: one transaction per batch of first deliveries (batch mode),
        // or per event.
        let mut done = Finished::default();
        let mut one_by_one = Vec::with_capacity(valid.len());
        let mut batch = Vec::new();
        let batch_mode =
            self.shared.config.mode == Mode::Batch && self.shared.handler.supports_batches();
        for (delivery, marked) in valid.into_iter().zip(marked) {
            if marked {
                Stats::add(&self.shared.stats.duplicates, 1);
                log::debug!(
                    "{}/{}: duplicate (marker)",
                    delivery.stream,
                    delivery.entry_id
                );
                done.push(delivery, false);
            } else if batch_mode && delivery.delivery_count <= 1 && delivery.failures.is_empty() {
                // Only first deliveries are batched: whatever comes back
                // (retries, redeliveries after a crash) goes one by one, so a
                // poison event cannot take its batch-mates down with it.
                batch.push(delivery);
            } else {
                one_by_one.push(delivery);
            }
        }
        // A batch that fails on one known event loses that event (it takes
        // the normal failure path) and is tried again without it; a failure
        // that names no event sends the whole batch one by one. Each failure
        // costs a rolled-back transaction, so while failures are frequent the
        // batch is cut into smaller transactions (see `batch_limit`).
        while !batch.is_empty() {
            let limit = self.batch_limit().min(batch.len());
            let mut chunk: Vec<Delivery> = batch.drain(..limit).collect();
            let size = chunk.len();
            let mut failures = 0;
            while chunk.len() > 1 {
                match self.through_outages(|p| p.apply_batch(&chunk)) {
                    None => self.abandon(std::mem::take(&mut chunk)),
                    Some(Ok(new)) => {
                        for (delivery, new) in std::mem::take(&mut chunk).into_iter().zip(new) {
                            let counter = if new {
                                &self.shared.stats.applied
                            } else {
                                &self.shared.stats.duplicates
                            };
                            Stats::add(counter, 1);
                            done.push(delivery, true);
                        }
                    }
                    Some(Err(e)) => {
                        failures += 1;
                        match e.event_index() {
                            Some(i) if i < chunk.len() => {
                                let delivery = chunk.remove(i);
                                self.failed(delivery, e);
                            }
                            _ => {
                                log::debug!(
                                    "{stream}: a batch of {} failed ({e}); applying its events one by one",
                                    chunk.len()
                                );
                                one_by_one.append(&mut chunk);
                            }
                        }
                    }
                }
            }
            one_by_one.append(&mut chunk);
            self.record_batch(size, failures);
        }
        one_by_one.append(&mut batch);
        for delivery in one_by_one {
            self.apply_one(delivery, &mut done);
        }
        // Step 4: markers, then acks.
        self.mark_and_ack(&stream, &done.deliveries, &done.to_mark);
    }

    /// The largest batch worth one transaction now. With a share `p` of
    /// events failing, a batch of `n` is rolled back about `n·p` times, so
    /// batches shrink to about `2/p` events while failures are frequent and
    /// grow back to the full read size when they stop. (Measured with
    /// scripts/bench.sh at p = 0.1: `2/p` drains healthy events faster than
    /// both full batches and `1/(2p)`.)
    fn batch_limit(&self) -> usize {
        if self.failure_rate < 0.005 {
            usize::MAX
        } else {
            ((2.0 / self.failure_rate) as usize).clamp(2, 1024)
        }
    }

    /// Updates the failure rate (a moving average) after a batch of `size`
    /// events saw `failures` failed transactions.
    fn record_batch(&mut self, size: usize, failures: usize) {
        let observed = failures as f64 / size.max(1) as f64;
        self.failure_rate = 0.8 * self.failure_rate + 0.2 * observed;
    }

    /// Step 3 for one event in its own transaction.
    ///
    /// A redelivered entry (not a retry) is a suspect: the process that had
    /// it may have died of it. Suspects are applied one at a time in this
    /// process, so a crash while one runs is charged (by `count_start`) to
    /// that one alone. Run side by side, the events that happened to be in
    /// progress next to a crash-looping event were charged one attempt per
    /// crash and dead-lettered with it (found by scripts/chaos.sh; see
    /// tests/chaos.rs).
    fn apply_one(&mut self, mut delivery: Delivery, done: &mut Finished) {
        let shared = self.shared.clone();
        let _one_suspect_at_a_time = (delivery.delivery_count > 1 && delivery.failures.is_empty())
            .then(|| shared.suspects.lock().unwrap_or_else(|e| e.into_inner()));
        if !self.count_start(&mut delivery) {
            return self.abandon(vec![delivery]);
        }
        match self.through_outages(|p| p.apply(&delivery)) {
            None => self.abandon(vec![delivery]),
            Some(Ok(Applied::New)) => {
                Stats::add(&self.shared.stats.applied, 1);
                done.push(delivery, true);
            }
            Some(Ok(Applied::Duplicate)) => {
                Stats::add(&self.shared.stats.duplicates, 1);
                log::debug!(
                    "{}/{}: duplicate (processed_events)",
                    delivery.stream,
                    delivery.entry_id
                );
                done.push(delivery, true);
            }
            Some(Ok(Applied::CrashLoop)) => {
                let reason = format!(
                    "delivered {} times without finishing (max attempts {}): the event likely crashes its consumer",
                    delivery.delivery_count, self.shared.config.max_attempts
                );
                self.dead_letter(delivery, Kind::CrashLoop, reason);
            }
            Some(Err(e)) => self.failed(delivery, e),
        }
    }

    /// Step 3 for a batch: one set-based insert into `processed_events`
    /// returns which event ids are new, the handler's batch form applies
    /// them, one COMMIT. Returns, per delivery, whether it was new (applied)
    /// or a duplicate. Any error rolls the whole batch back.
    fn apply_batch(&mut self, batch: &[Delivery]) -> Result<Vec<bool>, HandlerError> {
        let scope = self.shared.config.scope().to_owned();
        self.connection()?;
        let (Some(conn), cache) = (self.pg.as_mut(), &mut self.cache) else {
            unreachable!("connection() sets it")
        };
        let insert = prepare(&mut **conn, cache, INSERT_PROCESSED_BATCH)?;
        let mut tx = Tx {
            tx: conn.transaction()?,
            cache,
        };
        let ids: Vec<&str> = batch.iter().map(|d| event(d).event_id()).collect();
        let mut inserted: std::collections::HashSet<String> = tx
            .query(&insert, &[&scope, &ids])?
            .into_iter()
            .map(|row| row.get(0))
            .collect();
        // The first delivery of each inserted id is new; later copies of the
        // same id in this batch are duplicates.
        let new: Vec<bool> = ids.iter().map(|id| inserted.remove(*id)).collect();
        let (positions, events): (Vec<usize>, Vec<&Event>) = batch
            .iter()
            .enumerate()
            .filter(|(i, _)| new[*i])
            .map(|(i, d)| (i, event(d)))
            .unzip();
        if events.is_empty() {
            return Ok(new);
        }
        for e in &events {
            fault::hit(Point::InHandler, e.event_id());
        }
        let started = Instant::now();
        let handled = catch_panic(|| self.shared.handler.handle_batch(&events, &mut tx));
        self.shared.stats.handler_seconds.observe(started.elapsed());
        if let Err(e) = handled {
            if e.is_panic() {
                Stats::add(&self.shared.stats.panics, 1);
            }
            // Name the failing event by its place in `batch`.
            let at = e.event_index().and_then(|i| positions.get(i).copied());
            return Err(match at {
                Some(i) => e.for_event(i),
                None => e.for_no_event(),
            });
        }
        for e in &events {
            fault::hit(Point::BeforeCommit, e.event_id());
        }
        commit(tx)?;
        for e in &events {
            fault::hit(Point::AfterCommit, e.event_id());
            self.committed(e);
        }
        Ok(new)
    }

    /// Counts the start of a redelivered entry's attempt, just before it is
    /// applied, and makes its `delivery_count` the number of deliveries that
    /// actually reached this point (the first one always counts).
    ///
    /// Redis's own delivery count also rises for entries that were delivered
    /// but never started: after each crash, a restart re-reads (or a
    /// reclaimer claims) every pending entry, including those queued behind
    /// the event that crashed the process. Using it for the crash-loop check
    /// dead-lettered those innocent entries along with the poison. First
    /// deliveries (the normal path) cost nothing here; each redelivery costs
    /// one round trip. `false` when a shutdown interrupted a Redis outage.
    fn count_start(&self, delivery: &mut Delivery) -> bool {
        if delivery.delivery_count <= 1 || !delivery.failures.is_empty() {
            return true; // a first delivery, or a retry already counted
        }
        let key = format!(
            "started:{}:{}:{}",
            self.shared.config.group, delivery.stream, delivery.entry_id
        );
        let ttl = self.shared.config.marker_ttl.as_secs().max(1);
        let Some(started) = self.with_redis(|conn, _| {
            let (n,): (u64,) = redis::pipe()
                .cmd("INCR")
                .arg(&key)
                .cmd("EXPIRE")
                .arg(&key)
                .arg(ttl)
                .ignore()
                .query(conn)?;
            Ok(n)
        }) else {
            return false;
        };
        delivery.delivery_count = delivery.delivery_count.min(started.saturating_add(1));
        true
    }

    /// Runs `apply` (one event or a batch), waiting out PostgreSQL outages:
    /// they are not the events' fault, so they count no attempt. `None` when
    /// a shutdown interrupted the wait.
    fn through_outages<T>(
        &mut self,
        mut apply: impl FnMut(&mut Processor) -> Result<T, HandlerError>,
    ) -> Option<Result<T, HandlerError>> {
        let mut outages = 0u32;
        loop {
            match apply(self) {
                Err(e) if e.class() == FailureClass::Outage => {
                    // A fresh connection for the next try; the pool drops
                    // the broken one.
                    self.pg = None;
                    self.shared.health.down(Server::Postgres, &e);
                    outages += 1;
                    if self
                        .shared
                        .shutdown
                        .sleep(self.shared.outage_backoff(outages))
                    {
                        return None;
                    }
                }
                result => {
                    if result.is_ok() {
                        self.shared.health.up(Server::Postgres);
                    }
                    return Some(result);
                }
            }
        }
    }

    fn connection(&mut self) -> Result<&mut PgConn, HandlerError> {
        if self.pg.as_ref().is_some_and(|c| c.is_closed()) {
            self.pg = None;
        }
        if self.pg.is_none() {
            let conn = self
                .shared
                .pg
                .get()
                .map_err(|e| HandlerError::outage(format!("no PostgreSQL connection: {e}")))?;
            self.cache.clear();
            self.pg = Some(conn);
        }
        Ok(self.pg.as_mut().expect("connection was just set"))
    }

    /// Step 3 for one event.
    fn apply(&mut self, delivery: &Delivery) -> Result<Applied, HandlerError> {
        let event = event(delivery);
        let scope = self.shared.config.scope().to_owned();
        let crash_loop = delivery.prior_attempts() >= self.shared.config.max_attempts;
        self.connection()?;
        let (Some(conn), cache) = (self.pg.as_mut(), &mut self.cache) else {
            unreachable!("connection() sets it")
        };
        if crash_loop {
            // Dead-letter it without running the handler again, unless an
            // earlier delivery committed it before crashing. The probe is the
            // dedup insert itself, rolled back: unlike a SELECT, it waits for
            // a slow owner's uncommitted insert of the same key and sees how
            // that ends.
            let insert = prepare(&mut **conn, cache, INSERT_PROCESSED)?;
            let mut probe = conn.transaction()?;
            let done = probe.execute(&insert, &[&scope, &event.event_id()])? == 0;
            probe.rollback()?;
            return Ok(if done {
                Applied::Duplicate
            } else {
                Applied::CrashLoop
            });
        }
        let insert = prepare(&mut **conn, cache, INSERT_PROCESSED)?;
        let mut tx = Tx {
            tx: conn.transaction()?,
            cache,
        };
        if tx.execute(&insert, &[&scope, &event.event_id()])? == 0 {
            return Ok(Applied::Duplicate); // dropping tx rolls back
        }
        fault::hit(Point::InHandler, event.event_id());
        let started = Instant::now();
        let handled = catch_panic(|| self.shared.handler.handle(event, &mut tx));
        self.shared.stats.handler_seconds.observe(started.elapsed());
        log::trace!(
            "{}/{}: handler ran in {:?}",
            delivery.stream,
            delivery.entry_id,
            started.elapsed()
        );
        if let Err(e) = handled {
            if e.is_panic() {
                Stats::add(&self.shared.stats.panics, 1);
            }
            return Err(e);
        }
        fault::hit(Point::BeforeCommit, event.event_id());
        commit(tx)?;
        fault::hit(Point::AfterCommit, event.event_id());
        self.committed(event);
        Ok(Applied::New)
    }

    /// The handler's `committed` hook; a panic in it is logged, not spread
    /// (the event is committed: it must be acked all the same).
    fn committed(&self, event: &Event) {
        let hook = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.shared.handler.committed(event)
        }));
        if hook.is_err() {
            log::error!(
                "{}/{}: the handler's committed hook panicked",
                event.stream(),
                event.entry_id()
            );
        }
    }

    /// Step 4: set markers for `finished[to_mark]`, then XACK all of
    /// `finished`, in one round trip; through Redis outages.
    fn mark_and_ack(&mut self, stream: &str, finished: &[Delivery], to_mark: &[usize]) {
        if finished.is_empty() {
            return;
        }
        let ttl = self.shared.config.marker_ttl.as_secs();
        let group = self.shared.config.group.clone();
        let split = fault::is_armed(Point::AfterMarker);
        let done = self.with_redis(|conn, scope| {
            let mut pipe = conn.pipe();
            for &i in to_mark {
                pipe.cmd("SET")
                    .arg(marker_key(scope, event(&finished[i]).event_id()))
                    .arg(1)
                    .arg("EX")
                    .arg(ttl)
                    .ignore();
            }
            if split {
                // Crash test: Redis applied the markers, then we died.
                pipe.query::<()>(conn)?;
                pipe = conn.pipe();
                for &i in to_mark {
                    fault::hit(Point::AfterMarker, event(&finished[i]).event_id());
                }
            }
            let ids: Vec<&str> = finished.iter().map(|d| d.entry_id.as_str()).collect();
            pipe.cmd("XACK").arg(stream).arg(&group).arg(&ids).ignore();
            match pipe.query::<()>(conn) {
                // Markers are only a cache: if Redis refuses them (out of
                // memory, say), ack without them; PostgreSQL still decides.
                Err(e) if !crate::error::redis_is_outage(&e) => {
                    log::warn!(
                        "{stream}: duplicate markers not written ({e}); acking without them"
                    );
                    crate::streams::ack(conn, stream, &group, &ids)
                }
                result => result,
            }
        });
        if done.is_none() {
            log::warn!("{stream}: shutdown during a Redis outage; {} committed entries stay pending and will be skipped as duplicates", finished.len());
        }
        self.shared
            .in_flight
            .finish_all(stream, finished.iter().map(|d| d.entry_id.as_str()));
    }

    /// Runs `f` with a pooled Redis connection, retrying through outages.
    /// `None` when a shutdown interrupted the wait, or after three failures
    /// that are not an outage.
    fn with_redis<T>(
        &self,
        mut f: impl FnMut(&mut RedisConn, &str) -> redis::RedisResult<T>,
    ) -> Option<T> {
        let mut failures = 0u32;
        loop {
            let result = self
                .shared
                .redis_conn()
                .and_then(|mut conn| f(&mut conn, self.shared.config.scope()));
            match result {
                Ok(value) => {
                    if failures > 0 {
                        self.shared.health.up(Server::Redis);
                    }
                    return Some(value);
                }
                Err(e) => {
                    failures += 1;
                    if crate::error::redis_is_outage(&e) {
                        self.shared.health.down(Server::Redis, &e);
                    } else {
                        // Not an outage (out of memory, a refused command):
                        // a few tries, then leave the entries pending; they
                        // come back by reclaim and PostgreSQL deduplicates.
                        log::error!("redis: {e}");
                        if failures >= 3 {
                            return None;
                        }
                    }
                    if self
                        .shared
                        .shutdown
                        .sleep(self.shared.outage_backoff(failures))
                    {
                        return None;
                    }
                }
            }
        }
    }

    /// A failed attempt: retry later or dead-letter.
    fn failed(&mut self, mut delivery: Delivery, error: HandlerError) {
        let attempt = delivery.attempts() + 1;
        delivery.failures.push(Attempt {
            attempt,
            at: Some(SystemTime::now()),
            error: error.to_string(),
        });
        let config = &self.shared.config;
        let kind = match error.class() {
            FailureClass::Permanent => Some(Kind::Permanent),
            FailureClass::Invalid => Some(Kind::Invalid),
            _ if attempt >= config.max_attempts => Some(Kind::Exhausted),
            _ => None,
        };
        if let Some(kind) = kind {
            return self.dead_letter(delivery, kind, error.to_string());
        }
        let delay = self.shared.backoff.delay(attempt, error.retry_after());
        log::debug!(
            "{}/{}: attempt {attempt} failed ({error}); retrying in {delay:?}",
            delivery.stream,
            delivery.entry_id
        );
        Stats::add(&self.shared.stats.retries, 1);
        let key = delivery.key();
        self.shared.in_flight.park();
        if self
            .retry
            .send(Retry::of(delivery, Instant::now() + delay))
            .is_err()
        {
            // The retry thread is gone (shutdown): leave the entry pending.
            self.shared.in_flight.unpark();
            self.shared.in_flight.finish(&key);
        }
    }

    fn dead_letter(&mut self, delivery: Delivery, kind: Kind, reason: String) {
        let config = &self.shared.config;
        let now = SystemTime::now();
        let history = delivery.history();
        let first_failed = delivery.failures.first().and_then(|a| a.at).unwrap_or(now);
        let letter = DeadLetter {
            id: None,
            original_id: delivery.entry_id.clone(),
            stream: delivery.stream.to_string(),
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            event_id: delivery.event_id().map(str::to_owned),
            kind,
            reason,
            attempts: delivery.attempts(),
            history,
            first_failed_at: dead_letter::millis(first_failed),
            dead_at: dead_letter::millis(now),
            fields: match delivery.body {
                Ok(event) => event.fields,
                Err((fields, _)) => fields,
            },
        };
        let in_flight_key = crate::in_flight::key(&letter.stream, &letter.original_id);
        if self
            .dead
            .send(dead_letter::Job {
                letter,
                in_flight_key: in_flight_key.clone(),
            })
            .is_err()
        {
            log::error!("dead-letter writer is gone; the entry stays pending");
            self.shared.in_flight.finish(&in_flight_key);
        }
    }

    /// Leaves entries pending in Redis (they will be delivered again).
    fn abandon(&self, deliveries: Vec<Delivery>) {
        for d in deliveries {
            self.shared.in_flight.finish(&d.key());
        }
    }
}

/// COMMIT, but never of an aborted transaction. PostgreSQL answers COMMIT in
/// a failed transaction with ROLLBACK and no error, and the client reports
/// success: a handler that swallowed a statement error and returned Ok would
/// have its event acked with nothing written. One cheap statement first
/// fails (25P02) if the transaction is aborted.
fn commit(mut tx: Tx<'_>) -> Result<(), HandlerError> {
    let alive = tx.prepare_cached("SELECT 1")?;
    if let Err(e) = tx.query_one(&alive, &[]) {
        if crate::error::classify_postgres(&e) == FailureClass::Outage {
            return Err(e.into());
        }
        return Err(HandlerError::retryable(format!(
            "a statement of the handler failed and the transaction was aborted, but the handler returned Ok; rolled back ({e})"
        )));
    }
    tx.tx.commit()?;
    Ok(())
}

fn event(delivery: &Delivery) -> &Event {
    delivery
        .body
        .as_ref()
        .expect("only valid deliveries reach this point")
}
