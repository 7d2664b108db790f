//! The Redis keys taskhub keeps besides the streams, and why each part of
//! their names is there.
//!
//! - The duplicate marker of an event, `th:<ns>:<len>:<scope>:<event_id>`:
//!   a cache of "this database committed this event". `<ns>` names the
//!   database history that owns the truth (see [`Namespace`]), so two
//!   deployments sharing one Redis, a database dropped and created again
//!   under the same name, or a restore or failover to another timeline
//!   never trust markers written for another history. `<len>` is the
//!   scope's length in bytes: without it, scope `g` with event `x:1` and
//!   scope `g:x` with event `1` would be one key. Its value is its own
//!   tag ([`marker_tag`]): a reply counts as the marker only when it carries
//!   the tag of the key that was asked for (see `markers.rs`).
//! - The runs of an entry that started and did not finish (a hash:
//!   delivery count -> when and on which consumer it started), and the
//!   deliveries stopped by a shutdown without a crash (`e<delivery>`); a
//!   new name each time its form changed: a counter, then a set,
//!   `th:r:<len>:<group>:<len>:<stream>:<entry_id>` (see `apply.rs`).
//! - The record of the instance running as a consumer,
//!   `th:c:<len>:<group>:<len>:<stream>:<consumer>`: its token, process id
//!   and host, refreshed every few seconds by the reader, with a TTL (see
//!   `worker/name_check.rs`).
//! - The index of a group's dead-lettered entries, the hash
//!   `<stream>:dlq:index:<len>:<group>` (entry id → dead-letter id), in the
//!   stream's hash slot: an entry delivered again after its group was
//!   created again is recognised as dead-lettered already. (Earlier
//!   versions kept one index of every group's, `<stream>:dlq:index`; it is
//!   still read, see [`DEAD_IN`].)
//!
//! Keys written by earlier versions (`processed:<scope>:<event_id>`) are
//! not read: they could not say which database they speak for. They expire
//! with their TTL; meanwhile PostgreSQL answers for them.

use std::fmt;
use std::sync::{Arc, RwLock};

/// The dead-letter stream of `stream`. With a hash tag in the stream name
/// (`{tasks}:events`), both land in the same Redis Cluster slot.
pub fn dead_letter_stream(stream: &str) -> String {
    format!("{stream}:dlq")
}

/// The identity of the database history the markers speak for: the
/// cluster's `system_identifier` (new for every `initdb`, kept by replicas),
/// the database's OID (new when it is created again), the timeline (new
/// after a promotion or a point-in-time restore) and the file node of
/// `processed_events` (new after a TRUNCATE). Shown as a 64-bit FNV-1a hash
/// of those four, in hex.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    pub system_identifier: String,
    pub database_oid: String,
    pub timeline: String,
    pub filenode: String,
}

impl Identity {
    /// The query that reads it (one row of four texts). It fails on a
    /// server in recovery (a standby): no writes are possible there anyway.
    pub const QUERY: &'static str = "SELECT \
        (SELECT system_identifier FROM pg_control_system())::text, \
        (SELECT oid FROM pg_database WHERE datname = current_database())::text, \
        substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8), \
        coalesce(pg_relation_filenode(to_regclass('processed_events')), 0)::text";

    /// The namespace of markers for this identity.
    pub fn namespace(&self) -> String {
        let text = format!(
            "{}/{}/{}/{}",
            self.system_identifier, self.database_oid, self.timeline, self.filenode
        );
        format!("{:016x}", fnv1a(text.as_bytes()))
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "system {} database oid {} timeline {} processed_events file {}",
            self.system_identifier,
            self.database_oid,
            u32::from_str_radix(&self.timeline, 16).unwrap_or(0),
            self.filenode
        )
    }
}

/// 64-bit FNV-1a: small, and the same in every version of taskhub and Rust
/// (std's hasher may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The marker namespace in use, shared by every thread and replaced when a
/// new PostgreSQL connection finds another identity (a failover, a database
/// created again while the worker ran).
#[derive(Debug, Clone, Default)]
pub(crate) struct Namespace {
    current: Arc<RwLock<(Arc<str>, Option<Identity>)>>,
}

impl Namespace {
    /// The namespace now.
    pub fn get(&self) -> Arc<str> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// The identity it stands for, once a connection saw one.
    pub fn identity(&self) -> Option<Identity> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone()
    }

    /// Records the identity a connection found; logs when it changed.
    pub fn observe(&self, identity: &Identity) {
        let ns = identity.namespace();
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if *current.0 != *ns {
            if !current.0.is_empty() {
                log::warn!(
                    "postgres: the database is not the one the markers were written for \
                     ({identity}); markers of namespace {} are no longer trusted, \
                     new ones go to {ns}",
                    current.0
                );
            }
            *current = (ns.into(), Some(identity.clone()));
        }
    }
}

/// The marker of `event_id` in `scope`, in namespace `ns`.
pub(crate) fn marker(ns: &str, scope: &str, event_id: &str) -> String {
    let mut key = String::with_capacity(30 + ns.len() + scope.len() + event_id.len());
    push_marker(&mut key, ns, scope, event_id);
    key
}

/// Appends [`marker`]`(ns, scope, event_id)` to `key`. Built by hand:
/// with `format!` this and the tag took twice as long, and they run for
/// every event acked.
fn push_marker(key: &mut String, ns: &str, scope: &str, event_id: &str) {
    let mut digits = [0u8; 20];
    let len = decimal(scope.len(), &mut digits);
    for part in ["th:", ns, ":", len, ":", scope, ":", event_id] {
        key.push_str(part);
    }
}

/// The markers of several events in one buffer: one allocation for the
/// events an ack marks, where a `String` each was one per event.
pub(crate) struct MarkerKeys {
    text: String,
    ends: Vec<usize>,
}

impl MarkerKeys {
    pub fn new<'a>(
        ns: &str,
        scope: &str,
        event_ids: impl ExactSizeIterator<Item = &'a str>,
    ) -> MarkerKeys {
        let n = event_ids.len();
        let mut keys = MarkerKeys {
            text: String::with_capacity(n * (64 + ns.len() + scope.len())),
            ends: Vec::with_capacity(n),
        };
        for event_id in event_ids {
            push_marker(&mut keys.text, ns, scope, event_id);
            keys.ends.push(keys.text.len());
        }
        keys
    }

    /// The keys, in the order of the event ids.
    pub fn keys(&self) -> Vec<&str> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(&self.ends)
            .map(|(start, &end)| &self.text[start..end])
            .collect()
    }
}

/// `n` in decimal, written at the end of `buf`.
fn decimal(mut n: usize, buf: &mut [u8; 20]) -> &str {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    std::str::from_utf8(&buf[at..]).expect("ASCII digits")
}

/// What every marker of `scope` in namespace `ns` starts with: the read
/// script appends the event id (see `streams::read_group_bounded`).
pub(crate) fn marker_prefix(ns: &str, scope: &str) -> String {
    marker(ns, scope, "")
}

/// The value a marker holds: `m:` and the 64-bit FNV-1a hash of its own
/// key, in hex (18 bytes). A reply is a marker hit only when it is exactly
/// the tag of the key asked for, so a reply that belongs to another command
/// (another marker's tag, a stale `1` or `OK`, an `XACK` count) is never
/// taken for one. Markers written with the value `1` by earlier versions
/// simply miss, and PostgreSQL answers for them. Built without an
/// allocation: it runs for every event acked.
pub(crate) fn marker_tag(key: &str) -> [u8; MARKER_TAG_LEN] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let hash = fnv1a(key.as_bytes());
    let mut tag = *b"m:0000000000000000";
    for (i, digit) in tag[2..].iter_mut().enumerate() {
        *digit = HEX[((hash >> (60 - 4 * i)) & 0xf) as usize];
    }
    tag
}

/// The length of a [`marker_tag`]: `m:` and 16 hex digits.
pub(crate) const MARKER_TAG_LEN: usize = 18;

/// [`marker_tag`] as text, for tests that write markers by hand.
#[cfg(test)]
pub(crate) fn marker_tag_text(key: &str) -> String {
    String::from_utf8(marker_tag(key).to_vec()).expect("ASCII")
}

/// The record of the instance running as `consumer` in `group` on
/// `stream`, refreshed by its reader (see `worker/name_check.rs`): two
/// instances under one consumer name overwrite each other's.
pub(crate) fn consumer_record(group: &str, stream: &str, consumer: &str) -> String {
    format!(
        "th:c:{}:{group}:{}:{stream}:{consumer}",
        group.len(),
        stream.len()
    )
}

/// The started runs of one entry of `stream` in `group` (see
/// `worker/apply.rs`).
pub(crate) fn started(group: &str, stream: &str, entry_id: &str) -> String {
    format!(
        "th:r:{}:{group}:{}:{stream}:{entry_id}",
        group.len(),
        stream.len()
    )
}

/// The index of the entries of `stream` that `group` dead-lettered (a
/// hash: entry id → letter id), so that an entry delivered to the group
/// again (the group destroyed and created again) is not dead-lettered
/// twice, nor applied after its letter. Each group has its own: another
/// group reading the stream applies the entry its own way. In the
/// stream's hash slot, like the dead-letter stream.
pub(crate) fn dead_letter_index(stream: &str, group: &str) -> String {
    format!("{stream}:dlq:index:{}:{group}", group.len())
}

/// The entries `taskhub dlq replay` put back on `stream` for one group (a
/// hash: new entry id → group), written by the replay script itself: a
/// `replay_group` field in an entry is honoured only when this record
/// says the same (a producer that copies its clients' fields into entries
/// must not let a client make a group skip an event). In the stream's
/// hash slot.
pub(crate) fn replays(stream: &str) -> String {
    format!("{stream}:dlq:replays")
}

/// The index that versions before the group was in the key wrote, of
/// every group's letters (see [`DEAD_IN`]); only read.
pub(crate) fn dead_letter_index_of_all_groups(stream: &str) -> String {
    format!("{stream}:dlq:index")
}

/// Lua: which of the entry ids `ids[first..last]` group `group` dead-lettered,
/// as `HMGET` of its `index` answers (a letter id, or false), also counting
/// the entries in the index of every group's letters (`old`, see
/// [`dead_letter_index_of_all_groups`]) whose letter in `dlq` names this
/// group. (One whose letter is gone counts for no group: it may be any
/// group's, and a group that never dead-lettered it would drop it unread.)
/// 500 ids a call: Lua's `unpack` takes fewer than 8,000.
///
/// With `same` (a function of an id's place `k` and a letter's fields), a
/// letter counts only if `same` says it is that entry's: an entry id is
/// reused when a stream is deleted and written again with explicit ids,
/// and the index, a key of its own, outlives the stream (a new event at
/// the id of an old letter was acked as dead-lettered before, and lost).
/// A letter gone from `dlq` (archived, trimmed) cannot tell, and counts.
/// The read and the fast path compare event ids (`same_event`), and take
/// an entry without a readable one for no letter's: it goes on to its own
/// letter, whose write compares the two letters' event ids and original
/// fields, made alike (`same_original`): the same entry again is acked
/// there, another gets its letter, which takes the old one's place in the
/// index.
pub(crate) const DEAD_IN: &str = r"
local function letter_fields(dlq, letter_id)
    local letter = redis.call('XRANGE', dlq, letter_id, letter_id)
    if #letter == 1 and type(letter[1][2]) == 'table' then return letter[1][2] end
    return nil
end
local function field_of(f, name)
    for j = 1, #f - 1, 2 do
        if f[j] == name then return f[j + 1] end
    end
    return false
end
-- The event id and original fields of a letter's fields `f` from `from`.
local function original(f, from)
    local o = {}
    for j = from, #f - 1, 2 do
        local name = f[j]
        if name == 'event_id' or name == 'packed_fields' or string.sub(name, 1, 2) == 'f:' then
            o[#o + 1] = name
            o[#o + 1] = f[j + 1]
        end
    end
    return o
end
local function same_original(a, b)
    if #a ~= #b then return false end
    for i = 1, #a do
        if a[i] ~= b[i] then return false end
    end
    return true
end
-- `same` for entries whose event ids `events` (false: none) are known.
local function same_event(events)
    return function(k, f)
        return events[k] ~= false and field_of(f, 'event_id') == events[k]
    end
end
local function dead_in(index, old, dlq, group, ids, first, last, same)
    local dead = {}
    -- Most deployments never had the old index: no second HMGET then.
    local has_old = redis.call('EXISTS', old) == 1
    for from = first, last, 500 do
        local to = math.min(from + 499, last)
        local own = redis.call('HMGET', index, unpack(ids, from, to))
        local before = has_old and redis.call('HMGET', old, unpack(ids, from, to)) or {}
        for i = 1, #own do
            local letter_id, f = own[i], nil
            if letter_id then
                if same then f = letter_fields(dlq, letter_id) end
            elseif before[i] then
                f = letter_fields(dlq, before[i])
                if f and field_of(f, 'group') == group then letter_id = before[i] end
            end
            local k = from + i - 1
            if letter_id and same and f and not same(k, f) then
                letter_id = false
            end
            dead[#dead + 1] = letter_id
        end
    end
    return dead
end
";

/// The event ids of `group`'s entries of `stream` in flight (a hash: entry
/// id → event id, set by the reader and again by the fast path, removed
/// with the XACK or the dead letter), so that an entry deleted from the stream before its ack can
/// still be named and looked up in `processed_events`. In the stream's hash
/// slot, like the index.
pub(crate) fn in_flight_ids(stream: &str, group: &str) -> String {
    format!("{stream}:dlq:ids:{}:{group}", group.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_that_join_alike_make_different_keys() {
        assert_ne!(marker("n", "g", "x:1"), marker("n", "g:x", "1"));
        assert_ne!(started("a:b", "c", "1-0"), started("a", "b:c", "1-0"));
        assert_ne!(started("a", "b:1-0", "2-0"), started("a", "b", "1-0:2-0"));
        assert_ne!(
            consumer_record("a", "b:c", "d"),
            consumer_record("a", "b", "c:d")
        );
        assert_eq!(marker("00ff", "g", "e"), "th:00ff:1:g:e");
        assert_eq!(
            format!("{}e:1", marker_prefix("00ff", "g:x")),
            marker("00ff", "g:x", "e:1")
        );
    }

    #[test]
    fn markers_in_one_buffer_are_the_markers_one_by_one() {
        let ids = ["e-1", "", "é:2", "e-1"];
        let keys = MarkerKeys::new("00ff", "g:x", ids.into_iter());
        let want: Vec<String> = ids.iter().map(|id| marker("00ff", "g:x", id)).collect();
        assert_eq!(keys.keys(), want);
        assert!(MarkerKeys::new("00ff", "g", [].into_iter())
            .keys()
            .is_empty());
    }

    #[test]
    fn a_marker_tag_names_its_own_key() {
        let (a, b) = (marker("00ff", "g", "e-1"), marker("00ff", "g", "e-2"));
        assert_ne!(marker_tag_text(&a), marker_tag_text(&b));
        assert_eq!(marker_tag_text(&a), marker_tag_text(&a.clone()));
        assert_eq!(marker_tag_text(&a).len(), 18);
        assert_ne!(marker_tag_text(&a), "1");
        // The hand-built forms are the formatted ones, byte for byte.
        for (scope, id) in [
            ("", ""),
            ("g", "e-1"),
            ("a-scope-of-38-bytes-xxxxxxxxxxxxxxxxxx", "é:1"),
            ("scöpe", "e"),
        ] {
            let key = marker("00ff", scope, id);
            assert_eq!(key, format!("th:00ff:{}:{scope}:{id}", scope.len()));
            assert_eq!(
                marker_tag_text(&key),
                format!("m:{:016x}", fnv1a(key.as_bytes()))
            );
        }
        let long = "s".repeat(12345);
        assert!(marker("n", &long, "e").starts_with("th:n:12345:s"));
    }

    #[test]
    fn every_part_of_the_identity_changes_the_namespace() {
        let base = Identity {
            system_identifier: "7301".into(),
            database_oid: "16384".into(),
            timeline: "00000001".into(),
            filenode: "16390".into(),
        };
        let ns = base.namespace();
        assert_eq!(ns.len(), 16);
        for changed in [
            Identity {
                system_identifier: "7302".into(),
                ..base.clone()
            },
            Identity {
                database_oid: "16385".into(),
                ..base.clone()
            },
            Identity {
                timeline: "00000002".into(),
                ..base.clone()
            },
            Identity {
                filenode: "16391".into(),
                ..base.clone()
            },
        ] {
            assert_ne!(changed.namespace(), ns);
        }
        assert_eq!(base.clone().namespace(), ns);
    }
}
