//! Flow control: the set of entries read but not finished yet.
//!
//! A reader reserves room before each XREADGROUP and blocks while the worker
//! holds `capacity` entries with their fields (in the channel, in a worker, or
//! waiting for the dead-letter writer). A slow database therefore slows
//! reading and memory stays flat. Entries waiting for a retry are *parked*:
//! they keep only their id (see `retry.rs`), so they do not use that room,
//! up to `MAX_PARKED` of them. The set also tells the reclaimer and the restart path
//! which entries this process is already working on, so none runs twice here.

use std::collections::HashSet;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::shutdown::Shutdown;

#[derive(Debug)]
pub(crate) struct InFlight {
    state: Mutex<State>,
    changed: Condvar,
    capacity: usize,
}

#[derive(Debug, Default)]
struct State {
    entries: HashSet<String>,
    reserved: usize,
    parked: usize,
}

/// At most this many parked entries (about 200 bytes each) before readers
/// wait too.
const MAX_PARKED: usize = 100_000;

/// The key of an entry: stream and entry id.
pub(crate) fn key(stream: &str, entry_id: &str) -> String {
    let mut k = String::with_capacity(stream.len() + entry_id.len() + 1);
    write_key(&mut k, stream, entry_id);
    k
}

fn write_key(buf: &mut String, stream: &str, entry_id: &str) {
    buf.clear();
    buf.push_str(stream);
    buf.push('\n');
    buf.push_str(entry_id);
}

impl InFlight {
    pub fn new(capacity: usize) -> InFlight {
        InFlight {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for room and reserves up to `want` places. Returns 0 only when a
    /// shutdown was asked for.
    pub fn reserve(&self, want: usize, shutdown: &Shutdown) -> usize {
        let mut state = self.lock();
        loop {
            if shutdown.is_shutdown() {
                return 0;
            }
            let used = state.entries.len().saturating_sub(state.parked) + state.reserved;
            if used < self.capacity && state.parked < MAX_PARKED {
                let n = want.min(self.capacity - used);
                state.reserved += n;
                return n;
            }
            state = self
                .changed
                .wait_timeout(state, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Turns a reservation of `reserved` places into the entries of `stream`
    /// actually read, by id. Returns, per entry, whether it was newly
    /// admitted (`false`: this process already holds it, skip it).
    pub fn admit<'a>(
        &self,
        reserved: usize,
        stream: &str,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Vec<bool> {
        let mut state = self.lock();
        state.reserved = state.reserved.saturating_sub(reserved);
        let admitted = ids
            .into_iter()
            .map(|id| state.entries.insert(key(stream, id)))
            .collect();
        self.changed.notify_all();
        admitted
    }

    /// Gives back a reservation for which nothing was read.
    pub fn unreserve(&self, reserved: usize) {
        self.admit(reserved, "", []);
    }

    /// Marks an entry finished (acked, dead-lettered or abandoned).
    pub fn finish(&self, key: &str) {
        let mut state = self.lock();
        state.entries.remove(key);
        self.changed.notify_all();
    }

    /// Marks a batch of entries of one stream finished, under one lock.
    pub fn finish_all<'a>(&self, stream: &str, entry_ids: impl IntoIterator<Item = &'a str>) {
        let mut key = String::new();
        let mut state = self.lock();
        for id in entry_ids {
            write_key(&mut key, stream, id);
            state.entries.remove(key.as_str());
        }
        self.changed.notify_all();
    }

    /// An entry starts waiting for a retry: it no longer takes room.
    pub fn park(&self) {
        let mut state = self.lock();
        state.parked += 1;
        self.changed.notify_all();
    }

    /// A parked entry is back (or gone).
    pub fn unpark(&self) {
        let mut state = self.lock();
        state.parked = state.parked.saturating_sub(1);
    }

    /// Entries held now, parked ones included (reservations not counted).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_admit_finish() {
        let f = InFlight::new(3);
        let s = Shutdown::new();
        assert_eq!(f.reserve(2, &s), 2);
        assert_eq!(f.reserve(5, &s), 1);
        assert_eq!(f.admit(2, "s", ["a", "b"]), [true, true]);
        assert_eq!(f.admit(1, "s", ["a"]), [false]);
        assert_eq!(f.len(), 2);
        assert_eq!(f.reserve(5, &s), 1);
        f.unreserve(1);
        f.park(); // "a" waits for a retry: room for one more
        assert_eq!(f.reserve(5, &s), 2);
        f.unreserve(2);
        f.unpark();
        f.finish(&key("s", "a"));
        f.admit(0, "t", ["1", "2"]);
        f.finish_all("t", ["1", "2"]);
        f.finish(&key("s", "b"));
        assert_eq!(f.len(), 0);
        s.shutdown();
        assert_eq!(f.reserve(1, &s), 0);
    }
}
