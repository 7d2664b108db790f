//! Dead-letter alerts: [`Alerts`] starts the `taskhub-alert` thread beside a
//! worker.
//!
//! Every `interval` it looks at each dead-letter stream. When one becomes
//! non-empty, grows, or its oldest entry passes `age`, it logs one error
//! line with the count and the latest reason and, with a webhook, POSTs a
//! JSON document about it. Webhook calls are rate-limited per stream
//! (`min_gap`; changes in between are folded into the next call) and
//! retried, all on this thread, so alerting never slows event processing.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use std::thread::JoinHandle;

use crate::dlq::{dead_letter_stream, millis, DeadLetter};
use crate::error::{Error, ErrorKind};
use crate::event::parse_entries;
use crate::tls::Tls;
use crate::worker::monitor::Monitor;

/// Dead-letter alerts for one worker: log lines, and JSON posts to a
/// webhook if one is given.
///
/// ```no_run
/// # fn main() -> Result<(), taskhub::Error> {
/// # let worker = taskhub::Worker::builder().build(taskhub::SqlHandler::new(taskhub::DEFAULT_STATEMENT))?;
/// let alerts = taskhub::Alerts::new()
///     .webhook("https://hooks.example.com/T000/B000/XXXX")
///     .start(&worker.monitor())?;
/// worker.run()?; // the alert thread stops with the worker
/// alerts.join().ok();
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Alerts {
    webhook: Option<String>,
    tls: Tls,
    interval: Duration,
    age: Duration,
    min_gap: Duration,
}

impl std::fmt::Debug for Alerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alerts")
            .field(
                "webhook",
                &self.webhook.as_deref().map(crate::redact::redact_webhook),
            )
            .field("tls", &self.tls)
            .field("interval", &self.interval)
            .field("age", &self.age)
            .field("min_gap", &self.min_gap)
            .finish()
    }
}

impl Default for Alerts {
    fn default() -> Alerts {
        Alerts::new()
    }
}

impl Alerts {
    /// Logging only, every 10 s; an age alert after 1 h.
    pub fn new() -> Alerts {
        Alerts {
            webhook: None,
            tls: Tls::default(),
            interval: Duration::from_secs(10),
            age: Duration::from_secs(3600),
            min_gap: Duration::from_secs(60),
        }
    }

    /// POST a JSON alert to this URL too (only its scheme, host and port
    /// are ever shown: the rest often carries a secret).
    pub fn webhook(mut self, url: &str) -> Alerts {
        self.webhook = Some(url.to_owned());
        self
    }

    /// The CA and client certificate for an `https://` webhook.
    pub fn tls(mut self, tls: Tls) -> Alerts {
        self.tls = tls;
        self
    }

    /// How often the dead-letter streams are looked at. Defaults to 10 s.
    pub fn interval(mut self, interval: Duration) -> Alerts {
        self.interval = interval;
        self
    }

    /// Age of the oldest dead letter that raises an alert. Defaults to 1 h.
    pub fn age(mut self, age: Duration) -> Alerts {
        self.age = age;
        self
    }

    /// Least time between two webhook calls for one stream. Defaults to 1 min.
    pub fn min_gap(mut self, min_gap: Duration) -> Alerts {
        self.min_gap = min_gap;
        self
    }

    /// Starts the `taskhub-alert` thread; it stops when the monitor's
    /// worker shuts down. Fails when the interval is zero or the webhook's
    /// TLS files cannot be read.
    pub fn start(self, monitor: &Monitor) -> Result<JoinHandle<()>, Error> {
        if self.interval.is_zero() {
            return Err(Error::new(
                ErrorKind::Config,
                "the alert interval must be positive",
            ));
        }
        let agent = self.webhook_agent()?;
        let monitor = monitor.clone();
        std::thread::Builder::new()
            .name("taskhub-alert".into())
            .spawn(move || self.watch(&monitor, agent.as_ref()))
            .map_err(|e| {
                Error::with_source(ErrorKind::Thread, "cannot start thread taskhub-alert", e)
            })
    }
}

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

fn look(monitor: &Monitor, stream: &str) -> Result<Look, String> {
    let dlq = dead_letter_stream(stream);
    let mut conn = monitor.redis_conn()?;
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
        .query(&mut *conn)
        .map_err(|e| e.to_string())?;
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

impl Alerts {
    /// The HTTP client of the webhook, made at start-up so that a TLS file
    /// that cannot be read is a start-up error; `None` without a webhook.
    fn webhook_agent(&self) -> Result<Option<ureq::Agent>, Error> {
        let Some(url) = &self.webhook else {
            return Ok(None);
        };
        let tls = crate::tls::ureq_tls(url, &self.tls)?;
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
    fn watch(&self, monitor: &Monitor, agent: Option<&ureq::Agent>) {
        let shutdown = monitor.shutdown_handle();
        let mut states: HashMap<&str, State> = HashMap::new();
        loop {
            for stream in monitor.streams() {
                let state = states.entry(stream.as_str()).or_default();
                let found = match look(monitor, stream) {
                    Ok(found) => found,
                    Err(e) => {
                        log::debug!("alert: cannot read {}: {e}", dead_letter_stream(stream));
                        continue;
                    }
                };
                if let Some(change) = change(state, &found, self.age) {
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
                if let (Some(agent), Some(url)) = (agent, &self.webhook) {
                    let due = state.last_post.is_none_or(|t| t.elapsed() >= self.min_gap);
                    if let (true, Some((change, _))) = (due, state.unsent) {
                        let body = serde_json::json!({
                            "stream": stream,
                            "dead_letter_stream": dead_letter_stream(stream),
                            "group": monitor.group(),
                            "consumer": monitor.consumer(),
                            "change": change.as_str(),
                            "count": found.count,
                            "oldest_age_seconds": found.oldest_age.as_secs(),
                            "latest_reason": found.latest.as_ref().map(|l| l.reason.clone()),
                            "latest_kind": found.latest.as_ref().map(|l| l.kind.as_str()),
                            "latest_event_id": found.latest.as_ref().and_then(|l| l.event_id.clone()),
                        });
                        if post(&shutdown, agent, url, &body) {
                            state.unsent = None;
                        }
                        state.last_post = Some(Instant::now());
                    }
                }
            }
            if shutdown.sleep(self.interval) {
                return;
            }
        }
    }
}

/// POSTs `body`, three tries; true when the receiver answered 2xx.
fn post(
    shutdown: &crate::Shutdown,
    agent: &ureq::Agent,
    url: &str,
    body: &serde_json::Value,
) -> bool {
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
        if shutdown.sleep(Duration::from_secs(u64::from(attempt))) {
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
