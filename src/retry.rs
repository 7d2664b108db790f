//! Retries without head-of-line blocking: the retry thread.
//!
//! A worker that sees a retryable failure does not sleep: it hands the
//! delivery to this thread with the time it is due and goes on with the next
//! event. This thread keeps the waiting deliveries in a heap, sleeps until the
//! earliest is due (or a new one arrives) and hands it back to the worker pool.
//! The delivery stays pending in Redis all along, so a crash loses nothing. At
//! shutdown the waiting deliveries are left pending and come back on the next
//! start.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};

use crate::delivery::{Delivery, Job};
use crate::run::Shared;

/// A delivery waiting for its retry.
#[derive(Debug)]
pub(crate) struct Retry {
    pub due: Instant,
    pub delivery: Delivery,
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

/// The retry thread.
pub(crate) fn retry_thread(shared: &Shared, incoming: &Receiver<Retry>, jobs: &Sender<Job>) {
    let mut waiting: BinaryHeap<Retry> = BinaryHeap::new();
    while !shared.shutdown.is_shutdown() {
        let now = Instant::now();
        // Hand back everything due.
        while waiting.peek().is_some_and(|r| r.due <= now) {
            let retry = waiting.pop().expect("peeked");
            let mut job = vec![retry.delivery];
            loop {
                match jobs.send_timeout(job, TICK) {
                    Ok(()) => break,
                    Err(SendTimeoutError::Timeout(back)) if !shared.shutdown.is_shutdown() => {
                        job = back
                    }
                    Err(SendTimeoutError::Timeout(back) | SendTimeoutError::Disconnected(back)) => {
                        leave_pending(shared, back);
                        break;
                    }
                }
            }
        }
        let wait = waiting.peek().map_or(TICK, |r| {
            r.due.saturating_duration_since(Instant::now()).min(TICK)
        });
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
        leave_pending(shared, vec![retry.delivery]);
    }
}

fn leave_pending(shared: &Shared, job: Job) {
    for d in job {
        shared.in_flight.finish(&d.key());
    }
}
