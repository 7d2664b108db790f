//! What the dead-letter page shows: the list (filters, pages, "looked at
//! N" when a listing stopped early) and one letter in full.

use std::fmt::Write as _;
use std::time::SystemTime;

use crate::dlq::{self, DeadLetter, Filter};
use crate::http::access::Access;
use crate::http::bulk::Bulk;
use crate::http::filter::PageFilter;
use crate::http::html::{cut, escape, field_text, html, param, time};
use crate::http::page::{message, redis, stream_param};
use crate::http::wire::Response;
use crate::net::percent_encode as encode;
use crate::worker::monitor::Monitor;

const PAGE_SIZE: usize = 50;

/// Entries the reasons table looks at, at most, and for how long.
const REASONS_BUDGET: (usize, std::time::Duration) = (10_000, std::time::Duration::from_secs(1));

/// A filter the page cannot read: 400, saying why.
fn bad_filter(why: &str) -> Response {
    html(
        400,
        "Bad filter",
        &format!("<p class=\"msg\" id=\"msg\">{}</p>", escape(why)),
    )
}

pub(crate) fn list_page(
    monitor: &Monitor,
    access: &Access,
    bulk: &Bulk,
    query: &[(String, String)],
) -> Response {
    let stream = match stream_param(monitor, query) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let chosen = match PageFilter::read(query, SystemTime::now()) {
        Ok(f) => f,
        Err(e) => return bad_filter(&e),
    };
    let filter = Filter {
        limit: Some(PAGE_SIZE),
        before: param(query, "before").map(str::to_owned),
        ..chosen.filter.clone()
    };
    let mut conn = match redis(monitor) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let listing = match dlq::list(&mut conn, stream, &filter) {
        Ok(l) => l,
        Err(e) => return html(400, "Error", &format!("<p>{}</p>", escape(&e.to_string()))),
    };
    let reasons = dlq::stats_within(&mut conn, stream, &chosen.filter, Some(REASONS_BUDGET));
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
    body.push_str(&bulk.status(stream).unwrap_or_default());
    // A group the stream does not have (a typo, or a group gone): say so,
    // as `taskhub dlq --group` does, rather than an empty list that reads
    // as "no letters for this group".
    if let Some(group) = &chosen.filter.group {
        let known = crate::redis::streams::group_names(&mut conn, stream);
        if known.is_ok_and(|names| !names.iter().any(|n| n == group.as_bytes())) {
            let _ = write!(
                body,
                "<p class=\"msg\" id=\"unknown-group\">{} has no consumer group {}: \
                 only letters it wrote before it went can match.</p>",
                escape(stream),
                escape(group)
            );
        }
    }
    let _ = write!(
        body,
        "<p>{total} in <code>{}</code>, newest first. <a href=\"/\">Overview</a></p>",
        escape(&dlq_name)
    );
    let stream_input = if monitor.streams().len() > 1 {
        let mut out = String::from("Stream <select name=\"stream\">");
        for s in monitor.streams() {
            let selected = if s == stream { " selected" } else { "" };
            let _ = write!(out, "<option{selected}>{}</option>", escape(s));
        }
        out + "</select> "
    } else {
        format!(
            "<input type=\"hidden\" name=\"stream\" value=\"{}\">",
            escape(stream)
        )
    };
    body.push_str(&chosen.form(&stream_input));
    if let Ok(stats) = &reasons {
        body.push_str(&groups_table(stream, &chosen, stats));
        body.push_str(&reasons_table(stats));
    }
    if access.can_change() && !letters.is_empty() {
        body.push_str(&bulk_forms(stream, &chosen));
    }
    body.push_str(
        "<table id=\"letters\"><tr><th>dead at</th><th>group</th><th>kind</th><th>event_id</th><th>attempts</th><th>reason</th><th>entry</th></tr>",
    );
    for l in letters {
        let id = l.id.as_deref().unwrap_or("");
        let _ = write!(
            body,
            "<tr><td>{}</td><td class=\"group\">{}</td><td class=\"kind\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td><a href=\"/dlq/show?stream={}&amp;id={}{}\">{}</a></td></tr>",
            time(l.dead_at),
            escape(&cut(&l.group, 100)),
            l.kind,
            escape(l.event_id.as_deref().unwrap_or("")),
            l.attempts,
            escape(&cut(&l.reason, 200)),
            encode(stream),
            encode(id),
            chosen.link_params(),
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
    if let Some(last) = next {
        let _ = write!(
            body,
            "<p><a id=\"next\" href=\"/dlq?stream={}{}&amp;before={}\">Older &rarr;</a></p>",
            encode(stream),
            chosen.link_params(),
            encode(last)
        );
    }
    html(200, "taskhub dead letters", &body)
}

/// The matching dead letters by consumer group, each a link to its own,
/// when they are of more than one (groups reading one stream share its
/// dead-letter stream).
fn groups_table(stream: &str, chosen: &PageFilter, stats: &dlq::Stats) -> String {
    const SHOWN: usize = 20;
    if stats.by_group.len() < 2 {
        return String::new();
    }
    let mut out =
        format!(
        "<h2>Groups ({} matching{})</h2><table id=\"groups\"><tr><th>count</th><th>group</th></tr>",
        stats.count,
        if stats.stopped_at.is_some() { ", among the newest looked at" } else { "" }
    );
    for (group, n) in stats.by_group.iter().take(SHOWN) {
        // The link keeps the other criteria: the count shown is what it
        // lists, and what its bulk actions would take.
        let narrowed = PageFilter {
            group: Some(group.clone()),
            ..chosen.clone()
        };
        let _ = write!(
            out,
            "<tr><td>{n}</td><td><a href=\"/dlq?stream={}{}\">{}</a></td></tr>",
            encode(stream),
            narrowed.link_params(),
            escape(&cut(group, 100))
        );
    }
    out.push_str("</table>");
    if stats.by_group.len() > SHOWN {
        let _ = write!(
            out,
            "<p>and {} more groups (filter by group to see one).</p>",
            stats.by_group.len() - SHOWN
        );
    }
    out
}

/// The matching dead letters by reason, numbers and ids masked (as `taskhub
/// dlq stats`), with an example of each on hover.
fn reasons_table(stats: &dlq::Stats) -> String {
    if stats.by_reason.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "<h2>Reasons ({} matching{})</h2><table id=\"reasons\"><tr><th>count</th><th>reason (numbers and ids masked)</th></tr>",
        stats.count,
        if stats.stopped_at.is_some() { ", among the newest looked at" } else { "" }
    );
    for r in stats.by_reason.iter().take(20) {
        let _ = write!(
            out,
            "<tr><td>{}</td><td title=\"{}\">{}</td></tr>",
            r.count,
            escape(&cut(&r.example, 300)),
            escape(&cut(&r.fingerprint, 200))
        );
    }
    out.push_str("</table>");
    out
}

/// Replay and delete of everything the filter selects (admin only): the
/// first POST only counts and asks for confirmation.
fn bulk_forms(stream: &str, chosen: &PageFilter) -> String {
    let mut out = format!(
        "<p>Everything that matches: {}.</p>",
        escape(&chosen.describe())
    );
    for (action, label, extra) in [
        (
            "replay",
            "Replay all matching…",
            "at most <input name=\"rate\" size=\"4\" value=\"50\"> per second ",
        ),
        ("delete", "Delete all matching…", ""),
    ] {
        let _ = write!(
            out,
            "<form class=\"inline\" method=\"post\" action=\"/dlq/bulk\" id=\"bulk-{action}\">\
             <input type=\"hidden\" name=\"stream\" value=\"{}\">{}\
             <input type=\"hidden\" name=\"action\" value=\"{action}\">{extra}\
             Admin token <input type=\"password\" name=\"token\" autocomplete=\"off\"> \
             <button type=\"submit\">{label}</button></form> ",
            escape(stream),
            chosen.hidden_fields()
        );
    }
    out
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
    let list = match PageFilter::read(query, SystemTime::now()) {
        Ok(f) => f,
        Err(e) => return bad_filter(&e),
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
        &detail(access.can_change(), stream, id, &letter, &list),
    )
}

/// One letter in full; `list` is the criteria of the list it was opened
/// from, which its way back and its forms keep.
fn detail(can_change: bool, stream: &str, id: &str, l: &DeadLetter, list: &PageFilter) -> String {
    let back = if list.is_set() {
        escape(&list.describe())
    } else {
        "all dead letters".to_owned()
    };
    let mut body = format!(
        "<p><a href=\"/dlq?stream={}{}\">&larr; {back}</a></p><h1>Dead letter {}</h1><table id=\"meta\">",
        encode(stream),
        list.link_params(),
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
    for (gap, a) in crate::dlq::with_gaps(&l.history) {
        if let Some(gap) = gap {
            let _ = write!(
                body,
                "<tr><td>…</td><td></td><td>{}</td></tr>",
                escape(&gap)
            );
        }
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
                 <input type=\"hidden\" name=\"stream\" value=\"{}\"><input type=\"hidden\" name=\"id\" value=\"{}\">{}\
                 Admin token <input type=\"password\" name=\"token\" autocomplete=\"off\"> \
                 <button type=\"submit\">{label}</button></form> ",
                escape(stream),
                escape(id),
                list.hidden_fields()
            );
        }
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dlq::Attempt;

    #[test]
    fn a_letter_s_page_shows_where_its_history_left_attempts_out() {
        let mut l = crate::dlq::letter::tests::sample_letter(Vec::new());
        l.history = [1, 2, 5]
            .into_iter()
            .map(|n| Attempt::new(n, None, format!("failure {n}")))
            .collect();
        let list = PageFilter::read(&[], SystemTime::now()).unwrap();
        let page = detail(false, "s", "1-0", &l, &list);
        let at = |text: &str| page.find(text).unwrap_or_else(|| panic!("{text}: {page}"));
        assert!(
            at("failure 2") < at("(2 attempts left out")
                && at("(2 attempts left out") < at("failure 5")
        );
        assert_eq!(page.matches("left out").count(), 1, "{page}");
    }
}
