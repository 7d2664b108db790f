//! The `/dlq` page of `--http`, rendered in a real headless Chromium:
//! list and detail views, untrusted payloads shown as text and never run,
//! replay and delete only with the admin token. Chromium is installed by
//! scripts/test.sh when missing.

use std::time::Duration;

use crate::support::browser::render;
use crate::support::*;

const EVIL_ID: &str = "<b id=\"evil\">evil</b>";
const EVIL_PAYLOAD: &str =
    "<script>document.title='PWNED'</script>\"><img src=x onerror=\"document.title='PWNED'\">";
const TOKEN: &str = "correct-horse-battery";

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

/// The dead-letter page of `stream`, as text.
fn list_page(base: &str, stream: &str) -> String {
    ureq::get(format!("{base}/dlq?stream={}", encode(stream)))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap()
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

/// Writes a dead letter of `kind` for `stream` as the worker would, dead
/// `ago` before now, with a `tenant` field.
fn letter(
    r: &mut redis::Connection,
    stream: &str,
    event_id: &str,
    kind: taskhub::DeadLetterKind,
    reason: &str,
    ago: Duration,
    tenant: &str,
) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let fields = vec![
        (b"event_id".to_vec(), event_id.as_bytes().to_vec()),
        (b"payload".to_vec(), b"{}".to_vec()),
        (b"tenant".to_vec(), tenant.as_bytes().to_vec()),
    ];
    let mut l = taskhub::DeadLetter::new(stream, "1-0", kind, reason, fields);
    l.event_id = Some(event_id.into());
    l.group = stream.into();
    l.attempts = 1;
    l.dead_at = now - ago.as_millis() as u64;
    l.first_failed_at = l.dead_at;
    put(r, &l);
}

/// Writes `letter` to its dead-letter stream as the worker would.
fn put(r: &mut redis::Connection, letter: &taskhub::DeadLetter) {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(taskhub::dlq::dead_letter_stream(&letter.stream))
        .arg("*");
    for (k, v) in letter.to_fields() {
        cmd.arg(k).arg(v);
    }
    let _: String = cmd.query(r).unwrap();
}

/// A worker on `stream` with the page and the admin token, ready; its
/// process and the page's base URL.
/// One permanent letter ("HTTP 422") per (event id, group) pair.
fn put_group_letters(r: &mut redis::Connection, stream: &str, letters: &[(&str, &str)]) {
    for (event_id, group) in letters {
        let fields = vec![
            (b"event_id".to_vec(), event_id.as_bytes().to_vec()),
            (b"payload".to_vec(), b"{}".to_vec()),
        ];
        let mut l = taskhub::DeadLetter::new(
            stream,
            "1-0",
            taskhub::DeadLetterKind::Permanent,
            "HTTP 422",
            fields,
        );
        l.event_id = Some((*event_id).into());
        l.group = (*group).into();
        l.attempts = 1;
        put(r, &l);
    }
}

fn page_worker(db: &TestDb, stream: &str) -> (Proc, String) {
    let port = free_port();
    let mut cmd = run_on(&db.url, stream);
    cmd.args(["--sql", INT_SQL, "--http", &port.to_string()])
        .env("TASKHUB_ADMIN_TOKEN", TOKEN);
    let p = Proc::spawn(cmd);
    let base = format!("http://127.0.0.1:{port}");
    assert!(
        wait_until(Duration::from_secs(20), || ureq::get(format!(
            "{base}/readyz"
        ))
        .call()
        .is_ok()),
        "{}",
        p.stderr()
    );
    (p, base)
}

/// The page filters as `taskhub dlq` does (kinds, reason, time window,
/// field), groups the reasons with counts, and replays or deletes
/// everything a filter selects: admin token, a confirmation that shows the
/// count first, never more than the count confirmed, in the background.
#[test]
fn the_page_filters_groups_and_acts_on_everything_a_filter_selects() {
    use taskhub::DeadLetterKind::{Exhausted, Invalid, Permanent};
    let db = TestDb::new();
    let stream = unique("page-bulk");
    let mut r = redis(&redis_url());
    let hour = Duration::from_secs(3600);
    for i in 0..6 {
        let reason = format!("HTTP 503 for order {i}");
        letter(
            &mut r,
            &stream,
            &format!("acme-{i}"),
            Exhausted,
            &reason,
            hour,
            "acme",
        );
    }
    for i in 0..3 {
        let reason = format!("HTTP 503 for order {}", 10 + i);
        letter(
            &mut r,
            &stream,
            &format!("old-{i}"),
            Exhausted,
            &reason,
            hour * 72,
            "acme",
        );
    }
    letter(
        &mut r,
        &stream,
        "globex-1",
        Exhausted,
        "HTTP 503 for order 99",
        hour,
        "globex",
    );
    letter(
        &mut r,
        &stream,
        "bad-1",
        Invalid,
        "missing event_id",
        hour,
        "acme",
    );
    letter(
        &mut r,
        &stream,
        "perm-1",
        Permanent,
        "postgres 22P02: bad int",
        hour,
        "acme",
    );
    let port = free_port();
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--http", &port.to_string()])
        .env("TASKHUB_ADMIN_TOKEN", TOKEN)
        // The worker must not consume what is replayed before we count it.
        .args(["--sql", "SELECT pg_sleep(3600)", "--workers", "1"]);
    let mut p = Proc::spawn(cmd);
    let base = format!("http://127.0.0.1:{port}");
    assert!(wait_until(Duration::from_secs(20), || ureq::get(format!(
        "{base}/readyz"
    ))
    .call()
    .is_ok()));

    // kind + reason + since + field, in a real browser.
    let filter = "kind=exhausted&reason=HTTP+503&since=2d&field=tenant%3Dacme";
    let dom = render(
        &format!("{base}/dlq?stream={}&{filter}", encode(&stream)),
        None,
    );
    let shown = |id: &str| dom.contains(&format!("<td>{id}</td>"));
    for i in 0..6 {
        assert!(shown(&format!("acme-{i}")), "acme-{i}: {dom}");
    }
    for other in ["old-0", "globex-1", "bad-1", "perm-1"] {
        assert!(!shown(other), "{other} shown: {dom}");
    }
    // Reasons grouped with their count, numbers masked.
    assert!(
        dom.contains("<td>6</td><td title=") && dom.contains("HTTP # for order #"),
        "{dom}"
    );
    // The filter survives in the form.
    assert!(dom.contains("value=\"tenant=acme\""), "{dom}");

    // Replay all matching: first the confirmation, with the count.
    let form = format!(
        "stream={}&{filter}&action=replay&rate=200&token={TOKEN}",
        encode(&stream)
    );
    let (status, page) = post(&format!("{base}/dlq/bulk"), &form);
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("6 dead letters match"), "{page}");
    assert_eq!(dead_letters(&mut r, &stream).len(), 12, "nothing done yet");
    // Without the token: refused. Confirmed for 4: only 4 go.
    let confirm = |token: &str| {
        confirmation_form(&page, &format!("token={token}")).replace("confirm=6", "confirm=4")
    };
    let (status, _) = post(&format!("{base}/dlq/bulk"), &confirm("nope-nope-nope"));
    assert_eq!(status, 403);
    let (status, body) = post(&format!("{base}/dlq/bulk"), &confirm(TOKEN));
    assert_eq!(status, 303, "{body}");
    let list = || list_page(&base, &stream);
    assert!(
        wait_until(Duration::from_secs(20), || list()
            .contains("Last bulk replay: replayed 4")),
        "{}",
        list()
    );
    let left: Vec<String> = dead_letters(&mut r, &stream)
        .into_iter()
        .filter_map(|l| l.event_id)
        .collect();
    assert_eq!(left.len(), 8, "{left:?}");
    assert_eq!(left.iter().filter(|id| id.starts_with("acme-")).count(), 2);
    assert_eq!(xlen(&mut r, &stream), 4, "replayed onto the stream");

    // Delete all matching the invalid kind.
    let form = format!(
        "stream={}&kind=invalid&action=delete&token={TOKEN}",
        encode(&stream)
    );
    let (status, page) = post(&format!("{base}/dlq/bulk"), &form);
    assert!(
        status == 200 && page.contains("1 dead letters match"),
        "{page}"
    );
    let (status, _) = post(
        &format!("{base}/dlq/bulk"),
        &confirmation_form(&page, &format!("token={TOKEN}")),
    );
    assert_eq!(status, 303);
    assert!(wait_until(Duration::from_secs(20), || list()
        .contains("Last bulk delete: deleted 1")));
    assert!(!dead_letters(&mut r, &stream)
        .iter()
        .any(|l| l.event_id.as_deref() == Some("bad-1")));
    p.kill();
}

/// The form of a bulk confirmation page (`id="confirm-form"`) as a POST
/// body, the way a browser would send it: its hidden fields, HTML-unescaped
/// and encoded, then `extra` (the token, say) appended as given.
fn confirmation_form(page: &str, extra: &str) -> String {
    let start = page
        .find("id=\"confirm-form\"")
        .unwrap_or_else(|| panic!("no confirmation form: {page}"));
    let end = start + page[start..].find("</form>").unwrap();
    let unescape = |s: &str| {
        s.replace("&quot;", "\"")
            .replace("&#39;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&")
    };
    let mut fields = Vec::new();
    for input in page[start..end].split("<input type=\"hidden\" ").skip(1) {
        let name = input
            .split("name=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        let value = input
            .split("value=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        fields.push(format!("{}={}", encode(name), encode(&unescape(value))));
    }
    fields.push(extra.to_owned());
    fields.join("&")
}

/// The `event_id`s of the dead letters of `stream`, sorted.
fn dead_event_ids(r: &mut redis::Connection, stream: &str) -> Vec<String> {
    let mut ids: Vec<String> = dead_letters(r, stream)
        .into_iter()
        .filter_map(|l| l.event_id)
        .collect();
    ids.sort();
    ids
}

/// A bulk action acts on the dead letters the confirmation page counted,
/// never on ones that arrived after it was shown (the hostile tester's
/// repro: 10 letters previewed, 3 newer ones arrive, "delete 10" confirmed
/// deleted the 3 new ones and kept 3 of the confirmed). When fewer are left
/// than were confirmed, it acts on those and says so. A confirmation with a
/// missing or malformed bound is refused.
#[test]
fn bulk_delete_acts_only_on_the_letters_the_confirmation_counted() {
    let db = TestDb::new();
    let stream = unique("page-bound");
    let dlq = taskhub::dlq::dead_letter_stream(&stream);
    let mut r = redis(&redis_url());
    let produce = |r: &mut redis::Connection, event_id: &str| {
        xadd(r, &stream, &[("event_id", event_id), ("payload", "x")]);
    };
    for i in 1..=10 {
        produce(&mut r, &format!("bulk-old-{i:02}"));
    }
    let port = free_port();
    let mut cmd = run_on(&db.url, &stream);
    cmd.args(["--sql", INT_SQL, "--http", &port.to_string()])
        .env("TASKHUB_ADMIN_TOKEN", TOKEN);
    let mut p = Proc::spawn(cmd);
    let base = format!("http://127.0.0.1:{port}");
    let bulk = format!("{base}/dlq/bulk");
    assert!(
        wait_until(Duration::from_secs(20), || xlen(&mut r, &dlq) == 10),
        "{}",
        p.stderr()
    );

    // The operator previews: 10 match.
    let preview = format!(
        "stream={}&action=delete&kind=permanent&token={TOKEN}",
        encode(&stream)
    );
    let (status, page) = post(&bulk, &preview);
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("10 dead letters match"), "{page}");
    let confirm = confirmation_form(&page, &format!("token={TOKEN}"));

    // Three more dead letters arrive before the operator confirms.
    for i in 1..=3 {
        produce(&mut r, &format!("bulk-new-{i}"));
    }
    assert!(
        wait_until(Duration::from_secs(20), || xlen(&mut r, &dlq) == 13),
        "{}",
        p.stderr()
    );

    // The operator confirms: exactly the 10 shown go, the 3 new ones stay.
    let (status, body) = post(&bulk, &confirm);
    assert_eq!(status, 303, "{body}");
    let list = || list_page(&base, &stream);
    assert!(
        wait_until(Duration::from_secs(20), || list()
            .contains("Last bulk delete: ")),
        "{}",
        list()
    );
    assert_eq!(
        dead_event_ids(&mut r, &stream),
        ["bulk-new-1", "bulk-new-2", "bulk-new-3"],
        "the confirmed letters go, the later ones stay: {}",
        list()
    );
    assert!(
        list().contains("Last bulk delete: deleted 10 "),
        "{}",
        list()
    );

    // Preview again: the 3 newer ones.
    let (status, page) = post(&bulk, &preview);
    assert!(
        status == 200 && page.contains("3 dead letters match"),
        "{page}"
    );
    let confirm = confirmation_form(&page, &format!("token={TOKEN}"));

    // A confirmation without the bound, or with a malformed one, is refused
    // and changes nothing (a hostile client may post anything).
    let without_bound = format!("{preview}&confirm=3");
    let (status, body) = post(&bulk, &without_bound);
    assert_eq!(status, 400, "{body}");
    for bad in [
        "abc",
        "1",
        "1-",
        "-1",
        "1-2-3",
        "+1-0",
        " 1-0",
        "1-0x",
        "99999999999999999999999-0",
        "1-99999999999999999999999",
        "18446744073709551616-0",
    ] {
        let (status, body) = post(&bulk, &format!("{without_bound}&upto={}", encode(bad)));
        assert_eq!(status, 400, "upto={bad:?}: {body}");
    }
    for bad in ["-1", "ten", "99999999999999999999999"] {
        let form = confirm.replace("confirm=3", &format!("confirm={}", encode(bad)));
        let (status, body) = post(&bulk, &form);
        assert_eq!(status, 400, "confirm={bad:?}: {body}");
    }
    assert_eq!(xlen(&mut r, &dlq), 3, "refused means unchanged");

    // Fewer left than confirmed: one of the 3 is deleted by hand and a new
    // one arrives; the confirmation deletes the 2 left, says that 1 had
    // gone, and leaves the new one alone.
    let first = dead_letters(&mut r, &stream)[0].id.clone().unwrap();
    let (status, body) = post(&format!("{base}/dlq/delete"), &form(&stream, &first, TOKEN));
    assert_eq!(status, 303, "{body}");
    produce(&mut r, "bulk-late");
    assert!(
        wait_until(Duration::from_secs(20), || dead_event_ids(&mut r, &stream)
            .contains(&"bulk-late".to_owned())),
        "{}",
        p.stderr()
    );
    let (status, body) = post(&bulk, &confirm);
    assert_eq!(status, 303, "{body}");
    assert!(
        wait_until(Duration::from_secs(20), || list()
            .contains("Last bulk delete: deleted 2 ")),
        "{}",
        list()
    );
    assert!(
        list().contains("1 of the 3 confirmed had gone already"),
        "{}",
        list()
    );
    assert_eq!(dead_event_ids(&mut r, &stream), ["bulk-late"]);
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// A relative time window (`since=5s`) is resolved when the confirmation is
/// shown: confirming later acts on what the operator saw, not on what the
/// window holds by then.
#[test]
fn bulk_relative_since_is_fixed_when_the_confirmation_is_shown() {
    let db = TestDb::new();
    let stream = unique("page-since");
    let mut r = redis(&redis_url());
    let (mut p, base) = page_worker(&db, &stream);
    // Written once the page is up, so that it is inside the window however
    // long the start took.
    letter(
        &mut r,
        &stream,
        "recent-1",
        taskhub::DeadLetterKind::Permanent,
        "postgres 22P02: bad int",
        Duration::from_secs(1),
        "acme",
    );
    let (status, page) = post(
        &format!("{base}/dlq/bulk"),
        &format!(
            "stream={}&action=delete&since=5s&token={TOKEN}",
            encode(&stream)
        ),
    );
    assert!(
        status == 200 && page.contains("1 dead letters match"),
        "{page}"
    );
    assert!(
        !page.contains("name=\"since\" value=\"5s\""),
        "the window is carried as a time, not as \"5s\" again: {page}"
    );
    let confirm = confirmation_form(&page, &format!("token={TOKEN}"));
    // By now the letter is older than 5 s: a window read again would miss it.
    std::thread::sleep(Duration::from_secs(6));
    let (status, body) = post(&format!("{base}/dlq/bulk"), &confirm);
    assert_eq!(status, 303, "{body}");
    let list = || list_page(&base, &stream);
    assert!(
        wait_until(Duration::from_secs(20), || list()
            .contains("Last bulk delete: ")),
        "{}",
        list()
    );
    assert!(
        list().contains("Last bulk delete: deleted 1 "),
        "{}",
        list()
    );
    assert!(dead_letters(&mut r, &stream).is_empty());
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// A letter that does not hold the whole event (here a `trimmed` letter
/// that kept only its event_id) is not replayed from the page either: the
/// page says so, and the letter stays. (The shared replay refused it
/// already; the page used to report "replayed 0" as a success.)
#[test]
fn the_page_does_not_replay_a_letter_that_is_not_whole() {
    let db = TestDb::new();
    let (mut p, base, stream, _) = setup(&db, Some(TOKEN));
    let mut r = redis(&redis_url());
    let fields = vec![(b"event_id".to_vec(), b"cut-1".to_vec())];
    let mut l = taskhub::DeadLetter::new(
        &stream,
        "1-0",
        taskhub::DeadLetterKind::Trimmed,
        "deleted from the stream before it was read",
        fields,
    );
    l.event_id = Some("cut-1".into());
    l.group = stream.clone();
    let mut cmd = redis::cmd("XADD");
    cmd.arg(taskhub::dlq::dead_letter_stream(&stream)).arg("*");
    for (k, v) in l.to_fields() {
        cmd.arg(k).arg(v);
    }
    let id: String = cmd.query(&mut r).unwrap();
    let (status, body) = post(&format!("{base}/dlq/replay"), &form(&stream, &id, TOKEN));
    assert_eq!(status, 303, "{body}");
    assert!(
        body.contains("replayed 0") && body.contains("not whole: 1"),
        "{body}"
    );
    let page = ureq::get(format!(
        "{base}/dlq?stream={}&msg=replay_incomplete",
        encode(&stream)
    ))
    .call()
    .unwrap()
    .body_mut()
    .read_to_string()
    .unwrap();
    assert!(page.contains("does not hold the whole event"), "{page}");
    let ids: Vec<String> = dead_letters(&mut r, &stream)
        .into_iter()
        .filter_map(|l| l.id)
        .collect();
    assert!(ids.contains(&id), "the letter stays: {ids:?}");
    assert!(p.stderr().contains("not replayed"), "{}", p.stderr());
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
}

/// Several groups reading one stream share its dead-letter stream: the page
/// counts the letters by group with a link to each, narrows to one group
/// (`group=`, kept by every link and form), and a bulk action on one group
/// leaves the other's letters alone.
#[test]
fn the_page_narrows_to_one_group_and_its_bulk_actions_keep_to_it() {
    let db = TestDb::new();
    let stream = unique("page-groups");
    let mut r = redis(&redis_url());
    put_group_letters(
        &mut r,
        &stream,
        &[
            ("bill-1", "billing"),
            ("mail-1", "emails"),
            ("bill-2", "billing"),
            ("mail-2", "emails"),
            ("bill-3", "billing"),
        ],
    );
    let (mut p, base) = page_worker(&db, &stream);

    // Every group's letters, counted by group, each a link to its own.
    let page = list_page(&base, &stream);
    let groups = &page[page.find("id=\"groups\"").expect(&page)..];
    let groups = &groups[..groups.find("</table>").unwrap()];
    assert!(
        groups.contains("<tr><td>3</td><td><a href=\"/dlq?stream=")
            && groups.contains("&amp;group=billing\">billing</a>")
            && groups.contains("<tr><td>2</td>")
            && groups.contains("&amp;group=emails\">emails</a>"),
        "{groups}"
    );

    // One group's letters only; the filter stays in the form.
    let get = |query: &str| {
        ureq::get(format!("{base}/dlq?stream={}&{query}", encode(&stream)))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    };
    // A group's link keeps the other criteria (it dropped them: the count
    // shown led to a page whose bulk actions took all of the group's).
    let narrowed = get("kind=permanent&reason=422");
    assert!(
        narrowed.contains("&amp;kind=permanent&amp;group=billing&amp;reason=422\">billing</a>"),
        "{narrowed}"
    );
    let emails = get("group=emails");
    // The letters name groups the stream does not have (here only the
    // worker's, named after the stream): said, as `dlq --group` says it,
    // rather than a list that reads as complete.
    assert!(
        emails.contains(&format!(
            "id=\"unknown-group\">{stream} has no consumer group emails"
        )),
        "{emails}"
    );
    let real = get(&format!("group={}", encode(&stream)));
    assert!(!real.contains("unknown-group"), "{real}");
    for (event_id, shown) in [("mail-1", true), ("mail-2", true), ("bill-1", false)] {
        assert_eq!(
            emails.contains(&format!("<td>{event_id}</td>")),
            shown,
            "{event_id}: {emails}"
        );
    }
    assert!(
        emails.contains("name=\"group\" size=\"10\" value=\"emails\""),
        "{emails}"
    );

    // Delete everything of group emails: the confirmation counts 2, and
    // only those go.
    let bulk = format!("{base}/dlq/bulk");
    let preview = format!(
        "stream={}&group=emails&action=delete&token={TOKEN}",
        encode(&stream)
    );
    let (status, page) = post(&bulk, &preview);
    assert!(
        status == 200 && page.contains("2 dead letters match"),
        "{page}"
    );
    assert!(page.contains("group &quot;emails&quot;"), "{page}");
    let (status, body) = post(&bulk, &confirmation_form(&page, &format!("token={TOKEN}")));
    assert_eq!(status, 303, "{body}");
    assert!(
        wait_until(Duration::from_secs(20), || list_page(&base, &stream)
            .contains("Last bulk delete: deleted 2")),
        "{}",
        list_page(&base, &stream)
    );
    assert_eq!(
        dead_event_ids(&mut r, &stream),
        ["bill-1", "bill-2", "bill-3"]
    );
    p.kill();
}

/// A letter opened from a filtered list keeps the list's criteria: its
/// link, the way back, and where a replay or delete of it leads. They
/// dropped them: after deleting one of group `emails`'s letters the page
/// showed every group's, and its bulk actions took them all.
#[test]
fn a_letter_opened_from_a_filtered_list_leads_back_to_that_list() {
    let db = TestDb::new();
    let stream = unique("page-back");
    let mut r = redis(&redis_url());
    put_group_letters(
        &mut r,
        &stream,
        &[
            ("bill-1", "billing"),
            ("mail-1", "emails"),
            ("mail-2", "emails"),
        ],
    );
    let (mut p, base) = page_worker(&db, &stream);
    let get = |path: &str| {
        ureq::get(format!("{base}{path}"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    };
    let criteria = "&amp;kind=permanent&amp;group=emails";
    let list = get(&format!(
        "/dlq?stream={}&kind=permanent&group=emails",
        encode(&stream)
    ));
    let ids: Vec<(String, String)> = dead_letters(&mut r, &stream)
        .into_iter()
        .map(|l| (l.event_id.unwrap(), l.id.unwrap()))
        .collect();
    let mail_1 = &ids.iter().find(|(e, _)| e == "mail-1").unwrap().1;
    // (Stream names of the tests and entry ids need no percent-encoding.)
    let link = format!("/dlq/show?stream={stream}&amp;id={mail_1}{criteria}");
    assert!(list.contains(&format!("href=\"{link}\"")), "{list}");

    // The letter's page leads back to the filtered list, and its forms
    // carry the criteria.
    let detail = get(&link.replace("&amp;", "&"));
    assert!(
        detail.contains(&format!("href=\"/dlq?stream={stream}{criteria}\"")),
        "{detail}"
    );
    let hidden = "<input type=\"hidden\" name=\"kind\" value=\"permanent\"><input type=\"hidden\" name=\"group\" value=\"emails\">";
    assert_eq!(detail.matches(hidden).count(), 2, "{detail}");

    // Deleting it leads back to the list of the same criteria.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into();
    let deleted = agent
        .post(format!("{base}/dlq/delete"))
        .content_type("application/x-www-form-urlencoded")
        .send(
            format!(
                "{}&kind=permanent&group=emails",
                form(&stream, mail_1, TOKEN)
            )
            .as_bytes(),
        )
        .unwrap();
    assert_eq!(deleted.status().as_u16(), 303);
    let location = deleted.headers()["location"].to_str().unwrap().to_owned();
    assert_eq!(
        location,
        format!("/dlq?stream={stream}&kind=permanent&group=emails&msg=deleted")
    );
    let back = get(&location);
    assert!(
        back.contains("<td>mail-2</td>") && !back.contains("<td>bill-1</td>"),
        "{back}"
    );

    // A bad criterion is refused before anything is done.
    let mail_2 = &ids.iter().find(|(e, _)| e == "mail-2").unwrap().1;
    let (status, body) = post(
        &format!("{base}/dlq/delete"),
        &format!("{}&since=yesterday-ish", form(&stream, mail_2, TOKEN)),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(dead_letters(&mut r, &stream).len(), 2);
    p.kill();
}
