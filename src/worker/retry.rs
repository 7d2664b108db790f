//! Retries without head-of-line blocking: the retry thread.
//!
//! A worker that sees a retryable failure does not sleep: it hands the
//! delivery to this thread with the time it is due and goes on with the next
//! event. This thread keeps the waiting retries in a heap, sleeps until the
//! earliest is due (or a new one arrives), then checks that the entry is
//! still this consumer's (another consumer may have claimed it while it
//! waited: then it is the new owner's), resets its idle time, reads it back
//! from the stream and hands it to the worker pool. An entry deleted from
//! the stream meanwhile becomes a `trimmed` dead letter.
//!
//! A waiting retry keeps only the entry id and its attempt history, not its
//! fields, and does not count against the readers' in-flight room: thousands
//! of events can wait out a long backoff while healthy events flow at full
//! speed, and memory stays small. The entry stays pending in Redis all along,
//! so a crash loses nothing; at shutdown the waiting retries are left pending
//! and come back on the next start.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};

use crate::dlq::Attempt;
use crate::event::{Event, Invalid};
use crate::redis::streams::{self, Owned};
use crate::worker::context::{outage_backoff, Claim, Common};
use crate::worker::delivery::{in_parts, Delivery, Job, TRIMMED};
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
    pub strikes: u32,
    /// Its parked place in the in-flight set.
    pub ticket: Option<Ticket>,
}

impl Retry {
    /// Keeps what a retry needs of `delivery`; its fields are read again
    /// from the stream when it is due.
    pub fn of(mut delivery: Delivery, due: Instant, earliest: Instant) -> Retry {
        if let Some(ticket) = &mut delivery.ticket {
            ticket.park();
        }
        Retry {
            due,
            earliest,
            event_id: delivery.event_id().map(str::to_owned),
            stream: delivery.stream,
            entry_id: delivery.entry_id,
            delivery_count: delivery.delivery_count,
            token: delivery.token,
            failures: delivery.failures,
            strikes: delivery.strikes,
            ticket: delivery.ticket,
        }
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
                let sent_at = Instant::now();
                match self.fetch(&due) {
                    Ok(owned) => {
                        self.common.health.up(Server::Redis);
                        failures = 0;
                        // The due retries of one stream travel together,
                        // so in batch mode they share a (guarded) batch.
                        let mut by_stream: Vec<Job> = Vec::new();
                        for (retry, owned) in due.into_iter().zip(owned) {
                            let Some(delivery) = self.hand_back(retry, owned, sent_at) else {
                                continue;
                            };
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
                    }
                    Err(e) => {
                        // Redis is down: try these again a little later.
                        self.common.health.down(Server::Redis, &e);
                        failures += 1;
                        let later = Instant::now() + outage_backoff(failures);
                        for mut retry in due {
                            retry.due = later;
                            waiting.push(retry);
                        }
                    }
                }
                continue;
            }
            let wait = waiting
                .peek()
                .map_or(TICK, |r| r.due.saturating_duration_since(now).min(TICK));
            match incoming.recv_timeout(wait) {
                Ok(retry) => waiting.push(retry),
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
                bytes = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
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
                "{}/{}: no longer this consumer's (another consumer claimed it); leaving it to its new owner",
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
        if let Some(ticket) = &mut retry.ticket {
            ticket.unpark(bytes);
        }
        Some(Delivery {
            stream: retry.stream,
            entry_id: retry.entry_id,
            body,
            delivery_count: retry.delivery_count,
            token: retry.token,
            trimmed,
            held_since: at,
            failures: retry.failures,
            strikes: retry.strikes,
            started_as: None,
            ticket: retry.ticket,
            seen: None,
            holder: None,
        })
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
