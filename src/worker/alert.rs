//! Dead-letter alerts: the `taskhub-alert` thread.
//!
//! Every `alert_interval` it looks at each dead-letter stream. When one
//! becomes non-empty, grows, or its oldest entry passes `alert_age`, it logs
//! one error line with the count and the latest reason and, with
//! `alert_webhook`, POSTs a JSON document about it. Webhook calls are
//! rate-limited per stream (`alert_min_gap`; changes in between are folded
//! into the next call) and retried, all on this thread, so alerting never
//! slows event processing.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use crate::config::Config;
use crate::dlq::{dead_letter_stream, millis, DeadLetter};
use crate::error::Error;
use crate::event::parse_entries;
use crate::worker::Shared;

/// What changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    NonEmpty,
    Grew,
    Old,
}

impl Change {
    fn as_str(self) -> &'static str {
        match self {
            Change::NonEmpty => "non_empty",
            Change::Grew => "grew",
            Change::Old => "old",
        }
    }
}

/// What one look at a dead-letter stream found.
#[derive(Debug, Default, Clone)]
struct Look {
    count: u64,
    oldest_age: Duration,
    latest: Option<DeadLetter>,
}

/// Alert state of one stream.
#[derive(Debug, Default)]
struct State {
    /// Count at the last look (`None` before the first).
    count: Option<u64>,
    /// Whether the age alert fired for the current oldest entry.
    old_alerted: bool,
    /// When the webhook was last called.
    last_post: Option<Instant>,
    /// A change not posted yet because of the rate limit.
    unsent: Option<(Change, u64)>,
}

fn look(shared: &Shared, stream: &str) -> redis::RedisResult<Look> {
    let dlq = dead_letter_stream(stream);
    let mut conn = shared.redis_conn()?;
    let (count, oldest, newest): (u64, redis::Value, redis::Value) = redis::pipe()
        .cmd("XLEN")
        .arg(&dlq)
        .cmd("XRANGE")
        .arg(&dlq)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .cmd("XREVRANGE")
        .arg(&dlq)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query(&mut *conn)?;
    let first = |v| {
        parse_entries(v)
            .ok()
            .and_then(|mut e| (!e.is_empty()).then(|| e.remove(0)))
    };
    let oldest_age = first(oldest)
        .and_then(|e| e.id.split('-').next().and_then(|ms| ms.parse::<u64>().ok()))
        .map_or(Duration::ZERO, |ms| {
            Duration::from_millis(millis(SystemTime::now()).saturating_sub(ms))
        });
    let latest = first(newest).and_then(|e| DeadLetter::from_fields(Some(e.id), &e.fields?).ok());
    Ok(Look {
        count,
        oldest_age,
        latest,
    })
}

/// Decides whether this look is an alert, and updates the state.
fn change(state: &mut State, look: &Look, age_limit: Duration) -> Option<Change> {
    let previous = state.count.replace(look.count);
    if look.oldest_age < age_limit {
        state.old_alerted = false;
    }
    if look.count == 0 {
        return None;
    }
    match previous {
        None | Some(0) => Some(Change::NonEmpty),
        Some(p) if look.count > p => Some(Change::Grew),
        _ if look.oldest_age >= age_limit && !state.old_alerted => {
            state.old_alerted = true;
            Some(Change::Old)
        }
        _ => None,
    }
}

/// The HTTP client of the webhook, made at start-up so that a TLS file
/// that cannot be read is a start-up error; `None` without a webhook.
pub(crate) fn webhook_agent(config: &Config) -> Result<Option<ureq::Agent>, Error> {
    let Some(url) = &config.alert_webhook else {
        return Ok(None);
    };
    let tls = crate::tls::ureq_tls(url, &config.http_tls)?;
    Ok(Some(
        ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(5)))
            .http_status_as_error(false)
            .tls_config(tls)
            .build()
            .into(),
    ))
}

/// The alert thread; `agent` posts to the webhook, if there is one.
pub(crate) fn alert_thread(shared: &Shared, agent: Option<&ureq::Agent>) {
    let config = &shared.config;
    let mut states: HashMap<&str, State> = HashMap::new();
    loop {
        for stream in &config.streams {
            let state = states.entry(stream.as_str()).or_default();
            let found = match look(shared, stream) {
                Ok(found) => found,
                Err(e) => {
                    log::debug!("alert: cannot read {}: {e}", dead_letter_stream(stream));
                    continue;
                }
            };
            if let Some(change) = change(state, &found, config.alert_age) {
                let (reason, kind) = found
                    .latest
                    .as_ref()
                    .map_or(("?", "?"), |l| (l.reason.as_str(), l.kind.as_str()));
                log::error!(
                    "{}: {} dead letters ({}); latest ({kind}): {reason}",
                    dead_letter_stream(stream),
                    found.count,
                    match change {
                        Change::NonEmpty => "no longer empty",
                        Change::Grew => "growing",
                        Change::Old => "oldest past the age limit",
                    }
                );
                let previous = state.unsent.map_or(found.count, |(_, p)| p);
                state.unsent = Some((change, previous));
            }
            if let (Some(agent), Some(url)) = (agent, &config.alert_webhook) {
                let due = state
                    .last_post
                    .is_none_or(|t| t.elapsed() >= config.alert_min_gap);
                if let (true, Some((change, _))) = (due, state.unsent) {
                    let body = serde_json::json!({
                        "stream": stream,
                        "dead_letter_stream": dead_letter_stream(stream),
                        "group": config.group,
                        "consumer": config.consumer,
                        "change": change.as_str(),
                        "count": found.count,
                        "oldest_age_seconds": found.oldest_age.as_secs(),
                        "latest_reason": found.latest.as_ref().map(|l| l.reason.clone()),
                        "latest_kind": found.latest.as_ref().map(|l| l.kind.as_str()),
                        "latest_event_id": found.latest.as_ref().and_then(|l| l.event_id.clone()),
                    });
                    if post(shared, agent, url, &body) {
                        state.unsent = None;
                    }
                    state.last_post = Some(Instant::now());
                }
            }
        }
        if shared.shutdown.sleep(config.alert_interval) {
            return;
        }
    }
}

/// POSTs `body`, three tries; true when the receiver answered 2xx.
fn post(shared: &Shared, agent: &ureq::Agent, url: &str, body: &serde_json::Value) -> bool {
    for attempt in 1..=3u32 {
        let sent = agent
            .post(url)
            .content_type("application/json")
            .send(body.to_string().as_bytes());
        match sent {
            Ok(r) if r.status().is_success() => return true,
            Ok(r) => log::warn!(
                "alert: webhook {} answered HTTP {} (try {attempt}/3)",
                crate::redact::redact_webhook(url),
                r.status()
            ),
            Err(e) => log::warn!(
                "alert: webhook {}: {} (try {attempt}/3)",
                crate::redact::redact_webhook(url),
                crate::redact::scrub(&e.to_string(), url)
            ),
        }
        if shared
            .shutdown
            .sleep(Duration::from_secs(u64::from(attempt)))
        {
            break;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look(count: u64, age_secs: u64) -> Look {
        Look {
            count,
            oldest_age: Duration::from_secs(age_secs),
            latest: None,
        }
    }

    #[test]
    fn fires_once_per_state_change() {
        let limit = Duration::from_secs(100);
        let mut s = State::default();
        assert_eq!(change(&mut s, &look(0, 0), limit), None);
        assert_eq!(change(&mut s, &look(2, 1), limit), Some(Change::NonEmpty));
        assert_eq!(change(&mut s, &look(2, 5), limit), None);
        assert_eq!(change(&mut s, &look(3, 6), limit), Some(Change::Grew));
        assert_eq!(change(&mut s, &look(3, 200), limit), Some(Change::Old));
        assert_eq!(change(&mut s, &look(3, 300), limit), None);
        assert_eq!(change(&mut s, &look(1, 10), limit), None); // archived some
        assert_eq!(change(&mut s, &look(0, 0), limit), None);
        assert_eq!(change(&mut s, &look(1, 0), limit), Some(Change::NonEmpty));
    }
}
