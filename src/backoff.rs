//! Retry delays: exponential backoff, capped, with "equal jitter".
//!
//! The delay before retry `n` (n = 1 after the first failure) is drawn
//! uniformly from `[d/2, d]` where `d = min(cap, base · 2^(n-1))`. Equal jitter
//! keeps at least half of the exponential delay, so a struggling downstream
//! always gets real breathing room (full jitter can draw ~0 and retry at once),
//! while the random half spreads a burst of failures over time so they do not
//! all come back in the same instant (the thundering herd of section 8.2.4).
//!
//! A downstream's `Retry-After` is honoured: the delay is never shorter than
//! it asked for, bounded by `max_retry_after`.

use std::time::Duration;

/// The backoff policy of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay before the first retry (before jitter).
    pub base: Duration,
    /// Longest delay (before jitter).
    pub cap: Duration,
    /// Longest `Retry-After` honoured.
    pub max_retry_after: Duration,
}

impl Backoff {
    /// The exponential delay before retry `retry` (1-based), without jitter.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let shift = retry.saturating_sub(1).min(32);
        let factor = 1u64 << shift;
        let nanos = (self.base.as_nanos() as u64).saturating_mul(factor);
        Duration::from_nanos(nanos).min(self.cap)
    }

    /// The delay before retry `retry`, with `unit` a random number in
    /// `[0, 1)` (the jitter) and a downstream's `retry_after`, if any.
    pub fn delay_with(&self, retry: u32, unit: f64, retry_after: Option<Duration>) -> Duration {
        let ceiling = self.ceiling(retry);
        let half = ceiling / 2;
        let unit = if unit.is_nan() {
            1.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        let jittered = half + half.mul_f64(unit);
        match retry_after {
            Some(asked) => jittered.max(asked.min(self.max_retry_after)),
            None => jittered,
        }
    }

    /// The delay before retry `retry`, with a fresh random jitter.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        self.delay_with(retry, rand::random::<f64>(), retry_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOK: Backoff = Backoff {
        base: Duration::from_millis(20),
        cap: Duration::from_secs(1),
        max_retry_after: Duration::from_secs(60),
    };

    #[test]
    fn book_values() {
        // The book's 20, 40, 80 ms ... capped at 1 s.
        let ms: Vec<u128> = (1..=8).map(|n| BOOK.ceiling(n).as_millis()).collect();
        assert_eq!(ms, [20, 40, 80, 160, 320, 640, 1000, 1000]);
        assert_eq!(BOOK.delay_with(1, 0.0, None), Duration::from_millis(10));
        assert_eq!(BOOK.delay_with(1, 1.0, None), Duration::from_millis(20));
        assert_eq!(BOOK.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn retry_after_is_a_floor_bounded_by_the_maximum() {
        let d = BOOK.delay_with(1, 0.5, Some(Duration::from_secs(3)));
        assert_eq!(d, Duration::from_secs(3));
        let d = BOOK.delay_with(1, 0.5, Some(Duration::from_secs(600)));
        assert_eq!(d, Duration::from_secs(60));
        let d = BOOK.delay_with(7, 0.99, Some(Duration::from_millis(1)));
        assert!(d >= Duration::from_millis(500));
    }
}
