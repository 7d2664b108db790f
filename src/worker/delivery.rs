//! A delivery: one stream entry on its way through the worker, with what has
//! happened to it so far in this process and the proof that this consumer
//! still owns it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dlq::Attempt;
use crate::event::{value_in, Event, Fields, Invalid, Limits, RawEntry};
use crate::redis::streams::{Holder, Seen};
use crate::worker::flow::Ticket;
use crate::worker::stats::Stats;

/// An entry held this long since Redis last gave it to this consumer is
/// checked (and its idle time reset) before its outcome is committed: no
/// other consumer can have claimed it sooner, since claims need an idle
/// time of at least `reclaim_min_idle`, which is at least twice this.
pub(crate) const FRESH: Duration = Duration::from_secs(1);

/// An entry read from a stream, valid or not.
#[derive(Debug)]
pub(crate) struct Delivery {
    pub stream: Arc<str>,
    pub entry_id: String,
    pub body: Result<Event, (Fields, Invalid)>,
    /// Deliveries that reached a worker, this one included: the Redis
    /// delivery count, lowered by `Processor::count_start` for redeliveries
    /// that never started (entries queued behind a crash).
    pub delivery_count: u64,
    /// Redis's delivery count when this consumer got the entry: with the
    /// consumer name, the fence that proves it is still ours (a claim by
    /// anyone raises it). `None` for an entry that already left the pending
    /// list (XAUTOCLAIM reports trimmed entries that way).
    pub token: Option<u64>,
    /// The entry was deleted from its stream while pending; `body` has no
    /// fields then, and it is dead-lettered as `trimmed`.
    pub trimmed: bool,
    /// When this consumer last got (or refreshed) the entry: taken before
    /// the command was sent, so it is never later than Redis's own clock.
    pub held_since: Instant,
    /// Failed attempts in this process.
    pub failures: Vec<Attempt>,
    /// Earlier runs of the entry on any consumer that started and never
    /// finished (the crashes charged to it), as recorded when this
    /// delivery started: its history names them.
    pub unfinished: Vec<Attempt>,
    /// Connections lost while this event ran and other events committed:
    /// an event that kills its database session is a crash loop too.
    pub strikes: u32,
    /// The member this delivery's start was recorded under (its delivery
    /// count then), once recorded: an attempt that waits out an outage and
    /// runs again is still one start, and a start whose entry was claimed
    /// away is taken back.
    pub started_as: Option<u64>,
    /// Its place in the in-flight set, released when the delivery is
    /// dropped.
    pub ticket: Option<Ticket>,
    /// What the read script found for it (its marker, its place in the
    /// dead-letter index), when it looked: the fast path then asks nothing
    /// more.
    pub seen: Option<Seen>,
    /// Whether the event's whole effect is the built-in statement
    /// (`apply::plain`): asked once per attempt, by `Processor::process`,
    /// for the events it batches.
    pub plain: bool,
    /// Its read came back with as many new entries as it asked for: the
    /// stream is ahead of the workers (see `gather.rs`).
    pub behind: bool,
    /// Another consumer that holds this entry (a deleted entry found
    /// pending for it, see `reclaim.rs`): its dead letter is fenced by that
    /// consumer and count instead of this one's.
    pub holder: Option<Holder>,
}

/// The reason of a `trimmed` dead letter.
pub(crate) const TRIMMED: &str =
    "the entry was deleted from the stream (MAXLEN, XTRIM or XDEL) while it was pending, before it could be applied";

/// What the channel to the workers carries: entries of one stream.
pub(crate) type Job = Vec<Delivery>;

/// Cuts `job` into at most `parts` jobs of nearly equal size (see
/// `jobs_per_read` in `mod.rs`).
pub(crate) fn in_parts(mut job: Job, parts: usize) -> Vec<Job> {
    let size = job.len().div_ceil(parts.max(1)).max(1);
    let mut jobs = Vec::with_capacity(parts);
    while job.len() > size {
        let rest = job.split_off(size);
        jobs.push(job);
        job = rest;
    }
    if !job.is_empty() {
        jobs.push(job);
    }
    jobs
}

impl Delivery {
    /// Turns raw entries read (or claimed) at `sent_at` into deliveries, one
    /// per ticket: an entry without a ticket is held by this process already
    /// and is skipped. An entry deleted from the stream while pending (Redis
    /// returns it without fields) becomes a delivery to dead-letter as
    /// `trimmed`.
    pub fn from_entries(
        stats: &Stats,
        limits: Limits,
        stream: &Arc<str>,
        entries: Vec<RawEntry>,
        tickets: Vec<Option<Ticket>>,
        sent_at: Instant,
        delivery_count: impl Fn(&str) -> u64,
    ) -> Job {
        let mut job = Vec::with_capacity(entries.len());
        for (entry, ticket) in entries.into_iter().zip(tickets) {
            let Some(ticket) = ticket else { continue };
            Stats::add(&stats.of(stream).read, 1);
            let count = delivery_count(&entry.id);
            let (body, trimmed) = match entry.fields {
                Some(fields) => (
                    Event::parse(
                        stream.clone(),
                        entry.id.clone(),
                        fields,
                        entry.cut,
                        count,
                        limits,
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
                unfinished: Vec::new(),
                strikes: 0,
                started_as: None,
                ticket: Some(ticket),
                seen: entry.seen,
                plain: false,
                behind: false,
                holder: None,
            });
        }
        job
    }

    /// A delivery of an entry deleted from its stream while pending, known
    /// by its id (and the event id when `known` has it): a `trimmed` dead
    /// letter to be.
    pub fn trimmed(
        stream: &Arc<str>,
        entry_id: String,
        known: Fields,
        fence: Option<u64>,
        ticket: Option<Ticket>,
        at: Instant,
    ) -> Delivery {
        Delivery {
            stream: stream.clone(),
            entry_id,
            body: Err((known, Invalid(TRIMMED.into()))),
            delivery_count: 1,
            token: fence,
            trimmed: true,
            held_since: at,
            failures: Vec::new(),
            unfinished: Vec::new(),
            strikes: 0,
            started_as: None,
            ticket,
            seen: None,
            plain: false,
            behind: false,
            holder: None,
        }
    }

    pub fn event_id(&self) -> Option<&str> {
        match &self.body {
            Ok(event) => Some(event.event_id()),
            Err((fields, _)) => {
                value_in(fields, b"event_id").and_then(|v| std::str::from_utf8(v).ok())
            }
        }
    }

    /// The delivery count that proves this consumer still owns the entry:
    /// that of the latest delivery to this process (see `Ticket::token`).
    pub fn fence(&self) -> Option<u64> {
        self.ticket.as_ref().and_then(Ticket::token).or(self.token)
    }

    /// Whether its ownership must be checked with Redis before its outcome
    /// is committed (see [`FRESH`]).
    pub fn held_long(&self) -> bool {
        self.held_since.elapsed() >= FRESH
    }

    /// Attempts made before this delivery: each earlier delivery that did not
    /// finish counts as one (it crashed or was stopped).
    pub fn prior_attempts(&self) -> u32 {
        u32::try_from(self.delivery_count.saturating_sub(1)).unwrap_or(u32::MAX)
    }

    /// Attempts so far, failed ones in this process included.
    pub fn attempts(&self) -> u32 {
        self.prior_attempts()
            .saturating_add(u32::try_from(self.failures.len()).unwrap_or(u32::MAX))
    }

    /// The full history: unreported earlier deliveries (the runs recorded
    /// as started and never finished, with when and where, after the first
    /// delivery's), then this process's failures.
    pub fn history(&self) -> Vec<Attempt> {
        let prior = self.prior_attempts() as usize;
        let named = self.unfinished.len().min(prior);
        let unnamed = (0..prior - named).map(|_| Attempt {
            attempt: 0,
            at: None,
            error: "delivered but never finished (the consumer stopped or crashed)".into(),
        });
        let runs = self.unfinished[self.unfinished.len() - named..]
            .iter()
            .cloned();
        let mut history: Vec<Attempt> = unnamed.chain(runs).collect();
        for (i, attempt) in history.iter_mut().enumerate() {
            attempt.attempt = u32::try_from(i + 1).unwrap_or(u32::MAX);
        }
        history.extend(self.failures.iter().cloned());
        history
    }
}
