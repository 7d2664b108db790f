//! The reclaimer thread: takes over entries that other consumers left pending.
//!
//! Every `reclaim_interval` it lists, with XPENDING, the entries of each
//! stream idle for `reclaim_min_idle` (they belong to a consumer that died,
//! or hangs), leaves out those this process holds itself, and claims the
//! rest with XCLAIM, which checks the idle time again, atomically. Claimed
//! entries take the normal path through the worker pool with their own
//! delivery counts, so an entry that kills every consumer still ends as a
//! `crash_loop` dead letter. Entries deleted from the stream while pending
//! become `trimmed` dead letters. Every ten minutes it also forgets, in
//! the dead-letter indexes, the entries gone from the stream for good.
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
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::redis::streams;
use crate::redis::RedisConn;
use crate::worker::context::{Claim, Common};
use crate::worker::dead_letter;
use crate::worker::delivery::{Delivery, Job};
use crate::worker::flow::{InFlight, Reservation};
use crate::worker::stats::{Server, Stats};

/// How often the dead-letter indexes are emptied of entries gone from
/// their stream (the first time at the first round).
const FORGET_EVERY: Duration = Duration::from_secs(600);

/// What the reclaimer thread holds.
pub(crate) struct Reclaimer {
    pub common: Common,
    pub flow: InFlight,
    pub claim: Claim,
    pub streams: Vec<Arc<str>>,
    /// Entries per claim.
    pub count: usize,
    /// How often it looks.
    pub interval: Duration,
    /// How long an entry must be idle to be taken over.
    pub min_idle: Duration,
}

impl Reclaimer {
    /// The reclaimer thread.
    pub fn run(self, jobs: &Sender<Job>) {
        let mut forgot_at: Option<Instant> = None;
        while !self.common.shutdown.sleep(self.interval) {
            for stream in &self.streams {
                if let Err(e) = self.reclaim_stream(stream, jobs) {
                    if crate::redis::is_outage(&e) {
                        self.common.health.down(Server::Redis, &e);
                    } else if !streams::is_nogroup(&e) {
                        log::error!("{stream}: reclaiming failed: {e}");
                    }
                }
            }
            if forgot_at.is_none_or(|at| at.elapsed() >= FORGET_EVERY) {
                forgot_at = Some(Instant::now());
                self.forget_gone_entries();
            }
        }
    }

    /// Empties the dead-letter indexes of entries gone from the streams
    /// (see [`dead_letter::forget_gone_entries`]); a failure is only logged:
    /// it is tried again in [`FORGET_EVERY`].
    fn forget_gone_entries(&self) {
        let now_ms = crate::dlq::millis(std::time::SystemTime::now());
        for stream in &self.streams {
            let forgotten = self.common.redis_conn().and_then(|mut conn| {
                let go_on = || !self.common.shutdown.is_shutdown();
                dead_letter::forget_gone_entries(
                    &mut conn,
                    stream,
                    &self.claim.group,
                    now_ms,
                    &go_on,
                )
            });
            match forgotten {
                Ok(0) => {}
                Ok(n) => log::info!(
                    "{stream}: forgot {n} entries gone from the stream in its dead-letter index"
                ),
                Err(e) if crate::redis::is_outage(&e) => {}
                Err(e) => log::warn!("{stream}: cannot prune its dead-letter index: {e}"),
            }
        }
    }

    /// Claims every idle entry of one stream, in batches that fit the
    /// in-flight room.
    fn reclaim_stream(&self, stream: &Arc<str>, jobs: &Sender<Job>) -> redis::RedisResult<()> {
        let common = &self.common;
        let min_idle = self.min_idle.as_millis() as u64;
        let mut after = "-".to_string();
        loop {
            let Some(room) = self.flow.reserve(self.count, &common.shutdown) else {
                return Ok(());
            };
            // Taken once there is room: one held while the reader's room
            // was full sat idle, and a Redis with a `timeout` closed it
            // (found in review).
            let mut conn = common.redis_conn()?;
            let taken = take(
                common,
                &self.flow,
                &self.claim,
                &mut conn,
                stream,
                min_idle,
                &after,
                room,
            )?;
            if taken.claimed > 0 {
                log::info!(
                    "{stream}: reclaimed {} entries idle for over {:?}",
                    taken.claimed,
                    self.min_idle
                );
                Stats::add(&common.stats.of(stream).reclaimed, taken.claimed as u64);
            }
            if !taken.job.is_empty() && jobs.send(taken.job).is_err() {
                return Ok(());
            }
            common.health.up(Server::Redis);
            match taken.last {
                Some(last) if !common.shutdown.is_shutdown() => after = last,
                _ => return Ok(()),
            }
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
#[allow(clippy::too_many_arguments)] // what a claim needs, each used once
pub(crate) fn take(
    common: &Common,
    flow: &InFlight,
    claim: &Claim,
    conn: &mut RedisConn,
    stream: &Arc<str>,
    min_idle_ms: u64,
    after: &str,
    room: Reservation,
) -> redis::RedisResult<Taken> {
    let own = (min_idle_ms == 0).then_some(claim.consumer.as_str());
    let places = room.places();
    let sent_at = Instant::now();
    let rows = streams::pending_rows(conn, stream, &claim.group, min_idle_ms, after, places, own)?;
    let last = (rows.len() == places)
        .then(|| rows.last().map(|r| r.id.clone()))
        .flatten();
    let held = flow.holds(stream, rows.iter().map(|r| r.id.as_str()));
    let free: Vec<streams::PendingRow> = rows
        .into_iter()
        .zip(held)
        .filter_map(|(row, held)| (!held).then_some(row))
        .collect();
    let claimed = streams::claim(
        conn,
        stream,
        &claim.group,
        &claim.consumer,
        min_idle_ms,
        &free,
        claim.limits.max_entry_bytes,
    )?;
    let (entries, counts): (Vec<_>, Vec<u64>) = claimed.entries.into_iter().unzip();
    // A deleted entry of this consumer's own is fenced by its count.
    let own_fence = |h: &streams::Holder| (h.consumer == claim.consumer).then_some(h.count);
    let admitted = entries
        .iter()
        .zip(&counts)
        .map(|(e, n)| (e.id.as_str(), Some(*n), e.bytes()))
        .chain(
            claimed
                .deleted
                .iter()
                .map(|(id, holder)| (id.as_str(), own_fence(holder), 0)),
        );
    let mut tickets = room.admit(stream, admitted);
    let deleted_tickets = tickets.split_off(entries.len());
    let n = tickets.iter().filter(|t| t.is_some()).count();
    let counts: std::collections::HashMap<String, u64> =
        entries.iter().map(|e| e.id.clone()).zip(counts).collect();
    let mut job = Delivery::from_entries(
        &common.stats,
        claim.limits,
        stream,
        entries,
        tickets,
        sent_at,
        |id| counts.get(id).copied().unwrap_or(1),
    );
    // Entries deleted meanwhile: `trimmed` dead letters with nothing but
    // their ids (what was known). One this process still holds is left to
    // its holder, which knows more. Another consumer's is fenced by that
    // consumer: if it settles the entry first (acks it, having found its
    // event applied), the letter is not written.
    job.extend(claimed.deleted.into_iter().zip(deleted_tickets).filter_map(
        |((id, holder), ticket)| {
            let ticket = ticket?;
            let fence = own_fence(&holder);
            let mut delivery =
                Delivery::trimmed(stream, id, Vec::new(), fence, Some(ticket), sent_at);
            delivery.holder = fence.is_none().then_some(holder);
            Some(delivery)
        },
    ));
    Ok(Taken {
        job,
        claimed: n,
        last,
    })
}
