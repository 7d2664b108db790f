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
//! So a read that came back full (the stream is ahead of the workers) is
//! split: its built-in statement's events commit at once, in their one
//! statement, and its handler's events wait here until a read's worth of
//! them (`--count`) has gathered from the stream's reads, or the oldest has
//! waited [`GATHER_WAIT`]; then one transaction applies them all. A short
//! read (the stream is caught up) is not split, and takes what waits here
//! for its stream along into its own transaction: gathering adds no wait
//! where there is no backlog. Copies of one event in one read stay
//! together, so that the first copy is still the one applied.
//!
//! Nothing is lost by waiting here: the entries are pending in Redis (a
//! crash redelivers them, and `processed_events` settles what committed),
//! they keep their places in flight, and the worker threads apply what
//! waits before they stop.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::worker::delivery::Delivery;

/// The longest a gathered event waits for others to join it.
pub(crate) const GATHER_WAIT: Duration = Duration::from_millis(20);

/// The handler's events waiting for their batch, per stream.
#[derive(Default)]
pub(crate) struct Gathered {
    streams: Mutex<Vec<Waiting>>,
}

/// What waits for one stream.
struct Waiting {
    stream: Arc<str>,
    deliveries: Vec<Delivery>,
    /// When the oldest of them came.
    since: Instant,
}

impl Gathered {
    /// Adds `deliveries` of `stream`; returns what waits for the stream,
    /// them included, once that is at least `full`.
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
                streams.len() - 1
            }
        };
        streams[at].deliveries.extend(deliveries);
        (streams[at].deliveries.len() >= full).then(|| streams.swap_remove(at).deliveries)
    }

    /// Takes what waits for `stream`.
    pub fn take(&self, stream: &str) -> Vec<Delivery> {
        let mut streams = self.lock();
        match streams.iter().position(|w| &*w.stream == stream) {
            Some(at) => streams.swap_remove(at).deliveries,
            None => Vec::new(),
        }
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
            .add(&a, vec![delivery(&a, "2-0"), delivery(&a, "3-0")], 3)
            .expect("full");
        assert_eq!(ids(&full), ["1-0", "2-0", "3-0"]);
        // The other stream's wait on.
        assert_eq!(ids(&gathered.take("b")), ["1-0"]);
        assert!(gathered.take("a").is_empty());
        assert!(gathered.due().is_none());
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
