//! Replay or delete everything the page's filter selects, as `taskhub dlq
//! replay` and `purge` do with filter flags: only with the admin token,
//! after a confirmation page that shows the count, never more than the
//! count confirmed, replays at a chosen rate. The work runs on a thread of
//! its own (one action at a time per server), so the request returns at
//! once and the list page shows the progress.
//!
//! The confirmation binds the action to what the operator was shown: its
//! form carries the newest dead-letter id at that moment (`upto`) and the
//! time window as absolute times (`since=2h` becomes the time two hours
//! before the page was shown). The confirmed action selects only dead
//! letters with ids up to `upto` that still match, so dead letters that
//! arrive in between are never touched; if some of those counted were
//! replayed or deleted meanwhile, it acts on the rest and says so.

use std::fmt;
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

/// The newest dead-letter id a confirmation page counted (`upto` in its
/// form). The confirmed action selects only dead letters whose ids are at
/// most this one: ids of a stream only grow, so every dead letter that
/// arrives after the page was shown has a larger id and is left alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Upto {
    /// The two halves of a stream id `<ms>-<seq>`.
    ms: u64,
    seq: u64,
}

impl Upto {
    /// Reads a whole stream id `<ms>-<seq>`, strictly: two runs of ASCII
    /// digits that each fit in a u64, and nothing else (no sign, no spaces,
    /// no shorthand `<ms>` alone).
    fn parse(text: &str) -> Option<Upto> {
        let (ms, seq) = text.split_once('-')?;
        let number = |part: &str| {
            // `u64::from_str` would accept a leading `+`: check first.
            if part.is_empty() || part.len() > 20 || !part.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            part.parse::<u64>().ok()
        };
        Some(Upto {
            ms: number(ms)?,
            seq: number(seq)?,
        })
    }

    /// The `before` cursor of [`dlq::Filter`] (which is exclusive) that
    /// keeps the ids at most this one: the id just after it. `None` for the
    /// largest id there can be, which every id is at most.
    fn before(self) -> Option<String> {
        if self.seq < u64::MAX {
            Some(format!("{}-{}", self.ms, self.seq + 1))
        } else if self.ms < u64::MAX {
            Some(format!("{}-0", self.ms + 1))
        } else {
            None
        }
    }
}

impl fmt::Display for Upto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// What the operator confirmed: at most `count` dead letters, none newer
/// than `upto`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Confirmed {
    pub count: usize,
    pub upto: Upto,
}

/// The `upto` of a confirmed bulk form. It must be there: without it the
/// action could reach dead letters the operator never saw.
pub(crate) fn upto(form: &[(String, String)]) -> Result<Upto, String> {
    match param(form, "upto") {
        None => Err(concat!(
            "missing upto (the newest dead-letter id the confirmation counted): ",
            "ask for the confirmation page again"
        )
        .to_owned()),
        Some(text) => Upto::parse(text).ok_or_else(|| {
            format!("upto {text:?} is not a dead-letter id (they look like 1700000000000-0)")
        }),
    }
}

/// The rate of a replay form: replays per second within [0.001, 1000].
pub(crate) fn rate(form: &[(String, String)]) -> Result<f64, String> {
    match param(form, "rate") {
        None => Ok(RATE),
        Some(text) => match text.parse::<f64>() {
            Ok(r) if (crate::dlq::MIN_RATE..=MAX_RATE).contains(&r) => Ok(r),
            _ => Err(format!(
                "rate {text:?}: give replays per second, from {} to {MAX_RATE}",
                crate::dlq::MIN_RATE
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
    /// `stream`, showing how many that is first. Its form pins that set
    /// down: the newest dead-letter id now (`upto`), and the time window as
    /// absolute times.
    pub fn confirm(
        monitor: &Monitor,
        stream: &str,
        filter: &PageFilter,
        action: Action,
        rate: f64,
    ) -> Response {
        let counted = monitor
            .redis_conn()
            .map_err(|e| e.to_string())
            .and_then(|mut conn| count_upto_newest(&mut conn, stream, &filter.filter));
        let back = format!(
            "<p><a href=\"/dlq?stream={}{}\">&larr; back to the list</a></p>",
            encode(stream),
            filter.link_params()
        );
        let (count, upto) = match counted {
            Ok(Some((count, upto))) if count > 0 => (count, upto),
            // No dead letters at all, or none that match.
            Ok(_) => {
                return html(
                    200,
                    "Nothing to do",
                    &format!("<p class=\"msg\" id=\"msg\">Nothing matches.</p>{back}"),
                )
            }
            Err(e) => return html(503, "Unavailable", &format!("<p>{}</p>", escape(&e))),
        };
        // `since=2h` read again at the confirmed POST would be another
        // window: carry the times this count used.
        let fixed = filter.with_times_fixed();
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
             Only dead letters up to id <code>{upto}</code> are touched: those that \
             arrive meanwhile are left alone, and any of these replayed or deleted \
             meanwhile are skipped.</p>\
             <form method=\"post\" action=\"/dlq/bulk\" id=\"confirm-form\">\
             <input type=\"hidden\" name=\"stream\" value=\"{}\">{}\
             <input type=\"hidden\" name=\"action\" value=\"{verb}\">\
             <input type=\"hidden\" name=\"rate\" value=\"{rate}\">\
             <input type=\"hidden\" name=\"confirm\" value=\"{count}\">\
             <input type=\"hidden\" name=\"upto\" value=\"{upto}\">\
             Admin token <input type=\"password\" name=\"token\" autocomplete=\"off\"> \
             <button type=\"submit\">Yes, {verb} {count}</button></form>{back}",
            escape(&fixed.describe()),
            escape(stream),
            fixed.hidden_fields(),
        );
        html(200, "Confirm", &body)
    }

    /// Starts `action` on at most `confirmed.count` of the dead letters
    /// `filter` selects on `stream` whose ids are at most `confirmed.upto`
    /// (those the confirmation page counted). Refused while another bulk
    /// action runs.
    pub fn start(
        self: &Arc<Bulk>,
        monitor: &Monitor,
        stream: &str,
        filter: &PageFilter,
        action: Action,
        confirmed: Confirmed,
        rate: f64,
    ) -> Result<(), String> {
        let Confirmed { count, upto } = confirmed;
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.as_ref().is_some_and(|p| p.outcome.is_none()) {
                return Err("another bulk action is running; wait for it to finish".into());
            }
            *state = Some(Progress {
                action,
                stream: stream.to_owned(),
                done: 0,
                total: count,
                outcome: None,
            });
        }
        // Only what the confirmation counted: ids up to `upto` that still
        // match, and never more than confirmed.
        let mut selected = filter.filter.clone();
        selected.before = upto.before();
        selected.limit = Some(count);
        let (bulk, monitor, stream) = (self.clone(), monitor.clone(), stream.to_owned());
        let started = std::thread::Builder::new()
            .name("taskhub-http-bulk".into())
            .spawn(move || {
                let outcome = bulk.run(&monitor, &stream, selected, action, count, rate);
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
        confirmed: usize,
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
                    max_entry_bytes: Some(monitor.max_entry_bytes()),
                    ..ReplayOptions::default()
                };
                let mut progress = progress;
                match dlq::replay(&mut conn, None, stream, &selection, &options, &mut progress) {
                    Ok(r) => {
                        for item in &r.items {
                            if let Some(e) = &item.error {
                                log::warn!("http: bulk replay of {stream}/{}: {e}", item.id);
                            }
                        }
                        let out = format!(
                            "replayed {} (failed {}; not whole, kept: {}; not found {}) at {}",
                            r.replayed(),
                            r.failed(),
                            r.incomplete(),
                            r.not_found.len(),
                            humantime::format_rfc3339_seconds(SystemTime::now())
                        );
                        // `items` holds those found (replayed or failed).
                        out + &gone(r.items.len(), confirmed)
                    }
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
                    out + &gone(r.removed, confirmed)
                }
                Err(e) => format!("failed: {}", e.chain()),
            },
        }
    }
}

/// Counts the dead letters of `stream` that `filter` matches, up to the
/// newest dead letter there is now, and returns that count with the newest
/// id: `None` when there are no dead letters at all. The id is read first
/// and the count stops at it, so the two agree even while dead letters
/// keep arriving.
fn count_upto_newest(
    conn: &mut crate::redis::RedisConn,
    stream: &str,
    filter: &dlq::Filter,
) -> Result<Option<(u64, Upto)>, String> {
    let newest = dlq::Filter {
        limit: Some(1),
        ..dlq::Filter::default()
    };
    let listing = dlq::list(conn, stream, &newest).map_err(|e| e.to_string())?;
    let Some(letter) = listing.letters.first() else {
        if listing.stopped_at.is_some() {
            // Only unreadable entries near the end: no id to stop at.
            return Err("cannot find the newest readable dead letter to count up to".into());
        }
        return Ok(None);
    };
    let id = letter.id.as_deref().unwrap_or_default();
    let upto = Upto::parse(id).ok_or_else(|| format!("unexpected dead-letter id {id:?}"))?;
    let mut counted = filter.clone();
    counted.before = upto.before();
    let stats = dlq::stats(conn, stream, &counted).map_err(|e| e.to_string())?;
    Ok(Some((stats.count, upto)))
}

/// What to add to an outcome when fewer dead letters were there to act on
/// (`found`) than the operator confirmed: the others were replayed, deleted
/// or archived in between.
fn gone(found: usize, confirmed: usize) -> String {
    match confirmed.saturating_sub(found) {
        0 => String::new(),
        n => format!(
            "; {n} of the {confirmed} confirmed had gone already (replayed, deleted or archived meanwhile)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upto_reads_whole_stream_ids_only() {
        assert_eq!(
            Upto::parse("1700000000000-7"),
            Some(Upto {
                ms: 1_700_000_000_000,
                seq: 7
            })
        );
        let max = "18446744073709551615";
        assert!(Upto::parse(&format!("{max}-{max}")).is_some());
        for bad in [
            "",
            "1",
            "1-",
            "-1",
            "1-2-3",
            "+1-0",
            "1-+0",
            " 1-0",
            "1-0 ",
            "1-0x",
            "١-0",
            "18446744073709551616-0",
            "1-18446744073709551616",
            "000000000000000000001-0",
        ] {
            assert_eq!(Upto::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn upto_keeps_ids_up_to_and_including_itself() {
        let before = |text: &str| Upto::parse(text).unwrap().before();
        assert_eq!(before("5-0").as_deref(), Some("5-1"));
        assert_eq!(before("5-18446744073709551615").as_deref(), Some("6-0"));
        assert_eq!(before("18446744073709551615-18446744073709551615"), None);
        assert_eq!(Upto::parse("5-3").unwrap().to_string(), "5-3");
    }
}
