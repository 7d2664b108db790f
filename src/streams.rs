//! The Redis Streams commands the threads use, in one place: create the group,
//! read new or pending entries, look up delivery counts, claim idle entries.
//!
//! Every read that can return many entries runs inside a Lua script that
//! cuts entries over `--max-entry-bytes` down to the names and first bytes
//! of their first fields before they leave Redis ([`BOUND`]): a producer's
//! 4 MiB entries cost this process a few hundred bytes each, however many
//! arrive. Only the blocking read a reader makes when its stream is idle
//! (one entry at most) can bring one entry whole; it is cut down at once.

use std::collections::HashMap;

use redis::RedisResult;

use crate::redis_conn::RedisConn;

use crate::event::{parse_entries, parse_read_reply, RawEntry, MOST_FIELDS, PREFIX};

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

/// A Lua function, `bound(entries)`, that cuts each entry larger than
/// ARGV[1] bytes down to the names and first ARGV[2] bytes of its first
/// ARGV[3] fields, in place, and appends what it cut: such an entry becomes
/// `{id, fields, bytes, field count, {value sizes}}`. Scripts that use it
/// take those three arguments first.
const BOUND: &str = r"
local function bound(entries)
    local max, keep, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
    for _, e in ipairs(entries) do
        local f = e[2]
        if type(f) == 'table' then
            local size = 0
            for i = 1, #f do size = size + #f[i] end
            if size > max then
                local cut, sizes = {}, {}
                for i = 1, math.min(#f, most * 2), 2 do
                    cut[#cut + 1] = string.sub(f[i], 1, keep)
                    cut[#cut + 1] = string.sub(f[i + 1], 1, keep)
                    sizes[#sizes + 1] = #f[i + 1]
                end
                e[2], e[3], e[4], e[5] = cut, size, #f / 2, sizes
            end
        end
    end
    return entries
end
";

/// A script call whose script starts with [`BOUND`], keeping [`PREFIX`]
/// bytes of each field of an entry over `max_entry_bytes`.
fn bounded(script: &str, key: &str, max_entry_bytes: usize) -> redis::Cmd {
    bounded_keeping(script, key, max_entry_bytes, PREFIX)
}

/// [`bounded`], keeping `keep` bytes of each field.
pub(crate) fn bounded_keeping(
    script: &str,
    key: &str,
    max_entry_bytes: usize,
    keep: usize,
) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(format!("{BOUND}{script}"))
        .arg(1)
        .arg(key)
        .arg(max_entry_bytes)
        .arg(keep)
        .arg(MOST_FIELDS);
    cmd
}

/// XREADGROUP (no BLOCK) of new (`>`) or pending entries, cut down by
/// [`BOUND`]. ARGV[4..]: group, consumer, count, from.
const READ_BOUNDED: &str = r"
local r = redis.call('XREADGROUP', 'GROUP', ARGV[4], ARGV[5], 'COUNT', ARGV[6],
    'STREAMS', KEYS[1], ARGV[7])
if not r then return {} end
return bound(r[1][2])
";

/// XREADGROUP of one stream without blocking, entries over
/// `max_entry_bytes` cut down in Redis: `from` is `>` for new entries or
/// an id for this consumer's pending entries after it.
#[allow(clippy::too_many_arguments)] // the command's own arguments
pub(crate) fn read_group_bounded(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    count: usize,
    from: &str,
    max_entry_bytes: usize,
) -> RedisResult<Vec<RawEntry>> {
    let mut cmd = bounded(READ_BOUNDED, stream, max_entry_bytes);
    cmd.arg(group).arg(consumer).arg(count).arg(from);
    let reply: redis::Value = cmd.query(conn)?;
    parse_entries(reply).map_err(protocol_error)
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
    /// and the entry (cut down if over the size limit), when asked for.
    Yes(Option<RawEntry>),
    /// Pending for this consumer, but deleted from the stream (a producer's
    /// MAXLEN): it cannot be refreshed (XCLAIM would drop it from the
    /// pending list). Idle for this many milliseconds.
    Trimmed { idle_ms: u64 },
    /// Claimed by another consumer, or no longer pending.
    Lost,
}

/// Checks that `id` is pending for `consumer` with delivery count `count`,
/// and if so resets its idle time (XCLAIM JUSTID, which keeps the count)
/// and returns the entry (cut down by [`BOUND`]) when asked for. KEYS:
/// stream. ARGV[4..]: group, entry id, consumer, delivery count, `fields` or
/// `check`.
const CLAIM_IF_OWNED: &str = r"
local p = redis.pcall('XPENDING', KEYS[1], ARGV[4], ARGV[5], ARGV[5], 1)
if type(p) ~= 'table' or #p == 0 or p[1][2] ~= ARGV[6]
    or p[1][4] ~= tonumber(ARGV[7]) then
    return {0}
end
local e = redis.call('XRANGE', KEYS[1], ARGV[5], ARGV[5])
if #e == 0 then return {2, p[1][3]} end
redis.call('XCLAIM', KEYS[1], ARGV[4], ARGV[6], 0, ARGV[5], 'JUSTID')
if ARGV[8] == 'fields' then return {1, bound(e)} end
return {1}
";

/// The [`CLAIM_IF_OWNED`] call for one entry.
pub(crate) fn claim_if_owned(
    stream: &str,
    group: &str,
    consumer: &str,
    id: &str,
    count: u64,
    fields: Option<usize>,
) -> redis::Cmd {
    let mut cmd = bounded(CLAIM_IF_OWNED, stream, fields.unwrap_or(usize::MAX));
    cmd.arg(group)
        .arg(id)
        .arg(consumer)
        .arg(count)
        .arg(if fields.is_some() { "fields" } else { "check" });
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
            let entries = parse_entries(parts.swap_remove(1)).map_err(protocol_error)?;
            Owned::Yes(entries.into_iter().next())
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

/// XAUTOCLAIM, its entries cut down by [`BOUND`]. ARGV[4..]: group,
/// consumer, min idle, start, count.
const AUTOCLAIM_BOUNDED: &str = r"
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
    'COUNT', ARGV[8])
r[2] = bound(r[2])
return r
";

/// XAUTOCLAIM: takes over up to `count` entries idle for at least
/// `min_idle_ms`, scanning from `start`; entries over `max_entry_bytes` cut
/// down in Redis.
#[allow(clippy::too_many_arguments)] // the command's own arguments
pub(crate) fn autoclaim(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    min_idle_ms: u64,
    start: &str,
    count: usize,
    max_entry_bytes: usize,
) -> RedisResult<Claimed> {
    let mut cmd = bounded(AUTOCLAIM_BOUNDED, stream, max_entry_bytes);
    cmd.arg(group)
        .arg(consumer)
        .arg(min_idle_ms)
        .arg(start)
        .arg(count);
    let reply: redis::Value = cmd.query(conn)?;
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
