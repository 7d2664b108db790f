//! `taskhub status`: counts a test arranged by hand, exactly, as the
//! operator's JSON and table show them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::*;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn status(args: &[&str]) -> Out {
    let mut cmd = taskhub(&redis_url(), "postgres://unused");
    cmd.arg("status").args(args);
    output(cmd, None, Duration::from_secs(20))
}

#[test]
fn json_reports_what_the_stream_and_group_hold() {
    let stream = unique("status");
    let mut r = redis(&redis_url());
    // Ten entries, the first one 100 s old.
    let first = now_ms() - 100_000;
    for i in 0..10u64 {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg(format!("{}-0", first + i))
            .arg("event_id")
            .arg(format!("e{i}"))
            .arg("payload")
            .arg("p")
            .query(&mut r)
            .unwrap();
    }
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("g")
        .arg("0")
        .query(&mut r)
        .unwrap();
    // c1 reads six (lag 4), acks the last two (pending 4); c2 takes over
    // the first one (delivered twice: redelivered 1).
    let read: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("c1")
        .arg("COUNT")
        .arg(6)
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query(&mut r)
        .unwrap();
    drop(read);
    for i in [4u64, 5] {
        let _: u64 = redis::cmd("XACK")
            .arg(&stream)
            .arg("g")
            .arg(format!("{}-0", first + i))
            .query(&mut r)
            .unwrap();
    }
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg(&stream)
        .arg("g")
        .arg("c2")
        .arg(0)
        .arg(format!("{first}-0"))
        .query(&mut r)
        .unwrap();
    for _ in 0..3 {
        xadd(
            &mut r,
            &taskhub::dlq::dead_letter_stream(&stream),
            &[("kind", "permanent")],
        );
    }

    let out = status(&["--stream", &stream, "--group", "g", "--json"]);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 1, "{}", out.stdout);
    let doc: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    let keys: Vec<&String> = doc.as_object().unwrap().keys().collect();
    assert_eq!(
        keys,
        [
            "consumers",
            "dead_letters",
            "group",
            "lag",
            "last_id",
            "length",
            "oldest_pending_seconds",
            "other_groups",
            "pending",
            "redelivered",
            "stream"
        ]
    );
    assert_eq!(doc["stream"], stream.as_str());
    assert_eq!(doc["group"], "g");
    assert_eq!(doc["length"], 10);
    assert_eq!(doc["last_id"], format!("{}-0", first + 9));
    assert_eq!(doc["lag"], 4);
    assert_eq!(doc["pending"], 4);
    assert_eq!(doc["redelivered"], 1);
    assert_eq!(doc["dead_letters"], 3);
    assert_eq!(doc["other_groups"], serde_json::json!([]));
    let oldest = doc["oldest_pending_seconds"].as_u64().unwrap();
    assert!((100..=130).contains(&oldest), "{oldest}");
    let consumers = doc["consumers"].as_array().unwrap();
    assert_eq!(consumers.len(), 2);
    assert_eq!(consumers[0]["name"], "c1");
    assert_eq!(consumers[0]["pending"], 3);
    assert_eq!(consumers[1]["name"], "c2");
    assert_eq!(consumers[1]["pending"], 1);
    assert!(consumers[1]["idle_seconds"].as_u64().unwrap() < 30);

    // The table says the same.
    let out = status(&["--stream", &stream, "--group", "g"]);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    let row = out.stdout.lines().nth(2).unwrap();
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[..3], ["10", "4", "4"], "{}", out.stdout);
    assert!(out.stdout.contains("c2"), "{}", out.stdout);
    assert!(!out.stdout.contains("every group's"), "{}", out.stdout);

    // Other groups on the stream: its dead letters are shared, and said so;
    // a name with terminal escapes is shown escaped.
    for group in ["audit", "evil\x1b]0;pwned\x07\x1b[2J"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("$")
            .query(&mut r)
            .unwrap();
    }
    let doc = status(&["--stream", &stream, "--group", "g", "--json"]).json();
    let mut others: Vec<&str> = doc["other_groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_str().unwrap())
        .collect();
    others.sort();
    assert_eq!(others, ["audit", "evil\x1b]0;pwned\x07\x1b[2J"]);
    let out = status(&["--stream", &stream, "--group", "g"]);
    assert!(
        out.stdout
            .contains("DEAD LETTERS are every group's: the stream is also read by ")
            && out.stdout.contains("audit")
            && out.stdout.contains("--group g stats"),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.contains('\x1b') && !out.stdout.contains('\x07'),
        "{:?}",
        out.stdout
    );
    assert!(
        out.stdout.contains("evil\\u{1b}]0;pwned"),
        "{:?}",
        out.stdout
    );
}

#[test]
fn a_missing_stream_or_group_is_exit_1_with_one_line() {
    let stream = unique("status-missing");
    let mut r = redis(&redis_url());
    xadd(&mut r, &stream, &[("event_id", "e"), ("payload", "p")]);
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("g")
        .arg("0")
        .query(&mut r)
        .unwrap();
    let nowhere = unique("status-nowhere");
    for (args, needle) in [
        (
            vec!["--stream", nowhere.as_str(), "--group", "g"],
            "does not exist",
        ),
        (
            vec!["--stream", stream.as_str(), "--group", "nope"],
            "no consumer group nope",
        ),
    ] {
        let out = status(&args);
        assert_eq!(out.code(), Some(1), "{args:?}: {}", out.stderr);
        let lines: Vec<&str> = out.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{}", out.stderr);
        assert!(lines[0].contains(needle), "{}", out.stderr);
    }
    // Two streams, one missing: the other is still shown.
    let out = status(&[
        "--stream", &stream, "--stream", &nowhere, "--group", "g", "--json",
    ]);
    assert_eq!(out.code(), Some(1));
    assert_eq!(out.stdout.lines().count(), 1, "{}", out.stdout);
}
