//! The Redis Streams commands the threads use, in one place: create the group,
//! read new or pending entries, look up delivery counts, claim idle entries.

use std::collections::HashMap;

use redis::RedisResult;

use crate::redis_conn::RedisConn;

use crate::event::{parse_entries, parse_read_reply, Fields, RawEntry};

fn protocol_error(what: String) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Parse, "unexpected reply", what))
}

/// Creates `group` on `stream` (and the stream) at `start_id` unless it
/// exists.
pub(crate) fn ensure_group(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    start_id: &str,
) -> RedisResult<()> {
    let created: RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg(start_id)
        .arg("MKSTREAM")
        .query(conn);
    match created {
        Ok(()) => {
            log::info!("{stream}: created consumer group {group} at {start_id}");
            Ok(())
        }
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether an error means the group (or the stream) is gone.
pub(crate) fn is_nogroup(e: &redis::RedisError) -> bool {
    e.code() == Some("NOGROUP")
}

/// XREADGROUP of one stream: `from` is `>` for new entries (blocking up to
/// `block_ms`) or an id for this consumer's pending entries after it.
pub(crate) fn read_group(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    count: usize,
    block_ms: Option<u64>,
    from: &str,
) -> RedisResult<Vec<RawEntry>> {
    let mut cmd = redis::cmd("XREADGROUP");
    cmd.arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count);
    if let Some(ms) = block_ms {
        cmd.arg("BLOCK").arg(ms);
    }
    cmd.arg("STREAMS").arg(stream).arg(from);
    let reply: redis::Value = cmd.query(conn)?;
    let mut streams = parse_read_reply(reply).map_err(protocol_error)?;
    Ok(streams
        .pop()
        .map(|(_, entries)| entries)
        .unwrap_or_default())
}

/// Delivery counts of pending entries between `first` and `last`, owned by
/// `consumer`.
pub(crate) fn delivery_counts(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    first: &str,
    last: &str,
    count: usize,
) -> RedisResult<HashMap<String, u64>> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg(first)
        .arg(last)
        .arg(count)
        .arg(consumer)
        .query(conn)?;
    Ok(rows
        .into_iter()
        .map(|(id, _, _, times)| (id, times))
        .collect())
}

/// Who holds each of `ids` (consumer, delivery count), looked up one by one
/// in one pipelined round trip; `None` for an id that is not pending. (One
/// `XPENDING first last n consumer` over the ids' range would also return
/// the consumer's other pending entries in between, and push some of these
/// out of its `n` rows.)
pub(crate) fn owners(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    ids: &[&str],
) -> RedisResult<Vec<Option<(String, u64)>>> {
    let mut pipe = conn.pipe();
    for id in ids {
        pipe.cmd("XPENDING")
            .arg(stream)
            .arg(group)
            .arg(*id)
            .arg(*id)
            .arg(1);
    }
    let replies: Vec<Vec<(String, String, u64, u64)>> = pipe.query(conn)?;
    Ok(replies
        .into_iter()
        .map(|rows| {
            rows.into_iter()
                .next()
                .map(|(_, consumer, _, count)| (consumer, count))
        })
        .collect())
}

/// Whether an entry is still this consumer's, refreshed if so.
#[derive(Debug)]
pub(crate) enum Owned {
    /// Pending for this consumer with the count it holds it with; its idle
    /// time is reset to 0 (so no claim can take it for `reclaim_min_idle`),
    /// and its fields, when asked for.
    Yes(Option<Fields>),
    /// Pending for this consumer, but deleted from the stream (a producer's
    /// MAXLEN): it cannot be refreshed (XCLAIM would drop it from the
    /// pending list). Idle for this many milliseconds.
    Trimmed { idle_ms: u64 },
    /// Claimed by another consumer, or no longer pending.
    Lost,
}

/// Checks that `id` is pending for `consumer` with delivery count `count`,
/// and if so resets its idle time (XCLAIM JUSTID, which keeps the count)
/// and returns its fields when `fields` is set. KEYS: stream. ARGV: group,
/// entry id, consumer, delivery count, `fields` or `check`.
const CLAIM_IF_OWNED: &str = r"
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if type(p) ~= 'table' or #p == 0 or p[1][2] ~= ARGV[3]
    or p[1][4] ~= tonumber(ARGV[4]) then
    return {0}
end
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if #e == 0 then return {2, p[1][3]} end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
if ARGV[5] == 'fields' then return {1, e[1][2]} end
return {1}
";

/// The [`CLAIM_IF_OWNED`] call for one entry.
pub(crate) fn claim_if_owned(
    stream: &str,
    group: &str,
    consumer: &str,
    id: &str,
    count: u64,
    fields: bool,
) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CLAIM_IF_OWNED)
        .arg(1)
        .arg(stream)
        .arg(group)
        .arg(id)
        .arg(consumer)
        .arg(count)
        .arg(if fields { "fields" } else { "check" });
    cmd
}

/// Reads the reply of one [`claim_if_owned`] call.
pub(crate) fn parse_owned(reply: redis::Value) -> RedisResult<Owned> {
    let redis::Value::Array(mut parts) = reply else {
        return Err(protocol_error(format!("ownership check: {reply:?}")));
    };
    let status = match parts.first() {
        Some(redis::Value::Int(n)) => *n,
        other => return Err(protocol_error(format!("ownership check: {other:?}"))),
    };
    Ok(match status {
        1 if parts.len() > 1 => {
            let flat = parts.swap_remove(1);
            let fields = crate::event::parse_fields(flat).map_err(protocol_error)?;
            Owned::Yes(Some(fields))
        }
        1 => Owned::Yes(None),
        2 => Owned::Trimmed {
            idle_ms: match parts.get(1) {
                Some(redis::Value::Int(n)) => u64::try_from(*n).unwrap_or(0),
                _ => u64::MAX,
            },
        },
        _ => Owned::Lost,
    })
}

/// Number of entries pending in the group (all consumers).
pub(crate) fn pending_count(conn: &mut RedisConn, stream: &str, group: &str) -> RedisResult<u64> {
    let reply: redis::Value = redis::cmd("XPENDING").arg(stream).arg(group).query(conn)?;
    match reply {
        redis::Value::Array(items) => match items.into_iter().next() {
            Some(redis::Value::Int(n)) => Ok(u64::try_from(n).unwrap_or(0)),
            other => Err(protocol_error(format!("XPENDING summary {other:?}"))),
        },
        other => Err(protocol_error(format!("XPENDING summary {other:?}"))),
    }
}

/// The result of one XAUTOCLAIM call.
pub(crate) struct Claimed {
    pub next: String,
    pub entries: Vec<RawEntry>,
    pub deleted: Vec<String>,
}

/// XAUTOCLAIM: takes over up to `count` entries idle for at least
/// `min_idle_ms`, scanning from `start`.
pub(crate) fn autoclaim(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    min_idle_ms: u64,
    start: &str,
    count: usize,
) -> RedisResult<Claimed> {
    let reply: redis::Value = redis::cmd("XAUTOCLAIM")
        .arg(stream)
        .arg(group)
        .arg(consumer)
        .arg(min_idle_ms)
        .arg(start)
        .arg("COUNT")
        .arg(count)
        .query(conn)?;
    let redis::Value::Array(mut parts) = reply else {
        return Err(protocol_error("XAUTOCLAIM reply is not an array".into()));
    };
    if parts.len() < 2 {
        return Err(protocol_error("XAUTOCLAIM reply too short".into()));
    }
    // Redis 7 adds a third element: ids deleted while pending.
    let deleted = if parts.len() >= 3 {
        match parts.remove(2) {
            redis::Value::Array(ids) => ids
                .into_iter()
                .filter_map(crate::event::bytes)
                .filter_map(|b| String::from_utf8(b).ok())
                .collect(),
            _ => Vec::new(),
        }
    } else {
        Vec::new()
    };
    let entries = parse_entries(parts.remove(1)).map_err(protocol_error)?;
    let next = crate::event::bytes(parts.remove(0))
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| protocol_error("XAUTOCLAIM cursor".into()))?;
    Ok(Claimed {
        next,
        entries,
        deleted,
    })
}

/// XACK of `ids`.
pub(crate) fn ack(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    ids: &[&str],
) -> RedisResult<()> {
    if ids.is_empty() {
        return Ok(());
    }
    redis::cmd("XACK")
        .arg(stream)
        .arg(group)
        .arg(ids)
        .query(conn)
}
