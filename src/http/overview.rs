//! The overview at `/`: every stream of the worker as `taskhub status`
//! shows it, this instance's rates, and what waits here for a retry. It
//! reloads itself every few seconds (a meta refresh: no script, under the
//! page's strict CSP).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use crate::http::html::{cut, escape, refreshing};
use crate::http::wire::Response;
use crate::net::percent_encode as encode;
use crate::status::{group_status, GroupStatus};
use crate::worker::monitor::Monitor;
use crate::worker::stats::Summary;

/// Seconds between reloads.
const REFRESH: u32 = 5;

/// Counter samples for the rates: one kept per few seconds, over a minute.
#[derive(Default)]
pub(crate) struct Rates {
    samples: Mutex<VecDeque<(Instant, Summary)>>,
}

/// The rates shown: per second, over the window.
struct PerSecond {
    window: Duration,
    read: f64,
    applied: f64,
    duplicates: f64,
    retries: f64,
    dead_lettered: f64,
}

impl Rates {
    /// Records `now` and returns the rates since the oldest sample kept.
    fn update(&self, now: Instant, summary: Summary) -> Option<PerSecond> {
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        while samples
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > Duration::from_secs(60))
        {
            samples.pop_front();
        }
        if samples
            .back()
            .is_none_or(|(at, _)| now.duration_since(*at) >= Duration::from_secs(2))
        {
            samples.push_back((now, summary));
        }
        let (at, then) = samples.front()?;
        let window = now.duration_since(*at);
        if window < Duration::from_secs(1) {
            return None;
        }
        let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / window.as_secs_f64();
        Some(PerSecond {
            window,
            read: rate(summary.read, then.read),
            applied: rate(summary.applied, then.applied),
            duplicates: rate(summary.duplicates, then.duplicates),
            retries: rate(summary.retries, then.retries),
            dead_lettered: rate(summary.dead_lettered, then.dead_lettered),
        })
    }
}

fn seconds(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

/// The page.
pub(crate) fn overview_page(monitor: &Monitor, rates: &Rates) -> Response {
    let summary = monitor.summary();
    let mut body = format!(
        "<h1>taskhub</h1><p>Consumer <b>{}</b> of group <b>{}</b>, up {}. <a href=\"/dlq\">Dead letters</a> · <a href=\"/metrics\">metrics</a></p>",
        escape(monitor.consumer()),
        escape(monitor.group()),
        seconds(monitor.started().elapsed().unwrap_or_default()),
    );
    if let Err(problems) = monitor.ready() {
        let _ = write!(
            body,
            "<p class=\"msg\">Not ready: {}</p>",
            escape(&problems.join("; "))
        );
    }
    body.push_str(&streams_table(monitor));
    body.push_str(&counters(&summary, rates.update(Instant::now(), summary)));
    body.push_str(&retrying_table(monitor));
    refreshing("taskhub", &body, REFRESH)
}

fn streams_table(monitor: &Monitor) -> String {
    let group = monitor.group();
    let mut out = format!(
        "<h2>Streams (group {})</h2><table><tr><th>stream</th><th>length</th><th>lag</th><th>pending</th>\
         <th>oldest pending</th><th>redelivered</th><th>dead letters</th><th>consumers (pending, idle)</th></tr>",
        escape(group)
    );
    let now = SystemTime::now();
    let mut conn = monitor.redis_conn();
    // Streams other groups read too: their dead letters are every group's.
    let mut shared: Vec<(String, Vec<String>)> = Vec::new();
    for stream in monitor.streams() {
        let found: Result<GroupStatus, String> = match &mut conn {
            Ok(conn) => group_status(conn, stream, group, now).map_err(|e| e.chain()),
            Err(e) => Err(format!("Redis: {e}")),
        };
        let link = format!("/dlq?stream={}", encode(stream));
        match found {
            Ok(s) => {
                let consumers: Vec<String> = s
                    .consumers
                    .iter()
                    .map(|c| format!("{} ({}, {})", escape(&c.name), c.pending, seconds(c.idle)))
                    .collect();
                let mut letters = format!("<a href=\"{}\">{}</a>", escape(&link), s.dead_letters);
                if !s.other_groups.is_empty() {
                    let ours = format!("{link}&group={}", encode(group));
                    let _ = write!(
                        letters,
                        " (every group's; <a href=\"{}\">this group's</a>)",
                        escape(&ours)
                    );
                    shared.push((stream.clone(), s.other_groups.clone()));
                }
                let _ = write!(
                    out,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                     <td>{}</td><td>{}</td></tr>",
                    escape(stream),
                    s.length,
                    s.lag.map_or("?".into(), |n| n.to_string()),
                    s.pending,
                    s.oldest_pending.map_or("-".into(), seconds),
                    s.redelivered,
                    letters,
                    consumers.join(", ")
                );
            }
            Err(e) => {
                let _ = write!(
                    out,
                    "<tr><td>{}</td><td colspan=\"7\">cannot tell: {}</td></tr>",
                    escape(stream),
                    escape(&cut(&e, 200))
                );
            }
        }
    }
    out.push_str("</table>");
    out.push_str(
        "<p>Redelivered: pending entries delivered more than once (taken over from \
         another consumer, or read again after a restart or a crash). Retries keep \
         their delivery count: the ones this instance holds are below.</p>",
    );
    for (stream, others) in shared {
        let others: Vec<String> = others.iter().map(|g| escape(g)).collect();
        let _ = write!(
            out,
            "<p class=\"msg\">The dead letters of {} are every group's: the stream is \
             also read by {}.</p>",
            escape(&stream),
            others.join(", ")
        );
    }
    out
}

fn counters(s: &Summary, rates: Option<PerSecond>) -> String {
    let mut out = String::from("<h2>This instance</h2><table><tr><th></th><th>total</th>");
    if let Some(r) = &rates {
        let _ = write!(out, "<th>per second (last {})</th>", seconds(r.window));
    }
    out.push_str("</tr>");
    let rows = [
        ("read", s.read, rates.as_ref().map(|r| r.read)),
        ("applied", s.applied, rates.as_ref().map(|r| r.applied)),
        (
            "duplicates skipped",
            s.duplicates,
            rates.as_ref().map(|r| r.duplicates),
        ),
        ("retries", s.retries, rates.as_ref().map(|r| r.retries)),
        (
            "dead-lettered",
            s.dead_lettered,
            rates.as_ref().map(|r| r.dead_lettered),
        ),
        ("taken over from other consumers", s.reclaimed, None),
    ];
    for (name, total, rate) in rows {
        let _ = write!(out, "<tr><td>{name}</td><td>{total}</td>");
        if rates.is_some() {
            let _ = write!(
                out,
                "<td>{}</td>",
                rate.map_or(String::new(), |r| format!("{r:.1}"))
            );
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
    out
}

fn retrying_table(monitor: &Monitor) -> String {
    let (total, first) = monitor.retrying();
    let mut out = format!("<h2>Waiting for a retry here ({total})</h2>");
    if first.is_empty() {
        out.push_str("<p>Nothing.</p>");
        return out;
    }
    out.push_str(
        "<table><tr><th>stream</th><th>entry</th><th>event_id</th><th>attempts</th><th>next try</th><th>last error</th></tr>",
    );
    let now = SystemTime::now();
    for r in &first {
        let due = r.due.duration_since(now).unwrap_or_default();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>in {}</td><td>{}</td></tr>",
            escape(&r.stream),
            escape(&r.entry_id),
            escape(&cut(r.event_id.as_deref().unwrap_or("-"), 80)),
            r.attempts,
            seconds(due),
            escape(&cut(&r.last_error, 200)),
        );
    }
    out.push_str("</table>");
    if total > first.len() {
        let _ = write!(out, "<p>… and {} more.</p>", total - first.len());
    }
    out
}
