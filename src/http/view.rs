//! What the dead-letter page shows: the list (filters, pages, "looked at
//! N" when a listing stopped early) and one letter in full.

use std::fmt::Write as _;

use crate::dlq::{self, DeadLetter, Filter, Kind, ReasonMatch};
use crate::http::access::Access;
use crate::http::html::{cut, escape, field_text, html, param, time};
use crate::http::page::{message, redis, stream_param};
use crate::http::wire::Response;
use crate::net::percent_encode as encode;
use crate::worker::monitor::Monitor;

const PAGE_SIZE: usize = 50;

pub(crate) fn list_page(monitor: &Monitor, query: &[(String, String)]) -> Response {
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
            escape(&cut(&l.reason, 200)),
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

pub(crate) fn show_page(
    monitor: &Monitor,
    access: &Access,
    query: &[(String, String)],
) -> Response {
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
