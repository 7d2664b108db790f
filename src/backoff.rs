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

/// How early a retry may run to join others that are due.
pub(crate) const GATHER: Duration = Duration::from_millis(20);

/// The backoff policy of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
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

    /// How soon retry `retry`, due after `delay`, may run when others are
    /// due at once (so they share a batch): up to [`GATHER`] early, but
    /// never before half the ceiling (the documented lower bound) nor
    /// before a `Retry-After` the failure asked for.
    pub fn earliest(&self, retry: u32, delay: Duration, retry_after: Option<Duration>) -> Duration {
        let floor = (self.ceiling(retry) / 2)
            .max(retry_after.map_or(Duration::ZERO, |a| a.min(self.max_retry_after)));
        delay.saturating_sub(GATHER).max(floor).min(delay)
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
    fn a_retry_runs_early_only_within_its_window() {
        let ms = Duration::from_millis;
        // 1 s ceiling: due after 800 ms, may join others 20 ms before.
        let b = Backoff {
            base: ms(1000),
            cap: ms(1000),
            max_retry_after: ms(60_000),
        };
        assert_eq!(b.earliest(1, ms(800), None), ms(780));
        // Never before half the ceiling.
        assert_eq!(b.earliest(1, ms(505), None), ms(500));
        // Never before a Retry-After.
        assert_eq!(b.earliest(1, ms(2000), Some(ms(2000))), ms(2000));
        // The book's 20 ms base: no earlier than 10 ms.
        assert_eq!(BOOK.earliest(1, ms(12), None), ms(10));
    }

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

    // Properties: the delay stays within its bounds (`[ceiling/2,
    // ceiling]`, the ceiling never above the cap; a `Retry-After` is a
    // floor bounded by `max_retry_after`) and is monotone: the ceiling
    // never decreases with the attempt number, so neither does the
    // expected delay (3/4 of it), nor the delay for any one jitter draw.
    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// A duration from 1 ns to `max_ms` milliseconds, biased towards small ones.
        fn duration_up_to(max_ms: u64) -> impl Strategy<Value = Duration> {
            prop_oneof![
                (1u64..1_000_000).prop_map(Duration::from_nanos),
                (1u64..=max_ms).prop_map(Duration::from_millis),
            ]
        }

        /// A backoff policy as `build()` accepts it: 0 < base <= cap.
        fn backoff() -> impl Strategy<Value = Backoff> {
            (
                duration_up_to(10_000),
                duration_up_to(86_400_000),
                prop_oneof![Just(Duration::ZERO), duration_up_to(3_600_000)],
            )
                .prop_map(|(base, cap, max_retry_after)| Backoff {
                    base,
                    cap: cap.max(base),
                    max_retry_after,
                })
        }

        /// Attempt numbers: small ones, around the shift limit, and huge ones.
        fn retry() -> impl Strategy<Value = u32> {
            prop_oneof![1u32..40, 1u32..=u32::MAX, Just(u32::MAX)]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn ceiling_is_capped_starts_at_base_and_never_decreases(b in backoff(), r in retry()) {
                let c = b.ceiling(r);
                prop_assert!(c <= b.cap, "{c:?} above the cap {:?}", b.cap);
                prop_assert_eq!(b.ceiling(1), b.base.min(b.cap));
                prop_assert!(c >= b.ceiling(1), "below the first ceiling");
                if r < u32::MAX {
                    let next = b.ceiling(r + 1);
                    prop_assert!(next >= c, "ceiling({}) = {next:?} < ceiling({r}) = {c:?}", r + 1);
                    prop_assert!(next <= c * 2, "more than doubled: {c:?} -> {next:?}");
                }
                // 0 is treated as the first retry.
                prop_assert_eq!(b.ceiling(0), b.ceiling(1));
            }

            #[test]
            fn ceiling_doubles_until_the_cap(b in backoff(), r in 1u32..32) {
                let c = b.ceiling(r);
                let expected = (c * 2).min(b.cap);
                prop_assert_eq!(b.ceiling(r + 1), expected, "retry {} of {:?}", r + 1, b);
            }

            #[test]
            fn delay_is_within_half_and_all_of_the_ceiling(
                b in backoff(),
                r in retry(),
                unit in 0.0f64..1.0,
            ) {
                let c = b.ceiling(r);
                let d = b.delay_with(r, unit, None);
                prop_assert!(d >= c / 2 && d <= c, "{d:?} outside [{:?}, {c:?}]", c / 2);
                let random = b.delay(r, None);
                prop_assert!(random >= c / 2 && random <= c, "random {random:?} outside [{:?}, {c:?}]", c / 2);
            }

            #[test]
            fn jitter_outside_its_range_is_clamped(
                b in backoff(),
                r in retry(),
                unit in prop_oneof![-1e12f64..0.0, 1.0f64..1e12, Just(f64::INFINITY), Just(f64::NEG_INFINITY)],
            ) {
                let c = b.ceiling(r);
                let d = b.delay_with(r, unit, None);
                prop_assert!(d >= c / 2 && d <= c, "{d:?} outside [{:?}, {c:?}]", c / 2);
            }

            #[test]
            fn retry_after_is_a_floor_bounded_by_max_retry_after(
                b in backoff(),
                r in retry(),
                unit in 0.0f64..1.0,
                asked in prop_oneof![Just(Duration::ZERO), duration_up_to(7_200_000)],
            ) {
                let jittered = b.delay_with(r, unit, None);
                let floor = asked.min(b.max_retry_after);
                let d = b.delay_with(r, unit, Some(asked));
                prop_assert_eq!(d, jittered.max(floor));
                prop_assert!(d >= floor, "retried before Retry-After: {d:?} < {floor:?}");
                prop_assert!(
                    d <= b.ceiling(r).max(b.max_retry_after),
                    "{d:?} above both the ceiling and max_retry_after"
                );
                let random = b.delay(r, Some(asked));
                prop_assert!(random >= floor && random <= b.ceiling(r).max(floor));
            }

            /// Monotone in expectation: for any fixed jitter draw (and so for the
            /// mean over draws, 3/4 of the ceiling), a later retry never waits less.
            #[test]
            fn delay_never_decreases_with_the_attempt_for_a_fixed_draw(
                b in backoff(),
                r1 in retry(),
                r2 in retry(),
                unit in 0.0f64..1.0,
                asked in proptest::option::of(duration_up_to(7_200_000)),
            ) {
                let (lo, hi) = (r1.min(r2), r1.max(r2));
                prop_assert!(b.delay_with(lo, unit, asked) <= b.delay_with(hi, unit, asked));
                let mean = |r: u32| -> f64 {
                    (0..=20).map(|i| b.delay_with(r, i as f64 / 20.0, None).as_secs_f64()).sum::<f64>() / 21.0
                };
                prop_assert!(mean(lo) <= mean(hi) + 1e-12);
            }
        }
    }
}
