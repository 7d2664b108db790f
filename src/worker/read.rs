//! Step 1 of a message's path: a reader thread per stream pulls batches with
//! `XREADGROUP ... BLOCK` and sends them over the bounded channel to the
//! worker pool.
//!
//! Each reader has its own Redis connection (not from the pool) whose read
//! timeout is longer than BLOCK: a shorter timeout would drop the connection
//! while Redis is delivering, stranding entries in this consumer's pending
//! list. On start, and after every reconnect, the reader first re-reads this
//! consumer's own pending entries (`0`) before new ones (`>`). It reserves room
//! in the in-flight set before each read, so a slow database slows reading.
//!
//! When the group disappears (`XGROUP DESTROY`, a Redis restarted without
//! persistence), the reader creates it again: at `0` for a group that
//! started there (every entry is delivered again; the duplicate markers,
//! `processed_events` and the dead-letter index settle them), and, for a
//! group that started at `$`, at the last id this reader saw, so entries
//! added meanwhile are not skipped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::event::{Event, Invalid, RawEntry};
use crate::redis::streams;
use crate::redis::RedisConn;
use crate::worker::delivery::{Delivery, Job};
use crate::worker::flow::Ticket;
use crate::worker::stats::{Server, Stats};
use crate::worker::Shared;

/// Where the reader is in its stream.
enum Position {
    /// Re-reading this consumer's pending entries after the given id (`-`
    /// for the start).
    Pending(String),
    /// Reading new entries.
    New,
}

/// The reader thread of stream number `index`.
pub(crate) fn reader_thread(shared: &Shared, index: usize, jobs: &Sender<Job>) {
    let stream: Arc<str> = shared.config.streams[index].as_str().into();
    let config = &shared.config;
    let read_timeout = config.block + Duration::from_secs(5);
    let mut conn: Option<RedisConn> = None;
    let mut position = Position::Pending("-".into());
    // The newest entry id this reader saw, where a `$` group is created
    // again.
    let mut last_seen: Option<String> = None;
    let mut failures = 0u32;
    while !shared.shutdown.is_shutdown() {
        let c = match conn.as_mut() {
            Some(c) => c,
            None => match shared.redis_client.connect(read_timeout) {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    shared.health.down(Server::Redis, &e);
                    failures += 1;
                    shared.shutdown.sleep(shared.outage_backoff(failures));
                    continue;
                }
            },
        };
        let Some(room) = shared.in_flight.reserve(config.count, &shared.shutdown) else {
            break;
        };
        let read = match &position {
            // This consumer's own pending entries (after a start or a
            // reconnect), but not those this process holds already.
            Position::Pending(after) => {
                crate::worker::reclaim::take(shared, c, &stream, 0, after, room).map(|taken| {
                    position = match taken.last {
                        Some(last) => Position::Pending(last),
                        None => Position::New,
                    };
                    (taken.job, false)
                })
            }
            Position::New => {
                let sent_at = Instant::now();
                read_new(shared, c, &stream, room.places()).map(|entries| {
                    let idle = entries.is_empty();
                    if let Some(last) = entries.last() {
                        if last_seen.as_deref().is_none_or(|l| newer(&last.id, l)) {
                            last_seen = Some(last.id.clone());
                        }
                    }
                    let tickets = room.admit(
                        &stream,
                        entries.iter().map(|e| (e.id.as_str(), Some(1), e.bytes())),
                    );
                    let job = deliveries(shared, &stream, entries, tickets, sent_at, |_| 1);
                    (job, idle)
                })
            }
        };
        match read {
            Ok((job, idle)) => {
                if failures > 0 {
                    shared.health.up(Server::Redis);
                    failures = 0;
                }
                if !job.is_empty() && jobs.send(job).is_err() {
                    break;
                }
                shared.reader_idle[index].store(idle, Ordering::SeqCst);
            }
            Err(e) => {
                shared.reader_idle[index].store(false, Ordering::SeqCst);
                // Whatever went wrong, what this consumer may have been given
                // is pending for it: re-read that first.
                position = Position::Pending("-".into());
                if streams::is_nogroup(&e) {
                    let start = match (config.start_id.as_str(), &last_seen) {
                        ("$", Some(last)) => last.clone(),
                        (start, _) => start.to_owned(),
                    };
                    log::warn!(
                        "{stream}: consumer group {} is gone (NOGROUP); creating it again at {start}",
                        config.group
                    );
                    if let Err(e) = streams::ensure_group(c, &stream, &config.group, &start) {
                        log::error!("{stream}: cannot create group {}: {e}", config.group);
                        shared.shutdown.sleep(Duration::from_secs(1));
                    }
                    continue;
                }
                if crate::error::redis_is_outage(&e) {
                    shared.health.down(Server::Redis, &e);
                } else {
                    log::error!("{stream}: reading failed: {e}");
                }
                conn = None;
                failures += 1;
                shared.shutdown.sleep(shared.outage_backoff(failures));
            }
        }
    }
    log::debug!("{stream}: reader stopped");
}

/// New entries: without blocking (cut down to the size limit in Redis), or,
/// when there are none, one entry blocking up to BLOCK (which arrives
/// whole, once, and is cut down as it is parsed).
fn read_new(
    shared: &Shared,
    c: &mut RedisConn,
    stream: &str,
    room: usize,
) -> redis::RedisResult<Vec<RawEntry>> {
    let config = &shared.config;
    let max = shared.limits.max_entry_bytes;
    let entries =
        streams::read_group_bounded(c, stream, &config.group, &config.consumer, room, ">", max)?;
    if !entries.is_empty() {
        return Ok(entries);
    }
    let block = config.block.as_millis() as u64;
    streams::read_group(
        c,
        stream,
        &config.group,
        &config.consumer,
        1,
        Some(block),
        ">",
    )
}

/// Whether stream entry id `a` comes after `b` (`<ms>-<seq>`).
fn newer(a: &str, b: &str) -> bool {
    let parse = |id: &str| -> (u64, u64) {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
    };
    parse(a) > parse(b)
}

/// Turns raw entries read (or claimed) at `sent_at` into deliveries, one per
/// ticket: an entry without a ticket is held by this process already and is
/// skipped. An entry deleted from the stream while pending (Redis returns it
/// without fields) becomes a delivery to dead-letter as `trimmed`.
pub(crate) fn deliveries(
    shared: &Shared,
    stream: &Arc<str>,
    entries: Vec<RawEntry>,
    tickets: Vec<Option<Ticket>>,
    sent_at: Instant,
    delivery_count: impl Fn(&str) -> u64,
) -> Job {
    let mut job = Vec::with_capacity(entries.len());
    for (entry, ticket) in entries.into_iter().zip(tickets) {
        let Some(ticket) = ticket else { continue };
        Stats::add(&shared.stats.read, 1);
        let count = delivery_count(&entry.id);
        let (body, trimmed) = match entry.fields {
            Some(fields) => (
                Event::parse(
                    stream.clone(),
                    entry.id.clone(),
                    fields,
                    entry.cut,
                    count,
                    shared.limits,
                ),
                false,
            ),
            None => (Err((Vec::new(), Invalid(TRIMMED.into()))), true),
        };
        job.push(Delivery {
            stream: stream.clone(),
            entry_id: entry.id,
            body,
            delivery_count: count,
            token: Some(count),
            trimmed,
            held_since: sent_at,
            failures: Vec::new(),
            strikes: 0,
            start_counted: false,
            ticket: Some(ticket),
        });
    }
    job
}

/// The reason of a `trimmed` dead letter.
pub(crate) const TRIMMED: &str =
    "the entry was deleted from the stream (MAXLEN, XTRIM or XDEL) while it was pending, before it could be applied";

#[cfg(test)]
mod tests {
    use super::newer;

    #[test]
    fn entry_ids_compare_as_numbers() {
        assert!(newer("10-0", "9-5"));
        assert!(newer("9-10", "9-9"));
        assert!(!newer("9-9", "9-9"));
    }
}
