//! Retries without head-of-line blocking: the retry thread.
//!
//! A worker that sees a retryable failure does not sleep: it hands the
//! delivery to this thread with the time it is due and goes on with the next
//! event. This thread keeps the waiting retries in a heap, sleeps until the
//! earliest is due (or a new one arrives), then reads the entry back from the
//! stream and hands it to the worker pool.
//!
//! A waiting retry keeps only the entry id and its attempt history, not its
//! fields, and does not count against the readers' in-flight room: thousands
//! of events can wait out a long backoff while healthy events flow at full
//! speed, and memory stays small. The entry stays pending in Redis all along,
//! so a crash loses nothing; at shutdown the waiting retries are left pending
//! and come back on the next start.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};

use crate::delivery::{Attempt, Delivery, Job};
use crate::event::{parse_entries, Event};
use crate::run::Shared;
use crate::stats::Server;

/// A failed delivery waiting for its retry.
#[derive(Debug)]
pub(crate) struct Retry {
    pub due: Instant,
    pub stream: Arc<str>,
    pub entry_id: String,
    pub delivery_count: u64,
    pub failures: Vec<Attempt>,
}

impl Retry {
    /// Keeps what a retry needs of `delivery`; its fields are read again
    /// from the stream when it is due.
    pub fn of(delivery: Delivery, due: Instant) -> Retry {
        Retry {
            due,
            stream: delivery.stream,
            entry_id: delivery.entry_id,
            delivery_count: delivery.delivery_count,
            failures: delivery.failures,
        }
    }

    fn key(&self) -> String {
        crate::in_flight::key(&self.stream, &self.entry_id)
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

/// The retry thread.
pub(crate) fn retry_thread(shared: &Shared, incoming: &Receiver<Retry>, jobs: &Sender<Job>) {
    let mut waiting: BinaryHeap<Retry> = BinaryHeap::new();
    let mut failures = 0u32;
    while !shared.shutdown.is_shutdown() {
        let now = Instant::now();
        let mut due = Vec::new();
        while due.len() < FETCH && waiting.peek().is_some_and(|r| r.due <= now) {
            due.push(waiting.pop().expect("peeked"));
        }
        if !due.is_empty() {
            match fetch(shared, &due) {
                Ok(bodies) => {
                    shared.health.up(Server::Redis);
                    failures = 0;
                    for (retry, fields) in due.into_iter().zip(bodies) {
                        hand_back(shared, jobs, retry, fields);
                    }
                }
                Err(e) => {
                    // Redis is down: try these again a little later.
                    shared.health.down(Server::Redis, &e);
                    failures += 1;
                    let later = Instant::now() + shared.outage_backoff(failures);
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
    let left = waiting.len() + incoming.len();
    if left > 0 {
        log::info!(
            "retry: {left} deliveries waiting for a retry stay pending until the next start"
        );
    }
    for retry in waiting.drain().chain(incoming.try_iter()) {
        leave_pending(shared, &retry);
    }
}

/// Reads the fields of due retries back, in one pipelined round trip.
/// `None` for an entry deleted meanwhile.
fn fetch(shared: &Shared, due: &[Retry]) -> redis::RedisResult<Vec<Option<crate::event::Fields>>> {
    let mut conn = shared.redis_conn()?;
    let mut pipe = conn.pipe();
    for retry in due {
        pipe.cmd("XRANGE")
            .arg(&*retry.stream)
            .arg(&retry.entry_id)
            .arg(&retry.entry_id);
    }
    let replies: Vec<redis::Value> = pipe.query(&mut conn)?;
    Ok(replies
        .into_iter()
        .map(|reply| {
            parse_entries(reply)
                .ok()
                .and_then(|mut entries| entries.pop())
                .and_then(|entry| entry.fields)
        })
        .collect())
}

fn hand_back(
    shared: &Shared,
    jobs: &Sender<Job>,
    retry: Retry,
    fields: Option<crate::event::Fields>,
) {
    let Some(fields) = fields else {
        shared.in_flight.unpark();
        crate::reader::ack_deleted(shared, &retry.stream, &[retry.entry_id], true);
        return;
    };
    let body = Event::parse(
        retry.stream.clone(),
        retry.entry_id.clone(),
        fields,
        retry.delivery_count,
        shared.limits,
    );
    let mut job = vec![Delivery {
        stream: retry.stream,
        entry_id: retry.entry_id,
        body,
        delivery_count: retry.delivery_count,
        failures: retry.failures,
    }];
    shared.in_flight.unpark();
    loop {
        match jobs.send_timeout(job, TICK) {
            Ok(()) => return,
            Err(SendTimeoutError::Timeout(back)) if !shared.shutdown.is_shutdown() => job = back,
            Err(SendTimeoutError::Timeout(back) | SendTimeoutError::Disconnected(back)) => {
                for d in back {
                    shared.in_flight.finish(&d.key());
                }
                return;
            }
        }
    }
}

fn leave_pending(shared: &Shared, retry: &Retry) {
    shared.in_flight.unpark();
    shared.in_flight.finish(&retry.key());
}
