//! Dead-letter alerts: [`Alerts`] starts the `taskhub-alert` thread beside a
//! worker.
//!
//! Every `interval` it looks at the dead letters of its group on each
//! stream (groups reading one stream share its dead-letter stream; each
//! alerts on its own letters). When they become
//! non-empty, grow, or the oldest passes `age`, it logs one error
//! line with the count and the latest reason and, with a webhook, POSTs a
//! JSON document about it. Webhook calls are rate-limited per stream
//! (`min_gap`; changes in between are folded into the next call) and
//! retried, all on this thread, so alerting never slows event processing.

use std::time::{Duration, SystemTime};

use std::thread::JoinHandle;

use crate::dlq::{dead_letter_stream, millis, DeadLetter};
use crate::error::{Error, ErrorKind};
use crate::event::parse_entries;
use crate::redis::RedisConn;
use crate::tls::Tls;
use crate::worker::monitor::Monitor;

mod state;

use state::{change, Change, Lease, State};

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

/// What one look at a dead-letter stream found.
#[derive(Debug, Default, Clone)]
pub(crate) struct Look {
    pub count: u64,
    pub oldest_age: Duration,
    pub latest: Option<DeadLetter>,
}

/// How far the count of one group's letters reads, in a dead-letter stream
/// that several groups share, per look: past it, the newest are counted.
const SHARED_BUDGET: (usize, Duration) = (10_000, Duration::from_secs(1));

/// Looks at the dead letters of `group` on `stream`: when `group` is the
/// stream's only group (the usual case), the whole dead-letter stream is
/// its, and three commands tell; when other groups read the stream too,
/// its letters are counted among the newest [`SHARED_BUDGET`].
fn look(conn: &mut RedisConn, stream: &str, group: &str) -> Result<Look, crate::Error> {
    let shared = crate::redis::streams::group_names(conn, stream)
        .map_err(crate::dlq::redis_error(stream))?
        .iter()
        .any(|name| name != group.as_bytes());
    if !shared {
        return look_alone(conn, stream).map_err(crate::dlq::redis_error(stream));
    }
    let own = crate::dlq::Filter {
        group: Some(group.to_owned()),
        ..crate::dlq::Filter::default()
    };
    let stats = crate::dlq::stats_within(conn, stream, &own, Some(SHARED_BUDGET))?;
    let latest = if stats.count == 0 {
        None
    } else {
        let newest = crate::dlq::Filter {
            limit: Some(1),
            ..own
        };
        crate::dlq::list(conn, stream, &newest)?.letters.pop()
    };
    let now = millis(SystemTime::now());
    Ok(Look {
        count: stats.count,
        oldest_age: stats.oldest_dead_at.map_or(Duration::ZERO, |t| {
            Duration::from_millis(now.saturating_sub(t))
        }),
        latest,
    })
}

/// [`look`] at a dead-letter stream that is one group's alone.
fn look_alone(conn: &mut RedisConn, stream: &str) -> redis::RedisResult<Look> {
    let dlq = dead_letter_stream(stream);
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
        .query(conn)?;
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
    /// Of all the instances of a group, only the lease holder looks and
    /// alerts; the others wait to take over.
    fn watch(&self, monitor: &Monitor, agent: Option<&ureq::Agent>) {
        let shutdown = monitor.shutdown_handle();
        let lease = Lease {
            holder: format!("{}/{}", monitor.consumer(), uuid::Uuid::new_v4().simple()),
            ttl: (self.interval * 3).max(Duration::from_secs(3)),
        };
        // Changes whose webhook call failed, to put back in the shared
        // state with the next look (whoever holds the lease then sends
        // them again).
        let mut undelivered: Vec<Due> = Vec::new();
        loop {
            // The looks at Redis hold one of the page's places; the webhook
            // calls come after it is given back: a slow receiver (three
            // tries of up to 5 s) must not halve what the page may use.
            let mut due = Vec::new();
            match monitor.redis_conn() {
                Ok(mut conn) => {
                    put_back(&mut conn, &mut undelivered);
                    for stream in monitor.streams() {
                        match self.round(&mut conn, &lease, monitor, stream, agent.is_some()) {
                            Ok(post) => due.extend(post),
                            Err(e) => log::debug!(
                                "alert: cannot look at {}: {e}",
                                dead_letter_stream(stream)
                            ),
                        }
                    }
                }
                // Redis down, or the page's requests hold every place.
                Err(e) => log::debug!("alert: no Redis connection this round ({e})"),
            }
            if let (Some(agent), Some(url)) = (agent, &self.webhook) {
                for due in due {
                    if !post(&shutdown, agent, url, &due.body) {
                        undelivered.push(due);
                    }
                }
            }
            if shutdown.sleep(self.interval) {
                break;
            }
        }
        if let Ok(mut conn) = monitor.redis_conn() {
            put_back(&mut conn, &mut undelivered);
            for stream in monitor.streams() {
                let _ = lease.release(&mut conn, stream, monitor.group());
            }
        }
    }

    /// One look at the dead letters of `stream`: an alert if something
    /// changed; the webhook call to make, if one is due (`webhook`: there is
    /// one). The call is recorded as made before it is: an instance taking
    /// over while it runs must not send it again.
    fn round(
        &self,
        conn: &mut RedisConn,
        lease: &Lease,
        monitor: &Monitor,
        stream: &str,
        webhook: bool,
    ) -> Result<Option<Due>, Box<dyn std::error::Error>> {
        let group = monitor.group();
        if !lease.hold(conn, stream, group)? {
            log::debug!("alert: {stream}: another instance holds the alert lease");
            return Ok(None);
        }
        let mut state = State::load(conn, stream, group)?;
        let found = look(conn, stream, group)?;
        if let Some(change) = change(&mut state, &found, self.age) {
            let (reason, kind) = found
                .latest
                .as_ref()
                .map_or(("?", "?"), |l| (l.reason.as_str(), l.kind.as_str()));
            log::error!(
                "{}: {} dead letters ({}) of group {group}; latest ({kind}): {reason}",
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
        let mut due = None;
        if !webhook {
            state.unsent = None;
        } else if let Some((change, _)) = state.unsent {
            let now = SystemTime::now();
            if state.may_post(now, self.min_gap) {
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
                    "latest_group": found.latest.as_ref().map(|l| l.group.clone()),
                });
                state.last_post = Some(millis(now));
                due = Some(Due {
                    stream: stream.to_owned(),
                    group: group.to_owned(),
                    body,
                    unsent: state.unsent.take(),
                });
            }
        }
        state.save(conn, stream, group)?;
        Ok(due)
    }
}

/// Puts the changes of webhook calls that were not delivered back in the
/// shared state, whoever holds the lease now, so that the next round sends
/// them again; those Redis refused stay in `undelivered` for the next try.
fn put_back(conn: &mut RedisConn, undelivered: &mut Vec<Due>) {
    undelivered.retain(|due| {
        let kept = State::load(conn, &due.stream, &due.group).and_then(|mut state| {
            state.unsent = state.unsent.or(due.unsent);
            state.save(conn, &due.stream, &due.group)
        });
        if let Err(e) = &kept {
            log::debug!(
                "alert: {}: undelivered change not put back yet ({e})",
                due.stream
            );
        }
        kept.is_err()
    });
}

/// A webhook call a round found due: the change it reports, to put back
/// if the call fails.
struct Due {
    stream: String,
    group: String,
    body: serde_json::Value,
    unsent: Option<(Change, u64)>,
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
    use std::net::TcpListener;

    /// A change whose webhook call failed goes back in the shared state even
    /// when another instance took the lease while the call ran (three
    /// tries take up to 21 s, longer than a lease at intervals under 7 s):
    /// the new holder sends it. (The first version of the change above put
    /// it back only while holding the lease, and the change was lost.)
    #[test]
    fn an_undelivered_change_goes_back_whoever_holds_the_lease() {
        let mut conn = crate::redis::streams::tests::conn();
        let stream = format!("alert-back-{}", uuid::Uuid::new_v4().simple());
        let other = Lease {
            holder: "another instance".into(),
            ttl: Duration::from_secs(30),
        };
        assert!(other.hold(&mut conn, &stream, "g").unwrap());
        // What the round saved before its call: the change taken out.
        let saved = State {
            count: Some(1),
            last_post: Some(millis(SystemTime::now())),
            ..State::default()
        };
        saved.save(&mut conn, &stream, "g").unwrap();
        let mut undelivered = vec![Due {
            stream: stream.clone(),
            group: "g".into(),
            body: serde_json::json!({}),
            unsent: Some((Change::NonEmpty, 0)),
        }];
        put_back(&mut conn, &mut undelivered);
        let state = State::load(&mut conn, &stream, "g").unwrap();
        let _: () = redis::cmd("DEL")
            .arg(state::lease_key(&stream, "g"))
            .arg(state::state_key(&stream, "g"))
            .query(&mut conn)
            .unwrap();
        assert!(undelivered.is_empty());
        assert_eq!(state.unsent, Some((Change::NonEmpty, 0)));
        assert_eq!(state.count, Some(1));
    }

    /// Regression: the alert thread made its webhook calls while it held
    /// one of the two places the page has at Redis, so a receiver that
    /// hung (three tries of up to 5 s each) left the page one place for up
    /// to 18 s. The calls now come after the look gave its place back.
    #[test]
    fn a_hanging_webhook_holds_no_place_of_the_page() {
        let (redis_url, pg_url) = (
            crate::redis::streams::tests::url(),
            crate::postgres::pool::test_url(),
        );
        let stream = format!("alert-hang-{}", uuid::Uuid::new_v4().simple());
        let mut conn = crate::redis::streams::tests::conn();
        // One dead letter: the stream is no longer empty, a call is due.
        let letter = DeadLetter::new(
            &stream,
            "1-0",
            crate::dlq::Kind::Permanent,
            "refused",
            vec![(b"event_id".to_vec(), b"e".to_vec())],
        );
        let mut add = redis::cmd("XADD");
        add.arg(dead_letter_stream(&stream)).arg("*");
        for (k, v) in letter.to_fields() {
            add.arg(k).arg(v);
        }
        let _: String = add.query(&mut conn).unwrap();
        // A receiver that takes the connection and never answers.
        let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook", receiver.local_addr().unwrap());
        let worker = crate::Worker::builder()
            .redis_url(&redis_url)
            .database_url(&pg_url)
            .stream(&stream)
            .group("g")
            .build(crate::SqlHandler::default())
            .unwrap();
        let monitor = worker.monitor();
        monitor.connect_for_test(&redis_url, &pg_url);
        let alerts = Alerts::new()
            .webhook(&url)
            .interval(Duration::from_millis(50))
            .start(&monitor)
            .unwrap();
        let (held, _) = receiver.accept().expect("the alert calls the webhook");
        // The call is under way (its first try waits up to 5 s).
        std::thread::sleep(Duration::from_millis(300));
        let free = monitor.free_redis_looks();
        worker.shutdown_handle().shutdown();
        drop((held, receiver));
        alerts.join().unwrap();
        let _: () = redis::cmd("DEL")
            .arg(dead_letter_stream(&stream))
            .arg(state::lease_key(&stream, "g"))
            .arg(state::state_key(&stream, "g"))
            .query(&mut conn)
            .unwrap();
        assert_eq!(
            free,
            crate::worker::monitor::LOOKS,
            "places free during the call"
        );
    }
}
