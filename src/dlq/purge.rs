//! Deleting dead letters, by ids or by filter.

use crate::dlq::filter::Selection;
use crate::dlq::letter::dead_letter_stream;
use crate::dlq::read::fetch;
use crate::dlq::redis_error;
use crate::dlq::replay::{selected_ids, CHUNK};
use crate::error::Error;
use crate::redis::RedisConn;

/// What a purge did (or, in a dry run, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Nothing was removed.
    pub dry_run: bool,
    /// Entries removed (in a dry run: that would be).
    pub removed: usize,
    /// Ids asked for that are not in the dead-letter stream.
    pub not_found: Vec<String>,
}

/// Deletes the selected dead letters of `stream` (a dry run only counts
/// them).
pub fn purge(
    conn: &mut RedisConn,
    stream: &str,
    selection: &Selection,
    dry_run: bool,
) -> Result<PurgeReport, Error> {
    let dlq = dead_letter_stream(stream);
    let ids = selected_ids(conn, stream, selection)?;
    let mut report = PurgeReport {
        dry_run,
        ..PurgeReport::default()
    };
    for chunk in ids.chunks(CHUNK * 5) {
        if dry_run {
            for (id, fields) in chunk.iter().zip(fetch(conn, &dlq, chunk)?) {
                match fields {
                    Some(_) => report.removed += 1,
                    None => report.not_found.push(id.clone()),
                }
            }
            continue;
        }
        let mut pipe = redis::pipe();
        for id in chunk {
            pipe.cmd("XDEL").arg(&dlq).arg(id);
        }
        let deleted: Vec<u64> = pipe.query(conn).map_err(redis_error(&dlq))?;
        for (id, n) in chunk.iter().zip(deleted) {
            if n == 0 {
                report.not_found.push(id.clone());
            } else {
                report.removed += 1;
            }
        }
    }
    Ok(report)
}
