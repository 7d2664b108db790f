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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::event::RawEntry;
use crate::redis::keys::Namespace;
use crate::redis::streams;
use crate::redis::{RedisClient, RedisConn};
use crate::worker::context::{outage_backoff, Claim, Common};
use crate::worker::delivery::{in_parts, Delivery, Job};
use crate::worker::flow::InFlight;
use crate::worker::name_check::NameCheck;
use crate::worker::reclaim::take;
use crate::worker::stats::Server;

/// What a reader thread holds.
pub(crate) struct Reader {
    pub common: Common,
    /// Where its own connection comes from (with a longer read timeout).
    pub client: RedisClient,
    pub flow: InFlight,
    pub claim: Claim,
    pub stream: Arc<str>,
    /// Entries per read.
    pub count: usize,
    /// Into how many jobs each read is cut (see `jobs_per_read` in `mod.rs`).
    pub parts: usize,
    /// How long one read blocks.
    pub block: Duration,
    /// Where a group created again starts (`0` or `$`).
    pub start_id: String,
    /// Set while the last read found nothing new (for `until_idle`).
    pub idle: Arc<AtomicBool>,
    /// The duplicate markers' namespace and scope: on one server, the read
    /// looks the markers of what it reads up in the same step.
    pub namespace: Namespace,
    pub scope: String,
    /// Its record as this consumer (two instances under one name).
    pub name: NameCheck,
}

/// Where the reader is in its stream.
enum Position {
    /// Re-reading this consumer's pending entries after the given id (`-`
    /// for the start).
    Pending(String),
    /// Reading new entries.
    New,
}

impl Reader {
    /// The reader thread: reads until shutdown (or until the channel to the
    /// workers is closed).
    pub fn run(self, jobs: &Sender<Job>) {
        let Reader {
            common,
            client,
            flow,
            claim,
            stream,
            ..
        } = &self;
        let read_timeout = self.block + Duration::from_secs(5);
        let mut conn: Option<RedisConn> = None;
        let mut position = Position::Pending("-".into());
        // The newest entry id this reader saw, where a `$` group is created
        // again.
        let mut last_seen: Option<String> = None;
        let mut failures = 0u32;
        // Whether the last read found the stream drained (see `read_new`).
        let mut drained = false;
        // (entry id, event id) of what a blocking read took and could not
        // record (see `read_new`): recorded before anything else.
        let mut unrecorded: Vec<(String, Vec<u8>)> = Vec::new();
        while !common.shutdown.is_shutdown() {
            let c = match conn.as_mut() {
                Some(c) => c,
                None => match client.connect(read_timeout) {
                    Ok(c) => conn.insert(c),
                    Err(e) => {
                        common.health.down(Server::Redis, &e);
                        failures += 1;
                        common.shutdown.sleep(outage_backoff(failures));
                        continue;
                    }
                },
            };
            if !unrecorded.is_empty() {
                let key = crate::redis::keys::in_flight_ids(stream, &claim.group);
                let mut hset = redis::cmd("HSET");
                hset.arg(&key).arg(&unrecorded);
                if let Err(e) = hset.query::<()>(c) {
                    let what = "recording what a blocking read took";
                    back_off(common, stream, what, &e, &mut failures);
                    conn = None;
                    continue;
                }
                unrecorded.clear();
            }
            if let Err(e) = self.name.refresh(common, c) {
                // Not a reason to stop reading (see `NameCheck::refresh`):
                // a new connection, and the read; a server that is down
                // shows there.
                log::debug!("{stream}: writing this consumer's record: {e}");
                conn = None;
                continue;
            }
            let Some(room) = flow.reserve(self.count, &common.shutdown) else {
                break;
            };
            let asked = room.places();
            let read = match &position {
                // This consumer's own pending entries (after a start or a
                // reconnect), but not those this process holds already.
                Position::Pending(after) => take(common, flow, claim, c, stream, 0, after, room)
                    .map(|taken| {
                        position = match taken.last {
                            Some(last) => Position::Pending(last),
                            None => Position::New,
                        };
                        (taken.job, false)
                    }),
                Position::New => self
                    .read_new(c, room.places(), &mut drained, &mut unrecorded)
                    .map(|(entries, sent_at)| {
                        let idle = entries.is_empty();
                        if let Some(last) = entries.last() {
                            if last_seen.as_deref().is_none_or(|l| newer(&last.id, l)) {
                                last_seen = Some(last.id.clone());
                            }
                        }
                        let tickets = room.admit(
                            stream,
                            entries.iter().map(|e| (e.id.as_str(), Some(1), e.bytes())),
                        );
                        // All it asked for: the stream is ahead (see
                        // `gather.rs`).
                        let behind = !idle && entries.len() >= asked;
                        let mut job = Delivery::from_entries(
                            &common.stats,
                            claim.limits,
                            stream,
                            entries,
                            tickets,
                            sent_at,
                            |_| 1,
                        );
                        job.iter_mut().for_each(|d| d.behind = behind);
                        (job, idle)
                    }),
            };
            match read {
                Ok((job, idle)) => {
                    if failures > 0 {
                        common.health.up(Server::Redis);
                        failures = 0;
                    }
                    let parts = parts_of(self.parts, job.len(), asked, !jobs.is_empty());
                    if in_parts(job, parts)
                        .into_iter()
                        .any(|job| jobs.send(job).is_err())
                    {
                        break;
                    }
                    self.idle.store(idle, Ordering::SeqCst);
                }
                Err(e) => {
                    self.idle.store(false, Ordering::SeqCst);
                    drained = false;
                    // Whatever went wrong, what this consumer may have been
                    // given is pending for it: re-read that first.
                    position = Position::Pending("-".into());
                    if streams::is_nogroup(&e) {
                        self.create_group_again(c, last_seen.as_deref());
                        continue;
                    }
                    back_off(common, stream, "reading", &e, &mut failures);
                    conn = None;
                }
            }
        }
        if let Some(c) = conn.as_mut() {
            self.name.forget(c);
        }
        log::debug!("{stream}: reader stopped");
    }

    /// New entries: without blocking (cut down to the size limit in Redis),
    /// or, when there are none, one entry blocking up to BLOCK (which
    /// arrives whole, once, and is cut down as it is parsed), then at once
    /// whatever else came, without blocking.
    ///
    /// Either way each entry's event id is recorded in the in-flight ids
    /// (`keys::in_flight_ids`) before the entries go to a worker thread: an
    /// entry deleted from the stream while pending is then settled by its
    /// event (`settle_trimmed` in `process.rs`: acked if the event was
    /// applied) even when it was still queued when its holder stopped or
    /// died. Before, only the fast path wrote them, and an applied event's
    /// second copy read ahead and then trimmed became a `trimmed` letter of
    /// an unknown event, beside the effect (found by the chaos run). The
    /// script records them in the same step as the read, and records (and
    /// looks up the markers of) what a blocking read took in the step that
    /// reads what came after it: if that step fails, the entry is not
    /// handed on, its event id is recorded (`unrecorded`) as soon as Redis
    /// answers again, and then the reader re-reads its pending entries.
    ///
    /// `drained`: the last read came back short of its room (it took all
    /// there was), so this one blocks at once: a read that would find
    /// nothing is a round trip for nothing, and one that blocks returns at
    /// once if anything came. Under a trickle an entry then costs two round
    /// trips to read, not four (an empty read, the blocking one, the
    /// in-flight ids, the markers); under a steady load of small bursts a
    /// read costs two calls, not three (at 4,000 events/s per event, 37%
    /// fewer calls to Redis, and 10 µs less of its CPU and 8 µs less of ours
    /// per event); under a backlog, where reads come back full, reads do not
    /// block first; an idle stream costs one blocking read per BLOCK.
    /// (Before, only a read that waited for its entry and found nothing
    /// after it counted as drained, so a burst was followed by an empty
    /// read, and so was every BLOCK of an idle stream.)
    fn read_new(
        &self,
        c: &mut RedisConn,
        room: usize,
        drained: &mut bool,
        unrecorded: &mut Vec<(String, Vec<u8>)>,
    ) -> redis::RedisResult<(Vec<RawEntry>, Instant)> {
        let claim = &self.claim;
        let in_flight = crate::redis::keys::in_flight_ids(&self.stream, &claim.group);
        let dead_index = crate::redis::keys::dead_letter_index(&self.stream, &claim.group);
        // Known once a database connection named the namespace.
        let ns = self.namespace.get();
        let prefix = (!ns.is_empty() && !c.is_cluster())
            .then(|| crate::redis::keys::marker_prefix(&ns, &self.scope));
        let keys = streams::ReadKeys {
            in_flight: &in_flight,
            dead_index: &dead_index,
            markers: prefix.as_deref().map(|prefix| (&ns, prefix)),
        };
        let (group, consumer) = (claim.group.as_str(), claim.consumer.as_str());
        let stream = &*self.stream;
        let read = |c: &mut RedisConn, count: usize, blocked: Vec<RawEntry>| {
            let who = (group, consumer);
            streams::read_group_bounded(c, stream, &keys, who, count, ">", claim.limits, blocked)
        };
        if !*drained {
            let sent_at = Instant::now();
            let entries = read(c, room, Vec::new())?;
            if !entries.is_empty() {
                *drained = entries.len() < room;
                return Ok((entries, sent_at));
            }
        }
        let block = self.block.as_millis() as u64;
        let max = claim.limits.max_entry_bytes;
        let blocked = streams::read_group(c, stream, group, consumer, 1, Some(block), ">", max)?;
        if blocked.is_empty() {
            // Nothing came for a whole BLOCK: still drained, the next read
            // blocks at once (a read script first would find nothing).
            *drained = true;
            return Ok((blocked, Instant::now()));
        }
        let more = room.saturating_sub(blocked.len());
        let ids: Vec<(String, Vec<u8>)> = blocked
            .iter()
            .filter_map(|e| {
                let event_id = streams::event_id_of(e, claim.limits.max_event_id_bytes)?;
                Some((e.id.clone(), event_id.to_vec()))
            })
            .collect();
        // The call below resets the idle time of what the blocking read
        // took: read at this time, however long the read waited for it (an
        // entry dated from before the wait was held over a second when it
        // came late in a long BLOCK, and took the slow path).
        let sent_at = Instant::now();
        let entries = match read(c, more, blocked) {
            Ok(entries) => entries,
            Err(e) => {
                // Not handed on, and pending for this consumer: its event
                // id is recorded first thing once Redis answers, before the
                // pending entries are read again (if it is deleted from the
                // stream meanwhile, that is how its event is known).
                unrecorded.extend(ids);
                return Err(e);
            }
        };
        *drained = entries.len() < room;
        Ok((entries, sent_at))
    }

    /// The group is gone: create it again, at `0`, or, for a group that
    /// started at `$`, at the last id this reader saw.
    fn create_group_again(&self, c: &mut RedisConn, last_seen: Option<&str>) {
        let (stream, group) = (&self.stream, &self.claim.group);
        let start = match (self.start_id.as_str(), last_seen) {
            ("$", Some(last)) => last.to_owned(),
            (start, _) => start.to_owned(),
        };
        log::warn!(
            "{stream}: consumer group {group} is gone (NOGROUP); creating it again at {start}"
        );
        if let Err(e) = streams::ensure_group(c, stream, group, &start) {
            log::error!("{stream}: cannot create group {group}: {e}");
            self.common.shutdown.sleep(Duration::from_secs(1));
        }
    }
}

/// A Redis call of a reader failed: an outage is shown in the health,
/// anything else logged; then the reader waits before trying again (on a
/// new connection).
fn back_off(common: &Common, stream: &str, what: &str, e: &redis::RedisError, failures: &mut u32) {
    if crate::redis::is_outage(e) {
        common.health.down(Server::Redis, e);
    } else {
        log::error!("{stream}: {what} failed: {e}");
    }
    *failures += 1;
    common.shutdown.sleep(outage_backoff(*failures));
}

/// Whether stream entry id `a` comes after `b` (`<ms>-<seq>`).
fn newer(a: &str, b: &str) -> bool {
    let parse = |id: &str| -> (u64, u64) {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
    };
    parse(a) > parse(b)
}

/// Into how many jobs a read of `read` entries is cut, `asked` for as many
/// (with `parts` from `jobs_per_read` in `mod.rs`: 1 in batch mode).
///
/// A read that came back full while jobs wait in the channel is a backlog:
/// every worker is busy anyway, and the read goes whole to one worker (a
/// drain of 100,000 events in per-event mode ran 5–8% slower with its reads
/// cut). A read that came back short (the live traffic of a stream that is
/// caught up, or entries this process holds already left out) is cut even
/// while jobs wait: whole in one worker, its events would run one after
/// another while the other workers are free. At 70% of its capacity under a
/// steady producer, per-event mode's whole reads of about 14 events kept
/// its p99 at a median 14.8 ms over eight runs, against 8.6 ms cut (lower
/// in seven pairs of eight: see docs/performance-log.md).
fn parts_of(parts: usize, read: usize, asked: usize, queued: bool) -> usize {
    if queued && read >= asked {
        1
    } else {
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::{newer, parts_of};

    #[test]
    fn only_a_full_read_behind_queued_jobs_goes_whole() {
        // Workers waiting: cut.
        assert_eq!(parts_of(8, 64, 64, false), 8);
        assert_eq!(parts_of(8, 14, 64, false), 8);
        // A backlog: whole.
        assert_eq!(parts_of(8, 64, 64, true), 1);
        // Live traffic behind a queued job: still cut.
        assert_eq!(parts_of(8, 14, 64, true), 8);
        // A read asked for less (little room left) that filled it.
        assert_eq!(parts_of(8, 10, 10, true), 1);
        // Batch mode never cuts.
        assert_eq!(parts_of(1, 14, 64, false), 1);
    }

    #[test]
    fn entry_ids_compare_as_numbers() {
        assert!(newer("10-0", "9-5"));
        assert!(newer("9-10", "9-9"));
        assert!(!newer("9-9", "9-9"));
    }
}
