//! The cloneable shutdown handle: one shared stop flag that every thread
//! checks between bounded waits, and that wakes threads sleeping on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Asks a running [`Worker`](crate::Worker) to stop gracefully. Clone it freely;
/// any clone stops the worker.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    stopped: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Shutdown {
    /// A handle that has not fired.
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Asks the worker to stop: readers stop reading, workers finish and
    /// acknowledge what they hold, then [`Worker::run`](crate::Worker::run)
    /// returns.
    pub fn shutdown(&self) {
        self.inner.stopped.store(true, Ordering::SeqCst);
        let _guard = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.wake.notify_all();
    }

    /// Whether a shutdown was asked for.
    pub fn is_shutdown(&self) -> bool {
        self.inner.stopped.load(Ordering::SeqCst)
    }

    /// Sleeps for `duration`, or less if a shutdown is asked for meanwhile.
    /// Returns `true` when woken by a shutdown.
    pub fn sleep(&self, duration: Duration) -> bool {
        let deadline = deadline_after(duration);
        let mut guard = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.is_shutdown() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            guard = self
                .inner
                .wake
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// `after` from now; a time too far off for the clock (`Duration::MAX`,
/// which callers give for "no limit") is a century from now instead of a
/// panic.
pub(crate) fn deadline_after(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleep_is_cut_short_by_shutdown() {
        let s = Shutdown::new();
        assert!(!s.sleep(Duration::from_millis(1)));
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.sleep(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(20));
        s.shutdown();
        assert!(t.join().unwrap());
        assert!(s.is_shutdown());
    }
}
