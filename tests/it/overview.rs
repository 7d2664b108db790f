//! The overview at `/` of `--http`, rendered in a real headless Chromium:
//! the streams as `taskhub status` sees them, this instance's counters, and
//! the entries waiting here for a retry with their last error.

use std::time::Duration;

use crate::support::browser::render;
use crate::support::*;

/// A handler statement that fails retryably (SQLSTATE 40001) for payload
/// `busy`, permanently for a payload that is not an integer, and inserts
/// otherwise.
const SQL: &str = "SELECT apply_or_fail($1, $2)";

fn make_function(db: &TestDb) {
    db.client()
        .batch_execute(
            "CREATE FUNCTION apply_or_fail(id text, p text) RETURNS void AS $$
             BEGIN
               IF p = 'busy' THEN
                 RAISE EXCEPTION 'downstream busy, try later' USING ERRCODE = '40001';
               END IF;
               INSERT INTO notifications (event_id, payload) VALUES (id, p::int::text);
             END $$ LANGUAGE plpgsql",
        )
        .unwrap();
}

fn get(port: u16, path: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    match agent.get(format!("http://127.0.0.1:{port}{path}")).call() {
        Ok(mut r) => (
            r.status().as_u16(),
            r.body_mut().read_to_string().unwrap_or_default(),
        ),
        Err(_) => (0, String::new()),
    }
}

#[test]
fn the_overview_shows_streams_counters_and_what_waits_for_a_retry() {
    let db = TestDb::new();
    make_function(&db);
    let stream = unique("overview");
    let mut r = redis(&redis_url());
    xadd(&mut r, &stream, &[("event_id", "fine-1"), ("payload", "1")]);
    xadd(
        &mut r,
        &stream,
        &[("event_id", "broken-1"), ("payload", "x")],
    );
    xadd(
        &mut r,
        &stream,
        &[("event_id", "busy-1"), ("payload", "busy")],
    );
    // Another group reads the stream too: the dead letters are shared.
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", &stream, "other<b>", "$"])
        .query(&mut r)
        .unwrap();
    let port = free_port();
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", SQL, "--http", &port.to_string()])
        // The retry waits a minute: long enough to be seen on the page.
        .args(["--backoff-base", "60s", "--backoff-cap", "60s"]);
    let mut p = Proc::spawn(cmd);
    assert!(
        wait_until(Duration::from_secs(30), || get(port, "/")
            .1
            .contains("Waiting for a retry here (1)")),
        "{}",
        p.stderr()
    );

    let dom = render(&format!("http://127.0.0.1:{port}/"), None);
    assert!(dom.contains("http-equiv=\"refresh\""), "{dom}");
    // The stream row: 3 entries, nothing left to deliver, one pending (the
    // retry), one dead letter linking to its filtered list.
    let row = dom
        .split("<tr>")
        .find(|row| row.contains(&format!("<td>{stream}</td>")))
        .unwrap_or_else(|| panic!("no row for {stream}: {dom}"));
    let cells: Vec<&str> = row
        .split("<td>")
        .skip(1)
        .map(|c| c.split("</td>").next().unwrap())
        .collect();
    assert_eq!(cells[1..4], ["3", "0", "1"], "{row}");
    assert!(
        row.contains(&format!("href=\"/dlq?stream={stream}\">1</a>")),
        "{row}"
    );
    // Every group's letters, said so, with a link to this group's (run_on
    // names the group after the stream); the other group named, escaped.
    assert!(
        row.contains(&format!(
            "(every group's; <a href=\"/dlq?stream={stream}&amp;group={stream}\">this group's</a>)"
        )),
        "{row}"
    );
    assert!(
        dom.contains(&format!(
            "The dead letters of {stream} are every group's: the stream is also read by other&lt;b&gt;."
        )),
        "{dom}"
    );
    // A retry held in this process keeps its first delivery: redelivered
    // counts none, and the instance tells its own.
    assert!(dom.contains("<th>redelivered</th>"), "{dom}");
    assert_eq!(cells[5], "0", "{row}");
    let metrics = get(port, "/metrics").1;
    assert!(
        metrics
            .lines()
            .any(|l| l == format!(r#"taskhub_retries_waiting{{group="{stream}"}} 1"#)),
        "{metrics}"
    );
    // The counters, and the retry with its attempt count and error.
    assert!(dom.contains("<td>applied</td><td>1</td>"), "{dom}");
    assert!(dom.contains("<td>dead-lettered</td><td>1</td>"), "{dom}");
    let retry = dom
        .split("<tr>")
        .find(|row| row.contains("busy-1"))
        .unwrap_or_else(|| panic!("no retry row: {dom}"));
    assert!(retry.contains("<td>1</td>"), "attempts: {retry}");
    assert!(retry.contains("downstream busy, try later"), "{retry}");
    assert!(retry.contains("in "), "next try: {retry}");

    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

#[test]
fn off_loopback_the_overview_needs_the_read_token() {
    let db = TestDb::new();
    let stream = unique("overview-auth");
    let port = free_port();
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--http", &format!("0.0.0.0:{port}")])
        .env("TASKHUB_READ_TOKEN", "a-read-token-for-tests");
    let mut p = Proc::spawn(cmd);
    assert!(wait_until(Duration::from_secs(20), || get(port, "/readyz")
        .0
        == 200));
    let (status, body) = get(port, "/");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("read token"), "{body}");
    assert!(!body.contains(&stream), "{body}");
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}
