//! The `/dlq` page of `--http`, rendered in a real headless Chromium:
//! list and detail views, untrusted payloads shown as text and never run,
//! replay and delete only with the admin token. Chromium is installed by
//! scripts/test.sh when missing.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::*;

const EVIL_ID: &str = "<b id=\"evil\">evil</b>";
const EVIL_PAYLOAD: &str =
    "<script>document.title='PWNED'</script>\"><img src=x onerror=\"document.title='PWNED'\">";
const TOKEN: &str = "correct-horse-battery";

/// The DOM after Chromium loaded `url` (scripts, if any, have run).
fn render(url: &str, screenshot: Option<&Path>) -> String {
    let profile = TempDir::new("chromium");
    let mut cmd = Command::new("chromium");
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,900",
    ])
    .arg(format!("--user-data-dir={}", profile.0.display()));
    match screenshot {
        Some(path) => cmd.arg(format!("--screenshot={}", path.display())),
        None => cmd.arg("--dump-dom"),
    };
    let out = cmd
        .arg(url)
        .output()
        .expect("chromium is installed (scripts/test.sh installs Debian's chromium)");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn post(url: &str, form: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let mut r = agent
        .post(url)
        .content_type("application/x-www-form-urlencoded")
        .send(form.as_bytes())
        .unwrap();
    (
        r.status().as_u16(),
        r.body_mut().read_to_string().unwrap_or_default(),
    )
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The body of a replay or delete POST for dead letter `id`.
fn form(stream: &str, id: &str, token: &str) -> String {
    format!(
        "stream={}&id={}&token={}",
        encode(stream),
        encode(id),
        encode(token)
    )
}

/// Starts a worker with the page, makes one dead letter with a hostile
/// payload and event_id, returns (process, base url, stream, dead-letter id).
fn setup(db: &TestDb, token: Option<&str>) -> (Proc, String, String, String) {
    let stream = unique("page");
    let mut r = redis(&redis_url());
    xadd(
        &mut r,
        &stream,
        &[
            ("event_id", EVIL_ID),
            ("payload", EVIL_PAYLOAD),
            ("note", "x"),
        ],
    );
    let port = free_port();
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", INT_SQL, "--http", &port.to_string()]);
    if let Some(t) = token {
        cmd.env("TASKHUB_ADMIN_TOKEN", t);
    }
    let p = Proc::spawn(cmd);
    let dlq = taskhub::dlq::dead_letter_stream(&stream);
    assert!(
        wait_until(Duration::from_secs(20), || xlen(&mut r, &dlq) == 1),
        "{}",
        p.stderr()
    );
    let id = dead_letters(&mut r, &stream)[0].id.clone().unwrap();
    (p, format!("http://127.0.0.1:{port}"), stream, id)
}

#[test]
fn list_and_detail_render_hostile_payloads_as_text() {
    let db = TestDb::new();
    let (mut p, base, stream, id) = setup(&db, Some(TOKEN));

    let list = render(&format!("{base}/dlq?stream={}", encode(&stream)), None);
    assert!(
        list.contains("<title>taskhub dead letters</title>"),
        "{list}"
    );
    assert!(list.contains("Dead letters of"), "{list}");
    assert!(
        list.contains("&lt;b id=\"evil\"&gt;evil&lt;/b&gt;"),
        "event_id shown as text: {list}"
    );
    assert!(
        !list.contains("<b id=\"evil\">"),
        "event_id became markup: {list}"
    );
    assert!(list.contains(&id), "{list}");
    assert!(list.contains("permanent"), "{list}");

    let detail_url = format!(
        "{base}/dlq/show?stream={}&id={}",
        encode(&stream),
        encode(&id)
    );
    let detail = render(&detail_url, None);
    assert!(
        detail.contains("<title>taskhub dead letter</title>"),
        "a script changed the title: {detail}"
    );
    assert!(
        detail.contains("&lt;script&gt;document.title='PWNED'&lt;/script&gt;"),
        "{detail}"
    );
    assert!(!detail.contains("<script"), "{detail}");
    assert!(!detail.contains("<img"), "{detail}");
    assert!(detail.contains("22P02"), "the reason is shown: {detail}");
    assert!(detail.contains("id=\"history\""), "{detail}");
    assert!(
        detail.contains("replay-form"),
        "buttons with a token configured: {detail}"
    );

    // A screenshot for people, kept out of git (artifacts/ is ignored).
    let shot = repo_path("artifacts/dlq-detail.png");
    std::fs::create_dir_all(shot.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&shot);
    render(&detail_url, Some(&shot));
    assert!(std::fs::metadata(&shot)
        .map(|m| m.len() > 1000)
        .unwrap_or(false));

    // Replay needs the token: without it or with a wrong one, refused.
    let form = |token: &str| form(&stream, &id, token);
    assert_eq!(post(&format!("{base}/dlq/replay"), &form("")).0, 403);
    assert_eq!(
        post(&format!("{base}/dlq/replay"), &form("wrong-token-123")).0,
        403
    );
    let mut r = redis(&redis_url());
    assert_eq!(
        xlen(&mut r, &taskhub::dlq::dead_letter_stream(&stream)),
        1,
        "refused means unchanged"
    );
    // A GET never changes anything.
    let agent = ureq::agent();
    let _ = agent
        .get(format!(
            "{base}/dlq/replay?stream={}&id={}&token={TOKEN}",
            encode(&stream),
            encode(&id)
        ))
        .call();
    // Every page forbids scripts, whatever it shows.
    let page = agent
        .get(format!("{base}/dlq?stream={}", encode(&stream)))
        .call()
        .unwrap();
    let csp = page
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(csp.contains("default-src 'none'"), "CSP: {csp:?}");
    assert_eq!(xlen(&mut r, &taskhub::dlq::dead_letter_stream(&stream)), 1);
    // With the token: back to its stream (where it fails again, being the
    // same bad payload, and comes back as a new dead letter).
    let (status, body) = post(&format!("{base}/dlq/replay"), &form(TOKEN));
    assert_eq!(status, 303, "{body}");
    assert!(body.contains("replayed 1"), "{body}");
    assert!(wait_until(Duration::from_secs(20), || {
        let letters = dead_letters(&mut r, &stream);
        letters.len() == 1 && letters[0].id.as_deref() != Some(id.as_str())
    }));
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// The kind and reason filters narrow the list; with the token a dead letter
/// can be deleted (without it, refused).
#[test]
fn filters_narrow_the_list_and_delete_needs_the_token() {
    let db = TestDb::new();
    let (mut p, base, stream, id) = setup(&db, Some(TOKEN));
    let mut r = redis(&redis_url());
    // A second dead letter, of another kind and reason: no event_id.
    xadd(&mut r, &stream, &[("payload", "1")]);
    assert!(wait_until(Duration::from_secs(20), || dead_letters(
        &mut r, &stream
    )
    .len()
        == 2));
    let other = dead_letters(&mut r, &stream)
        .into_iter()
        .find(|l| l.id.as_deref() != Some(id.as_str()))
        .and_then(|l| l.id)
        .unwrap();
    let list = |filter: &str| {
        let agent = ureq::agent();
        agent
            .get(format!("{base}/dlq?stream={}&{filter}", encode(&stream)))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    };
    let invalid = list("kind=invalid");
    assert!(
        invalid.contains(&other) && !invalid.contains(&id),
        "{invalid}"
    );
    let by_reason = list("reason=22P02");
    assert!(
        by_reason.contains(&id) && !by_reason.contains(&other),
        "{by_reason}"
    );

    let form = |token: &str| form(&stream, &id, token);
    assert_eq!(
        post(&format!("{base}/dlq/delete"), &form("wrong-token-123")).0,
        403
    );
    assert_eq!(dead_letters(&mut r, &stream).len(), 2);
    let (status, body) = post(&format!("{base}/dlq/delete"), &form(TOKEN));
    assert_eq!(status, 303, "{body}");
    let left: Vec<Option<String>> = dead_letters(&mut r, &stream)
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(left, [Some(other)]);
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

#[test]
fn without_a_token_the_page_is_read_only() {
    let db = TestDb::new();
    let (mut p, base, stream, id) = setup(&db, None);
    let detail = render(
        &format!(
            "{base}/dlq/show?stream={}&id={}",
            encode(&stream),
            encode(&id)
        ),
        None,
    );
    assert!(detail.contains("Dead letter"), "{detail}");
    assert!(
        !detail.contains("replay-form") && !detail.contains("delete-form"),
        "{detail}"
    );
    let form = format!(
        "stream={}&id={}&token=anything-at-all",
        encode(&stream),
        encode(&id)
    );
    assert_eq!(post(&format!("{base}/dlq/replay"), &form).0, 403);
    assert_eq!(post(&format!("{base}/dlq/delete"), &form).0, 403);
    let mut r = redis(&redis_url());
    assert_eq!(xlen(&mut r, &taskhub::dlq::dead_letter_stream(&stream)), 1);
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}
