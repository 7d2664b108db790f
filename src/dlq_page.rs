//! The dead-letter web page of `--http`: a list with filters and pages, a
//! detail view, and, only when an admin token is configured, replay and
//! delete buttons (POST with the token; a GET never changes anything).
//!
//! Payloads are untrusted input: every byte that reaches the page goes
//! through [`escape`], and a strict Content-Security-Policy forbids scripts
//! altogether, so even a missed escape could not run anything.

use std::fmt::Write as _;
use std::io::Read as _;
use std::time::Duration;

use crate::dead_letter::{DeadLetter, Kind};
use crate::dlq::{self, Filter, ReasonMatch, ReplayOptions, Selection};
use crate::http_server::text;
use crate::run::Shared;

const PAGE_SIZE: usize = 50;
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

type Response = tiny_http::Response<std::io::Cursor<Vec<u8>>>;

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
    crate::connect::percent_decode(&text.replace('+', " "))
}

/// Encodes a query parameter value.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
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
    text(status, "text/html; charset=utf-8", page).with_header(
        tiny_http::Header::from_bytes("Content-Security-Policy", CSP).expect("valid header"),
    )
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

/// Serves `/dlq...`; `None` when the path is not the page's.
pub(crate) fn route(shared: &Shared, request: &mut tiny_http::Request) -> Option<Response> {
    let url = request.url().to_owned();
    let (path, query) = url.split_once('?').unwrap_or((url.as_str(), ""));
    let query = params(query);
    let response = match (request.method(), path) {
        (tiny_http::Method::Get, "/dlq") => list_page(shared, &query),
        (tiny_http::Method::Get, "/dlq/show") => show_page(shared, &query),
        (tiny_http::Method::Post, "/dlq/replay" | "/dlq/delete") => {
            if request.body_length().is_none_or(|n| n > 64 * 1024) {
                return Some(html(
                    413,
                    "Too large",
                    "<p>form too large or without a length</p>",
                ));
            }
            let mut body = String::new();
            if std::io::Read::take(request.as_reader(), 64 * 1024)
                .read_to_string(&mut body)
                .is_err()
            {
                return Some(html(400, "Bad request", "<p>unreadable form</p>"));
            }
            action(shared, path, &params(&body))
        }
        (_, p) if p == "/dlq" || p.starts_with("/dlq/") => {
            html(405, "Not allowed", "<p>method not allowed</p>")
        }
        _ => return None,
    };
    Some(response)
}

fn stream_param<'a>(
    shared: &'a Shared,
    query: &'a [(String, String)],
) -> Result<&'a str, Response> {
    let stream = param(query, "stream").unwrap_or(&shared.config.streams[0]);
    if shared.config.streams.iter().any(|s| s == stream) {
        Ok(stream)
    } else {
        Err(html(404, "Unknown stream", "<p>unknown stream</p>"))
    }
}

fn redis(
    shared: &Shared,
) -> Result<r2d2::PooledConnection<crate::connect::RedisManager>, Response> {
    shared.redis_conn().map_err(|e| {
        html(
            503,
            "Redis unavailable",
            &format!("<p>Redis: {}</p>", escape(&e.to_string())),
        )
    })
}

fn list_page(shared: &Shared, query: &[(String, String)]) -> Response {
    let stream = match stream_param(shared, query) {
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
    let mut conn = match redis(shared) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let letters = match dlq::list(&mut conn, stream, &filter) {
        Ok(l) => l,
        Err(e) => return html(400, "Error", &format!("<p>{}</p>", escape(&e.to_string()))),
    };
    let dlq_name = crate::dead_letter::dead_letter_stream(stream);
    let total: u64 = redis::cmd("XLEN")
        .arg(&dlq_name)
        .query(&mut *conn)
        .unwrap_or(0);
    let mut body = format!("<h1>Dead letters of {}</h1>", escape(stream));
    if let Some(msg) = param(query, "msg") {
        let _ = write!(body, "<p class=\"msg\" id=\"msg\">{}</p>", escape(msg));
    }
    let _ = write!(
        body,
        "<p>{total} in <code>{}</code>, newest first.</p>",
        escape(&dlq_name)
    );
    body.push_str("<form method=\"get\" action=\"/dlq\">");
    if shared.config.streams.len() > 1 {
        body.push_str("Stream <select name=\"stream\">");
        for s in &shared.config.streams {
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
    for l in &letters {
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
    if letters.len() == PAGE_SIZE {
        if let Some(last) = letters.last().and_then(|l| l.id.as_deref()) {
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

fn show_page(shared: &Shared, query: &[(String, String)]) -> Response {
    let stream = match stream_param(shared, query) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let Some(id) = param(query, "id") else {
        return html(400, "Bad request", "<p>missing id</p>");
    };
    let mut conn = match redis(shared) {
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
        &detail(shared, stream, id, &letter),
    )
}

fn detail(shared: &Shared, stream: &str, id: &str, l: &DeadLetter) -> String {
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
            time(crate::dead_letter::millis(t))
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
    if shared.config.admin_token.is_some() {
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

/// Compares without an early exit, so timing says nothing about the token.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn action(shared: &Shared, path: &str, form: &[(String, String)]) -> Response {
    let Some(expected) = &shared.config.admin_token else {
        return html(
            403,
            "Refused",
            "<p>refused: no admin token is configured, the page is read-only</p>",
        );
    };
    if !param(form, "token").is_some_and(|t| same(t, expected)) {
        log::warn!("http: {path} refused: wrong or missing admin token");
        return html(
            403,
            "Refused",
            "<p>refused: wrong or missing admin token</p>",
        );
    }
    let stream = match stream_param(shared, form) {
        Ok(s) => s.to_owned(),
        Err(r) => return r,
    };
    let Some(id) = param(form, "id") else {
        return html(400, "Bad request", "<p>missing id</p>");
    };
    let mut conn = match redis(shared) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let selection = Selection::Ids(vec![id.to_owned()]);
    let message = if path == "/dlq/replay" {
        let mut pg = shared.pg.get_timeout(Duration::from_secs(2)).ok();
        let report = dlq::replay(
            &mut conn,
            pg.as_deref_mut().map(|c| &mut **c),
            &stream,
            &selection,
            &ReplayOptions::default(),
            &mut |_, _| {},
        );
        match report {
            Ok(r) => format!(
                "replayed {} (already processed: {}, failed: {})",
                r.replayed(),
                r.already_processed(),
                r.failed()
            ),
            Err(e) => format!("replay failed: {e}"),
        }
    } else {
        match dlq::purge(&mut conn, &stream, &selection, false) {
            Ok(_) => format!("deleted {id}"),
            Err(e) => format!("delete failed: {e}"),
        }
    };
    log::info!("http: {path} {stream}/{id}: {message}");
    let location = format!("/dlq?stream={}&msg={}", encode(&stream), encode(&message));
    text(303, "text/plain", message).with_header(
        tiny_http::Header::from_bytes("Location", location.as_bytes()).expect("valid header"),
    )
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
        assert!(same("secret", "secret") && !same("secret", "secreT") && !same("s", "secret"));
    }
}
