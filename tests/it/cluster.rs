//! Redis Cluster: the worker, the dead-letter writer, replay and the CLI
//! against a real local cluster (3 masters, each with a replica), through a
//! node restart and a failover, with the usual checks: no event lost, none
//! applied twice, every failure dead-lettered once.

use crate::support;

use std::time::Duration;

use support::certs::make_certs;
use support::cluster::{Cluster, Secure};
use support::*;

/// A direct cluster connection of the test's own (redis-rs), to look at
/// what taskhub did.
fn cluster_conn(c: &Cluster) -> redis::cluster::ClusterConnection {
    redis::cluster::ClusterClient::new(vec![c.url()])
        .unwrap()
        .get_connection()
        .unwrap()
}

/// Publishes `ids` with `taskhub produce` (a subprocess, like a user).
fn produce(c: &Cluster, stream: &str, events: &[(String, String)]) {
    let lines: String = events
        .iter()
        .map(|(id, payload)| format!("{{\"event_id\":\"{id}\",\"payload\":\"{payload}\"}}\n"))
        .collect();
    let mut cmd = taskhub(&c.url(), "postgres://unused");
    cmd.args(["produce", "--stream", stream]);
    let out = output(cmd, Some(lines.as_bytes()), Duration::from_secs(60));
    assert!(out.status.success(), "produce failed:\n{}", out.stderr);
}

/// Every 25th event has a payload the statement rejects (22P02, permanent).
fn events(prefix: &str, n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let payload = if i % 25 == 7 {
                "not a number".to_string()
            } else {
                i.to_string()
            };
            (format!("{prefix}-{i}"), payload)
        })
        .collect()
}

/// `taskhub run` on `stream`, group `g`, against the cluster at `url`.
fn run(url: &str, db: &TestDb, stream: &str) -> std::process::Command {
    let mut cmd = taskhub(url, &db.url);
    cmd.args([
        "run",
        "--stream",
        stream,
        "--group",
        "g",
        "--block-ms",
        "100",
    ]);
    cmd
}

/// Entries pending in the group; panics if Redis does not answer.
fn pending(conn: &mut redis::cluster::ClusterConnection, stream: &str, group: &str) -> u64 {
    let reply: Vec<redis::Value> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query(conn)
        .unwrap();
    match reply.first() {
        Some(redis::Value::Int(n)) => *n as u64,
        other => panic!("XPENDING: {other:?}"),
    }
}

/// The events split by outcome: (dead-lettered, applied) ids.
type Split<'a> = (Vec<&'a (String, String)>, Vec<&'a (String, String)>);

fn split(all: &[(String, String)]) -> Split<'_> {
    all.iter().partition(|(_, p)| p == "not a number")
}

/// Waits until every event of `all` is applied or dead-lettered with nothing
/// pending, stops the worker with SIGTERM (exit 0) and returns its log.
fn drain_and_stop(
    mut worker: Proc,
    db: &TestDb,
    conn: &mut redis::cluster::ClusterConnection,
    stream: &str,
    all: &[(String, String)],
) -> String {
    let (bad, good) = split(all);
    let finished = wait_until(Duration::from_secs(120), || {
        db.effect_counts().len() == good.len()
            && dead_letters(conn, stream).len() >= bad.len()
            && pending(conn, stream, "g") == 0
    });
    worker.signal("TERM");
    let status = worker.wait(Duration::from_secs(30));
    let log = worker.stderr();
    assert!(
        finished,
        "not everything was processed: {} of {} effects, {} of {} dead letters, {} pending\n{log}",
        db.effect_counts().len(),
        good.len(),
        dead_letters(conn, stream).len(),
        bad.len(),
        pending(conn, stream, "g")
    );
    assert!(status.success(), "{status:?}\n{log}");
    log
}

/// Each good event applied exactly once, nothing else applied, and exactly
/// the bad ones among `dead` (the event ids of the dead letters).
fn assert_exactly_once(db: &TestDb, all: &[(String, String)], mut dead: Vec<String>) {
    let (bad, good) = split(all);
    let effects = db.effect_counts();
    for (id, _) in &good {
        assert_eq!(effects.get(id), Some(&1), "{id}: effect count");
    }
    assert_eq!(effects.len(), good.len());
    dead.sort();
    let mut expected: Vec<String> = bad.iter().map(|(id, _)| id.clone()).collect();
    expected.sort();
    assert_eq!(dead, expected);
}

#[test]
fn worker_survives_a_node_restart_and_a_failover_losing_nothing() {
    let mut cluster = Cluster::start(3, 1);
    let db = TestDb::new();
    let stream = format!("{{{}}}:events", unique("cl"));
    let mut conn = cluster_conn(&cluster);

    let first = events("a", 3000);
    produce(&cluster, &stream, &first);
    // The worker's only seed is the node that is going to be killed: its new
    // connections must find the cluster through the other nodes it learnt.
    let master = cluster.master_of(&stream);
    let worker = Proc::spawn({
        let mut cmd = run(&cluster.url_of(master), &db, &stream);
        cmd.args(["--workers", "4", "--consumer", "c1", "--sql", INT_SQL]);
        cmd
    });

    // A crash of the master that holds the stream, mid-run.
    assert!(
        wait_until(Duration::from_secs(60), || db.effect_counts().len() >= 300),
        "processing did not start:\n{}",
        worker.stderr()
    );
    cluster.restart(master, Duration::from_secs(1));

    // Then a failover of the stream's slot to a replica, mid-run.
    let second = events("b", 1500);
    produce(&cluster, &stream, &second);
    let master = cluster.master_of(&stream);
    let promoted = cluster.failover(master);
    assert_eq!(cluster.master_of(&stream), promoted);
    let third = events("c", 500);
    produce(&cluster, &stream, &third);

    let all: Vec<(String, String)> = first.into_iter().chain(second).chain(third).collect();
    let log = drain_and_stop(worker, &db, &mut conn, &stream, &all);
    assert!(log.contains("a Redis Cluster"), "{log}");
    // The restart hit the run: Redis went away and came back.
    assert!(
        log.contains("Redis: unavailable") && log.contains("Redis: reachable again"),
        "{log}"
    );

    // Nothing lost, nothing twice; failures dead-lettered once, with payload.
    let letters = dead_letters(&mut conn, &stream);
    assert_exactly_once(
        &db,
        &all,
        letters.iter().filter_map(|l| l.event_id.clone()).collect(),
    );
    let good = split(&all).1.len();
    assert_eq!(
        db.count("SELECT count(*) FROM processed_events"),
        good as i64
    );
    assert!(letters
        .iter()
        .all(|l| l.field("payload") == Some(&b"not a number"[..])));
    assert_eq!(pending(&mut conn, &stream, "g"), 0);
    assert_eq!(xlen(&mut conn, &stream), all.len() as u64);
    // The markers spread over the masters (the stream is on one of them).
    let masters_with_keys = cluster
        .nodes
        .iter()
        .filter(|n| {
            let role = n.raw(&["ROLE"]);
            let is_master = matches!(&role, Ok(redis::Value::Array(v)) if matches!(v.first(), Some(redis::Value::BulkString(r)) if r == b"master"));
            is_master && matches!(n.raw(&["DBSIZE"]), Ok(redis::Value::Int(n)) if n > 1)
        })
        .count();
    assert_eq!(masters_with_keys, 3);

    // The CLI works on the cluster too, given every node's URL this time.
    let cli = |args: &[&str]| {
        let mut cmd = taskhub(&cluster.urls(), &db.url);
        cmd.args(args);
        output(cmd, None, Duration::from_secs(60))
    };
    let out = cli(&["consumers", "--stream", &stream, "--group", "g"]);
    assert!(out.status.success(), "{}", out.stderr);
    assert!(out.stdout.contains("c1"), "{}", out.stdout);
    let out = cli(&["dlq", "stats", "--stream", &stream]);
    assert!(out.status.success(), "{}", out.stderr);
    assert!(
        out.stdout.contains(&split(&all).0.len().to_string()),
        "{}",
        out.stdout
    );

    // After a fix (a statement that takes any payload), replay all and run
    // again: each dead event is applied once, the others are not again.
    let out = cli(&["dlq", "replay", "--stream", &stream, "--all"]);
    assert!(out.status.success(), "{}", out.stderr);
    assert!(dead_letters(&mut conn, &stream).is_empty());
    let mut cmd = run(&cluster.url(), &db, &stream);
    cmd.arg("--until-idle");
    let out = output(cmd, None, Duration::from_secs(120));
    assert!(out.status.success(), "{}", out.stderr);
    let effects = db.effect_counts();
    assert_eq!(effects.len(), all.len());
    assert!(effects.values().all(|&n| n == 1), "{effects:?}");
    assert_eq!(pending(&mut conn, &stream, "g"), 0);
}

#[test]
fn worker_follows_its_stream_through_a_resharding() {
    let cluster = Cluster::start(3, 0);
    let db = TestDb::new();
    let stream = format!("{{{}}}:events", unique("rs"));
    let mut conn = cluster_conn(&cluster);
    let first = events("a", 3000);
    produce(&cluster, &stream, &first);
    let worker = Proc::spawn({
        let mut cmd = run(&cluster.url(), &db, &stream);
        cmd.args(["--workers", "4", "--sql", INT_SQL])
            .env("RUST_LOG", "info,taskhub::redis::conn=debug");
        cmd
    });
    assert!(
        wait_until(Duration::from_secs(60), || db.effect_counts().len() >= 300),
        "processing did not start:\n{}",
        worker.stderr()
    );
    // Move all of the stream's master's slots (the stream, its dead letters
    // and a third of the markers) to another master, mid-run.
    let from = cluster.master_of(&stream);
    let to = (from + 1) % 3;
    cluster.reshard(from, to);
    assert_eq!(cluster.master_of(&stream), to);
    let second = events("b", 1000);
    produce(&cluster, &stream, &second);

    let all: Vec<(String, String)> = first.into_iter().chain(second).collect();
    let log = drain_and_stop(worker, &db, &mut conn, &stream, &all);
    // The move hit the run: pipelines met MOVED or ASK and were resent.
    assert!(log.contains("pipeline redirected"), "{log}");
    let letters = dead_letters(&mut conn, &stream);
    assert_exactly_once(
        &db,
        &all,
        letters.iter().filter_map(|l| l.event_id.clone()).collect(),
    );
}

/// Whether the group has been handed every entry of `stream` and none is
/// pending: all of it was settled, one way or another.
fn settled(conn: &mut redis::cluster::ClusterConnection, stream: &str) -> bool {
    let last: String = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query::<std::collections::HashMap<String, redis::Value>>(conn)
        .ok()
        .and_then(|info| redis::from_redis_value(info.get("last-generated-id")?.clone()).ok())
        .unwrap_or_default();
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(conn)
        .unwrap_or_default();
    let delivered = groups
        .iter()
        .filter_map(|g| redis::from_redis_value::<String>(g.get("last-delivered-id")?.clone()).ok())
        .any(|id| id == last);
    delivered && pending(conn, stream, "g") == 0
}

/// Regression test for events lost as "duplicates" on a cluster: a reply
/// left unread on a connection (a stale `:1`) was read by the next marker
/// check as the marker of one of its events, and every later reply on that
/// node connection answered the command before it, so events were acked as
/// duplicates that PostgreSQL never committed. Markers now hold their own
/// tag and a reply of the wrong shape drops the connection, so a marker hit
/// is always the reply for its key.
#[test]
fn a_stale_reply_on_a_connection_is_never_taken_for_a_marker() {
    let cluster = Cluster::start(3, 0);
    let db = TestDb::new();
    let stream = format!("{{{}}}:events", unique("stale"));
    let home = cluster.master_of(&stream);
    // A node with markers only (not the stream): a third of them go
    // through the proxy.
    let proxy = cluster.stale_replies((home + 1) % 3);
    let mut conn = cluster_conn(&cluster);
    let first = events("a", 2000);
    produce(&cluster, &stream, &first);
    let mut worker = Proc::spawn({
        let mut cmd = run(&cluster.url_of(home), &db, &stream);
        cmd.args(["--workers", "4", "--sql", INT_SQL]);
        cmd
    });
    assert!(
        wait_until(Duration::from_secs(60), || db.effect_counts().len() >= 300),
        "processing did not start:\n{}",
        worker.stderr()
    );
    // Every connection open now (the worker's pool among them) finds a
    // stale reply ahead of its next one, mid-run.
    assert!(proxy.inject() > 0);
    let second = events("b", 2000);
    produce(&cluster, &stream, &second);
    let all: Vec<(String, String)> = first.into_iter().chain(second).collect();

    let done = wait_until(Duration::from_secs(120), || settled(&mut conn, &stream));
    worker.signal("TERM");
    let status = worker.wait(Duration::from_secs(30));
    let log = worker.stderr();
    assert!(done, "the stream was not settled:\n{log}");
    assert!(status.success(), "{status:?}\n{log}");
    assert!(proxy.injected() > 0, "no stale reply was read:\n{log}");

    // Nothing acked as a duplicate that this database did not commit.
    let good = split(&all).1.len();
    let effects = db.effect_counts();
    let lost: Vec<&String> = split(&all)
        .1
        .iter()
        .map(|(id, _)| id)
        .filter(|id| !effects.contains_key(*id))
        .collect();
    assert!(
        lost.is_empty(),
        "{} events acked without an effect (after {} stale replies), e.g. {:?}",
        lost.len(),
        proxy.injected(),
        &lost[..lost.len().min(5)]
    );
    assert_eq!(
        db.count("SELECT count(*) FROM processed_events"),
        good as i64
    );
    let letters = dead_letters(&mut conn, &stream);
    assert_exactly_once(
        &db,
        &all,
        letters.iter().filter_map(|l| l.event_id.clone()).collect(),
    );
    // The worker saw the reply out of place and dropped the connection.
    assert!(log.contains("a reply out of place"), "{log}");
}

#[test]
fn events_apply_once_on_a_cluster_over_mutual_tls_with_an_acl_user() {
    let dir = TempDir::new("taskhub-cluster-tls");
    let certs = make_certs(&dir.0, "cluster");
    let ca = certs.ca.clone();
    let client = certs.client("taskhub");
    let ours = certs.client("taskhub-tests");
    let password = "cluster-pass-51b2";
    let cluster = Cluster::start_with(
        3,
        0,
        Some(Secure {
            certs,
            client: ours,
            user: "taskhub".into(),
            password: password.into(),
        }),
    );
    let db = TestDb::new();
    let stream = format!("{{{}}}:events", unique("tls"));
    // The custom CA and the client certificate the nodes require are given
    // the way they are for one server (before rustls, a cluster could take
    // neither: only a CA in OpenSSL's SSL_CERT_FILE).
    let cli = |url: &str, args: &[&str], stdin: Option<&[u8]>| {
        let mut cmd = taskhub(url, &db.url);
        cmd.env_remove("SSL_CERT_FILE")
            .env("TASKHUB_REDIS_CA_FILE", &ca)
            .env("TASKHUB_REDIS_CLIENT_CERT", &client.cert)
            .env("TASKHUB_REDIS_CLIENT_KEY", &client.key)
            .args(args);
        output(cmd, stdin, Duration::from_secs(120))
    };
    let url = cluster.url();
    assert!(url.starts_with("rediss://taskhub:"), "{url}");

    let all = events("t", 400);
    let lines: String = all
        .iter()
        .map(|(id, payload)| format!("{{\"event_id\":\"{id}\",\"payload\":\"{payload}\"}}\n"))
        .collect();
    let out = cli(
        &url,
        &["produce", "--stream", &stream],
        Some(lines.as_bytes()),
    );
    assert!(out.status.success(), "{}", out.stderr);
    let run = ["run", "--stream", &stream, "--group", "g", "--until-idle"];
    let out = cli(&url, &[&run[..], &["--sql", INT_SQL]].concat(), None);
    assert!(out.status.success(), "{}", out.stderr);
    assert!(out.stderr.contains("a Redis Cluster"), "{}", out.stderr);
    assert!(!out.stderr.contains(password), "{}", out.stderr);

    let out = cli(
        &url,
        &["dlq", "list", "--stream", &stream, "--json", "--limit", "0"],
        None,
    );
    assert!(out.status.success(), "{}", out.stderr);
    let dead: Vec<String> = out
        .stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["event_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_exactly_once(&db, &all, dead);
    let out = cli(
        &url,
        &["consumers", "--stream", &stream, "--group", "g"],
        None,
    );
    assert!(out.status.success(), "{}", out.stderr);
    assert!(
        out.stdout
            .lines()
            .skip(1)
            .all(|l| l.split_whitespace().nth(1) == Some("0")),
        "{}",
        out.stdout
    );

    // A wrong password: one line, the password not in it.
    let wrong = url.replace(password, "not-the-password");
    let out = cli(&wrong, &run, None);
    assert_eq!(out.code(), Some(1), "{}", out.stderr);
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("cannot connect to Redis") && !out.stderr.contains("not-the-password"),
        "{}",
        out.stderr
    );
    // Without a client certificate, or without the CA: refused, one line.
    let no_cert = ["TASKHUB_REDIS_CLIENT_CERT", "TASKHUB_REDIS_CLIENT_KEY"];
    for missing in [&no_cert[..], &["TASKHUB_REDIS_CA_FILE"]] {
        let mut cmd = taskhub(&url, &db.url);
        cmd.env_remove("SSL_CERT_FILE")
            .env("TASKHUB_REDIS_CA_FILE", &ca)
            .env("TASKHUB_REDIS_CLIENT_CERT", &client.cert)
            .env("TASKHUB_REDIS_CLIENT_KEY", &client.key)
            .args(run);
        for var in missing {
            cmd.env_remove(var);
        }
        let out = output(cmd, None, Duration::from_secs(60));
        assert_eq!(out.code(), Some(1), "without {missing:?}: {}", out.stderr);
        assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
        assert!(
            out.stderr.contains("cannot connect to Redis") && !out.stderr.contains(password),
            "{}",
            out.stderr
        );
    }
}

#[test]
fn a_stream_without_a_hash_tag_is_refused_with_the_fix() {
    let cluster = Cluster::start(3, 0);
    let db = TestDb::new();
    let mut cmd = taskhub(&cluster.url(), &db.url);
    cmd.args(["run", "--stream", "orders", "--until-idle"]);
    let out = output(cmd, None, Duration::from_secs(60));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("hash tag") && out.stderr.contains("{orders}"),
        "{}",
        out.stderr
    );

    let mut cmd = taskhub(&cluster.url(), &db.url);
    cmd.args(["dlq", "list", "--stream", "orders"]);
    let out = output(cmd, None, Duration::from_secs(60));
    assert!(!out.status.success());
    assert!(out.stderr.contains("hash tag"), "{}", out.stderr);
}
