//! The benchmark: preload N events, drain them with a worker, report the rate,
//! latency, CPU per event and peak memory. `scripts/bench.sh` runs it next to
//! the database's own ceiling measured with pgbench.
//!
//! `--fail-ratio 0.1 --fail-times 2 --backoff-base 1s` makes 10% of events fail
//! twice with a 1 s backoff: the head-of-line benchmark. It then also reports
//! the drain rate of the healthy events alone, which must stay close to the
//! clean rate because retries wait in the retry thread, not in a worker.
//!
//! `--poison-ratio 0.01` makes 1% of payloads carry `"poison":true`, which a
//! CHECK constraint named `bench_poison` on `notifications` must reject (the
//! caller adds it; `scripts/bench.sh` does on its scratch database): the
//! built-in statement fails for them, and they are dead-lettered.
//!
//! `--rate R --duration S` runs a steady load instead of a backlog: a producer
//! thread sends R events per second for S seconds (in a small pipeline each
//! millisecond) while the worker runs, and the latency is measured from each
//! event's send, in microseconds, to its commit. It also reports the rate
//! sustained: the commits per second while the producer ran (its first
//! quarter left out). With R above what the worker keeps up with, that is
//! the capacity under a producer, which `scripts/bench.sh` takes the steady
//! runs' rates from.
//!
//! `--trace FILE` writes one line per committed event: the commit time and
//! the latency, in microseconds, to see how latency moves during a run.
//!
//! The host's steal (the CPU time it gave this VM's cores to other guests)
//! is sampled every 100 ms while a run lasts. On a shared host it comes in
//! bursts: a tenth of a second with a quarter of the cores taken, then none
//! for seconds. A run reports how long those bursts lasted and, under a
//! steady load, the latency of the events whose whole flight (XADD to
//! commit) met none of them: what the machine gives when the host takes
//! nothing. Events sent after a burst that queued behind its backlog count
//! as calm, so the figure flatters nothing. `--watch-steal FILE` samples
//! alone (for `scripts/bench.sh` to put pgbench under the same rule), and
//! `--calm-latency FILE` applies that rule to "end latency" lines (in
//! microseconds) read from standard input.
//!
//! The disk stalls too: `--disk-probe DIR` writes 8 KiB to a file of its
//! own in DIR and waits for it to reach the disk (fdatasync), then sleeps
//! 10 ms, over and over; a sync that took over 5 ms is a stall. Every
//! commit waits for such a sync of the database's WAL, so with DIR on the
//! database's disk a stall holds every event in flight and queues the ones
//! behind it (on this project's two-core VM, stalls of 16-73 ms a few
//! times in 30 s: see docs/performance-log.md). The flights that met a
//! stall, from the probe's last sync before it, are left out of the calm
//! figures as those that met a steal burst are.
//!
//! Run: `cargo run --release --example bench -- --events 100000`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use taskhub::{Event, Handler, HandlerError, Producer, SqlHandler, Tls, Tx, Worker};

struct Args {
    events: usize,
    workers: usize,
    count: usize,
    fail_ratio: f64,
    fail_times: u32,
    poison_ratio: f64,
    backoff_base: Duration,
    payload_bytes: usize,
    sql: String,
    mode: taskhub::Mode,
    /// Steady load: events per second (0: a preloaded backlog).
    rate: u64,
    duration: Duration,
    /// Where to write each commit's time and latency.
    trace: Option<String>,
    /// Only sample the host's steal for `duration`, into this file.
    watch_steal: Option<String>,
    /// Only compute the latency of the lines on stdin that met no burst of
    /// the steal samples in this file.
    calm_latency: Option<String>,
    /// Steady load: size Redis's key tables for the run's markers first.
    presize: bool,
    /// Where to probe the disk for stalls (see `probe_disk`).
    disk_probe: Option<String>,
}

const USAGE: &str = "\
Usage: bench [FLAGS]   (REDIS_URL and DATABASE_URL from the environment)

Preloads events and drains them with a worker (or, with --rate, runs a
steady load), then prints rate, latency, CPU per event and peak RSS, and a
RESULT line for scripts. scripts/bench.sh runs it next to pgbench.

  --events N           events to preload [100000]
  --workers N          worker threads [8]
  --count N            entries per read [64]
  --mode M             batch or per-event [batch]
  --sql STATEMENT      a custom per-event statement ($1 event id, $2 payload)
  --payload-bytes N    size of each JSON payload [200]
  --fail-ratio F       share of events that fail (retryable) [0]
  --fail-times N       how many times each of them fails [2]
  --backoff-base D     first retry's backoff, e.g. 1s [1s]
  --poison-ratio F     share of events the database rejects (needs the
                       bench_poison CHECK constraint) [0]
  --rate R             steady load: R events per second instead of a backlog;
                       also prints the rate sustained while it ran
  --duration D         how long the steady load runs [30s]
  --presize            steady load: first fill Redis with placeholder keys
                       (with a TTL, deleted after the run) so that its
                       tables of keys hold the run's markers without
                       growing during the run (see presize_redis)
  --trace FILE         one line per commit: its time and latency (us)
  --watch-steal FILE   only sample the host's steal every 100 ms for
                       --duration, into FILE (start end share, us and %;
                       with --disk-probe, then \"probed\" and a line
                       \"stall SINCE START END\" per stall)
  --calm-latency FILE  only read \"end latency\" lines (us) from stdin and
                       print the latency of those that met no steal burst
                       of FILE (a 100 ms sample with over 5% taken) and no
                       disk stall in it
  --disk-probe DIR     while the run (or --watch-steal) lasts, write 8 KiB
                       and fdatasync it, then sleep 10 ms, in a file of its
                       own in DIR (best: on the database's disk); a sync
                       over 5 ms is a stall, and flights that met one are
                       not calm. A DIR that cannot take the file stops the
                       run at once; a probe that fails later costs the run
                       its stall figures only
  -h, --help           this text
";

fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        events: 100_000,
        workers: 8,
        count: 64,
        fail_ratio: 0.0,
        fail_times: 2,
        poison_ratio: 0.0,
        backoff_base: Duration::from_secs(1),
        payload_bytes: 200,
        sql: taskhub::DEFAULT_STATEMENT.to_owned(),
        mode: taskhub::Mode::Batch,
        rate: 0,
        duration: Duration::from_secs(30),
        trace: None,
        watch_steal: None,
        calm_latency: None,
        presize: false,
        disk_probe: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let bad = |e: &dyn std::fmt::Display| format!("{flag}: {e}");
        match flag.as_str() {
            "--events" => args.events = value()?.parse().map_err(|e| bad(&e))?,
            "--workers" => args.workers = value()?.parse().map_err(|e| bad(&e))?,
            "--count" => args.count = value()?.parse().map_err(|e| bad(&e))?,
            "--fail-ratio" => args.fail_ratio = value()?.parse().map_err(|e| bad(&e))?,
            "--fail-times" => args.fail_times = value()?.parse().map_err(|e| bad(&e))?,
            "--poison-ratio" => args.poison_ratio = value()?.parse().map_err(|e| bad(&e))?,
            "--backoff-base" => {
                args.backoff_base = humantime::parse_duration(&value()?).map_err(|e| bad(&e))?
            }
            "--payload-bytes" => args.payload_bytes = value()?.parse().map_err(|e| bad(&e))?,
            "--sql" => args.sql = value()?,
            "--mode" => args.mode = value()?.parse()?,
            "--rate" => args.rate = value()?.parse().map_err(|e| bad(&e))?,
            "--trace" => args.trace = Some(value()?),
            "--watch-steal" => args.watch_steal = Some(value()?),
            "--calm-latency" => args.calm_latency = Some(value()?),
            "--duration" => {
                args.duration = humantime::parse_duration(&value()?).map_err(|e| bad(&e))?
            }
            "--presize" => args.presize = true,
            "--disk-probe" => args.disk_probe = Some(value()?),
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown flag {other} (see --help)")),
        }
    }
    Ok(Some(args))
}

/// The most events in one pipeline of the `--rate` producer: on schedule
/// it sends about a millisecond's worth (3 to 80 at `scripts/bench.sh`'s
/// rates); when behind, it catches up in pipelines of this size.
const CATCH_UP: usize = 1_000;

/// `--presize`: fills Redis with placeholder keys `<prefix><n>` (expiring
/// after an hour; the run's cleanup deletes them with the stream's keys) so
/// that both of its tables of keys (every key, and the keys with a TTL) take
/// `markers` more keys without growing. Returns how many it wrote.
///
/// Redis doubles a full table and then moves every key into the new one, a
/// little at each command. From an empty Redis, a 30 s batch run at 23,000
/// events/s passes 2^18 and 2^19 markers, and each doubling slowed Redis
/// for a second (its PING answered in 10-19 ms) and left 10,000-20,000
/// events over 10 ms: the run's p99 (62-131 ms in five runs, against 15
/// and 18 ms presized). A deployment at a steady rate holds about rate x
/// marker TTL markers, as many expire each second as are written, and its
/// tables keep their size: it grows them through its first marker TTL, and
/// again whenever its rate passes its earlier peak. A table is full at
/// a power of two: with `table` the power of two above (keys now + markers),
/// `table + 1` placeholders make both tables twice `table`, with room for
/// the markers. Then a lookup of a placeholder per bucket of the old table
/// (each lookup advances both moves by at least one bucket) finishes the
/// move before the clock starts.
///
/// While Redis has a child process (a background save, an AOF rewrite) it
/// neither grows a table nor moves one: this waits (up to a minute) until
/// it has none, and returns `true` with the count when one is still there
/// or began meanwhile.
fn presize_redis(
    redis: &mut redis::Connection,
    prefix: &str,
    markers: u64,
) -> Result<(u64, bool), Box<dyn std::error::Error>> {
    const CHUNK: u64 = 50_000;
    let info = |redis: &mut redis::Connection, section: &str, field: &str| {
        redis::cmd("INFO")
            .arg(section)
            .query::<String>(redis)
            .map(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            })
    };
    let child = |redis: &mut redis::Connection| -> redis::RedisResult<bool> {
        Ok(info(redis, "persistence", "rdb_bgsave_in_progress")?
            + info(redis, "persistence", "aof_rewrite_in_progress")?
            > 0)
    };
    let waited = Instant::now();
    while child(redis)? && waited.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let forks = info(redis, "stats", "total_forks")?;
    let keys: u64 = redis::cmd("DBSIZE").query(redis)?;
    let table = (keys + markers + 1).next_power_of_two();
    let fill = table + 1;
    let write = redis::Script::new(
        "for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do \
         redis.call('SET', ARGV[1] .. i, 1, 'EX', 3600) end return 1",
    );
    let mut from = 0;
    while from < fill {
        let to = (from + CHUNK).min(fill);
        write
            .arg(prefix)
            .arg(from)
            .arg(to - 1)
            .invoke::<i64>(redis)?;
        from = to;
    }
    let look = redis::Script::new(
        "for i = 1, tonumber(ARGV[2]) do redis.call('EXISTS', ARGV[1]) end return 1",
    );
    let mut left = table;
    while left > 0 {
        let n = left.min(4 * CHUNK);
        look.arg(format!("{prefix}0")).arg(n).invoke::<i64>(redis)?;
        left -= n;
    }
    // A child still there (after a minute's wait) or a new one: the
    // tables may not be sized.
    let forked = child(redis)? || info(redis, "stats", "total_forks")? != forks;
    Ok((fill, forked))
}

/// The SQL handler, plus scripted failures and a record of commit times.
struct BenchHandler {
    sql: SqlHandler,
    failures: Mutex<HashMap<String, u32>>,
    fail_times: u32,
    /// Microseconds from XADD to commit, per event.
    latencies: Mutex<Vec<u64>>,
    /// The commit time and latency of each event, in microseconds, under a
    /// steady load (the rate sustained while the producer ran is counted
    /// from them, and the latency of the calm flights); `None` for a
    /// drain, whose peak RSS is a measurement.
    commit_times: Option<Mutex<Vec<(u64, u64)>>>,
    last_healthy_commit: Mutex<Option<Instant>>,
    /// `--trace`: "commit time, latency" in microseconds, a line per event.
    trace: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
}

fn entry_millis(entry_id: &str) -> u64 {
    entry_id
        .split('-')
        .next()
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(0)
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

impl Handler for BenchHandler {
    fn handle(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        if event.field("fail").is_some() {
            let mut failures = self.failures.lock().unwrap();
            let n = failures.entry(event.event_id().to_owned()).or_default();
            if *n < self.fail_times {
                *n += 1;
                return Err(HandlerError::retryable("scripted failure"));
            }
        }
        self.sql.handle(event, tx)
    }

    /// The scripted failures first (naming the failing event, as the
    /// default batch form does), then the SQL handler's own batch form (a
    /// set-based insert for the default statement).
    fn handle_batch(&self, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        {
            let mut failures = self.failures.lock().unwrap();
            for (i, event) in events.iter().enumerate() {
                if event.field("fail").is_some() {
                    let n = failures.entry(event.event_id().to_owned()).or_default();
                    if *n < self.fail_times {
                        *n += 1;
                        return Err(HandlerError::retryable("scripted failure").for_event(i));
                    }
                }
            }
        }
        self.sql.handle_batch(events, tx)
    }

    /// Events without scripted failures are the SQL handler's alone, so
    /// taskhub may fold its default statement into the dedup insert.
    fn sql_effect(&self, event: &Event) -> Option<&SqlHandler> {
        event.field("fail").is_none().then_some(&self.sql)
    }

    fn committed(&self, event: &Event) {
        // The producer's clock in microseconds when it wrote one (steady
        // load), else the entry id's milliseconds (preloaded backlog).
        let sent_us = event
            .field("sent_us")
            .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
            .unwrap_or_else(|| entry_millis(event.entry_id()) * 1000);
        let now = now_micros();
        let latency = now.saturating_sub(sent_us);
        self.latencies.lock().unwrap().push(latency);
        if let Some(times) = &self.commit_times {
            times.lock().unwrap().push((now, latency));
        }
        if let Some(trace) = &self.trace {
            use std::io::Write;
            let _ = writeln!(trace.lock().unwrap(), "{now} {latency}");
        }
        if event.field("fail").is_none() {
            *self.last_healthy_commit.lock().unwrap() = Some(Instant::now());
        }
    }
}

/// (user + system CPU seconds, peak RSS in kB) of this process, from /proc.
fn usage() -> (f64, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let cpu = (ticks(11) + ticks(12)) / 100.0; // utime, stime (after the name)
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (cpu, rss)
}

/// (steal, total) jiffies of the whole machine, from /proc/stat: the share
/// of time the host gave this VM's CPUs to someone else. A run with much
/// of it measured the neighbours as much as taskhub.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1) // "cpu"
        .take(8) // user nice system idle iowait irq softirq steal
        .filter_map(|v| v.parse().ok())
        .collect();
    (ticks.get(7).copied().unwrap_or(0), ticks.iter().sum())
}

/// A sample of 100 ms in which the host took more than this share of the
/// machine's CPU time is a burst: more than one tick of the 20 that two
/// cores count in it.
const BURST_PCT: f64 = 5.0;

/// One sample of the host's steal: its start and end, in microseconds since
/// the epoch, and the share of the machine's CPU time the host took.
type StealSample = (u64, u64, f64);

/// Samples the host's steal every 100 ms until `stop` is set.
fn watch_steal(stop: &AtomicBool) -> Vec<StealSample> {
    let mut samples = Vec::new();
    let (mut at, mut ticks) = (now_micros(), machine_ticks());
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        let (now, next) = (now_micros(), machine_ticks());
        let total = next.1.saturating_sub(ticks.1);
        if total > 0 {
            let steal = next.0.saturating_sub(ticks.0) as f64 * 100.0 / total as f64;
            samples.push((at, now, steal));
            (at, ticks) = (now, next);
        }
    }
    samples
}

/// The bursts among `samples` (in time order): their start and end.
fn bursts(samples: &[StealSample]) -> Vec<(u64, u64)> {
    samples
        .iter()
        .filter(|s| s.2 > BURST_PCT)
        .map(|s| (s.0, s.1))
        .collect()
}

/// A steady run whose events stop committing for this long after its
/// producer ended gives up (Redis or PostgreSQL gone for good).
const STUCK: Duration = Duration::from_secs(60);

/// A steady run whose worker is not ready this long after its start
/// gives up before its producer sends anything.
const READY_WAIT: Duration = Duration::from_secs(30);

/// A sync of the disk probe that took longer than this is a stall.
const STALL: Duration = Duration::from_millis(5);

/// How long the disk probe sleeps between two syncs.
const PROBE_PAUSE: Duration = Duration::from_millis(10);

/// A stall of the disk: when the disk had last answered the probe (the
/// stall may have begun while it slept), and when the stalled sync began
/// and ended; microseconds since the epoch.
type Stall = (u64, u64, u64);

/// `--disk-probe`'s file in `dir`: a new one (never a file already there),
/// its name removed at once, so that nothing is left behind however the
/// run ends (a file without a name takes writes and syncs while open).
fn disk_probe_file(dir: &str) -> Result<std::fs::File, String> {
    let path = std::path::Path::new(dir).join(format!(".bench-disk-probe-{}", std::process::id()));
    let bad = |e: std::io::Error| format!("--disk-probe {dir}: {e}");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(bad)?;
    std::fs::remove_file(&path).map_err(bad)?;
    Ok(file)
}

/// Until `stop`: writes 8 KiB into `file` (the same 1 MiB over and over)
/// and waits for it to reach the disk, as a commit waits for its WAL, then
/// sleeps [`PROBE_PAUSE`]; returns the syncs that took over [`STALL`].
/// A stall is the disk's or the probe thread's wait for a core: on two
/// busy cores it may be either.
fn probe_disk(file: std::fs::File, stop: &AtomicBool) -> std::io::Result<Vec<Stall>> {
    use std::os::unix::fs::FileExt;
    let block = [0x55u8; 8192];
    let mut stalls = Vec::new();
    let mut syncs = 0u64;
    let mut answered = now_micros();
    while !stop.load(Ordering::Relaxed) {
        let start = now_micros();
        file.write_all_at(&block, syncs % 128 * block.len() as u64)?;
        file.sync_data()?;
        let end = now_micros();
        if end.saturating_sub(start) > STALL.as_micros() as u64 {
            stalls.push((answered, start, end));
        }
        answered = end;
        syncs += 1;
        std::thread::sleep(PROBE_PAUSE);
    }
    Ok(stalls)
}

/// What the host did to the run, in time order: the steal bursts of
/// `samples` and the disk's `stalls` (from its last answer before each),
/// those that overlap joined.
fn host_bursts(samples: &[StealSample], stalls: &[Stall]) -> Vec<(u64, u64)> {
    let mut all = bursts(samples);
    all.extend(stalls.iter().map(|s| (s.0, s.2)));
    all.sort_unstable();
    let mut joined: Vec<(u64, u64)> = Vec::with_capacity(all.len());
    for (start, end) in all {
        match joined.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => joined.push((start, end)),
        }
    }
    joined
}

/// "stalls=.. stall_s=.. stall_max_ms=..": how many syncs of the disk
/// probe stalled, how long they took in all, and the longest.
fn stall_fields(stalls: &[Stall]) -> String {
    let took = |s: &Stall| s.2.saturating_sub(s.1);
    let total: u64 = stalls.iter().map(took).sum();
    let longest = stalls.iter().map(took).max().unwrap_or(0);
    format!(
        "stalls={} stall_s={:.2} stall_max_ms={:.1}",
        stalls.len(),
        total as f64 / 1e6,
        longest as f64 / 1000.0
    )
}

/// Whether a flight from `start` to `end` met none of `bursts`.
fn calm(bursts: &[(u64, u64)], start: u64, end: u64) -> bool {
    let first_not_over = bursts.partition_point(|b| b.1 < start);
    bursts.get(first_not_over).is_none_or(|b| b.0 > end)
}

/// "burst_s=.. steal_max_pct=..": how long the bursts of `samples` lasted
/// in all, and the most the host took in one sample.
fn steal_fields(samples: &[StealSample]) -> String {
    let burst_us: u64 = bursts(samples).iter().map(|b| b.1 - b.0).sum();
    let most = samples.iter().map(|s| s.2).fold(0.0, f64::max);
    format!(
        "burst_s={:.1} steal_max_pct={most:.0}",
        burst_us as f64 / 1e6
    )
}

/// "calm_p50_ms=.. calm_p99_ms=.. calm_max_ms=.. calm_share=..": the
/// latency of the events of `flights` (end, latency; microseconds) whose
/// flight met no steal burst and no stall of the disk, and their share of
/// all.
fn calm_fields(samples: &[StealSample], stalls: &[Stall], flights: &[(u64, u64)]) -> String {
    let bursts = host_bursts(samples, stalls);
    let mut calm: Vec<u64> = flights
        .iter()
        .filter(|(end, latency)| calm(&bursts, end.saturating_sub(*latency), *end))
        .map(|f| f.1)
        .collect();
    calm.sort_unstable();
    let ms = |p: f64| percentile(&calm, p) as f64 / 1000.0;
    format!(
        "calm_p50_ms={:.2} calm_p99_ms={:.2} calm_max_ms={:.2} calm_share={:.0}",
        ms(0.5),
        ms(0.99),
        ms(1.0),
        calm.len() as f64 * 100.0 / flights.len().max(1) as f64
    )
}

/// `--watch-steal FILE`: samples for `duration`, a line per sample; with
/// `--disk-probe`, a line "probed" and a line "stall SINCE START END" per
/// stall (a probe that failed is said on stderr, and leaves them out).
fn watch_steal_into(
    path: &str,
    duration: Duration,
    disk_probe: Option<&str>,
) -> Result<(), Box<dyn std::error::Error>> {
    let probe = disk_probe.map(disk_probe_file).transpose()?;
    let stop = AtomicBool::new(false);
    let (samples, stalls) = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(duration);
            stop.store(true, Ordering::Relaxed);
        });
        let probing = probe.map(|p| scope.spawn(|| probe_disk(p, &stop)));
        let samples = watch_steal(&stop);
        let stalls = probing.map(|p| p.join().expect("the disk probe panicked"));
        (samples, stalls)
    });
    let mut lines: String = samples
        .iter()
        .map(|(start, end, steal)| format!("{start} {end} {steal:.1}\n"))
        .collect();
    match stalls {
        Some(Ok(stalls)) => {
            lines.push_str("probed\n");
            for (since, start, end) in stalls {
                lines.push_str(&format!("stall {since} {start} {end}\n"));
            }
        }
        Some(Err(e)) => eprintln!("bench: the disk probe failed ({e}); no stall figures"),
        None => {}
    }
    std::fs::write(path, lines).map_err(|e| format!("--watch-steal {path}: {e}"))?;
    Ok(())
}

/// `--calm-latency FILE`: the samples of FILE (`--watch-steal`'s), the
/// flights from standard input, one line of figures.
fn calm_latency(path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("--calm-latency {path}: {e}"))?;
    let numbers = |line: &str| -> Vec<f64> {
        line.split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect()
    };
    let samples: Vec<StealSample> = text
        .lines()
        .map(numbers)
        .filter(|v| v.len() == 3)
        .map(|v| (v[0] as u64, v[1] as u64, v[2]))
        .collect();
    let probed = text.lines().any(|line| line == "probed");
    let stalls: Vec<Stall> = text
        .lines()
        .filter_map(|line| line.strip_prefix("stall "))
        .map(numbers)
        .filter(|v| v.len() == 3)
        .map(|v| (v[0] as u64, v[1] as u64, v[2] as u64))
        .collect();
    let flights: Vec<(u64, u64)> = std::io::stdin()
        .lines()
        .map_while(Result::ok)
        .map(|line| numbers(&line))
        .filter(|v| v.len() == 2)
        .map(|v| (v[0] as u64, v[1] as u64))
        .collect();
    let stall_figures = if probed {
        format!(" {}", stall_fields(&stalls))
    } else {
        String::new()
    };
    println!(
        "{} {}{stall_figures}",
        calm_fields(&samples, &stalls, &flights),
        steal_fields(&samples)
    );
    Ok(())
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp_millis()
        .init();
    let Some(args) = parse_args()? else {
        print!("{USAGE}");
        return Ok(());
    };
    if let Some(path) = &args.watch_steal {
        return watch_steal_into(path, args.duration, args.disk_probe.as_deref());
    }
    if let Some(path) = &args.calm_latency {
        return calm_latency(path);
    }
    // Before anything is written: a directory that cannot take the probe
    // fails here.
    let probe = args
        .disk_probe
        .as_deref()
        .map(disk_probe_file)
        .transpose()?;
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:taskhub@127.0.0.1:5432/taskhub".into());
    taskhub::migrate(&database_url)?;

    let run = uuid::Uuid::new_v4().simple().to_string();
    let stream = format!("bench:{run}");
    let group = format!("bench-{run}");
    let pad = "x".repeat(args.payload_bytes.saturating_sub(60));
    let failing_every = if args.fail_ratio > 0.0 {
        (1.0 / args.fail_ratio).round() as usize
    } else {
        0
    };
    let poison_every = if args.poison_ratio > 0.0 {
        let mut db = postgres::Client::connect(&database_url, postgres::NoTls)?;
        let found = db.query_opt(
            "SELECT 1 FROM pg_constraint WHERE conname = 'bench_poison' \
             AND conrelid = 'notifications'::regclass",
            &[],
        )?;
        if found.is_none() {
            return Err("--poison-ratio needs notifications to reject them: ALTER TABLE notifications \
                 ADD CONSTRAINT bench_poison CHECK (payload NOT LIKE '%\"poison\":true%') NOT VALID"
                .into());
        }
        (1.0 / args.poison_ratio).round() as usize
    } else {
        0
    };
    let poisoned = |n: usize| poison_every > 0 && n % poison_every == poison_every / 2;
    let fields = |n: usize| {
        let poison = if poisoned(n) { "\"poison\":true," } else { "" };
        let mut fields = vec![
            ("event_id".to_owned(), format!("{run}-{n}")),
            (
                "payload".to_owned(),
                format!("{{\"n\":{n},\"kind\":\"bench\",{poison}\"pad\":\"{pad}\"}}"),
            ),
        ];
        if failing_every > 0 && n.is_multiple_of(failing_every) {
            fields.push(("fail".to_owned(), "1".to_owned()));
        }
        fields
    };
    let mut producer = Producer::connect(&redis_url, &Tls::default(), &stream)?;
    if args.presize && args.rate > 0 {
        let mut redis = redis::Client::open(redis_url.as_str())?.get_connection()?;
        // A marker per event, and room for the few other keys of the run.
        let secs = args.duration.as_secs_f64().ceil().max(1.0) as u64;
        let markers = args.rate * secs * 11 / 10 + 1_000;
        let (fill, forked) = presize_redis(&mut redis, &format!("{stream}:fill:"), markers)?;
        println!("presized          {fill} placeholder keys: Redis holds {markers} more keys without growing its tables");
        if forked {
            println!("presize warning   Redis had a child process (a background save or AOF rewrite) while the placeholders went in: its tables may not be sized, or still moving");
        }
    }
    let mut failing = 0;
    // Of them, the ones the database rejects for good.
    let mut rejected = 0;
    let steady = args.rate > 0;
    if !steady {
        for chunk_start in (0..args.events).step_by(1000) {
            let batch: Vec<Vec<(String, String)>> = (chunk_start
                ..(chunk_start + 1000).min(args.events))
                .map(fields)
                .collect();
            failing += batch.iter().filter(|f| f.len() == 3).count();
            let poison = (chunk_start..(chunk_start + 1000).min(args.events))
                .filter(|n| poisoned(*n))
                .count();
            (failing, rejected) = (failing + poison, rejected + poison);
            producer.send_batch(&batch)?;
        }
    }

    let handler = std::sync::Arc::new(BenchHandler {
        sql: SqlHandler::new(args.sql.clone()),
        failures: Mutex::default(),
        fail_times: args.fail_times,
        latencies: Mutex::new(Vec::with_capacity(args.events)),
        commit_times: (args.rate > 0).then(Mutex::default),
        last_healthy_commit: Mutex::default(),
        trace: match &args.trace {
            Some(path) => Some(Mutex::new(std::io::BufWriter::new(
                std::fs::File::create(path).map_err(|e| format!("--trace {path}: {e}"))?,
            ))),
            None => None,
        },
    });
    let worker = Worker::builder()
        .redis_url(&redis_url)
        .database_url(&database_url)
        .stream(&stream)
        .group(&group)
        .workers(args.workers)
        .count(args.count)
        .block(Duration::from_millis(100))
        .backoff_base(args.backoff_base)
        .backoff_cap(args.backoff_base * 8)
        .max_attempts(args.fail_times + 3)
        .until_idle(!steady)
        .mode(args.mode)
        .build(handler.clone())?;
    let shutdown = worker.shutdown_handle();
    let monitor = worker.monitor();
    let (cpu_before, _) = usage();
    let machine_before = machine_ticks();
    let started = Instant::now();
    // While the producer ran (steady load), in microseconds, and how many
    // events it sent.
    let mut producing: Option<(u64, u64, usize)> = None;
    let stop_watching = AtomicBool::new(false);
    // The steady load, while the worker runs.
    let mut produce =
        |running: &std::thread::ScopedJoinHandle<'_, _>| -> Result<(), Box<dyn std::error::Error>> {
            // The steady state, not the start: events sent while the
            // worker was still connecting waited for it, and counted in
            // the steady run's latency.
            // A worker not ready within READY_WAIT (its Redis gone before
            // the first event, say) ends the run: the producer would wait
            // for it for ever.
            let waiting = Instant::now();
            while !running.is_finished() {
                match monitor.ready() {
                    Ok(()) => break,
                    Err(problems) if waiting.elapsed() > READY_WAIT => {
                        return Err(format!(
                            "the worker was not ready within {READY_WAIT:?}: {}",
                            problems.join("; ")
                        )
                        .into());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            let began = Instant::now();
            let began_us = now_micros();
            // One small pipeline per millisecond, each event stamped with
            // the producer's clock when its pipeline is built; then wait
            // for the last commit. A producer behind its schedule (Redis
            // slow to answer, or this thread not scheduled) catches up in
            // pipelines of at most CATCH_UP events, back to back: one
            // pipeline of everything due grows with the lag (about 500 MB
            // after seconds behind). The time an event waited in a
            // producer behind its schedule is not in its latency (nor was
            // it before).
            let total = (args.rate as f64 * args.duration.as_secs_f64()) as usize;
            let mut sent = 0;
            while sent < total && !running.is_finished() {
                let due = (began.elapsed().as_secs_f64() * args.rate as f64) as usize;
                let due = due.min(total);
                let upto = due.min(sent + CATCH_UP);
                if upto > sent {
                    let now = now_micros().to_string();
                    let batch: Vec<Vec<(String, String)>> = (sent..upto)
                        .map(|n| {
                            let mut f = fields(n);
                            f.push(("sent_us".to_owned(), now.clone()));
                            f
                        })
                        .collect();
                    producer.send_batch(&batch)?;
                    sent = upto;
                    if sent < due {
                        continue; // still behind: the next pipeline at once
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            producing = Some((began_us, now_micros(), sent));
            // The last commits, as long as commits come.
            let (mut committed, mut since) = (0, Instant::now());
            while committed < sent && !running.is_finished() {
                std::thread::sleep(Duration::from_millis(10));
                let now = handler.latencies.lock().unwrap().len();
                if now > committed {
                    (committed, since) = (now, Instant::now());
                } else if since.elapsed() > STUCK {
                    return Err(format!(
                        "{} of {sent} events not committed, and none for {STUCK:?}",
                        sent - committed
                    )
                    .into());
                }
            }
            shutdown.shutdown();
            Ok(())
        };
    let (summary, steal, stalls) =
        std::thread::scope(|scope| -> Result<_, Box<dyn std::error::Error>> {
            let watching = scope.spawn(|| watch_steal(&stop_watching));
            let probing = probe.map(|p| scope.spawn(|| probe_disk(p, &stop_watching)));
            let running = scope.spawn(|| worker.run());
            // A producer that fails (Redis gone, say) ends the run: the
            // worker would wait out the outage, and the samplers run until
            // it ends.
            let produced = if steady { produce(&running) } else { Ok(()) };
            if produced.is_err() {
                shutdown.shutdown();
            }
            let summary = running.join().expect("the worker thread panicked");
            stop_watching.store(true, Ordering::Relaxed);
            let steal = watching.join().expect("the steal sampler panicked");
            let stalls = probing.map(|p| p.join().expect("the disk probe panicked"));
            produced?;
            Ok((summary?, steal, stalls))
        })?;
    let elapsed = started.elapsed();
    let (cpu_after, peak_rss_kb) = usage();
    let machine_after = machine_ticks();
    let steal_pct = machine_after.0.saturating_sub(machine_before.0) as f64 * 100.0
        / machine_after.1.saturating_sub(machine_before.1).max(1) as f64;
    if let Some(trace) = &handler.trace {
        use std::io::Write;
        trace.lock().unwrap().flush()?;
    }
    let events = if steady {
        handler.latencies.lock().unwrap().len()
    } else {
        args.events
    };

    let mut db = postgres::Client::connect(&database_url, postgres::NoTls)?;
    let applied: i64 = db
        .query_one(
            "SELECT count(*) FROM processed_events WHERE scope = $1",
            &[&group],
        )?
        .get(0);
    let mut latencies = std::mem::take(&mut *handler.latencies.lock().unwrap());
    latencies.sort_unstable();
    let rate = events as f64 / elapsed.as_secs_f64();
    let healthy = events - failing;
    let healthy_elapsed = handler
        .last_healthy_commit
        .lock()
        .unwrap()
        .map_or(elapsed, |t| t - started);
    let healthy_rate = healthy as f64 / healthy_elapsed.as_secs_f64();
    let ms = |p: f64| percentile(&latencies, p) as f64 / 1000.0;
    // Steady load: the commits per second while the producer ran, its first
    // quarter left out (the worker's start, the first reads). With a
    // producer faster than the worker, this is what the machine commits
    // with a producer on it, which a drain of preloaded events overstates
    // (there the events were sent before the clock started).
    let sustained = producing.map_or(0.0, |(began, ended, _)| {
        let from = began + ended.saturating_sub(began) / 4;
        let Some(times) = &handler.commit_times else {
            return 0.0;
        };
        let times = times.lock().unwrap();
        let n = times
            .iter()
            .filter(|t| (from..=ended).contains(&t.0))
            .count();
        n as f64 * 1e6 / ended.saturating_sub(from).max(1) as f64
    });
    // What the producer managed (on two shared cores it may fall short of
    // --rate): a capacity measured with a producer the worker kept up with
    // is only the producer's speed.
    let produced = producing.map_or(0.0, |(began, ended, sent)| {
        sent as f64 * 1e6 / ended.saturating_sub(began).max(1) as f64
    });
    let cpu_us = (cpu_after - cpu_before) * 1e6 / events.max(1) as f64;
    println!("events            {events}");
    println!(
        "workers           {} (count {}, {:?} mode)",
        args.workers, args.count, args.mode
    );
    println!("applied           {applied} (verified in processed_events)");
    println!("elapsed           {:.2} s", elapsed.as_secs_f64());
    println!("rate              {rate:.0} events/s");
    if producing.is_some() {
        println!("sustained         {sustained:.0} events/s committed while the producer ran (its first quarter left out); it sent {produced:.0} events/s");
    }
    if failing > 0 {
        match poison_every {
            0 => println!(
                "failing events    {failing} (fail {} times, backoff base {:?})",
                args.fail_times, args.backoff_base
            ),
            _ => println!("failing events    {failing} (rejected by bench_poison, dead-lettered)"),
        }
        println!(
            "healthy rate      {healthy_rate:.0} events/s (last healthy commit at {:.2} s)",
            healthy_elapsed.as_secs_f64()
        );
    }
    let load = if steady {
        format!("steady load of {} events/s", args.rate)
    } else {
        "preloaded backlog".to_owned()
    };
    println!(
        "latency p50       {:.2} ms (XADD to commit, {load})",
        ms(0.5)
    );
    println!("latency p99       {:.2} ms", ms(0.99));
    println!("latency max       {:.2} ms", ms(1.0));
    println!(
        "cpu per event     {cpu_us:.1} µs (user+system, this process{})",
        if steady { ", producer included" } else { "" }
    );
    println!("peak rss          {:.1} MB", peak_rss_kb as f64 / 1024.0);
    println!("cpu steal         {steal_pct:.1}% (of the machine's CPU time, taken by the host)");
    let steal_figures = steal_fields(&steal);
    println!("steal bursts      {steal_figures} (100 ms samples with over {BURST_PCT}% taken)");
    let stalls = match stalls {
        Some(Ok(stalls)) => Some(stalls),
        Some(Err(e)) => {
            // The run's figures stand; only the stalls are unknown.
            println!("disk stalls       unknown: the probe failed ({e})");
            None
        }
        None => None,
    };
    let stall_figures = match &stalls {
        Some(stalls) => {
            let figures = stall_fields(stalls);
            println!(
                "disk stalls       {figures} (syncs of 8 KiB over {} ms, {} ms apart, in {})",
                STALL.as_millis(),
                PROBE_PAUSE.as_millis(),
                args.disk_probe.as_deref().unwrap_or_default()
            );
            format!(" {figures}")
        }
        None => String::new(),
    };
    // Under a steady load, the latency of the flights that met no burst
    // and no stall (no burst alone, where the disk was not probed).
    let through = if stalls.is_some() {
        "no burst, no stall"
    } else {
        "no burst"
    };
    let stalls = stalls.unwrap_or_default();
    let calm_figures = match &handler.commit_times {
        Some(times) => format!(" {}", calm_fields(&steal, &stalls, &times.lock().unwrap())),
        None => String::new(),
    };
    if !calm_figures.is_empty() {
        println!("latency, calm    {calm_figures} (XADD to commit through {through})");
    }
    println!("summary           {summary}");
    println!(
        "RESULT rate={rate:.0} healthy_rate={healthy_rate:.0} sustained={sustained:.0} produced={produced:.0} p50_ms={:.2} p99_ms={:.2} max_ms={:.2} cpu_us={cpu_us:.1} rss_kb={peak_rss_kb} steal_pct={steal_pct:.1} {steal_figures}{stall_figures}{calm_figures} applied={applied}",
        ms(0.5),
        ms(0.99),
        ms(1.0),
    );
    // The benchmark's keys are scratch data: its stream and the keys beside
    // it, and its duplicate markers (`th:<namespace>:<len>:<scope>:<id>`),
    // which would otherwise stay for the marker TTL. Left behind, a
    // bench.sh run's millions of markers made Redis slower for every run
    // after it (rehashing its key space mid-run).
    let mut redis = redis::Client::open(redis_url.as_str())?.get_connection()?;
    for pattern in [
        format!("{stream}*"),
        format!("th:*:{}:{group}:*", group.len()),
    ] {
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(10_000)
                .query(&mut redis)?;
            if !keys.is_empty() {
                redis::cmd("UNLINK").arg(&keys).query::<()>(&mut redis)?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    if applied as usize != events - rejected {
        return Err(format!("expected {} effects, found {applied}", events - rejected).into());
    }
    Ok(())
}
