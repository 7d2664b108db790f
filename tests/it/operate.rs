//! Operating `taskhub run`: /metrics, /healthz, /readyz and the dead-letter
//! webhook alert, against real servers and a local HTTP receiver.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;

fn get(url: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let mut response = agent.get(url).call().unwrap();
    let status = response.status().as_u16();
    (status, response.body_mut().read_to_string().unwrap())
}

/// Parses Prometheus text: every sample line is `name{labels} value` with a
/// numeric value and a name declared by a `# TYPE` line.
fn parse_metrics(text: &str) -> Vec<(String, f64)> {
    let mut declared = Vec::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            declared.push(parts.next().unwrap().to_owned());
            assert!(
                matches!(parts.next(), Some("counter" | "gauge" | "histogram")),
                "{line}"
            );
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad name in {line:?}"
        );
        let base = name
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        assert!(
            declared.iter().any(|d| d == name || d == base),
            "{name} has no TYPE line"
        );
        if let Some(labels) = series.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(labels.starts_with('{') && labels.ends_with('}'), "{line:?}");
            }
        }
        samples.push((series.to_owned(), value));
    }
    samples
}

/// `promtool check metrics` (Debian's prometheus package) finds nothing
/// wrong with a scrape.
fn promtool_accepts(text: &str) {
    let out = output(
        {
            let mut cmd = std::process::Command::new("promtool");
            cmd.args(["check", "metrics"]);
            cmd
        },
        Some(text.as_bytes()),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success() && out.stdout.trim().is_empty() && out.stderr.trim().is_empty(),
        "promtool check metrics:\n{}{}\n{text}",
        out.stdout,
        out.stderr
    );
}

fn sample(samples: &[(String, f64)], series: &str) -> f64 {
    samples
        .iter()
        .find(|(s, _)| s == series)
        .unwrap_or_else(|| panic!("no {series} in {samples:?}"))
        .1
}

#[test]
fn metrics_health_and_readiness_match_what_the_run_did() {
    let db = TestDb::new();
    let stream = unique("ops");
    let mut r = redis(&redis_url());
    for i in 0..30 {
        xadd(
            &mut r,
            &stream,
            &[
                ("event_id", &format!("good-{i}")),
                ("payload", &i.to_string()),
            ],
        );
    }
    for i in 0..4 {
        xadd(
            &mut r,
            &stream,
            &[
                ("event_id", &format!("bad-{i}")),
                ("payload", "not a number"),
            ],
        );
    }
    let port = free_port();
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", INT_SQL, "--http", &port.to_string()]);
    let mut p = Proc::spawn(cmd);
    let dlq = taskhub::dlq::dead_letter_stream(&stream);
    assert!(
        wait_until(Duration::from_secs(20), || {
            db.count("SELECT count(*) FROM notifications") == 30 && xlen(&mut r, &dlq) == 4
        }),
        "{}",
        p.stderr()
    );
    let base = format!("http://127.0.0.1:{port}");
    assert_eq!(get(&format!("{base}/healthz")).0, 200);
    let (status, body) = get(&format!("{base}/readyz"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(get(&format!("{base}/nothing")).0, 404);

    let (status, text) = get(&format!("{base}/metrics"));
    assert_eq!(status, 200);
    promtool_accepts(&text);
    let m = parse_metrics(&text);
    // run_on names the group after the stream.
    let of = |name: &str| format!(r#"{name}{{stream="{stream}",group="{stream}"}}"#);
    assert_eq!(sample(&m, &of("taskhub_events_read_total")), 34.0);
    assert_eq!(sample(&m, &of("taskhub_events_applied_total")), 30.0);
    assert_eq!(sample(&m, &of("taskhub_duplicates_total")), 0.0);
    assert_eq!(
        sample(
            &m,
            &format!(
                r#"taskhub_dead_lettered_total{{stream="{stream}",group="{stream}",kind="permanent"}}"#
            )
        ),
        4.0
    );
    assert_eq!(
        sample(
            &m,
            &format!(
                r#"taskhub_dead_lettered_total{{stream="{stream}",group="{stream}",kind="invalid"}}"#
            )
        ),
        0.0
    );
    assert_eq!(sample(&m, &of("taskhub_oldest_pending_seconds")), 0.0);
    assert_eq!(
        sample(
            &m,
            &format!(
                r#"taskhub_build_info{{version="{}"}}"#,
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0
    );
    let rss = sample(&m, "process_resident_memory_bytes");
    assert!((1e6..1e9).contains(&rss), "{rss}");
    let started = sample(&m, "process_start_time_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        started <= now && started > now - 120.0,
        "{started} vs {now}"
    );
    assert_eq!(
        sample(&m, &format!(r#"taskhub_dead_letters{{stream="{stream}"}}"#)),
        4.0
    );
    assert_eq!(sample(&m, &of("taskhub_pending")), 0.0);
    assert_eq!(sample(&m, &of("taskhub_stream_lag")), 0.0);
    assert_eq!(sample(&m, "taskhub_in_flight"), 0.0);
    assert!(sample(&m, "taskhub_handler_duration_seconds_count") >= 1.0);
    assert_eq!(
        sample(&m, r#"taskhub_handler_duration_seconds_bucket{le="+Inf"}"#),
        sample(&m, "taskhub_handler_duration_seconds_count")
    );

    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// The gauges while work is held (a slow statement, one worker): entries in
/// flight, pending in the group, lag behind the stream, never more entries
/// held than the bound; then the duplicate counter once a repeated event_id
/// has gone through.
#[test]
fn metrics_show_work_in_progress_and_duplicates() {
    const SLOW_SQL: &str =
        "INSERT INTO notifications (event_id, payload) SELECT $1, $2 FROM pg_sleep(0.4)";
    let db = TestDb::new();
    let stream = unique("ops-busy");
    let mut r = redis(&redis_url());
    for id in ["e0", "e1", "e2", "e3", "e4", "e5", "e0"] {
        xadd(&mut r, &stream, &[("event_id", id), ("payload", "p")]);
    }
    let port = free_port();
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", SLOW_SQL, "--http", &port.to_string()])
        .args(["--workers", "1", "--count", "1", "--mode", "per-event"]);
    let mut p = Proc::spawn(cmd);
    let metrics = || parse_metrics(&get(&format!("http://127.0.0.1:{port}/metrics")).1);
    let gauge = |m: &[(String, f64)], name: &str| {
        sample(
            m,
            &format!(r#"{name}{{stream="{stream}",group="{stream}"}}"#),
        )
    };
    assert!(
        wait_until(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && sample(&metrics(), "taskhub_in_flight") > 0.0
        }),
        "{}",
        p.stderr()
    );
    let m = metrics();
    assert!(gauge(&m, "taskhub_pending") > 0.0, "{m:?}");
    assert!(gauge(&m, "taskhub_stream_lag") > 0.0, "{m:?}");
    gauge(&m, "taskhub_oldest_pending_seconds");
    // Memory stays bounded: at most workers · count · 2 = 2 entries held.
    let mut most_held = 0;
    assert!(
        wait_until(Duration::from_secs(30), || {
            let held = pending(&mut r, &stream, &stream);
            most_held = most_held.max(held);
            db.effect_counts().len() == 6 && held == 0
        }),
        "{}",
        p.stderr()
    );
    assert!((1..=2).contains(&most_held), "{most_held} entries held");
    let m = metrics();
    assert_eq!(gauge(&m, "taskhub_events_read_total"), 7.0);
    assert_eq!(gauge(&m, "taskhub_events_applied_total"), 6.0);
    assert_eq!(gauge(&m, "taskhub_duplicates_total"), 1.0);
    assert_eq!(sample(&m, "taskhub_in_flight"), 0.0);
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

#[test]
fn readyz_says_which_server_is_down() {
    let mut pg = PrivatePostgres::start();
    let db = TestDb::on(&pg.url("postgres"));
    readyz_names_the_server_down(&redis_url(), &db, "postgres", |up| {
        if up {
            pg.start_again()
        } else {
            pg.stop()
        }
    });
    let mut r = PrivateRedis::start();
    let db = TestDb::new();
    readyz_names_the_server_down(&r.url(), &db, "redis", |up| {
        if up {
            r.start_again()
        } else {
            r.stop()
        }
    });
}

/// `/readyz` answers 200, then 503 naming `server` while it is stopped
/// (`set_up(false)`; `/healthz` still 200), then 200 again once it is back
/// (`set_up(true)`).
fn readyz_names_the_server_down(
    redis_url: &str,
    db: &TestDb,
    server: &str,
    mut set_up: impl FnMut(bool),
) {
    let stream = unique("ready");
    let port = free_port();
    let mut cmd = taskhub(redis_url, &db.url);
    cmd.args([
        "run",
        "--stream",
        &stream,
        "--group",
        &stream,
        "--block-ms",
        "100",
    ])
    .args(["--http", &format!("127.0.0.1:{port}")]);
    let mut p = Proc::spawn(cmd);
    let url = format!("http://127.0.0.1:{port}/readyz");
    // Listening at once, ready once connected.
    assert!(wait_until(Duration::from_secs(20), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    }));
    assert!(wait_until(Duration::from_secs(20), || get(&url).0 == 200));
    set_up(false);
    let (status, body) = get(&url);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(server), "{body}");
    assert_eq!(
        get(&format!("http://127.0.0.1:{port}/healthz")).0,
        200,
        "alive all the same"
    );
    set_up(true);
    assert!(wait_until(Duration::from_secs(20), || get(&url).0 == 200));
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// Bodies received by a local webhook receiver.
type Posts = Arc<Mutex<Vec<serde_json::Value>>>;

/// A webhook receiver that answers HTTP 500 to its first `failures`
/// requests, then 200; returns its URL and every body it received.
fn receiver(failures: usize) -> (String, Posts) {
    let posts: Posts = Arc::default();
    let seen = posts.clone();
    let addr = crate::support::downstream::start(move |request| {
        let n = {
            let mut seen = seen.lock().unwrap();
            seen.push(serde_json::from_slice(&request.body).unwrap());
            seen.len()
        };
        crate::support::downstream::Answer::status(if n <= failures { 500 } else { 200 })
    });
    (format!("http://{addr}/alert"), posts)
}

/// Waits until the alert thread of `stream` has run a whole round that began
/// after this call, so that an alert it was going to send has been sent. The
/// lease holder renews its lease (resets its TTL) at the start of every round
/// (src/alerts/state.rs): the second renewal seen starts the round after one
/// that began, and so ended, after this call.
fn wait_for_alert_round(r: &mut redis::Connection, stream: &str) {
    // run_on's group is named after the stream.
    wait_for_alert_round_of(r, stream, stream);
}

/// [`wait_for_alert_round`] of the instances of `group`.
fn wait_for_alert_round_of(r: &mut redis::Connection, stream: &str, group: &str) {
    let lease = format!("th:alert:lease:{}:{stream}:{group}", stream.len());
    let mut ttl = || -> i64 { redis::cmd("PTTL").arg(&lease).query(r).unwrap() };
    let (mut last, mut renewals) = (ttl(), 0);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let now = ttl();
            if now > last {
                renewals += 1;
            }
            last = now;
            renewals >= 2
        }),
        "the alert thread of {stream} did not renew its lease twice"
    );
}

#[test]
fn webhook_is_retried_and_rate_limited() {
    let (hook, posts) = receiver(1);
    let db = TestDb::new();
    let stream = unique("alert-rl");
    let mut r = redis(&redis_url());
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", INT_SQL, "--alert-webhook", &hook])
        .args(["--alert-interval", "100ms", "--alert-min-gap", "1h"]);
    let mut p = Proc::spawn(cmd);
    let count = || posts.lock().unwrap().len();
    xadd(&mut r, &stream, &[("event_id", "bad-1"), ("payload", "x")]);
    // The receiver fails the first call: the same alert is sent again.
    assert!(
        wait_until(Duration::from_secs(15), || count() == 2),
        "{}",
        p.stderr()
    );
    {
        let posts = posts.lock().unwrap();
        assert_eq!(posts[0], posts[1], "the retry carries the same alert");
        assert_eq!(posts[1]["change"], "non_empty");
    }
    // It grows, but within --alert-min-gap: logged, not posted.
    xadd(&mut r, &stream, &[("event_id", "bad-2"), ("payload", "y")]);
    assert!(wait_until(Duration::from_secs(10), || p
        .stderr()
        .contains("dead letters (growing)")));
    wait_for_alert_round(&mut r, &stream);
    assert_eq!(count(), 2);
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

#[test]
fn webhook_fires_once_per_state_change() {
    let (hook, posts) = receiver(0);
    let db = TestDb::new();
    let stream = unique("alert");
    let mut r = redis(&redis_url());
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", INT_SQL, "--alert-webhook", &hook])
        .args(["--alert-interval", "100ms", "--alert-min-gap", "0s"]);
    let mut p = Proc::spawn(cmd);
    let count = || posts.lock().unwrap().len();

    // Healthy events: no alert.
    xadd(&mut r, &stream, &[("event_id", "ok"), ("payload", "1")]);
    assert!(wait_until(Duration::from_secs(10), || db.effects("ok") == 1));
    wait_for_alert_round(&mut r, &stream);
    assert_eq!(count(), 0);

    // The stream becomes non-empty: one alert, then silence.
    xadd(&mut r, &stream, &[("event_id", "bad-1"), ("payload", "x")]);
    assert!(
        wait_until(Duration::from_secs(10), || count() == 1),
        "{}",
        p.stderr()
    );
    wait_for_alert_round(&mut r, &stream);
    assert_eq!(count(), 1);
    {
        let posts = posts.lock().unwrap();
        assert_eq!(posts[0]["change"], "non_empty");
        assert_eq!(posts[0]["count"], 1);
        assert_eq!(posts[0]["latest_event_id"], "bad-1");
        assert_eq!(posts[0]["latest_group"].as_str(), Some(stream.as_str()));
        assert!(
            posts[0]["latest_reason"]
                .as_str()
                .unwrap()
                .contains("22P02"),
            "{}",
            posts[0]
        );
    }
    assert!(
        p.stderr().contains("dead letters (no longer empty)"),
        "{}",
        p.stderr()
    );

    // It grows: one more alert.
    xadd(&mut r, &stream, &[("event_id", "bad-2"), ("payload", "y")]);
    assert!(
        wait_until(Duration::from_secs(10), || count() == 2),
        "{}",
        p.stderr()
    );
    wait_for_alert_round(&mut r, &stream);
    assert_eq!(count(), 2);
    assert_eq!(posts.lock().unwrap()[1]["change"], "grew");
    assert_eq!(posts.lock().unwrap()[1]["count"], 2);

    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// Two instances of one group: one alert per change, from the instance
/// holding the lease; once it is SIGKILLed, the other takes over after the
/// lease's TTL and says only what changed since (no repeated alert).
#[test]
fn one_instance_alerts_and_another_takes_over_when_it_dies() {
    let (hook, posts) = receiver(0);
    let db = TestDb::new();
    let stream = unique("alert-lease");
    let mut r = redis(&redis_url());
    let start = |name: &str| {
        let mut cmd = run_on(&db.url, &stream);
        cmd.args(["--sql", INT_SQL, "--alert-webhook", &hook])
            .args(["--alert-interval", "100ms", "--alert-min-gap", "0s"])
            .env("TASKHUB_CONSUMER", name)
            .env("RUST_LOG", "info,taskhub::alerts=debug");
        Proc::spawn(cmd)
    };
    let mut procs = [start("vm-a"), start("vm-b")];
    let count = || posts.lock().unwrap().len();
    let waiting = |p: &Proc| {
        p.stderr()
            .matches("another instance holds the alert lease")
            .count()
    };

    xadd(&mut r, &stream, &[("event_id", "bad-1"), ("payload", "x")]);
    assert!(wait_until(Duration::from_secs(15), || count() == 1));
    let holder = posts.lock().unwrap()[0]["consumer"]
        .as_str()
        .unwrap()
        .to_owned();
    let (held, other) = if holder == "vm-a" { (0, 1) } else { (1, 0) };
    // The other instance looked at the lease a few more times, and stayed
    // quiet.
    let seen = waiting(&procs[other]);
    assert!(
        wait_until(Duration::from_secs(10), || waiting(&procs[other])
            >= seen + 3),
        "{}",
        procs[other].stderr()
    );
    assert_eq!(count(), 1, "{:?}", posts.lock().unwrap());
    assert_eq!(posts.lock().unwrap()[0]["change"], "non_empty");

    procs[held].kill();
    xadd(&mut r, &stream, &[("event_id", "bad-2"), ("payload", "y")]);
    assert!(
        wait_until(Duration::from_secs(20), || count() == 2),
        "{}",
        procs[other].stderr()
    );
    {
        let posts = posts.lock().unwrap();
        assert_eq!(
            posts[1]["consumer"],
            if other == 0 { "vm-a" } else { "vm-b" }
        );
        assert_eq!(posts[1]["change"], "grew", "{:?}", *posts);
        assert_eq!(posts[1]["count"], 2);
    }
    procs[other].signal("TERM");
    assert!(procs[other].wait(Duration::from_secs(20)).success());
    assert_eq!(count(), 2);
}

/// The group's dead-letter index holds one field per entry ever
/// dead-lettered, so that an entry delivered again is not dead-lettered
/// twice. An entry gone from the stream (trimmed below its first entry) can
/// never be delivered again: once its letter is a day old, the worker
/// forgets it, in the group's index and in the index of every group's
/// letters of earlier versions. Entries still in the stream, and letters
/// written less than a day ago, stay (a writer that lost the reply of its
/// script may still ask again).
#[test]
fn the_dead_letter_index_forgets_entries_gone_from_the_stream() {
    let db = TestDb::new();
    let stream = unique("forget");
    let group = stream.clone(); // run_on's group
    let index = format!("{stream}:dlq:index:{}:{group}", group.len());
    let old_index = format!("{stream}:dlq:index");
    let mut r = redis(&redis_url());
    let gone = xadd(&mut r, &stream, &[("event_id", "gone"), ("payload", "1")]);
    let kept = xadd(&mut r, &stream, &[("event_id", "kept"), ("payload", "2")]);
    // Trim the first entry away; the second stays.
    let _: i64 = redis::cmd("XTRIM")
        .arg(&stream)
        .arg("MINID")
        .arg(&kept)
        .query(&mut r)
        .unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let day_old = format!("{}-0", now_ms - 25 * 3600 * 1000);
    let fresh = format!("{now_ms}-0");
    let hset = |r: &mut redis::Connection, key: &str, field: &str, value: &str| {
        let _: i64 = redis::cmd("HSET")
            .arg(key)
            .arg(field)
            .arg(value)
            .query(r)
            .unwrap();
    };
    hset(&mut r, &index, "1-0", &day_old); // gone, old letter: forgotten
    hset(&mut r, &index, &gone, &day_old); // gone, old letter: forgotten
    hset(&mut r, &index, "2-0", &fresh); // gone, letter of now: kept
    hset(&mut r, &index, &kept, &day_old); // in the stream: kept
    hset(&mut r, &old_index, "1-5", &day_old); // gone: forgotten
    hset(&mut r, &old_index, &kept, &day_old); // in the stream: kept

    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", INT_SQL, "--reclaim-interval", "100ms"])
        .env("RUST_LOG", "info");
    let mut p = Proc::spawn(cmd);
    let fields = |r: &mut redis::Connection, key: &str| -> Vec<String> {
        let mut f: Vec<String> = redis::cmd("HKEYS").arg(key).query(r).unwrap();
        f.sort();
        f
    };
    let mut expected = vec!["2-0".to_owned(), kept.clone()];
    expected.sort();
    // The line comes once both indexes were pruned (one after the other:
    // checked as soon as the group's index was, the other one was not yet,
    // once, on a loaded machine).
    assert!(
        p.wait_for(
            "forgot 3 entries gone from the stream",
            Duration::from_secs(20)
        ),
        "{:?}: {}",
        fields(&mut r, &index),
        p.stderr()
    );
    assert_eq!(fields(&mut r, &index), expected);
    assert_eq!(fields(&mut r, &old_index), [kept.as_str()]);
    // The entry still in the stream was dead-lettered: acked, not applied.
    let pending = |r: &mut redis::Connection| -> u64 {
        let (n, _, _, _): (u64, Option<String>, Option<String>, redis::Value) =
            redis::cmd("XPENDING")
                .arg(&stream)
                .arg(&group)
                .query(r)
                .unwrap();
        n
    };
    assert!(wait_until(Duration::from_secs(10), || pending(&mut r) == 0));
    assert_eq!(db.effects("kept"), 0);
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// Two groups read one stream, each with its own webhook: each alerts on
/// its own dead letters only, to its own webhook, with its own count. Before,
/// one lease per stream: whichever instance held it alerted on every
/// group's letters, to its own webhook only, under its own group's name
/// (the other team heard nothing of its letters, and the first one heard
/// them as its own growing).
#[test]
fn each_group_alerts_on_its_own_dead_letters_to_its_own_webhook() {
    let db = TestDb::new();
    let stream = unique("alert-groups");
    let mut r = redis(&redis_url());
    // billing fails events whose payload is not an integer; emails fails
    // those whose payload is two characters long (a division by zero).
    let billing_sql = INT_SQL;
    let emails_sql =
        "INSERT INTO notifications (event_id, payload) VALUES ($1, (10 / (length($2::text) - 2))::text)";
    let start = |group: &str, sql: &str, hook: &str| {
        let mut cmd = taskhub(&redis_url(), &db.url);
        cmd.args([
            "run",
            "--stream",
            &stream,
            "--group",
            group,
            "--block-ms",
            "100",
        ])
        .args(["--sql", sql, "--alert-webhook", hook])
        .args(["--alert-interval", "100ms", "--alert-min-gap", "0s"]);
        Proc::spawn(cmd)
    };
    let (billing_hook, billing_posts) = receiver(0);
    let (emails_hook, emails_posts) = receiver(0);
    let mut billing = start("billing", billing_sql, &billing_hook);
    let mut emails = start("emails", emails_sql, &emails_hook);
    let posts = |p: &Posts| p.lock().unwrap().clone();

    // billing's letter: billing hears of it, emails does not.
    xadd(
        &mut r,
        &stream,
        &[("event_id", "for-billing"), ("payload", "x")],
    );
    assert!(
        wait_until(Duration::from_secs(15), || posts(&billing_posts).len() == 1),
        "{}",
        billing.stderr()
    );
    let post = &posts(&billing_posts)[0];
    assert_eq!(
        (
            &post["group"],
            &post["count"],
            &post["change"],
            &post["latest_event_id"]
        ),
        (
            &"billing".into(),
            &1.into(),
            &"non_empty".into(),
            &"for-billing".into()
        ),
        "{post}"
    );
    assert!(wait_until(Duration::from_secs(10), || db
        .effects("for-billing")
        == 1));
    wait_for_alert_round_of(&mut r, &stream, "emails");
    assert_eq!(posts(&emails_posts).len(), 0, "{:?}", posts(&emails_posts));

    // emails' letter: emails hears of it with its own count; billing's
    // count did not change.
    xadd(
        &mut r,
        &stream,
        &[("event_id", "for-emails"), ("payload", "12")],
    );
    assert!(
        wait_until(Duration::from_secs(15), || posts(&emails_posts).len() == 1),
        "{}",
        emails.stderr()
    );
    let post = &posts(&emails_posts)[0];
    assert_eq!(
        (
            &post["group"],
            &post["count"],
            &post["change"],
            &post["latest_event_id"]
        ),
        (
            &"emails".into(),
            &1.into(),
            &"non_empty".into(),
            &"for-emails".into()
        ),
        "{post}"
    );
    assert!(wait_until(Duration::from_secs(10), || db
        .effects("for-emails")
        == 1));
    wait_for_alert_round_of(&mut r, &stream, "billing");
    assert_eq!(
        posts(&billing_posts).len(),
        1,
        "{:?}",
        posts(&billing_posts)
    );
    assert!(
        billing
            .stderr()
            .contains("1 dead letters (no longer empty) of group billing"),
        "{}",
        billing.stderr()
    );
    for p in [&mut billing, &mut emails] {
        p.signal("TERM");
        assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
    }
}

/// A group's alert counts its own letters exactly, whatever other groups
/// put in or take out of the shared dead-letter stream: a purge of another
/// group's letters is no change of its own, and neither are letters left
/// by a group destroyed since (the stream then has one group again, but
/// not one group's letters: the reviewer saw them posted as this group's
/// growing, 1,007 of them).
#[test]
fn a_groups_alert_count_ignores_other_groups_letters() {
    let (hook, posts) = receiver(0);
    let db = TestDb::new();
    let stream = unique("alert-shared");
    let group = stream.clone(); // run_on's
    let mut r = redis(&redis_url());
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("other")
        .arg("$")
        .arg("MKSTREAM")
        .query(&mut r)
        .unwrap();
    let others_letter = |r: &mut redis::Connection, i: usize| {
        let mut l = taskhub::DeadLetter::new(
            &stream,
            "1-0",
            taskhub::DeadLetterKind::Permanent,
            "other's",
            vec![(b"event_id".to_vec(), format!("o-{i}").into_bytes())],
        );
        l.group = "other".into();
        l.dead_at = 1;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(taskhub::dlq::dead_letter_stream(&stream)).arg("*");
        for (k, v) in l.to_fields() {
            cmd.arg(k).arg(v);
        }
        let _: String = cmd.query(r).unwrap();
    };
    for i in 0..50 {
        others_letter(&mut r, i);
    }
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", INT_SQL, "--alert-webhook", &hook])
        .args(["--alert-interval", "100ms", "--alert-min-gap", "0s"]);
    let mut p = Proc::spawn(cmd);
    let count = || posts.lock().unwrap().len();

    xadd(&mut r, &stream, &[("event_id", "bad-1"), ("payload", "x")]);
    assert!(
        wait_until(Duration::from_secs(15), || count() == 1),
        "{}",
        p.stderr()
    );
    assert_eq!(posts.lock().unwrap()[0]["count"], 1, "its own letter only");
    // Old letters of the other group (dead_at 1970) do not age this one's.
    wait_for_alert_round_of(&mut r, &stream, &group);
    assert_eq!(count(), 1);

    // The other group's letters purged: nothing changed for this group.
    let mut purge = taskhub(&redis_url(), &db.url);
    purge.args([
        "dlq", "--stream", &stream, "--group", "other", "purge", "--all", "--yes",
    ]);
    let out = output(purge, None, Duration::from_secs(20));
    assert!(out.stdout.contains("removed 50"), "{}", out.stdout);
    wait_for_alert_round_of(&mut r, &stream, &group);
    assert_eq!(count(), 1, "{:?}", posts.lock().unwrap());

    // The other group destroyed, and letters of it left at the end (say a
    // writer of it finished late): still none of this group's.
    let _: i64 = redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(&stream)
        .arg("other")
        .query(&mut r)
        .unwrap();
    for i in 0..5 {
        others_letter(&mut r, 100 + i);
    }
    wait_for_alert_round_of(&mut r, &stream, &group);
    assert_eq!(count(), 1, "{:?}", posts.lock().unwrap());

    // A letter of its own: it grew, by one.
    xadd(&mut r, &stream, &[("event_id", "bad-2"), ("payload", "y")]);
    assert!(
        wait_until(Duration::from_secs(15), || count() == 2),
        "{}",
        p.stderr()
    );
    {
        let posts = posts.lock().unwrap();
        assert_eq!(
            (&posts[1]["change"], &posts[1]["count"]),
            (&"grew".into(), &2.into()),
            "{:?}",
            *posts
        );
        assert_eq!(posts[1]["latest_event_id"], "bad-2");
    }
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// Two groups reading one stream, an instance of each: every series of the
/// stream carries its group, so the drained group's instance reports its
/// own zeros and the busy one its own backlog. (With the stream label
/// alone, both reported `taskhub_pending{stream="S"}`, and a dashboard's
/// `max by (stream)` showed one group's backlog as the other's.) The
/// dead-letter stream is every group's: its gauge has no group.
#[test]
fn metrics_of_groups_sharing_a_stream_carry_their_group() {
    const SLOW_SQL: &str =
        "INSERT INTO notifications (event_id, payload) SELECT $1, $2 FROM pg_sleep(1)";
    let (db_a, db_b) = (TestDb::new(), TestDb::new());
    let stream = unique("ops-groups");
    let (group_a, group_b) = (format!("{stream}-a"), format!("{stream}-b"));
    let mut r = redis(&redis_url());
    for i in 0..20 {
        xadd(
            &mut r,
            &stream,
            &[("event_id", &format!("e{i}")), ("payload", "p")],
        );
    }
    let start = |db: &TestDb, group: &str, port: u16, extra: &[&str]| {
        let mut cmd = taskhub(&redis_url(), &db.url);
        cmd.args(["run", "--stream", &stream, "--group", group])
            .args(["--block-ms", "100", "--http", &port.to_string()])
            .args(extra);
        Proc::spawn(cmd)
    };
    let (port_a, port_b) = (free_port(), free_port());
    let mut a = start(&db_a, &group_a, port_a, &[]);
    let slow = ["--sql", SLOW_SQL, "--workers", "1", "--count", "1"];
    let mut b = start(&db_b, &group_b, port_b, &slow);
    assert!(
        wait_until(Duration::from_secs(20), || {
            db_a.count("SELECT count(*) FROM notifications") == 20
                && std::net::TcpStream::connect(("127.0.0.1", port_b)).is_ok()
        }),
        "{}\n{}",
        a.stderr(),
        b.stderr()
    );
    let scrape = |port: u16| get(&format!("http://127.0.0.1:{port}/metrics")).1;
    let (text_a, text_b) = (scrape(port_a), scrape(port_b));
    promtool_accepts(&text_a);
    let (m_a, m_b) = (parse_metrics(&text_a), parse_metrics(&text_b));
    let of = |name: &str, group: &str| format!(r#"{name}{{stream="{stream}",group="{group}"}}"#);
    assert_eq!(
        sample(&m_a, &of("taskhub_events_applied_total", &group_a)),
        20.0
    );
    assert_eq!(sample(&m_a, &of("taskhub_pending", &group_a)), 0.0);
    assert_eq!(sample(&m_a, &of("taskhub_stream_lag", &group_a)), 0.0);
    assert!(sample(&m_b, &of("taskhub_events_applied_total", &group_b)) < 20.0);
    assert!(
        sample(&m_b, &of("taskhub_stream_lag", &group_b)) > 0.0,
        "{text_b}"
    );
    assert_eq!(
        sample(
            &m_a,
            &format!(
                r#"taskhub_dead_lettered_total{{stream="{stream}",group="{group_a}",kind="permanent"}}"#
            )
        ),
        0.0
    );
    // Neither instance speaks for the other group.
    assert!(!text_a.contains(&group_b), "{text_a}");
    assert!(
        !text_b.contains(&format!("group=\"{group_a}\"")),
        "{text_b}"
    );
    for m in [&m_a, &m_b] {
        assert_eq!(
            sample(m, &format!(r#"taskhub_dead_letters{{stream="{stream}"}}"#)),
            0.0
        );
    }
    for p in [&mut a, &mut b] {
        p.signal("TERM");
        assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
    }
}

/// Two instances started under one consumer name (two on one host, both
/// with the default, the host name) share one pending list: each is told,
/// in its log and in /metrics. An instance that replaces one killed under
/// the same name is not (the record of the killed one is there when it
/// starts, and is never written again).
#[test]
fn two_instances_under_one_consumer_name_are_told() {
    let db = TestDb::new();
    let stream = unique("same-name");
    let start = |port: Option<u16>| {
        let mut cmd = run_on(&db.url, &stream);
        cmd.args(["--sql", INT_SQL])
            .env("TASKHUB_CONSUMER", "vm-same");
        if let Some(port) = port {
            cmd.args(["--http", &port.to_string()]);
        }
        Proc::spawn(cmd)
    };
    let told = "another instance runs as consumer \"vm-same\"";
    let mut r = redis(&redis_url());
    let record = format!(
        "th:c:{}:{stream}:{}:{stream}:vm-same",
        stream.len(),
        stream.len()
    );
    let value = |r: &mut redis::Connection| -> Option<String> {
        redis::cmd("GET").arg(&record).query(r).unwrap()
    };
    let mut killed = start(None);
    let of = |pid: u32| format!(" pid {pid} on ");
    let killed_pid = killed.pid();
    assert!(
        wait_until(Duration::from_secs(15), || value(&mut r)
            .is_some_and(|v| v.contains(&of(killed_pid)))),
        "{}",
        killed.stderr()
    );
    killed.kill();
    // The killed one's record is still there when the replacement writes
    // its first: that find must not be taken for a clash.
    let left: i64 = redis::cmd("PTTL").arg(&record).query(&mut r).unwrap();
    assert!(left > 5_000, "{left} ms left");
    let port = free_port();
    let replacement = start(Some(port));
    assert!(
        wait_until(Duration::from_secs(15), || value(&mut r)
            .is_some_and(|v| v.contains(&of(replacement.pid())))),
        "{}",
        replacement.stderr()
    );
    std::thread::sleep(Duration::from_secs(11));
    assert!(
        !replacement.stderr().contains(told),
        "{}",
        replacement.stderr()
    );

    let twin = start(None);
    xadd(&mut r, &stream, &[("event_id", "e-1"), ("payload", "1")]);
    for p in [&replacement, &twin] {
        assert!(
            wait_until(Duration::from_secs(30), || p.stderr().contains(told)),
            "{}",
            p.stderr()
        );
    }
    let pid = twin.pid().to_string();
    assert!(
        replacement.stderr().contains(&format!("\"pid {pid} on ")),
        "{}",
        replacement.stderr()
    );
    let (_, metrics) = get(&format!("http://127.0.0.1:{port}/metrics"));
    let clashes = sample(
        &parse_metrics(&metrics),
        &format!("taskhub_consumer_name_clashes_total{{group=\"{stream}\"}}"),
    );
    assert!(clashes >= 1.0, "{metrics}");
    // Outcomes stay exact.
    assert!(wait_until(Duration::from_secs(15), || db.effects("e-1") == 1));
    for mut p in [replacement, twin] {
        p.signal("TERM");
        assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
    }
    assert_eq!(db.effects("e-1"), 1);
}

/// A refusal of the record's write that passes (here a full `maxmemory`
/// under `noeviction`, which Redis lifts again) skips a turn of the check;
/// it used to turn the check off until a restart, and a twin started later
/// went untold.
#[test]
fn a_passing_refusal_does_not_turn_the_name_check_off() {
    let db = TestDb::new();
    let server = PrivateRedis::start();
    let stream = unique("same-name-oom");
    let start = || {
        let mut cmd = taskhub(&server.url(), &db.url);
        cmd.args(["run", "--stream", &stream, "--group", &stream])
            .args(["--block-ms", "100", "--sql", INT_SQL])
            .env("TASKHUB_CONSUMER", "vm-oom")
            .env("RUST_LOG", "info,taskhub::worker::name_check=debug");
        Proc::spawn(cmd)
    };
    let mut r = redis(&server.url());
    let record = format!(
        "th:c:{}:{stream}:{}:{stream}:vm-oom",
        stream.len(),
        stream.len()
    );
    let first = start();
    assert!(
        wait_until(Duration::from_secs(15), || redis::cmd("EXISTS")
            .arg(&record)
            .query::<bool>(&mut r)
            .unwrap()),
        "{}",
        first.stderr()
    );
    let config = |r: &mut redis::Connection, name: &str, value: &str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query::<()>(r)
            .unwrap();
    };
    config(&mut r, "maxmemory-policy", "noeviction");
    config(&mut r, "maxmemory", "1");
    let refused = "was not written this time";
    let seen = wait_until(Duration::from_secs(12), || first.stderr().contains(refused));
    config(&mut r, "maxmemory", "0");
    assert!(seen, "no refresh while Redis was full: {}", first.stderr());
    assert!(
        !first.stderr().contains("the check is off"),
        "{}",
        first.stderr()
    );

    let twin = start();
    let told = "another instance runs as consumer \"vm-oom\"";
    for p in [&first, &twin] {
        assert!(
            wait_until(Duration::from_secs(30), || p.stderr().contains(told)),
            "{}",
            p.stderr()
        );
    }
    // Reading went on through it all: an event after it is applied once.
    xadd(&mut r, &stream, &[("event_id", "e-1"), ("payload", "1")]);
    assert!(wait_until(Duration::from_secs(15), || db.effects("e-1") == 1));
    for mut p in [first, twin] {
        p.signal("TERM");
        assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
    }
    assert_eq!(db.effects("e-1"), 1);
}
