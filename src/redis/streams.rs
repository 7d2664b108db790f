//! The Redis Streams commands the threads use, in one place: create the group,
//! read new or pending entries, look up delivery counts, claim idle entries.
//!
//! Every read that can return many entries runs inside a Lua script that
//! cuts entries over `--max-entry-bytes` down to the names and first bytes
//! of their first fields before they leave Redis ([`BOUND`]): a producer's
//! 4 MiB entries cost this process a few hundred bytes each, however many
//! arrive. Only the blocking read a reader makes when its stream is idle
//! (one entry at most) can bring one entry whole; it is cut down at once.

use std::sync::Arc;

use redis::RedisResult;

use crate::redis::keys::DEAD_IN;
use crate::redis::script::Script;
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
        // XGROUP CREATE is refused whole on a full Redis (maxmemory under
        // noeviction), before the server looks for the group: a worker
        // restarted then failed to start, blaming a group that existed
        // (found by a hostile test). The group there, it starts; else the
        // error says what is wrong.
        Err(e) if e.code() == Some("OOM") => {
            let named = group_names(conn, stream)?;
            if named.iter().any(|g| g == group.as_bytes()) {
                Ok(())
            } else {
                Err(redis::RedisError::from((
                    redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                    "Redis is out of memory (maxmemory, with the noeviction policy) and refused to create the group",
                    e.to_string(),
                )))
            }
        }
        Err(e) => Err(e),
    }
}

/// Checks at start-up what every read and dead letter will need, so that a
/// mistake is one clear error instead of a loop of failed calls: the keys
/// taskhub keeps beside `stream` for `group` hold what it writes there (or
/// nothing yet), and the Redis user may run scripts. `Err` says what is
/// wrong and what to do.
pub(crate) fn check_keys(conn: &mut RedisConn, stream: &str, group: &str) -> Result<(), String> {
    use crate::redis::keys;
    let expected = [
        (
            keys::dead_letter_stream(stream),
            "stream",
            "its dead letters",
        ),
        (
            keys::dead_letter_index(stream, group),
            "hash",
            "its group's dead-letter index",
        ),
        (
            keys::dead_letter_index_of_all_groups(stream),
            "hash",
            "its old dead-letter index",
        ),
        (
            keys::in_flight_ids(stream, group),
            "hash",
            "its group's in-flight event ids",
        ),
    ];
    let mut pipe = conn.pipe();
    for (key, _, _) in &expected {
        pipe.cmd("TYPE").arg(key);
    }
    let types: Vec<String> = match pipe.query(conn) {
        Ok(types) => types,
        // TYPE is only this check's: a user that may not run it has the
        // keys' types left unchecked, not its start refused.
        Err(e) if e.code() == Some("NOPERM") => {
            log::warn!("redis: the types of the keys beside {stream} are not checked: the Redis user may not run TYPE ({e})");
            Vec::new()
        }
        Err(e) => return Err(access(&e)),
    };
    for ((key, want, what), found) in expected.iter().zip(types) {
        if found != "none" && &found != want {
            return Err(format!(
                "key {key} holds a {found}, where taskhub keeps {what} of stream {stream} (a {want}); rename or delete that key, or read another stream"
            ));
        }
    }
    // The keys taskhub keeps for every stream, `th:*`: the duplicate
    // markers and the start counts of redelivered entries (a user without
    // them passed this check, then left every redelivered entry pending
    // for ever, found by a hostile test). One of each form is asked for;
    // in a cluster they may be on other nodes, each asked on its own.
    for key in [
        keys::started(group, stream, "0-0"),
        keys::marker("0000000000000000", group, "probe"),
    ] {
        redis::cmd("EXISTS")
            .arg(&key)
            .query::<i64>(conn)
            .map_err(|e| {
                if e.code() == Some("NOPERM") {
                    format!("the Redis user may not use the keys th:* ({e}), where taskhub keeps its duplicate markers and the start counts of redelivered entries; allow them (~th:*) beside the stream's keys")
                } else {
                    access(&e)
                }
            })?;
    }
    // HSCAN is only the reclaimer's, which empties the dead-letter index of
    // entries gone from the stream every ten minutes: a user that may not
    // run it is told, not refused.
    if let Err(e) = redis::cmd("HSCAN")
        .arg(keys::dead_letter_index(stream, group))
        .arg(0)
        .arg("COUNT")
        .arg(1)
        .query::<redis::Value>(conn)
    {
        if e.code() == Some("NOPERM") {
            log::warn!("redis: the dead-letter index of {stream} will keep the entries gone from the stream: the Redis user may not run HSCAN ({e}); allow it to let it be emptied of them");
        } else {
            return Err(access(&e));
        }
    }
    // Scripts: EVAL, and EVALSHA (a script Redis does not know yet answers
    // NOSCRIPT, which proves the call was allowed).
    redis::cmd("EVAL")
        .arg("return 1")
        .arg(0)
        .query::<redis::Value>(conn)
        .map_err(|e| access(&e))?;
    match redis::cmd("EVALSHA")
        .arg("0000000000000000000000000000000000000000")
        .arg(0)
        .query::<redis::Value>(conn)
    {
        Err(e) if e.code() != Some("NOSCRIPT") => Err(access(&e)),
        _ => Ok(()),
    }
}

/// A refused start-up check, said for an operator.
fn access(e: &redis::RedisError) -> String {
    if e.code() == Some("NOPERM") {
        format!("the Redis user may not run what taskhub needs ({e}); allow it (on the stream's keys and the markers' th:*): XREADGROUP XACK XCLAIM XAUTOCLAIM XPENDING XADD XRANGE XREVRANGE XDEL XLEN XGROUP XINFO HSET HDEL HMGET HGETALL HSCAN GET MGET SET EXISTS EXPIRE DEL EVAL EVALSHA SCRIPT PING INFO (or +@all; see \"TLS and credentials\" under Deploying in the README)")
    } else {
        format!("checking the keys beside the stream: {e}")
    }
}

/// The names of the consumer groups of `stream` (none when there is no
/// such stream).
pub(crate) fn group_names(conn: &mut RedisConn, stream: &str) -> redis::RedisResult<Vec<Vec<u8>>> {
    let groups: redis::RedisResult<Vec<std::collections::HashMap<String, redis::Value>>> =
        redis::cmd("XINFO").arg("GROUPS").arg(stream).query(conn);
    match groups {
        Ok(groups) => Ok(groups
            .into_iter()
            .filter_map(|mut g| match g.remove("name") {
                Some(redis::Value::BulkString(name)) => Some(name),
                Some(redis::Value::SimpleString(name)) => Some(name.into_bytes()),
                _ => None,
            })
            .collect()),
        Err(e) if e.to_string().contains("no such key") => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Whether an error means the group (or the stream) is gone.
pub(crate) fn is_nogroup(e: &redis::RedisError) -> bool {
    e.code() == Some("NOGROUP")
}

/// A Lua function, `bound(entries)`, that cuts each entry larger than
/// ARGV[1] bytes (its names and values, and `FIELD_COST` bytes a field:
/// see `EntryFields::size`) down to the names and first ARGV[2] bytes of
/// its first ARGV[3] fields, in place, and appends what it cut: such an
/// entry becomes `{id, fields, bytes of names and values, field count,
/// {value sizes}}`. Scripts that use it take those three arguments first.
const BOUND: &str = r"
local function bound(entries)
    local max, keep, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
    for _, e in ipairs(entries) do
        local f = e[2]
        if type(f) == 'table' then
            local size = 0
            for i = 1, #f do size = size + #f[i] end
            if size + 16 * (#f / 2) > max then
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

/// The arguments of a script that starts with [`BOUND`]: its keys, then
/// what `bound` reads (see [`bounded_on`]).
fn bound_args(cmd: &mut redis::Cmd, keys: &[&str], max_entry_bytes: usize, keep: usize) {
    cmd.arg(keys.len())
        .arg(keys)
        .arg(max_entry_bytes)
        .arg(keep)
        .arg(MOST_FIELDS);
}

/// The read script ([`BOUND`] and [`READ_BOUNDED`]), called by its digest
/// (see `script.rs`): it runs on every read.
static READ: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(format!("{BOUND}{DEAD_IN}{READ_BOUNDED}")));

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
    cmd.arg(format!("{BOUND}{script}"));
    bound_args(&mut cmd, keys, max_entry_bytes, keep);
    cmd
}

/// XREADGROUP (no BLOCK) of new (`>`) or pending entries, cut down by
/// [`BOUND`], each entry's event id recorded in the in-flight ids KEYS[2]
/// in the same step (see `keys::in_flight_ids`; an event id over ARGV[8]
/// bytes is invalid and not recorded). ARGV[4..]: group, consumer, count
/// (`0`: read nothing), from, the longest event id, and the prefix of the
/// duplicate markers (`keys::marker` without the event id) or an empty
/// string; then (entry id, event id or empty) pairs of entries a blocking
/// read took just before (a script cannot block), which are recorded and
/// looked up first, as if this read had taken them, their idle time reset
/// (XCLAIM JUSTID to this consumer, which keeps the delivery count), so
/// that they count as read by this call; one that is no longer pending for
/// this consumer (claimed by another meanwhile) is left alone.
///
/// With a prefix, the script also answers the fast path's questions for
/// each entry (see `markers.rs`): a letter per entry, `d` when the group
/// dead-lettered it (its index KEYS[3], or the index of every group's
/// letters KEYS[4] with a letter in KEYS[5] of this group: see
/// `keys::DEAD_IN`), else `m` when its event's marker holds a
/// marker's value (`m:` and 16 hex digits; inside a script a reply cannot
/// belong to another command; a key of another type is no marker), else
/// `-`; one HMGET of the index and one MGET of the markers for up to 500
/// entries, where a call per entry and question took Redis about 0.3 µs
/// more per event (of ~12 µs in scripts) under a steady load; a marker the
/// user may not read is no marker. Markers are in other hash slots than the
/// stream, so on a cluster the prefix is empty and the fast path asks
/// apart.
///
/// The reply is `{entries, letters, kept}`, the entries packed with
/// MessagePack (see `packed.rs`: one string to parse instead of seven
/// values per entry), the letters (those of the blocking read's entries
/// first) empty without a prefix, and `kept` a `1` per blocking read's
/// entry still this consumer's, else `0`.
const READ_BOUNDED: &str = r"
local prefix, longest = ARGV[9], tonumber(ARGV[8])
local ids, read, events, named = {}, {}, {}, {}
-- `named`: the event id each entry names, whatever its length (for
-- `dead_in`, which compares it with its letter's).
local function note(id, event, names)
    if event then
        ids[#ids + 1] = id
        ids[#ids + 1] = event
        if #ids >= 1000 then
            redis.call('HSET', KEYS[2], unpack(ids))
            ids = {}
        end
    end
    read[#read + 1] = id
    events[#read] = event or false
    named[#read] = names or event or false
end
local kept = {}
for i = 10, #ARGV - 1, 2 do
    local p = redis.call('XPENDING', KEYS[1], ARGV[4], ARGV[i], ARGV[i], 1)
    if #p == 1 and p[1][2] == ARGV[5] then
        redis.call('XCLAIM', KEYS[1], ARGV[4], ARGV[5], 0, ARGV[i], 'JUSTID')
        local event = ARGV[i + 1]
        if event == '' then event = nil end
        note(ARGV[i], event)
        kept[#kept + 1] = '1'
    else
        kept[#kept + 1] = '0'
    end
end
local entries = {}
if ARGV[6] ~= '0' then
    local r = redis.call('XREADGROUP', 'GROUP', ARGV[4], ARGV[5], 'COUNT', ARGV[6],
        'STREAMS', KEYS[1], ARGV[7])
    if r then entries = r[1][2] end
end
for _, e in ipairs(entries) do
    local f, event, names = e[2], nil, nil
    if type(f) == 'table' then
        for i = 1, #f - 1, 2 do
            if f[i] == 'event_id' then
                names = f[i + 1]
                if #names <= longest then event = names end
                break
            end
        end
    end
    note(e[1], event, names)
end
if #ids > 0 then redis.call('HSET', KEYS[2], unpack(ids)) end
local seen = {}
if prefix ~= '' then
    for first = 1, #read, 500 do
        local last = math.min(first + 499, #read)
        local dead = dead_in(KEYS[3], KEYS[4], KEYS[5], ARGV[4], read, first, last, same_event(named))
        local markers, at = {}, {}
        for i = first, last do
            if events[i] then
                markers[#markers + 1] = prefix .. events[i]
                at[i] = #markers
            end
        end
        if #markers > 0 then
            -- An error (a key the ACL user may not read) is no marker.
            markers = redis.pcall('MGET', unpack(markers))
            if markers.err then markers = {} end
        end
        for i = first, last do
            local v = at[i] and markers[at[i]]
            if dead[i - first + 1] then
                seen[i] = 'd'
            elseif type(v) == 'string' and #v == 18 and string.sub(v, 1, 2) == 'm:' then
                seen[i] = 'm'
            else
                seen[i] = '-'
            end
        end
    end
end
return {cmsgpack.pack(bound(entries)), table.concat(seen), table.concat(kept)}
";

/// The keys [`read_group_bounded`] uses besides the stream.
pub(crate) struct ReadKeys<'a> {
    /// The in-flight ids (`keys::in_flight_ids`).
    pub in_flight: &'a str,
    /// The group's dead-letter index (`keys::dead_letter_index`).
    pub dead_index: &'a str,
    /// On one server once the marker namespace is known: the namespace
    /// and the markers' prefix in it (`keys::marker_prefix`); `None` on a
    /// cluster.
    pub markers: Option<(&'a Arc<str>, &'a str)>,
}

/// What the read script found for an entry (see [`READ_BOUNDED`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Its event has a duplicate marker in namespace `ns`.
    pub marked: bool,
    /// It is in the dead-letter index.
    pub dead: bool,
    /// The marker namespace it looked in: a marker of another database
    /// history says nothing (see `keys.rs`).
    pub ns: Arc<str>,
}

/// XREADGROUP of one stream without blocking, entries over
/// `max_entry_bytes` cut down in Redis, their event ids (up to
/// `max_event_id_bytes`) recorded in the in-flight ids in the same step:
/// `from` is `>` for new entries or an id for this consumer's pending
/// entries after it. With a markers' prefix, also what the fast path would
/// ask for each entry, in the same step.
///
/// `blocked`: entries a blocking [`read_group`] took just before; they are
/// recorded and looked up in the same step and returned first, followed by
/// up to `count` more.
#[allow(clippy::too_many_arguments)] // the command's own arguments
pub(crate) fn read_group_bounded(
    conn: &mut RedisConn,
    stream: &str,
    keys: &ReadKeys<'_>,
    (group, consumer): (&str, &str),
    count: usize,
    from: &str,
    limits: Limits,
    blocked: Vec<RawEntry>,
) -> RedisResult<Vec<RawEntry>> {
    let mut cmd = READ.cmd();
    let every_group = crate::redis::keys::dead_letter_index_of_all_groups(stream);
    let dlq = crate::redis::keys::dead_letter_stream(stream);
    bound_args(
        &mut cmd,
        &[stream, keys.in_flight, keys.dead_index, &every_group, &dlq],
        limits.max_entry_bytes,
        PREFIX,
    );
    cmd.arg(group)
        .arg(consumer)
        .arg(count)
        .arg(from)
        .arg(limits.max_event_id_bytes)
        .arg(keys.markers.map_or("", |(_, prefix)| prefix));
    for entry in &blocked {
        let event_id = event_id_of(entry, limits.max_event_id_bytes).unwrap_or_default();
        cmd.arg(&entry.id).arg(event_id);
    }
    let (packed, seen, kept) = match READ.query(&cmd, conn)? {
        redis::Value::Array(parts) if parts.len() == 3 => {
            let mut parts = parts.into_iter().map(crate::event::bytes);
            match (
                parts.next().flatten(),
                parts.next().flatten(),
                parts.next().flatten(),
            ) {
                (Some(packed), Some(letters), Some(kept)) if kept.len() == blocked.len() => {
                    (packed, letters, kept)
                }
                _ => return Err(protocol_error("read: not three strings".into())),
            }
        }
        other => return Err(protocol_error(format!("read: {other:?}"))),
    };
    let entries = crate::redis::packed::entries(&packed).map_err(protocol_error)?;
    // What the blocking read took and another consumer claimed meanwhile
    // is that consumer's.
    let mut entries = blocked
        .into_iter()
        .zip(kept)
        .filter_map(|(entry, kept)| (kept == b'1').then_some(entry))
        .chain(entries)
        .collect::<Vec<_>>();
    let Some((ns, _)) = keys.markers else {
        return Ok(entries);
    };
    if seen.len() != entries.len() {
        return Err(protocol_error(format!(
            "read: {} letters for {} entries",
            seen.len(),
            entries.len()
        )));
    }
    for (entry, letter) in entries.iter_mut().zip(seen) {
        entry.seen = Some(Seen {
            marked: letter == b'm',
            dead: letter == b'd',
            ns: ns.clone(),
        });
    }
    Ok(entries)
}

/// The event id of `entry` as the read script records it: its `event_id`
/// field, when it is at most `longest` bytes.
pub(crate) fn event_id_of(entry: &RawEntry, longest: usize) -> Option<&[u8]> {
    entry
        .fields
        .as_ref()?
        .value_of(b"event_id")
        .filter(|id| id.len() <= longest)
}

/// XREADGROUP of one stream: `from` is `>` for new entries (blocking up to
/// `block_ms`) or an id for this consumer's pending entries after it. The
/// entries come whole; one over `max_entry_bytes` is cut down as it is
/// read (see `EntryFields::from_pairs`).
#[allow(clippy::too_many_arguments)] // the command's own arguments, and the size limit
pub(crate) fn read_group(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    count: usize,
    block_ms: Option<u64>,
    from: &str,
    max_entry_bytes: usize,
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
    let mut streams = parse_read_reply(reply, max_entry_bytes).map_err(protocol_error)?;
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

/// For each (entry id, delivery count) pair from ARGV[7]: checks that the
/// entry is pending for consumer ARGV[5] of group ARGV[4] with that count,
/// and if so resets its idle time (XCLAIM JUSTID, which keeps the count)
/// and answers the entry (cut down by [`BOUND`]) when ARGV[6] is `fields`.
/// KEYS: stream. One reply per pair: `{0}` (not ours), `{2, idle ms}`
/// (deleted from the stream), `{1}` or `{1, entries}`, the entries packed
/// with MessagePack as the read script packs them (see `packed.rs`).
const CLAIM_IF_OWNED: &str = r"
local out = {}
for i = 7, #ARGV - 1, 2 do
    local id = ARGV[i]
    local p = redis.pcall('XPENDING', KEYS[1], ARGV[4], id, id, 1)
    if type(p) ~= 'table' or #p == 0 or p[1][2] ~= ARGV[5]
        or p[1][4] ~= tonumber(ARGV[i + 1]) then
        out[#out + 1] = {0}
    else
        local e = redis.call('XRANGE', KEYS[1], id, id)
        if #e == 0 then
            out[#out + 1] = {2, p[1][3]}
        else
            redis.call('XCLAIM', KEYS[1], ARGV[4], ARGV[5], 0, id, 'JUSTID')
            if ARGV[6] == 'fields' then
                out[#out + 1] = {1, cmsgpack.pack(bound(e))}
            else
                out[#out + 1] = {1}
            end
        end
    end
end
return out
";

/// One entry [`owned`] asks about.
pub(crate) struct Held<'a> {
    pub stream: &'a str,
    pub entry_id: &'a str,
    /// The delivery count it is held with (0 if unknown: never ours).
    pub count: u64,
}

/// Whether each of `held` is still `consumer`'s, refreshed if so (see
/// [`Owned`]), with its entry cut down to `fields` bytes when given: one
/// script call per stream, all in one pipelined round trip.
pub(crate) fn owned(
    conn: &mut RedisConn,
    group: &str,
    consumer: &str,
    held: &[Held<'_>],
    fields: Option<usize>,
) -> RedisResult<Vec<Owned>> {
    let mut streams: Vec<&str> = Vec::new();
    for h in held {
        if !streams.contains(&h.stream) {
            streams.push(h.stream);
        }
    }
    let mut pipe = conn.pipe();
    for stream in &streams {
        let mut cmd = bounded(CLAIM_IF_OWNED, stream, fields.unwrap_or(usize::MAX));
        cmd.arg(group)
            .arg(consumer)
            .arg(if fields.is_some() { "fields" } else { "check" });
        for h in held.iter().filter(|h| h.stream == *stream) {
            cmd.arg(h.entry_id).arg(h.count);
        }
        pipe.add_command(cmd);
    }
    let replies: Vec<redis::Value> = pipe.query(conn)?;
    let mut answers = Vec::with_capacity(streams.len());
    for (stream, reply) in streams.iter().zip(replies) {
        let want = held.iter().filter(|h| h.stream == *stream).count();
        match reply {
            redis::Value::Array(items) if items.len() == want => {
                answers.push(items.into_iter());
            }
            other => return Err(protocol_error(format!("ownership check: {other:?}"))),
        }
    }
    held.iter()
        .map(|h| {
            let at = streams.iter().position(|s| *s == h.stream).expect("listed");
            parse_owned(answers[at].next().expect("counted"))
        })
        .collect()
}

/// Reads the reply for one entry of a [`CLAIM_IF_OWNED`] call.
fn parse_owned(reply: redis::Value) -> RedisResult<Owned> {
    let redis::Value::Array(mut parts) = reply else {
        return Err(protocol_error(format!("ownership check: {reply:?}")));
    };
    let status = match parts.first() {
        Some(redis::Value::Int(n)) => *n,
        other => return Err(protocol_error(format!("ownership check: {other:?}"))),
    };
    Ok(match status {
        1 if parts.len() > 1 => {
            let redis::Value::BulkString(packed) = parts.swap_remove(1) else {
                return Err(protocol_error("ownership check: entries not packed".into()));
            };
            let entries = crate::redis::packed::entries(&packed).map_err(protocol_error)?;
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
    /// (id, the consumer they are pending for and its delivery count, which
    /// fence their dead letter: written only while that consumer still
    /// holds the entry with that count).
    pub deleted: Vec<(String, Holder)>,
}

/// The consumer an entry is pending for, with its delivery count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub consumer: String,
    pub count: u64,
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
    let entries = parse_entries(parts.pop().unwrap_or(redis::Value::Nil), max_entry_bytes)
        .map_err(protocol_error)?;
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
            .filter_map(|id| {
                let row = row_of(&id)?;
                let holder = Holder {
                    consumer: row.consumer.clone(),
                    count: row.count,
                };
                Some((id, holder))
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
pub(crate) mod tests {
    //! Against the Redis at `TASKHUB_TEST_REDIS_URL` (default
    //! `redis://127.0.0.1:6379`), like the integration tests.

    use super::*;
    use crate::event::EntryFields;

    /// The test Redis.
    pub(crate) fn url() -> String {
        std::env::var("TASKHUB_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    pub(crate) fn conn() -> RedisConn {
        crate::redis::connect(&url(), &crate::Tls::default()).expect("the test Redis answers")
    }

    pub(crate) fn cmd(conn: &mut RedisConn, args: &[&str]) -> redis::Value {
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
        // The deleted one is reported with its holder (whose letter it is
        // while it holds it), and left pending for its dead letter to ack.
        let holder = Holder {
            consumer: "dead".into(),
            count: 5,
        };
        assert_eq!(claimed.deleted, [(gone.clone(), holder)]);
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

    #[test]
    fn ownership_checks_of_two_streams_answer_each_entry_in_its_place() {
        // One script call per stream, the answers put back in the order
        // asked: an answer out of place would commit (or drop) the wrong
        // entry.
        let mut c = conn();
        let (a, b) = (
            format!("owned-a-{}", uuid::Uuid::new_v4()),
            format!("owned-b-{}", uuid::Uuid::new_v4()),
        );
        // Ids of their own in each stream, so an answer of the other
        // stream's entry shows.
        let mut ids = Vec::new();
        for (n, stream) in [(1, &a), (2, &b)] {
            cmd(&mut c, &["XGROUP", "CREATE", stream, "g", "0", "MKSTREAM"]);
            let mut add = |seq: u32| {
                let id = format!("{n}-{seq}");
                cmd(&mut c, &["XADD", stream, &id, "event_id", stream]);
                id
            };
            ids.push((add(1), add(2), add(3)));
            cmd(
                &mut c,
                &["XREADGROUP", "GROUP", "g", "me", "STREAMS", stream, ">"],
            );
        }
        // a: ours, another's, deleted; b: ours, held with another count,
        // ours.
        let ((a1, a2, a3), (b1, b2, b3)) = (ids[0].clone(), ids[1].clone());
        cmd(&mut c, &["XCLAIM", &a, "g", "other", "0", &a2, "JUSTID"]);
        cmd(&mut c, &["XDEL", &a, &a3]);
        let held = [
            Held {
                stream: &b,
                entry_id: &b1,
                count: 1,
            },
            Held {
                stream: &a,
                entry_id: &a1,
                count: 1,
            },
            Held {
                stream: &b,
                entry_id: &b2,
                count: 7,
            },
            Held {
                stream: &a,
                entry_id: &a2,
                count: 1,
            },
            Held {
                stream: &b,
                entry_id: &b3,
                count: 1,
            },
            Held {
                stream: &a,
                entry_id: &a3,
                count: 1,
            },
        ];
        let got: Vec<String> = owned(&mut c, "g", "me", &held, Some(1 << 20))
            .unwrap()
            .into_iter()
            .map(|o| match o {
                Owned::Yes(Some(e)) => format!("yes {}", e.id),
                Owned::Yes(None) => "yes".into(),
                Owned::Trimmed { .. } => "trimmed".into(),
                Owned::Lost => "lost".into(),
            })
            .collect();
        let want = [
            format!("yes {b1}"),
            format!("yes {a1}"),
            "lost".into(),
            "lost".into(),
            format!("yes {b3}"),
            "trimmed".into(),
        ];
        assert_eq!(got, want);
        cmd(&mut c, &["DEL", &a, &b]);
    }

    #[test]
    fn the_read_script_and_the_parser_count_an_entry_s_fields_alike() {
        // An entry of many empty fields: 9 bytes of names and values, but
        // 101 fields of 16 bytes each to hold. At its size it is whole on
        // both sides, a byte under it cut on both (the script counted the
        // bytes alone: a million empty fields were 0 bytes, and 16 MB here).
        use crate::event::{size_of, FIELD_COST};
        let mut c = conn();
        let s = format!("many-fields-{}", uuid::Uuid::new_v4());
        cmd(&mut c, &["XGROUP", "CREATE", &s, "g", "0", "MKSTREAM"]);
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&s).arg("1-1").arg("event_id").arg("a");
        let mut pairs = vec![(b"event_id".to_vec(), b"a".to_vec())];
        for _ in 0..100 {
            xadd.arg("").arg("");
            pairs.push((Vec::new(), Vec::new()));
        }
        xadd.query::<()>(&mut c).unwrap();
        cmd(
            &mut c,
            &["XREADGROUP", "GROUP", "g", "me", "STREAMS", &s, ">"],
        );
        let size = size_of(9, 101);
        assert_eq!(size, 9 + 101 * FIELD_COST);
        let held = [Held {
            stream: &s,
            entry_id: "1-1",
            count: 1,
        }];
        for (limit, cut) in [(size, false), (size - 1, true)] {
            let got = owned(&mut c, "g", "me", &held, Some(limit)).unwrap();
            let [Owned::Yes(Some(entry))] = &got[..] else {
                panic!("{got:?}")
            };
            assert_eq!(
                entry.cut.is_some(),
                cut,
                "the script, at a limit of {limit}"
            );
            let (fields, parsed) = EntryFields::from_pairs(&pairs, limit);
            assert_eq!(parsed.is_some(), cut, "the parser, at a limit of {limit}");
            assert_eq!(entry.cut, parsed);
            assert_eq!(entry.fields.as_ref(), Some(&fields));
        }
        cmd(&mut c, &["DEL", &s]);
    }

    #[test]
    fn an_entry_the_ownership_check_reads_back_is_whole_or_cut_as_a_read_s() {
        // Under the size limit its fields come back as written; over it,
        // cut down in Redis with what was cut, as the read script does.
        let mut c = conn();
        let s = format!("owned-fields-{}", uuid::Uuid::new_v4());
        cmd(&mut c, &["XGROUP", "CREATE", &s, "g", "0", "MKSTREAM"]);
        let big = "x".repeat(5000);
        cmd(
            &mut c,
            &["XADD", &s, "1-1", "event_id", "e-1", "payload", "{\"a\":1}"],
        );
        cmd(
            &mut c,
            &["XADD", &s, "1-2", "event_id", "e-2", "payload", &big],
        );
        // Bytes that are no UTF-8, NUL among them, come back as they were.
        let binary: &[u8] = b"\x00\xff\xfe\x80";
        redis::cmd("XADD")
            .arg(&s)
            .arg("1-3")
            .arg("event_id")
            .arg("e-3")
            .arg("raw")
            .arg(binary)
            .query::<()>(&mut c)
            .unwrap();
        cmd(
            &mut c,
            &["XREADGROUP", "GROUP", "g", "me", "STREAMS", &s, ">"],
        );
        let held = ["1-1", "1-2", "1-3"].map(|entry_id| Held {
            stream: &s,
            entry_id,
            count: 1,
        });
        let got = owned(&mut c, "g", "me", &held, Some(1000)).unwrap();
        let [Owned::Yes(Some(whole)), Owned::Yes(Some(cut)), Owned::Yes(Some(raw))] = &got[..]
        else {
            panic!("{got:?}")
        };
        let field = |name: &str, value: &[u8]| (name.as_bytes().to_vec(), value.to_vec());
        assert_eq!(whole.id, "1-1");
        assert_eq!(
            whole.fields.as_ref().map(EntryFields::to_vec).as_deref(),
            Some(&[field("event_id", b"e-1"), field("payload", b"{\"a\":1}")][..])
        );
        assert!(whole.cut.is_none());
        assert_eq!(cut.id, "1-2");
        let what = cut.cut.as_ref().expect("cut down");
        assert_eq!((what.bytes, what.fields), (8 + 3 + 7 + 5000, 2));
        assert_eq!(what.sizes, [3, 5000]);
        let fields = cut.fields.as_ref().expect("fields").to_vec();
        assert_eq!(fields[0], field("event_id", b"e-2"));
        assert_eq!(fields[1], field("payload", &big.as_bytes()[..PREFIX]));
        assert_eq!(
            raw.fields.as_ref().map(EntryFields::to_vec).as_deref(),
            Some(&[field("event_id", b"e-3"), field("raw", binary)][..])
        );
        cmd(&mut c, &["DEL", &s]);
    }

    /// Event ids up to 64 bytes, entries up to 1 MiB.
    const LIMITS: Limits = Limits {
        max_event_id_bytes: 64,
        max_entry_bytes: 1 << 20,
    };

    /// A new stream with group `g`, and the keys a read of it uses, with
    /// the markers of a new scope in namespace `00ff00ff00ff00ff`.
    struct ReadSetup {
        stream: String,
        scope: String,
        ns: Arc<str>,
        index: String,
        in_flight: String,
        prefix: String,
    }

    impl ReadSetup {
        fn new(c: &mut RedisConn, name: &str) -> ReadSetup {
            use crate::redis::keys::{dead_letter_index, in_flight_ids, marker_prefix};
            let stream = format!("{name}-{}", uuid::Uuid::new_v4());
            let scope = format!("scope-{}", uuid::Uuid::new_v4());
            let ns: Arc<str> = "00ff00ff00ff00ff".into();
            cmd(c, &["XGROUP", "CREATE", &stream, "g", "0", "MKSTREAM"]);
            ReadSetup {
                index: dead_letter_index(&stream, "g"),
                in_flight: in_flight_ids(&stream, "g"),
                prefix: marker_prefix(&ns, &scope),
                stream,
                scope,
                ns,
            }
        }

        fn keys(&self) -> ReadKeys<'_> {
            ReadKeys {
                in_flight: &self.in_flight,
                dead_index: &self.index,
                markers: Some((&self.ns, &self.prefix)),
            }
        }
    }

    #[test]
    fn the_read_script_looks_up_each_entrys_marker_and_dead_letter() {
        // One letter per entry, in the entries' order: a hit read for the
        // wrong entry would ack an event that was never applied.
        use crate::redis::keys::marker;
        let mut c = conn();
        let setup = ReadSetup::new(&mut c, "read-seen");
        let (stream, scope, ns) = (&setup.stream, &setup.scope, &setup.ns);
        let (index, in_flight, keys) = (&setup.index, &setup.in_flight, setup.keys());
        let mut ids = Vec::new();
        for fields in [
            vec!["event_id", "a"],
            vec!["event_id", "b"],
            vec!["event_id", "c"],
            vec!["payload", "no id"],
            vec!["event_id", "d"],
            vec!["event_id", "e"],
        ] {
            let mut add = redis::cmd("XADD");
            add.arg(stream).arg("*").arg(fields);
            ids.push(add.query::<String>(&mut c).unwrap());
        }
        let set = |c: &mut RedisConn, key: &str, value: &str| {
            cmd(c, &["SET", key, value, "EX", "60"]);
        };
        // b: a marker; c: an old `1`; e: a marker of another namespace;
        // d: in the dead-letter index (and marked: dead comes first).
        let b = marker(ns, scope, "b");
        set(&mut c, &b, &crate::redis::keys::marker_tag_text(&b));
        set(&mut c, &marker(ns, scope, "c"), "1");
        // a: a key of another type where its marker would be (a shared
        // Redis): no marker, and no error that would fail the whole read.
        cmd(&mut c, &["HSET", &marker(ns, scope, "a"), "x", "1"]);
        let d = marker(ns, scope, "d");
        set(&mut c, &d, &crate::redis::keys::marker_tag_text(&d));
        let e = marker("1111222233334444", scope, "e");
        set(&mut c, &e, &crate::redis::keys::marker_tag_text(&e));
        cmd(&mut c, &["HSET", index, &ids[4], "1-0"]);
        let read = |c: &mut RedisConn, keys: &ReadKeys<'_>, from: &str| {
            read_group_bounded(c, stream, keys, ("g", "me"), 100, from, LIMITS, Vec::new()).unwrap()
        };
        let entries = read(&mut c, &keys, ">");
        let got: Vec<(&str, bool, bool)> = entries
            .iter()
            .map(|e| {
                let seen = e.seen.as_ref().expect("looked up");
                assert_eq!(seen.ns, *ns);
                (e.id.as_str(), seen.marked, seen.dead)
            })
            .collect();
        let want: Vec<(&str, bool, bool)> = ids
            .iter()
            .map(String::as_str)
            .zip([
                (false, false),
                (true, false),
                (false, false),
                (false, false),
                (false, true),
                (false, false),
            ])
            .map(|(id, (m, d))| (id, m, d))
            .collect();
        assert_eq!(got, want);
        // Nothing new: an empty read, letters and all.
        assert!(read(&mut c, &keys, ">").is_empty());
        // Without a prefix (a cluster, or no namespace yet): no lookup.
        let keys = ReadKeys {
            markers: None,
            ..keys
        };
        let again = read(&mut c, &keys, "0");
        assert_eq!(again.len(), ids.len());
        assert!(again.iter().all(|e| e.seen.is_none()));
        let mut del = redis::cmd("DEL");
        del.arg(stream)
            .arg(index)
            .arg(in_flight)
            .arg(&b)
            .arg(&d)
            .arg(&e);
        del.arg(marker(ns, scope, "c"));
        del.query::<()>(&mut c).unwrap();
    }

    /// The lookups go 500 entries to a call: over several such chunks, and
    /// with entries without an event id between, each letter is still its
    /// own entry's.
    #[test]
    fn a_long_read_looks_each_entry_up_in_its_place() {
        use crate::redis::keys::{marker, marker_tag_text};
        let mut c = conn();
        let setup = ReadSetup::new(&mut c, "read-long");
        let (stream, scope, ns) = (&setup.stream, &setup.scope, &setup.ns);
        let mut pipe = redis::pipe();
        for i in 0..1203 {
            pipe.cmd("XADD").arg(stream).arg("*");
            match i % 13 {
                0 => pipe.arg("payload").arg("no id"),
                _ => pipe.arg("event_id").arg(format!("ev{i}")),
            };
        }
        let ids: Vec<String> = pipe.query(&mut c).unwrap();
        let mut want = Vec::new();
        let mut pipe = redis::pipe();
        for (i, id) in ids.iter().enumerate() {
            let dead = i % 11 == 0;
            let marked = i % 7 == 0 && i % 13 != 0;
            if dead {
                pipe.cmd("HSET").arg(&setup.index).arg(id).arg("1-0");
            }
            if marked {
                let key = marker(ns, scope, &format!("ev{i}"));
                pipe.cmd("SET")
                    .arg(&key)
                    .arg(marker_tag_text(&key))
                    .arg("EX")
                    .arg(60);
            }
            want.push((id.clone(), marked && !dead, dead));
        }
        pipe.query::<()>(&mut c).unwrap();
        let keys = setup.keys();
        let entries = read_group_bounded(
            &mut c,
            stream,
            &keys,
            ("g", "me"),
            2000,
            ">",
            LIMITS,
            Vec::new(),
        )
        .unwrap();
        let got: Vec<(String, bool, bool)> = entries
            .into_iter()
            .map(|e| {
                let seen = e.seen.expect("looked up");
                (e.id, seen.marked, seen.dead)
            })
            .collect();
        assert_eq!(got, want);
        let mut del = redis::cmd("DEL");
        del.arg(stream).arg(&setup.index).arg(&setup.in_flight);
        for i in (0..1203).filter(|i| i % 7 == 0) {
            del.arg(marker(ns, scope, &format!("ev{i}")));
        }
        del.query::<()>(&mut c).unwrap();
    }

    /// Regression (a review of the one MGET per read): an ACL user whose
    /// key patterns leave the markers out got an error for the whole read
    /// from the MGET, where the GET per entry it replaced counted an error
    /// as no marker. The entries come, unmarked.
    #[test]
    fn markers_the_user_may_not_read_are_no_markers() {
        use crate::redis::keys::{marker, marker_tag_text};
        let mut admin = conn();
        let setup = ReadSetup::new(&mut admin, "read-acl");
        let (stream, scope, ns) = (&setup.stream, &setup.scope, &setup.ns);
        let id: String = redis::cmd("XADD")
            .arg(stream)
            .arg("*")
            .arg("event_id")
            .arg("a")
            .query(&mut admin)
            .unwrap();
        let key = marker(ns, scope, "a");
        cmd(
            &mut admin,
            &["SET", &key, &marker_tag_text(&key), "EX", "60"],
        );
        // Its stream and the keys beside it, not the markers.
        let user = format!("taskhub-test-{}", uuid::Uuid::new_v4().simple());
        let pattern = format!("~{stream}*");
        cmd(
            &mut admin,
            &["ACL", "SETUSER", &user, "on", ">pw", &pattern, "+@all"],
        );
        let url = url().replacen("redis://", &format!("redis://{user}:pw@"), 1);
        let mut c = crate::redis::connect(&url, &crate::Tls::default()).unwrap();
        let keys = setup.keys();
        let read = read_group_bounded(
            &mut c,
            stream,
            &keys,
            ("g", "me"),
            10,
            ">",
            LIMITS,
            Vec::new(),
        );
        cmd(&mut admin, &["ACL", "DELUSER", &user]);
        let entries = read.unwrap();
        let got: Vec<(&str, bool)> = entries
            .iter()
            .map(|e| (e.id.as_str(), e.seen.as_ref().expect("looked up").marked))
            .collect();
        assert_eq!(got, [(id.as_str(), false)]);
        cmd(
            &mut admin,
            &["DEL", stream, &setup.index, &setup.in_flight, &key],
        );
    }

    /// What a blocking read took is recorded in the in-flight ids and
    /// looked up by the read that follows it, and comes first; a read with
    /// no room left (`count` 0) reads nothing more.
    #[test]
    fn a_read_after_a_blocking_read_records_and_looks_up_its_entry() {
        use crate::redis::keys::marker;
        let mut c = conn();
        let setup = ReadSetup::new(&mut c, "read-blocked");
        let (stream, scope, ns) = (&setup.stream, &setup.scope, &setup.ns);
        let (in_flight, keys) = (&setup.in_flight, setup.keys());
        let mut ids = Vec::new();
        for event in ["b", "x", "y"] {
            let mut add = redis::cmd("XADD");
            add.arg(stream).arg("*").arg("event_id").arg(event);
            ids.push(add.query::<String>(&mut c).unwrap());
        }
        let b = marker(ns, scope, "b");
        cmd(
            &mut c,
            &[
                "SET",
                &b,
                &crate::redis::keys::marker_tag_text(&b),
                "EX",
                "60",
            ],
        );
        let in_flight_of = |c: &mut RedisConn| -> Vec<(String, String)> {
            let mut all: Vec<(String, String)> = redis::cmd("HGETALL")
                .arg(in_flight)
                .query::<std::collections::HashMap<String, String>>(c)
                .unwrap()
                .into_iter()
                .collect();
            all.sort();
            all
        };
        let blocked = read_group(&mut c, stream, "g", "me", 1, Some(100), ">", 1 << 20).unwrap();
        assert_eq!(blocked.len(), 1);
        // No room for more: only the blocked entry, recorded and looked up.
        let only = read_group_bounded(&mut c, stream, &keys, ("g", "me"), 0, ">", LIMITS, blocked)
            .unwrap();
        assert_eq!(only.len(), 1);
        assert_eq!(only[0].id, ids[0]);
        assert!(only[0].seen.as_ref().is_some_and(|s| s.marked && !s.dead));
        assert_eq!(in_flight_of(&mut c), vec![(ids[0].clone(), "b".to_owned())]);
        assert_eq!(pending_count(&mut c, stream, "g").unwrap(), 1);
        // Its idle time reset, its delivery count kept (a count of 2 would
        // make it a redelivery, a suspect of a crash).
        let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(stream)
            .arg("g")
            .arg(&ids[0])
            .arg(&ids[0])
            .arg(1)
            .query(&mut c)
            .unwrap();
        assert_eq!(pending[0].3, 1, "{pending:?}");
        // Room for more: the blocked entry first, then the rest.
        let blocked = read_group(&mut c, stream, "g", "me", 1, Some(100), ">", 1 << 20).unwrap();
        let all = read_group_bounded(&mut c, stream, &keys, ("g", "me"), 10, ">", LIMITS, blocked)
            .unwrap();
        let got: Vec<(&str, bool)> = all
            .iter()
            .map(|e| (e.id.as_str(), e.seen.as_ref().expect("looked up").marked))
            .collect();
        assert_eq!(
            got,
            vec![(ids[1].as_str(), false), (ids[2].as_str(), false)]
        );
        let want: Vec<(String, String)> = ids
            .iter()
            .cloned()
            .zip(["b", "x", "y"].map(str::to_owned))
            .collect();
        assert_eq!(in_flight_of(&mut c), want);
        // Claimed by another consumer between the two: left to it.
        let mut add = redis::cmd("XADD");
        add.arg(stream).arg("*").arg("event_id").arg("z");
        let z = add.query::<String>(&mut c).unwrap();
        let blocked = read_group(&mut c, stream, "g", "me", 1, Some(100), ">", 1 << 20).unwrap();
        assert_eq!(blocked[0].id, z);
        cmd(&mut c, &["XCLAIM", stream, "g", "other", "0", &z, "JUSTID"]);
        let none = read_group_bounded(&mut c, stream, &keys, ("g", "me"), 10, ">", LIMITS, blocked)
            .unwrap();
        assert!(none.is_empty(), "{none:?}");
        assert_eq!(in_flight_of(&mut c), want);
        let mut del = redis::cmd("DEL");
        del.arg(stream).arg(in_flight).arg(&b);
        del.query::<()>(&mut c).unwrap();
    }
}
