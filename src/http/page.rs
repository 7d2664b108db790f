//! The dead-letter web page of `--http`: a list with filters and pages, a
//! detail view, and, only when an admin token is configured, replay and
//! delete buttons (POST with the token; a GET never changes anything). Who
//! may see and change it is `http_access.rs`'s business.
//!
//! Payloads are untrusted input: every byte that reaches the page goes
//! through [`escape`], and a strict Content-Security-Policy forbids scripts
//! altogether, so even a missed escape could not run anything. The URL
//! never puts words on the page: the message box after an action shows one
//! of a fixed set of texts, chosen by a code (see [`message`]).

use std::fmt::Write as _;

use crate::dlq::{self, Filter, ReasonMatch, ReplayOptions, Selection};
use crate::dlq::{DeadLetter, Kind};
use crate::http::access::{cross_site, Access, Denied};
use crate::http::server::text;
use crate::http::wire::{Request, Response};
use crate::net::percent_encode as encode;
use crate::worker::monitor::Monitor;

const PAGE_SIZE: usize = 50;
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// Largest form a POST may carry (login, replay, delete).
const MAX_FORM: usize = 64 * 1024;

/// HTML-escapes text for element content and quoted attributes.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// Decodes `application/x-www-form-urlencoded` text.
fn decode(text: &str) -> String {
    // `+` first: an encoded `%2B` must stay a plus sign.
    crate::net::percent_decode(&text.replace('+', " "))
}

fn params(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
    params
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

fn html(status: u16, title: &str, body: &str) -> Response {
    let page = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{}</title><style>\
         body{{font-family:sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;width:100%}}\
         td,th{{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top;font-size:14px}}\
         th{{background:#f4f4f4}}pre{{background:#f7f7f7;padding:8px;white-space:pre-wrap;word-break:break-all}}\
         .kind{{font-family:monospace}}.msg{{padding:6px;background:#eef}}form.inline{{display:inline}}\
         </style></head><body>{body}</body></html>",
        escape(title)
    );
    text(status, "text/html; charset=utf-8", page).with_header("Content-Security-Policy", CSP)
}

fn time(ms: u64) -> String {
    crate::dlq::format_time(ms, false)
}

fn field_text(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => text.to_owned(),
        Err(_) => {
            let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
            format!("0x{hex} (binary)")
        }
    }
}

/// The page's routes and who may use them.
pub(crate) struct Page {
    access: Access,
}

impl Page {
    pub fn new(loopback: bool, admin: Option<String>, read: Option<String>) -> Page {
        Page {
            access: Access::new(loopback, admin, read),
        }
    }

    /// The largest body a POST to `path` may carry: a form for the page's
    /// forms, nothing elsewhere.
    pub fn form_limit(&self, path: &str) -> usize {
        match path {
            "/dlq/login" | "/dlq/replay" | "/dlq/delete" => MAX_FORM,
            _ => 0,
        }
    }

    /// Serves `/dlq...`; `None` when the path is not the page's.
    pub fn route(&self, monitor: &Monitor, request: &Request) -> Option<Response> {
        let path = request.path();
        if path != "/dlq" && !path.starts_with("/dlq/") {
            return None;
        }
        let response = match (request.method(), path) {
            ("GET" | "HEAD", "/dlq" | "/dlq/show") => {
                match self.access.may_read(request, &monitor.shutdown_handle()) {
                    Err(denied) => login_page(denied),
                    Ok(()) if path == "/dlq" => list_page(monitor, &params(request.query())),
                    Ok(()) => show_page(monitor, &self.access, &params(request.query())),
                }
            }
            ("POST", "/dlq/login" | "/dlq/replay" | "/dlq/delete") => {
                if cross_site(request) {
                    log::warn!("http: {path} refused: sent from another site");
                    return Some(html(
                        403,
                        "Refused",
                        "<p>refused: this form was sent from another site</p>",
                    ));
                }
                let Ok(body) = std::str::from_utf8(request.body()) else {
                    return Some(html(400, "Bad request", "<p>unreadable form</p>"));
                };
                let form = params(body);
                if path == "/dlq/login" {
                    self.login(monitor, &form)
                } else {
                    self.action(monitor, path, &form)
                }
            }
            _ => html(405, "Not allowed", "<p>method not allowed</p>"),
        };
        Some(response)
    }

    fn login(&self, monitor: &Monitor, form: &[(String, String)]) -> Response {
        match self
            .access
            .login(param(form, "token"), &monitor.shutdown_handle())
        {
            Ok(cookie) => text(303, "text/plain", "logged in\n".into())
                .with_header("Location", "/dlq")
                .with_header("Set-Cookie", cookie),
            Err(denied) => login_page(denied),
        }
    }

    fn action(&self, monitor: &Monitor, path: &str, form: &[(String, String)]) -> Response {
        match self
            .access
            .may_change(param(form, "token"), &monitor.shutdown_handle())
        {
            Ok(()) => {}
            Err(Denied::NotConfigured) => {
                return html(
                    403,
                    "Refused",
                    "<p>refused: no admin token is configured, the page is read-only</p>",
                )
            }
            Err(_) => {
                log::warn!("http: {path} refused: wrong or missing admin token");
                return html(
                    403,
                    "Refused",
                    "<p>refused: wrong or missing admin token</p>",
                );
            }
        }
        let stream = match stream_param(monitor, form) {
            Ok(s) => s.to_owned(),
            Err(r) => return r,
        };
        let Some(id) = param(form, "id") else {
            return html(400, "Bad request", "<p>missing id</p>");
        };
        if !crate::dlq::filter::valid_id(id) {
            return not_found(&stream, id);
        }
        let mut conn = match redis(monitor) {
            Ok(c) => c,
            Err(r) => return r,
        };
        let selection = Selection::Ids(vec![id.to_owned()]);
        let (code, message) = if path == "/dlq/replay" {
            let mut pg = monitor.pg_conn().ok();
            let report = dlq::replay(
                &mut conn,
                pg.as_deref_mut().map(|c| &mut **c),
                &stream,
                &selection,
                &ReplayOptions::default(),
                &mut |_, _| {},
            );
            match report {
                Ok(r) if !r.not_found.is_empty() => return not_found(&stream, id),
                Ok(r) => {
                    let message = format!(
                        "replayed {} (already processed: {}, failed: {})",
                        r.replayed(),
                        r.already_processed(),
                        r.failed()
                    );
                    let code = if r.failed() > 0 {
                        for item in &r.items {
                            if let Some(e) = &item.error {
                                log::warn!("http: replay of {stream}/{}: {e}", item.id);
                            }
                        }
                        "replay_failed".to_owned()
                    } else {
                        format!(
                            "replayed&n={}&skipped={}",
                            r.replayed(),
                            r.already_processed()
                        )
                    };
                    (code, message)
                }
                Err(e) => ("replay_failed".to_owned(), format!("replay failed: {e}")),
            }
        } else {
            match dlq::purge(&mut conn, &stream, &selection, false) {
                Ok(r) if r.removed == 0 => return not_found(&stream, id),
                Ok(_) => ("deleted".to_owned(), format!("deleted {id}")),
                Err(e) => ("delete_failed".to_owned(), format!("delete failed: {e}")),
            }
        };
        log::info!("http: {path} {stream}/{id}: {message}");
        let location = format!("/dlq?stream={}&msg={code}", encode(&stream));
        text(303, "text/plain", message + "\n").with_header("Location", location)
    }
}

/// The answer to a replay or delete of an id the dead-letter stream does
/// not hold.
fn not_found(stream: &str, id: &str) -> Response {
    html(
        404,
        "Not found",
        &format!(
            "<p class=\"msg\" id=\"msg\">not found: no dead letter {} in {} (replayed, deleted or archived already?)</p>\
             <p><a href=\"/dlq?stream={}\">&larr; all dead letters</a></p>",
            escape(id),
            escape(&crate::dlq::dead_letter_stream(stream)),
            encode(stream)
        ),
    )
}

/// What a reader without a good token sees (status 403).
fn login_page(denied: Denied) -> Response {
    let why = match denied {
        Denied::NotConfigured => {
            return html(
                403,
                "Read token needed",
                "<h1>Read token needed</h1><p>No read token is configured. Dead letters carry \
                 payloads, so on an address other than loopback this page needs one: start \
                 taskhub with <code>--read-token TOKEN</code> (or the environment variable \
                 <code>TASKHUB_READ_TOKEN</code>; the admin token works too), then log in here \
                 or send <code>Authorization: Bearer TOKEN</code>.</p>",
            )
        }
        Denied::Missing => "A read token is needed to see the dead letters.",
        Denied::Wrong => "Wrong token.",
    };
    html(
        403,
        "Log in",
        &format!(
            "<h1>taskhub dead letters</h1><p class=\"msg\" id=\"msg\">{why}</p>\
             <form method=\"post\" action=\"/dlq/login\" id=\"login-form\">Token \
             <input type=\"password\" name=\"token\" autocomplete=\"off\"> \
             <button type=\"submit\">Log in</button></form>"
        ),
    )
}

/// The message box's text for the code an action put in the URL
/// (`/dlq?msg=replayed&n=3&skipped=1`). Only these texts can appear: the
/// URL picks one and gives numbers, never words, so a link cannot put an
/// attacker's sentence in the page's own box. Unknown codes show nothing.
fn message(query: &[(String, String)]) -> Option<String> {
    let number = |name: &str| {
        param(query, name)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Some(match param(query, "msg")? {
        "replayed" => format!(
            "Replayed {} dead letter(s) to the stream ({} already processed: the worker will skip them).",
            number("n"),
            number("skipped")
        ),
        "replay_failed" => "The replay failed; the worker's log says why.".to_owned(),
        "deleted" => "Deleted the dead letter.".to_owned(),
        "delete_failed" => "The delete failed; the worker's log says why.".to_owned(),
        _ => return None,
    })
}

fn stream_param<'a>(
    monitor: &'a Monitor,
    query: &'a [(String, String)],
) -> Result<&'a str, Response> {
    let stream = param(query, "stream").unwrap_or(&monitor.streams()[0]);
    if monitor.streams().iter().any(|s| s == stream) {
        Ok(stream)
    } else {
        Err(html(404, "Unknown stream", "<p>unknown stream</p>"))
    }
}

fn redis(
    monitor: &Monitor,
) -> Result<r2d2::PooledConnection<crate::redis::pool::RedisManager>, Response> {
    monitor.redis_conn().map_err(|e| {
        html(
            503,
            "Redis unavailable",
            &format!("<p>Redis: {}</p>", escape(&e.to_string())),
        )
    })
}

fn list_page(monitor: &Monitor, query: &[(String, String)]) -> Response {
    let stream = match stream_param(monitor, query) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let kind = param(query, "kind").and_then(Kind::parse);
    let reason = param(query, "reason");
    let filter = Filter {
        kinds: kind.into_iter().collect(),
        reason: reason.map(ReasonMatch::substring),
        limit: Some(PAGE_SIZE),
        before: param(query, "before").map(str::to_owned),
        ..Filter::default()
    };
    let mut conn = match redis(monitor) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let listing = match dlq::list(&mut conn, stream, &filter) {
        Ok(l) => l,
        Err(e) => return html(400, "Error", &format!("<p>{}</p>", escape(&e.to_string()))),
    };
    let letters = &listing.letters;
    let dlq_name = crate::dlq::dead_letter_stream(stream);
    let total: u64 = redis::cmd("XLEN")
        .arg(&dlq_name)
        .query(&mut *conn)
        .unwrap_or(0);
    let mut body = format!("<h1>Dead letters of {}</h1>", escape(stream));
    if let Some(msg) = message(query) {
        let _ = write!(body, "<p class=\"msg\" id=\"msg\">{}</p>", escape(&msg));
    }
    let _ = write!(
        body,
        "<p>{total} in <code>{}</code>, newest first.</p>",
        escape(&dlq_name)
    );
    body.push_str("<form method=\"get\" action=\"/dlq\">");
    if monitor.streams().len() > 1 {
        body.push_str("Stream <select name=\"stream\">");
        for s in monitor.streams() {
            let selected = if s == stream { " selected" } else { "" };
            let _ = write!(body, "<option{selected}>{}</option>", escape(s));
        }
        body.push_str("</select> ");
    } else {
        let _ = write!(
            body,
            "<input type=\"hidden\" name=\"stream\" value=\"{}\">",
            escape(stream)
        );
    }
    body.push_str("Kind <select name=\"kind\"><option value=\"\">any</option>");
    for k in Kind::ALL {
        let selected = if Some(k) == kind { " selected" } else { "" };
        let _ = write!(body, "<option{selected}>{k}</option>");
    }
    let _ = write!(
        body,
        "</select> Reason contains <input name=\"reason\" value=\"{}\"> <button type=\"submit\">Filter</button></form>",
        escape(reason.unwrap_or(""))
    );
    body.push_str(
        "<table id=\"letters\"><tr><th>dead at</th><th>kind</th><th>event_id</th><th>attempts</th><th>reason</th><th>entry</th></tr>",
    );
    for l in letters {
        let id = l.id.as_deref().unwrap_or("");
        let _ = write!(
            body,
            "<tr><td>{}</td><td class=\"kind\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td><a href=\"/dlq/show?stream={}&amp;id={}\">{}</a></td></tr>",
            time(l.dead_at),
            l.kind,
            escape(l.event_id.as_deref().unwrap_or("")),
            l.attempts,
            escape(&dlq::one_line(&l.reason, 200)),
            encode(stream),
            encode(id),
            escape(id)
        );
    }
    body.push_str("</table>");
    let next = match &listing.stopped_at {
        // The scan stopped at its budget: say so, and offer to go on.
        Some(at) => {
            let _ = write!(
                body,
                "<p id=\"stopped\">Looked at {} dead letters without filling the page; older ones may match.</p>",
                listing.scanned
            );
            Some(at.as_str())
        }
        None if letters.len() == PAGE_SIZE => letters.last().and_then(|l| l.id.as_deref()),
        None => None,
    };
    {
        if let Some(last) = next {
            let _ = write!(
                body,
                "<p><a id=\"next\" href=\"/dlq?stream={}&amp;kind={}&amp;reason={}&amp;before={}\">Older &rarr;</a></p>",
                encode(stream),
                kind.map_or("", |k| k.as_str()),
                encode(reason.unwrap_or("")),
                encode(last)
            );
        }
    }
    html(200, "taskhub dead letters", &body)
}

fn show_page(monitor: &Monitor, access: &Access, query: &[(String, String)]) -> Response {
    let stream = match stream_param(monitor, query) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let Some(id) = param(query, "id") else {
        return html(400, "Bad request", "<p>missing id</p>");
    };
    let mut conn = match redis(monitor) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let letter = match dlq::show(&mut conn, stream, id) {
        Ok(Some(l)) => l,
        Ok(None) => {
            return html(
                404,
                "Not found",
                "<p>no such dead letter (replayed, purged or archived?)</p>",
            )
        }
        Err(e) => return html(400, "Error", &format!("<p>{}</p>", escape(&e.to_string()))),
    };
    html(
        200,
        "taskhub dead letter",
        &detail(access.can_change(), stream, id, &letter),
    )
}

fn detail(can_change: bool, stream: &str, id: &str, l: &DeadLetter) -> String {
    let mut body = format!(
        "<p><a href=\"/dlq?stream={}\">&larr; all dead letters</a></p><h1>Dead letter {}</h1><table id=\"meta\">",
        encode(stream),
        escape(id)
    );
    for (name, value) in [
        ("event_id", l.event_id.clone().unwrap_or_default()),
        ("kind", l.kind.to_string()),
        ("reason", l.reason.clone()),
        ("attempts", l.attempts.to_string()),
        ("stream", l.stream.clone()),
        ("original entry", l.original_id.clone()),
        ("group", l.group.clone()),
        ("consumer", l.consumer.clone()),
        ("first failed", time(l.first_failed_at)),
        ("dead at", time(l.dead_at)),
    ] {
        let _ = write!(body, "<tr><th>{name}</th><td>{}</td></tr>", escape(&value));
    }
    body.push_str("</table><h2>Payload</h2>");
    let payload =
        l.field("payload")
            .map(|p| match serde_json::from_slice::<serde_json::Value>(p) {
                Ok(json) => serde_json::to_string_pretty(&json).unwrap_or_default(),
                Err(_) => field_text(p),
            });
    let _ = write!(
        body,
        "<pre id=\"payload\">{}</pre><h2>Fields</h2><table id=\"fields\">",
        escape(payload.as_deref().unwrap_or("(no payload field)"))
    );
    for (k, v) in &l.fields {
        let _ = write!(
            body,
            "<tr><th>{}</th><td>{}</td></tr>",
            escape(&field_text(k)),
            escape(&field_text(v))
        );
    }
    body.push_str("</table><h2>Attempts</h2><table id=\"history\"><tr><th>#</th><th>at</th><th>error</th></tr>");
    for a in &l.history {
        let at = a.at.map_or("(never reported: crashed)".to_owned(), |t| {
            time(crate::dlq::millis(t))
        });
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            a.attempt,
            at,
            escape(&a.error)
        );
    }
    body.push_str("</table>");
    if can_change {
        for (action, label) in [("replay", "Replay"), ("delete", "Delete")] {
            let _ = write!(
                body,
                "<form class=\"inline\" method=\"post\" action=\"/dlq/{action}\" id=\"{action}-form\">\
                 <input type=\"hidden\" name=\"stream\" value=\"{}\"><input type=\"hidden\" name=\"id\" value=\"{}\">\
                 Admin token <input type=\"password\" name=\"token\" autocomplete=\"off\"> \
                 <button type=\"submit\">{label}</button></form> ",
                escape(stream),
                escape(id)
            );
        }
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_and_form_decoding() {
        assert_eq!(
            escape(r#""><img src=x onerror=alert(1)><script>"#),
            "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;"
        );
        assert_eq!(escape("a\u{1b}[31m"), "a\\u{1b}[31m");
        assert_eq!(decode("a+b%20c%3D%26"), "a b c=&");
        assert_eq!(decode("100%"), "100%");
        assert_eq!(encode("a b/é"), "a%20b%2F%C3%A9");
        assert_eq!(decode("%e9%"), "\u{fffd}%");
    }

    #[test]
    fn the_message_box_shows_fixed_texts_only() {
        let shown = |query: &str| message(&params(query));
        assert_eq!(
            shown("msg=replayed&n=3&skipped=1").as_deref(),
            Some("Replayed 3 dead letter(s) to the stream (1 already processed: the worker will skip them).")
        );
        assert_eq!(
            shown("msg=replayed&n=Call+us+now&skipped=-1").as_deref(),
            Some("Replayed 0 dead letter(s) to the stream (0 already processed: the worker will skip them).")
        );
        assert_eq!(
            shown("msg=deleted").as_deref(),
            Some("Deleted the dead letter.")
        );
        assert_eq!(shown("msg=Your+session+expired%2C+call+555"), None);
        assert_eq!(shown("stream=s"), None);
    }
}
