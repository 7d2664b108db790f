//! Counters of what a worker did, and the health of its two servers.
//!
//! Counters are plain atomics bumped on the hot path, one set per stream
//! (found by a short scan: a worker reads a handful of streams);
//! [`Stats::snapshot`] sums them for the `--until-idle` summary,
//! [`Stats::snapshot_of`] gives one stream's for metrics. [`Health`]
//! turns a stream of connection errors into one log line when a server goes
//! away and one when it is back, instead of one line per event.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What happened to the events of one stream.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub read: AtomicU64,
    pub applied: AtomicU64,
    pub duplicates: AtomicU64,
    pub retries: AtomicU64,
    pub dead_permanent: AtomicU64,
    pub dead_exhausted: AtomicU64,
    pub dead_crash_loop: AtomicU64,
    pub dead_invalid: AtomicU64,
    pub dead_trimmed: AtomicU64,
    pub reclaimed: AtomicU64,
    pub gathered: AtomicU64,
}

/// Counters of one worker.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// Per stream, in the order of the configuration.
    streams: Vec<(String, Counters)>,
    /// Entries this process dropped because another consumer owns them now.
    pub lost_ownership: AtomicU64,
    /// Transactions committed by this process (an event that kills its
    /// connection while others commit is a crash loop, not an outage).
    pub commits: AtomicU64,
    pub panics: AtomicU64,
    /// Refreshes of a consumer record that found another instance's (see
    /// `name_check.rs`).
    pub name_clashes: AtomicU64,
    pub handler_seconds: Histogram,
    /// Which failed attempts are logged at warn level.
    pub failures_shown: Sampled,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Summary {
    /// Entries read from the streams (including redeliveries).
    pub read: u64,
    /// Events whose effect this worker committed.
    pub applied: u64,
    /// Deliveries skipped because the event was already applied.
    pub duplicates: u64,
    /// Retries scheduled after a retryable failure.
    pub retries: u64,
    /// Events dead-lettered, all kinds.
    pub dead_lettered: u64,
    /// ... of which permanent failures.
    pub dead_permanent: u64,
    /// ... of which exhausted retries.
    pub dead_exhausted: u64,
    /// ... of which crash loops.
    pub dead_crash_loop: u64,
    /// ... of which invalid entries.
    pub dead_invalid: u64,
    /// ... of which entries deleted from their stream before they could be
    /// applied.
    pub dead_trimmed: u64,
    /// Entries taken over from other consumers.
    pub reclaimed: u64,
    /// The handler's own events of a backlog's mixed reads that waited to
    /// be applied with other reads' (batch mode; see `worker/gather.rs`).
    pub gathered: u64,
    /// Handler panics caught.
    pub panics: u64,
    /// Times another running instance was found using this one's consumer
    /// name (each instance needs its own).
    pub name_clashes: u64,
}

impl Stats {
    /// Counters for each of `streams`.
    pub fn new(streams: &[String]) -> Stats {
        Stats {
            streams: streams
                .iter()
                .map(|s| (s.clone(), Counters::default()))
                .collect(),
            ..Stats::default()
        }
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The counters of `stream` (one of the worker's; the first one's for
    /// a stream it does not read, which cannot happen).
    pub fn of(&self, stream: &str) -> &Counters {
        static NONE: Counters = Counters::new();
        self.streams
            .iter()
            .find(|(name, _)| name == stream)
            .or(self.streams.first())
            .map_or(&NONE, |(_, c)| c)
    }

    /// Everything so far, all streams together.
    pub fn snapshot(&self) -> Summary {
        let mut total = Summary {
            panics: self.panics.load(Ordering::Relaxed),
            name_clashes: self.name_clashes.load(Ordering::Relaxed),
            ..Summary::default()
        };
        for (_, c) in &self.streams {
            total.add(&c.summary());
        }
        total
    }

    /// What happened on `stream` (`panics` are not counted per stream).
    pub fn snapshot_of(&self, stream: &str) -> Summary {
        self.of(stream).summary()
    }
}

impl Counters {
    const fn new() -> Counters {
        Counters {
            read: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            dead_permanent: AtomicU64::new(0),
            dead_exhausted: AtomicU64::new(0),
            dead_crash_loop: AtomicU64::new(0),
            dead_invalid: AtomicU64::new(0),
            dead_trimmed: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
            gathered: AtomicU64::new(0),
        }
    }

    fn summary(&self) -> Summary {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let dead = [
            get(&self.dead_permanent),
            get(&self.dead_exhausted),
            get(&self.dead_crash_loop),
            get(&self.dead_invalid),
            get(&self.dead_trimmed),
        ];
        Summary {
            read: get(&self.read),
            applied: get(&self.applied),
            duplicates: get(&self.duplicates),
            retries: get(&self.retries),
            dead_lettered: dead.iter().sum(),
            dead_permanent: dead[0],
            dead_exhausted: dead[1],
            dead_crash_loop: dead[2],
            dead_invalid: dead[3],
            dead_trimmed: dead[4],
            reclaimed: get(&self.reclaimed),
            gathered: get(&self.gathered),
            panics: 0,
            name_clashes: 0,
        }
    }
}

impl Summary {
    fn add(&mut self, other: &Summary) {
        self.read += other.read;
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.retries += other.retries;
        self.dead_lettered += other.dead_lettered;
        self.dead_permanent += other.dead_permanent;
        self.dead_exhausted += other.dead_exhausted;
        self.dead_crash_loop += other.dead_crash_loop;
        self.dead_invalid += other.dead_invalid;
        self.dead_trimmed += other.dead_trimmed;
        self.reclaimed += other.reclaimed;
        self.gathered += other.gathered;
        self.panics += other.panics;
        self.name_clashes += other.name_clashes;
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "read={} applied={} duplicates={} retries={} dead_lettered={} \
             (permanent={} exhausted={} crash_loop={} invalid={} trimmed={}) reclaimed={}",
            self.read,
            self.applied,
            self.duplicates,
            self.retries,
            self.dead_lettered,
            self.dead_permanent,
            self.dead_exhausted,
            self.dead_crash_loop,
            self.dead_invalid,
            self.dead_trimmed,
            self.reclaimed
        )?;
        // Only where it happens (batch mode, a handler with both kinds).
        if self.gathered > 0 {
            write!(f, " gathered={}", self.gathered)?;
        }
        Ok(())
    }
}

/// A server the worker depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Server {
    Redis,
    Postgres,
    /// The service an HTTP handler calls.
    Downstream,
}

/// Whether each server is reachable, as last seen.
#[derive(Debug, Default)]
pub(crate) struct Health {
    redis_down: AtomicBool,
    postgres_down: AtomicBool,
    downstream_down: AtomicBool,
}

impl Health {
    fn flag(&self, server: Server) -> &AtomicBool {
        match server {
            Server::Redis => &self.redis_down,
            Server::Postgres => &self.postgres_down,
            Server::Downstream => &self.downstream_down,
        }
    }

    /// Records that `server` failed; logs the start of an outage once, however
    /// many threads notice it. Returns whether this call logged it.
    ///
    /// A call a signal interrupted (EINTR: the process was stopped and
    /// continued, SIGSTOP then SIGCONT, which interrupts reads with a
    /// timeout) is no outage: its connection is made again all the same, and
    /// the server stays up (each stop logged an ERROR saying Redis was
    /// unavailable; found by a hostile test).
    pub fn down(&self, server: Server, why: &dyn std::fmt::Display) -> bool {
        let why = match server {
            Server::Redis => crate::net::plain(&why.to_string()),
            _ => why.to_string(),
        };
        if crate::net::interrupted(&why) {
            log::warn!("{server:?}: a call was interrupted ({why}), by a stop and continue of this process or a signal; connecting again");
            return false;
        }
        let first = !self.flag(server).swap(true, Ordering::SeqCst);
        if first {
            log::error!(
                "{server:?}: unavailable ({why}); pausing and reconnecting with backoff, no event is failed because of this"
            );
        }
        first
    }

    /// Whether `server` is in an outage this process noticed.
    pub fn is_down(&self, server: Server) -> bool {
        self.flag(server).load(Ordering::SeqCst)
    }

    /// Records that `server` works; logs the end of an outage.
    pub fn up(&self, server: Server) {
        if self.flag(server).swap(false, Ordering::SeqCst) {
            log::info!("{server:?}: reachable again, resuming");
        }
    }
}

/// One line in a while out of many: a failed attempt is logged at warn
/// level when none was for [`Sampled::EVERY`], and that line counts the
/// ones not shown since (at debug level). Each failure at warn level would
/// flood the log when a downstream fails every event; none at all would
/// hide that the worker is only retrying.
#[derive(Debug, Default)]
pub(crate) struct Sampled {
    /// When a line was last shown, and how many were not since.
    last: std::sync::Mutex<Option<(std::time::Instant, u64)>>,
}

impl Sampled {
    pub const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    /// `Some(n)`: show this one, with `n` not shown since the last shown
    /// one; `None`: this one is not shown.
    pub fn take(&self, now: std::time::Instant) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *last {
            Some((at, hidden)) if now.duration_since(*at) < Self::EVERY => {
                *hidden += 1;
                None
            }
            _ => {
                let hidden = last.map_or(0, |(_, hidden)| hidden);
                *last = Some((now, 0));
                Some(hidden)
            }
        }
    }
}

/// Upper bounds (seconds) of the handler duration histogram buckets.
pub(crate) const DURATION_BUCKETS: [f64; 10] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];

/// A Prometheus-style histogram of handler call durations, lock-free.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    /// Counts per bucket of `DURATION_BUCKETS` (each call lands in the first
    /// bucket whose bound it does not exceed), then above the last bound;
    /// made cumulative when read, so a call costs two atomic adds.
    buckets: [AtomicU64; 11],
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        let i = DURATION_BUCKETS
            .iter()
            .position(|bound| secs <= *bound)
            .unwrap_or(DURATION_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(
            u64::try_from(d.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// (cumulative bucket counts, +Inf last; sum in seconds).
    pub fn read(&self) -> ([u64; 11], f64) {
        let mut total = 0;
        let counts = std::array::from_fn(|i| {
            total += self.buckets[i].load(Ordering::Relaxed);
            total
        });
        (counts, self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::{Health, Histogram, Sampled, Server};
    use std::time::{Duration, Instant};

    #[test]
    fn one_failure_is_shown_per_window_with_a_count_of_the_others() {
        let s = Sampled::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        assert_eq!(s.take(t0), Some(0), "the first is shown");
        assert_eq!(s.take(ms(1)), None);
        assert_eq!(s.take(ms(9_999)), None);
        assert_eq!(s.take(ms(10_000)), Some(2), "the next window's first");
        assert_eq!(s.take(ms(10_001)), None);
        assert_eq!(s.take(ms(60_000)), Some(1));
        assert_eq!(s.take(ms(70_000)), Some(0), "none hidden");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        for ms in [0, 1, 3, 30, 400, 9_000] {
            h.observe(Duration::from_millis(ms));
        }
        let (counts, sum) = h.read();
        // Bounds: 1ms 2.5ms 5ms 10ms 25ms 50ms 100ms 250ms 1s 5s +Inf.
        assert_eq!(counts, [2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 6]);
        assert!((sum - 9.434).abs() < 1e-9, "{sum}");
    }

    #[test]
    fn an_outage_is_logged_once_however_many_threads_see_it() {
        let health = Health::default();
        let logged: usize = std::thread::scope(|s| {
            let threads: Vec<_> = (0..8)
                .map(|_| s.spawn(|| health.down(Server::Redis, &"refused")))
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .filter(|&first| first)
                .count()
        });
        assert_eq!(logged, 1);
        assert!(!health.down(Server::Redis, &"still refused"));
        // Another server's outage is its own; a new outage is logged again.
        assert!(health.down(Server::Postgres, &"refused"));
        health.up(Server::Redis);
        assert!(health.down(Server::Redis, &"refused again"));
    }

    #[test]
    fn an_interrupted_call_is_no_outage() {
        let health = Health::default();
        let eintr = std::io::Error::from_raw_os_error(libc::EINTR);
        assert!(!health.down(Server::Redis, &eintr));
        assert!(!health.redis_down.load(std::sync::atomic::Ordering::SeqCst));
        assert!(health.down(Server::Redis, &"refused"));
    }
}
