//! The reclaimer thread: takes over entries that other consumers left pending.
//!
//! Every `reclaim_interval` it runs XAUTOCLAIM on each stream with
//! `reclaim_min_idle`: entries unacknowledged for that long belong to a
//! consumer that died (or hangs). Claimed entries take the normal path through
//! the worker pool with their own delivery counts (looked up one by one), so
//! an entry that kills every consumer still ends as a `crash_loop` dead
//! letter. Entries deleted from the stream while pending (Redis 7 drops them
//! from the pending list and reports them) become `trimmed` dead letters.
//!
//! If the original owner was only slow, it finds out before it commits (an
//! entry held for over a second is checked with Redis first) and stops
//! working on it; and if both still run the event, only one effect commits:
//! the `processed_events` key decides.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::delivery::{Delivery, Job};
use crate::event::Invalid;
use crate::reader::{deliveries, TRIMMED};
use crate::redis_conn::RedisConn;
use crate::run::Shared;
use crate::stats::{Server, Stats};
use crate::streams;

pub(crate) fn reclaim_thread(shared: &Shared, jobs: &Sender<Job>) {
    while !shared.shutdown.sleep(shared.config.reclaim_interval) {
        for stream in &shared.config.streams {
            let stream: Arc<str> = stream.as_str().into();
            if let Err(e) = reclaim_stream(shared, &stream, jobs) {
                if crate::error::redis_is_outage(&e) {
                    shared.health.down(Server::Redis, &e);
                } else if !streams::is_nogroup(&e) {
                    log::error!("{stream}: XAUTOCLAIM failed: {e}");
                }
            }
        }
    }
}

/// One XAUTOCLAIM call with the delivery count of every entry claimed.
pub(crate) struct Claim {
    pub claimed: streams::Claimed,
    pub counts: Vec<u64>,
}

/// Claims up to `count` entries of `stream` idle for `min_idle_ms`, from
/// `cursor`, and looks up each one's delivery count.
pub(crate) fn claim(
    conn: &mut RedisConn,
    stream: &str,
    group: &str,
    consumer: &str,
    min_idle_ms: u64,
    cursor: &str,
    count: usize,
) -> redis::RedisResult<Claim> {
    let claimed = streams::autoclaim(conn, stream, group, consumer, min_idle_ms, cursor, count)?;
    let ids: Vec<&str> = claimed.entries.iter().map(|e| e.id.as_str()).collect();
    let counts = streams::owners(conn, stream, group, &ids)?
        .into_iter()
        // Not pending any more (acked meanwhile): it is dropped later, by
        // the ownership checks, whatever count it carries.
        .map(|owner| owner.map_or(1, |(_, count)| count))
        .collect();
    Ok(Claim { claimed, counts })
}

/// Claims every idle entry of one stream, in batches that fit the in-flight
/// room.
fn reclaim_stream(
    shared: &Shared,
    stream: &Arc<str>,
    jobs: &Sender<Job>,
) -> redis::RedisResult<()> {
    let config = &shared.config;
    let mut conn = shared.redis_conn()?;
    let mut cursor = "0-0".to_string();
    loop {
        let Some(room) = shared.in_flight.reserve(config.count, &shared.shutdown) else {
            return Ok(());
        };
        let sent_at = Instant::now();
        let Claim { claimed, counts } = claim(
            &mut conn,
            stream,
            &config.group,
            &config.consumer,
            config.reclaim_min_idle.as_millis() as u64,
            &cursor,
            room.places(),
        )?;
        let ids = claimed
            .entries
            .iter()
            .zip(&counts)
            .map(|(e, n)| (e.id.as_str(), Some(*n)))
            .chain(claimed.deleted.iter().map(|id| (id.as_str(), None)));
        let mut tickets = room.admit(stream, ids);
        let deleted_tickets = tickets.split_off(claimed.entries.len());
        let n = tickets.iter().filter(|t| t.is_some()).count();
        if n > 0 {
            log::info!(
                "{stream}: reclaimed {n} entries idle for over {:?}",
                config.reclaim_min_idle
            );
            Stats::add(&shared.stats.reclaimed, n as u64);
        }
        let counts: std::collections::HashMap<String, u64> = claimed
            .entries
            .iter()
            .map(|e| e.id.clone())
            .zip(counts.iter().copied())
            .collect();
        let mut job = deliveries(shared, stream, claimed.entries, tickets, sent_at, |id| {
            counts.get(id).copied().unwrap_or(1)
        });
        job.extend(trimmed(stream, claimed.deleted, deleted_tickets, sent_at));
        if !job.is_empty() && jobs.send(job).is_err() {
            return Ok(());
        }
        shared.health.up(Server::Redis);
        if claimed.next == "0-0" || shared.shutdown.is_shutdown() {
            return Ok(());
        }
        cursor = claimed.next;
    }
}

/// Deliveries for entries XAUTOCLAIM reported deleted (and dropped from the
/// pending list): `trimmed` dead letters with nothing but their ids. One
/// this process still holds is left to its holder, which knows more.
fn trimmed(
    stream: &Arc<str>,
    ids: Vec<String>,
    tickets: Vec<Option<crate::in_flight::Ticket>>,
    sent_at: Instant,
) -> impl Iterator<Item = Delivery> + '_ {
    ids.into_iter()
        .zip(tickets)
        .filter_map(move |(entry_id, ticket)| {
            let ticket = ticket?;
            Some(Delivery {
                stream: stream.clone(),
                entry_id,
                body: Err((Vec::new(), Invalid(TRIMMED.into()))),
                delivery_count: 1,
                token: None,
                trimmed: true,
                held_since: sent_at,
                failures: Vec::new(),
                strikes: 0,
                ticket: Some(ticket),
            })
        })
}

#[cfg(test)]
mod tests {
    //! Against the Redis at `TASKHUB_TEST_REDIS_URL` (default
    //! `redis://127.0.0.1:6379`), like the integration tests.

    use super::*;

    fn conn() -> RedisConn {
        let url = std::env::var("TASKHUB_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        crate::redis_conn::connect(&url, &crate::Tls::default()).expect("the test Redis answers")
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
        // One `XPENDING first last n claimer` over the claimed range returned
        // them too, so the last claimed ids fell off and counted 1: they ran
        // batched, with a fresh attempt budget, past the crash-loop check.
        let mut c = conn();
        let stream = format!("reclaim-counts-{}", uuid::Uuid::new_v4());
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
        for (consumer, n) in [("dead", "1"), ("claimer", "3"), ("dead", "1")] {
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
                &["XCLAIM", &stream, "g", "dead", "0", &dead, &dead_too],
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(30));
        // Only the dead consumer's entries are idle enough.
        cmd(
            &mut c,
            &[
                "XCLAIM", &stream, "g", "claimer", "0", &own[0], &own[1], &own[2], "JUSTID",
            ],
        );
        let Claim { claimed, counts } =
            claim(&mut c, &stream, "g", "claimer", 20, "0-0", 10).unwrap();
        let ids: Vec<&str> = claimed.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, [dead.as_str(), dead_too.as_str()]);
        // 1 read + 4 XCLAIMs + this claim.
        assert_eq!(counts, [6, 6]);
        cmd(&mut c, &["DEL", &stream]);
    }
}
