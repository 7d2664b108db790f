//! The reclaimer thread: takes over entries that other consumers left pending.
//!
//! Every `reclaim_interval` it runs XAUTOCLAIM on each stream with
//! `reclaim_min_idle`: entries unacknowledged for that long belong to a
//! consumer that died (or hangs). Claimed entries take the normal path through
//! the worker pool, with their delivery count, so an entry that kills every
//! consumer still ends as a `crash_loop` dead letter. Entries deleted while
//! pending (Redis 7 reports them) are acked and logged.
//!
//! If the original owner was only slow and finishes too, both run the event
//! but only one effect commits: the `processed_events` key decides.

use std::sync::Arc;

use crossbeam_channel::Sender;

use crate::delivery::Job;
use crate::reader::{ack_deleted, deliveries};
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
        let room = shared.in_flight.reserve(config.count, &shared.shutdown);
        if room == 0 {
            return Ok(());
        }
        let claimed = streams::autoclaim(
            &mut conn,
            stream,
            &config.group,
            &config.consumer,
            config.reclaim_min_idle.as_millis() as u64,
            &cursor,
            room,
        );
        let claimed = match claimed {
            Ok(c) => c,
            Err(e) => {
                shared.in_flight.unreserve(room);
                return Err(e);
            }
        };
        let counts = match (claimed.entries.first(), claimed.entries.last()) {
            (Some(first), Some(last)) => streams::delivery_counts(
                &mut conn,
                stream,
                &config.group,
                &config.consumer,
                &first.id,
                &last.id,
                claimed.entries.len(),
            ),
            _ => Ok(Default::default()),
        };
        let counts = match counts {
            Ok(c) => c,
            Err(e) => {
                // Give the room back (the claimed entries stay pending and
                // are claimed again next time).
                shared.in_flight.unreserve(room);
                return Err(e);
            }
        };
        let admitted =
            shared
                .in_flight
                .admit(room, stream, claimed.entries.iter().map(|e| e.id.as_str()));
        let n = admitted.iter().filter(|a| **a).count();
        if n > 0 {
            log::info!(
                "{stream}: reclaimed {n} entries idle for over {:?}",
                config.reclaim_min_idle
            );
            Stats::add(&shared.stats.reclaimed, n as u64);
        }
        let job = deliveries(shared, stream, claimed.entries, &admitted, |id| {
            counts.get(id).copied().unwrap_or(1)
        });
        if !claimed.deleted.is_empty() {
            ack_deleted(shared, stream, &claimed.deleted, false);
        }
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
