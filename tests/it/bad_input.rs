//! The bad-input corpus not covered elsewhere (failures.rs covers odd and
//! invalid event_ids, exactly_once.rs binary values and duplicates in one
//! batch, cli.rs bad configurations): each input has a defined outcome
//! (applied, or dead-lettered with a clear reason), nothing crashes and
//! nothing stays pending.
//!
//! - an entry with 1,000 fields: applied, every field reaches the handler
//!   (library handler and `taskhub run --sql` with `$3`);
//! - an oversize entry, and one of many empty fields (16 bytes a field
//!   count towards the limit): the same dead letter whether it arrives in
//!   the blocking read or in a backlog;
//! - a 5 MB payload: dead-lettered as invalid with the default entry limit,
//!   the reason naming the size and the limit, the payload kept whole in the
//!   dead letter; applied with `--max-entry-bytes 8000000`;
//! - the stream deleted (`DEL`) while the worker reads, with an event waiting
//!   for its retry: the worker keeps running, recreates its group, applies
//!   the entries added afterwards, and drops the waiting retry of the deleted
//!   entry instead of applying or dead-lettering it.
//! - a key of the wrong type beside the stream, a Redis user that may not
//!   run scripts: a start-up error saying what to fix.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;
use taskhub::{handler_fn, Builder, DeadLetterKind, Event, HandlerError, Tx};

const INSERT: &str = "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)";

fn builder(db_url: &str, stream: &str, group: &str) -> Builder {
    fast_builder(&redis_url(), db_url, stream, group)
}

fn xadd_raw(conn: &mut redis::Connection, stream: &str, fields: &[(Vec<u8>, Vec<u8>)]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(k).arg(v);
    }
    cmd.query(conn).unwrap()
}

fn del(conn: &mut redis::Connection, keys: &[&str]) {
    let _: i64 = redis::cmd("DEL").arg(keys).query(conn).unwrap();
}

/// `taskhub run --until-idle` with fast timings; returns the summary line
/// parsed, after asserting exit 0.
fn run_binary(db: &TestDb, stream: &str, group: &str, extra: &[&str]) -> BTreeMap<String, u64> {
    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.args([
        "run",
        "--stream",
        stream,
        "--group",
        group,
        "--consumer",
        "c1",
    ])
    .args(["--workers", "2", "--block-ms", "200", "--until-idle"])
    .args(["--backoff-base", "10ms", "--backoff-cap", "100ms"])
    .args(extra);
    let mut p = Proc::spawn(cmd);
    let status = p.wait(Duration::from_secs(60));
    assert!(status.success(), "exit {status}\nstderr:\n{}", p.stderr());
    parse_summary(&p.stdout())
}

// ---------------------------------------------------------------------------

/// 1,000 fields (binary values among them): one effect, and the handler sees
/// every field, in order, byte for byte. The same entry (text values only)
/// through `taskhub run --sql` with `$3`: all 1,000 fields in the JSON.
#[test]
fn entry_with_a_thousand_fields_is_applied_with_every_field() {
    let db = TestDb::new();
    let (stream, group) = (unique("s"), unique("g"));
    let mut conn = redis(&redis_url());
    let mut fields: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (b"event_id".to_vec(), b"wide-1".to_vec()),
        (b"payload".to_vec(), b"many fields".to_vec()),
    ];
    for i in 2..1000 {
        let value = match i % 3 {
            0 => format!("value {i}").into_bytes(),
            1 => vec![0xff, 0x00, (i % 256) as u8],
            _ => Vec::new(),
        };
        fields.push((format!("f{i:04}").into_bytes(), value));
    }
    assert_eq!(fields.len(), 1000);
    xadd_raw(&mut conn, &stream, &fields);
    xadd(
        &mut conn,
        &stream,
        &[("event_id", "narrow-1"), ("payload", "p")],
    );

    let seen: Arc<Mutex<HashMap<String, taskhub::Fields>>> = Arc::default();
    let s = seen.clone();
    let worker = builder(&db.url, &stream, &group)
        .until_idle(true)
        .build(handler_fn(move |event: &Event, tx: &mut Tx<'_>| {
            s.lock()
                .unwrap()
                .insert(event.event_id().to_owned(), event.fields().to_vec());
            tx.execute(INSERT, &[&event.event_id(), &event.payload()])?;
            Ok::<(), HandlerError>(())
        }))
        .unwrap();
    let summary = Running::of(worker).join(Duration::from_secs(40));

    assert_eq!(
        (summary.applied, summary.dead_lettered),
        (2, 0),
        "{summary}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen["wide-1"].len(), 1000);
    assert!(
        seen["wide-1"] == fields,
        "fields reached the handler intact"
    );
    assert_eq!(db.effects("wide-1"), 1);
    assert_eq!(db.effects("narrow-1"), 1);
    assert_eq!(pending(&mut conn, &stream, &group), 0);

    // The CLI's SQL handler: $3 is every field as one JSON object.
    let stream2 = unique("s");
    let text_fields: Vec<(Vec<u8>, Vec<u8>)> =
        std::iter::once((b"event_id".to_vec(), b"wide-2".to_vec()))
            .chain((1..1000).map(|i| {
                (
                    format!("f{i:04}").into_bytes(),
                    format!("v{i}").into_bytes(),
                )
            }))
            .collect();
    xadd_raw(&mut conn, &stream2, &text_fields);
    let summary = run_binary(
        &db,
        &stream2,
        &group,
        &[
            "--sql",
            // wide-2 has no payload: $2 is NULL.
            "INSERT INTO notifications (event_id, payload) VALUES ($1, coalesce($2::text, '') || $3::text)",
        ],
    );
    assert_eq!(summary["applied"], 1, "{summary:?}");
    assert_eq!(summary["dead_lettered"], 0, "{summary:?}");
    let json: String = db
        .client()
        .query_one(
            "SELECT payload FROM notifications WHERE event_id = 'wide-2'",
            &[],
        )
        .unwrap()
        .get(0);
    let object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(object.len(), 1000, "all fields in $3");
    assert_eq!(object["event_id"], "wide-2");
    assert_eq!(object["f0999"], "v999");
    assert_eq!(pending(&mut conn, &stream2, &group), 0);
    del(&mut conn, &[&stream, &stream2]);
}

/// A 5 MB payload with the default limit (1 MiB): dead-lettered at once as
/// invalid, the reason naming the entry's size and the limit, every byte of
/// the payload kept in the dead letter, its neighbours applied. With
/// `--max-entry-bytes 8000000` the same entry is applied, payload whole.
#[test]
fn five_megabyte_payload_is_dead_lettered_by_default_and_applied_when_allowed() {
    let db = TestDb::new();
    let group = unique("g");
    let mut conn = redis(&redis_url());
    let big: Vec<u8> = (0..5 * 1024 * 1024)
        .map(|i| b'a' + (i % 26) as u8)
        .collect();
    let size = big.len() + "payload".len() + "event_id".len() + "big-1".len();

    let stream = unique("s");
    xadd(
        &mut conn,
        &stream,
        &[("event_id", "small-1"), ("payload", "p")],
    );
    let big_fields = vec![
        (b"event_id".to_vec(), b"big-1".to_vec()),
        (b"payload".to_vec(), big.clone()),
    ];
    let big_entry = xadd_raw(&mut conn, &stream, &big_fields);
    xadd(
        &mut conn,
        &stream,
        &[("event_id", "small-2"), ("payload", "p")],
    );

    let summary = run_binary(&db, &stream, &group, &[]);
    assert_eq!(summary["applied"], 2, "{summary:?}");
    assert_eq!(summary["dead_lettered"], 1, "{summary:?}");
    assert_eq!(summary["invalid"], 1, "{summary:?}");
    assert_eq!(db.effects("big-1"), 0);
    assert_eq!(db.effects("small-1"), 1);
    assert_eq!(db.effects("small-2"), 1);
    assert_eq!(pending(&mut conn, &stream, &group), 0);
    let letters = dead_letters(&mut conn, &stream);
    assert_eq!(letters.len(), 1, "one dead letter");
    let l = &letters[0];
    assert_eq!(l.kind, DeadLetterKind::Invalid);
    assert_eq!(l.original_id, big_entry);
    assert_eq!(l.event_id.as_deref(), Some("big-1"));
    assert!(
        l.reason.contains(&format!("{size} bytes"))
            && l.reason
                .contains(&format!("limit of {} bytes", 1024 * 1024)),
        "the reason names the size and the limit: {}",
        l.reason
    );
    // Not the 5 MB: each field's name and first 256 bytes, and its size in
    // the reason (memory stays bounded by the limit, here and in Redis).
    assert_eq!(l.field("payload"), Some(&big[..256]));
    assert_eq!(l.fields.len(), big_fields.len(), "every field named");
    assert!(
        l.reason.contains(&format!("payload {}", big.len())),
        "{}",
        l.reason
    );

    // Allowed: applied, the payload stored whole.
    let stream2 = unique("s");
    xadd_raw(&mut conn, &stream2, &big_fields);
    let summary = run_binary(&db, &stream2, &group, &["--max-entry-bytes", "8000000"]);
    assert_eq!(summary["applied"], 1, "{summary:?}");
    assert_eq!(summary["dead_lettered"], 0, "{summary:?}");
    let stored: String = db
        .client()
        .query_one(
            "SELECT payload FROM notifications WHERE event_id = 'big-1'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(stored.as_bytes() == big.as_slice(), "payload stored whole");
    assert_eq!(db.effects("big-1"), 1);
    assert_eq!(pending(&mut conn, &stream2, &group), 0);
    assert!(dead_letters(&mut conn, &stream2).is_empty());
    let dlq = taskhub::dlq::dead_letter_stream(&stream);
    del(&mut conn, &[&stream, &stream2, &dlq]);
}

/// `DEL stream` while the worker reads and one event waits for its retry:
/// no crash, the worker keeps running, recreates the group (it lived in the
/// deleted key), applies every entry added afterwards exactly once, and
/// drops the waiting retry of the deleted entry (it is gone: not applied,
/// not dead-lettered). `run()` returning by itself (`until_idle`) shows the
/// dropped retry was finished and nothing was left in flight.
#[test]
fn stream_deleted_while_the_worker_reads_then_new_entries_are_applied() {
    let db = TestDb::new();
    let (stream, group) = (unique("s"), unique("g"));
    let mut conn = redis(&redis_url());
    let before: Vec<String> = (0..20).map(|i| format!("before-{i}")).collect();
    for id in &before {
        xadd(&mut conn, &stream, &[("event_id", id), ("payload", "p")]);
    }
    xadd(
        &mut conn,
        &stream,
        &[("event_id", "waiting"), ("payload", "p")],
    );

    let waiting_calls = Arc::new(AtomicUsize::new(0));
    let w = waiting_calls.clone();
    let worker = builder(&db.url, &stream, &group)
        .until_idle(true)
        .build(handler_fn(move |event: &Event, tx: &mut Tx<'_>| {
            if event.event_id() == "waiting" {
                w.fetch_add(1, Ordering::SeqCst);
                return Err(
                    HandlerError::retryable("not yet").with_retry_after(Duration::from_secs(5))
                );
            }
            tx.execute(INSERT, &[&event.event_id(), &event.payload()])?;
            Ok(())
        }))
        .unwrap();
    let running = Running::of(worker);
    assert!(
        wait_until(Duration::from_secs(20), || {
            db.count("SELECT count(*) FROM notifications") == 20
                && waiting_calls.load(Ordering::SeqCst) == 1
        }),
        "the first events were not processed"
    );
    let deleted_at = Instant::now();
    del(&mut conn, &[&stream]);

    // The reader finds its group gone and creates it again (MKSTREAM).
    let group_exists = |conn: &mut redis::Connection| -> bool {
        let groups: redis::RedisResult<Vec<HashMap<String, redis::Value>>> =
            redis::cmd("XINFO").arg("GROUPS").arg(&stream).query(conn);
        groups.is_ok_and(|g| g.len() == 1)
    };
    assert!(
        wait_until(Duration::from_secs(10), || group_exists(&mut conn)),
        "the group was not recreated"
    );
    let after: Vec<String> = (0..20).map(|i| format!("after-{i}")).collect();
    for id in &after {
        xadd(&mut conn, &stream, &[("event_id", id), ("payload", "p")]);
    }
    assert!(
        deleted_at.elapsed() < Duration::from_secs(4),
        "the new entries must arrive while the retry still waits (machine too slow?)"
    );
    let summary = running.join(Duration::from_secs(40));

    let mut all = before.clone();
    all.extend(after.iter().cloned());
    for id in &all {
        assert_eq!(db.effects(id), 1, "{id}");
    }
    assert_eq!(db.count("SELECT count(*) FROM notifications"), 40);
    assert_eq!(
        db.effects("waiting"),
        0,
        "the deleted entry was not applied"
    );
    assert_eq!(
        waiting_calls.load(Ordering::SeqCst),
        1,
        "the retry of the deleted entry did not run the handler"
    );
    assert_eq!(summary.applied, 40, "{summary}");
    assert_eq!(summary.retries, 1, "{summary}");
    assert_eq!(summary.dead_lettered, 0, "{summary}");
    assert!(dead_letters(&mut conn, &stream).is_empty());
    assert!(group_exists(&mut conn));
    assert_eq!(pending(&mut conn, &stream, &group), 0);
    assert_eq!(xlen(&mut conn, &stream), 20, "only the new entries");
    del(&mut conn, &[&stream]);
}

/// Wide entries without an event_id are dead-lettered whole: 1,000 fields
/// (written by the conditional Lua step) and 5,000 fields (over what Lua's
/// `unpack` takes, written with MULTI/EXEC). Pins the fallback of the
/// conditional dead-letter write (see tests/it/chaos.rs): a letter over Lua's
/// limit would fail to write, and the writer would retry it forever.
#[test]
fn very_wide_invalid_entries_are_dead_lettered_whole() {
    let db = TestDb::new();
    let (stream, group) = (unique("s"), unique("g"));
    let mut conn = redis(&redis_url());
    let wide = |n: usize| -> Vec<(Vec<u8>, Vec<u8>)> {
        (0..n)
            .map(|i| (format!("k{i:05}").into_bytes(), vec![(i % 251) as u8; 3]))
            .collect()
    };
    let (a, b) = (wide(1000), wide(5000));
    let entry_a = xadd_raw(&mut conn, &stream, &a);
    let entry_b = xadd_raw(&mut conn, &stream, &b);
    xadd(
        &mut conn,
        &stream,
        &[("event_id", "after"), ("payload", "p")],
    );

    let worker = builder(&db.url, &stream, &group)
        .until_idle(true)
        .build(taskhub::SqlHandler::default())
        .unwrap();
    let summary = Running::of(worker).join(Duration::from_secs(40));

    assert_eq!(summary.dead_invalid, 2, "{summary}");
    assert_eq!(summary.applied, 1, "{summary}");
    assert_eq!(db.effects("after"), 1);
    assert_eq!(pending(&mut conn, &stream, &group), 0);
    let letters = dead_letters(&mut conn, &stream);
    assert_eq!(letters.len(), 2);
    for (entry, fields) in [(&entry_a, &a), (&entry_b, &b)] {
        let l = letters
            .iter()
            .find(|l| &l.original_id == entry)
            .unwrap_or_else(|| panic!("no dead letter for {entry}"));
        assert_eq!(l.kind, DeadLetterKind::Invalid);
        assert!(l.reason.contains("missing field event_id"), "{}", l.reason);
        assert!(&l.fields == fields, "{} fields kept whole", fields.len());
    }
    let dlq = taskhub::dlq::dead_letter_stream(&stream);
    del(&mut conn, &[&stream, &dlq]);
}

/// An oversize entry that arrives while the worker waits in its blocking
/// read (taken whole by XREADGROUP, and cut down as it is parsed) gets the
/// same dead letter as the same entry read from a backlog (cut down in
/// Redis by the read script): the same fields kept (64 of 72, 256 bytes of
/// each), the same reason; the event after it is applied.
#[test]
fn an_oversize_entry_gets_the_same_dead_letter_from_a_blocking_read_as_from_a_backlog() {
    let mut big: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (b"event_id".to_vec(), b"big".to_vec()),
        (b"payload".to_vec(), vec![b'p'; 5000]),
    ];
    big.extend((0..70).map(|i| (format!("f{i:02}").into_bytes(), vec![b'v'; 300])));
    let letter = dead_letter_from_a_blocking_read_and_from_a_backlog(&big, 1024);
    assert!(
        letter.reason.contains("over the limit of 1024 bytes"),
        "{}",
        letter.reason
    );
    assert_eq!(letter.fields.len(), 64, "the first 64 fields kept");
    assert_eq!(letter.field("payload"), Some(&[b'p'; 256][..]));
}

/// An entry of many empty fields counts what it takes to hold (16 bytes a
/// field beside its names and values), read whole or from a backlog: 1,001
/// fields of 12 bytes in all are 16,028 bytes, over a limit of 4,096, and
/// dead-lettered as oversize. Counted by their bytes alone, they passed any
/// limit: a producer's entries of a million empty fields were 0 bytes each
/// to the in-flight budget and 16 MB each to hold (seen failing: applied).
#[test]
fn an_entry_of_many_empty_fields_counts_what_it_takes_to_hold() {
    let mut wide: Vec<(Vec<u8>, Vec<u8>)> = vec![(b"event_id".to_vec(), b"wide".to_vec())];
    wide.extend((0..1000).map(|_| (Vec::new(), Vec::new())));
    let letter = dead_letter_from_a_blocking_read_and_from_a_backlog(&wide, 4096);
    assert!(
        letter.reason.starts_with(
            "entry is 12 bytes in 1001 fields, over the limit of 4096 bytes (it counts 16028 with 16 bytes a field)"
        ),
        "{}",
        letter.reason
    );
    assert_eq!(letter.fields.len(), 64, "the first 64 fields kept");
    assert_eq!(letter.event_id.as_deref(), Some("wide"));
}

/// Writes `big` (event_id `big` or `wide`) and a small event to a stream
/// before a worker with `max_entry_bytes` starts, and to another while its
/// worker waits in its blocking read; checks both are dead-lettered
/// `invalid` alike, the small events applied, nothing pending. Returns the
/// letter.
fn dead_letter_from_a_blocking_read_and_from_a_backlog(
    big: &[(Vec<u8>, Vec<u8>)],
    max_entry_bytes: usize,
) -> taskhub::DeadLetter {
    let db = TestDb::new();
    let group = unique("g");
    let mut conn = redis(&redis_url());
    let big_id = String::from_utf8(big[0].1.clone()).unwrap();
    let small = [("event_id", "small"), ("payload", "p")];
    let handler = || {
        handler_fn(|event: &Event, tx: &mut Tx<'_>| {
            tx.execute(INSERT, &[&event.event_id(), &event.payload()])?;
            Ok::<(), HandlerError>(())
        })
    };

    // From a backlog: written before the worker starts.
    let backlog = unique("s");
    xadd_raw(&mut conn, &backlog, big);
    xadd(&mut conn, &backlog, &small);
    let worker = builder(&db.url, &backlog, &group)
        .max_entry_bytes(max_entry_bytes)
        .until_idle(true)
        .build(handler())
        .unwrap();
    let summary = Running::of(worker).join(Duration::from_secs(30));
    assert_eq!((summary.dead_invalid, summary.applied), (1, 1), "{summary}");

    // Live: written while the worker waits in its blocking read.
    let live = unique("s");
    let db2 = TestDb::new();
    let worker = builder(&db2.url, &live, &group)
        .max_entry_bytes(max_entry_bytes)
        .build(handler())
        .unwrap();
    let running = Running::of(worker);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let groups: redis::RedisResult<Vec<HashMap<String, redis::Value>>> =
                redis::cmd("XINFO")
                    .arg("GROUPS")
                    .arg(&live)
                    .query(&mut conn);
            groups.is_ok_and(|g| g.len() == 1)
        }),
        "the worker did not create its group"
    );
    std::thread::sleep(Duration::from_millis(500)); // in its blocking read
    xadd_raw(&mut conn, &live, big);
    xadd(&mut conn, &live, &small);
    assert!(
        wait_until(Duration::from_secs(20), || {
            dead_letters(&mut conn, &live).len() == 1 && db2.effects("small") == 1
        }),
        "the live oversize entry was not dead-lettered, or the event after it not applied"
    );
    let summary = running.stop();
    assert_eq!((summary.dead_invalid, summary.applied), (1, 1), "{summary}");
    assert_eq!(pending(&mut conn, &live, &group), 0);
    assert_eq!((db.effects(&big_id), db2.effects(&big_id)), (0, 0));

    let (from_backlog, from_live) = (
        dead_letters(&mut conn, &backlog).remove(0),
        dead_letters(&mut conn, &live).remove(0),
    );
    for l in [&from_backlog, &from_live] {
        assert_eq!(l.kind, DeadLetterKind::Invalid);
        assert_eq!(l.event_id.as_deref(), Some(&big_id[..]));
    }
    assert_eq!(from_live.fields, from_backlog.fields);
    assert_eq!(from_live.reason, from_backlog.reason);
    for stream in [&backlog, &live] {
        let dlq = taskhub::dlq::dead_letter_stream(stream);
        del(&mut conn, &[stream, &dlq]);
    }
    from_live
}

/// A key beside the stream that holds something else than taskhub keeps
/// there (a string at `<stream>:dlq`, say) is a start-up error naming it.
/// It used to be found at the first dead letter, as "Redis: unavailable
/// (WRONGTYPE ...)", retried for ever: `--until-idle` never ended.
#[test]
fn a_key_of_the_wrong_type_beside_the_stream_is_a_start_up_error() {
    let db = TestDb::new();
    let stream = unique("wrongtype");
    let mut conn = redis(&redis_url());
    let _: () = redis::cmd("SET")
        .arg(format!("{stream}:dlq"))
        .arg("x")
        .query(&mut conn)
        .unwrap();
    xadd(&mut conn, &stream, &[("event_id", "w-1"), ("payload", "p")]);
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--until-idle", "--sql", "SELECT 1 / 0 WHERE $1 <> $2"]);
    let out = output(cmd, None, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "key {stream}:dlq holds a string, where taskhub keeps its dead letters"
        )),
        "{}",
        out.stderr
    );
    assert_eq!(pending(&mut conn, &stream, &stream), 0, "nothing read");
    let _: () = redis::cmd("DEL")
        .arg(format!("{stream}:dlq"))
        .query(&mut conn)
        .unwrap();
}

/// A Redis user that may not run EVALSHA (the read and ack scripts go by
/// their digest) is a start-up error saying what to allow. It used to log
/// "reading failed: NoPerm" a dozen times a second, for ever.
#[test]
fn a_redis_user_without_scripts_is_a_start_up_error() {
    let db = TestDb::new();
    let server = PrivateRedis::start();
    let mut conn = redis(&server.url());
    redis::cmd("ACL")
        .arg(&[
            "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-evalsha",
        ])
        .query::<()>(&mut conn)
        .unwrap();
    let url = format!("redis://limited:pw@127.0.0.1:{}", server.port);
    let stream = unique("noperm");
    let mut cmd = taskhub(&url, &db.url);
    cmd.args(["run", "--stream", &stream, "--group", "g", "--until-idle"])
        .args(["--block-ms", "100"]);
    let out = output(cmd, None, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("the Redis user may not run what taskhub needs")
            && out.stderr.contains("EVALSHA"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains(":pw@"), "no password: {}", out.stderr);

    // Without HSCAN, which only empties the dead-letter index of entries
    // gone from the stream: a warning at start-up, and the run goes on.
    redis::cmd("ACL")
        .arg(&[
            "SETUSER", "noscan", "on", ">pw", "~*", "&*", "+@all", "-hscan",
        ])
        .query::<()>(&mut conn)
        .unwrap();
    let url = format!("redis://noscan:pw@127.0.0.1:{}", server.port);
    let mut cmd = taskhub(&url, &db.url);
    cmd.args(["run", "--stream", &stream, "--group", "g", "--until-idle"])
        .args(["--block-ms", "100"]);
    let out = output(cmd, None, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{}", out.stderr);
    assert!(
        out.stderr.contains("the Redis user may not run HSCAN"),
        "{}",
        out.stderr
    );
}

/// A Redis user that may use the stream's keys but not taskhub's own
/// (`th:*`: the duplicate markers, the start counts of redelivered
/// entries) is a start-up error saying so. It passed the start-up check,
/// then every redelivered entry stayed pending for ever and `--until-idle`
/// never ended (found by a hostile test).
#[test]
fn a_redis_user_without_taskhubs_own_keys_is_a_start_up_error() {
    let db = TestDb::new();
    let server = PrivateRedis::start();
    let stream = unique("nomarkers");
    let mut conn = redis(&server.url());
    for (user, patterns) in [("streams", &[""][..]), ("starts", &["~th:r:*"])] {
        let mut acl = redis::cmd("ACL");
        acl.arg(&["SETUSER", user, "on", ">pw", "&*", "+@all"])
            .arg(format!("~{stream}*"));
        for p in patterns.iter().filter(|p| !p.is_empty()) {
            acl.arg(p);
        }
        acl.query::<()>(&mut conn).unwrap();
        let url = format!("redis://{user}:pw@127.0.0.1:{}", server.port);
        let mut cmd = taskhub(&url, &db.url);
        cmd.args(["run", "--stream", &stream, "--group", "g", "--until-idle"])
            .args(["--block-ms", "100"]);
        let out = output(cmd, None, Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(1), "{user}: {}", out.stderr);
        assert!(
            out.stderr.contains("may not use the keys th:*") && out.stderr.contains("~th:*"),
            "{user}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains(":pw@"), "{}", out.stderr);
    }
}

/// `run` on a dead-letter stream is refused before it reads: its letters
/// would each be applied as an event and acked (seen: 35 letters inserted
/// as notifications, a group made on the `:dlq` stream).
#[test]
fn running_on_a_dead_letter_stream_is_refused() {
    let db = TestDb::new();
    let stream = unique("dlq-as-events");
    let dlq = taskhub::dlq::dead_letter_stream(&stream);
    let mut r = redis(&redis_url());
    xadd(
        &mut r,
        &dlq,
        &[("kind", "permanent"), ("event_id", "e1"), ("payload", "p")],
    );
    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.args(["run", "--stream", &dlq, "--until-idle", "--block-ms", "100"]);
    let out = output(cmd, None, Duration::from_secs(30));
    assert_eq!(out.code(), Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr
            .contains(&format!("is the dead-letter stream of '{stream}'")),
        "{}",
        out.stderr
    );
    let groups: Vec<redis::Value> = redis::cmd("XINFO")
        .arg(&["GROUPS", &dlq])
        .query(&mut r)
        .unwrap();
    assert!(groups.is_empty(), "{groups:?}");
    assert_eq!(db.count("SELECT count(*) FROM notifications"), 0);
}
