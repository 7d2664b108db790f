//! Flow control: the entries read but not finished yet, each held by a
//! [`Ticket`] that gives its place back when dropped.
//!
//! A reader [`reserve`](InFlight::reserve)s room before each XREADGROUP and
//! blocks while the worker holds `capacity` entries with their fields (in the
//! channel, in a worker, or waiting for the dead-letter writer). A slow
//! database therefore slows reading and memory stays flat. The reservation
//! turns into one ticket per entry actually read; the ticket travels with the
//! entry (worker, retry thread, dead-letter writer) and is released when the
//! entry is dropped, whatever the path: acked, dead-lettered, left pending at
//! shutdown, or dropped by a panic. No path can forget to give it back, and
//! no path can give back a ticket another thread still holds.
//!
//! Entries waiting for a retry are *parked*: they keep only their id (see
//! `retry.rs`), so they do not use the readers' room, up to `MAX_PARKED` of
//! them. The set also tells the reclaimer and the restart path which entries
//! this process is already working on, so none runs twice here.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::shutdown::Shutdown;

/// The in-flight set of one worker.
#[derive(Debug, Clone)]
pub(crate) struct InFlight {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    changed: Condvar,
    capacity: usize,
    /// Bytes of entry fields held at most, past which readers wait (the
    /// read that crosses it is let through: one read over at worst).
    byte_budget: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Held entries, with the delivery count Redis gave the latest delivery
    /// of each to this process (see [`Ticket::token`]). Every entry read
    /// is looked up, added and removed here: with `foldhash`, not SipHash
    /// (its keys are at most as many as the entries in flight, so a
    /// producer who chose colliding entry ids would slow little).
    entries: foldhash::HashMap<Arc<str>, Option<u64>>,
    reserved: usize,
    parked: usize,
    /// Bytes of the fields held by tickets that are not parked.
    bytes: usize,
}

/// At most this many parked entries (about 200 bytes each) before readers
/// wait too.
const MAX_PARKED: usize = 100_000;

fn key(stream: &str, entry_id: &str) -> String {
    let mut k = String::with_capacity(stream.len() + entry_id.len() + 1);
    write_key(&mut k, stream, entry_id);
    k
}

fn write_key(k: &mut String, stream: &str, entry_id: &str) {
    k.clear();
    k.push_str(stream);
    k.push('\n');
    k.push_str(entry_id);
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl InFlight {
    /// At most `capacity` entries and (about) `byte_budget` bytes of their
    /// fields held at once.
    pub fn new(capacity: usize, byte_budget: usize) -> InFlight {
        InFlight {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
                capacity: capacity.max(1),
                byte_budget: byte_budget.max(1),
            }),
        }
    }

    /// Waits for room and reserves up to `want` places. `None` only when a
    /// shutdown was asked for.
    pub fn reserve(&self, want: usize, shutdown: &Shutdown) -> Option<Reservation> {
        let inner = &self.inner;
        let mut state = inner.lock();
        loop {
            if shutdown.is_shutdown() {
                return None;
            }
            let used = state.entries.len().saturating_sub(state.parked) + state.reserved;
            let bytes_left = state.bytes < inner.byte_budget || used == 0;
            if used < inner.capacity && state.parked < MAX_PARKED && bytes_left {
                let places = want.min(inner.capacity - used);
                state.reserved += places;
                return Some(Reservation {
                    inner: inner.clone(),
                    places,
                });
            }
            state = inner
                .changed
                .wait_timeout(state, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether this process holds each of `ids` of `stream`.
    pub fn holds<'a>(&self, stream: &str, ids: impl IntoIterator<Item = &'a str>) -> Vec<bool> {
        let state = self.inner.lock();
        ids.into_iter()
            .map(|id| state.entries.contains_key(key(stream, id).as_str()))
            .collect()
    }

    /// Entries held now, parked ones included (reservations not counted).
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    /// Gives back several tickets under one lock (a batch that was acked).
    pub fn release_all(&self, tickets: impl IntoIterator<Item = Ticket>) {
        let mut state = self.inner.lock();
        for mut ticket in tickets {
            ticket.release(&mut state);
        }
        self.inner.changed.notify_all();
    }
}

/// Room reserved for one read; what is not turned into tickets is given back
/// when it is dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    inner: Arc<Inner>,
    places: usize,
}

impl Reservation {
    /// The number of entries this reservation may admit.
    pub fn places(&self) -> usize {
        self.places
    }

    /// Turns the reservation into tickets for the entries of `stream`
    /// actually read: (id, the delivery count Redis gave it, the bytes of
    /// its fields). `None` for an entry this process holds already (skip it;
    /// its holder's ticket takes the new count, since this process is still
    /// its owner).
    pub fn admit<'a>(
        mut self,
        stream: &str,
        entries: impl IntoIterator<Item = (&'a str, Option<u64>, usize)>,
    ) -> Vec<Option<Ticket>> {
        let mut state = self.inner.lock();
        state.reserved = state.reserved.saturating_sub(self.places);
        self.places = 0;
        // One allocation per entry admitted, shared by the set and the
        // ticket: this runs for every entry read.
        let mut scratch = String::new();
        let tickets = entries
            .into_iter()
            .map(|(id, count, bytes)| {
                write_key(&mut scratch, stream, id);
                match state.entries.get_mut(scratch.as_str()) {
                    Some(held) => {
                        if count.is_some() {
                            *held = count;
                        }
                        None
                    }
                    None => {
                        let key: Arc<str> = Arc::from(scratch.as_str());
                        state.entries.insert(key.clone(), count);
                        state.bytes += bytes;
                        Some(Ticket {
                            inner: Some(self.inner.clone()),
                            key,
                            parked: false,
                            bytes,
                        })
                    }
                }
            })
            .collect();
        self.inner.changed.notify_all();
        tickets
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.places > 0 {
            let mut state = self.inner.lock();
            state.reserved = state.reserved.saturating_sub(self.places);
            self.inner.changed.notify_all();
        }
    }
}

/// One entry's place in the in-flight set, released on drop.
#[derive(Debug)]
pub(crate) struct Ticket {
    /// `None` once released.
    inner: Option<Arc<Inner>>,
    key: Arc<str>,
    parked: bool,
    /// Bytes of the entry's fields it holds (0 while parked).
    bytes: usize,
}

impl Ticket {
    /// The delivery count of the latest delivery of this entry to this
    /// process: with the consumer name, the proof that the entry is still
    /// ours (a claim by another consumer raises the count in Redis but not
    /// here). `None` if unknown.
    pub fn token(&self) -> Option<u64> {
        let inner = self.inner.as_ref()?;
        inner.lock().entries.get(&*self.key).copied().flatten()
    }

    /// The entry starts waiting for a retry: it no longer takes the readers'
    /// room (it still keeps other readers from admitting it).
    pub fn park(&mut self) {
        if let Some(inner) = self.inner.as_ref().filter(|_| !self.parked) {
            let mut state = inner.lock();
            state.parked += 1;
            state.bytes = state.bytes.saturating_sub(self.bytes);
            self.bytes = 0;
            inner.changed.notify_all();
            self.parked = true;
        }
    }

    /// The entry is back from its wait, with `bytes` of fields read again,
    /// and takes room again.
    pub fn unpark(&mut self, bytes: usize) {
        if let Some(inner) = self.inner.as_ref().filter(|_| self.parked) {
            let mut state = inner.lock();
            state.parked = state.parked.saturating_sub(1);
            state.bytes += bytes;
            self.bytes = bytes;
            self.parked = false;
        }
    }

    fn release(&mut self, state: &mut State) {
        if self.inner.take().is_some() {
            state.entries.remove(&*self.key);
            state.bytes = state.bytes.saturating_sub(self.bytes);
            if self.parked {
                state.parked = state.parked.saturating_sub(1);
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.clone() {
            let mut state = inner.lock();
            self.release(&mut state);
            inner.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_become_tickets_released_on_drop() {
        let f = InFlight::new(3, usize::MAX);
        let s = Shutdown::new();
        let r = f.reserve(2, &s).unwrap();
        assert_eq!(r.places(), 2);
        assert_eq!(f.reserve(5, &s).unwrap().places(), 1); // dropped: given back
        let tickets = r.admit("s", [("a", Some(1), 0), ("b", Some(1), 0)]);
        assert!(tickets.iter().all(Option::is_some));
        // Held already: not admitted twice, but this process delivered it
        // again, so the holder's token follows.
        let again = f.reserve(1, &s).unwrap().admit("s", [("a", Some(2), 0)]);
        assert!(again[0].is_none());
        assert_eq!(f.len(), 2);
        let mut tickets: Vec<Ticket> = tickets.into_iter().flatten().collect();
        assert_eq!(tickets[0].token(), Some(2));
        assert_eq!(tickets[1].token(), Some(1));
        // A parked ticket does not take room; the set is full otherwise.
        assert_eq!(f.reserve(5, &s).unwrap().places(), 1);
        tickets[0].park();
        assert_eq!(f.reserve(5, &s).unwrap().places(), 2);
        tickets[0].unpark(0);
        let b = tickets.pop().unwrap();
        drop(tickets); // "a" released by drop
        assert_eq!(f.len(), 1);
        f.release_all([b]);
        assert_eq!(f.len(), 0);
        s.shutdown();
        assert!(f.reserve(1, &s).is_none());
    }

    #[test]
    fn readers_wait_while_the_fields_held_pass_the_byte_budget() {
        let f = InFlight::new(100, 1000);
        let s = Shutdown::new();
        // The read that crosses the budget is let through...
        let mut held = f.reserve(10, &s).unwrap().admit("s", [("a", None, 1500)]);
        // ...then readers wait until bytes are given back.
        let waiting = {
            let f = f.clone();
            let s = s.clone();
            std::thread::spawn(move || f.reserve(10, &s).map(|r| r.places()))
        };
        std::thread::sleep(Duration::from_millis(150));
        assert!(!waiting.is_finished());
        // A parked entry's fields are dropped: its bytes are given back.
        held[0].as_mut().unwrap().park();
        assert_eq!(waiting.join().unwrap(), Some(10));
        held[0].as_mut().unwrap().unpark(1500);
        drop(held);
        assert_eq!(f.inner.lock().bytes, 0);
    }

    #[test]
    fn a_parked_ticket_dropped_frees_its_parked_count() {
        let f = InFlight::new(1, usize::MAX);
        let s = Shutdown::new();
        let mut t = f
            .reserve(1, &s)
            .unwrap()
            .admit("s", [("a", None, 0)])
            .remove(0)
            .unwrap();
        t.park();
        drop(t);
        assert_eq!(f.len(), 0);
        assert_eq!(f.inner.lock().parked, 0);
        assert_eq!(f.reserve(1, &s).unwrap().places(), 1);
    }

    #[test]
    fn a_ticket_moved_to_another_thread_survives_a_panic_here() {
        // The bug this type closes: a worker that panicked released every
        // key of its job, including one it had already handed to the retry
        // thread, so that entry could be admitted (and run) twice.
        let f = InFlight::new(4, usize::MAX);
        let s = Shutdown::new();
        let mut tickets = f
            .reserve(2, &s)
            .unwrap()
            .admit("s", [("a", None, 0), ("b", None, 0)]);
        let (tx, rx) = std::sync::mpsc::channel();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let handed_over = tickets[0].take().unwrap();
            tx.send(handed_over).unwrap();
            let _still_here = tickets[1].take();
            panic!("a bug outside the handler");
        }));
        assert!(result.is_err());
        let held = rx.recv().unwrap();
        assert!(f.reserve(1, &s).unwrap().admit("s", [("a", None, 0)])[0].is_none());
        assert!(f.reserve(1, &s).unwrap().admit("s", [("b", None, 0)])[0].is_some());
        drop(held);
    }
}
