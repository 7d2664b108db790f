//! Listing a group's consumers and removing one that left, safely.

use crate::support::*;

fn read_as(
    conn: &mut redis::Connection,
    stream: &str,
    group: &str,
    consumer: &str,
    count: usize,
) -> Vec<String> {
    let reply: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query(conn)
        .unwrap();
    let redis::Value::Array(streams) = reply else {
        return vec![];
    };
    let mut ids = Vec::new();
    for s in streams {
        let redis::Value::Array(mut pair) = s else {
            continue;
        };
        let Some(redis::Value::Array(entries)) = pair.pop() else {
            continue;
        };
        for e in entries {
            if let redis::Value::Array(mut kv) = e {
                kv.truncate(1);
                if let Some(redis::Value::BulkString(id)) = kv.pop() {
                    ids.push(String::from_utf8(id).unwrap());
                }
            }
        }
    }
    ids
}

#[test]
fn list_and_remove_only_when_nothing_is_pending() {
    let url = redis_url();
    let (stream, group) = (unique("cons"), unique("g"));
    let mut conn = redis(&url);
    for i in 0..5 {
        xadd(&mut conn, &stream, &[("event_id", &format!("e{i}"))]);
    }
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg(&group)
        .arg("0")
        .query::<()>(&mut conn)
        .unwrap();
    let a = read_as(&mut conn, &stream, &group, "alive", 2);
    let gone = read_as(&mut conn, &stream, &group, "gone", 3);
    assert_eq!((a.len(), gone.len()), (2, 3));

    let list = taskhub::consumers(&url, &taskhub::Tls::default(), &stream, &group).unwrap();
    let pending: Vec<(&str, u64)> = list.iter().map(|c| (c.name.as_str(), c.pending)).collect();
    assert_eq!(pending, [("alive", 2), ("gone", 3)]);

    // Refused while it holds entries: they would become unclaimable.
    let err = taskhub::remove_consumer(&url, &taskhub::Tls::default(), &stream, &group, "gone")
        .unwrap_err();
    assert!(err.to_string().contains("pending"), "{err}");
    assert_eq!(
        taskhub::consumers(&url, &taskhub::Tls::default(), &stream, &group)
            .unwrap()
            .len(),
        2
    );

    // Once another consumer took them over (as the reclaimer does), it goes.
    let _: redis::Value = redis::cmd("XAUTOCLAIM")
        .arg(&stream)
        .arg(&group)
        .arg("alive")
        .arg(0)
        .arg("0-0")
        .query(&mut conn)
        .unwrap();
    taskhub::remove_consumer(&url, &taskhub::Tls::default(), &stream, &group, "gone").unwrap();
    let list = taskhub::consumers(&url, &taskhub::Tls::default(), &stream, &group).unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].name.as_str(), list[0].pending), ("alive", 5));
}

#[test]
fn cli_lists_and_refuses_to_remove_a_consumer_with_pending_entries() {
    let url = redis_url();
    let (stream, group) = (unique("cons-cli"), unique("g"));
    let mut conn = redis(&url);
    xadd(&mut conn, &stream, &[("event_id", "e1")]);
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg(&group)
        .arg("0")
        .query::<()>(&mut conn)
        .unwrap();
    read_as(&mut conn, &stream, &group, "old-host", 1);
    let db_url = "postgres://nobody@127.0.0.1:1/none";
    let out = taskhub(&url, db_url)
        .args(["consumers", "--stream", &stream, "--group", &group])
        .output()
        .unwrap();
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("old-host") && l.contains(" 1 ")),
        "{table}"
    );
    let out = taskhub(&url, db_url)
        .args([
            "consumers",
            "--stream",
            &stream,
            "--group",
            &group,
            "--remove",
            "old-host",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("still has pending entries"));
    assert_eq!(
        taskhub::consumers(&url, &taskhub::Tls::default(), &stream, &group)
            .unwrap()
            .len(),
        1
    );
    // A stream that does not exist (a typo) is named as such, not "cannot
    // list the consumers: no such key".
    let typo = format!("{stream}-typo");
    let out = taskhub(&url, db_url)
        .args(["consumers", "--stream", &typo, "--group", &group])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{typo}: stream does not exist")),
        "{stderr}"
    );
}

#[test]
fn urls_can_come_from_files() {
    let dir = TempDir::new("urls");
    let file = dir.0.join("redis.url");
    std::fs::write(&file, format!("{}\n", redis_url())).unwrap();
    let stream = unique("file-url");
    // The environment points nowhere; the file wins.
    let out = taskhub("redis://127.0.0.1:1", "postgres://x@127.0.0.1:1/x")
        .arg("--redis-url-file")
        .arg(&file)
        .args(["produce", "--stream", &stream, "--count", "3"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(xlen(&mut redis(&redis_url()), &stream), 3);
    // A password read from a file is redacted in errors like any other.
    std::fs::write(&file, "redis://:s3cret-pw@127.0.0.1:1/").unwrap();
    let out = taskhub(&redis_url(), "postgres://x@127.0.0.1:1/x")
        .env("REDIS_URL_FILE", &file)
        .args(["produce", "--stream", &stream, "--count", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("redis://127.0.0.1:1/") && !stderr.contains("s3cret-pw"),
        "{stderr}"
    );
    // The PostgreSQL URL too: DATABASE_URL points nowhere, the file wins.
    let db = TestDb::new();
    let pg_file = dir.0.join("database.url");
    std::fs::write(&pg_file, format!("{}\n", db.url)).unwrap();
    let out = taskhub(&redis_url(), "postgres://x@127.0.0.1:1/x")
        .arg("--database-url-file")
        .arg(&pg_file)
        .arg("migrate")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Consumer names are any client's text: the list and a prune show them on
/// one line with control characters escaped (a name with terminal escapes
/// and a newline cleared the screen and forged a row of its own; seen
/// failing).
#[test]
fn cli_shows_a_hostile_consumer_name_escaped_on_one_line() {
    let url = redis_url();
    let (stream, group) = (unique("cons-evil"), unique("g"));
    let mut conn = redis(&url);
    redis::cmd("XGROUP")
        .arg(&["CREATE", &stream, &group, "$", "MKSTREAM"])
        .query::<()>(&mut conn)
        .unwrap();
    let evil = "evil\x1b[2J\x1b[31mRED\nc9        999";
    let _: i64 = redis::cmd("XGROUP")
        .arg(&["CREATECONSUMER", &stream, &group, evil])
        .query(&mut conn)
        .unwrap();
    let db_url = "postgres://nobody@127.0.0.1:1/none";
    let run = |extra: &[&str]| {
        let out = taskhub(&url, db_url)
            .args(["consumers", "--stream", &stream, "--group", &group])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let table = run(&[]);
    assert!(!table.contains('\x1b'), "{table:?}");
    assert_eq!(table.lines().count(), 2, "a header and one row: {table:?}");
    // Escaped, not blanked: `a\nb` and `a b` must not look alike.
    assert!(
        table
            .lines()
            .nth(1)
            .unwrap()
            .starts_with(r"evil\u{1b}[2J\u{1b}[31mRED\nc9"),
        "{table:?}"
    );
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let pruned = run(&["--prune-idle", "1s"]);
    assert!(!pruned.contains('\x1b'), "{pruned:?}");
    assert_eq!(pruned.lines().count(), 2, "{pruned:?}");
    assert!(pruned.contains("1 consumer removed"), "{pruned:?}");
}
