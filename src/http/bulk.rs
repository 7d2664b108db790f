//! Replay or delete everything the page's filter selects, as `taskhub dlq
//! replay` and `purge` do with filter flags: only with the admin token,
//! after a confirmation page that shows the count, never more than the
//! count confirmed, replays at a chosen rate. The work runs on a thread of
//! its own (one action at a time per server), so the request returns at
//! once and the list page shows the progress.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::dlq::{self, ReplayOptions, Selection};
use crate::http::filter::PageFilter;
use crate::http::html::{escape, html, param};
use crate::http::wire::Response;
use crate::net::percent_encode as encode;
use crate::worker::monitor::Monitor;

/// Replays per second unless the form says otherwise, and the most it may.
const RATE: f64 = 50.0;
const MAX_RATE: f64 = 1000.0;

/// What a bulk action does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Replay,
    Delete,
}

impl Action {
    pub fn parse(text: &str) -> Option<Action> {
        match text {
            "replay" => Some(Action::Replay),
            "delete" => Some(Action::Delete),
            _ => None,
        }
    }

    fn verb(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Delete => "delete",
        }
    }
}

/// The bulk action of one server: the one running, or the last one done.
#[derive(Default)]
pub(crate) struct Bulk {
    state: Mutex<Option<Progress>>,
}

#[derive(Clone)]
struct Progress {
    action: Action,
    stream: String,
    done: usize,
    total: usize,
    /// What came of it, once finished.
    outcome: Option<String>,
}

/// The rate of a replay form: replays per second within (0, 1000].
pub(crate) fn rate(form: &[(String, String)]) -> Result<f64, String> {
    match param(form, "rate") {
        None => Ok(RATE),
        Some(text) => match text.parse::<f64>() {
            Ok(r) if r > 0.0 && r <= MAX_RATE => Ok(r),
            _ => Err(format!(
                "rate {text:?}: give replays per second, at most {MAX_RATE}"
            )),
        },
    }
}

impl Bulk {
    /// The line the list page shows about the current or last action on
    /// `stream`, if any.
    pub fn status(&self, stream: &str) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let p = state.as_ref().filter(|p| p.stream == stream)?;
        Some(match &p.outcome {
            None => format!(
                "<p class=\"msg\" id=\"bulk\">Bulk {} running: {} of {} done.</p>",
                p.action.verb(),
                p.done,
                p.total
            ),
            Some(outcome) => format!(
                "<p class=\"msg\" id=\"bulk\">Last bulk {}: {}</p>",
                p.action.verb(),
                escape(outcome)
            ),
        })
    }

    /// The page that asks to confirm `action` on what `filter` selects on
    /// `stream`, showing how many that is first.
    pub fn confirm(
        monitor: &Monitor,
        stream: &str,
        filter: &PageFilter,
        action: Action,
        rate: f64,
    ) -> Response {
        let count = match monitor
            .redis_conn()
            .map_err(|e| e.to_string())
            .and_then(|mut conn| {
                dlq::stats(&mut conn, stream, &filter.filter).map_err(|e| e.to_string())
            }) {
            Ok(s) => s.count,
            Err(e) => return html(503, "Unavailable", &format!("<p>{}</p>", escape(&e))),
        };
        let back = format!(
            "<p><a href=\"/dlq?stream={}{}\">&larr; back to the list</a></p>",
            encode(stream),
            filter.link_params()
        );
        if count == 0 {
            return html(
                200,
                "Nothing to do",
                &format!("<p class=\"msg\" id=\"msg\">Nothing matches.</p>{back}"),
            );
        }
        let verb = action.verb();
        let what = match action {
            Action::Replay => format!(
                "put back on <code>{}</code>, at most {rate} per second",
                escape(stream)
            ),
            Action::Delete => "deleted for good".to_owned(),
        };
        let body = format!(
            "<h1>Confirm: {verb} {count} dead letters</h1>\
             <p id=\"confirm-count\">{count} dead letters match: {}. They will be {what}. \
             Dead letters that arrive meanwhile are left alone.</p>\
             <form method=\"post\" action=\"/dlq/bulk\" id=\"confirm-form\">\
             <input type=\"hidden\" name=\"stream\" value=\"{}\">{}\
             <input type=\"hidden\" name=\"action\" value=\"{verb}\">\
             <input type=\"hidden\" name=\"rate\" value=\"{rate}\">\
             <input type=\"hidden\" name=\"confirm\" value=\"{count}\">\
             Admin token <input type=\"password\" name=\"token\" autocomplete=\"off\"> \
             <button type=\"submit\">Yes, {verb} {count}</button></form>{back}",
            escape(&filter.describe()),
            escape(stream),
            filter.hidden_fields(),
        );
        html(200, "Confirm", &body)
    }

    /// Starts `action` on at most `confirmed` of the dead letters `filter`
    /// selects on `stream`. Refused while another bulk action runs.
    pub fn start(
        self: &Arc<Bulk>,
        monitor: &Monitor,
        stream: &str,
        filter: &PageFilter,
        action: Action,
        confirmed: usize,
        rate: f64,
    ) -> Result<(), String> {
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.as_ref().is_some_and(|p| p.outcome.is_none()) {
                return Err("another bulk action is running; wait for it to finish".into());
            }
            *state = Some(Progress {
                action,
                stream: stream.to_owned(),
                done: 0,
                total: confirmed,
                outcome: None,
            });
        }
        let mut selected = filter.filter.clone();
        selected.limit = Some(confirmed);
        let (bulk, monitor, stream) = (self.clone(), monitor.clone(), stream.to_owned());
        let started = std::thread::Builder::new()
            .name("taskhub-http-bulk".into())
            .spawn(move || {
                let outcome = bulk.run(&monitor, &stream, selected, action, rate);
                log::info!("http: bulk {} on {stream}: {outcome}", action.verb());
                let mut state = bulk.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(p) = state.as_mut() {
                    p.outcome = Some(outcome);
                }
            });
        started
            .map(drop)
            .map_err(|e| format!("cannot start the bulk action: {e}"))
    }

    fn run(
        &self,
        monitor: &Monitor,
        stream: &str,
        selected: dlq::Filter,
        action: Action,
        rate: f64,
    ) -> String {
        let mut conn = match monitor.redis_conn_for_bulk() {
            Ok(c) => c,
            Err(e) => return format!("failed: Redis: {e}"),
        };
        let selection = Selection::Filter(selected);
        let progress = |done: usize, total: usize| {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = state.as_mut() {
                (p.done, p.total) = (done, total);
            }
        };
        match action {
            Action::Replay => {
                let options = ReplayOptions {
                    rate: Some(rate),
                    ..ReplayOptions::default()
                };
                let mut progress = progress;
                match dlq::replay(&mut conn, None, stream, &selection, &options, &mut progress) {
                    Ok(r) => format!(
                        "replayed {} (failed {}; not found {}) at {}",
                        r.replayed(),
                        r.failed(),
                        r.not_found.len(),
                        humantime::format_rfc3339_seconds(SystemTime::now())
                    ),
                    Err(e) => format!("failed: {}", e.chain()),
                }
            }
            Action::Delete => match dlq::purge(&mut conn, stream, &selection, false) {
                Ok(r) => {
                    progress(r.removed, r.removed);
                    let mut out = format!("deleted {}", r.removed);
                    let _ = write!(
                        out,
                        " at {}",
                        humantime::format_rfc3339_seconds(SystemTime::now())
                    );
                    out
                }
                Err(e) => format!("failed: {}", e.chain()),
            },
        }
    }
}
