//! Step 2 of a message's path: decide what happens to each entry of a job,
//! and route it: applied (`apply.rs`), then acknowledged (`ack.rs`), or,
//! when it fails, handed to the retry thread or the dead-letter writer
//! (`fail.rs`).
//!
//! For a job (entries of one stream), in this order:
//! 1. invalid and trimmed entries go to the dead-letter writer;
//! 2. fast path, one pipelined round trip: the Redis markers of the events
//!    (a marked event is a duplicate) and the dead-letter index (an entry
//!    dead-lettered before, delivered again because its group was created
//!    again, is only acked);
//! 3. the rest is applied: in batch mode, first deliveries and retries in
//!    one transaction per batch (in a backlog, the handler's own events of
//!    reads that mix them with the built-in statement's are gathered across
//!    reads first, see `gather.rs`), redeliveries one at a time; in
//!    per-event mode, each event in its own transaction;
//! 4. one pipelined round trip sets the markers of what committed and XACKs
//!    everything finished: once the oldest finished entry has waited 50 ms
//!    ([`ACK_HOLD`]: the finished entries of the next jobs join it), or
//!    a quarter of a read is finished, and before going on within a job
//!    once the oldest has waited 250 ms.
//!
//! The marker is written only after PostgreSQL committed, so it is a cache of
//! the truth and never a lock: a crash anywhere leaves the entry pending, and
//! its redelivery finds the `processed_events` row. Nothing is acked that was
//! not committed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use foldhash::HashSetExt;

use crate::backoff::Backoff;
use crate::config::Mode;
use crate::dlq::Kind;
use crate::error::{FailureClass, HandlerError};
use crate::event::{value_in, Event};
use crate::fault::{self, Point};
use crate::handler::StatementCache;
use crate::handler::{catch_panic, Handler};
use crate::postgres::pool::PgConn;
use crate::postgres::pool::PgPool;
use crate::postgres::Answer;
use crate::redis::keys::Namespace;
use crate::worker::apply::{Applied, Batch, Ended, Session};
use crate::worker::context::Common;
use crate::worker::dead_letter;
use crate::worker::delivery::{Delivery, Job, TRIMMED};
use crate::worker::flow::InFlight;
use crate::worker::gather::Gathered;
use crate::worker::retry::Retry;
use crate::worker::stats::Stats;

/// Deliveries finished by a job (to ack), and which need a marker.
#[derive(Default)]
pub(crate) struct Finished {
    pub deliveries: Vec<Delivery>,
    pub to_mark: Vec<usize>,
    /// When the oldest of them finished.
    since: Option<Instant>,
}

/// A job acks what it finished before going on once the oldest has waited
/// this long. Acks held for the whole job made a finished entry wait for
/// every slower one behind it; idle past another instance's
/// `reclaim_min_idle` it was claimed, and if it had been deleted from the
/// stream meanwhile, dead-lettered as `trimmed` although applied. Now a
/// finished entry waits at most this plus one transaction.
const ACK_WITHIN: Duration = Duration::from_millis(250);

/// Finished entries wait up to this long after the oldest of them for
/// the next jobs' to join them in one ack round trip, or until a quarter
/// of a read is finished (`Settings::ack_batch`). The worker thread's
/// wait for a job ends when they are due (see `pool.rs`); a job checks
/// them before each transaction, and before it waits out an outage or
/// for its turn to run a suspect, so a job that comes first makes them
/// wait one transaction more at most. Under a steady trickle jobs are one or two
/// events each (a read is cut to run side by side), and an ack round trip
/// per job was most of the round trips to Redis. A finished entry stays
/// pending that much longer; a crash then redelivers it and its marker or
/// `processed_events` says it is a duplicate, as after a crash between
/// COMMIT and XACK.
pub(crate) const ACK_HOLD: Duration = Duration::from_millis(50);

impl Finished {
    fn with_capacity(deliveries: usize) -> Finished {
        Finished {
            deliveries: Vec::with_capacity(deliveries),
            to_mark: Vec::with_capacity(deliveries),
            since: None,
        }
    }

    /// Adds `other`'s deliveries after these.
    fn append(&mut self, other: Finished) {
        let base = self.deliveries.len();
        self.to_mark.extend(other.to_mark.iter().map(|i| i + base));
        self.deliveries.extend(other.deliveries);
        self.since = match (self.since, other.since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    fn push(&mut self, delivery: Delivery, mark: bool) {
        if mark {
            self.to_mark.push(self.deliveries.len());
        }
        self.deliveries.push(delivery);
        self.since.get_or_insert_with(Instant::now);
    }

    /// Whether the oldest has waited [`ACK_WITHIN`].
    fn overdue(&self) -> bool {
        self.since.is_some_and(|t| t.elapsed() >= ACK_WITHIN)
    }
}

/// The state of one worker thread: its PostgreSQL connection with its
/// prepared statements, and the channels to the retry and dead-letter threads.
pub(crate) struct Processor {
    pub(crate) stage: Arc<Stage>,
    pub(crate) pg: Option<PgConn>,
    pub(crate) cache: StatementCache,
    pub(crate) retry: Sender<Retry>,
    pub(crate) dead: Sender<dead_letter::Job>,
    /// Share of batched events whose failure rolled a batch back (moving
    /// average); it sizes the batches.
    failure_rate: f64,
    /// Whether the attempt under way got past the dedup insert, i.e. the
    /// database worked when the event started (see `through_outages`).
    pub(crate) reached_database: bool,
    /// How the connection's session is set up (`None`: as the pool or its
    /// last holder left it).
    pub(crate) session: Option<Session>,
    /// Whether the built-in statement can be fused on this connection's
    /// database (`None`: not checked yet).
    pub(crate) default_folds: Option<bool>,
    /// Whether this connection's session has the function that applies
    /// the events of a rejected batch apart (`sql::APPLY_EACH_FUNCTION`;
    /// `None`: not created yet).
    pub(crate) each_function: Option<bool>,
    /// Whether this connection refused the function that runs the SQL
    /// handler's statement for a whole batch (see `ready_each_statement`
    /// in `apply.rs`).
    pub(crate) each_statement_refused: bool,
    /// How many more batches of the built-in statement go straight to
    /// `sql::APPLY_EACH`: set when one was rejected (see `apply.rs`).
    pub(crate) each_batches: u32,
    /// How many more guarded batches take a savepoint before their
    /// handler runs: set when a handler failed after sending a statement
    /// and no savepoint was there to go back to (see `apply_batch`).
    pub(crate) savepoint_batches: u32,
    /// Finished entries of earlier jobs waiting for their ack round trip
    /// (see [`ACK_HOLD`]), all of one stream.
    held: Option<(Arc<str>, Finished)>,
}

/// What the worker threads share: each holds an `Arc` of it.
pub(crate) struct Stage {
    pub common: Common,
    pub flow: InFlight,
    pub pg: PgPool,
    /// The duplicate markers' namespace, followed by every new PostgreSQL
    /// connection.
    pub namespace: Namespace,
    pub handler: Arc<dyn Handler>,
    pub settings: Settings,
    /// Held while a redelivered entry (a suspect) is applied: see
    /// `Processor::apply_one`.
    pub suspects: Mutex<()>,
    /// The handler's events of a backlog's mixed reads, waiting for their
    /// batch (see `gather.rs`).
    pub gathered: Gathered,
}

/// The settings of the worker threads.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub mode: Mode,
    /// The idempotency scope.
    pub scope: String,
    pub group: String,
    pub consumer: String,
    pub max_attempts: u32,
    pub marker_ttl: Duration,
    /// Finished entries held for one ack round trip are acked at once at
    /// this many (a quarter of a read; see [`ACK_HOLD`]): they keep their
    /// places in flight until then, and holding more slowed the readers
    /// down under a heavy load (at 35,000 events/s, 8 workers holding up to
    /// a read's worth each took half the in-flight room).
    pub ack_batch: usize,
    /// Entries per read: a job of this many came from a backlog, and the
    /// handler's events of a mixed one are gathered up to as many (see
    /// `gather.rs`).
    pub count: usize,
    pub handler_timeout: Duration,
    /// How long an entry may stay idle before another consumer may claim it.
    pub reclaim_min_idle: Duration,
    /// The bound of the fused built-in statement (see `apply.rs`): half the
    /// time between `FRESH` and `reclaim_min_idle`, so that it commits well
    /// before another consumer may claim its entry.
    pub fused_timeout: Duration,
    pub backoff: Backoff,
}

/// How a transaction attempt that may meet outages ended.
pub(crate) enum Flow<T> {
    /// It ran (successfully or not).
    Done(Result<T, HandlerError>),
    /// A shutdown interrupted the wait for a server.
    Stopped,
    /// The connection was lost again and again while it ran, as other
    /// transactions committed: it most likely kills its session.
    Struck,
}

/// At most this many lost connections while a batch ran, others committing
/// meanwhile, before its events are applied one by one.
const BATCH_STRIKES: u32 = 2;

/// Batches run guarded (a savepoint around the handler) while more than
/// this share of batched events failed lately.
const GUARD_ABOVE: f64 = 0.005;

impl Processor {
    pub fn new(
        stage: Arc<Stage>,
        retry: Sender<Retry>,
        dead: Sender<dead_letter::Job>,
    ) -> Processor {
        Processor {
            stage,
            pg: None,
            cache: StatementCache::default(),
            retry,
            dead,
            failure_rate: 0.0,
            reached_database: false,
            session: None,
            default_folds: None,
            each_function: None,
            each_statement_refused: false,
            each_batches: 0,
            savepoint_batches: 0,
            held: None,
        }
    }

    /// When the held finished entries must be acked (`None`: none held).
    pub fn ack_due(&self) -> Option<Instant> {
        let (_, held) = self.held.as_ref()?;
        Some(held.since? + ACK_HOLD)
    }

    /// Marks and acks the held finished entries now.
    pub fn flush_acks(&mut self) {
        if let Some((stream, held)) = self.held.take() {
            self.mark_and_ack(&stream, held);
        }
    }

    /// Acks the held finished entries if they are due (see [`ACK_HOLD`]):
    /// checked before every transaction, so a job does not make them wait
    /// longer than that plus one transaction.
    pub(crate) fn flush_acks_if_due(&mut self) {
        if self.ack_due().is_some_and(|due| due <= Instant::now()) {
            self.flush_acks();
        }
    }

    /// Holds what a job finished for one ack round trip with the next
    /// jobs' (see [`ACK_HOLD`]); acks at once what is due, or
    /// `Settings::ack_batch` entries.
    fn hold(&mut self, stream: &Arc<str>, done: Finished) {
        if done.deliveries.is_empty() {
            return;
        }
        match &mut self.held {
            Some((s, held)) if s == stream => held.append(done),
            _ => {
                self.flush_acks();
                self.held = Some((stream.clone(), done));
            }
        }
        let full = self
            .held
            .as_ref()
            .is_some_and(|(_, h)| h.deliveries.len() >= self.stage.settings.ack_batch);
        if full {
            self.flush_acks();
        } else {
            self.flush_acks_if_due();
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
        let behind = first.behind;
        let mut valid = Vec::with_capacity(job.len());
        let mut trimmed = Vec::new();
        // Each delivery ends here (a `Delivery` is a few hundred bytes:
        // growing the list a push at a time copied them again and again).
        let mut done = Finished::with_capacity(job.len());
        for delivery in job {
            let field = |name: &str| match &delivery.body {
                Ok(event) => event.field(name),
                Err((fields, _)) => value_in(fields, name.as_bytes()),
            };
            if let Some(other) = replayed_for(field, &stream, &self.stage.settings.group) {
                match self.replayed_for_group(&stream, &delivery.entry_id, &other) {
                    // Another group's dead letter put back: that group's
                    // redo, not news for this one (which had the original).
                    Some(true) => {
                        Stats::add(&self.stage.common.stats.of(&stream).duplicates, 1);
                        log::debug!(
                            "{}/{}: replayed for group {}; acked, not applied",
                            delivery.stream,
                            delivery.entry_id,
                            String::from_utf8_lossy(&other)
                        );
                        done.push(delivery, false);
                        continue;
                    }
                    // That group is gone (renamed since the replay, say),
                    // or no replay wrote this tag (a client's fields): the
                    // entry is for every group, as if untagged.
                    Some(false) => {}
                    // Shutdown during a Redis outage: left pending.
                    None => continue,
                }
            }
            match &delivery.body {
                // The handler's own check, a panic caught as one failed
                // attempt of this event: uncaught, it took the whole job
                // down and left it pending, to be read again and panic
                // again, with no letter and no progress (found by a
                // hostile test).
                Ok(event) => match catch_panic(|| self.stage.handler.validate(event)) {
                    Ok(()) => valid.push(delivery),
                    Err(e) if e.is_panic() => {
                        Stats::add(&self.stage.common.stats.panics, 1);
                        self.failed(delivery, e);
                    }
                    Err(e) => match e.class() {
                        FailureClass::Permanent => {
                            self.dead_letter(delivery, Kind::Permanent, e.to_string())
                        }
                        FailureClass::Invalid => {
                            self.dead_letter(delivery, Kind::Invalid, e.to_string())
                        }
                        // A server the check needed was down: again after
                        // a backoff, counting no attempt, as outages go.
                        FailureClass::Outage => self.not_counted(delivery, &e),
                        // Retryable: an attempt that failed, retried after
                        // its backoff.
                        _ => self.failed(delivery, e),
                    },
                },
                Err(_) if delivery.trimmed => trimmed.push(delivery),
                Err((_, why)) => {
                    let reason = why.to_string();
                    self.dead_letter(delivery, Kind::Invalid, reason);
                }
            }
        }
        if !trimmed.is_empty() {
            self.settle_trimmed(&stream, trimmed, &mut done);
        }
        if valid.is_empty() {
            self.hold(&stream, done);
            return;
        }
        // Step 2: the fast path.
        let Some((marked, dead_before)) = self.fast_path(&stream, &valid) else {
            return; // shutdown during a Redis outage: left pending
        };
        // Step 3: one transaction per batch of first deliveries (batch mode),
        // or per event.
        let mut one_by_one = Vec::with_capacity(valid.len());
        let mut batch = Vec::new();
        // How many of the batch are the handler's: the others' whole effect
        // is the built-in statement, which the batch's dedup insert applies
        // (see `apply_batch`), and a batch of those alone is one statement
        // in one round trip.
        let mut handlers = 0;
        let batch_mode =
            self.stage.settings.mode == Mode::Batch && self.stage.handler.supports_batches();
        for ((mut delivery, marked), dead) in valid.into_iter().zip(marked).zip(dead_before) {
            if dead {
                log::info!(
                    "{}/{}: dead-lettered before (its group was created again?); acked, not applied",
                    delivery.stream,
                    delivery.entry_id
                );
                done.push(delivery, false);
            } else if marked {
                self.acked_as_duplicate(delivery, "duplicate (marker)", &mut done);
            } else if batch_mode && (delivery.delivery_count <= 1 || !delivery.failures.is_empty())
            {
                // First deliveries and retries are batched; retries always
                // in a guarded batch (see `apply_batches`), so one that
                // fails again costs a savepoint, not its batch-mates.
                // Redeliveries after a crash go one by one: a poison event
                // must not take its batch-mates down with it.
                delivery.plain =
                    crate::worker::apply::plain(&*self.stage.handler, event(&delivery));
                handlers += usize::from(!delivery.plain);
                batch.push(delivery);
            } else {
                one_by_one.push(delivery);
            }
        }
        // In a backlog, the handler's events of a mixed read wait for the
        // next reads' (see `gather.rs`; batch mode only: in per-event mode
        // nothing is batched, nor gathered).
        let (batch, handlers, gathered) = if batch_mode {
            self.gather(&stream, behind, batch, handlers)
        } else {
            (batch, handlers, None)
        };
        self.apply_and_hold(&stream, (batch, handlers), one_by_one, done);
        if let Some(gathered) = gathered {
            self.apply_gathered(&stream, gathered);
        }
    }

    /// Steps 3 and 4 for what a job holds: `batch` (of which `handlers` are
    /// the handler's events), then `one_by_one`; then the markers and acks
    /// of what finished, with `done`.
    fn apply_and_hold(
        &mut self,
        stream: &Arc<str>,
        (batch, handlers): (Vec<Delivery>, usize),
        mut one_by_one: Vec<Delivery>,
        mut done: Finished,
    ) {
        // Only the handler's events count towards the failure rate that
        // guards its batches.
        let failures = self.apply_batches(stream, batch, &mut one_by_one, &mut done);
        self.record_batch(handlers, failures);
        // A copy of an event after a copy of it that failed here (to a
        // retry or a dead letter) is acked as a duplicate, unmarked (the
        // failed copy's retry must still run): the event is the failed
        // copy's, as in a batch (`apply_batch`).
        let mut failed: HashSet<String> = HashSet::new();
        for delivery in one_by_one {
            self.ack_if_overdue(stream, &mut done);
            if delivery.event_id().is_some_and(|id| failed.contains(id)) {
                let why = "a copy of an event whose earlier copy failed here; acked as a duplicate";
                self.acked_as_duplicate(delivery, why, &mut done);
                continue;
            }
            if let Outcome::Failed(Some(id)) = self.apply_one(delivery, &mut done) {
                failed.insert(id);
            }
        }
        // Step 4: markers, then acks (with the next jobs' finished entries,
        // for a few milliseconds at most).
        self.hold(stream, done);
    }

    /// Where a job's batch goes (see `gather.rs`). A read that came back
    /// full (`behind`) and mixes first deliveries of both kinds keeps its
    /// built-in statement's events, and its handler's events wait with
    /// those of the stream's other reads, unless the read holds copies of
    /// one event (they stay together), or the built-in statement is not
    /// known to be fused here (where it cannot be, the read is one
    /// transaction either way). A short read takes
    /// along what waits for its stream, as much as fits in a read, before
    /// its own. Returns the batch to apply now, how many of it are the
    /// handler's, and a full batch of gathered events to apply after it.
    fn gather(
        &self,
        stream: &Arc<str>,
        behind: bool,
        batch: Vec<Delivery>,
        handlers: usize,
    ) -> (Vec<Delivery>, usize, Option<Vec<Delivery>>) {
        let gathered = &self.stage.gathered;
        let full = self.stage.settings.count;
        // First deliveries, as a read's are (not retries, nor entries
        // claimed from another consumer).
        let first = |d: &Delivery| d.delivery_count <= 1 && d.failures.is_empty();
        if !batch.iter().all(first) {
            return (batch, handlers, None);
        }
        if !behind {
            let mut waiting = gathered.take(stream, full.saturating_sub(batch.len()));
            let taken = waiting.len();
            if taken == 0 {
                return (batch, handlers, None);
            }
            waiting.extend(batch);
            return (waiting, handlers + taken, None);
        }
        if handlers == 0 || handlers == batch.len() || self.default_folds != Some(true) {
            return (batch, handlers, None);
        }
        let mut ids = foldhash::HashSet::with_capacity(batch.len());
        if !batch.iter().all(|d| ids.insert(event(d).event_id())) {
            return (batch, handlers, None);
        }
        // The handler's events out, the rest left in place: no list grows
        // a push at a time (a delivery is a few hundred bytes).
        let mut now = batch;
        let mut wait = Vec::with_capacity(handlers);
        wait.extend(now.extract_if(.., |d| !d.plain));
        // (The crash tests stop here, with these gathered and not applied.)
        let gathering: Vec<String> = if fault::is_armed(Point::Gathered) {
            wait.iter()
                .map(|d| event(d).event_id().to_owned())
                .collect()
        } else {
            Vec::new()
        };
        Stats::add(
            &self.stage.common.stats.of(stream).gathered,
            wait.len() as u64,
        );
        let batch = gathered.add(stream, wait, full);
        for id in &gathering {
            fault::hit(Point::Gathered, id);
        }
        (now, 0, batch)
    }

    /// Applies gathered handler's events of `stream` (see `gather.rs`) in
    /// one batch.
    fn apply_gathered(&mut self, stream: &Arc<str>, deliveries: Vec<Delivery>) {
        let handlers = deliveries.len();
        self.apply_and_hold(
            stream,
            (deliveries, handlers),
            Vec::new(),
            Finished::default(),
        );
    }

    /// Applies the gathered events that waited long enough (see
    /// `gather.rs`), or all of them with `None` (before the thread stops).
    pub fn apply_gathered_due(&mut self, now: Option<Instant>) {
        for (stream, deliveries) in self.stage.gathered.take_due(now) {
            self.apply_gathered(&stream, deliveries);
        }
    }

    /// Counts `delivery` as a duplicate and acks it, without a marker (the
    /// event's marker, if any, is already there or is not this copy's).
    fn acked_as_duplicate(&self, delivery: Delivery, why: &str, done: &mut Finished) {
        Stats::add(&self.stage.common.stats.of(&delivery.stream).duplicates, 1);
        log::debug!("{}/{}: {why}", delivery.stream, delivery.entry_id);
        done.push(delivery, false);
    }

    /// Marks and acks what the job finished so far if the oldest has waited
    /// [`ACK_WITHIN`].
    fn ack_if_overdue(&mut self, stream: &str, done: &mut Finished) {
        if done.overdue() {
            self.mark_and_ack(stream, std::mem::take(done));
        }
        self.flush_acks_if_due();
    }

    /// Entries deleted from the stream before they were acked. Their event
    /// ids are read back from the in-flight ids (the reader wrote them when
    /// it read the entries): an entry whose event
    /// `processed_events` has was applied (its holder died between COMMIT
    /// and XACK, say) and is acked, not dead-lettered; the rest become
    /// `trimmed` dead letters that name their event. Left pending when
    /// Redis or PostgreSQL cannot answer (a shutdown, an outage): they are
    /// claimed again later.
    fn settle_trimmed(&mut self, stream: &str, trimmed: Vec<Delivery>, done: &mut Finished) {
        let ids_key = crate::redis::keys::in_flight_ids(stream, &self.stage.settings.group);
        let entry_ids: Vec<&str> = trimmed.iter().map(|d| d.entry_id.as_str()).collect();
        // Bytes, not text: an entry whose event id is not UTF-8 (invalid,
        // never applied) is recorded as it came, and reading the ids as
        // text failed the whole look-up at every claim, leaving its
        // deleted neighbours pending for ever (found by the chaos run in
        // CI).
        let Some(event_ids) = self.with_redis(|conn| {
            redis::cmd("HMGET")
                .arg(&ids_key)
                .arg(&entry_ids)
                .query::<Vec<Option<Vec<u8>>>>(conn)
        }) else {
            return;
        };
        if event_ids.len() != trimmed.len() {
            log::warn!(
                "{stream}: in-flight ids: a reply out of place; trimmed entries left pending"
            );
            return;
        }
        fn text(id: &Option<Vec<u8>>) -> Option<&str> {
            id.as_deref().and_then(|b| std::str::from_utf8(b).ok())
        }
        let known: Vec<&str> = event_ids.iter().filter_map(text).collect();
        // Its owner's transaction may not have ended yet (a COMMIT held up
        // on the network): waited for, not missed.
        let answers = match self.applied_or_held(&known) {
            Ok(answers) => answers,
            Err(e) => {
                log::warn!(
                    "{stream}: cannot tell whether the events of {} deleted entries were applied ({e}); left to settle later",
                    trimmed.len()
                );
                return;
            }
        };
        let answer_of: std::collections::HashMap<String, Answer> = known
            .iter()
            .map(|id| (*id).to_owned())
            .zip(answers)
            .collect();
        let mut held = Vec::new();
        for (mut delivery, event_id) in trimmed.into_iter().zip(event_ids.iter()) {
            let answer = text(event_id).and_then(|id| answer_of.get(id).copied());
            if answer == Some(Answer::Held) {
                // Left pending for the next reclaim to settle (its ticket
                // goes with it).
                held.push(delivery.entry_id.clone());
                continue;
            }
            match event_id {
                Some(id) if answer == Some(Answer::Processed) => {
                    log::info!(
                        "{}/{}: deleted from the stream after its event {} was applied; acked",
                        delivery.stream,
                        delivery.entry_id,
                        String::from_utf8_lossy(id)
                    );
                    Stats::add(&self.stage.common.stats.of(stream).duplicates, 1);
                    done.push(delivery, false);
                }
                Some(id) => {
                    if delivery.event_id().is_none() {
                        if let Err((known, _)) = &mut delivery.body {
                            known.push((b"event_id".to_vec(), id.clone()));
                        }
                    }
                    self.dead_letter(delivery, Kind::Trimmed, TRIMMED.to_owned());
                }
                None => self.dead_letter(delivery, Kind::Trimmed, TRIMMED.to_owned()),
            }
        }
        if let Some(first) = held.first() {
            log::warn!(
                "{stream}: cannot tell yet whether the events of deleted entries ({first} and {} more) were applied: a transaction holds their keys uncommitted; left to settle later",
                held.len() - 1
            );
        }
    }

    /// [`crate::postgres::processed_or_awaited`] for `event_ids`; when its
    /// connection is lost (the event's own key may be what kills its
    /// session), the plain look-up on a new connection: this worker's own
    /// transactions of those events died with their sessions, so none of
    /// ours is left uncommitted to miss.
    fn applied_or_held(&mut self, event_ids: &[&str]) -> Result<Vec<Answer>, HandlerError> {
        let scope = self.stage.settings.scope.clone();
        self.connection()?;
        let conn = self.pg.as_mut().expect("connection() sets it");
        match crate::postgres::processed_or_awaited(conn, &scope, event_ids) {
            Ok(answers) => Ok(answers),
            Err(e) => {
                log::debug!("postgres: looking events up again after {e}");
                if let Some(mut conn) = self.pg.take() {
                    conn.discard();
                }
                self.connection()?;
                let conn = self.pg.as_mut().expect("connection() sets it");
                let applied = crate::postgres::processed(&mut ***conn, &scope, event_ids)?;
                Ok(event_ids
                    .iter()
                    .map(|id| {
                        if applied.contains(*id) {
                            Answer::Processed
                        } else {
                            Answer::NotProcessed
                        }
                    })
                    .collect())
            }
        }
    }

    /// Which events have a marker, and which entries were dead-lettered
    /// before. What the read script found in the same step as the read is
    /// taken as it is (on one server: see `streams::read_group_bounded`),
    /// unless the marker namespace changed since or the entry waited over
    /// a second; the rest is asked in one pipelined round trip. `None` when
    /// a shutdown interrupted a Redis outage.
    fn fast_path(&self, stream: &str, valid: &[Delivery]) -> Option<(Vec<bool>, Vec<bool>)> {
        let ns = self.stage.namespace.get();
        let mut marked = Vec::with_capacity(valid.len());
        let mut dead = Vec::with_capacity(valid.len());
        let mut ask = Vec::new();
        for (i, d) in valid.iter().enumerate() {
            match &d.seen {
                Some(seen) if *seen.ns == *ns && !d.held_long() => {
                    marked.push(seen.marked);
                    dead.push(seen.dead);
                }
                _ => {
                    marked.push(false);
                    dead.push(false);
                    ask.push(i);
                }
            }
        }
        if ask.is_empty() {
            return Some((marked, dead));
        }
        // The reader recorded the event ids of what it read; entries
        // claimed from other consumers (delivered more than once) are
        // recorded again, in case their first reader could not.
        let ids_key = crate::redis::keys::in_flight_ids(stream, &self.stage.settings.group);
        let pairs: Vec<(&str, &str)> = ask
            .iter()
            .map(|&i| &valid[i])
            .filter(|d| d.delivery_count > 1)
            .map(|d| (d.entry_id.as_str(), event(d).event_id()))
            .collect();
        let scope = &self.stage.settings.scope;
        let keys: Vec<String> = ask
            .iter()
            .map(|&i| crate::redis::keys::marker(&ns, scope, event(&valid[i]).event_id()))
            .collect();
        let entries: Vec<(&str, &str)> = ask
            .iter()
            .map(|&i| (valid[i].entry_id.as_str(), event(&valid[i]).event_id()))
            .collect();
        // A hit counts only when its reply proves it answers its key.
        let seen = self.with_redis(|conn| {
            crate::redis::markers::check(
                conn,
                &keys,
                (stream, &self.stage.settings.group),
                &entries,
                (&ids_key, &pairs),
            )
        })?;
        for (n, &i) in ask.iter().enumerate() {
            marked[i] = seen.marked[n];
            dead[i] = seen.dead[n];
        }
        Some((marked, dead))
    }

    /// A batch that fails on one known event loses that event (it takes the
    /// normal failure path) and the rest goes on without it; a failure of the
    /// built-in statement (which names no event) has each half of the batch
    /// tried apart, down to the failing event alone; another failure that
    /// names no event sends the whole batch one by one. While failures are
    /// frequent, batches run guarded (see `apply_batch`): a failing event
    /// costs a return to a savepoint, not the batch's transaction. Returns
    /// how many of the handler's events failed (see `record_batch`).
    fn apply_batches(
        &mut self,
        stream: &str,
        batch: Vec<Delivery>,
        one_by_one: &mut Vec<Delivery>,
        done: &mut Finished,
    ) -> usize {
        let mut chunk = batch;
        // The second halves of rejected batches still to try, last first.
        let mut halves: Vec<Vec<Delivery>> = Vec::new();
        let mut failures = 0;
        let mut strikes = 0;
        loop {
            // A batch of one goes one by one, but for the one-statement form
            // (every event `apply::plain`), which is as cheap for one event
            // (and asked `sql_effect` already). Then the next half, if any.
            if !(chunk.len() > 1 || (!chunk.is_empty() && chunk.iter().all(|d| d.plain))) {
                one_by_one.append(&mut chunk);
                match halves.pop() {
                    Some(half) => chunk = half,
                    None => break,
                }
                continue;
            }
            self.ack_if_overdue(stream, done);
            let guarded =
                self.failure_rate >= GUARD_ABOVE || chunk.iter().any(|d| !d.failures.is_empty());
            match self.through_outages(&mut strikes, BATCH_STRIKES, |p| {
                p.apply_batch(&chunk, guarded)
            }) {
                Flow::Stopped => {
                    // Left pending, marked as ended without a crash.
                    let left = chunk.iter().chain(halves.iter().flatten());
                    crate::worker::apply::ended_without_crash(&self.stage, left);
                    chunk.clear();
                    halves.clear();
                }
                Flow::Struck => {
                    log::warn!(
                        "{stream}: the database connection was lost {strikes} times while a batch of {} ran; applying its events one by one",
                        chunk.len()
                    );
                    one_by_one.append(&mut chunk);
                    for mut half in halves.drain(..).rev() {
                        one_by_one.append(&mut half);
                    }
                }
                Flow::Done(Ok(Batch::Applied(new, left_out))) => {
                    // (The built-in statement's failures are not the
                    // handler's.)
                    failures += left_out.iter().filter(|(i, _)| !chunk[*i].plain).count();
                    let mut left_out: Vec<(usize, HandlerError)> = left_out;
                    left_out.sort_by_key(|(i, _)| *i);
                    // Another copy of a failed event in this batch is no
                    // duplicate of anything applied: acked without the
                    // marker, which would make the failed copy's retry a
                    // "duplicate" (the failed copy carries the event on).
                    let failed_events: Vec<String> = left_out
                        .iter()
                        .map(|(i, _)| event(&chunk[*i]).event_id().to_owned())
                        .collect();
                    let mut left_out = left_out.into_iter().peekable();
                    for (i, (delivery, new)) in
                        std::mem::take(&mut chunk).into_iter().zip(new).enumerate()
                    {
                        if left_out.peek().is_some_and(|(at, _)| *at == i) {
                            let (_, error) = left_out.next().expect("peeked");
                            self.failed(delivery, error);
                            continue;
                        }
                        let counters = self.stage.common.stats.of(&delivery.stream);
                        let counter = if new {
                            &counters.applied
                        } else {
                            &counters.duplicates
                        };
                        Stats::add(counter, 1);
                        let copy_of_failed = !new
                            && failed_events
                                .iter()
                                .any(|id| id == event(&delivery).event_id());
                        done.push(delivery, !copy_of_failed);
                    }
                }
                Flow::Done(Ok(Batch::Redo(failed))) => {
                    // Rolled back: the failed events take the failure
                    // path, the rest goes again.
                    failures += failed.len();
                    let mut failed = failed;
                    failed.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
                    for (i, error) in failed {
                        let delivery = chunk.remove(i);
                        self.failed(delivery, error);
                    }
                }
                Flow::Done(Ok(Batch::NotOurs(positions))) => {
                    // Rolled back: drop the entries that are no longer
                    // ours, dead-letter the trimmed ones, redo the rest.
                    for (i, applied) in positions.into_iter().rev() {
                        let delivery = chunk.remove(i);
                        self.not_applied(delivery, applied);
                    }
                }
                Flow::Done(Ok(Batch::Ended(outcomes))) => {
                    // The handler's COMMIT committed the new events' rows:
                    // applied as far as the database knows, whatever their
                    // effects. Said with a dead letter each of the
                    // handler's, not acked as duplicates in silence.
                    failures += chunk.len();
                    log::error!(
                        "{stream}: the handler ran COMMIT itself in a batch of {}: its new events are recorded applied with what it wrote before; dead-lettered to say so",
                        chunk.len()
                    );
                    for (delivery, outcome) in std::mem::take(&mut chunk).into_iter().zip(outcomes)
                    {
                        let counters = self.stage.common.stats.of(&delivery.stream);
                        match outcome {
                            Ended::Handlers => {
                                self.failed(delivery, crate::worker::apply::committed_by_handler())
                            }
                            Ended::Applied => {
                                Stats::add(&counters.applied, 1);
                                done.push(delivery, true);
                            }
                            Ended::Duplicate => {
                                Stats::add(&counters.duplicates, 1);
                                done.push(delivery, true);
                            }
                        }
                    }
                }
                Flow::Done(Ok(Batch::Rejected(e))) if chunk.len() == 1 => {
                    // The event the built-in statement failed for.
                    let delivery = chunk.remove(0);
                    self.failed(delivery, e.for_event(0));
                }
                Flow::Done(Ok(Batch::Rejected(e))) => {
                    // The built-in statement failed for some event it does
                    // not name: each half goes on its own, so a failing
                    // event costs its half, and its halves..., down to
                    // itself alone (about 2 log2(n) statements where one
                    // by one took n, and the healthy ones commit together).
                    log::debug!(
                        "{stream}: a batch of {} failed ({e}); trying its halves apart",
                        chunk.len()
                    );
                    halves.push(chunk.split_off(chunk.len() / 2));
                }
                Flow::Done(Err(e)) => {
                    // A failure of the built-in statement's events (a
                    // constraint of `notifications`, say) is not the
                    // handler's.
                    let handlers = match e.event_index() {
                        Some(i) if i < chunk.len() => !chunk[i].plain,
                        _ => chunk.iter().any(|d| !d.plain),
                    };
                    failures += usize::from(handlers);
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
        failures
    }

    /// Updates the failure rate (a moving average) after a batch of `size`
    /// events saw `failures` failed events.
    fn record_batch(&mut self, size: usize, failures: usize) {
        if size == 0 {
            return;
        }
        // (Where the built-in statement cannot be fused, its events are the
        // handler's too and may fail beyond `size`.)
        let observed = (failures as f64 / size as f64).min(1.0);
        self.failure_rate = 0.8 * self.failure_rate + 0.2 * observed;
    }

    /// Step 3 for one event in its own transaction.
    ///
    /// A redelivered entry (not a retry) is a suspect: the process that had
    /// it may have died of it. Suspects are applied one at a time in this
    /// process, so a crash while one runs is charged to that one alone (see
    /// `apply.rs`). Run side by side, the events that happened to be in
    /// progress next to a crash-looping event were charged one attempt per
    /// crash and dead-lettered with it (found by scripts/chaos.sh).
    fn apply_one(&mut self, mut delivery: Delivery, done: &mut Finished) -> Outcome {
        let stage = self.stage.clone();
        let suspect = delivery.delivery_count > 1 && delivery.failures.is_empty();
        if suspect {
            // Its turn may take a while: what earlier jobs finished is
            // acked first.
            self.flush_acks();
        }
        let _one_suspect_at_a_time =
            suspect.then(|| suspect_turn(&stage.suspects, stage.settings.handler_timeout));
        let mut strikes = delivery.strikes;
        let max = self.stage.settings.max_attempts;
        let flow = self.through_outages(&mut strikes, max, |p| p.apply(&mut delivery));
        delivery.strikes = strikes;
        match flow {
            Flow::Stopped => {
                // Dropped: left pending. Stopped while it waited out an
                // outage, its run did not crash the process: the next
                // delivery must not count it.
                crate::worker::apply::ended_without_crash(&self.stage, [&delivery]);
                Outcome::Other
            }
            Flow::Struck => {
                // The sessions lost may have been those of its own commit's
                // reply, or of a duplicate's statement (the one-statement
                // path cannot tell a new event from a duplicate before its
                // reply): an event applied is no crash loop (found by a
                // hostile test: a connection reset at each reply naming the
                // event made an applied event a `crash_loop` letter).
                let event_id = delivery.event_id().unwrap_or_default().to_owned();
                match self.applied_or_held(&[event_id.as_str()]).map(|a| a[0]) {
                    Ok(Answer::Processed) => {
                        log::info!(
                            "{}/{}: the connection was lost {strikes} times while it ran, and it was applied: a duplicate",
                            delivery.stream,
                            delivery.entry_id
                        );
                        Stats::add(&self.stage.common.stats.of(&delivery.stream).duplicates, 1);
                        done.push(delivery, true);
                        Outcome::Other
                    }
                    Ok(Answer::NotProcessed) => {
                        let reason = format!(
                            "the database connection was lost {strikes} times while this event ran, as other events committed (max attempts {max}): the event likely kills its database session"
                        );
                        let id = delivery.event_id().map(str::to_owned);
                        self.dead_letter(delivery, Kind::CrashLoop, reason);
                        Outcome::Failed(id)
                    }
                    held => {
                        // Left pending, reclaimed later: not dead-lettered
                        // on a guess. Its start stays counted (a crash loop
                        // is only said after its dedup insert found it new).
                        let why = match held {
                            Err(e) => e.to_string(),
                            _ => "a transaction holds its key uncommitted".into(),
                        };
                        log::warn!(
                            "{}/{}: cannot tell yet whether it was applied ({why}); left pending",
                            delivery.stream,
                            delivery.entry_id
                        );
                        Outcome::Other
                    }
                }
            }
            Flow::Done(Ok(Applied::New)) => {
                Stats::add(&self.stage.common.stats.of(&delivery.stream).applied, 1);
                done.push(delivery, true);
                Outcome::Other
            }
            Flow::Done(Ok(Applied::Duplicate)) => {
                Stats::add(&self.stage.common.stats.of(&delivery.stream).duplicates, 1);
                log::debug!(
                    "{}/{}: duplicate (processed_events)",
                    delivery.stream,
                    delivery.entry_id
                );
                done.push(delivery, true);
                Outcome::Other
            }
            Flow::Done(Ok(Applied::CrashLoop)) => {
                let reason = format!(
                    "delivered {} times without finishing (max attempts {max}): the event likely crashes its consumer",
                    delivery.delivery_count
                );
                let id = delivery.event_id().map(str::to_owned);
                self.dead_letter(delivery, Kind::CrashLoop, reason);
                Outcome::Failed(id)
            }
            // Trimmed (dead-lettered) or no longer ours: the event is not
            // this copy's to decide.
            Flow::Done(Ok(other)) => {
                self.not_applied(delivery, other);
                Outcome::Other
            }
            Flow::Done(Err(e)) => {
                let id = delivery.event_id().map(str::to_owned);
                self.failed(delivery, e);
                Outcome::Failed(id)
            }
        }
    }
}

/// What became of a delivery applied on its own.
enum Outcome {
    /// Failed here, gone to a retry or a dead letter: its event id.
    Failed(Option<String>),
    /// Applied, a duplicate, left pending, or not ours any more.
    Other,
}

/// Waits for this worker's turn to apply a suspect (a redelivered entry),
/// one at a time in the process; after `patience` (the handler timeout) it
/// goes ahead anyway with a warning, so a hung suspect cannot stall every
/// other redelivery.
fn suspect_turn(lock: &Mutex<()>, patience: Duration) -> Option<MutexGuard<'_, ()>> {
    let deadline = crate::shutdown::deadline_after(patience);
    loop {
        match lock.try_lock() {
            Ok(guard) => return Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() >= deadline => {
                log::warn!(
                    "another redelivered event has run for over {patience:?}; applying this one beside it"
                );
                return None;
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

pub(crate) fn event(delivery: &Delivery) -> &Event {
    delivery
        .body
        .as_ref()
        .expect("only valid deliveries reach this point")
}

/// The group an entry was put back for by `taskhub dlq replay` on `stream`
/// (its `replay_group`, with the `replay_stream` and `replayed_from` every
/// such replay adds), when that is another group than `group`: every group
/// reading the stream receives it, and only the group whose letter it was
/// applies it. An entry copied from another stream with its fields (a
/// bridge, a restore) is no replay of this stream: `None`, as for every
/// other entry.
fn replayed_for<'a>(
    field: impl Fn(&str) -> Option<&'a [u8]>,
    stream: &str,
    group: &str,
) -> Option<Vec<u8>> {
    field("replayed_from")?;
    if field("replay_stream")? != stream.as_bytes() {
        return None;
    }
    field("replay_group")
        .filter(|g| *g != group.as_bytes())
        .map(<[u8]>::to_vec)
}

impl Processor {
    /// Whether entry `entry_id` of `stream` was put back by a replay for
    /// `group` (the replay's own record, `keys::replays`, says so) and that
    /// group still reads the stream: then it is that group's alone. Asked
    /// only for entries tagged for another group (replays); `None` at
    /// shutdown during a Redis outage.
    fn replayed_for_group(&mut self, stream: &str, entry_id: &str, group: &[u8]) -> Option<bool> {
        let key = crate::redis::keys::replays(stream);
        self.with_redis(|conn| {
            let recorded: Option<Vec<u8>> =
                redis::cmd("HGET").arg(&key).arg(entry_id).query(conn)?;
            if recorded.as_deref() != Some(group) {
                return Ok(false);
            }
            let names = crate::redis::streams::group_names(conn, stream)?;
            Ok(names.iter().any(|n| n.as_slice() == group))
        })
    }
}
