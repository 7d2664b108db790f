//! The dead-letter web page of `--http`: its routes, the login, and, only
//! when an admin token is configured, the replay and delete actions (POST
//! with the token; a GET never changes anything). What it shows is
//! `view.rs`; who may see and change it, `access.rs`.
//!
//! The URL never puts words on the page: the message box after an action
//! shows one of a fixed set of texts, chosen by a code (see [`message`]).

use std::sync::Arc;
use std::time::SystemTime;

use crate::dlq::{self, ReplayOptions, Selection};
use crate::http::access::{cross_site, Access, Denied};
use crate::http::bulk::{self, Action, Bulk, Confirmed};
use crate::http::filter::PageFilter;
use crate::http::html::{escape, html, param, params};
use crate::http::overview::{overview_page, Rates};
use crate::http::server::text;
use crate::http::view::{list_page, show_page};
use crate::http::wire::{Request, Response};
use crate::net::percent_encode as encode;
use crate::worker::monitor::Monitor;

/// Largest form a POST may carry (login, replay, delete).
const MAX_FORM: usize = 64 * 1024;

/// The page's routes and who may use them.
pub(crate) struct Page {
    access: Access,
    rates: Rates,
    bulk: Arc<Bulk>,
}

impl Page {
    pub fn new(loopback: bool, admin: Option<String>, read: Option<String>) -> Page {
        Page {
            access: Access::new(loopback, admin, read),
            rates: Rates::default(),
            bulk: Arc::default(),
        }
    }

    /// The largest body a POST to `path` may carry: a form for the page's
    /// forms, nothing elsewhere.
    pub fn form_limit(&self, path: &str) -> usize {
        match path {
            "/dlq/login" | "/dlq/replay" | "/dlq/delete" | "/dlq/bulk" => MAX_FORM,
            _ => 0,
        }
    }

    /// Serves `/dlq...`; `None` when the path is not the page's.
    pub fn route(&self, monitor: &Monitor, request: &Request) -> Option<Response> {
        let path = request.path();
        if path != "/" && path != "/dlq" && !path.starts_with("/dlq/") {
            return None;
        }
        let response = match (request.method(), path) {
            ("GET" | "HEAD", "/") => {
                match self.access.may_read(request, &monitor.shutdown_handle()) {
                    Err(denied) => login_page(denied),
                    Ok(()) => overview_page(monitor, &self.rates),
                }
            }
            ("GET" | "HEAD", "/dlq" | "/dlq/show") => {
                match self.access.may_read(request, &monitor.shutdown_handle()) {
                    Err(denied) => login_page(denied),
                    Ok(()) if path == "/dlq" => {
                        list_page(monitor, &self.access, &self.bulk, &params(request.query()))
                    }
                    Ok(()) => show_page(monitor, &self.access, &params(request.query())),
                }
            }
            ("POST", "/dlq/login" | "/dlq/replay" | "/dlq/delete" | "/dlq/bulk") => {
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
        if path == "/dlq/bulk" {
            return self.bulk_action(monitor, &stream, form);
        }
        let Some(id) = param(form, "id") else {
            return html(400, "Bad request", "<p>missing id</p>");
        };
        // The criteria of the list the letter was opened from: the answer
        // leads back to that list.
        let list = match PageFilter::read(form, SystemTime::now()) {
            Ok(f) => f,
            Err(e) => return html(400, "Bad filter", &format!("<p>{}</p>", escape(&e))),
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
                &ReplayOptions {
                    max_entry_bytes: Some(monitor.max_entry_bytes()),
                    ..ReplayOptions::default()
                },
                &mut |_, _| {},
            );
            match report {
                Ok(r) if !r.not_found.is_empty() => return not_found(&stream, id),
                Ok(r) => {
                    let message = format!(
                        "replayed {} (already processed: {}, failed: {}, not whole: {})",
                        r.replayed(),
                        r.already_processed(),
                        r.failed(),
                        r.incomplete()
                    );
                    let code = if r.incomplete() > 0 {
                        for item in &r.items {
                            if let Some(why) = &item.incomplete {
                                log::warn!("http: {stream}/{} not replayed: {why}", item.id);
                            }
                        }
                        "replay_incomplete".to_owned()
                    } else if r.failed() > 0 {
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
        let location = format!(
            "/dlq?stream={}{}&msg={code}",
            encode(&stream),
            list.query_params()
        );
        text(303, "text/plain", message + "\n").with_header("Location", location)
    }
}

impl Page {
    /// `POST /dlq/bulk` (admin token checked): without `confirm`, the page
    /// that shows the count and asks; with it (and the `upto` that page
    /// gave), the action starts on what that page counted.
    fn bulk_action(&self, monitor: &Monitor, stream: &str, form: &[(String, String)]) -> Response {
        let bad = |why: String| html(400, "Bad request", &format!("<p>{}</p>", escape(&why)));
        let Some(action) = param(form, "action").and_then(Action::parse) else {
            return bad("action must be replay or delete".into());
        };
        let filter = match PageFilter::read(form, SystemTime::now()) {
            Ok(f) => f,
            Err(e) => return bad(e),
        };
        let rate = match bulk::rate(form) {
            Ok(r) => r,
            Err(e) => return bad(e),
        };
        let Some(confirmed) = param(form, "confirm") else {
            return Bulk::confirm(monitor, stream, &filter, action, rate);
        };
        let Ok(confirmed) = confirmed.parse::<usize>() else {
            return bad(format!("confirm {confirmed:?} is not a count"));
        };
        // The newest dead letter the confirmation counted: nothing newer is
        // touched.
        let upto = match bulk::upto(form) {
            Ok(u) => u,
            Err(e) => return bad(e),
        };
        let confirmation = Confirmed {
            count: confirmed,
            upto,
        };
        if let Err(e) = self
            .bulk
            .start(monitor, stream, &filter, action, confirmation, rate)
        {
            return html(
                409,
                "Busy",
                &format!("<p class=\"msg\" id=\"msg\">{}</p>", escape(&e)),
            );
        }
        log::info!(
            "http: bulk {form_action} of up to {confirmed} on {stream} started",
            form_action = param(form, "action").unwrap_or("")
        );
        let location = format!(
            "/dlq?stream={}{}&msg=bulk_started&n={confirmed}",
            encode(stream),
            filter.query_params()
        );
        text(303, "text/plain", "started\n".into()).with_header("Location", location)
    }
}

/// The answer to a replay or delete of an id the dead-letter stream does
/// not hold.
pub(crate) fn not_found(stream: &str, id: &str) -> Response {
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
pub(crate) fn message(query: &[(String, String)]) -> Option<String> {
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
        "replay_incomplete" => "Not replayed: this letter does not hold the whole event (cut for size, or its entry deleted before it was read), and replayed it would be applied cut down; produce the event again in full, or delete the letter.".to_owned(),
        "deleted" => "Deleted the dead letter.".to_owned(),
        "delete_failed" => "The delete failed; the worker's log says why.".to_owned(),
        "bulk_started" => format!(
            "Started on {} dead letter(s), in the background; progress below.",
            number("n")
        ),
        _ => return None,
    })
}

pub(crate) fn stream_param<'a>(
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

pub(crate) fn redis(
    monitor: &Monitor,
) -> Result<crate::worker::monitor::Look<crate::redis::pool::PooledRedis>, Response> {
    monitor.redis_conn().map_err(|e| {
        let busy = e == crate::worker::monitor::BUSY;
        html(
            503,
            if busy { "Busy" } else { "Redis unavailable" },
            &format!("<p>Redis: {}</p>", escape(&e.to_string())),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
