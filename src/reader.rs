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

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::delivery::{Delivery, Job};
use crate::event::{Event, RawEntry};
use crate::redis_conn::RedisConn;
use crate::run::Shared;
use crate::stats::{Server, Stats};
use crate::streams;

/// Where the reader is in its stream.
enum Position {
    /// Re-reading this consumer's pending entries after the given id.
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
    let mut position = Position::Pending("0".into());
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
        let room = shared.in_flight.reserve(config.count, &shared.shutdown);
        if room == 0 {
            break;
        }
        let (block, from) = match &position {
            Position::Pending(after) => (None, after.as_str()),
            Position::New => (Some(config.block.as_millis() as u64), ">"),
        };
        let read = streams::read_group(
            c,
            &stream,
            &config.group,
            &config.consumer,
            room,
            block,
            from,
        )
        .and_then(|entries| {
            let counts = match (&position, entries.first(), entries.last()) {
                (Position::Pending(_), Some(first), Some(last)) => Some(streams::delivery_counts(
                    c,
                    &stream,
                    &config.group,
                    &config.consumer,
                    &first.id,
                    &last.id,
                    entries.len(),
                )?),
                _ => None,
            };
            Ok((entries, counts))
        });
        match read {
            Ok((entries, counts)) => {
                if failures > 0 {
                    shared.health.up(Server::Redis);
                    failures = 0;
                }
                if let Position::Pending(after) = &mut position {
                    match entries.last() {
                        Some(last) => *after = last.id.clone(),
                        None => position = Position::New,
                    }
                }
                let idle = entries.is_empty() && matches!(position, Position::New);
                let admitted =
                    shared
                        .in_flight
                        .admit(room, &stream, entries.iter().map(|e| e.id.as_str()));
                let job = deliveries(shared, &stream, entries, &admitted, |id| {
                    counts
                        .as_ref()
                        .and_then(|c| c.get(id).copied())
                        .unwrap_or(1)
                });
                if !job.is_empty() && jobs.send(job).is_err() {
                    break;
                }
                shared.reader_idle[index].store(idle, Ordering::SeqCst);
            }
            Err(e) => {
                shared.in_flight.unreserve(room);
                shared.reader_idle[index].store(false, Ordering::SeqCst);
                if streams::is_nogroup(&e) {
                    log::warn!(
                        "{stream}: consumer group {} is gone (NOGROUP); creating it again",
                        config.group
                    );
                    if let Err(e) =
                        streams::ensure_group(c, &stream, &config.group, &config.start_id)
                    {
                        log::error!("{stream}: cannot create group {}: {e}", config.group);
                        shared.shutdown.sleep(Duration::from_secs(1));
                    }
                    position = Position::Pending("0".into());
                } else if crate::error::redis_is_outage(&e) {
                    shared.health.down(Server::Redis, &e);
                    conn = None;
                    position = Position::Pending("0".into());
                    failures += 1;
                    shared.shutdown.sleep(shared.outage_backoff(failures));
                } else {
                    log::error!("{stream}: XREADGROUP failed: {e}");
                    conn = None;
                    // The reply may have carried entries we never saw: they
                    // are pending for us, so re-read them first.
                    position = Position::Pending("0".into());
                    failures += 1;
                    shared.shutdown.sleep(shared.outage_backoff(failures));
                }
            }
        }
    }
    log::debug!("{stream}: reader stopped");
}

/// Turns raw entries into deliveries. Entries deleted while pending are acked
/// at once (nothing is left to process); entries this process already holds
/// are skipped.
pub(crate) fn deliveries(
    shared: &Shared,
    stream: &Arc<str>,
    entries: Vec<RawEntry>,
    admitted: &[bool],
    delivery_count: impl Fn(&str) -> u64,
) -> Job {
    let mut job = Vec::with_capacity(entries.len());
    let mut deleted = Vec::new();
    for (entry, admitted) in entries.into_iter().zip(admitted) {
        if !admitted {
            continue;
        }
        Stats::add(&shared.stats.read, 1);
        let Some(fields) = entry.fields else {
            deleted.push(entry.id);
            continue;
        };
        let count = delivery_count(&entry.id);
        let body = Event::parse(
            stream.clone(),
            entry.id.clone(),
            fields,
            count,
            shared.limits,
        );
        job.push(Delivery {
            stream: stream.clone(),
            entry_id: entry.id,
            body,
            delivery_count: count,
            failures: Vec::new(),
        });
    }
    if !deleted.is_empty() {
        ack_deleted(shared, stream, &deleted, true);
    }
    job
}

/// Acks entries that were deleted from the stream while pending. `admitted`:
/// whether this process admitted them to its in-flight set (a reader did; the
/// reclaimer's deleted ids were never admitted, and must not release keys
/// that a worker or the retry thread may hold).
pub(crate) fn ack_deleted(shared: &Shared, stream: &str, ids: &[String], admitted: bool) {
    log::warn!(
        "{stream}: {} entries were deleted while pending ({}...); acking them, nothing is left to process",
        ids.len(),
        ids[0]
    );
    Stats::add(&shared.stats.deleted_while_pending, ids.len() as u64);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let acked = shared
        .redis_conn()
        .and_then(|mut c| streams::ack(&mut c, stream, &shared.config.group, &refs));
    if let Err(e) = acked {
        log::error!("{stream}: cannot ack deleted entries: {e}");
    }
    if admitted {
        for id in ids {
            shared.in_flight.finish(&crate::in_flight::key(stream, id));
        }
    }
}
