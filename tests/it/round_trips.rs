//! Round trips to Redis on the hot path, counted by a private server's
//! `INFO commandstats` (every call these tests make there is theirs).
//!
//! Under a steady trickle, the common load of a small deployment, entries
//! arrive one at a time: each read blocks, and each read is cut into jobs
//! of one event so they run side by side. These tests pin that such an
//! entry is not paid for with a round trip per step.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::support::*;

/// Calls per command on the server of `conn` since the last reset (script
/// calls included: `xack` counts one per ack script).
fn calls(conn: &mut redis::Connection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let n = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), n))
        })
        .collect()
}

/// A worker in per-event mode (4 workers, reads of up to 64) on `stream` of
/// the private Redis `r`, with one event applied first, so that it knows
/// its marker namespace (the read script looks markers up from then on);
/// the server's command counts are reset after `settle`.
fn warm_worker(
    r: &PrivateRedis,
    db: &TestDb,
    (stream, group): (&str, &str),
    settle: Duration,
) -> (redis::Connection, Running) {
    let mut conn = redis(&r.url());
    let running = Running::start(
        fast_builder(&r.url(), &db.url, stream, group)
            .mode(taskhub::Mode::PerEvent)
            .workers(4)
            .count(64),
        taskhub::SqlHandler::default(),
    );
    xadd(&mut conn, stream, &[("event_id", "warm"), ("payload", "p")]);
    applied_and_acked(&mut conn, db, (stream, group), 1, "the first event");
    std::thread::sleep(settle);
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut conn)
        .unwrap();
    (conn, running)
}

/// Waits until `n` events are applied and nothing is pending.
fn applied_and_acked(
    conn: &mut redis::Connection,
    db: &TestDb,
    (stream, group): (&str, &str),
    n: i64,
    what: &str,
) {
    assert!(
        wait_until(Duration::from_secs(20), || pending(conn, stream, group)
            == 0
            && db.count("SELECT count(*) FROM processed_events") == n),
        "{what} not applied and acked: {} pending",
        pending(conn, stream, group)
    );
}

/// A trickle of 60 entries, one every 2 ms, to 4 workers in per-event mode.
/// Each entry is read by a blocking read followed by one read script call,
/// which records its event id in the in-flight ids and looks its marker up
/// (no marker check of its own, which sends a GET per marker where the
/// read script sends one MGET per read); and finished entries are acked
/// together for a few milliseconds, not one ack per job. Before, an entry
/// cost an empty read, the blocking read, an HSET, a marker check and an
/// ack of its own: 60 XACK calls and 60 marker checks (a GET and an HMGET
/// each) here.
#[test]
fn a_trickle_shares_its_reads_and_acks() {
    let r = PrivateRedis::start();
    let db = TestDb::new();
    let (stream, group) = (unique("trickle"), unique("g"));
    let (mut conn, running) = warm_worker(&r, &db, (&stream, &group), Duration::ZERO);
    let n = 60;
    let started = Instant::now();
    for i in 0..n {
        xadd(
            &mut conn,
            &stream,
            &[("event_id", &format!("t-{i}")), ("payload", "p")],
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    applied_and_acked(&mut conn, &db, (&stream, &group), 1 + n, "the trickle");
    // Each of the 4 workers acks at most once per 50 ms hold: a trickle
    // slowed down by a loaded machine allows more acks than half.
    let holds = (started.elapsed().as_millis() / 50 + 2) as u64;
    let most_acks = (n as u64 / 2).max(4 * holds);
    let calls = calls(&mut conn);
    let summary = running.stop();
    assert_eq!(summary.applied, 1 + n as u64, "{summary}");
    let get = |name: &str| calls.get(name).copied().unwrap_or(0);
    assert_eq!(get("get"), 0, "marker checks of their own: {calls:?}");
    assert!(
        get("mget") > 0,
        "no marker looked up by the reads: {calls:?}"
    );
    assert!(
        get("xack") <= most_acks && get("xack") < n as u64,
        "{} ack round trips for {n} entries (at most {most_acks} for this trickle's pace): {calls:?}",
        get("xack")
    );
    assert!(
        get("xreadgroup") <= 2 * n as u64 + 10,
        "{} reads for {n} entries: {calls:?}",
        get("xreadgroup")
    );
}

/// A steady load of small bursts (5 entries every 10 ms, the shape of a
/// producer that sends in batches), in per-event mode: a read that comes
/// back short of its room took all there was, so the next one blocks at
/// once. A burst is then read in two calls (the blocking XREADGROUP, and the
/// read script with the rest), not three: before, only a read that found
/// nothing after its blocked entry counted as drained, so every burst was
/// followed by a read script that found nothing (three XREADGROUPs a burst
/// here, counting the scripts').
#[test]
fn bursts_are_read_in_two_calls_not_three() {
    let r = PrivateRedis::start();
    let db = TestDb::new();
    let (stream, group) = (unique("bursts"), unique("g"));
    // Reading the stream idle may have sent a read script first: counted
    // from a read that blocks.
    let settle = Duration::from_millis(300);
    let (mut conn, running) = warm_worker(&r, &db, (&stream, &group), settle);
    let bursts = 40;
    for b in 0..bursts {
        let ids: Vec<String> = (0..5).map(|i| format!("b-{b}-{i}")).collect();
        xadd_events(&mut conn, &stream, &ids);
        std::thread::sleep(Duration::from_millis(10));
    }
    let n = 1 + 5 * bursts;
    applied_and_acked(&mut conn, &db, (&stream, &group), n, "the bursts");
    let calls = calls(&mut conn);
    let summary = running.stop();
    assert_eq!(summary.applied, n as u64, "{summary}");
    let reads = calls.get("xreadgroup").copied().unwrap_or(0);
    // Two a burst, and a few to spare for a burst that came in two reads.
    assert!(
        reads <= 2 * bursts as u64 + 10,
        "{reads} XREADGROUP calls for {bursts} bursts: {calls:?}"
    );
}

/// A sparse trickle under a long BLOCK (the default is 2 s): an entry that
/// comes late in the wait is still fresh when it is handed on, so the read
/// script's marker letter is used (no marker check of its own) and the
/// one-statement transaction runs. Before, the read was dated from before
/// the wait: an entry that came over a second into it counted as held
/// long, and took the slow path with a marker check of its own.
#[test]
fn an_entry_late_in_a_long_block_is_fresh() {
    let r = PrivateRedis::start();
    let db = TestDb::new();
    let (stream, group) = (unique("sparse"), unique("g"));
    let mut conn = redis(&r.url());
    let running = Running::start(
        fast_builder(&r.url(), &db.url, &stream, &group)
            .mode(taskhub::Mode::PerEvent)
            .block(Duration::from_secs(5)),
        taskhub::SqlHandler::default(),
    );
    let applied = |n: i64| {
        wait_until(Duration::from_secs(20), || {
            db.count("SELECT count(*) FROM processed_events") == n
        })
    };
    xadd(
        &mut conn,
        &stream,
        &[("event_id", "warm"), ("payload", "p")],
    );
    assert!(applied(1), "the first event was not applied");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut conn)
        .unwrap();
    for i in 0..2 {
        // Well into the reader's next wait.
        std::thread::sleep(Duration::from_millis(1500));
        xadd(
            &mut conn,
            &stream,
            &[("event_id", &format!("late-{i}")), ("payload", "p")],
        );
        assert!(applied(2 + i), "late-{i} was not applied");
    }
    let calls = calls(&mut conn);
    let summary = running.stop();
    assert_eq!(summary.applied, 3, "{summary}");
    assert_eq!(
        calls.get("get").copied().unwrap_or(0),
        0,
        "marker checks of their own: {calls:?}"
    );
}

/// Fails each event's first attempt (retryable), then inserts its effect.
struct FailsOnce(std::sync::Mutex<std::collections::HashSet<String>>);

impl taskhub::Handler for FailsOnce {
    fn handle(
        &self,
        event: &taskhub::Event,
        tx: &mut taskhub::Tx<'_>,
    ) -> Result<(), taskhub::HandlerError> {
        if self.0.lock().unwrap().insert(event.event_id().to_owned()) {
            return Err(taskhub::HandlerError::retryable("first attempt"));
        }
        tx.execute(
            "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)",
            &[&event.event_id(), &event.payload()],
        )?;
        Ok(())
    }
}

/// The script calls that read retries back: the retry thread's ownership
/// check with the entries' fields (an EVAL with a `fields` argument), from a
/// slow log that keeps every command. (The check before a COMMIT runs the
/// same script without fields.)
fn read_back_calls(conn: &mut redis::Connection) -> usize {
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query(conn)
        .unwrap();
    log.iter()
        .filter(|entry| {
            let redis::Value::Array(parts) = entry else {
                return false;
            };
            let Some(redis::Value::Array(args)) = parts.get(3) else {
                return false;
            };
            let arg = |a: &redis::Value| match a {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            };
            args.first()
                .is_some_and(|a| arg(a).eq_ignore_ascii_case("eval"))
                && args.iter().any(|a| arg(a) == "fields")
        })
        .count()
}

/// Runs `events` (payloads of `size` bytes), each failing once with a
/// backoff of `backoff` (half of it to all of it), to the end, with
/// `--reclaim-min-idle` `min_idle` (the longest wait is 5 s, the
/// `max_retry_after` of `fast_builder`); returns the script calls that read
/// retries back.
fn retry_reads(events: usize, size: usize, backoff: Duration, min_idle: Duration) -> usize {
    let r = PrivateRedis::start();
    let db = TestDb::new();
    let (stream, group) = (unique("retry"), unique("g"));
    let mut conn = redis(&r.url());
    for (name, value) in [
        ("slowlog-log-slower-than", "0"),
        ("slowlog-max-len", "1000000"),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut conn)
            .unwrap();
    }
    let payload = "p".repeat(size);
    for i in 0..events {
        xadd(
            &mut conn,
            &stream,
            &[("event_id", &format!("r-{i}")), ("payload", &payload)],
        );
    }
    let summary = Running::start(
        fast_builder(&r.url(), &db.url, &stream, &group)
            .until_idle(true)
            .backoff_base(backoff)
            .backoff_cap(backoff)
            .reclaim_min_idle(min_idle),
        FailsOnce(Default::default()),
    )
    .join(Duration::from_secs(60));
    assert_eq!(summary.applied, events as u64, "{summary}");
    assert_eq!(summary.retries, events as u64, "{summary}");
    let ids: Vec<String> = (0..events).map(|i| format!("r-{i}")).collect();
    db.assert_effects_once(&ids);
    read_back_calls(&mut conn)
}

/// A retry due well within the least `--reclaim-min-idle` (2 s) of its read
/// is still this consumer's: it goes back to the pool with the event it
/// kept, without asking Redis. Before, each due batch of retries made a
/// script call that checked, refreshed and read back every entry (an
/// XPENDING, an XRANGE and an XCLAIM each).
#[test]
fn a_retry_due_soon_asks_redis_nothing() {
    let reads = retry_reads(40, 100, Duration::from_millis(100), Duration::from_secs(10));
    assert_eq!(reads, 0, "script calls that read retries back");
}

/// Going back without asking does not reset the entry's idle time, so it is
/// done only where `--reclaim-min-idle` leaves room for one more of the
/// longest waits (and a second for the run) after it: with 6 s of min-idle
/// and 5 s waits, every retry is checked and refreshed, as before.
#[test]
fn a_retry_is_checked_where_min_idle_leaves_no_room_for_another_wait() {
    let reads = retry_reads(40, 100, Duration::from_millis(100), Duration::from_secs(6));
    assert!(reads >= 1, "no retry read back");
}

/// The events the retries keep are bounded (4 MiB): past that, a retry
/// keeps only its id and reads its fields back when due, as any long wait
/// does, and nothing is lost either way. (All 12 fail before the first is
/// due, 0.5 to 1 s later: at most 5 of their 700 kB events fit.)
#[test]
fn retries_keep_at_most_a_few_megabytes_of_events() {
    let reads = retry_reads(12, 700_000, Duration::from_secs(1), Duration::from_secs(10));
    assert!(reads >= 1, "no retry of 700 kB read back");
}

/// An idle stream costs one blocking read per BLOCK and nothing else: a
/// read that waited a whole BLOCK for nothing leaves the stream drained, so
/// the next one blocks at once. Before, each was followed by a read script
/// that found nothing: 16 XREADGROUPs (counting the scripts') and 8 script
/// calls in these 2 s at the tests' 200 ms BLOCK, where it is now 9 and none.
#[test]
fn an_idle_stream_costs_one_blocking_read_per_block() {
    let r = PrivateRedis::start();
    let db = TestDb::new();
    let (stream, group) = (unique("idle"), unique("g"));
    let settle = Duration::from_millis(300);
    let (mut conn, running) = warm_worker(&r, &db, (&stream, &group), settle);
    let counted = Instant::now(); // the counts were reset just before
    std::thread::sleep(Duration::from_secs(2));
    let calls = calls(&mut conn);
    // A loaded machine stretches the window the counts cover.
    let blocks = (counted.elapsed().as_millis() / 200) as u64;
    running.stop();
    let get = |name: &str| calls.get(name).copied().unwrap_or(0);
    let reads = get("xreadgroup");
    assert!(
        (5..=blocks + 2).contains(&reads),
        "{reads} reads in {blocks} BLOCKs of 200 ms of an idle stream: {calls:?}"
    );
    assert_eq!(get("evalsha"), 0, "a read script while idle: {calls:?}");
}

/// Each worker readies its PostgreSQL connection before its first event
/// (`Processor::warm_up`): the fused batch statement planned and run once
/// for no event, in a transaction rolled back, and its statements
/// prepared, so the first events after a start do not queue behind every
/// new backend reading its catalog and planning. Seen by a statement
/// trigger on `notifications` (which fires for no row): each worker ran
/// the statement (the trigger's `nextval`, which no rollback takes back),
/// and nothing it wrote stayed, nor any row of ours.
#[test]
fn each_worker_readies_its_connection_before_the_first_event() {
    for mode in [taskhub::Mode::Batch, taskhub::Mode::PerEvent] {
        let db = TestDb::new();
        let (stream, group) = (unique("warm"), unique("g"));
        let workers = 3;
        db.client()
            .batch_execute(
                "CREATE SEQUENCE runs; CREATE TABLE fired (at timestamptz DEFAULT now()); \
                 CREATE FUNCTION note_insert() RETURNS trigger LANGUAGE plpgsql AS \
                   $$ BEGIN PERFORM nextval('runs'); INSERT INTO fired DEFAULT VALUES; \
                   RETURN NULL; END $$; \
                 CREATE TRIGGER noted AFTER INSERT ON notifications \
                   FOR EACH STATEMENT EXECUTE FUNCTION note_insert()",
            )
            .unwrap();
        let _running = Running::start(
            fast_builder(&redis_url(), &db.url, &stream, &group)
                .mode(mode)
                .workers(workers),
            taskhub::SqlHandler::default(),
        );
        let runs = || db.count("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM runs");
        assert!(
            wait_until(Duration::from_secs(20), || runs() >= workers as i64),
            "{mode:?}: the fused statement ran {} times for {workers} workers before any event",
            runs()
        );
        for table in ["fired", "processed_events", "notifications"] {
            let n = db.count(&format!("SELECT count(*) FROM {table}"));
            assert_eq!(n, 0, "{mode:?}: {table}");
        }
    }
}

/// A migration holding `processed_events` (CREATE INDEX takes a SHARE
/// lock) while a worker starts: the warm-up waits a second at most for
/// each lock, so an idle worker still stops at once (it waited for the
/// lock, past the shutdown's deadline); once the lock is gone, the first
/// events are applied once, on connections that kept nothing of the
/// warm-up's bound (the statement records the session's `lock_timeout`).
#[test]
fn a_table_locked_at_start_neither_holds_a_shutdown_nor_stays_on_the_connection() {
    let db = TestDb::new();
    db.client()
        .batch_execute("CREATE TABLE seen (event_id text PRIMARY KEY, lock_timeout text)")
        .unwrap();
    let (stream, group) = (unique("warm-lock"), unique("g"));
    let start = || {
        Running::start(
            fast_builder(&redis_url(), &db.url, &stream, &group)
                .reclaim_min_idle(Duration::from_secs(300)),
            taskhub::SqlHandler::new(
                "INSERT INTO seen VALUES ($1, current_setting('lock_timeout'))",
            ),
        )
    };
    let mut locker = db.client();
    locker
        .batch_execute("BEGIN; LOCK TABLE processed_events IN SHARE MODE")
        .unwrap();
    let running = start();
    std::thread::sleep(Duration::from_millis(500));
    let asked = std::time::Instant::now();
    running.stop();
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "an idle worker took {:?} to stop",
        asked.elapsed()
    );

    let running = start();
    // Past the warm-up's wait.
    std::thread::sleep(Duration::from_millis(2500));
    locker.batch_execute("ROLLBACK").unwrap();
    let ids: Vec<String> = (0..20).map(|i| format!("e{i}")).collect();
    xadd_events(&mut redis(&redis_url()), &stream, &ids);
    assert!(wait_until(Duration::from_secs(20), || {
        db.count("SELECT count(*) FROM seen") == 20
    }));
    running.stop();
    assert_eq!(
        db.count("SELECT count(*) FROM seen WHERE lock_timeout <> '0'"),
        0,
        "events ran with the warm-up's lock_timeout"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events"), 20);
}
