//! `taskhub dlq` as an operator runs it, against the real Redis and
//! PostgreSQL: stats, list (filters, pagination), show, replay (dry run, rate,
//! already-processed events, events applied once after a fix), purge (needs
//! --yes), archive (to PostgreSQL and to a file, and interrupted half-way by a
//! SIGKILL: nothing lost), check (exit codes), and `--json` output.
//!
//! Dead letters come from a real worker run with a failing `--sql`, or are
//! written directly with `DeadLetter::to_fields` when a test needs control over
//! kinds, reasons and times.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::*;
use serde_json::Value;
use taskhub::dlq::Attempt;
use taskhub::{DeadLetter, DeadLetterKind};

const T: Duration = Duration::from_secs(30);

/// `taskhub dlq --stream <stream> <args>` with the shared Redis and `db_url`.
fn dlq(db_url: &str, stream: &str, args: &[&str]) -> Out {
    let mut cmd = taskhub(&redis_url(), db_url);
    cmd.env("RUST_LOG", "warn")
        .args(["dlq", "--stream", stream])
        .args(args);
    output(cmd, None, T)
}

/// Asserts exit 0 and returns the output.
fn dlq_ok(db_url: &str, stream: &str, args: &[&str]) -> Out {
    let out = dlq(db_url, stream, args);
    assert_eq!(
        out.code(),
        Some(0),
        "dlq {args:?}: stdout:\n{}\nstderr:\n{}",
        out.stdout,
        out.stderr
    );
    out
}

/// `taskhub run --until-idle` on `stream` (group `g`, one worker), with
/// `sql` as the handler; returns the summary line's counters.
fn run_worker(db_url: &str, stream: &str, sql: Option<&str>) -> BTreeMap<String, u64> {
    run_worker_with(db_url, stream, sql, &[])
}

/// [`run_worker`] with more flags.
fn run_worker_with(
    db_url: &str,
    stream: &str,
    sql: Option<&str>,
    more: &[&str],
) -> BTreeMap<String, u64> {
    run_worker_as(db_url, stream, "g", sql, more)
}

/// [`run_worker_with`] as consumer group `group`.
fn run_worker_as(
    db_url: &str,
    stream: &str,
    group: &str,
    sql: Option<&str>,
    more: &[&str],
) -> BTreeMap<String, u64> {
    let mut cmd = taskhub(&redis_url(), db_url);
    cmd.args([
        "run",
        "--stream",
        stream,
        "--group",
        group,
        "--consumer",
        "c",
    ])
    .args(["--workers", "1", "--block-ms", "200", "--until-idle"])
    .args(["--backoff-base", "10ms", "--backoff-cap", "100ms"])
    .args(more);
    if let Some(sql) = sql {
        cmd.args(["--sql", sql]);
    }
    let out = output(cmd, None, T);
    assert_eq!(out.code(), Some(0), "run: {}", out.stderr);
    parse_summary(&out.stdout)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A dead letter of `stream` (group `g`) for `event_id`, dead-lettered `ago`
/// before now, with a payload and extra original fields.
fn letter(
    stream: &str,
    event_id: &str,
    kind: DeadLetterKind,
    reason: &str,
    ago: Duration,
    extra: &[(&str, &[u8])],
) -> DeadLetter {
    let dead_at = now_ms() - ago.as_millis() as u64;
    let mut fields = vec![
        (b"event_id".to_vec(), event_id.as_bytes().to_vec()),
        (
            b"payload".to_vec(),
            format!(r#"{{"order":1234,"event":"{event_id}"}}"#).into_bytes(),
        ),
    ];
    for (k, v) in extra {
        fields.push((k.as_bytes().to_vec(), v.to_vec()));
    }
    let mut letter = DeadLetter::new(stream, "1-0", kind, reason, fields);
    letter.group = "g".into();
    letter.consumer = "c".into();
    letter.event_id = Some(event_id.into());
    letter.attempts = 2;
    letter.history = vec![
        Attempt::new(1, None, "delivered but never finished"),
        Attempt::new(2, Some(UNIX_EPOCH + Duration::from_millis(dead_at)), reason),
    ];
    letter.first_failed_at = dead_at;
    letter.dead_at = dead_at;
    letter
}

/// Writes `letter` to `<stream>:dlq` as the worker would; returns its id.
fn put(conn: &mut redis::Connection, letter: &DeadLetter) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(taskhub::dlq::dead_letter_stream(&letter.stream))
        .arg("*");
    for (k, v) in letter.to_fields() {
        cmd.arg(k).arg(v);
    }
    cmd.query(conn).unwrap()
}

/// Ids in `<stream>:dlq`, oldest first.
fn dlq_ids(conn: &mut redis::Connection, stream: &str) -> Vec<String> {
    dead_letters(conn, stream)
        .into_iter()
        .map(|l| l.id.unwrap())
        .collect()
}

/// Entries of `stream`, oldest first, fields as text.
fn entries(conn: &mut redis::Connection, stream: &str) -> Vec<(String, HashMap<String, String>)> {
    let rows: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(conn)
        .unwrap();
    rows.into_iter()
        .map(|(id, f)| (id, f.into_iter().collect()))
        .collect()
}

fn ids_of(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .map(|d| d["id"].as_str().unwrap().to_owned())
        .collect()
}

/// `list --json`: one JSON object per line.
fn list_json(db_url: &str, stream: &str, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["list", "--json"];
    all.extend_from_slice(args);
    let out = dlq_ok(db_url, stream, &all);
    out.stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn cleanup(conn: &mut redis::Connection, stream: &str) {
    let _: i64 = redis::cmd("DEL")
        .arg(stream)
        .arg(taskhub::dlq::dead_letter_stream(stream))
        .query(conn)
        .unwrap();
}

const H: u64 = 3600;

/// event_id, kind, reason, age in seconds, extra original fields.
type Spec<'a> = (
    &'a str,
    DeadLetterKind,
    &'a str,
    u64,
    &'a [(&'a str, &'a [u8])],
);

/// Five dead letters with known kinds, reasons, ages and fields; ids oldest
/// first.
fn five_letters(conn: &mut redis::Connection, stream: &str) -> Vec<String> {
    let specs: [Spec; 5] = [
        (
            "e0",
            DeadLetterKind::Exhausted,
            "HTTP 503 for order 1234",
            5 * H,
            &[("tenant", b"acme")],
        ),
        (
            "e1",
            DeadLetterKind::Permanent,
            "postgres 23505: duplicate key",
            4 * H,
            &[("tenant", b"other")],
        ),
        (
            "e2",
            DeadLetterKind::Exhausted,
            "HTTP 503 for order 99",
            3 * H,
            &[("tenant", b"acme")],
        ),
        (
            "e3",
            DeadLetterKind::Invalid,
            "missing field event_id",
            H / 2,
            &[],
        ),
        (
            "e4",
            DeadLetterKind::CrashLoop,
            "Timeout after 30s for 6f1c2a7e-8b1d-4c2e-9a33-0c5d7e9f1a2b",
            60,
            &[("tenant", b"acme")],
        ),
    ];
    specs
        .iter()
        .map(|(id, kind, reason, ago, extra)| {
            put(
                conn,
                &letter(stream, id, *kind, reason, Duration::from_secs(*ago), extra),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Help
// ---------------------------------------------------------------------------

#[test]
fn help_of_dlq_and_each_subcommand_names_the_flags() {
    let cases: [(&[&str], &[&str]); 8] = [
        (
            &["dlq", "--help"],
            &[
                "stats", "list", "show", "replay", "purge", "archive", "check", "--stream",
                "--json", "RFC 3339",
            ],
        ),
        (&["dlq", "stats", "--help"], &["--json"]),
        (
            &["dlq", "list", "--help"],
            &[
                "--kind",
                "--reason",
                "--reason-regex",
                "--since",
                "--until",
                "--field",
                "--limit",
                "--before",
            ],
        ),
        (&["dlq", "show", "--help"], &["<ID>"]),
        (
            &["dlq", "replay", "--help"],
            &[
                "--dry-run",
                "--rate",
                "--all",
                "--scope",
                "replayed_from",
                "replay_count",
                "processed_events",
            ],
        ),
        (&["dlq", "purge", "--help"], &["--yes", "--all", "--kind"]),
        (
            &["dlq", "archive", "--help"],
            &["--older-than", "--to", "postgres", "JSONL"],
        ),
        (&["dlq", "check", "--help"], &["exit"]),
    ];
    for (args, needles) in cases {
        let mut cmd = taskhub(&redis_url(), "postgres://postgres@127.0.0.1:1/none");
        cmd.args(args);
        let out = output(cmd, None, T);
        assert_eq!(out.code(), Some(0), "{args:?}: {}", out.stderr);
        for needle in needles {
            assert!(
                out.stdout.contains(needle),
                "{args:?} help should mention {needle}:\n{}",
                out.stdout
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Stats, list, show
// ---------------------------------------------------------------------------

#[test]
fn stats_counts_by_kind_and_reason_fingerprint_with_ages() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    five_letters(&mut conn, &stream);

    let doc = dlq_ok(&db.url, &stream, &["stats", "--json"]).json();
    assert_eq!(doc["count"], 5);
    assert_eq!(doc["undecodable"], 0);
    assert_eq!(
        doc["by_kind"],
        serde_json::json!({"exhausted": 2, "permanent": 1, "invalid": 1, "crash_loop": 1})
    );
    let reasons: HashMap<String, u64> = doc["by_reason"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["fingerprint"].as_str().unwrap().to_owned(),
                r["count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    assert_eq!(
        reasons["HTTP # for order #"], 2,
        "numbers masked: {reasons:?}"
    );
    assert_eq!(reasons["postgres #: duplicate key"], 1, "{reasons:?}");
    assert_eq!(
        reasons["Timeout after #s for #"], 1,
        "UUID masked: {reasons:?}"
    );
    let oldest = doc["oldest_age_secs"].as_u64().unwrap();
    let newest = doc["newest_age_secs"].as_u64().unwrap();
    assert!((5 * H..5 * H + 60).contains(&oldest), "oldest age {oldest}");
    assert!((60..120).contains(&newest), "newest age {newest}");
    assert_eq!(
        doc["latest_reason"],
        "Timeout after 30s for 6f1c2a7e-8b1d-4c2e-9a33-0c5d7e9f1a2b"
    );

    let text = dlq_ok(&db.url, &stream, &["stats"]).stdout;
    assert!(text.contains("5 dead letters"), "{text}");
    assert!(text.contains("oldest 5h0m ago"), "{text}");
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle}:\n{text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(line("exhausted"), "2 exhausted");
    assert_eq!(line("HTTP #"), "2 HTTP # for order #");
    cleanup(&mut conn, &stream);
}

#[test]
fn list_filters_newest_first_with_pagination_and_json_lines() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let ids = five_letters(&mut conn, &stream);
    let newest_first: Vec<String> = ids.iter().rev().cloned().collect();

    let all = list_json(&db.url, &stream, &[]);
    assert_eq!(ids_of(&all), newest_first, "newest first");
    let e4 = &all[0];
    assert_eq!(e4["event_id"], "e4");
    assert_eq!(e4["kind"], "crash_loop");
    assert_eq!(e4["fields"]["tenant"], "acme");
    assert_eq!(e4["history"].as_array().unwrap().len(), 2);

    let pick = |args: &[&str]| ids_of(&list_json(&db.url, &stream, args));
    let at = |i: &[usize]| -> Vec<String> { i.iter().map(|&i| ids[i].clone()).collect() };
    assert_eq!(pick(&["--kind", "exhausted"]), at(&[2, 0]));
    assert_eq!(pick(&["--kind", "invalid,crash-loop"]), at(&[4, 3]));
    assert_eq!(
        pick(&["--kind", "invalid", "--kind", "permanent"]),
        at(&[3, 1])
    );
    assert_eq!(pick(&["--reason", "HTTP 503"]), at(&[2, 0]));
    assert_eq!(
        pick(&["--reason", "http 503"]),
        at(&[]),
        "substring is case-sensitive"
    );
    assert_eq!(
        pick(&["--reason-regex", "(?i)^http 5\\d\\d for order \\d{4}$"]),
        at(&[0])
    );
    assert_eq!(pick(&["--since", "2h"]), at(&[4, 3]));
    assert_eq!(pick(&["--until", "2h"]), at(&[2, 1, 0]));
    assert_eq!(pick(&["--since", "4h30m", "--until", "1h"]), at(&[2, 1]));
    let rfc = humantime::format_rfc3339_seconds(SystemTime::now() - Duration::from_secs(2 * H))
        .to_string();
    assert_eq!(pick(&["--since", &rfc]), at(&[4, 3]), "RFC 3339 time {rfc}");
    assert_eq!(pick(&["--field", "tenant=acme"]), at(&[4, 2, 0]));
    assert_eq!(
        pick(&[
            "--field",
            "tenant=acme",
            "--kind",
            "exhausted",
            "--since",
            "4h"
        ]),
        at(&[2])
    );
    assert_eq!(pick(&["--field", "tenant=nobody"]), at(&[]));

    // Pagination: two per page, the next page after the last id.
    let page1 = dlq_ok(&db.url, &stream, &["list", "--json", "--limit", "2"]);
    assert_eq!(page1.stdout.lines().count(), 2);
    assert!(
        page1.stderr.contains(&format!("--before {}", ids[3])),
        "says how to get the next page: {}",
        page1.stderr
    );
    assert_eq!(pick(&["--limit", "2", "--before", &ids[3]]), at(&[2, 1]));
    assert_eq!(pick(&["--limit", "2", "--before", &ids[1]]), at(&[0]));
    assert_eq!(pick(&["--limit", "0"]), newest_first);

    // The table: a header and one row per dead letter, newest first.
    let table = dlq_ok(&db.url, &stream, &["list"]).stdout;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 6, "{table}");
    for needle in [
        "ID", "AGE", "GROUP", "KIND", "ATTEMPTS", "EVENT_ID", "REASON",
    ] {
        assert!(lines[0].contains(needle), "{table}");
    }
    assert!(
        lines[1].starts_with(&ids[4]) && lines[1].contains("crash_loop"),
        "{table}"
    );
    assert!(
        lines[5].starts_with(&ids[0]) && lines[5].contains("HTTP 503 for order 1234"),
        "{table}"
    );

    // Bad filters are refused with a message.
    for args in [
        &["list", "--kind", "nope"][..],
        &["list", "--since", "yesterday"],
        &["list", "--field", "tenant"],
        &["list", "--reason-regex", "("],
        &["list", "--before", "not-an-id"],
    ] {
        let out = dlq(&db.url, &stream, args);
        assert_ne!(out.code(), Some(0), "{args:?}");
        assert!(out.stderr.contains("error"), "{args:?}: {}", out.stderr);
    }
    cleanup(&mut conn, &stream);
}

#[test]
fn show_prints_everything_with_pretty_payload_and_history() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let mut l = letter(
        &stream,
        "show-1",
        DeadLetterKind::Exhausted,
        "HTTP 503 \u{1b}[31mred",
        Duration::from_secs(90),
        &[("bin", &[0, 255, 1])],
    );
    l.fields[1].1 = br#"{"order":1234,"items":[{"sku":"a"}]}"#.to_vec();
    let id = put(&mut conn, &l);

    let text = dlq_ok(&db.url, &stream, &["show", &id]).stdout;
    for needle in [
        id.as_str(),
        "exhausted",
        "show-1",
        "group g, consumer c",
        "attempts      2",
        "(never reported)",
        "delivered but never finished",
        "payload: (JSON)",
        "      \"order\": 1234",
        "          \"sku\": \"a\"",
        "(3 bytes, not UTF-8) 00ff01",
        "\\u{1b}[31mred",
    ] {
        assert!(
            text.contains(needle),
            "show should contain {needle:?}:\n{text}"
        );
    }
    assert!(
        !text.contains('\u{1b}'),
        "terminal escapes are made visible"
    );

    let doc = dlq_ok(&db.url, &stream, &["show", &id, "--json"]).json();
    assert_eq!(doc["id"], id.as_str());
    assert_eq!(doc["event_id"], "show-1");
    assert_eq!(doc["payload_json"]["items"][0]["sku"], "a");
    assert_eq!(doc["fields"]["bin"], serde_json::json!({"hex": "00ff01"}));
    assert_eq!(doc["history"][0]["at"], Value::Null);
    assert_eq!(doc["history"][1]["error"], "HTTP 503 \u{1b}[31mred");

    let out = dlq(&db.url, &stream, &["show", "1-0"]);
    assert_eq!(out.code(), Some(1));
    assert!(out.stderr.contains("no dead letter 1-0"), "{}", out.stderr);
    let out = dlq(&db.url, &stream, &["show", "x"]);
    assert_eq!(out.code(), Some(1));
    assert!(
        out.stderr.contains("not a dead-letter id"),
        "{}",
        out.stderr
    );
    cleanup(&mut conn, &stream);
}

// ---------------------------------------------------------------------------
// Replay
// ---------------------------------------------------------------------------

/// A real dead letter (the worker's failing SQL), replayed after the fix:
/// the dry run changes nothing; the replay moves it back with the same
/// event_id and the audit fields; the next run applies it exactly once.
#[test]
fn replay_of_an_unprocessed_event_applies_it_exactly_once() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let event = unique("ev");
    xadd(
        &mut conn,
        &stream,
        &[
            ("event_id", &event),
            ("payload", "not-a-number"),
            ("tenant", "acme"),
        ],
    );
    let ok_event = unique("ok");
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &ok_event), ("payload", "7")],
    );
    let summary = run_worker(&db.url, &stream, Some(INT_SQL));
    assert_eq!(
        (summary["applied"], summary["permanent"]),
        (1, 1),
        "{summary:?}"
    );
    let ids = dlq_ids(&mut conn, &stream);
    assert_eq!(ids.len(), 1);
    let dead_id = &ids[0];
    let stream_len = xlen(&mut conn, &stream);

    // Dry run: says it would replay 1, none processed; changes nothing.
    let out = dlq_ok(&db.url, &stream, &["replay", dead_id, "--dry-run"]);
    assert!(
        out.stdout.contains("would replay 1 dead letter")
            && out.stdout.contains("0 already processed"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains(&event),
        "lists the entry: {}",
        out.stdout
    );
    assert_eq!(
        dlq_ids(&mut conn, &stream),
        ids,
        "dry run: the dead letter stays"
    );
    assert_eq!(
        xlen(&mut conn, &stream),
        stream_len,
        "dry run: nothing added"
    );

    let doc = dlq_ok(&db.url, &stream, &["replay", dead_id, "--json"]).json();
    assert_eq!(doc["dry_run"], false);
    assert_eq!(doc["replayed"], 1);
    assert_eq!(doc["already_processed"], 0);
    assert_eq!(doc["checked_with"], "postgres");
    let new_id = doc["items"][0]["replayed_as"].as_str().unwrap().to_owned();
    assert!(
        dlq_ids(&mut conn, &stream).is_empty(),
        "left the dead-letter stream"
    );
    let all = entries(&mut conn, &stream);
    let (last_id, fields) = all.last().unwrap();
    assert_eq!(last_id, &new_id);
    assert_eq!(fields["event_id"], event, "same event_id");
    assert_eq!(fields["payload"], "not-a-number");
    assert_eq!(fields["tenant"], "acme", "every original field");
    assert_eq!(&fields["replayed_from"], dead_id);
    assert_eq!(fields["replay_count"], "1");
    let at: u64 = fields["replayed_at"].parse().unwrap();
    assert!(now_ms() - at < 60_000, "replayed_at is now (ms): {at}");

    // After the fix: applied exactly once.
    let summary = run_worker(&db.url, &stream, None);
    assert_eq!(summary["applied"], 1, "{summary:?}");
    assert_eq!(db.effects(&event), 1);
    assert_eq!(db.effects(&ok_event), 1);
    assert_eq!(pending(&mut conn, &stream, "g"), 0);
    assert!(dlq_ids(&mut conn, &stream).is_empty());

    // A second replay of the same id finds nothing, and says so.
    let out = dlq(&db.url, &stream, &["replay", dead_id]);
    assert_eq!(out.code(), Some(1));
    assert!(out.stdout.contains("1 not found"), "{}", out.stdout);
    cleanup(&mut conn, &stream);
}

/// An event whose effect is committed but that also sits in the dead-letter
/// stream: the replay says 1 already processed (from processed_events, or
/// from the Redis marker when PostgreSQL is unreachable), the worker skips
/// it, and the effect count stays 1.
#[test]
fn replay_of_an_already_processed_event_is_skipped_and_counted() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let done = unique("done");
    let fresh = unique("fresh");
    xadd(&mut conn, &stream, &[("event_id", &done), ("payload", "p")]);
    assert_eq!(run_worker(&db.url, &stream, None)["applied"], 1);
    assert_eq!(db.effects(&done), 1);
    put(
        &mut conn,
        &letter(
            &stream,
            &done,
            DeadLetterKind::Exhausted,
            "timeout",
            Duration::from_secs(5),
            &[],
        ),
    );
    put(
        &mut conn,
        &letter(
            &stream,
            &fresh,
            DeadLetterKind::Exhausted,
            "timeout",
            Duration::from_secs(5),
            &[],
        ),
    );

    // With PostgreSQL unreachable, nothing can be checked: the markers speak
    // for one database, which only PostgreSQL can name.
    let out = dlq_ok(
        "postgres://postgres@127.0.0.1:1/none",
        &stream,
        &["replay", "--all", "--dry-run", "--json"],
    );
    let doc = out.json();
    assert_eq!(doc["checked_with"], serde_json::Value::Null);
    assert_eq!(
        (doc["replayed"].as_u64(), doc["already_processed"].as_u64()),
        (Some(2), Some(0))
    );
    assert!(out.stderr.contains("not checked"), "{}", out.stderr);
    assert_eq!(
        dlq_ids(&mut conn, &stream).len(),
        2,
        "dry run changed nothing"
    );

    // The replay checks processed_events.
    let out = dlq_ok(&db.url, &stream, &["replay", "--reason", "timeout"]);
    assert!(
        out.stdout.contains("replayed 2 dead letters")
            && out.stdout.contains("1 already processed"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("processed_events"), "{}", out.stdout);
    assert!(dlq_ids(&mut conn, &stream).is_empty());

    let summary = run_worker(&db.url, &stream, None);
    assert_eq!(
        (summary["applied"], summary["duplicates"]),
        (1, 1),
        "{summary:?}"
    );
    assert_eq!(
        db.effects(&done),
        1,
        "the already-processed event is not applied again"
    );
    assert_eq!(db.effects(&fresh), 1);
    assert_eq!(pending(&mut conn, &stream, "g"), 0);

    // --scope: in another scope nothing is processed yet.
    put(
        &mut conn,
        &letter(
            &stream,
            &done,
            DeadLetterKind::Exhausted,
            "timeout",
            Duration::from_secs(5),
            &[],
        ),
    );
    let doc = dlq_ok(
        &db.url,
        &stream,
        &[
            "replay",
            "--all",
            "--dry-run",
            "--json",
            "--scope",
            "elsewhere",
        ],
    )
    .json();
    assert_eq!(doc["already_processed"], 0);
    let doc = dlq_ok(
        &db.url,
        &stream,
        &["replay", "--all", "--dry-run", "--json"],
    )
    .json();
    assert_eq!(doc["already_processed"], 1);
    cleanup(&mut conn, &stream);
}

/// A filter selects; the replay goes oldest first, at most --rate per second;
/// --limit takes the newest matches; a replayed entry replayed again counts 2.
#[test]
fn replay_by_filter_oldest_first_at_a_rate() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let ids = five_letters(&mut conn, &stream);

    // A selection is required: a usage mistake, exit 2 (as `dlq --help`
    // says; it was 1, as for a failure).
    let out = dlq(&db.url, &stream, &["replay"]);
    assert_eq!(out.code(), Some(2));
    assert!(out.stderr.contains("--all"), "{}", out.stderr);
    let out = dlq(&db.url, &stream, &["replay", &ids[0], "--kind", "invalid"]);
    assert_eq!(out.code(), Some(2), "ids and filters together are refused");
    let out = dlq(&db.url, &stream, &["purge", &ids[0], "--kind", "invalid"]);
    assert_eq!(out.code(), Some(2), "{}", out.stderr);
    assert_eq!(dlq_ids(&mut conn, &stream), ids);

    // --field tenant=acme: e0, e2, e4, replayed oldest first at 10/s.
    let out = dlq_ok(
        &db.url,
        &stream,
        &["replay", "--field", "tenant=acme", "--rate", "10"],
    );
    assert!(
        out.stdout.contains("replayed 3 dead letters"),
        "{}",
        out.stdout
    );
    assert!(
        out.took >= Duration::from_millis(200),
        "3 entries at 10/s take at least 0.2 s: {:?}",
        out.took
    );
    assert_eq!(
        dlq_ids(&mut conn, &stream),
        vec![ids[1].clone(), ids[3].clone()]
    );
    let back = entries(&mut conn, &stream);
    let order: Vec<&str> = back.iter().map(|(_, f)| f["event_id"].as_str()).collect();
    assert_eq!(order, ["e0", "e2", "e4"], "oldest first");
    let from: Vec<&str> = back
        .iter()
        .map(|(_, f)| f["replayed_from"].as_str())
        .collect();
    assert_eq!(from, [ids[0].as_str(), ids[2].as_str(), ids[4].as_str()]);

    // --limit 1 with a filter: the newest match only.
    let doc = dlq_ok(
        &db.url,
        &stream,
        &[
            "replay",
            "--kind",
            "permanent,invalid",
            "--limit",
            "1",
            "--json",
        ],
    )
    .json();
    assert_eq!(doc["replayed"], 1);
    assert_eq!(doc["items"][0]["id"], ids[3].as_str());

    // Dead again after a replay, and replayed again: replay_count 2, one set
    // of audit fields.
    let mut again = letter(
        &stream,
        "e0",
        DeadLetterKind::Exhausted,
        "again",
        Duration::from_secs(1),
        &[],
    );
    again.fields = back[0]
        .1
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect();
    let again_id = put(&mut conn, &again);
    dlq_ok(&db.url, &stream, &["replay", &again_id]);
    let raw: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
        .arg(&stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query(&mut conn)
        .unwrap();
    let names: Vec<&str> = raw[0].1.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names.iter().filter(|n| **n == "replay_count").count(),
        1,
        "{names:?}"
    );
    let f: HashMap<&str, &str> = raw[0]
        .1
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        (f["replay_count"], f["replayed_from"]),
        ("2", again_id.as_str())
    );
    cleanup(&mut conn, &stream);
}

/// When the XADD fails (the original key is not a stream), the dead letter
/// is not removed: replay never loses an entry.
#[test]
fn replay_that_cannot_add_keeps_the_dead_letter() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let id = put(
        &mut conn,
        &letter(
            &stream,
            "k",
            DeadLetterKind::Permanent,
            "x",
            Duration::from_secs(1),
            &[],
        ),
    );
    let _: () = redis::cmd("SET")
        .arg(&stream)
        .arg("not a stream")
        .query(&mut conn)
        .unwrap();
    let out = dlq(&db.url, &stream, &["replay", &id]);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stdout.contains("not replayed") && out.stdout.contains("1 failed"),
        "{}",
        out.stdout
    );
    assert_eq!(dlq_ids(&mut conn, &stream), [id]);
    cleanup(&mut conn, &stream);
}

/// The payload stored for `event_id` in `notifications` (one row expected).
fn stored_payloads(db: &TestDb, event_id: &str) -> Vec<Option<String>> {
    db.client()
        .query(
            "SELECT payload FROM notifications WHERE event_id = $1",
            &[&event_id],
        )
        .unwrap()
        .into_iter()
        .map(|r| r.get(0))
        .collect()
}

/// Regression (hostile tester): an oversize `invalid` letter keeps only the
/// first 256 bytes of each field, and replay put that cut-down event back on
/// the stream: the worker applied it (a payload of 256 bytes instead of
/// 1503) and recorded the event processed, so the true payload could never
/// be applied. Now replay (and its dry run) refuses such a letter, says why,
/// keeps it in the dead-letter stream and exits 1; a letter over the limit
/// whose fields were all kept whole still replays; and the event produced
/// again in full is applied whole.
#[test]
fn replay_refuses_an_oversize_letter_cut_down_to_256_bytes_a_field() {
    let db = TestDb::new();
    let stream = unique("atk_big");
    let mut conn = redis(&redis_url());
    let big = unique("big");
    let payload = format!("{}END", "A".repeat(1500));
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &big), ("payload", &payload)],
    );
    // Over the limit too, but every field under 256 bytes: nothing was cut,
    // the letter holds the whole event.
    let wide = unique("wide");
    let quarter = "B".repeat(250);
    xadd(
        &mut conn,
        &stream,
        &[
            ("event_id", &wide),
            ("payload", &quarter),
            ("a", &quarter),
            ("b", &quarter),
            ("c", &quarter),
        ],
    );
    let summary = run_worker_with(&db.url, &stream, None, &["--max-entry-bytes", "1000"]);
    assert_eq!(summary["invalid"], 2, "{summary:?}");
    let ids = dlq_ids(&mut conn, &stream);
    assert_eq!(ids.len(), 2);
    let stream_len = xlen(&mut conn, &stream);

    // Dry run: says which cannot be replayed, and why; exit 1.
    let out = dlq(&db.url, &stream, &["replay", "--all", "--dry-run"]);
    assert_eq!(
        out.code(),
        Some(1),
        "dry run of a cut-down letter must say something is left out: {}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains(&format!("{big}: kept only the first 256 bytes"))
            && out.stdout.contains("produce the event again in full")
            && out.stdout.contains("would replay 1 dead letter")
            && out.stdout.contains("1 not replayed"),
        "{}",
        out.stdout
    );
    let doc = dlq(
        &db.url,
        &stream,
        &["replay", "--all", "--dry-run", "--json"],
    )
    .json();
    assert_eq!(doc["replayed"], 1, "{doc}");
    assert_eq!(doc["incomplete"], 1, "{doc}");

    // The replay: the complete letter goes back, the cut one stays.
    let out = dlq(&db.url, &stream, &["replay", "--all", "--json"]);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    let doc = out.json();
    assert_eq!(doc["replayed"], 1, "{doc}");
    assert_eq!(doc["incomplete"], 1, "{doc}");
    assert_eq!(doc["failed"], 0, "{doc}");
    let items = doc["items"].as_array().unwrap();
    let cut = items
        .iter()
        .find(|i| i["event_id"] == big.as_str())
        .unwrap();
    assert!(cut["replayed_as"].is_null(), "{doc}");
    assert!(
        cut["incomplete"]
            .as_str()
            .is_some_and(|w| w.contains("256 bytes") && w.contains("--max-entry-bytes")),
        "{doc}"
    );
    let whole = items
        .iter()
        .find(|i| i["event_id"] == wide.as_str())
        .unwrap();
    assert!(whole["replayed_as"].is_string(), "{doc}");
    assert!(whole["incomplete"].is_null(), "{doc}");
    assert_eq!(
        dead_letters(&mut conn, &stream)
            .iter()
            .map(|l| l.event_id.clone().unwrap())
            .collect::<Vec<_>>(),
        std::slice::from_ref(&big),
        "the cut letter stays a dead letter"
    );
    assert_eq!(xlen(&mut conn, &stream), stream_len + 1, "one entry added");

    // The worker applies the complete one whole, nothing of the cut one.
    let summary = run_worker(&db.url, &stream, None);
    assert_eq!(summary["applied"], 1, "{summary:?}");
    assert_eq!(stored_payloads(&db, &wide), [Some(quarter.clone())]);
    assert_eq!(db.effects(&big), 0, "the cut-down event was applied");

    // Text: the line names the event and the way out.
    let out = dlq(&db.url, &stream, &["replay", "--all"]);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stdout.contains(&format!(
            "{big}: kept only the first 256 bytes of each field"
        )) && out.stdout.contains("not replayed")
            && out.stdout.contains("or purge the letter"),
        "{}",
        out.stdout
    );

    // The way out: the event produced again in full is applied whole.
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &big), ("payload", &payload)],
    );
    let summary = run_worker(&db.url, &stream, None);
    assert_eq!(summary["applied"], 1, "{summary:?}");
    assert_eq!(stored_payloads(&db, &big), [Some(payload)]);
    cleanup(&mut conn, &stream);
}

/// Regression (hostile tester): a replay adds its audit fields (about 200
/// bytes with the names of the group and the stream) to the entry it puts
/// back, and an event that was within that of `--max-entry-bytes` came
/// back over it: the worker cut it down to an `invalid` letter that cannot
/// be replayed, the whole event left only in the stream. Now replay keeps
/// such a letter, says why and exits 1; with `--max-entry-bytes` raised (of
/// the replay and the workers) it goes back and is applied whole.
#[test]
fn replay_keeps_a_letter_the_audit_fields_would_push_over_the_limit() {
    let db = TestDb::new();
    let stream = unique("atk_near");
    let mut conn = redis(&redis_url());
    let (near, far) = (unique("near"), unique("far"));
    // 50 bytes under the limit of 3000, counted as the worker counts.
    let payload = "7".repeat(3000 - 50 - 2 * 16 - "event_id".len() - near.len() - "payload".len());
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &near), ("payload", &format!("x{payload}"))],
    );
    xadd(&mut conn, &stream, &[("event_id", &far), ("payload", "x")]);
    let limit = ["--max-entry-bytes", "3000"];
    let summary = run_worker_with(&db.url, &stream, Some(INT_SQL), &limit);
    assert_eq!(summary["permanent"], 2, "{summary:?}");
    let stream_len = xlen(&mut conn, &stream);

    let out = dlq(
        &db.url,
        &stream,
        &["replay", "--all", "--max-entry-bytes", "3000"],
    );
    assert_eq!(out.code(), Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout
            .contains("bytes with the replay's fields > --max-entry-bytes 3000"),
        "{}",
        out.stdout
    );
    let left: Vec<String> = dead_letters(&mut conn, &stream)
        .into_iter()
        .filter_map(|l| l.event_id)
        .collect();
    assert_eq!(
        left,
        std::slice::from_ref(&near),
        "the letter near the limit stays"
    );
    assert_eq!(xlen(&mut conn, &stream), stream_len + 1, "one entry added");
    // The size it says, to the byte: a byte less still keeps it, and the
    // workers take it whole at exactly that limit (a replay that counted
    // less than the worker would let through an entry the worker cuts).
    let size: usize = out
        .stdout
        .split(" bytes with the replay's fields")
        .next()
        .and_then(|before| before.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no size in: {}", out.stdout));
    assert!(size > 3000 && size < 3300, "{size}");
    let below = (size - 1).to_string();
    let out = dlq(
        &db.url,
        &stream,
        &["replay", "--all", "--dry-run", "--max-entry-bytes", &below],
    );
    assert_eq!(out.code(), Some(1), "{}", out.stdout);

    // Raised for both, it goes back and is applied whole (the statement
    // fixed: the payload without its leading letter is an integer).
    let limit = size.to_string();
    let out = dlq(
        &db.url,
        &stream,
        &["replay", "--all", "--max-entry-bytes", &limit],
    );
    assert_eq!(out.code(), Some(0), "{}", out.stdout);
    let fixed = "INSERT INTO notifications (event_id, payload) VALUES ($1, substr($2, 2))";
    let summary = run_worker_with(
        &db.url,
        &stream,
        Some(fixed),
        &["--max-entry-bytes", &limit],
    );
    assert_eq!(summary["applied"], 2, "{summary:?}");
    assert_eq!(stored_payloads(&db, &near), [Some(payload)]);
    assert!(dead_letters(&mut conn, &stream).is_empty());
    cleanup(&mut conn, &stream);
}

/// Regression (hostile tester): a dead-letter id typed without its
/// sequence number (`5` for `5-1`). `XRANGE` took it for every id of that
/// millisecond and `XDEL` for `5-0`: the replay put back the event of
/// `5-1`, said "replayed 1", and left its letter, again at each replay.
/// Such an id is now refused, and nothing moves.
#[test]
fn a_dead_letter_id_without_its_sequence_is_refused() {
    let db = TestDb::new();
    let stream = unique("atk_short");
    let mut conn = redis(&redis_url());
    for n in 0..2 {
        xadd(
            &mut conn,
            &stream,
            &[("event_id", &unique(&format!("s{n}"))), ("payload", "x")],
        );
    }
    let summary = run_worker_with(&db.url, &stream, Some(INT_SQL), &[]);
    assert_eq!(summary["permanent"], 2, "{summary:?}");
    // The two letters again, at ids of one millisecond.
    let dlq_key = format!("{stream}:dlq");
    type Entry = (String, Vec<(String, Vec<u8>)>);
    let letters: Vec<Entry> = redis::cmd("XRANGE")
        .arg(&dlq_key)
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("DEL").arg(&dlq_key).query(&mut conn).unwrap();
    for (seq, (_, fields)) in letters.iter().enumerate() {
        let mut add = redis::cmd("XADD");
        add.arg(&dlq_key).arg(format!("5-{seq}"));
        for (k, v) in fields {
            add.arg(k).arg(v);
        }
        let _: String = add.query(&mut conn).unwrap();
    }
    let stream_len = xlen(&mut conn, &stream);
    for args in [
        &["replay", "5"][..],
        &["replay", "5", "--dry-run"],
        &["show", "5"],
    ] {
        let out = dlq(&db.url, &stream, args);
        assert_eq!(
            out.code(),
            Some(1),
            "{args:?}: {}\n{}",
            out.stdout,
            out.stderr
        );
        assert!(
            out.stderr.contains("is not a whole dead-letter id"),
            "{args:?}: {}",
            out.stderr
        );
    }
    assert_eq!(xlen(&mut conn, &stream), stream_len, "nothing put back");
    assert_eq!(dead_letters(&mut conn, &stream).len(), 2);
    // The whole id replays its own letter.
    let out = dlq_ok(&db.url, &stream, &["replay", "5-1"]);
    assert!(out.stdout.contains("replayed 1"), "{}", out.stdout);
    let left: Vec<String> = dead_letters(&mut conn, &stream)
        .into_iter()
        .filter_map(|l| l.id)
        .collect();
    assert_eq!(left, ["5-0"]);
    cleanup(&mut conn, &stream);
}

/// Regression (hostile tester): a 300 KB payload refused by the database,
/// whose error quotes the value: the letter kept that error whole in its
/// reason and its history, about 900 KB, past the 256 KiB over which
/// listings read letters cut down, and its history, cut, was no longer
/// JSON: `dlq list`, the filters and `replay --all` skipped it (the latter
/// exiting 0 with the letter still there). Error texts are now bounded, and
/// the letter is listed and replayed like any other.
#[test]
fn a_letter_whose_error_quotes_a_large_payload_is_listed_and_replayed() {
    let db = TestDb::new();
    let stream = unique("atk_bigerr");
    let mut conn = redis(&redis_url());
    let event = unique("big");
    let payload = "x".repeat(300_000);
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &event), ("payload", &payload)],
    );
    let summary = run_worker_with(&db.url, &stream, Some(INT_SQL), &[]);
    assert_eq!(summary["permanent"], 1, "{summary:?}");
    let letters = dead_letters(&mut conn, &stream);
    assert!(
        letters[0].reason.len() <= 2048,
        "{}",
        letters[0].reason.len()
    );
    let out = dlq_ok(&db.url, &stream, &["list", "--kind", "permanent"]);
    assert!(
        out.stdout.contains(&event),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    let out = dlq_ok(&db.url, &stream, &["replay", "--all"]);
    assert!(out.stdout.contains("replayed 1"), "{}", out.stdout);
    assert!(dead_letters(&mut conn, &stream).is_empty());
    cleanup(&mut conn, &stream);
}

/// The record a worker keeps as consumer `consumer` of group `g` on
/// `stream` (`keys::consumer_record`).
fn consumer_record(stream: &str, consumer: &str) -> String {
    format!("th:c:1:g:{}:{stream}:{consumer}", stream.len())
}

/// Regression (left open by the last session's note): `dlq replay` without
/// the workers' limit used its own default of 1 MiB, and put back a letter
/// whose entry, with the replay's audit fields, the running workers (at
/// 3000 bytes) cut down into an `invalid` letter that cannot be replayed.
/// The workers now publish their limit in their consumer records, the
/// replay keeps to the smallest, and a worker that stops takes its record
/// away (so a stopped worker's limit no longer holds a replay back).
#[test]
fn replay_keeps_to_the_limit_its_stream_s_running_workers_publish() {
    let db = TestDb::new();
    let stream = unique("atk_pub");
    let mut conn = redis(&redis_url());
    let near = unique("near");
    // 50 bytes under the limit of 3000, counted as the worker counts.
    let payload = "7".repeat(3000 - 50 - 2 * 16 - "event_id".len() - near.len() - "payload".len());
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &near), ("payload", &format!("x{payload}"))],
    );
    let limit = ["--max-entry-bytes", "3000"];
    let summary = run_worker_with(&db.url, &stream, Some(INT_SQL), &limit);
    assert_eq!(summary["permanent"], 1, "{summary:?}");
    let exists = |conn: &mut redis::Connection, key: &str| -> bool {
        redis::cmd("EXISTS").arg(key).query(conn).unwrap()
    };
    assert!(
        !exists(&mut conn, &consumer_record(&stream, "c")),
        "a worker that stopped leaves no record"
    );
    let letter_id = dead_letters(&mut conn, &stream)[0].id.clone().unwrap();
    let stream_len = xlen(&mut conn, &stream);

    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.args(["run", "--stream", &stream, "--group", "g"])
        .args([
            "--consumer",
            "running",
            "--workers",
            "1",
            "--block-ms",
            "100",
        ])
        .args(["--sql", INT_SQL])
        .args(limit);
    let mut p = Proc::spawn(cmd);
    let record = consumer_record(&stream, "running");
    let published = wait_until(Duration::from_secs(20), || exists(&mut conn, &record));
    assert!(published, "no record\n{}", p.stderr());
    // No --max-entry-bytes: its own default (1 MiB) would let it through.
    let out = dlq(&db.url, &stream, &["replay", "--all"]);
    let kept = dead_letters(&mut conn, &stream);
    let replayed_len = xlen(&mut conn, &stream);
    p.signal("TERM");
    p.wait(T);
    assert_eq!(out.code(), Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout
            .contains("> --max-entry-bytes 3000 (of a worker reading the stream)"),
        "{}",
        out.stdout
    );
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(
        kept[0].id.as_deref(),
        Some(letter_id.as_str()),
        "the letter stays"
    );
    assert_eq!(kept[0].kind, DeadLetterKind::Permanent);
    assert_eq!(replayed_len, stream_len, "nothing put back");
    assert!(
        !exists(&mut conn, &record),
        "the stopped worker took its record away\n{}",
        p.stderr()
    );
    // With no worker running, the replay's own limit decides again.
    let out = dlq(&db.url, &stream, &["replay", "--all", "--dry-run"]);
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    cleanup(&mut conn, &stream);
}

/// Regression (hostile tester): an entry deleted from the stream (XTRIM
/// MAXLEN 0) while it waited for a retry became a `trimmed` letter holding
/// only its event_id, and replay put that back: the worker stored the event
/// with a NULL payload and recorded it processed. Now replay refuses it,
/// says why, keeps the letter and exits 1. A `trimmed` letter that holds
/// the event's fields (one the worker had read whole) still replays.
#[test]
fn replay_refuses_a_trimmed_letter_that_kept_only_the_event_id() {
    let db = TestDb::new();
    db.client().batch_execute(ALWAYS_RETRY).unwrap();
    let stream = unique("atk_trim");
    let mut conn = redis(&redis_url());
    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.args([
        "run",
        "--stream",
        &stream,
        "--group",
        "g",
        "--consumer",
        "c",
    ])
    .args(["--workers", "1", "--block-ms", "100"])
    .args(["--sql", "SELECT try_later($1)"])
    .args(["--backoff-base", "3s", "--backoff-cap", "3s"])
    .args(["--max-retry-after", "3s", "--reclaim-min-idle", "10s"])
    .env("RUST_LOG", "taskhub=debug");
    let mut p = Proc::spawn(cmd);
    let event = unique("trim");
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &event), ("payload", "the real payload")],
    );
    assert!(
        p.wait_for("retrying in", Duration::from_secs(20)),
        "no failed attempt\n{}",
        p.stderr()
    );
    let _: i64 = redis::cmd("XTRIM")
        .arg(&stream)
        .arg("MAXLEN")
        .arg(0)
        .query(&mut conn)
        .unwrap();
    let found = wait_until(Duration::from_secs(20), || {
        !dead_letters(&mut conn, &stream).is_empty()
    });
    p.signal("TERM");
    p.wait(T);
    assert!(found, "no dead letter\n{}", p.stderr());
    let letters = dead_letters(&mut conn, &stream);
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].kind, DeadLetterKind::Trimmed);
    assert_eq!(
        letters[0].fields,
        [(b"event_id".to_vec(), event.clone().into_bytes())],
        "the letter keeps only the event_id"
    );
    let trimmed_id = letters[0].id.clone().unwrap();

    // A trimmed letter with the whole event (written as the worker writes
    // one for an entry deleted while it was being applied): replayable.
    let full = unique("full");
    let whole = put(
        &mut conn,
        &letter(
            &stream,
            &full,
            DeadLetterKind::Trimmed,
            "the entry was deleted from the stream (MAXLEN, XTRIM or XDEL) while it was pending, before it could be applied",
            Duration::from_secs(1),
            &[],
        ),
    );

    let out = dlq(&db.url, &stream, &["replay", "--all", "--dry-run"]);
    assert_eq!(
        out.code(),
        Some(1),
        "dry run of a letter without its fields must say something is left out: {}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains(&format!("{event}: kept only its event_id"))
            && out.stdout.contains("would replay 1 dead letter"),
        "{}",
        out.stdout
    );

    let out = dlq(&db.url, &stream, &["replay", "--all", "--json"]);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    let doc = out.json();
    assert_eq!(doc["replayed"], 1, "{doc}");
    assert_eq!(doc["incomplete"], 1, "{doc}");
    let items = doc["items"].as_array().unwrap();
    let kept = items
        .iter()
        .find(|i| i["id"] == trimmed_id.as_str())
        .unwrap();
    assert!(kept["replayed_as"].is_null(), "{doc}");
    assert!(
        kept["incomplete"]
            .as_str()
            .is_some_and(|w| w.contains("event_id") && w.contains("deleted")),
        "{doc}"
    );
    let back = items.iter().find(|i| i["id"] == whole.as_str()).unwrap();
    assert!(back["replayed_as"].is_string(), "{doc}");
    assert_eq!(
        dlq_ids(&mut conn, &stream),
        [trimmed_id],
        "the letter stays"
    );

    let summary = run_worker(&db.url, &stream, None);
    assert_eq!(summary["applied"], 1, "{summary:?}");
    assert_eq!(db.effects(&event), 0, "applied without its payload");
    assert_eq!(
        stored_payloads(&db, &full),
        [Some(format!(r#"{{"order":1234,"event":"{full}"}}"#))]
    );
    cleanup(&mut conn, &stream);
}

// ---------------------------------------------------------------------------
// Purge
// ---------------------------------------------------------------------------

#[test]
fn purge_needs_yes_and_prints_the_count() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let ids = five_letters(&mut conn, &stream);

    let out = dlq(&db.url, &stream, &["purge", "--kind", "exhausted"]);
    assert_eq!(out.code(), Some(1), "without --yes: exit 1");
    assert!(
        out.stderr.contains("would remove 2 dead letters"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("--yes"), "{}", out.stderr);
    assert_eq!(dlq_ids(&mut conn, &stream), ids, "nothing removed");
    let out = dlq(&db.url, &stream, &["purge", "--all", "--json"]);
    assert_eq!(out.code(), Some(1));
    assert_eq!(out.json()["would_remove"], 5);
    assert_eq!(dlq_ids(&mut conn, &stream), ids, "nothing removed");
    let out = dlq(&db.url, &stream, &["purge", "--yes"]);
    assert_eq!(
        out.code(),
        Some(2),
        "no selection: refused, a usage mistake"
    );
    assert_eq!(dlq_ids(&mut conn, &stream), ids);

    let out = dlq_ok(&db.url, &stream, &["purge", "--kind", "exhausted", "--yes"]);
    assert!(
        out.stdout.contains("removed 2 dead letters"),
        "{}",
        out.stdout
    );
    assert_eq!(dlq_ids(&mut conn, &stream), at(&ids, &[1, 3, 4]));

    let doc = dlq_ok(
        &db.url,
        &stream,
        &["purge", &ids[1], &ids[3], "--yes", "--json"],
    )
    .json();
    assert_eq!(doc["removed"], 2);
    assert_eq!(dlq_ids(&mut conn, &stream), at(&ids, &[4]));

    let out = dlq(&db.url, &stream, &["purge", &ids[1], "--yes"]);
    assert_eq!(out.code(), Some(1), "an id that is not there");
    assert!(
        out.stdout.contains("removed 0") && out.stdout.contains(&ids[1]),
        "{}",
        out.stdout
    );
    assert_eq!(dlq_ids(&mut conn, &stream), at(&ids, &[4]));
    cleanup(&mut conn, &stream);
}

fn at(ids: &[String], i: &[usize]) -> Vec<String> {
    i.iter().map(|&i| ids[i].clone()).collect()
}

// ---------------------------------------------------------------------------
// Archive
// ---------------------------------------------------------------------------

/// `n` dead letters dead-lettered 3 h ago, then 2 recent ones; ids oldest
/// first.
fn old_and_new(conn: &mut redis::Connection, stream: &str, n: usize) -> (Vec<String>, Vec<String>) {
    let old = (0..n)
        .map(|i| {
            put(
                conn,
                &letter(
                    stream,
                    &format!("old{i}"),
                    DeadLetterKind::Exhausted,
                    &format!("HTTP 500 #{i}"),
                    Duration::from_secs(3 * H),
                    &[("bin", &[0, 255, i as u8])],
                ),
            )
        })
        .collect();
    let new = (0..2)
        .map(|i| {
            put(
                conn,
                &letter(
                    stream,
                    &format!("new{i}"),
                    DeadLetterKind::Permanent,
                    "bad",
                    Duration::from_secs(60),
                    &[],
                ),
            )
        })
        .collect();
    (old, new)
}

/// Dead-letter ids in dead_letters_archive for `stream`, sorted.
fn archived_ids(db: &TestDb, stream: &str) -> Vec<String> {
    let mut ids: Vec<String> = db
        .client()
        .query(
            "SELECT dead_letter_id FROM dead_letters_archive WHERE stream = $1",
            &[&stream],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    ids.sort();
    ids
}

/// Dead-letter ids of the lines of a JSONL archive, in file order.
fn file_ids(path: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let doc: Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line ({e}): {l}"));
            doc["dead_letter_id"].as_str().unwrap().to_owned()
        })
        .collect()
}

#[test]
fn archive_to_postgres_moves_only_old_entries_and_keeps_every_field() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let (old, new) = old_and_new(&mut conn, &stream, 3);

    let out = dlq_ok(&db.url, &stream, &["archive", "--older-than", "2h"]);
    assert!(
        out.stdout.contains("archived 3 dead letters"),
        "{}",
        out.stdout
    );
    assert_eq!(dlq_ids(&mut conn, &stream), new, "recent ones stay");
    let mut sorted = old.clone();
    sorted.sort();
    assert_eq!(archived_ids(&db, &stream), sorted);
    let row = db
        .client()
        .query_one(
            "SELECT event_id, kind, reason, fields FROM dead_letters_archive WHERE stream = $1 AND dead_letter_id = $2",
            &[&stream, &old[1]],
        )
        .unwrap();
    let (event_id, kind, reason, fields): (String, String, String, Value) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        (event_id.as_str(), kind.as_str(), reason.as_str()),
        ("old1", "exhausted", "HTTP 500 #1")
    );
    assert_eq!(fields["f:event_id"], "old1");
    assert_eq!(fields["f:payload"], r#"{"order":1234,"event":"old1"}"#);
    assert_eq!(
        fields["f:bin"],
        serde_json::json!({"hex": "00ff01"}),
        "binary kept exactly"
    );
    assert_eq!(fields["group"], "g");
    assert_eq!(fields["attempts"], "2");
    let history: Value = serde_json::from_str(fields["history"].as_str().unwrap()).unwrap();
    assert_eq!(history.as_array().unwrap().len(), 2);

    // Again: nothing more is old enough; then everything, as JSON.
    let out = dlq_ok(&db.url, &stream, &["archive", "--older-than", "2h"]);
    assert!(
        out.stdout.contains("archived 0 dead letters"),
        "{}",
        out.stdout
    );
    let doc = dlq_ok(
        &db.url,
        &stream,
        &["archive", "--older-than", "0s", "--json"],
    )
    .json();
    assert_eq!(
        (doc["selected"].as_u64(), doc["archived"].as_u64()),
        (Some(2), Some(2))
    );
    assert!(dlq_ids(&mut conn, &stream).is_empty());
    assert_eq!(archived_ids(&db, &stream).len(), 5);

    // A row already archived with other content is never overwritten, and
    // its entry is not removed (the copy does not match).
    let clash = put(
        &mut conn,
        &letter(
            &stream,
            "clash",
            DeadLetterKind::Invalid,
            "x",
            Duration::from_secs(3 * H),
            &[],
        ),
    );
    db.client()
        .execute(
            "INSERT INTO dead_letters_archive (stream, dead_letter_id, fields) VALUES ($1, $2, '{}')",
            &[&stream, &clash],
        )
        .unwrap();
    let out = dlq(&db.url, &stream, &["archive", "--older-than", "1h"]);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stdout.contains(&clash) && out.stdout.contains("kept"),
        "{}",
        out.stdout
    );
    assert_eq!(dlq_ids(&mut conn, &stream), [clash]);
    cleanup(&mut conn, &stream);
}

#[test]
fn archive_to_a_jsonl_file_appends_verified_lines() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let (old, new) = old_and_new(&mut conn, &stream, 3);
    let dir = TempDir::new("dlq-archive");
    let path = dir.0.join("dead.jsonl");
    // An earlier archive cut short in the middle of a line.
    std::fs::write(&path, "{\"stream\":\"x\",\"dead_le").unwrap();

    let out = dlq_ok(
        &db.url,
        &stream,
        &[
            "archive",
            "--older-than",
            "1h",
            "--to",
            path.to_str().unwrap(),
        ],
    );
    assert!(
        out.stdout.contains("archived 3 dead letters"),
        "{}",
        out.stdout
    );
    assert_eq!(dlq_ids(&mut conn, &stream), new);
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        4,
        "the cut line, then one line per entry:\n{text}"
    );
    assert!(text.ends_with('\n'));
    let docs: Vec<Value> = lines[1..]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = docs
        .iter()
        .map(|d| d["dead_letter_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        old.iter().map(String::as_str).collect::<Vec<_>>(),
        "oldest first"
    );
    assert_eq!(docs[2]["stream"], stream.as_str());
    assert_eq!(docs[2]["event_id"], "old2");
    assert_eq!(docs[2]["kind"], "exhausted");
    assert_eq!(
        docs[2]["fields"]["f:bin"],
        serde_json::json!({"hex": "00ff02"})
    );
    assert_eq!(docs[2]["fields"]["reason"], "HTTP 500 #2");
    assert!(docs[2]["archived_at"].as_str().unwrap().ends_with('Z'));
    assert!(
        archived_ids(&db, &stream).is_empty(),
        "nothing went to PostgreSQL"
    );

    // A file that cannot be written: nothing is removed.
    let out = dlq(
        &db.url,
        &stream,
        &[
            "archive",
            "--older-than",
            "0s",
            "--to",
            "/nonexistent-dir/x.jsonl",
        ],
    );
    assert_eq!(out.code(), Some(1));
    assert!(
        out.stderr.contains("/nonexistent-dir/x.jsonl"),
        "{}",
        out.stderr
    );
    assert_eq!(dlq_ids(&mut conn, &stream), new);
    cleanup(&mut conn, &stream);
}

/// The archive SIGKILLed after copying (and verifying) its second chunk,
/// before deleting it: every entry is in the stream or in the archive (the
/// second chunk in both), none in neither; a second run finishes the job.
fn archive_interrupted(to_file: bool) {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let (old, _) = old_and_new(&mut conn, &stream, 10);
    let dir = TempDir::new("dlq-archive");
    let path = dir.0.join("dead.jsonl");
    let to = if to_file {
        path.to_str().unwrap().to_owned()
    } else {
        "postgres".to_owned()
    };
    let archived = |db: &TestDb| -> Vec<String> {
        if to_file {
            file_ids(&path)
        } else {
            archived_ids(db, &stream)
        }
    };

    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.env("TASKHUB_FAULT", format!("archive-after-copy@{}", old[4]))
        .args([
            "dlq",
            "--stream",
            &stream,
            "archive",
            "--older-than",
            "1h",
            "--chunk",
            "4",
            "--to",
            &to,
        ]);
    let mut p = Proc::spawn(cmd);
    assert!(
        p.wait_for(&format!("taskhub-fault: archive-after-copy {}", old[4]), T),
        "stderr:\n{}",
        p.stderr()
    );
    p.kill();

    let in_stream: BTreeSet<String> = dlq_ids(&mut conn, &stream).into_iter().collect();
    let in_archive: BTreeSet<String> = archived(&db).into_iter().collect();
    for id in &old {
        assert!(
            in_stream.contains(id) || in_archive.contains(id),
            "{id} is in neither the stream nor the archive"
        );
    }
    let set = |i: &[usize]| -> BTreeSet<String> { i.iter().map(|&i| old[i].clone()).collect() };
    assert_eq!(
        &in_archive,
        &set(&[0, 1, 2, 3, 4, 5, 6, 7]),
        "two chunks copied"
    );
    let old_in_stream: BTreeSet<String> = in_stream
        .intersection(&set(&(0..10).collect::<Vec<_>>()))
        .cloned()
        .collect();
    assert_eq!(
        old_in_stream,
        set(&[4, 5, 6, 7, 8, 9]),
        "only the first chunk removed"
    );

    // Run again: everything old is archived and gone from the stream.
    let out = dlq_ok(
        &db.url,
        &stream,
        &["archive", "--older-than", "1h", "--chunk", "4", "--to", &to],
    );
    assert!(
        out.stdout.contains("archived 6 dead letters"),
        "{}",
        out.stdout
    );
    let in_stream: BTreeSet<String> = dlq_ids(&mut conn, &stream).into_iter().collect();
    assert!(
        in_stream.is_disjoint(&set(&(0..10).collect::<Vec<_>>())),
        "{in_stream:?}"
    );
    assert_eq!(in_stream.len(), 2, "the recent ones stay");
    let all = archived(&db);
    let unique_ids: BTreeSet<String> = all.iter().cloned().collect();
    assert_eq!(unique_ids, set(&(0..10).collect::<Vec<_>>()));
    // The table keeps one row each; the file holds the second chunk twice.
    assert_eq!(all.len(), if to_file { 14 } else { 10 });
    cleanup(&mut conn, &stream);
}

#[test]
fn archive_to_postgres_killed_half_way_loses_nothing() {
    archive_interrupted(false);
}

#[test]
fn archive_to_a_file_killed_half_way_loses_nothing() {
    archive_interrupted(true);
}

// ---------------------------------------------------------------------------
// Check
// ---------------------------------------------------------------------------

/// A probe that reads the dead letters of a stream nothing reads, with no
/// letter (a misspelt `--stream`, an environment file's stream that is not
/// this one) is not told "no dead letters" for ever: `check` exits 1 and
/// says what to look at; the other commands warn. And `dlq`, `status` and
/// `consumers` take their stream from `TASKHUB_STREAM` (and the last two
/// their group from `TASKHUB_GROUP`), as `run` does, so one environment
/// file serves them all (they looked at `tasks:events` while the worker ran
/// on another stream).
#[test]
fn a_stream_nothing_reads_fails_the_check_and_the_environment_names_the_stream() {
    let db = TestDb::new();
    let (stream, typo) = (unique("env-s"), unique("typo"));
    let mut conn = redis(&redis_url());
    put(
        &mut conn,
        &letter(
            &stream,
            "c1",
            DeadLetterKind::Exhausted,
            "HTTP 503",
            Duration::from_secs(60),
            &[],
        ),
    );
    let out = dlq(&db.url, &typo, &["check"]);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stderr.contains("no consumer group reads stream")
            && out.stderr.contains("is the name right"),
        "{}",
        out.stderr
    );
    let doc = dlq(&db.url, &typo, &["check", "--json"]).json();
    assert_eq!(
        (doc["ok"].as_bool(), doc["unknown_stream"].as_bool()),
        (Some(false), Some(true))
    );
    let out = dlq(&db.url, &typo, &["list"]);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("is the name right"), "{}", out.stderr);

    // The environment's stream and group, with no flag.
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("envgroup")
        .arg("$")
        .arg("MKSTREAM")
        .query(&mut conn)
        .unwrap();
    let with_env = |args: &[&str]| {
        let mut cmd = taskhub(&redis_url(), &db.url);
        cmd.env("RUST_LOG", "warn")
            .env("TASKHUB_STREAM", &stream)
            .env("TASKHUB_GROUP", "envgroup")
            .args(args);
        output(cmd, None, T)
    };
    // The stream's letters, of every group (the environment's group is for
    // the commands that need one).
    let out = with_env(&["dlq", "check", "--json"]);
    assert_eq!(out.code(), Some(1), "{}", out.stderr);
    let doc = out.json();
    assert_eq!(
        (doc["stream"].as_str(), doc["count"].as_u64()),
        (Some(stream.as_str()), Some(1))
    );
    assert!(doc["group"].is_null(), "{doc}");
    let out = with_env(&["status", "--json"]);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    assert!(
        out.stdout.contains(&stream) && out.stdout.contains("envgroup"),
        "{}",
        out.stdout
    );
    let out = with_env(&["consumers"]);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    // Several streams, as `run` takes them: a command of one stream says so.
    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.env("TASKHUB_STREAM", format!("{stream},{typo}"))
        .args(["dlq", "check"]);
    let out = output(cmd, None, T);
    assert_eq!(out.code(), Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("names several streams"),
        "{}",
        out.stderr
    );
}

#[test]
fn check_exits_0_when_empty_and_1_with_a_one_line_summary() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    // A stream that a group reads, with no dead letter.
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("g")
        .arg("$")
        .arg("MKSTREAM")
        .query(&mut conn)
        .unwrap();

    let out = dlq(&db.url, &stream, &["check"]);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    assert_eq!(out.stdout.lines().count(), 1, "{}", out.stdout);
    let doc = dlq_ok(&db.url, &stream, &["check", "--json"]).json();
    assert_eq!(
        (doc["ok"].as_bool(), doc["count"].as_u64()),
        (Some(true), Some(0))
    );

    put(
        &mut conn,
        &letter(
            &stream,
            "c1",
            DeadLetterKind::Exhausted,
            "HTTP 503",
            Duration::from_secs(2 * H),
            &[],
        ),
    );
    put(
        &mut conn,
        &letter(
            &stream,
            "c2",
            DeadLetterKind::Permanent,
            "constraint\nviolated",
            Duration::from_secs(10),
            &[],
        ),
    );
    let out = dlq(&db.url, &stream, &["check"]);
    assert_eq!(out.code(), Some(1), "{}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {}", out.stdout);
    for needle in [
        "2 dead letters",
        "exhausted 1",
        "permanent 1",
        "oldest 2h0m ago",
        "latest reason: constraint violated",
    ] {
        assert!(lines[0].contains(needle), "{needle:?} in {}", lines[0]);
    }
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    let out = dlq(&db.url, &stream, &["check", "--json"]);
    assert_eq!(out.code(), Some(1));
    let doc = out.json();
    assert_eq!(
        (doc["ok"].as_bool(), doc["count"].as_u64()),
        (Some(false), Some(2))
    );
    assert_eq!(doc["by_kind"]["exhausted"], 1);
    assert_eq!(doc["latest_reason"], "constraint\nviolated");

    // Redis unreachable: an error, not "empty".
    let mut cmd = taskhub("redis://127.0.0.1:1", &db.url);
    cmd.args(["dlq", "--stream", &stream, "check"]);
    let out = output(cmd, None, T);
    assert_eq!(out.code(), Some(1));
    assert!(
        out.stderr
            .starts_with("taskhub: error: cannot connect to Redis"),
        "{}",
        out.stderr
    );
    cleanup(&mut conn, &stream);
}

// ---------------------------------------------------------------------------
// Concurrent archives
// ---------------------------------------------------------------------------

/// Three archives of one stream at once: each reads the same letters and
/// copies many of the same ones (the table keeps one row each), but only one
/// run's XDEL removes a letter. Each run reports what it removed, so the
/// reports add up to the letters archived; every letter is archived once and
/// none is left.
#[test]
fn concurrent_archives_report_each_letter_once() {
    const N: usize = 3000;
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let fields = letter(
        &stream,
        "conc",
        DeadLetterKind::Exhausted,
        "HTTP 500",
        Duration::from_secs(3 * H),
        &[],
    )
    .to_fields();
    let mut pipe = redis::pipe();
    for _ in 0..N {
        let cmd = pipe
            .cmd("XADD")
            .arg(taskhub::dlq::dead_letter_stream(&stream))
            .arg("*");
        for (k, v) in &fields {
            cmd.arg(k).arg(v);
        }
        cmd.ignore();
    }
    pipe.query::<()>(&mut conn).unwrap();
    let mut ids = dlq_ids(&mut conn, &stream);
    assert_eq!(ids.len(), N);
    ids.sort();

    let reports: Vec<Value> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    dlq_ok(
                        &db.url,
                        &stream,
                        &["archive", "--older-than", "1h", "--chunk", "250", "--json"],
                    )
                    .json()
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let counts: Vec<u64> = reports
        .iter()
        .map(|doc| doc["archived"].as_u64().unwrap())
        .collect();
    assert_eq!(
        counts.iter().sum::<u64>(),
        N as u64,
        "each letter reported by one run only: {counts:?}"
    );
    assert!(dlq_ids(&mut conn, &stream).is_empty(), "none left");
    assert_eq!(archived_ids(&db, &stream), ids, "one row each");
    cleanup(&mut conn, &stream);
}

// ---------------------------------------------------------------------------
// Several groups on one stream
// ---------------------------------------------------------------------------

/// Two groups reading one stream share its dead-letter stream. `--group`
/// makes every subcommand take only that group's letters: before it, the
/// operator of one group purged, replayed and archived the other's (the
/// reviewer's repro: `purge --kind permanent --yes` of group billing deleted
/// the letters group emails still had to fix). `stats` counts by group.
#[test]
fn every_subcommand_takes_only_the_letters_of_the_group_given() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let mut ids = BTreeMap::new();
    for (event, group, kind, ago) in [
        ("b1", "billing", DeadLetterKind::Permanent, 5 * H),
        ("e1", "emails", DeadLetterKind::Permanent, 5 * H),
        ("b2", "billing", DeadLetterKind::Permanent, 4 * H),
        ("e2", "emails", DeadLetterKind::Exhausted, 3 * H),
        ("b3", "billing", DeadLetterKind::Exhausted, 60),
        ("e3", "emails", DeadLetterKind::Permanent, 60),
    ] {
        let mut l = letter(
            &stream,
            event,
            kind,
            "HTTP 422",
            Duration::from_secs(ago),
            &[],
        );
        l.group = group.into();
        ids.insert(event, put(&mut conn, &l));
    }
    for group in ["billing", "emails"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("$")
            .arg("MKSTREAM")
            .query(&mut conn)
            .unwrap();
    }
    let events_left = |conn: &mut redis::Connection| -> Vec<String> {
        let mut left: Vec<String> = dead_letters(conn, &stream)
            .into_iter()
            .filter_map(|l| l.event_id)
            .collect();
        left.sort();
        left
    };

    // stats: the counts by group, and one group's own counts.
    let doc = dlq_ok(&db.url, &stream, &["stats", "--json"]).json();
    assert_eq!(doc["count"], 6);
    assert_eq!(
        doc["by_group"],
        serde_json::json!({"billing": 3, "emails": 3})
    );
    let out = dlq_ok(&db.url, &stream, &["stats"]);
    assert!(out.stdout.contains("GROUP"), "{}", out.stdout);
    let doc = dlq_ok(&db.url, &stream, &["stats", "--group", "emails", "--json"]).json();
    assert_eq!(
        (doc["count"].as_u64(), doc["group"].as_str()),
        (Some(3), Some("emails"))
    );
    assert_eq!(doc["by_kind"]["exhausted"], 1);

    // list, show and check.
    let listed = list_json(&db.url, &stream, &["--group", "billing"]);
    let mut events: Vec<&str> = listed
        .iter()
        .map(|d| d["event_id"].as_str().unwrap())
        .collect();
    events.sort();
    assert_eq!(events, ["b1", "b2", "b3"]);
    let out = dlq(
        &db.url,
        &stream,
        &["show", &ids["e1"], "--group", "billing"],
    );
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stderr.contains("group emails's, not billing's"),
        "{}",
        out.stderr
    );
    dlq_ok(&db.url, &stream, &["show", &ids["e1"], "--group", "emails"]);
    // A group the stream does not have (a misspelt --group): said, and
    // check does not report "none" for ever.
    let out = dlq(&db.url, &stream, &["check", "--group", "nobody"]);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stdout.contains("(group nobody): no dead letters")
            && out.stderr.contains("has no consumer group nobody"),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    let out = dlq(&db.url, &stream, &["check", "--group", "nobody", "--json"]);
    let doc = out.json();
    assert_eq!(
        (
            out.code(),
            doc["ok"].as_bool(),
            doc["unknown_group"].as_bool()
        ),
        (Some(1), Some(false), Some(true)),
        "{doc}"
    );
    let out = dlq_ok(&db.url, &stream, &["stats", "--group", "billing"]);
    assert!(
        out.stderr.is_empty(),
        "a group the stream has: {}",
        out.stderr
    );
    let out = dlq(&db.url, &stream, &["check", "--group", "emails", "--json"]);
    assert_eq!(
        (out.code(), out.json()["count"].as_u64()),
        (Some(1), Some(3))
    );

    // purge: only the group's, by filter, or all of it; --group alone is
    // no selection (a script's empty list of ids must not take the group).
    let out = dlq(&db.url, &stream, &["purge", "--group", "billing", "--yes"]);
    assert_eq!(out.code(), Some(2), "{}", out.stdout);
    assert!(
        out.stderr
            .contains("or --all (for every letter of the group)"),
        "{}",
        out.stderr
    );
    assert_eq!(dead_letters(&mut conn, &stream).len(), 6, "nothing removed");
    let out = dlq_ok(
        &db.url,
        &stream,
        &[
            "purge",
            "--group",
            "billing",
            "--kind",
            "permanent",
            "--yes",
        ],
    );
    assert!(
        out.stdout
            .contains("removed 2 dead letters of group billing"),
        "{}",
        out.stdout
    );
    assert_eq!(events_left(&mut conn), ["b3", "e1", "e2", "e3"]);

    // archive: only the group's old letters.
    let dir = TempDir::new("dlq-group");
    let file = dir.0.join("emails.jsonl");
    let out = dlq_ok(
        &db.url,
        &stream,
        &[
            "archive",
            "--group",
            "emails",
            "--older-than",
            "1h",
            "--to",
            file.to_str().unwrap(),
        ],
    );
    assert!(
        out.stdout.contains("archived 2 dead letters"),
        "{}",
        out.stdout
    );
    let mut archived = file_ids(&file);
    archived.sort();
    assert_eq!(archived, [ids["e1"].clone(), ids["e2"].clone()]);
    assert_eq!(events_left(&mut conn), ["b3", "e3"]);

    // replay: only the group's (a dry run says which).
    let doc = dlq_ok(
        &db.url,
        &stream,
        &[
            "replay",
            "--group",
            "emails",
            "--all",
            "--dry-run",
            "--json",
        ],
    )
    .json();
    assert_eq!(
        (doc["dry_run"].as_bool(), doc["replayed"].as_u64()),
        (Some(true), Some(1)),
        "{doc}"
    );
    let doc = dlq_ok(
        &db.url,
        &stream,
        &["replay", "--group", "emails", "--all", "--json"],
    )
    .json();
    assert_eq!(doc["replayed"], 1, "{doc}");
    assert_eq!(events_left(&mut conn), ["b3"]);
    assert_eq!(entries(&mut conn, &stream)[0].1["event_id"], "e3");

    // Usage: ids name letters themselves; --all with filter flags; an empty group.
    for (args, says) in [
        (
            vec!["purge", ids["b3"].as_str(), "--group", "billing", "--yes"],
            "drop --group",
        ),
        (
            vec![
                "purge",
                "--all",
                "--kind",
                "exhausted",
                "--group",
                "billing",
                "--yes",
            ],
            "of the group",
        ),
        (
            vec!["purge", "--group", "", "--all", "--yes"],
            "a value is required for '--group <GROUP>'",
        ),
    ] {
        // Each a usage mistake: exit 2, clap's or the selection's.
        let out = dlq(&db.url, &stream, &args);
        assert_eq!(out.code(), Some(2), "{args:?}: {}", out.stdout);
        assert!(out.stderr.contains(says), "{args:?}: {}", out.stderr);
    }
    assert_eq!(events_left(&mut conn), ["b3"]);
    cleanup(&mut conn, &stream);
}

/// `taskhub run --until-idle` on `stream` as group `group`, with `sql`;
/// returns the summary line's counters.
fn run_group(db_url: &str, stream: &str, group: &str, sql: &str) -> BTreeMap<String, u64> {
    run_worker_as(db_url, stream, group, Some(sql), &[])
}

/// A replay puts the event back on the stream, which every group reads;
/// only the group whose letter it was applies it. Before, the hostile
/// reviewer's repro: both groups dead-lettered an event, group emails
/// purged its letter (never apply it), group billing replayed its own after
/// a fix, and emails applied the replayed copy too: a second outcome for
/// emails, and an effect its operator had refused. (A group that already
/// applied the event only skipped it as a duplicate.)
#[test]
fn a_replay_is_applied_by_the_group_whose_letter_it_was_only() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    xadd(&mut conn, &stream, &[("event_id", "ev"), ("payload", "x")]);
    for group in ["billing", "emails"] {
        let summary = run_group(&db.url, &stream, group, INT_SQL);
        assert_eq!(summary["dead_lettered"], 1, "{group}: {summary:?}");
    }
    dlq_ok(
        &db.url,
        &stream,
        &["--group", "emails", "purge", "--all", "--yes"],
    );
    let doc = dlq_ok(
        &db.url,
        &stream,
        &["--group", "billing", "replay", "--all", "--json"],
    )
    .json();
    assert_eq!(doc["replayed"], 1, "{doc}");
    let replayed = entries(&mut conn, &stream).pop().unwrap().1;
    assert_eq!(replayed["replay_group"], "billing");

    let fixed = "INSERT INTO notifications (event_id, payload) VALUES ($1, 'fixed')";
    let emails = run_group(&db.url, &stream, "emails", fixed);
    assert_eq!(
        (emails["applied"], emails["duplicates"]),
        (0, 1),
        "emails acks billing's replay unapplied: {emails:?}"
    );
    let billing = run_group(&db.url, &stream, "billing", fixed);
    assert_eq!(billing["applied"], 1, "{billing:?}");
    assert_eq!(db.effects("ev"), 1, "applied once, by billing");

    // The letter of a group that no longer reads the stream (renamed, say)
    // names no one: every group reading it applies it, rather than none.
    let mut l = letter(
        &stream,
        "ev-of-retired",
        DeadLetterKind::Exhausted,
        "HTTP 503",
        Duration::from_secs(60),
        &[],
    );
    l.group = "retired".into();
    put(&mut conn, &l);
    let doc = dlq_ok(
        &db.url,
        &stream,
        &["--group", "retired", "replay", "--all", "--json"],
    )
    .json();
    assert_eq!(doc["replayed"], 1, "{doc}");
    let replayed = entries(&mut conn, &stream).pop().unwrap().1;
    assert!(!replayed.contains_key("replay_group"), "{replayed:?}");
    for group in ["billing", "emails"] {
        let summary = run_group(&db.url, &stream, group, fixed);
        assert_eq!(summary["applied"], 1, "{group}: {summary:?}");
    }
    assert_eq!(db.effects("ev-of-retired"), 2);
    cleanup(&mut conn, &stream);
}

/// The replay tag is honoured only for what it means: a replay on this
/// stream for a group that reads it. The reviewer's repros, each acked
/// unapplied before: an entry copied from another stream with its replay
/// fields (a bridge, a restore) was lost; a replay for a group renamed
/// since was applied by no one. And a replayed entry without an event id
/// for another group was dead-lettered a second time by this one.
#[test]
fn a_replay_tag_counts_only_on_its_stream_for_a_group_that_reads_it() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    for group in ["mine", "other"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM")
            .query(&mut conn)
            .unwrap();
    }
    // As the replay script writes them: the tagged entry and its record.
    let replayed = |conn: &mut redis::Connection, event: Option<&str>, group: &str, on: &str| {
        let mut fields = vec![("payload", "5"), ("replayed_from", "1-0")];
        fields.extend([("replay_group", group), ("replay_stream", on)]);
        if let Some(event) = event {
            fields.insert(0, ("event_id", event));
        }
        add_replayed(conn, &stream, group, &fields);
    };
    replayed(&mut conn, Some("bridged"), "other", "another-stream");
    replayed(&mut conn, Some("for-other"), "other", &stream);
    replayed(&mut conn, Some("for-renamed"), "renamed-away", &stream);
    replayed(&mut conn, None, "other", &stream);
    let fixed = "INSERT INTO notifications (event_id, payload) VALUES ($1, 'fixed')";
    let mine = run_group(&db.url, &stream, "mine", fixed);
    assert_eq!(
        (mine["applied"], mine["duplicates"], mine["dead_lettered"]),
        (2, 2, 0),
        "{mine:?}"
    );
    for (event, effects) in [("bridged", 1), ("for-renamed", 1), ("for-other", 0)] {
        assert_eq!(db.effects(event), effects, "{event}");
    }
    assert!(dead_letters(&mut conn, &stream).is_empty());
    cleanup(&mut conn, &stream);
}

/// A worker that found a tagged group missing a moment ago still asks
/// again before it applies a replay meant for another group: the group may
/// have been made since (the reviewer's repro: the list of groups, kept
/// 5 s, said "no such group", and the other group's replay was applied
/// here too).
#[test]
fn a_replay_for_a_group_made_a_moment_ago_is_left_to_it() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let create = |conn: &mut redis::Connection, group: &str| {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("$")
            .arg("MKSTREAM")
            .query(conn)
            .unwrap();
    };
    create(&mut conn, "mine");
    let fixed = "INSERT INTO notifications (event_id, payload) VALUES ($1, 'fixed')";
    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.args([
        "run",
        "--stream",
        &stream,
        "--group",
        "mine",
        "--consumer",
        "c",
    ])
    .args(["--workers", "1", "--block-ms", "100", "--sql", fixed]);
    let mut p = Proc::spawn(cmd);
    let replayed = |conn: &mut redis::Connection, event: &str, group: &str| {
        let fields = [
            ("event_id", event),
            ("payload", "5"),
            ("replayed_from", "1-0"),
            ("replay_group", group),
            ("replay_stream", stream.as_str()),
        ];
        add_replayed(conn, &stream, group, &fields);
    };
    // A replay for a group that is gone: applied here (and the worker has
    // now seen the stream's groups).
    replayed(&mut conn, "for-gone", "gone");
    assert!(
        wait_until(Duration::from_secs(15), || db.effects("for-gone") == 1),
        "{}",
        p.stderr()
    );
    // At once, a group is made and a replay for it comes: not applied here.
    create(&mut conn, "late");
    replayed(&mut conn, "for-late", "late");
    replayed(&mut conn, "after", "gone");
    assert!(
        wait_until(Duration::from_secs(15), || db.effects("after") == 1),
        "{}",
        p.stderr()
    );
    assert_eq!(db.effects("for-late"), 0, "{}", p.stderr());
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
    cleanup(&mut conn, &stream);
}

/// Adds an entry of `fields` to `stream` recorded as put back by a replay
/// for `group`, in one step as the replay script does (a worker reading
/// between the two would take the tag for a client's).
fn add_replayed(conn: &mut redis::Connection, stream: &str, group: &str, fields: &[(&str, &str)]) {
    let mut eval = redis::cmd("EVAL");
    eval.arg(
        "local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2)) \
         redis.call('HSET', KEYS[2], id, ARGV[1]) return id",
    )
    .arg(2)
    .arg(stream)
    .arg(format!("{stream}:dlq:replays"))
    .arg(group);
    for (k, v) in fields {
        eval.arg(*k).arg(*v);
    }
    let _: String = eval.query(conn).unwrap();
}

/// A tag no replay wrote is no tag. A producer that copies its clients'
/// fields into entries (a gateway) let a client add `replayed_from`,
/// `replay_stream` and `replay_group` naming another group that reads the
/// stream, and this group acked the event unapplied (found reading the
/// change once more): a client could make billing skip its order.
#[test]
fn a_replay_tag_a_client_wrote_is_ignored() {
    let db = TestDb::new();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    for group in ["billing", "emails"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM")
            .query(&mut conn)
            .unwrap();
    }
    let forged = [
        ("event_id", "order-1"),
        ("payload", "5"),
        ("replayed_from", "1-0"),
        ("replay_group", "emails"),
        ("replay_stream", stream.as_str()),
    ];
    xadd(&mut conn, &stream, &forged);
    let fixed = "INSERT INTO notifications (event_id, payload) VALUES ($1, 'fixed')";
    let billing = run_group(&db.url, &stream, "billing", fixed);
    assert_eq!(
        (billing["applied"], billing["duplicates"]),
        (1, 0),
        "{billing:?}"
    );
    assert_eq!(db.effects("order-1"), 1);
    cleanup(&mut conn, &stream);
}

/// With `run`'s comma list in TASKHUB_STREAM (one environment file for
/// every command), `dlq --stream S`, on either side of the subcommand,
/// works on S. (The global flag's parser met the environment's value again
/// at the subcommand, and refused it: exit 2, whatever --stream said.)
#[test]
fn an_explicit_stream_wins_over_a_comma_list_in_the_environment() {
    let db = TestDb::new();
    let (stream, other) = (unique("s"), unique("o"));
    let mut conn = redis(&redis_url());
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("g")
        .arg("$")
        .arg("MKSTREAM")
        .query(&mut conn)
        .unwrap();
    for args in [
        vec!["dlq", "--stream", stream.as_str(), "check"],
        vec!["dlq", "check", "--stream", stream.as_str()],
    ] {
        let mut cmd = taskhub(&redis_url(), &db.url);
        cmd.env("TASKHUB_STREAM", format!("{stream},{other}"))
            .args(&args);
        let out = output(cmd, None, T);
        assert_eq!(out.code(), Some(0), "{args:?}: {}", out.stderr);
    }
}

/// Regression (hostile test): `dlq replay` and `prune` waited with no word
/// for a lock on `processed_events` held elsewhere (a migration, a `LOCK
/// TABLE` left in an open transaction), where `run` says what it waits
/// for. Each now says, within seconds, which session holds the lock, waits
/// on, and finishes its work once the lock goes.
#[test]
fn replay_and_prune_say_who_holds_the_lock_they_wait_for() {
    let db = TestDb::new();
    taskhub::migrate(&db.url).unwrap();
    let stream = unique("s");
    let mut conn = redis(&redis_url());
    let event = unique("ev");
    let id = put(
        &mut conn,
        &letter(
            &stream,
            &event,
            DeadLetterKind::Permanent,
            "bad",
            Duration::from_secs(60),
            &[],
        ),
    );

    // Holds the table's strongest lock until told to let go.
    let hold = || {
        let mut holder = db.client();
        holder
            .batch_execute("BEGIN; LOCK TABLE processed_events")
            .unwrap();
        let pid: i32 = holder
            .query_one("SELECT pg_backend_pid()", &[])
            .unwrap()
            .get(0);
        (holder, pid)
    };
    let waits_then_goes_on = |mut cmd: std::process::Command, what: &str| {
        let (mut holder, pid) = hold();
        cmd.env("RUST_LOG", "warn");
        let mut p = Proc::spawn(cmd);
        let said = format!("for a lock held by pid {pid} ");
        assert!(
            p.wait_for(&said, Duration::from_secs(30)),
            "{what} never said who holds the lock: {}",
            p.stderr()
        );
        assert!(
            p.child.try_wait().unwrap().is_none(),
            "{what} ended while the lock was held: {}",
            p.stderr()
        );
        holder.batch_execute("COMMIT").unwrap();
        let status = p.wait(T);
        assert!(
            status.success(),
            "{what}: {status}\nstdout:\n{}\nstderr:\n{}",
            p.stdout(),
            p.stderr()
        );
        p.stdout()
    };

    let mut replay = taskhub(&redis_url(), &db.url);
    replay.args(["dlq", "--stream", &stream, "replay", &id]);
    let out = waits_then_goes_on(replay, "dlq replay");
    assert!(out.contains("replayed 1"), "{out}");
    assert!(dlq_ids(&mut conn, &stream).is_empty(), "the letter is gone");

    let mut prune = taskhub(&redis_url(), &db.url);
    prune.args(["prune", "--older-than", "7d"]);
    waits_then_goes_on(prune, "prune");
    cleanup(&mut conn, &stream);
}

/// Regression (found in review): a letter over the 256 KiB past which
/// listings read letters cut down kept each field's first 16 KiB, its
/// whole history only up to about 28 attempts of long errors. With more
/// (`--max-attempts` has no upper bound) its history was cut into
/// something that is not JSON, and no listing, filter or bulk action saw
/// the letter. A letter now keeps the first attempts and the last ones,
/// whatever their number; `show` says how many were left out between.
#[test]
fn a_large_letter_with_many_long_attempts_is_listed_and_replayed() {
    let db = TestDb::new();
    db.client().batch_execute(ALWAYS_RETRY).unwrap();
    let stream = unique("atk_hist");
    let mut conn = redis(&redis_url());
    let event = unique("hist");
    let payload = "x".repeat(300_000);
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &event), ("payload", &payload)],
    );
    let summary = run_worker_with(
        &db.url,
        &stream,
        Some("SELECT try_later($2) WHERE $1::text IS NOT NULL"),
        &["--max-attempts", "40"],
    );
    assert_eq!(summary["exhausted"], 1, "{summary:?}");
    let letters = dead_letters(&mut conn, &stream);
    assert_eq!(letters[0].attempts, 40, "{:?}", letters[0].attempts);
    let out = dlq_ok(&db.url, &stream, &["list", "--kind", "exhausted"]);
    assert!(
        out.stdout.contains(&event),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    let id = dlq_ids(&mut conn, &stream).remove(0);
    let doc = dlq_ok(&db.url, &stream, &["show", &id, "--json"]).json();
    let attempts: Vec<u64> = doc["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["attempt"].as_u64().unwrap())
        .collect();
    assert_eq!(
        (attempts.first(), attempts.last()),
        (Some(&1), Some(&40)),
        "the first and the last attempts: {attempts:?}"
    );
    let out = dlq_ok(&db.url, &stream, &["show", &id]);
    assert!(
        out.stdout.contains("attempts left out"),
        "says where the history was cut: {}",
        out.stdout
    );
    let out = dlq_ok(&db.url, &stream, &["replay", "--all"]);
    assert!(out.stdout.contains("replayed 1"), "{}", out.stdout);
    assert!(dead_letters(&mut conn, &stream).is_empty());
    cleanup(&mut conn, &stream);
}

/// Regression (hostile test): `dlq replay --rate 1e-300` replayed one
/// letter, then panicked (exit 101, no report) computing the wait before
/// the next; a rate under 0.001 a second is now refused before anything
/// is replayed.
#[test]
fn a_replay_rate_too_low_to_wait_for_is_refused_before_anything_moves() {
    let db = TestDb::new();
    let stream = unique("atk_rate");
    let mut conn = redis(&redis_url());
    for n in 0..3 {
        put(
            &mut conn,
            &letter(
                &stream,
                &format!("r{n}"),
                DeadLetterKind::Permanent,
                "bad",
                Duration::from_secs(60),
                &[],
            ),
        );
    }
    for rate in ["1e-300", "0.0001"] {
        let out = dlq(&db.url, &stream, &["replay", "--all", "--rate", rate]);
        assert_ne!(out.code(), Some(101), "a panic: {}", out.stderr);
        assert_ne!(out.code(), Some(0), "{}", out.stderr);
        assert!(out.stderr.contains("bad rate"), "{}", out.stderr);
        assert_eq!(dlq_ids(&mut conn, &stream).len(), 3, "nothing moved");
    }
    cleanup(&mut conn, &stream);
}
