//! Putting dead letters back on their stream after a fix (see the module
//! documentation of `dlq`).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime};

use crate::dlq::filter::{check_ids, Selection};
use crate::dlq::letter::millis;
use crate::dlq::letter::{dead_letter_stream, DeadLetter};
use crate::dlq::read::{fetch, matching_ids};
use crate::dlq::{bad_input, pg_error, redis_error};
use crate::error::Error;
use crate::event::Fields;
use crate::redis::RedisConn;

/// Dead letters handled per round trip.
pub(crate) const CHUNK: usize = 100;

/// The lowest replay rate, in letters a second.
pub(crate) const MIN_RATE: f64 = 0.001;

/// The audit fields a replay adds to an entry (earlier ones are replaced):
/// the dead-letter id it came from, when, how many times this event was
/// replayed, and the group whose letter it was with the stream it was put
/// back on, while that group reads the stream: every group reading the
/// stream receives the entry, and only that group applies it (the others
/// ack it as a duplicate of the original they had).
pub const REPLAY_FIELDS: [&str; 5] = [
    "replayed_from",
    "replayed_at",
    "replay_count",
    "replay_group",
    "replay_stream",
];

/// How a replay runs.
#[derive(Debug, Clone, Default)]
pub struct ReplayOptions {
    /// Report what would happen; change nothing.
    pub dry_run: bool,
    /// At most this many entries per second (`None`: as fast as possible).
    pub rate: Option<f64>,
    /// The idempotency scope to check (default: each dead letter's group,
    /// which is the worker's default scope).
    pub scope: Option<String>,
    /// The workers' `--max-entry-bytes`: a letter whose entry, put back
    /// with the replay's audit fields, would be larger is not replayed (the
    /// worker would cut it down to a letter that cannot be replayed): it
    /// stays, with the reason as its `error`. The workers that run publish
    /// their own limit in their consumer records, and the smallest of
    /// those and this one is kept to. `None`: only theirs.
    pub max_entry_bytes: Option<usize>,
}

/// Where "already processed" was looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessedCheck {
    /// `processed_events` in PostgreSQL: the truth. (The Redis markers are
    /// not asked: they speak for one database, which only PostgreSQL can
    /// name; without it, nothing is checked.)
    Postgres,
}

impl ProcessedCheck {
    /// `postgres` or `redis-marker`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessedCheck::Postgres => "postgres",
        }
    }
}

/// One dead letter of a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayItem {
    /// Its dead-letter id.
    pub id: String,
    /// Its event_id, when it has one.
    pub event_id: Option<String>,
    /// The stream it goes back to.
    pub stream: String,
    /// Its effect is already committed: the worker will skip it as a
    /// duplicate.
    pub already_processed: bool,
    /// Its new entry id in `stream` (`None` in a dry run or on failure).
    pub replayed_as: Option<String>,
    /// Why it could not be replayed (it stays in the dead-letter stream).
    pub error: Option<String>,
    /// Why its letter does not hold the whole event (see
    /// [`DeadLetter::incomplete`]): it is not replayed, in a dry run
    /// neither, and stays in the dead-letter stream. The way out is to
    /// produce the event again in full, or to purge the letter.
    pub incomplete: Option<String>,
}

impl ReplayItem {
    /// Whether it goes (or, in a dry run, would go) back on its stream.
    fn goes_back(&self, dry_run: bool) -> bool {
        self.error.is_none() && self.incomplete.is_none() && (dry_run || self.replayed_as.is_some())
    }
}

/// What a replay did (or, in a dry run, would do).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Nothing was changed.
    pub dry_run: bool,
    /// The dead letters found, in the order they were handled.
    pub items: Vec<ReplayItem>,
    /// Ids asked for that are not (or no longer) in the dead-letter stream.
    pub not_found: Vec<String>,
    /// Where "already processed" was looked up (`None`: nothing to check).
    pub checked_with: Option<ProcessedCheck>,
}

impl ReplayReport {
    /// Entries put back on their stream (in a dry run: that would be).
    pub fn replayed(&self) -> usize {
        self.items
            .iter()
            .filter(|i| i.goes_back(self.dry_run))
            .count()
    }

    /// Of those, how many the worker will skip as already processed.
    pub fn already_processed(&self) -> usize {
        self.items
            .iter()
            .filter(|i| i.goes_back(self.dry_run) && i.already_processed)
            .count()
    }

    /// Entries not replayed because their letter does not hold the whole
    /// event (they stay dead letters; see [`ReplayItem::incomplete`]).
    pub fn incomplete(&self) -> usize {
        self.items.iter().filter(|i| i.incomplete.is_some()).count()
    }

    /// Entries that could not be replayed (they stay dead letters).
    pub fn failed(&self) -> usize {
        self.items.iter().filter(|i| i.error.is_some()).count()
    }
}

/// XADD to the original stream and XDEL from the dead-letter stream, as one
/// atomic step, only when the dead letter is still there. The XADD comes
/// first: if it fails (say the key is not a stream), nothing was changed.
/// The entry names the letter's group (`replay_group`, first, and the
/// stream, `replay_stream`, so that a copy of it elsewhere is not taken
/// for a replay there) when that
/// group still reads the stream: only it applies the entry. A group that is
/// gone (renamed, say) names no one, and every group reading the stream
/// receives it, rather than none applying it.
/// The tag is recorded beside it (`keys::replays`): a worker honours only
/// a tag the replay wrote.
/// KEYS: dead-letter stream, original stream, its replays. ARGV:
/// dead-letter id, the letter's group, then field, value, field, value...
const REPLAY_SCRIPT: &str = r"
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return false end
local reads = false
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[2])
if ok and ARGV[2] ~= '' then
    for _, g in ipairs(groups) do
        for i = 1, #g, 2 do
            if g[i] == 'name' and g[i + 1] == ARGV[2] then reads = true end
        end
    end
end
local id
if reads then
    id = redis.call('XADD', KEYS[2], '*', 'replay_group', ARGV[2], 'replay_stream', KEYS[2],
        unpack(ARGV, 3))
    redis.call('HSET', KEYS[3], id, ARGV[2])
else
    id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
end
redis.call('XDEL', KEYS[1], ARGV[1])
return id
";

/// The fields a replayed entry carries: the original ones (earlier audit
/// fields dropped) and the new audit fields.
pub fn replay_fields(letter: &DeadLetter, now: SystemTime) -> Fields {
    let previous: u64 = letter
        .field("replay_count")
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut fields: Fields = letter
        .fields
        .iter()
        .filter(|(k, _)| !REPLAY_FIELDS.iter().any(|a| a.as_bytes() == k.as_slice()))
        .cloned()
        .collect();
    // `replay_group` is added by the script that puts the entry back, only
    // while that group reads the stream.
    let audit = [
        letter.id.clone().unwrap_or_default(),
        millis(now).to_string(),
        (previous + 1).to_string(),
    ];
    for (name, value) in REPLAY_FIELDS.iter().zip(audit) {
        fields.push((name.as_bytes().to_vec(), value.into_bytes()));
    }
    fields
}

/// Why `letter` is not put back under a limit of `max_entry_bytes`: its
/// entry with the audit fields (the group's two counted whether that group
/// reads the stream or not) would be over it. The worker would cut it down
/// and dead-letter it as `invalid`, keeping 256 bytes of each field: the
/// whole, replayable letter traded for one that cannot be replayed, the
/// event whole only in the stream until it is trimmed (found by a hostile
/// test: 4 of 7 events within 183 bytes of the limit).
pub(crate) fn over_limit(letter: &DeadLetter, limit: Limit) -> Option<String> {
    let max_entry_bytes = limit.bytes;
    let fields = replay_fields(letter, SystemTime::now());
    let stream = letter.stream.as_str();
    let group_fields = [
        ("replay_group", letter.group.as_str()),
        ("replay_stream", stream),
    ];
    let bytes = fields.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
        + group_fields
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>();
    let size = crate::event::size_of(bytes, fields.len() + group_fields.len());
    (size > max_entry_bytes).then(|| {
        let whose = if limit.published {
            " (of a worker reading the stream)"
        } else {
            ""
        };
        format!(
            "{size} bytes with the replay's fields > --max-entry-bytes {max_entry_bytes}{whose}: \
             the workers would cut it down; raise --max-entry-bytes (of the workers, and of this \
             replay), then replay it"
        )
    })
}

/// The size limit a replay keeps to for one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limit {
    pub bytes: usize,
    /// It is the `--max-entry-bytes` a running worker published, lower
    /// than the replay's own (or the replay has none).
    pub published: bool,
}

/// The limit for letters going back to `stream`: the smallest of `own`
/// and what the workers reading it publish (see
/// `name_check::smallest_published_limit`), looked up once per stream
/// (`known`). A failed look-up (a Redis user that may not run `XINFO` or
/// read `th:*`) leaves `own`, with a warning.
fn limit_for(
    conn: &mut RedisConn,
    stream: &str,
    own: Option<usize>,
    known: &mut HashMap<String, Option<Limit>>,
) -> Option<Limit> {
    if let Some(limit) = known.get(stream) {
        return *limit;
    }
    let published = crate::worker::name_check::smallest_published_limit(conn, stream)
        .unwrap_or_else(|e| {
            log::warn!(
                "{stream}: the workers' --max-entry-bytes could not be read from their records \
                 ({}); keeping to this replay's own",
                crate::error::chain(&e)
            );
            None
        });
    let limit = match (own, published) {
        (Some(own), Some(theirs)) if theirs < own => Some(Limit {
            bytes: theirs,
            published: true,
        }),
        (Some(own), _) => Some(Limit {
            bytes: own,
            published: false,
        }),
        (None, theirs) => theirs.map(|bytes| Limit {
            bytes,
            published: true,
        }),
    };
    known.insert(stream.to_owned(), limit);
    limit
}

/// Which of `letters` are already processed, in their scopes.
fn already_processed(
    pg: Option<&mut postgres::Client>,
    letters: &[DeadLetter],
    scope: Option<&str>,
) -> Result<Vec<bool>, Error> {
    if letters.is_empty() {
        return Ok(Vec::new());
    }
    let scope_of = |l: &DeadLetter| scope.unwrap_or(&l.group).to_owned();
    match pg {
        Some(pg) => {
            let mut by_scope: HashMap<String, Vec<String>> = HashMap::new();
            for l in letters {
                if let Some(id) = &l.event_id {
                    by_scope.entry(scope_of(l)).or_default().push(id.clone());
                }
            }
            let mut done: HashSet<(String, String)> = HashSet::new();
            for (scope, ids) in by_scope {
                let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                let found = crate::postgres::processed(pg, &scope, &ids)
                    .map_err(pg_error("cannot read processed_events"))?;
                for id in found {
                    done.insert((scope.clone(), id));
                }
            }
            Ok(letters
                .iter()
                .map(|l| {
                    l.event_id
                        .as_ref()
                        .is_some_and(|id| done.contains(&(scope_of(l), id.clone())))
                })
                .collect())
        }
        None => Ok(vec![false; letters.len()]),
    }
}

/// Puts the selected dead letters of `stream` back on their original stream
/// (see the module documentation). With `pg`, "already processed" is looked
/// up in `processed_events`, else not at all. `progress` is called
/// with (done, total) after each chunk. A filter selection is replayed oldest
/// first; ids in the order given.
pub fn replay(
    conn: &mut RedisConn,
    mut pg: Option<&mut postgres::Client>,
    stream: &str,
    selection: &Selection,
    options: &ReplayOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ReplayReport, Error> {
    if let Some(rate) = options.rate {
        // Below one a thousand seconds, the wait between two letters grew
        // past what a Duration holds (`--rate 1e-300` panicked half-way,
        // found by a hostile test), or past any sensible run.
        if !(rate.is_finite() && rate >= MIN_RATE) {
            return Err(bad_input(format!(
                "bad rate {rate}: expected at least {MIN_RATE} letters a second (one in about 17 minutes)"
            )));
        }
    }
    let dlq = dead_letter_stream(stream);
    let ids = selected_ids(conn, stream, selection)?;
    let total = ids.len();
    let mut report = ReplayReport {
        dry_run: options.dry_run,
        checked_with: pg.is_some().then_some(ProcessedCheck::Postgres),
        ..ReplayReport::default()
    };
    let started = Instant::now();
    let mut sent = 0usize;
    let mut done = 0usize;
    let mut limits = HashMap::new();
    for chunk in ids.chunks(CHUNK) {
        let done_sent = sent;
        let letters = read_chunk(conn, stream, chunk, &mut report)
            .map_err(|e| progress_error(e, &report, total))?;
        let processed = already_processed(pg.as_deref_mut(), &letters, options.scope.as_deref())
            .map_err(|e| progress_error(e, &report, total))?;
        // A letter that does not hold the whole event stays (and is
        // reported): put back, its cut-down event would be applied and
        // recorded processed, and the true one skipped as a duplicate ever
        // after.
        let mut items = Vec::with_capacity(letters.len());
        let mut whole = Vec::with_capacity(letters.len());
        for (l, p) in letters.into_iter().zip(processed) {
            let limit = limit_for(conn, &l.stream, options.max_entry_bytes, &mut limits);
            let item = ReplayItem {
                id: l.id.clone().unwrap_or_default(),
                event_id: l.event_id.clone(),
                stream: l.stream.clone(),
                already_processed: p,
                replayed_as: None,
                error: limit.and_then(|limit| over_limit(&l, limit)),
                incomplete: l.incomplete(),
            };
            if item.incomplete.is_some() || item.error.is_some() {
                report.items.push(item);
            } else {
                items.push(item);
                whole.push(l);
            }
        }
        let letters = whole;
        if options.dry_run {
            report.items.extend(items);
        } else {
            // Without a rate, one round trip per chunk; with one, one entry
            // at a time, each at its due time.
            let group = if options.rate.is_some() { 1 } else { CHUNK };
            let mut items = items.into_iter();
            for letters in letters.chunks(group) {
                if let Some(rate) = options.rate {
                    let due = started + Duration::from_secs_f64(sent as f64 / rate);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
                let results = put_back(conn, &dlq, letters)
                    .map_err(|e| progress_error(redis_error(&dlq)(e), &report, total))?;
                sent += letters.len();
                for (mut item, result) in items.by_ref().take(letters.len()).zip(results) {
                    match result {
                        Ok(Some(new_id)) => item.replayed_as = Some(new_id),
                        // Replayed or purged by someone else since it was read.
                        Ok(None) => {
                            report.not_found.push(item.id);
                            continue;
                        }
                        Err(e) => item.error = Some(format!("replay failed: {e}")),
                    }
                    report.items.push(item);
                }
                if options.rate.is_some() {
                    progress(done + sent - done_sent, total);
                }
            }
        }
        done += chunk.len();
        progress(done, total);
    }
    Ok(report)
}

/// The dead letters of `chunk` (ids in `stream`'s dead-letter stream); ids
/// gone meanwhile and entries that are not readable dead letters go to the
/// report.
fn read_chunk(
    conn: &mut RedisConn,
    stream: &str,
    chunk: &[String],
    report: &mut ReplayReport,
) -> Result<Vec<DeadLetter>, Error> {
    let fetched = fetch(conn, &dead_letter_stream(stream), chunk)?;
    let mut letters = Vec::with_capacity(chunk.len());
    for (id, fields) in chunk.iter().zip(fetched) {
        let letter = fields.map(|f| DeadLetter::from_fields(Some(id.clone()), &f));
        match letter {
            None => report.not_found.push(id.clone()),
            Some(Ok(letter)) => letters.push(letter),
            Some(Err(why)) => report.items.push(ReplayItem {
                id: id.clone(),
                event_id: None,
                stream: stream.to_owned(),
                already_processed: false,
                replayed_as: None,
                error: Some(format!("not a readable dead letter: {why}")),
                incomplete: None,
            }),
        }
    }
    Ok(letters)
}

/// Runs the replay script for each of `letters` in one pipelined round
/// trip; per letter, its new id on the original stream, `None` when it was
/// gone, or the error.
fn put_back(
    conn: &mut RedisConn,
    dlq: &str,
    letters: &[DeadLetter],
) -> redis::RedisResult<Vec<redis::RedisResult<Option<String>>>> {
    let now = SystemTime::now();
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    for l in letters {
        let mut eval = redis::cmd("EVAL");
        eval.arg(REPLAY_SCRIPT)
            .arg(3)
            .arg(dlq)
            .arg(&l.stream)
            .arg(crate::redis::keys::replays(&l.stream))
            .arg(l.id.as_deref().unwrap_or_default())
            .arg(&l.group);
        for (k, v) in replay_fields(l, now) {
            eval.arg(k).arg(v);
        }
        pipe.add_command(eval);
    }
    pipe.query(conn)
}

/// An error in the middle of a bulk operation, with how far it got.
fn progress_error(e: Error, report: &ReplayReport, total: usize) -> Error {
    let done = report.replayed();
    if done == 0 || report.dry_run {
        return e;
    }
    Error::with_source(
        e.kind(),
        format!("stopped after replaying {done} of {total} dead letters"),
        e,
    )
}

/// The ids a selection names: given ids as they are (checked), a filter's
/// matches oldest first.
pub(crate) fn selected_ids(
    conn: &mut RedisConn,
    stream: &str,
    selection: &Selection,
) -> Result<Vec<String>, Error> {
    match selection {
        Selection::Ids(ids) => {
            check_ids(ids)?;
            let mut seen = HashSet::new();
            Ok(ids.iter().filter(|id| seen.insert(*id)).cloned().collect())
        }
        Selection::Filter(filter) => {
            let mut ids = matching_ids(conn, stream, filter)?;
            ids.reverse();
            Ok(ids)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dlq::letter::tests::sample_letter;
    use std::time::UNIX_EPOCH;

    #[test]
    fn replay_fields_replace_earlier_audit_fields() {
        let letter = sample_letter(vec![
            (b"event_id".to_vec(), b"e".to_vec()),
            (b"replayed_from".to_vec(), b"3-0".to_vec()),
            (b"replay_count".to_vec(), b"2".to_vec()),
            (b"replay_group".to_vec(), b"earlier".to_vec()),
            (b"bin".to_vec(), vec![0, 255]),
        ]);
        let fields = replay_fields(&letter, UNIX_EPOCH + Duration::from_millis(42));
        let get = |n: &str| {
            let all: Vec<&Vec<u8>> = fields
                .iter()
                .filter(|(k, _)| k.as_slice() == n.as_bytes())
                .map(|(_, v)| v)
                .collect();
            assert_eq!(all.len(), 1, "{n} once");
            all[0].clone()
        };
        assert_eq!(get("event_id"), b"e");
        assert_eq!(get("bin"), vec![0, 255]);
        assert_eq!(get("replayed_from"), b"9-0");
        assert_eq!(get("replayed_at"), b"42");
        assert_eq!(get("replay_count"), b"3");
        assert!(
            !fields.iter().any(|(k, _)| k == b"replay_group"),
            "the earlier group dropped; the script names the new one"
        );
    }
}
