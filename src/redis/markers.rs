//! The duplicate-marker check of the fast path, and the marker write: where
//! a reply is matched to the key it answers.
//!
//! A marker hit is acked without asking PostgreSQL, so a hit read from the
//! wrong reply loses the event. Replies are matched to commands only by
//! their order on a connection, and on a Redis Cluster one pipeline is split
//! over the nodes, its replies put back in order, and sent again command by
//! command after a redirection (`conn.rs`); a connection that once took one
//! reply too few or too many reads every later reply off by one. So the
//! check does not trust the order alone:
//!
//! - each marker holds its own tag (`keys::marker_tag`) and is read with
//!   `GET`: a reply is a hit only when it is that key's tag. The reply of
//!   another command (a stale `1`, an `OK`, another marker's tag) is never
//!   a hit;
//! - every reply must have the shape its command gives (a `GET`: nil or a
//!   string; the `HMGET` of the dead-letter index: an array of one nil or
//!   string per entry), and there must be one per command. Anything else
//!   means this connection's replies no longer line up with its commands:
//!   it is marked stale (the pool drops it) and the check fails with an I/O
//!   error, so it is done again on a fresh connection, as after a dropped
//!   one.
//!
//! Still one pipelined round trip (one per node on a cluster). On one
//! server, the entries a reader reads are looked up by its read script in
//! the same step (`streams::read_group_bounded`), where no reply can be out
//! of place, and this check is left for the rest (claimed entries, retries,
//! entries that waited).
//!
//! The markers of what committed are written, with the acks, by one script
//! on one server ([`set_and_ack`]) and by a pipeline of [`set`] on a
//! cluster.

use redis::{RedisError, RedisResult, Value};

use crate::redis::conn::{Pipe, RedisConn};
use crate::redis::keys::{self, marker_tag, MARKER_TAG_LEN};
use crate::redis::script::Script;

/// What the fast path learnt about a job's entries, in their order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Seen {
    /// The entry's event has a marker: this database committed it.
    pub marked: Vec<bool>,
    /// The entry is in the dead-letter index: it was dead-lettered before.
    pub dead: Vec<bool>,
}

/// Reads the markers `keys` (one per entry) and which of `entries` (entry
/// id, event id) `group` dead-lettered from `stream` (see `keys::DEAD_IN`), in one
/// pipelined round trip. Fails, and marks
/// `conn` stale, when a reply is out of place (see the module's
/// documentation).
///
/// In the same round trip, `remember` (a hash key and its entry id → event
/// id pairs) is written; its reply is not read.
pub(crate) fn check(
    conn: &mut RedisConn,
    keys: &[String],
    (stream, group): (&str, &str),
    entries: &[(&str, &str)],
    remember: (&str, &[(&str, &str)]),
) -> RedisResult<Seen> {
    debug_assert_eq!(keys.len(), entries.len());
    let mut pipe = conn.pipe();
    for key in keys {
        pipe.cmd("GET").arg(key);
    }
    pipe.cmd("EVAL")
        .arg(DEAD_OF_GROUP.as_str())
        .arg(3)
        .arg(keys::dead_letter_index(stream, group))
        .arg(keys::dead_letter_index_of_all_groups(stream))
        .arg(keys::dead_letter_stream(stream))
        .arg(group)
        .arg(entries);
    let (ids_key, pairs) = remember;
    if !pairs.is_empty() {
        pipe.cmd("HSET").arg(ids_key).arg(pairs).ignore();
    }
    let replies: Vec<Value> = pipe.query(conn)?;
    read(keys, entries.len(), replies).map_err(|why| {
        log::warn!(
            "redis: marker check: a reply out of place ({why}); the connection is dropped and the check done again on another"
        );
        conn.mark_stale();
        // A connection whose replies no longer line up is as lost as a
        // dropped one: an I/O error, so the caller retries through it like
        // an outage (on a fresh connection) instead of giving up.
        RedisError::from(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("marker check: a reply out of place ({why})"),
        ))
    })
}

/// Which of the entries ARGV[2..] (entry id, event id, ...) group ARGV[1]
/// dead-lettered, as letters that name the same event: its index KEYS[1],
/// the index of every group's letters KEYS[2], their letters KEYS[3] (see
/// `keys::DEAD_IN`). Sent as EVAL in a pipeline (a few hundred bytes; Redis
/// keeps it compiled): this path runs for what the read did not cover.
static DEAD_OF_GROUP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{}{}",
        keys::DEAD_IN,
        r"
local ids, events = {}, {}
for i = 2, #ARGV - 1, 2 do
    ids[#ids + 1] = ARGV[i]
    events[#ids] = ARGV[i + 1]
end
if #ids == 0 then return {} end
return dead_in(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ids, 1, #ids, same_event(events))
"
    )
});

/// Adds to `pipe` the marker `key`, expiring after `ttl_secs`; its reply is
/// left out.
pub(crate) fn set(pipe: &mut Pipe, key: &str, ttl_secs: u64) {
    pipe.cmd("SET")
        .arg(key)
        .arg(&marker_tag(key)[..])
        .arg("EX")
        .arg(ttl_secs.max(1))
        .ignore();
}

/// Sets the markers KEYS[3..] (their tags ARGV[3..], expiring after ARGV[2]
/// seconds; a marker Redis refuses, out of memory say, is left out: it is
/// only a cache), then XACKs the entry ids after the tags in group ARGV[1]
/// of stream KEYS[1] and removes them from the in-flight ids KEYS[2].
const MARK_AND_ACK: &str = r"
local marks = #KEYS - 2
for i = 1, marks do
    redis.pcall('SET', KEYS[2 + i], ARGV[2 + i], 'EX', ARGV[2])
end
local acked = 0
for first = 3 + marks, #ARGV, 1000 do
    local last = math.min(first + 999, #ARGV)
    acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, last))
    redis.call('HDEL', KEYS[2], unpack(ARGV, first, last))
end
return acked
";

/// On one server, [`set`] for each of `keys` with [`XACK`](crate::redis::streams::ack)
/// of `ids` and their removal from the in-flight ids, as one script: one
/// reply where a pipeline has one per marker. Its keys are in several hash
/// slots, so a cluster takes the pipeline.
pub(crate) fn set_and_ack(
    conn: &mut RedisConn,
    keys: &[&str],
    ttl_secs: u64,
    (stream, in_flight, group): (&str, &str, &str),
    ids: &[&str],
) -> RedisResult<()> {
    debug_assert!(!conn.is_cluster());
    // Sized up front: an ack holds a few hundred arguments.
    let args = 5 + keys.len() * 2 + ids.len();
    let marked: usize = keys.iter().map(|k| k.len() + MARKER_TAG_LEN).sum();
    let acked: usize = ids.iter().map(|id| id.len()).sum();
    let bytes = stream.len() + in_flight.len() + group.len() + marked + acked + 40;
    let mut cmd = MARK_AND_ACK_SCRIPT.cmd_with_capacity(args, bytes);
    cmd.arg(keys.len() + 2)
        .arg(stream)
        .arg(in_flight)
        .arg(keys)
        .arg(group)
        .arg(ttl_secs.max(1));
    for key in keys {
        cmd.arg(&marker_tag(key)[..]);
    }
    cmd.arg(ids);
    MARK_AND_ACK_SCRIPT.query::<i64>(&cmd, conn).map(drop)
}

/// [`MARK_AND_ACK`], called by its digest (see `script.rs`).
static MARK_AND_ACK_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(MARK_AND_ACK.to_owned()));

/// The replies of [`check`]'s pipeline: one per marker, then the index's.
fn read(keys: &[String], entries: usize, mut replies: Vec<Value>) -> Result<Seen, String> {
    if replies.len() != keys.len() + 1 {
        return Err(format!(
            "{} replies to {} commands",
            replies.len(),
            keys.len() + 1
        ));
    }
    let dead = match replies.pop() {
        Some(Value::Array(values)) if values.len() == entries => values
            .iter()
            .map(|v| match v {
                Value::Nil => Ok(false),
                Value::BulkString(_) => Ok(true),
                other => Err(format!("HMGET of the dead-letter index: an item {other:?}")),
            })
            .collect::<Result<Vec<bool>, String>>()?,
        other => {
            return Err(format!(
                "HMGET of the dead-letter index ({entries} fields): {other:?}"
            ))
        }
    };
    let marked = keys
        .iter()
        .zip(&replies)
        .map(|(key, reply)| match reply {
            Value::Nil => Ok(false),
            Value::BulkString(value) => Ok(value.as_slice() == marker_tag(key)),
            other => Err(format!("GET {key}: {other:?}")),
        })
        .collect::<Result<Vec<bool>, String>>()?;
    Ok(Seen { marked, dead })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::keys::{marker, marker_tag_text};

    fn keys(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| marker("00ff", "g", &format!("e-{i}")))
            .collect()
    }

    fn tag(key: &str) -> Value {
        Value::BulkString(marker_tag_text(key).into_bytes())
    }

    fn index(items: &[Option<&str>]) -> Value {
        Value::Array(
            items
                .iter()
                .map(|i| i.map_or(Value::Nil, |s| Value::BulkString(s.into())))
                .collect(),
        )
    }

    #[test]
    fn a_hit_is_the_tag_of_the_key_asked_for() {
        let k = keys(3);
        let replies = vec![
            tag(&k[0]),
            Value::Nil,
            tag(&k[2]),
            index(&[None, Some("1700-0"), None]),
        ];
        assert_eq!(
            read(&k, 3, replies),
            Ok(Seen {
                marked: vec![true, false, true],
                dead: vec![false, true, false],
            })
        );
    }

    #[test]
    fn another_markers_tag_or_an_old_value_is_no_hit() {
        let k = keys(3);
        // Replies shifted by one (a leftover reply first), but of the right
        // types: nothing is taken for a hit it is not.
        let replies = vec![
            Value::Nil,
            tag(&k[0]),
            Value::BulkString(b"1".to_vec()),
            index(&[None, None, None]),
        ];
        let seen = read(&k, 3, replies).unwrap();
        assert_eq!(seen.marked, vec![false, false, false]);
    }

    #[test]
    fn a_reply_of_another_command_fails_the_check() {
        let k = keys(2);
        // The bug this pins: a stale `:1` (an EXISTS reply left unread on a
        // connection) read as the marker of the next event.
        for stale in [
            Value::Int(1),
            Value::Okay,
            Value::SimpleString("OK".into()),
            Value::Array(vec![]),
        ] {
            let replies = vec![stale, Value::Nil, index(&[None, None])];
            assert!(read(&k, 2, replies).is_err());
        }
    }

    #[test]
    fn a_wrong_count_or_shape_fails_the_check() {
        let k = keys(2);
        assert!(read(&k, 2, vec![Value::Nil, index(&[None, None])]).is_err());
        assert!(read(
            &k,
            2,
            vec![Value::Nil, Value::Nil, Value::Nil, index(&[None, None])]
        )
        .is_err());
        assert!(read(&k, 2, vec![Value::Nil, Value::Nil, index(&[None])]).is_err());
        assert!(read(&k, 2, vec![Value::Nil, Value::Nil, Value::Int(0)]).is_err());
        let odd = Value::Array(vec![Value::Nil, Value::Int(1)]);
        assert!(read(&k, 2, vec![Value::Nil, Value::Nil, odd]).is_err());
    }

    /// Against the test Redis: the group's index and the old one of every
    /// group, for more entries than Lua's `unpack` takes at once (a
    /// review: 8,100 failed with "too many results to unpack", and the
    /// entries stayed pending for ever); an old-index entry counts for the
    /// group its letter names only; a letter counts for the event it names
    /// only (an entry id reused by another event, its stream deleted and
    /// written again, was acked as dead-lettered before: lost).
    #[test]
    fn the_dead_letter_lookup_takes_many_entries_and_old_letters_by_group() {
        let mut c = crate::redis::streams::tests::conn();
        let stream = format!("{{dead-in-{}}}", uuid::Uuid::new_v4());
        let dlq = keys::dead_letter_stream(&stream);
        let cmd = |c: &mut RedisConn, args: &[&str]| {
            redis::cmd(args[0])
                .arg(&args[1..])
                .query::<Value>(c)
                .unwrap()
        };
        let letter = |c: &mut RedisConn, group: &str, event: &str| -> String {
            redis::cmd("XADD")
                .arg(&dlq)
                .arg("*")
                .arg("group")
                .arg(group)
                .arg("event_id")
                .arg(event)
                .query(c)
                .unwrap()
        };
        let (a_letter, b_letter) = (letter(&mut c, "a", "e"), letter(&mut c, "b", "e"));
        let other = letter(&mut c, "a", "another");
        let ids: Vec<String> = (0..9_000).map(|i| format!("{}-0", i + 1)).collect();
        // Group a's own index: entry 1, entry 5 (the letter of another
        // event); the old index: entry 2 (a's letter), entry 3 (b's
        // letter), entry 4 (a letter gone).
        let own = keys::dead_letter_index(&stream, "a");
        let old = keys::dead_letter_index_of_all_groups(&stream);
        cmd(&mut c, &["HSET", &own, "1-0", &a_letter, "5-0", &other]);
        cmd(
            &mut c,
            &[
                "HSET", &old, "2-0", &a_letter, "3-0", &b_letter, "4-0", "9-9",
            ],
        );
        let refs: Vec<(&str, &str)> = ids.iter().map(|id| (id.as_str(), "e")).collect();
        let keys = vec![keys::marker("00ff", "s", "e"); refs.len()];
        let seen = check(&mut c, &keys, (&stream, "a"), &refs, ("unused", &[])).unwrap();
        let dead: Vec<usize> = (0..refs.len()).filter(|i| seen.dead[*i]).collect();
        assert_eq!(dead, [0, 1], "entries 1 and 2 are a's, not 5");
        let seen = check(
            &mut c,
            &keys[..4],
            (&stream, "b"),
            &refs[..4],
            ("unused", &[]),
        )
        .unwrap();
        assert_eq!(seen.dead, [false, false, true, false], "entry 3 is b's");
        cmd(&mut c, &["DEL", &own, &old, &dlq]);
    }
}
