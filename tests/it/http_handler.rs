//! `taskhub run --http-url`: events are POSTed to a downstream (here a local
//! server run by the test, `support::downstream`) and its answers decide what
//! happens.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::downstream::Answer;
use crate::support::*;

/// What the downstream saw: (time, Idempotency-Key, body, fields header).
type Seen = Arc<Mutex<Vec<(Instant, String, Vec<u8>, String)>>>;

/// A downstream that answers each request with the next status from
/// `script(event_id, n)` (n = how many requests that event_id has made);
/// status 0 answers 200 after 4 s.
fn downstream(script: fn(&str, usize) -> (u16, Option<&'static str>)) -> (String, Seen) {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let addr = crate::support::downstream::start(move |request| {
        let key = request.header("Idempotency-Key");
        let fields = request.header("X-Taskhub-Fields");
        let n = {
            let mut seen = log.lock().unwrap();
            seen.push((Instant::now(), key.clone(), request.body, fields));
            seen.iter().filter(|s| s.1 == key).count()
        };
        let (status, retry_after) = script(&key, n);
        if status == 0 {
            // "Hang": answer only after the client's timeout (on this
            // request's own thread, so the next requests are not held up).
            return Answer {
                delay: Duration::from_millis(4000),
                ..Answer::status(200)
            };
        }
        let mut answer = Answer::status(status);
        if let Some(v) = retry_after {
            answer.headers.push(("Retry-After", v.to_owned()));
        }
        answer
    });
    (format!("http://{addr}/hook"), seen)
}

/// Runs the binary on `stream` with a group named after it, so the Redis
/// markers (keyed by group and event_id) of one run never meet another's.
fn run_http(url: &str, stream: &str, db: &TestDb, extra: &[&str]) -> Proc {
    let mut cmd = taskhub(&redis_url(), &db.url);
    cmd.args([
        "run",
        "--stream",
        stream,
        "--group",
        stream,
        "--until-idle",
        "--block-ms",
        "100",
    ])
    .args([
        "--http-url",
        url,
        "--backoff-base",
        "20ms",
        "--backoff-cap",
        "200ms",
    ])
    .args(extra);
    Proc::spawn(cmd)
}

#[test]
fn success_retry_after_and_permanent_statuses() {
    let (url, seen) = downstream(|key, n| match key {
        k if k.starts_with("ok") => (200, None),
        k if k.starts_with("slow") && n == 1 => (503, Some("1")),
        k if k.starts_with("slow") => (204, None),
        k if k.starts_with("r408") && n == 1 => (408, None),
        k if k.starts_with("r429") && n == 1 => (429, None),
        k if k.starts_with("r4") => (200, None),
        _ => (422, None),
    });
    let db = TestDb::new();
    let stream = unique("http");
    let mut r = redis(&redis_url());
    xadd(
        &mut r,
        &stream,
        &[("event_id", "ok-1"), ("payload", "héllo"), ("tenant", "ü")],
    );
    xadd(&mut r, &stream, &[("event_id", "slow-1"), ("payload", "p")]);
    xadd(&mut r, &stream, &[("event_id", "bad-1"), ("payload", "p")]);
    xadd(&mut r, &stream, &[("event_id", "r408-1"), ("payload", "p")]);
    xadd(&mut r, &stream, &[("event_id", "r429-1"), ("payload", "p")]);
    let mut p = run_http(&url, &stream, &db, &[]);
    assert!(p.wait(Duration::from_secs(30)).success(), "{}", p.stderr());

    let seen = seen.lock().unwrap();
    let calls = |key: &str| seen.iter().filter(|s| s.1 == key).collect::<Vec<_>>();
    // 2xx: one call, body = payload, other fields in the header.
    let ok = calls("ok-1");
    assert_eq!(ok.len(), 1);
    assert_eq!(ok[0].2, "héllo".as_bytes());
    assert_eq!(ok[0].3, r#"{"event_id":"ok-1","tenant":"\u00fc"}"#);
    // 503 + Retry-After: 1 → the retry comes at least 1 s later.
    let slow = calls("slow-1");
    assert_eq!(slow.len(), 2);
    let gap = slow[1].0 - slow[0].0;
    assert!(
        gap >= Duration::from_secs(1),
        "Retry-After ignored: gap {gap:?}"
    );
    // 408 and 429: retryable, so tried again and applied.
    assert_eq!(calls("r408-1").len(), 2);
    assert_eq!(calls("r429-1").len(), 2);
    // 422: permanent, not retried.
    assert_eq!(calls("bad-1").len(), 1);
    let dead = dead_letters(&mut r, &stream);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event_id.as_deref(), Some("bad-1"));
    assert_eq!(dead[0].kind, taskhub::DeadLetterKind::Permanent);
    assert!(dead[0].reason.contains("HTTP 422"), "{}", dead[0].reason);
    // Successes are recorded in processed_events.
    assert_eq!(db.count("SELECT count(*) FROM processed_events"), 4);
    assert_eq!(pending(&mut r, &stream, &stream), 0);
}

#[test]
fn a_downstream_timeout_is_retried() {
    let (url, seen) = downstream(|_, n| if n == 1 { (0, None) } else { (204, None) });
    let db = TestDb::new();
    let stream = unique("http-slow");
    let mut r = redis(&redis_url());
    xadd(&mut r, &stream, &[("event_id", "t1"), ("payload", "p")]);
    let mut p = run_http(&url, &stream, &db, &["--http-timeout", "1s"]);
    assert!(p.wait(Duration::from_secs(30)).success(), "{}", p.stderr());
    assert_eq!(seen.lock().unwrap().len(), 2, "timed out, then tried again");
    assert!(dead_letters(&mut r, &stream).is_empty());
    assert_eq!(db.count("SELECT count(*) FROM processed_events"), 1);
    assert_eq!(pending(&mut r, &stream, &stream), 0);
}

/// A downstream that cannot be reached (connection refused, a name that
/// does not resolve) is an outage, as a database that is down: the worker
/// pauses and tries again, counting no attempt, so even one allowed attempt
/// dead-letters nothing; once the downstream listens, everything is applied.
#[test]
fn an_unreachable_downstream_is_an_outage_not_a_failure() {
    let db = TestDb::new();
    let stream = unique("http-down");
    let mut r = redis(&redis_url());
    for i in 0..5 {
        xadd(
            &mut r,
            &stream,
            &[("event_id", &format!("e{i}")), ("payload", "p")],
        );
    }
    let addr = format!("127.0.0.1:{}", free_port());
    let url = format!("http://{addr}/hook");
    let mut p = run_http(&url, &stream, &db, &["--max-attempts", "1"]);
    assert!(
        p.wait_for("Downstream: unavailable", Duration::from_secs(20)),
        "{}",
        p.stderr()
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    crate::support::downstream::start_at(&addr, move |request| {
        s.lock().unwrap().push(request.header("Idempotency-Key"));
        Answer::status(200)
    });
    assert!(p.wait(Duration::from_secs(60)).success(), "{}", p.stderr());
    assert!(
        p.stderr().contains("Downstream: reachable again"),
        "{}",
        p.stderr()
    );
    assert!(dead_letters(&mut r, &stream).is_empty(), "{}", p.stderr());
    assert_eq!(db.count("SELECT count(*) FROM processed_events"), 5);
    assert_eq!(seen.lock().unwrap().len(), 5);
    assert_eq!(pending(&mut r, &stream, &stream), 0);

    // A name that does not resolve: the same pause, nothing failed.
    let stream = unique("http-dns");
    xadd(&mut r, &stream, &[("event_id", "d1"), ("payload", "p")]);
    let mut p = run_http(
        "http://no-such-host.invalid/hook",
        &stream,
        &db,
        &["--max-attempts", "1"],
    );
    assert!(
        p.wait_for("Downstream: unavailable", Duration::from_secs(20)),
        "{}",
        p.stderr()
    );
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
    assert!(dead_letters(&mut r, &stream).is_empty());
    assert_eq!(
        pending(&mut r, &stream, &stream),
        1,
        "left for the next start"
    );
}

/// Failures that are the downstream's answer follow the HTTP retry budget:
/// eight attempts by default before the event is dead-lettered.
#[test]
fn a_failing_downstream_gets_the_http_retry_budget() {
    let (url, seen) = downstream(|_, _| (503, None));
    let db = TestDb::new();
    let stream = unique("http-budget");
    let mut r = redis(&redis_url());
    xadd(&mut r, &stream, &[("event_id", "b1"), ("payload", "p")]);
    let mut p = run_http(&url, &stream, &db, &[]);
    assert!(p.wait(Duration::from_secs(60)).success(), "{}", p.stderr());
    assert_eq!(seen.lock().unwrap().len(), 8);
    let dead = dead_letters(&mut r, &stream);
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].kind, taskhub::DeadLetterKind::Exhausted);
    assert_eq!(dead[0].attempts, 8);
    assert!(dead[0].reason.contains("HTTP 503"), "{}", dead[0].reason);
}

/// Regression (a hostile tester): `--http-header` took headers taskhub or
/// its HTTP client set themselves: `Content-Length: 5` went out beside the
/// client's own framing (with `Transfer-Encoding: chunked`, the
/// request-smuggling shape), `Idempotency-Key: x` and `Host` were sent
/// twice. They are refused at start-up, in any case, naming the header;
/// headers that replace the client's defaults (User-Agent, Accept) and
/// authentication headers still go out.
#[test]
fn reserved_http_headers_are_refused_at_start_up() {
    // Authorization, User-Agent and every Content-Type of each request.
    type Seen = Vec<(String, String, Vec<String>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let log = seen.clone();
    let addr = crate::support::downstream::start(move |request| {
        log.lock().unwrap().push((
            request.header("Authorization"),
            request.header("User-Agent"),
            request.headers_named("Content-Type"),
        ));
        Answer::status(200)
    });
    let url = format!("http://{addr}/hook");
    let db = TestDb::new();
    let mut r = redis(&redis_url());
    for header in [
        "Content-Length: 5",
        "transfer-encoding: chunked",
        "HOST: evil.example",
        "Connection: close",
        "Idempotency-Key: x",
        "X-Taskhub-Fields: {}",
        "x-taskhub-stream: s",
        "X-Taskhub-Entry-Id: 1-0",
        "Upgrade: websocket",
        "TE: trailers",
        "Trailer: X-Sig",
        "Expect: 100-continue",
    ] {
        let stream = unique("http-hdr");
        xadd(&mut r, &stream, &[("event_id", "h1"), ("payload", "p")]);
        let mut p = run_http(&url, &stream, &db, &["--http-header", header]);
        let status = p.wait(Duration::from_secs(30));
        assert_eq!(status.code(), Some(1), "{header}: {}", p.stderr());
        let name = header.split(':').next().unwrap();
        let stderr = p.stderr();
        let line = stderr
            .lines()
            .find(|l| l.starts_with("taskhub: error:"))
            .unwrap_or_else(|| panic!("{header}: no error line:\n{stderr}"));
        assert!(line.contains("--http-header"), "{header}: {line}");
        assert!(line.contains(name), "{header}: {line}");
    }
    assert!(seen.lock().unwrap().is_empty(), "nothing was sent");

    // Allowed: authentication, and the client's overridable defaults.
    let stream = unique("http-hdr-ok");
    xadd(&mut r, &stream, &[("event_id", "ok1"), ("payload", "p")]);
    let mut p = run_http(
        &url,
        &stream,
        &db,
        &[
            "--http-header",
            "Authorization: Bearer abc",
            "--http-header",
            "User-Agent: mine/1",
            "--http-header",
            "Accept: application/json",
            "--http-header",
            "Content-Type: application/json",
        ],
    );
    assert!(p.wait(Duration::from_secs(30)).success(), "{}", p.stderr());
    // A Content-Type given replaces taskhub's own (both went out before).
    assert_eq!(
        *seen.lock().unwrap(),
        [(
            "Bearer abc".to_owned(),
            "mine/1".to_owned(),
            vec!["application/json".to_owned()]
        )]
    );
}

/// A `--http-header` line without a colon is refused by its number, and
/// nothing of it is shown: it was echoed (its first word), which in the
/// usual mistakes is the secret (a token wrapped onto a line of its own,
/// `X-Api-Key=value`; found by a hostile test).
#[test]
fn a_malformed_http_header_line_is_not_shown() {
    let db = TestDb::new();
    let dir = TempDir::new("hdr");
    for (lines, file) in [
        ("Authorization: Bearer abc\neyJSECRET1", false),
        ("X-Api-Key: abc\n  continued-SECRET2", true),
        ("X-Api-Key=SECRET3-equals-form", true),
    ] {
        let stream = unique("http-hdr-bad");
        let mut cmd = taskhub(&redis_url(), &db.url);
        cmd.args([
            "run",
            "--stream",
            &stream,
            "--http-url",
            "http://127.0.0.1:9/x",
        ]);
        if file {
            let path = dir.0.join("headers");
            std::fs::write(&path, lines).unwrap();
            cmd.arg("--http-header-file").arg(&path);
        } else {
            cmd.args(["--http-header", lines]);
        }
        let out = output(cmd, None, Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(1), "{lines:?}: {}", out.stderr);
        assert!(
            out.stderr.contains("has no ':'"),
            "{lines:?}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains("SECRET"), "{lines:?}: {}", out.stderr);
    }
}
