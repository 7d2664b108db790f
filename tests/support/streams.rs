//! Redis as the tests see it: a connection, entries added by hand, what is
//! pending in a group, the dead letters of a stream and the marker key of an
//! event.

use std::time::Duration;

/// The shared Redis of the machine (never stopped by tests).
pub fn redis_url() -> String {
    std::env::var("TASKHUB_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn redis(url: &str) -> redis::Connection {
    let conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn
}

/// XADD of string fields; returns the entry id.
pub fn xadd(conn: &mut dyn redis::ConnectionLike, stream: &str, fields: &[(&str, &str)]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query(conn).unwrap()
}

/// Adds one event per id, with the payload `payload of <id>`, pipelined;
/// returns the entry ids.
pub fn xadd_events(
    conn: &mut dyn redis::ConnectionLike,
    stream: &str,
    event_ids: &[String],
) -> Vec<String> {
    let mut entries = Vec::with_capacity(event_ids.len());
    for chunk in event_ids.chunks(500) {
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("event_id")
                .arg(id)
                .arg("payload")
                .arg(format!("payload of {id}"));
        }
        let added: Vec<String> = pipe.query(conn).unwrap();
        entries.extend(added);
    }
    entries
}

/// Entries pending in `group` (all consumers); 0 when the group is missing.
pub fn pending(conn: &mut dyn redis::ConnectionLike, stream: &str, group: &str) -> u64 {
    let reply: redis::RedisResult<Vec<redis::Value>> =
        redis::cmd("XPENDING").arg(stream).arg(group).query(conn);
    match reply.as_deref() {
        Ok([redis::Value::Int(n), ..]) => *n as u64,
        _ => 0,
    }
}

/// Pending entries of the group: (entry id, consumer, delivery count).
pub fn pending_entries(
    conn: &mut dyn redis::ConnectionLike,
    stream: &str,
    group: &str,
) -> Vec<(String, String, u64)> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(100_000)
        .query(conn)
        .unwrap();
    rows.into_iter()
        .map(|(id, consumer, _idle, count)| (id, consumer, count))
        .collect()
}

pub fn xlen(conn: &mut dyn redis::ConnectionLike, stream: &str) -> u64 {
    redis::cmd("XLEN").arg(stream).query(conn).unwrap()
}

/// The dead letters of `stream`, decoded.
pub fn dead_letters(
    conn: &mut dyn redis::ConnectionLike,
    stream: &str,
) -> Vec<taskhub::DeadLetter> {
    let rows: Vec<(String, taskhub::Fields)> = redis::cmd("XRANGE")
        .arg(taskhub::dlq::dead_letter_stream(stream))
        .arg("-")
        .arg("+")
        .query(conn)
        .unwrap();
    rows.into_iter()
        .map(|(id, fields)| taskhub::DeadLetter::from_fields(Some(id), &fields).unwrap())
        .collect()
}

/// The Redis marker key of `event_id` in `scope` for the database at
/// `db_url`, computed here from the format the README documents:
/// `th:<ns>:<len(scope)>:<scope>:<event_id>`, where `<ns>` is the 64-bit
/// FNV-1a hash, in hex, of `<system_identifier>/<database oid>/<timeline,
/// 8 hex digits>/<processed_events file node>`.
pub fn marker_key(db_url: &str, scope: &str, event_id: &str) -> String {
    let mut client = postgres::Client::connect(db_url, postgres::NoTls).unwrap();
    let row = client
        .query_one(
            "SELECT (SELECT system_identifier FROM pg_control_system())::text, \
             (SELECT oid FROM pg_database WHERE datname = current_database())::text, \
             substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8), \
             coalesce(pg_relation_filenode(to_regclass('processed_events')), 0)::text",
            &[],
        )
        .unwrap();
    let parts: Vec<String> = (0..4).map(|i| row.get(i)).collect();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.join("/").bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("th:{hash:016x}:{}:{scope}:{event_id}", scope.len())
}
