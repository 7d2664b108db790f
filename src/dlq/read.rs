//! Reading dead letters: newest first, a page per round trip, each entry
//! cut down in Redis if it is very large; [`list`] reads about as many as it
//! returns and stops at a budget, [`show`] reads one whole.

use std::time::{Duration, Instant};

use crate::dlq::filter::{check_ids, Filter};
use crate::dlq::letter::{dead_letter_stream, DeadLetter};
use crate::dlq::redis_error;
use crate::error::{Error, ErrorKind};
use crate::event::{parse_entry_pairs, Fields};
use crate::redis::RedisConn;
/// Dead letters read per round trip, at most.
pub(crate) const PAGE: usize = 100;

/// A dead letter larger than this (an event of over about 250 KB, or a
/// letter of an older version, which kept whole payloads or whole error
/// texts) is read cut down, keeping [`LETTER_KEEP`] bytes of each field,
/// by the scans that list and filter; `show` and `replay` read it whole.
/// What a letter says about itself (its reason, its history: see
/// `letter::REASON_MAX`) fits whole in that.
const LETTER_READ_MAX: usize = 256 * 1024;
const LETTER_KEEP: usize = 16 * 1024;

/// How far one listing scans before it stops and says where it got (a
/// filter that matches nothing must not read a whole stream per request).
const LIST_BUDGET_ENTRIES: usize = 10_000;
const LIST_BUDGET_TIME: Duration = Duration::from_secs(2);

/// Where a scan stopped.
#[derive(Debug, Default)]
pub(crate) struct Scanned {
    /// Entries read.
    pub entries: usize,
    /// The last id read, when the scan stopped because of its budget with
    /// more entries left.
    pub stopped_at: Option<String>,
}

/// XREVRANGE, cut down by `streams::BOUND`. ARGV[4..]: end, count.
const REVRANGE_BOUNDED: &str = r"
return bound(redis.call('XREVRANGE', KEYS[1], ARGV[4], '-', 'COUNT', ARGV[5]))
";

/// Walks the dead-letter stream newest first, from `before` (exclusive) or
/// the end, until `visit` returns false, in pages of `first_page` entries
/// growing to [`PAGE`] (a listing of 20 reads about 20). With a `budget`
/// (entries, time), it stops there and says where.
pub(crate) fn scan(
    conn: &mut RedisConn,
    dlq: &str,
    before: Option<&str>,
    first_page: usize,
    budget: Option<(usize, Duration)>,
    mut visit: impl FnMut(String, Fields) -> bool,
) -> Result<Scanned, Error> {
    if let Some(id) = before.filter(|id| !crate::dlq::filter::is_millisecond(id)) {
        check_ids(std::slice::from_ref(&id.to_owned()))?;
    }
    let started = Instant::now();
    let mut scanned = Scanned::default();
    let mut end = before.map_or_else(|| "+".to_owned(), |id| format!("({id}"));
    let mut page = first_page.clamp(1, PAGE);
    loop {
        let mut cmd = crate::redis::streams::bounded_keeping(
            REVRANGE_BOUNDED,
            dlq,
            LETTER_READ_MAX,
            LETTER_KEEP,
        );
        cmd.arg(&end).arg(page);
        let value: redis::Value = cmd.query(conn).map_err(redis_error(dlq))?;
        let entries = parse_entry_pairs(value)
            .map_err(|e| Error::new(ErrorKind::Redis, format!("{dlq}: {e}")))?;
        let n = entries.len();
        let Some(last) = entries.last() else {
            return Ok(scanned);
        };
        end = format!("({}", last.0);
        for (id, fields) in entries {
            scanned.entries += 1;
            if let Some(fields) = fields {
                if !visit(id.clone(), fields) {
                    return Ok(scanned);
                }
            }
            let spent = budget.is_some_and(|(entries, time)| {
                scanned.entries >= entries || started.elapsed() >= time
            });
            if spent {
                scanned.stopped_at = Some(id);
                return Ok(scanned);
            }
        }
        if n < page {
            return Ok(scanned);
        }
        page = (page * 4).min(PAGE);
    }
}

fn decode(id: String, fields: &Fields, dlq: &str) -> Option<DeadLetter> {
    match DeadLetter::from_fields(Some(id.clone()), fields) {
        Ok(letter) => Some(letter),
        Err(why) => {
            log::warn!("{dlq}/{id}: not a readable dead letter ({why}); skipped");
            None
        }
    }
}

/// What a listing found.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Listing {
    /// The dead letters that matched, newest first.
    pub letters: Vec<DeadLetter>,
    /// Entries read to find them.
    pub scanned: usize,
    /// Set when the scan stopped at its budget (10,000 entries or 2 s)
    /// before the limit was reached: list again `before` this id to go on.
    pub stopped_at: Option<String>,
}

/// The dead letters of `stream` (in `<stream>:dlq`) that `filter` matches,
/// newest first, reading about as many entries as it returns (or, with
/// filters, at most 10,000 or for 2 s: then it says where it stopped).
/// Entries that cannot be decoded are skipped with a warning.
pub fn list(conn: &mut RedisConn, stream: &str, filter: &Filter) -> Result<Listing, Error> {
    let dlq = dead_letter_stream(stream);
    let mut letters = Vec::new();
    if filter.limit == Some(0) {
        return Ok(Listing::default());
    }
    let first_page = filter.limit.map_or(PAGE, |n| n + 1);
    let budget = Some((LIST_BUDGET_ENTRIES, LIST_BUDGET_TIME));
    let scanned = scan(
        conn,
        &dlq,
        filter.before.as_deref(),
        first_page,
        budget,
        |id, fields| {
            if let Some(letter) = decode(id, &fields, &dlq) {
                if filter.matches(&letter) {
                    letters.push(letter);
                }
            }
            filter.limit.is_none_or(|limit| letters.len() < limit)
        },
    )?;
    Ok(Listing {
        letters,
        scanned: scanned.entries,
        stopped_at: scanned.stopped_at,
    })
}

/// Calls `f` with each dead letter `filter` matches, newest first, up to its
/// limit, however many entries that takes.
pub(crate) fn each_match(
    conn: &mut RedisConn,
    stream: &str,
    filter: &Filter,
    mut f: impl FnMut(DeadLetter),
) -> Result<(), Error> {
    let dlq = dead_letter_stream(stream);
    if filter.limit == Some(0) {
        return Ok(());
    }
    let mut n = 0;
    scan(
        conn,
        &dlq,
        filter.before.as_deref(),
        PAGE,
        None,
        |id, fields| {
            if let Some(letter) = decode(id, &fields, &dlq) {
                if filter.matches(&letter) {
                    f(letter);
                    n += 1;
                }
            }
            filter.limit.is_none_or(|limit| n < limit)
        },
    )?;
    Ok(())
}

/// Ids of the entries `filter` matches, newest first (only the ids are kept,
/// so a large selection costs little memory).
pub(crate) fn matching_ids(
    conn: &mut RedisConn,
    stream: &str,
    filter: &Filter,
) -> Result<Vec<String>, Error> {
    let mut ids = Vec::new();
    each_match(conn, stream, filter, |letter| ids.extend(letter.id))?;
    Ok(ids)
}

/// Reads entries by id in one round trip: `None` for ids not in the stream.
pub(crate) fn fetch(
    conn: &mut RedisConn,
    dlq: &str,
    ids: &[String],
) -> Result<Vec<Option<Fields>>, Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for id in ids {
        pipe.cmd("XRANGE")
            .arg(dlq)
            .arg(id)
            .arg(id)
            .arg("COUNT")
            .arg(1);
    }
    let replies: Vec<redis::Value> = pipe.query(conn).map_err(redis_error(dlq))?;
    replies
        .into_iter()
        .map(|reply| {
            let mut entries = parse_entry_pairs(reply)
                .map_err(|e| Error::new(ErrorKind::Redis, format!("{dlq}: {e}")))?;
            Ok(entries.pop().and_then(|(_, fields)| fields))
        })
        .collect()
}

/// One dead letter by its id in `<stream>:dlq`; `None` when it is not there.
pub fn show(conn: &mut RedisConn, stream: &str, id: &str) -> Result<Option<DeadLetter>, Error> {
    let dlq = dead_letter_stream(stream);
    let ids = [id.to_owned()];
    check_ids(&ids)?;
    match fetch(conn, &dlq, &ids)?.pop().flatten() {
        None => Ok(None),
        Some(fields) => DeadLetter::from_fields(Some(id.to_owned()), &fields)
            .map(Some)
            .map_err(|why| {
                Error::new(
                    ErrorKind::Redis,
                    format!("{dlq}/{id}: not a readable dead letter: {why}"),
                )
            }),
    }
}
