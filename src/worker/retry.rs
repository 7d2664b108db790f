//! Retries without head-of-line blocking: the retry thread.
//!
//! A worker that sees a retryable failure does not sleep: it hands the
//! delivery to this thread with the time it is due and goes on with the next
//! event. This thread keeps the waiting retries in a heap, sleeps until the
//! earliest is due (or a new one arrives), then checks that the entry is
//! still this consumer's (another consumer may have claimed it while it
//! waited: then it is the new owner's), resets its idle time, reads it back
//! from the stream and hands it to the worker pool. An entry deleted from
//! the stream meanwhile becomes a `trimmed` dead letter (one that went back
//! without asking, below, is applied from the event it kept, or found
//! deleted by the check before its COMMIT).
//!
//! A retry due within [`STILL_OURS`] of its read (or of its last refresh)
//! skips that round trip: no consumer can claim an entry idle for less than
//! 2 s (the least `--reclaim-min-idle`), so it is still ours, and it kept
//! its fields in memory (up to [`KEPT_BYTES`] of them in all). Held over a
//! second by the time it commits, its ownership is checked then, as for any
//! entry (see `delivery.rs`). Its idle time is not reset, so this is done
//! only where `--reclaim-min-idle` leaves room for one more of the longest
//! waits after it ([`still_ours`]).
//!
//! Any other waiting retry keeps only the entry id and its attempt history,
//! not its fields, and does not count against the readers' in-flight room:
//! thousands of events can wait out a long backoff while healthy events flow
//! at full speed, and memory stays small. The entry stays pending in Redis
//! all along, so a crash loses nothing; at shutdown the waiting retries are
//! left pending and come back on the next start.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};

use crate::dlq::Attempt;
use crate::event::{Event, Fields, Invalid};
use crate::redis::streams::{self, Owned};
use crate::worker::context::{outage_backoff, Claim, Common};
use crate::worker::delivery::{in_parts, Delivery, Job, FRESH, TRIMMED};
use crate::worker::flow::Ticket;
use crate::worker::stats::{Server, Stats};

/// What the retry thread holds.
pub(crate) struct Retrier {
    pub common: Common,
    pub claim: Claim,
    /// Into how many jobs the due retries of one stream are cut (see
    /// `jobs_per_read` in `mod.rs`).
    pub parts: usize,
    /// Where it shows what waits (for the monitor).
    pub board: Arc<Board>,
    /// See [`still_ours`].
    pub still_ours: Duration,
}

/// A delivery waiting for its retry, as a monitor shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retrying {
    /// The stream.
    pub stream: String,
    /// Its entry id.
    pub entry_id: String,
    /// Its event_id.
    pub event_id: Option<String>,
    /// Attempts failed so far.
    pub attempts: u32,
    /// The last attempt's error.
    pub last_error: String,
    /// When it is tried again.
    pub due: SystemTime,
}

/// The waiting retries as last published: how many, and the earliest
/// [`BOARD`] of them by due time.
#[derive(Debug, Default)]
pub(crate) struct Board {
    shown: Mutex<(usize, Vec<Retrying>)>,
}

/// How many waiting retries the board lists.
const BOARD: usize = 100;

impl Board {
    /// How many wait, and the earliest of them.
    pub fn read(&self) -> (usize, Vec<Retrying>) {
        self.shown.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn publish(&self, waiting: &BinaryHeap<Retry>) {
        let (now, clock) = (Instant::now(), SystemTime::now());
        let mut first: Vec<&Retry> = waiting.iter().collect();
        first.sort_by_key(|r| r.due);
        first.truncate(BOARD);
        let list = first
            .into_iter()
            .map(|r| Retrying {
                stream: r.stream.to_string(),
                entry_id: r.entry_id.clone(),
                event_id: r.event_id.clone(),
                attempts: r.failures.len() as u32,
                last_error: r
                    .failures
                    .last()
                    .map(|a| a.error.clone())
                    .unwrap_or_default(),
                due: clock + r.due.saturating_duration_since(now),
            })
            .collect();
        *self.shown.lock().unwrap_or_else(|e| e.into_inner()) = (waiting.len(), list);
    }
}

/// A failed delivery waiting for its retry.
#[derive(Debug)]
pub(crate) struct Retry {
    pub due: Instant,
    /// How soon it may run to join others that are due (see
    /// `Backoff::earliest`).
    pub earliest: Instant,
    pub stream: Arc<str>,
    pub entry_id: String,
    pub event_id: Option<String>,
    pub delivery_count: u64,
    pub token: Option<u64>,
    pub failures: Vec<Attempt>,
    pub unfinished: Vec<Attempt>,
    /// The start its run recorded, if any: the retry of a run that counted
    /// no attempt (it waited for a row held elsewhere) is the same start,
    /// not one more.
    pub started_as: Option<u64>,
    pub strikes: u32,
    /// Its parked place in the in-flight set.
    pub ticket: Option<Ticket>,
    /// When this consumer last read or refreshed the entry.
    pub held_since: Instant,
    /// Its event, while it may go back without asking Redis (see
    /// [`Retrier::still_ours`]).
    pub kept: Option<Box<Kept>>,
}

/// The event of a retry due soon, kept so that it needs no round trip.
#[derive(Debug)]
pub(crate) struct Kept {
    event: Event,
    bytes: usize,
}

/// A retry due this soon after its entry was read or refreshed is still this
/// consumer's: no consumer claims an entry idle for less than 2 s, the least
/// `--reclaim-min-idle` (`held_since` is taken before the command is sent,
/// so Redis's idle time is never longer).
const STILL_OURS: Duration = Duration::from_millis(1500);

/// How long after its entry's read (or refresh) a retry may go back without
/// asking Redis: under [`STILL_OURS`], and soon enough that, should it fail
/// again and wait the longest wait, the entry stays idle for less than
/// `reclaim_min_idle` (a second left for its run), as after a refresh.
pub(crate) fn still_ours(reclaim_min_idle: Duration, longest_wait: Duration) -> Duration {
    reclaim_min_idle
        .saturating_sub(longest_wait + FRESH)
        .min(STILL_OURS)
}

/// Bytes of fields the retries due soon keep in memory, at most (with the
/// events around them, a few thousand small events); past it, a retry
/// reads its fields back.
const KEPT_BYTES: usize = 4 << 20;

impl Retry {
    /// Keeps what a retry needs of `delivery`, its event included; the
    /// retry thread drops the event on receipt unless it may go back
    /// without asking Redis (then its fields are read again when due).
    pub fn of(mut delivery: Delivery, due: Instant, earliest: Instant) -> Retry {
        if let Some(ticket) = &mut delivery.ticket {
            ticket.park();
        }
        let event_id = delivery.event_id().map(str::to_owned);
        let kept = match std::mem::replace(
            &mut delivery.body,
            Err((Vec::new(), Invalid(String::new()))),
        ) {
            Ok(event) if !delivery.trimmed => {
                let bytes = event.fields.size();
                Some(Box::new(Kept { event, bytes }))
            }
            _ => None,
        };
        Retry {
            held_since: delivery.held_since,
            kept,
            due,
            earliest,
            event_id,
            stream: delivery.stream,
            entry_id: delivery.entry_id,
            delivery_count: delivery.delivery_count,
            token: delivery.token,
            failures: delivery.failures,
            unfinished: delivery.unfinished,
            started_as: delivery.started_as,
            strikes: delivery.strikes,
            ticket: delivery.ticket,
        }
    }
}

/// The delivery a retry becomes again, its `bytes` of fields back in the
/// readers' room.
fn back_to_pool(
    mut retry: Retry,
    body: Result<Event, (Fields, Invalid)>,
    bytes: usize,
    held_since: Instant,
    trimmed: bool,
) -> Delivery {
    if let Some(ticket) = &mut retry.ticket {
        ticket.unpark(bytes);
    }
    Delivery {
        stream: retry.stream,
        entry_id: retry.entry_id,
        body,
        delivery_count: retry.delivery_count,
        token: retry.token,
        trimmed,
        held_since,
        failures: retry.failures,
        unfinished: retry.unfinished,
        strikes: retry.strikes,
        started_as: retry.started_as,
        ticket: retry.ticket,
        seen: None,
        plain: false,
        behind: false,
        holder: None,
    }
}

// Ordered by due time, earliest first in the (max-)heap.
impl PartialEq for Retry {
    fn eq(&self, other: &Retry) -> bool {
        self.due == other.due
    }
}
impl Eq for Retry {}
impl PartialOrd for Retry {
    fn partial_cmp(&self, other: &Retry) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Retry {
    fn cmp(&self, other: &Retry) -> Ordering {
        other.due.cmp(&self.due)
    }
}

/// How often the thread looks at the stop flag while idle.
const TICK: Duration = Duration::from_millis(100);
/// Retries read back from Redis in one round trip.
const FETCH: usize = 64;

impl Retrier {
    /// The retry thread.
    pub fn run(self, incoming: &Receiver<Retry>, jobs: &Sender<Job>) {
        let mut waiting: BinaryHeap<Retry> = BinaryHeap::new();
        let mut failures = 0u32;
        // Bytes of the events the waiting retries keep.
        let mut kept_bytes = 0usize;
        let mut published = (0usize, Instant::now());
        while !self.common.shutdown.is_shutdown() {
            let now = Instant::now();
            // The board follows the heap, at most four times a second.
            let changed = waiting.len() != published.0;
            let since = now.saturating_duration_since(published.1);
            if (changed && since >= Duration::from_millis(250)) || since >= Duration::from_secs(1) {
                self.board.publish(&waiting);
                published = (waiting.len(), now);
            }
            let mut due = Vec::new();
            // What is due, and with it what may run a little early, so
            // retries that fell due together share a batch.
            while due.len() < FETCH
                && waiting
                    .peek()
                    .is_some_and(|r| r.due <= now || (!due.is_empty() && r.earliest <= now))
            {
                due.push(waiting.pop().expect("peeked"));
            }
            if !due.is_empty() {
                // Those still ours with their event go back as they are
                // (checked again here: the thread may be late, or Redis was
                // down when they fell due); the others are checked and read
                // back from Redis.
                let (soon, mut ask): (Vec<Retry>, Vec<Retry>) = due
                    .into_iter()
                    .partition(|r| r.kept.is_some() && r.held_since.elapsed() < self.still_ours);
                let mut back: Vec<Delivery> = Vec::with_capacity(soon.len() + ask.len());
                for mut retry in soon {
                    let kept = *retry.kept.take().expect("partitioned");
                    kept_bytes -= kept.bytes;
                    let mut event = kept.event;
                    event.delivery_count = retry.delivery_count;
                    let held_since = retry.held_since;
                    back.push(back_to_pool(
                        retry,
                        Ok(event),
                        kept.bytes,
                        held_since,
                        false,
                    ));
                }
                for retry in &mut ask {
                    if let Some(kept) = retry.kept.take() {
                        kept_bytes -= kept.bytes;
                    }
                }
                if !ask.is_empty() {
                    let sent_at = Instant::now();
                    match self.fetch(&ask) {
                        Ok(owned) => {
                            self.common.health.up(Server::Redis);
                            failures = 0;
                            back.extend(ask.into_iter().zip(owned).filter_map(|(retry, owned)| {
                                self.hand_back(retry, owned, sent_at)
                            }));
                        }
                        Err(e) => {
                            // Redis is down: try these again a little later.
                            self.common.health.down(Server::Redis, &e);
                            failures += 1;
                            let later = Instant::now() + outage_backoff(failures);
                            for mut retry in ask {
                                retry.due = later;
                                waiting.push(retry);
                            }
                        }
                    }
                }
                // The due retries of one stream travel together, so in
                // batch mode they share a (guarded) batch.
                let mut by_stream: Vec<Job> = Vec::new();
                for delivery in back {
                    match by_stream
                        .iter_mut()
                        .find(|j| j[0].stream == delivery.stream)
                    {
                        Some(job) => job.push(delivery),
                        None => by_stream.push(vec![delivery]),
                    }
                }
                for job in by_stream {
                    for part in in_parts(job, self.parts) {
                        self.send(jobs, part);
                    }
                }
                continue;
            }
            let wait = waiting
                .peek()
                .map_or(TICK, |r| r.due.saturating_duration_since(now).min(TICK));
            match incoming.recv_timeout(wait) {
                Ok(mut retry) => {
                    if let Some(kept) = &retry.kept {
                        let soon = retry.due < retry.held_since + self.still_ours;
                        if !soon || kept_bytes + kept.bytes > KEPT_BYTES {
                            retry.kept = None; // read back when due
                        } else {
                            kept_bytes += kept.bytes;
                        }
                    }
                    waiting.push(retry);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) if waiting.is_empty() => break,
                Err(RecvTimeoutError::Disconnected) => std::thread::sleep(wait),
            }
        }
        self.board.publish(&BinaryHeap::new());
        let left = waiting.len() + incoming.len();
        if left > 0 {
            log::info!(
                "retry: {left} deliveries waiting for a retry stay pending until the next start"
            );
        }
        // Dropping them releases their tickets; the entries stay pending.
    }

    /// Checks that each due retry is still this consumer's, refreshes its idle
    /// time and reads its fields back, in one round trip.
    fn fetch(&self, due: &[Retry]) -> redis::RedisResult<Vec<Owned>> {
        let mut conn = self.common.redis_conn()?;
        let held: Vec<streams::Held<'_>> = due
            .iter()
            .map(|retry| streams::Held {
                stream: &retry.stream,
                entry_id: &retry.entry_id,
                count: retry
                    .ticket
                    .as_ref()
                    .and_then(Ticket::token)
                    .or(retry.token)
                    .unwrap_or(0),
            })
            .collect();
        let claim = &self.claim;
        let fields = Some(claim.limits.max_entry_bytes);
        streams::owned(&mut conn, &claim.group, &claim.consumer, &held, fields)
    }

    /// The delivery a due retry becomes, unless it is no longer this
    /// consumer's.
    fn hand_back(&self, mut retry: Retry, owned: Owned, at: Instant) -> Option<Delivery> {
        let mut bytes = 0;
        let (body, trimmed) = match owned {
            Owned::Yes(Some(crate::event::RawEntry {
                fields: Some(fields),
                cut,
                ..
            })) => {
                bytes = fields.size();
                let event = Event::parse(
                    retry.stream.clone(),
                    retry.entry_id.clone(),
                    fields,
                    cut,
                    retry.delivery_count,
                    self.claim.limits,
                );
                (event, false)
            }
            Owned::Lost | Owned::Yes(None) => {
                // Claimed by another consumer while it waited (its wait plus
                // its runs outlasted reclaim_min_idle), or finished by one: the
                // new owner decides its outcome, not us.
                log::info!(
                "{}/{}: no longer pending for this consumer while it waited for a retry (claimed or finished by another consumer, the usual case; or removed from the pending list by XGROUP DELCONSUMER or a deleted stream, which Redis never delivers again); left to whoever holds it",
                retry.stream,
                retry.entry_id
            );
                Stats::add(&self.common.stats.lost_ownership, 1);
                return None;
            }
            Owned::Trimmed { .. } | Owned::Yes(Some(_)) => {
                let known = retry
                    .event_id
                    .take()
                    .map(|id| vec![(b"event_id".to_vec(), id.into_bytes())])
                    .unwrap_or_default();
                (Err((known, Invalid(TRIMMED.into()))), true)
            }
        };
        Some(back_to_pool(retry, body, bytes, at, trimmed))
    }

    /// Sends a job to the workers, waiting while the channel is full;
    /// dropped at shutdown (its entries stay pending).
    fn send(&self, jobs: &Sender<Job>, mut job: Job) {
        loop {
            match jobs.send_timeout(job, TICK) {
                Ok(()) => return,
                Err(SendTimeoutError::Timeout(back)) if !self.common.shutdown.is_shutdown() => {
                    job = back
                }
                // Shutdown: dropping it leaves the entry pending.
                Err(SendTimeoutError::Timeout(_) | SendTimeoutError::Disconnected(_)) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_skips_its_check_only_where_no_wait_can_outlast_min_idle() {
        let s = Duration::from_secs;
        // The defaults (5 min, 30 s cap): the whole window.
        assert_eq!(still_ours(s(300), s(30)), STILL_OURS);
        // 3 s min-idle, 1 s waits: 1 s after the read at most.
        assert_eq!(still_ours(s(3), s(1)), s(1));
        // 2 s min-idle, 1 s waits: never; each retry is checked and
        // refreshed, as before.
        assert_eq!(still_ours(s(2), s(1)), Duration::ZERO);
    }
}
