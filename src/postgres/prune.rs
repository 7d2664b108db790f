//! `taskhub prune`: forget old `processed_events` rows, a few at a time.
//!
//! The table grows by one row per event for ever. A row older than the
//! retention can go when no duplicate of its event can arrive any more; the
//! trade-off is that one that does arrive later is applied again. The Redis
//! marker no longer protects it either once its TTL has passed, so a
//! retention shorter than the marker TTL is refused: it would give up the
//! arbiter while the cache still pretends to know.

use std::time::Duration;

use crate::error::{Error, ErrorKind};
use crate::postgres::blockers::LockWatch;

/// What [`prune`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pruned {
    /// Rows deleted.
    pub rows: u64,
    /// Transactions used.
    pub transactions: u64,
}

/// Deletes the `processed_events` rows handled more than `older_than` ago
/// (only those of `scope`, when given), `batch` rows per transaction so no
/// lock is held long, until none is left. Refuses an `older_than` shorter
/// than `marker_ttl` (the workers' duplicate-marker lifetime).
pub fn prune(
    database_url: &str,
    scope: Option<&str>,
    older_than: Duration,
    marker_ttl: Duration,
    batch: usize,
) -> Result<Pruned, Error> {
    if older_than < marker_ttl {
        return Err(Error::config(format!(
            "--older-than {} is shorter than the marker TTL {}: a duplicate could then be applied again while its marker still says it was not; give at least the marker TTL",
            humantime::format_duration(older_than),
            humantime::format_duration(marker_ttl)
        )));
    }
    if batch == 0 {
        return Err(Error::config("the batch size must be at least 1"));
    }
    crate::runtime::off_async(|| {
        let mut client = crate::postgres::connect::postgres(database_url)?;
        let _watch = LockWatch::begin(&mut client, database_url, "prune's delete");
        let seconds = older_than.as_secs_f64();
        let sql = "DELETE FROM processed_events WHERE ctid = ANY(ARRAY(
                       SELECT ctid FROM processed_events
                       WHERE handled_at < now() - make_interval(secs => $1)
                         AND ($2::text IS NULL OR scope = $2)
                       LIMIT $3))";
        let mut pruned = Pruned::default();
        loop {
            let n = client
                .execute(sql, &[&seconds, &scope, &(batch as i64)])
                .map_err(|e| {
                    Error::with_source(
                        ErrorKind::Postgres,
                        "cannot delete from processed_events",
                        e,
                    )
                })?;
            pruned.transactions += 1;
            pruned.rows += n;
            if n < batch as u64 {
                return Ok(pruned);
            }
        }
    })
}
