//! The Redis Streams commands the threads use, in one place: create the group,
//! read new or pending entries, look up delivery counts, claim idle entries.
//!
//! Every read that can return many entries runs inside a Lua script that
//! cuts entries over `--max-entry-bytes` down to the names and first bytes
//! of their first fields before they leave Redis ([`BOUND`]): a producer's
//! 4 MiB entries cost this process a few hundred bytes each, however many
//! arrive. Only the blocking read a reader makes when its stream is idle
//! (one entry at most) can bring one entry whole; it is cut down at once.

use redis::RedisResult;

use crate::redis::RedisConn;

use crate::event::{parse_entries, parse_read_reply, Limits, RawEntry, MOST_FIELDS, PREFIX};

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
    bounded_on(script, &[key], max_entry_bytes, keep)
}

/// [`bounded_keeping`] of a script with several keys.
fn bounded_on(script: &str, keys: &[&str], max_entry_bytes: usize, keep: usize) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(format!("{BOUND}{script}"))
        .arg(keys.len())
        .arg(keys)
        .arg(max_entry_bytes)
        .arg(keep)
        .arg(MOST_FIELDS);
    cmd
}

/// XREADGROUP (no BLOCK) of new (`>`) or pending entries, cut down by
/// [`BOUND`], each entry's event id recorded in the in-flight ids KEYS[2]
/// in the same step (see `keys::in_flight_ids`; an event id over ARGV[8]
/// bytes is invalid and not recorded). ARGV[4..]: group, consumer, count,
/// from, the longest event id.
const READ_BOUNDED: &str = r"
local r = redis.call('XREADGROUP', 'GROUP', ARGV[4], ARGV[5], 'COUNT', ARGV[6],
    'STREAMS', KEYS[1], ARGV[7])
if not r then return {} end
local entries, ids, longest = r[1][2], {}, tonumber(ARGV[8])
for _, e in ipairs(entries) do
    local f = e[2]
    if type(f) == 'table' then
        for i = 1, #f - 1, 2 do
            if f[i] == 'event_id' then
                if #f[i + 1] <= longest then
                    ids[#ids + 1] = e[1]
                    ids[#ids + 1] = f[i + 1]
                end
                break
            end
        end
    end
    if #ids >= 1000 then
        redis.call('HSET', KEYS[2], unpack(ids))
        ids = {}
    end
end
if #ids > 0 then redis.call('HSET', KEYS[2], unpack(ids)) end
return bound(entries)
";

/// XREADGROUP of one stream without blocking, entries over
/// `max_entry_bytes` cut down in Redis, their event ids (up to
/// `max_event_id_bytes`) recorded in `in_flight` in the same step: `from`
/// is `>` for new entries or an id for this consumer's pending entries
/// after it.
#[allow(clippy::too_many_arguments)] // the command's own arguments
pub(crate) fn read_group_bounded(
    conn: &mut RedisConn,
    stream: &str,
    in_flight: &str,
    group: &str,
    consumer: &str,
    count: usize,
    from: &str,
    limits: Limits,
) -> RedisResult<Vec<RawEntry>> {
    let mut cmd = bounded_on(
        READ_BOUNDED,
        &[stream, in_flight],
        limits.max_entry_bytes,
        PREFIX,
    );
    cmd.arg(group)
        .arg(consumer)
        .arg(count)
        .arg(from)
        .arg(limits.max_event_id_bytes);
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

/// One row of XPENDING's extended form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PendingRow {
    pub id: String,
    pub consumer: String,
    pub idle_ms: u64,
    pub count: u64,
}

/// Up to `count` pending entries of the group after `after` (exclusive;
/// `-` for the start), idle for at least `min_idle_ms`, of `consumer` only
/// when given. XPENDING changes nothing: no count is raised, no idle time
/// reset.
pub(crate) fn pending_rows(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    min_idle_ms: u64,
    after: &str,
    count: usize,
    consumer: Option<&str>,
) -> RedisResult<Vec<PendingRow>> {
    let start = if after == "-" {
        "-".to_owned()
    } else {
        format!("({after}")
    };
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(stream)
        .arg(group)
        .arg("IDLE")
        .arg(min_idle_ms)
        .arg(start)
        .arg("+")
        .arg(count);
    if let Some(consumer) = consumer {
        cmd.arg(consumer);
    }
    let rows: Vec<(String, String, u64, u64)> = cmd.query(conn)?;
    Ok(rows
        .into_iter()
        .map(|(id, consumer, idle_ms, count)| PendingRow {
            id,
            consumer,
            idle_ms,
            count,
        })
        .collect())
}

/// What one [`claim`] took.
#[derive(Debug, Default)]
pub(crate) struct Claimed {
    /// Entries now this consumer's, cut down by [`BOUND`], each with its
    /// delivery count.
    pub entries: Vec<(RawEntry, u64)>,
    /// Entries deleted from the stream while pending (and still idle):
    /// (id, the delivery count to fence their dead letter with, when this
    /// consumer owns them; `None` for another consumer's).
    pub deleted: Vec<(String, Option<u64>)>,
}

/// Claims the given pending entries for ARGV[5] if they are still idle for
/// ARGV[6] ms, cut down by [`BOUND`]; reports those deleted from the stream
/// (XCLAIM would silently drop them from the pending list, so they are
/// left pending: their `trimmed` dead letter acks them). ARGV[4..]: group,
/// consumer, min idle, then the ids. Returns `{entries, deleted ids}`.
const CLAIM: &str = r"
local claimed, deleted = {}, {}
for i = 7, #ARGV do
    local id = ARGV[i]
    if #redis.call('XRANGE', KEYS[1], id, id) == 0 then
        local p = redis.call('XPENDING', KEYS[1], ARGV[4], 'IDLE', ARGV[6], id, id, 1)
        if #p > 0 then deleted[#deleted + 1] = id end
    else
        local c = redis.call('XCLAIM', KEYS[1], ARGV[4], ARGV[5], ARGV[6], id)
        if #c > 0 then claimed[#claimed + 1] = c[1] end
    end
end
return {bound(claimed), deleted}
";

/// Claims `rows` (found by [`pending_rows`]) for `consumer` if each is still
/// idle for `min_idle_ms` (0: this consumer's own, re-read after a restart),
/// entries over `max_entry_bytes` cut down in Redis. A claim raises an
/// entry's delivery count by one, so each count is known without asking.
/// Entries that someone touched since `rows` was read are not taken.
#[allow(clippy::too_many_arguments)] // the command's own arguments
pub(crate) fn claim(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    min_idle_ms: u64,
    rows: &[PendingRow],
    max_entry_bytes: usize,
) -> RedisResult<Claimed> {
    if rows.is_empty() {
        return Ok(Claimed::default());
    }
    let mut cmd = bounded(CLAIM, stream, max_entry_bytes);
    cmd.arg(group).arg(consumer).arg(min_idle_ms);
    for row in rows {
        cmd.arg(&row.id);
    }
    let reply: redis::Value = cmd.query(conn)?;
    let redis::Value::Array(mut parts) = reply else {
        return Err(protocol_error("claim reply is not an array".into()));
    };
    if parts.len() != 2 {
        return Err(protocol_error("claim reply has not two parts".into()));
    }
    let deleted_ids: Vec<String> = match parts.pop() {
        Some(redis::Value::Array(ids)) => ids
            .into_iter()
            .filter_map(crate::event::bytes)
            .filter_map(|b| String::from_utf8(b).ok())
            .collect(),
        _ => Vec::new(),
    };
    let entries =
        parse_entries(parts.pop().unwrap_or(redis::Value::Nil)).map_err(protocol_error)?;
    let row_of = |id: &str| rows.iter().find(|r| r.id == id);
    Ok(Claimed {
        entries: entries
            .into_iter()
            .map(|e| {
                let count = row_of(&e.id).map_or(1, |r| r.count + 1);
                (e, count)
            })
            .collect(),
        deleted: deleted_ids
            .into_iter()
            .map(|id| {
                let fence = row_of(&id)
                    .filter(|r| r.consumer == consumer)
                    .map(|r| r.count);
                (id, fence)
            })
            .collect(),
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

#[cfg(test)]
mod tests {
    //! Against the Redis at `TASKHUB_TEST_REDIS_URL` (default
    //! `redis://127.0.0.1:6379`), like the integration tests.

    use super::*;

    fn conn() -> RedisConn {
        let url = std::env::var("TASKHUB_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        crate::redis::connect(&url, &crate::Tls::default()).expect("the test Redis answers")
    }

    fn cmd(conn: &mut RedisConn, args: &[&str]) -> redis::Value {
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(conn).unwrap()
    }

    #[test]
    fn claimed_entries_get_their_own_delivery_counts() {
        // The claimer's own pending entries sit between the claimed ones.
        // One `XPENDING first last n claimer` over the claimed range (as
        // the reclaimer used to look counts up) returned them too, so the
        // last claimed ids fell off and counted 1: they ran batched, with a
        // fresh attempt budget, past the crash-loop check.
        let mut c = conn();
        let stream = format!("claim-counts-{}", uuid::Uuid::new_v4());
        cmd(&mut c, &["XGROUP", "CREATE", &stream, "g", "0", "MKSTREAM"]);
        let add = |c: &mut RedisConn| -> String {
            redis::cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("event_id")
                .arg("e")
                .query(c)
                .unwrap()
        };
        let dead = add(&mut c);
        let own: Vec<String> = (0..3).map(|_| add(&mut c)).collect();
        let dead_too = add(&mut c);
        let gone = add(&mut c);
        for (consumer, n) in [("dead", "1"), ("claimer", "3"), ("dead", "2")] {
            cmd(
                &mut c,
                &[
                    "XREADGROUP",
                    "GROUP",
                    "g",
                    consumer,
                    "COUNT",
                    n,
                    "STREAMS",
                    &stream,
                    ">",
                ],
            );
        }
        // The dead consumer's entries were delivered several times.
        for _ in 0..4 {
            cmd(
                &mut c,
                &["XCLAIM", &stream, "g", "dead", "0", &dead, &dead_too, &gone],
            );
        }
        cmd(&mut c, &["XDEL", &stream, &gone]);
        std::thread::sleep(std::time::Duration::from_millis(30));
        // Only the dead consumer's entries are idle enough.
        let mut own_ids = vec!["XCLAIM", &stream, "g", "claimer", "0"];
        own_ids.extend(own.iter().map(String::as_str));
        own_ids.push("JUSTID");
        cmd(&mut c, &own_ids);
        let rows = pending_rows(&mut c, &stream, "g", 20, "-", 10, None).unwrap();
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, [dead.as_str(), dead_too.as_str(), gone.as_str()]);
        let claimed = claim(&mut c, &stream, "g", "claimer", 20, &rows, 1 << 20).unwrap();
        let got: Vec<(&str, u64)> = claimed
            .entries
            .iter()
            .map(|(e, n)| (e.id.as_str(), *n))
            .collect();
        // 1 read + 4 XCLAIMs + this claim.
        assert_eq!(got, [(dead.as_str(), 6), (dead_too.as_str(), 6)]);
        // The deleted one is reported (not the claimer's: no fence), and
        // left pending for its dead letter to ack.
        assert_eq!(claimed.deleted, [(gone.clone(), None)]);
        let still = pending_rows(&mut c, &stream, "g", 0, "-", 10, Some("dead")).unwrap();
        assert_eq!(still.len(), 1);
        // Nothing of this consumer's own is touched by listing it.
        let mine = pending_rows(&mut c, &stream, "g", 0, "-", 10, Some("claimer")).unwrap();
        assert!(mine
            .iter()
            .filter(|r| own.contains(&r.id))
            .all(|r| r.count == 1));
        cmd(&mut c, &["DEL", &stream]);
    }
}
