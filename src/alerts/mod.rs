//! Dead-letter alerts: [`Alerts`] starts the `taskhub-alert` thread beside a
//! worker.
//!
//! Every `interval` it looks at the dead letters of its group on each
//! stream (groups reading one stream share its dead-letter stream; each
//! alerts on its own letters). When they become
//! non-empty, grow, or the oldest passes `age`, it logs one error
//! line with the count and the latest reason and, with a webhook, POSTs a
//! JSON document about it. Webhook calls are rate-limited per stream and
//! group (`min_gap`; changes in between are folded into the next call) and
//! retried, all on this thread, so alerting never slows event processing.

use std::time::{Duration, Instant, SystemTime};

use std::thread::JoinHandle;

use crate::dlq::{dead_letter_stream, millis, DeadLetter};
use crate::error::{Error, ErrorKind};
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

/// Lua: the entries ever added to the stream `KEYS[1]` and its length (so
/// how many were deleted), without any entry (`XINFO STREAM` answers with
/// its first and last entries whole); `{0, 0}` when there is none; added
/// -1 where Redis does not say (before 7.0).
const STREAM_COUNTS: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local added, length = -1, 0
for i = 1, #info, 2 do
    if info[i] == 'entries-added' then added = info[i + 1] end
    if info[i] == 'length' then length = info[i + 1] end
end
return {added, length}
";

/// Lua: over at most `ARGV[3]` dead letters of `KEYS[1]` after id
/// `ARGV[2]` (exclusive; `-` from the start), those of group `ARGV[1]`:
/// `{count, earliest dead_at (0: none), newest id ('': none), last id
/// read ('': none), entries read}`. Only these numbers come back, not the
/// letters (which may be large). `false` when the entry `ARGV[2]` is not
/// there (the stream was deleted and made again since): count again.
const COUNT_OF_GROUP: &str = r"
if ARGV[2] ~= '-' and #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) == 0 then
    return false
end
local from = ARGV[2] == '-' and '-' or '(' .. ARGV[2]
local entries = redis.call('XRANGE', KEYS[1], from, '+', 'COUNT', ARGV[3])
local count, earliest, newest, last = 0, 0, '', ''
for _, e in ipairs(entries) do
    last = e[1]
    local f, group, dead_at = e[2], nil, nil
    for i = 1, #f, 2 do
        if f[i] == 'group' then group = f[i + 1] end
        if f[i] == 'dead_at' and string.match(f[i + 1], '^%d+$') then
            dead_at = tonumber(f[i + 1])
        end
        if group and dead_at then break end
    end
    if group == ARGV[1] then
        count = count + 1
        newest = e[1]
        if dead_at and (earliest == 0 or dead_at < earliest) then earliest = dead_at end
    end
end
return {count, earliest, newest, last, #entries}
";

/// Dead letters counted per [`COUNT_OF_GROUP`] call, at most; the chunk
/// doubles after a call quicker than `CHUNK_QUICK` and halves after one
/// slower than `CHUNK_SLOW`.
const COUNT_CHUNK: usize = 1000;
const CHUNK_QUICK: Duration = Duration::from_millis(5);
const CHUNK_SLOW: Duration = Duration::from_millis(20);

/// A group's letters in a dead-letter stream as last counted: while no
/// entry was deleted from the stream since, only the entries added after
/// `upto` are read (so a look costs the new letters, not all of them).
#[derive(Debug, Clone)]
pub(crate) struct Counted {
    /// Entries deleted from the dead-letter stream ever (added − length)
    /// when counted: when it changes, the count starts over.
    deleted: i64,
    /// Entries added to it ever: when it is lower, the stream was deleted
    /// and made again, and the count starts over.
    added: i64,
    /// The last entry read.
    upto: String,
    count: u64,
    earliest: Option<u64>,
    newest: String,
}

impl Counted {
    /// Nothing counted yet: the next look reads from the stream's start.
    fn from_start(deleted: i64, added: i64) -> Counted {
        Counted {
            deleted,
            added,
            upto: "-".to_owned(),
            count: 0,
            earliest: None,
            newest: String::new(),
        }
    }
}

/// Looks at the dead letters of `group` on `stream`, counting in Redis,
/// which sends back numbers only: exact and deterministic, so another
/// group's letters coming or going (several groups reading one stream
/// share its dead-letter stream; a group destroyed leaves its letters) are
/// no change of this group's. `counted` is the last count, gone on from.
fn look(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    counted: &mut Option<Counted>,
) -> Result<Look, crate::Error> {
    let redis_error = crate::dlq::redis_error(stream);
    let dlq = dead_letter_stream(stream);
    let (added, length): (i64, i64) = redis::cmd("EVAL")
        .arg(STREAM_COUNTS)
        .arg(1)
        .arg(&dlq)
        .query(conn)
        .map_err(&redis_error)?;
    let deleted = added - length;
    // A Redis that does not count the entries added (before 7.0) cannot
    // tell a delete: count from the start every time.
    let mut c = match counted.take() {
        Some(c) if added >= 0 && c.deleted == deleted && c.added <= added => Counted { added, ..c },
        _ => Counted::from_start(deleted, added),
    };
    // Redis copies every letter a call reads into the script, and serves
    // no one else meanwhile: the chunk starts small, grows while calls are
    // quick and shrinks while they are not (letters of a megabyte, one by
    // one).
    let mut chunk = 16;
    loop {
        let sent = Instant::now();
        let counted: Option<(u64, u64, String, String, usize)> = redis::cmd("EVAL")
            .arg(COUNT_OF_GROUP)
            .arg(1)
            .arg(&dlq)
            .arg(group)
            .arg(&c.upto)
            .arg(chunk)
            .query(conn)
            .map_err(&redis_error)?;
        let took = sent.elapsed();
        let Some((n, first, own, last, read)) = counted else {
            // Where the last count stopped is gone with nothing deleted:
            // the stream was made again. Count it again from its start.
            c = Counted::from_start(deleted, added);
            continue;
        };
        c.count += n;
        if first > 0 {
            c.earliest = Some(c.earliest.map_or(first, |e| e.min(first)));
        }
        if !own.is_empty() {
            c.newest = own;
        }
        if !last.is_empty() {
            c.upto = last;
        }
        if read < chunk {
            break;
        }
        if took < CHUNK_QUICK {
            chunk = (chunk * 2).min(COUNT_CHUNK);
        } else if took > CHUNK_SLOW {
            chunk = (chunk / 2).max(1);
        }
    }
    // A newest letter that cannot be read (of a newer version, say) still
    // counts, and is said; the alert goes without it.
    let latest = if c.newest.is_empty() {
        None
    } else {
        crate::dlq::show(conn, stream, &c.newest).unwrap_or_else(|e| {
            log::warn!("alert: {e}");
            None
        })
    };
    let now = millis(SystemTime::now());
    let look = Look {
        count: c.count,
        oldest_age: c.earliest.map_or(Duration::ZERO, |t| {
            Duration::from_millis(now.saturating_sub(t))
        }),
        latest,
    };
    *counted = Some(c);
    Ok(look)
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
        // Each stream's count of the group's letters, gone on from.
        let mut counts: std::collections::HashMap<String, Option<Counted>> =
            std::collections::HashMap::new();
        loop {
            // The looks at Redis hold one of the page's places; the webhook
            // calls come after it is given back: a slow receiver (three
            // tries of up to 5 s) must not halve what the page may use.
            let mut due = Vec::new();
            match monitor.redis_conn() {
                Ok(mut conn) => {
                    put_back(&mut conn, &mut undelivered);
                    for stream in monitor.streams() {
                        let counted = counts.entry(stream.to_string()).or_default();
                        match self.round(
                            &mut conn,
                            &lease,
                            monitor,
                            stream,
                            counted,
                            agent.is_some(),
                        ) {
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
        counted: &mut Option<Counted>,
        webhook: bool,
    ) -> Result<Option<Due>, Box<dyn std::error::Error>> {
        let group = monitor.group();
        if !lease.hold(conn, stream, group)? {
            log::debug!("alert: {stream}: another instance holds the alert lease");
            return Ok(None);
        }
        let mut state = State::load(conn, stream, group)?;
        let found = look(conn, stream, group, counted)?;
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

    /// The count of a group's letters goes on from the last one while no
    /// letter was deleted, and starts over when the stream was deleted and
    /// made again (its count of deletions is 0 again, as before): also when
    /// an entry of the new stream has the id where the last count stopped
    /// (both made in one millisecond, the first of it: seen in CI). Letters
    /// without a group or a time are counted for no group, and do not fail
    /// the count.
    #[test]
    fn a_groups_count_goes_on_and_starts_over_when_the_stream_is_made_again() {
        let mut conn = crate::redis::streams::tests::conn();
        let stream = format!("alert-count-{}", uuid::Uuid::new_v4().simple());
        let dlq = dead_letter_stream(&stream);
        let add = |conn: &mut RedisConn, id: &str, group: &str| {
            let mut letter = DeadLetter::new(
                &stream,
                "1-0",
                crate::dlq::Kind::Permanent,
                "refused",
                vec![(b"event_id".to_vec(), b"e".to_vec())],
            );
            letter.group = group.into();
            letter.dead_at = 1_000;
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&dlq).arg(id);
            for (k, v) in letter.to_fields() {
                cmd.arg(k).arg(v);
            }
            let _: String = cmd.query(conn).unwrap();
        };
        let mut counted = None;
        let mut count = |conn: &mut RedisConn| look(conn, &stream, "g", &mut counted).unwrap();
        add(&mut conn, "1-1", "g");
        add(&mut conn, "1-2", "other");
        let _: String = redis::cmd("XADD")
            .arg(&dlq)
            .arg("1-3")
            .arg("not")
            .arg("a letter")
            .query(&mut conn)
            .unwrap();
        add(&mut conn, "1-4", "g");
        let first = count(&mut conn);
        assert_eq!(first.count, 2);
        assert_eq!(first.latest.map(|l| l.group), Some("g".to_owned()));
        add(&mut conn, "1-5", "g");
        assert_eq!(count(&mut conn).count, 3, "went on");
        let _: () = redis::cmd("DEL").arg(&dlq).query(&mut conn).unwrap();
        add(&mut conn, "1-5", "g");
        assert_eq!(count(&mut conn).count, 1, "started over, the same id");
        let _: () = redis::cmd("DEL").arg(&dlq).query(&mut conn).unwrap();
        add(&mut conn, "2-0", "g");
        add(&mut conn, "2-1", "g");
        assert_eq!(count(&mut conn).count, 2, "started over, the place gone");
        // A time that is no number of ms (-1) does not hide the letters'
        // age; a newest letter that cannot be read (a kind of a newer
        // version) counts, and the look goes on without it.
        let _: String = redis::cmd("XADD")
            .arg(&dlq)
            .arg("2-2")
            .arg("group")
            .arg("g")
            .arg("dead_at")
            .arg("-1")
            .arg("kind")
            .arg("bogus")
            .query(&mut conn)
            .unwrap();
        let last = count(&mut conn);
        assert_eq!(last.count, 3);
        assert!(last.latest.is_none());
        assert!(
            last.oldest_age > Duration::from_secs(86_400),
            "{:?}",
            last.oldest_age
        );
        // First in a count of its own, that time came back as the earliest.
        let _: () = redis::cmd("DEL").arg(&dlq).query(&mut conn).unwrap();
        let _: String = redis::cmd("XADD")
            .arg(&dlq)
            .arg("3-0")
            .arg("group")
            .arg("g")
            .arg("dead_at")
            .arg("-1")
            .query(&mut conn)
            .unwrap();
        add(&mut conn, "3-1", "g");
        let bad_first = count(&mut conn);
        assert_eq!(bad_first.count, 2);
        assert!(
            bad_first.oldest_age > Duration::from_secs(86_400),
            "{:?}",
            bad_first.oldest_age
        );
        let _: () = redis::cmd("DEL").arg(&dlq).query(&mut conn).unwrap();
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
        let mut letter = DeadLetter::new(
            &stream,
            "1-0",
            crate::dlq::Kind::Permanent,
            "refused",
            vec![(b"event_id".to_vec(), b"e".to_vec())],
        );
        letter.group = "g".into();
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
