//! Where a stream and its group stand: length, lag, pending, the entries
//! delivered more than once, dead letters, and each consumer. What
//! `taskhub status` prints and the `/` page of `--http` shows; a handful of
//! read-only commands on the stream's node.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::consumers::{list_consumers, ConsumerInfo};
use crate::error::{Error, ErrorKind};
use crate::redis::keys::dead_letter_stream;
use crate::redis::RedisConn;
use crate::tls::Tls;

/// At most this many pending entries are looked at to count the
/// redelivered ones (a healthy group holds far fewer).
const REDELIVERED_SCAN: usize = 10_000;

/// One stream as one consumer group sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupStatus {
    /// The stream.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// Entries in the stream (`XLEN`).
    pub length: u64,
    /// The id of the last entry added.
    pub last_id: String,
    /// Entries not yet delivered to the group; `None` when Redis cannot
    /// tell (after an `XDEL` or a trim in the undelivered part).
    pub lag: Option<u64>,
    /// Entries delivered and not acknowledged, by any consumer.
    pub pending: u64,
    /// Age of the oldest pending entry (from its id's time); `None` when
    /// nothing is pending.
    pub oldest_pending: Option<Duration>,
    /// Pending entries delivered more than once: taken over from another
    /// consumer, or read again by their own after a restart or a crash.
    /// Counted over the first 10,000 pending entries. A retry keeps its
    /// delivery count: the retries an instance holds are its own to tell
    /// (`Monitor::retrying`, the overview page, `taskhub_retries_waiting`).
    pub redelivered: u64,
    /// Entries in the dead-letter stream: every group's letters, when
    /// several groups read the stream (see `other_groups`).
    pub dead_letters: u64,
    /// The other consumer groups of the stream, which share its dead-letter
    /// stream (`taskhub dlq --group` counts one group's letters).
    pub other_groups: Vec<String>,
    /// The group's consumers, by name.
    pub consumers: Vec<ConsumerInfo>,
}

/// The status of `group` on each of `streams`, asking Redis at `redis_url`
/// (with `tls` for `rediss://`). Fails, naming it, when a stream or the
/// group on it does not exist.
pub fn status(
    redis_url: &str,
    tls: &Tls,
    streams: &[String],
    group: &str,
) -> Result<Vec<GroupStatus>, Error> {
    crate::runtime::off_async(|| {
        let mut conn = crate::redis::connect(redis_url, tls)?;
        streams
            .iter()
            .map(|stream| group_status(&mut conn, stream, group, SystemTime::now()))
            .collect()
    })
}

type Map = HashMap<String, redis::Value>;

fn failed(what: String) -> impl FnOnce(redis::RedisError) -> Error {
    move |e| Error::with_source(ErrorKind::Redis, what, e)
}

fn int(map: &Map, key: &str) -> Option<u64> {
    match map.get(key) {
        Some(redis::Value::Int(n)) => u64::try_from(*n).ok(),
        _ => None,
    }
}

fn text(value: Option<&redis::Value>) -> String {
    match value {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        _ => String::new(),
    }
}

/// Milliseconds of an entry id (`1700000000000-0`).
fn id_millis(id: &str) -> Option<u64> {
    id.split('-').next()?.parse().ok()
}

/// The status of `group` on `stream` at `now`, over `conn`.
pub(crate) fn group_status(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    now: SystemTime,
) -> Result<GroupStatus, Error> {
    let exists: bool = redis::cmd("EXISTS")
        .arg(stream)
        .query(conn)
        .map_err(failed(format!("{stream}: cannot read the stream")))?;
    if !exists {
        return Err(Error::new(
            ErrorKind::Config,
            format!("stream {stream} does not exist"),
        ));
    }
    let info: Map = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query(conn)
        .map_err(failed(format!("{stream}: cannot read the stream")))?;
    let groups: Vec<Map> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(conn)
        .map_err(failed(format!("{stream}: cannot list its groups")))?;
    let Some(found) = groups.iter().find(|g| text(g.get("name")) == group) else {
        return Err(Error::new(
            ErrorKind::Config,
            format!("stream {stream} has no consumer group {group}"),
        ));
    };
    let pending = int(found, "pending").unwrap_or(0);
    let (redelivered, oldest) = if pending == 0 {
        (0, None)
    } else {
        scan_pending(conn, stream, group)?
    };
    let dead_letters: u64 = redis::cmd("XLEN")
        .arg(dead_letter_stream(stream))
        .query(conn)
        .map_err(failed(format!("{stream}: cannot read its dead letters")))?;
    Ok(GroupStatus {
        stream: stream.to_owned(),
        group: group.to_owned(),
        length: int(&info, "length").unwrap_or(0),
        last_id: text(info.get("last-generated-id")),
        lag: int(found, "lag"),
        pending,
        oldest_pending: oldest.as_deref().and_then(|id| age(id, now)),
        redelivered,
        dead_letters,
        other_groups: groups
            .iter()
            .map(|g| text(g.get("name")))
            .filter(|name| name != group)
            .collect(),
        consumers: list_consumers(conn, stream, group)?,
    })
}

/// The group-wide gauges of `/metrics`, cheaper than a whole status: one
/// `XINFO GROUPS`, one `XPENDING` summary, one `XLEN`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Gauges {
    pub pending: u64,
    pub lag: Option<u64>,
    pub dead_letters: u64,
    pub oldest_pending: Option<Duration>,
}

/// The [`Gauges`] of `group` on `stream` at `now`; `None` when the group is
/// missing.
pub(crate) fn gauges(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    now: SystemTime,
) -> Result<Option<Gauges>, Error> {
    let groups: Vec<Map> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(conn)
        .map_err(failed(format!("{stream}: cannot list its groups")))?;
    let Some(found) = groups.iter().find(|g| text(g.get("name")) == group) else {
        return Ok(None);
    };
    // count, oldest id, newest id, per consumer
    let (_, oldest, _, _): (u64, Option<String>, Option<String>, redis::Value) =
        redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .query(conn)
            .map_err(failed(format!("{stream}: cannot read the pending entries")))?;
    let dead_letters: u64 = redis::cmd("XLEN")
        .arg(dead_letter_stream(stream))
        .query(conn)
        .map_err(failed(format!("{stream}: cannot read its dead letters")))?;
    Ok(Some(Gauges {
        pending: int(found, "pending").unwrap_or(0),
        lag: int(found, "lag"),
        dead_letters,
        oldest_pending: oldest.as_deref().and_then(|id| age(id, now)),
    }))
}

/// How old entry `id` is at `now`, from the time in its id.
fn age(id: &str, now: SystemTime) -> Option<Duration> {
    let now_ms = now.duration_since(UNIX_EPOCH).ok()?.as_millis() as u64;
    Some(Duration::from_millis(now_ms.saturating_sub(id_millis(id)?)))
}

/// Counts the pending entries delivered more than once (over the first
/// [`REDELIVERED_SCAN`]), and returns the oldest pending id.
fn scan_pending(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
) -> Result<(u64, Option<String>), Error> {
    const PAGE: usize = 1000;
    let mut redelivered = 0;
    let mut oldest = None;
    let mut start = "-".to_owned();
    let mut seen = 0;
    while seen < REDELIVERED_SCAN {
        // (id, consumer, idle ms, deliveries)
        let page: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .arg(&start)
            .arg("+")
            .arg(PAGE)
            .query(conn)
            .map_err(failed(format!("{stream}: cannot list the pending entries")))?;
        if oldest.is_none() {
            oldest = page.first().map(|p| p.0.clone());
        }
        seen += page.len();
        redelivered += page.iter().filter(|p| p.3 > 1).count() as u64;
        match page.last() {
            Some(last) if page.len() == PAGE => start = format!("({}", last.0),
            _ => break,
        }
    }
    Ok((redelivered, oldest))
}
