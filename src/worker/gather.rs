//! Step 3, in batch mode, for a backlog whose reads mix the two kinds of
//! events: the handler's own events are gathered across reads into full
//! batches, while the built-in statement's events commit at once.
//!
//! A read of events whose whole effect is the built-in statement
//! (`apply::plain`) commits in one statement, one round trip. A read that
//! also holds events of the handler's own code needs a transaction: BEGIN,
//! the dedup insert (which applies the built-in statement's events too),
//! the handler's statements, COMMIT, four round trips. With a tenth of a
//! backlog's events the handler's, every read was mixed, and the healthy
//! events drained at 0.67–0.79x the rate of a backlog of the built-in
//! statement's events alone.
//!
//! So a read that came back with all it asked for (the stream is ahead of
//! the workers; the reader marks its deliveries `behind`) is split: its
//! built-in statement's events commit at once, in their one statement, and
//! its handler's events wait here until a read's worth of them (`--count`)
//! has gathered from the stream's reads, or the oldest has waited
//! [`GATHER_WAIT`]; then one transaction applies them. A short read (the
//! stream is caught up) is not split, and takes what waits here for its
//! stream along into its own transaction, as much as fits in a read:
//! gathering adds no wait where there is no backlog, and no batch holds
//! more than `--count` events. A read that holds copies of one event is
//! not split, so the first copy in a read is still the one applied
//! (across reads, as ever, the copy that commits first is).
//!
//! Where the built-in statement cannot be fused with the dedup insert (a
//! `jsonb` payload column), a read is one transaction either way, and is
//! not split.
//!
//! The worker thread that gathered events may then be busy with a long
//! job: the first events of a stream's set, and every job a thread takes
//! while something waits, wake one worker thread waiting for a job
//! ([`Gathered::wake`]), which then waits for their deadline too.
//!
//! Nothing is lost by waiting here: the entries are pending in Redis (a
//! crash redelivers them, and `processed_events` settles what committed),
//! they keep their places in flight, and the worker threads apply what
//! waits before they stop.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::worker::delivery::Delivery;

/// The longest a gathered event waits for others to join it.
pub(crate) const GATHER_WAIT: Duration = Duration::from_millis(20);

/// The handler's events waiting for their batch, per stream.
pub(crate) struct Gathered {
    streams: Mutex<Vec<Waiting>>,
    /// A word to the worker threads that something waits, with a deadline
    /// (see `pool.rs`): one waiting for a job with no deadline of its own
    /// would otherwise sleep through it, however long the thread that
    /// gathered the events stays busy.
    wake: (Sender<()>, Receiver<()>),
}

impl Default for Gathered {
    fn default() -> Gathered {
        Gathered {
            streams: Mutex::default(),
            wake: crossbeam_channel::bounded(1),
        }
    }
}

/// What waits for one stream.
struct Waiting {
    stream: Arc<str>,
    deliveries: Vec<Delivery>,
    /// When the oldest of them came (or earlier: a short read that took
    /// the oldest along leaves it as it was, so the rest is due sooner).
    since: Instant,
}

impl Gathered {
    /// Adds `deliveries` of `stream`; returns the `full` that waited
    /// longest, them included, once that many wait.
    pub fn add(
        &self,
        stream: &Arc<str>,
        deliveries: Vec<Delivery>,
        full: usize,
    ) -> Option<Vec<Delivery>> {
        let mut streams = self.lock();
        let at = match streams.iter().position(|w| w.stream == *stream) {
            Some(at) => at,
            None => {
                streams.push(Waiting {
                    stream: stream.clone(),
                    deliveries: Vec::new(),
                    since: Instant::now(),
                });
                self.wake();
                streams.len() - 1
            }
        };
        let waiting = &mut streams[at];
        waiting.deliveries.extend(deliveries);
        if waiting.deliveries.len() < full.max(1) {
            return None;
        }
        let rest = waiting.deliveries.split_off(full.max(1));
        let batch = std::mem::replace(&mut waiting.deliveries, rest);
        // What is left came now.
        waiting.since = Instant::now();
        if waiting.deliveries.is_empty() {
            streams.swap_remove(at);
        }
        Some(batch)
    }

    /// Takes up to `most` of what waits for `stream`, those that waited
    /// longest.
    pub fn take(&self, stream: &str, most: usize) -> Vec<Delivery> {
        let mut streams = self.lock();
        let Some(at) = streams.iter().position(|w| &*w.stream == stream) else {
            return Vec::new();
        };
        let waiting = &mut streams[at];
        if waiting.deliveries.len() <= most {
            return streams.swap_remove(at).deliveries;
        }
        let rest = waiting.deliveries.split_off(most);
        std::mem::replace(&mut waiting.deliveries, rest)
    }

    /// When the oldest waiting event has waited [`GATHER_WAIT`] (`None`:
    /// nothing waits).
    pub fn due(&self) -> Option<Instant> {
        let streams = self.lock();
        streams.iter().map(|w| w.since + GATHER_WAIT).min()
    }

    /// Takes what waits for each stream whose oldest event is due by
    /// `now`; everything with `None`.
    pub fn take_due(&self, now: Option<Instant>) -> Vec<(Arc<str>, Vec<Delivery>)> {
        let mut streams = self.lock();
        let (due, rest): (Vec<Waiting>, Vec<Waiting>) = std::mem::take(&mut *streams)
            .into_iter()
            .partition(|w| now.is_none_or(|now| w.since + GATHER_WAIT <= now));
        *streams = rest;
        due.into_iter().map(|w| (w.stream, w.deliveries)).collect()
    }

    /// Tells one worker thread waiting for a job that something waits here
    /// (see [`Gathered::woken`]); a word not taken yet stands.
    pub fn wake(&self) {
        let _ = self.wake.0.try_send(());
    }

    /// Where that word comes: a worker thread waits on it beside the jobs.
    pub fn woken(&self) -> &Receiver<()> {
        &self.wake.1
    }

    /// The lock: what it guards is only moved in and out, so a panic while
    /// it was held left it whole.
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Waiting>> {
        self.streams.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(stream: &Arc<str>, id: &str) -> Delivery {
        Delivery::trimmed(
            stream,
            id.to_owned(),
            Vec::new(),
            None,
            None,
            Instant::now(),
        )
    }

    fn ids(deliveries: &[Delivery]) -> Vec<&str> {
        deliveries.iter().map(|d| d.entry_id.as_str()).collect()
    }

    #[test]
    fn a_stream_batch_is_handed_back_once_full_in_the_order_it_came() {
        let gathered = Gathered::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        assert!(gathered.add(&a, vec![delivery(&a, "1-0")], 3).is_none());
        assert!(gathered.add(&b, vec![delivery(&b, "1-0")], 3).is_none());
        let full = gathered
            .add(
                &a,
                vec![
                    delivery(&a, "2-0"),
                    delivery(&a, "3-0"),
                    delivery(&a, "4-0"),
                ],
                3,
            )
            .expect("full");
        // Never more than a full batch: the newest waits on.
        assert_eq!(ids(&full), ["1-0", "2-0", "3-0"]);
        assert_eq!(ids(&gathered.take("a", 10)), ["4-0"]);
        // The other stream's wait on.
        assert_eq!(ids(&gathered.take("b", 10)), ["1-0"]);
        assert!(gathered.take("a", 10).is_empty());
        assert!(gathered.due().is_none());
    }

    #[test]
    fn a_short_read_takes_along_only_what_fits_the_oldest_first() {
        let gathered = Gathered::default();
        let a: Arc<str> = "a".into();
        let three = vec![
            delivery(&a, "1-0"),
            delivery(&a, "2-0"),
            delivery(&a, "3-0"),
        ];
        assert!(gathered.add(&a, three, 10).is_none());
        assert_eq!(ids(&gathered.take("a", 2)), ["1-0", "2-0"]);
        assert_eq!(ids(&gathered.take("a", 0)), Vec::<&str>::new());
        assert_eq!(ids(&gathered.take("a", 2)), ["3-0"]);
    }

    #[test]
    fn the_first_events_of_a_stream_wake_one_waiting_worker() {
        let gathered = Gathered::default();
        let a: Arc<str> = "a".into();
        gathered.add(&a, vec![delivery(&a, "1-0")], 10);
        gathered.add(&a, vec![delivery(&a, "2-0")], 10);
        assert!(gathered.woken().try_recv().is_ok());
        // One word for the set, not one per event.
        assert!(gathered.woken().try_recv().is_err());
    }

    #[test]
    fn only_streams_whose_oldest_event_waited_long_enough_are_due() {
        let gathered = Gathered::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        gathered.add(&a, vec![delivery(&a, "1-0")], 10);
        let first = gathered.due().expect("something waits");
        std::thread::sleep(Duration::from_millis(5));
        gathered.add(&b, vec![delivery(&b, "1-0")], 10);
        // Joining does not make the oldest wait longer.
        gathered.add(&a, vec![delivery(&a, "2-0")], 10);
        assert_eq!(gathered.due(), Some(first));
        assert!(gathered.take_due(Some(first - GATHER_WAIT)).is_empty());
        let due = gathered.take_due(Some(first));
        assert_eq!(due.len(), 1);
        assert_eq!(&*due[0].0, "a");
        assert_eq!(ids(&due[0].1), ["1-0", "2-0"]);
        let rest = gathered.take_due(None);
        assert_eq!(rest.len(), 1);
        assert_eq!(&*rest[0].0, "b");
        assert!(gathered.due().is_none());
    }
}
