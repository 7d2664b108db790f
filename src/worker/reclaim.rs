//! The reclaimer thread: takes over entries that other consumers left pending.
//!
//! Every `reclaim_interval` it lists, with XPENDING, the entries of each
//! stream idle for `reclaim_min_idle` (they belong to a consumer that died,
//! or hangs), leaves out those this process holds itself, and claims the
//! rest with XCLAIM, which checks the idle time again, atomically. Claimed
//! entries take the normal path through the worker pool with their own
//! delivery counts, so an entry that kills every consumer still ends as a
//! `crash_loop` dead letter. Entries deleted from the stream while pending
//! become `trimmed` dead letters.
//!
//! If the original owner was only slow, it finds out before it commits (an
//! entry held for over a second is checked with Redis first) and stops
//! working on it; and if both still run the event, only one effect commits:
//! the `processed_events` key decides.
//!
//! The same [`take`] re-reads this consumer's own pending entries when a
//! reader starts or reconnects: listing them first changes nothing in Redis
//! for the ones this process still holds (their holders' ownership checks
//! stay valid), which XREADGROUP of the history would not.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::event::Invalid;
use crate::redis::streams;
use crate::redis::RedisConn;
use crate::worker::delivery::{Delivery, Job};
use crate::worker::flow::Reservation;
use crate::worker::read::{deliveries, TRIMMED};
use crate::worker::stats::{Server, Stats};
use crate::worker::Shared;

pub(crate) fn reclaim_thread(shared: &Shared, jobs: &Sender<Job>) {
    while !shared.shutdown.sleep(shared.config.reclaim_interval) {
        for stream in &shared.config.streams {
            let stream: Arc<str> = stream.as_str().into();
            if let Err(e) = reclaim_stream(shared, &stream, jobs) {
                if crate::error::redis_is_outage(&e) {
                    shared.health.down(Server::Redis, &e);
                } else if !streams::is_nogroup(&e) {
                    log::error!("{stream}: reclaiming failed: {e}");
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
    let min_idle = config.reclaim_min_idle.as_millis() as u64;
    let mut after = "-".to_string();
    loop {
        let Some(room) = shared.in_flight.reserve(config.count, &shared.shutdown) else {
            return Ok(());
        };
        let taken = take(shared, &mut conn, stream, min_idle, &after, room)?;
        if taken.claimed > 0 {
            log::info!(
                "{stream}: reclaimed {} entries idle for over {:?}",
                taken.claimed,
                config.reclaim_min_idle
            );
            Stats::add(&shared.stats.reclaimed, taken.claimed as u64);
        }
        if !taken.job.is_empty() && jobs.send(taken.job).is_err() {
            return Ok(());
        }
        shared.health.up(Server::Redis);
        match taken.last {
            Some(last) if !shared.shutdown.is_shutdown() => after = last,
            _ => return Ok(()),
        }
    }
}

/// What one [`take`] found.
pub(crate) struct Taken {
    /// The deliveries to process.
    pub job: Job,
    /// How many entries were claimed (not counting trimmed ones).
    pub claimed: usize,
    /// The last pending id listed, to go on after; `None` when the list was
    /// shorter than the room (nothing more to list).
    pub last: Option<String>,
}

/// Lists up to `room` pending entries after `after` that have been idle for
/// `min_idle_ms` (of this consumer only, when `min_idle_ms` is 0: a re-read
/// of its own), claims those this process does not hold, and turns them into
/// deliveries: entries cut down to the size limit, and `trimmed` deliveries
/// for entries deleted from the stream meanwhile.
pub(crate) fn take(
    shared: &Shared,
    conn: &mut RedisConn,
    stream: &Arc<str>,
    min_idle_ms: u64,
    after: &str,
    room: Reservation,
) -> redis::RedisResult<Taken> {
    let config = &shared.config;
    let own = (min_idle_ms == 0).then_some(config.consumer.as_str());
    let places = room.places();
    let sent_at = Instant::now();
    let rows = streams::pending_rows(conn, stream, &config.group, min_idle_ms, after, places, own)?;
    let last = (rows.len() == places)
        .then(|| rows.last().map(|r| r.id.clone()))
        .flatten();
    let held = shared
        .in_flight
        .holds(stream, rows.iter().map(|r| r.id.as_str()));
    let free: Vec<streams::PendingRow> = rows
        .into_iter()
        .zip(held)
        .filter_map(|(row, held)| (!held).then_some(row))
        .collect();
    let claimed = streams::claim(
        conn,
        stream,
        &config.group,
        &config.consumer,
        min_idle_ms,
        &free,
        shared.limits.max_entry_bytes,
    )?;
    let (entries, counts): (Vec<_>, Vec<u64>) = claimed.entries.into_iter().unzip();
    let admitted = entries
        .iter()
        .zip(&counts)
        .map(|(e, n)| (e.id.as_str(), Some(*n), e.bytes()))
        .chain(
            claimed
                .deleted
                .iter()
                .map(|(id, fence)| (id.as_str(), *fence, 0)),
        );
    let mut tickets = room.admit(stream, admitted);
    let deleted_tickets = tickets.split_off(entries.len());
    let n = tickets.iter().filter(|t| t.is_some()).count();
    let counts: std::collections::HashMap<String, u64> =
        entries.iter().map(|e| e.id.clone()).zip(counts).collect();
    let mut job = deliveries(shared, stream, entries, tickets, sent_at, |id| {
        counts.get(id).copied().unwrap_or(1)
    });
    job.extend(trimmed(stream, claimed.deleted, deleted_tickets, sent_at));
    Ok(Taken {
        job,
        claimed: n,
        last,
    })
}

/// Deliveries for entries deleted from the stream while pending: `trimmed`
/// dead letters with nothing but their ids (what was known). One this
/// process still holds is left to its holder, which knows more.
fn trimmed(
    stream: &Arc<str>,
    ids: Vec<(String, Option<u64>)>,
    tickets: Vec<Option<crate::worker::flow::Ticket>>,
    sent_at: Instant,
) -> impl Iterator<Item = Delivery> + '_ {
    ids.into_iter()
        .zip(tickets)
        .filter_map(move |((entry_id, fence), ticket)| {
            let ticket = ticket?;
            Some(Delivery {
                stream: stream.clone(),
                entry_id,
                body: Err((Vec::new(), Invalid(TRIMMED.into()))),
                delivery_count: 1,
                token: fence,
                trimmed: true,
                held_since: sent_at,
                failures: Vec::new(),
                strikes: 0,
                start_counted: false,
                ticket: Some(ticket),
            })
        })
}
