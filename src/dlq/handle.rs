//! [`DeadLetters`]: the dead-letter stream of one stream, behind one Redis
//! connection of its own; what `taskhub dlq` and embedding programs use.

use std::time::SystemTime;

use crate::dlq::archive::{archive, ArchiveReport, ArchiveTarget};
use crate::dlq::filter::{Filter, Selection};
use crate::dlq::letter::{dead_letter_stream, DeadLetter};
use crate::dlq::purge::{purge, PurgeReport};
use crate::dlq::read::{list, show, Listing};
use crate::dlq::redis_error;
use crate::dlq::replay::{replay, ReplayOptions, ReplayReport};
use crate::dlq::stats::{stats, Stats};
use crate::error::Error;
use crate::redis::RedisConn;
use crate::tls::Tls;

/// The dead letters of one stream (`<stream>:dlq`).
///
/// ```no_run
/// # fn main() -> Result<(), taskhub::Error> {
/// use taskhub::dlq::{DeadLetters, Filter};
/// let mut dead = DeadLetters::connect("redis://127.0.0.1:6379", &taskhub::Tls::default(), "tasks:events")?;
/// for letter in dead.list(&Filter { limit: Some(20), ..Filter::default() })?.letters {
///     println!("{} {} {}", letter.kind, letter.event_id.unwrap_or_default(), letter.reason);
/// }
/// # Ok(())
/// # }
/// ```
pub struct DeadLetters {
    conn: RedisConn,
    stream: String,
}

impl std::fmt::Debug for DeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetters")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl DeadLetters {
    /// Connects to Redis (one server or a cluster; `tls` for `rediss://`)
    /// for the dead letters of `stream`. On a cluster, `stream` and its
    /// dead-letter stream must share a hash slot.
    pub fn connect(redis_url: &str, tls: &Tls, stream: &str) -> Result<DeadLetters, Error> {
        let conn = crate::redis::connect(redis_url, tls)?;
        conn.check_stream(stream)?;
        Ok(DeadLetters {
            conn,
            stream: stream.to_owned(),
        })
    }

    /// The stream whose dead letters these are.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The dead-letter stream's name, `<stream>:dlq`.
    pub fn name(&self) -> String {
        dead_letter_stream(&self.stream)
    }

    /// How many dead letters there are (one `XLEN`).
    pub fn len(&mut self) -> Result<u64, Error> {
        let dlq = self.name();
        redis::cmd("XLEN")
            .arg(&dlq)
            .query(&mut self.conn)
            .map_err(redis_error(&dlq))
    }

    /// The consumer groups reading the stream, which share its dead
    /// letters (none when the stream does not exist).
    pub fn groups(&mut self) -> Result<Vec<String>, Error> {
        crate::redis::streams::group_names(&mut self.conn, &self.stream)
            .map(|names| {
                names
                    .into_iter()
                    .map(|n| String::from_utf8_lossy(&n).into_owned())
                    .collect()
            })
            .map_err(redis_error(&self.stream))
    }

    /// Whether there are none.
    pub fn is_empty(&mut self) -> Result<bool, Error> {
        Ok(self.len()? == 0)
    }

    /// Counts by kind and by reason fingerprint, oldest and latest.
    pub fn stats(&mut self, filter: &Filter) -> Result<Stats, Error> {
        stats(&mut self.conn, &self.stream, filter)
    }

    /// Dead letters newest first, through `filter`.
    pub fn list(&mut self, filter: &Filter) -> Result<Listing, Error> {
        list(&mut self.conn, &self.stream, filter)
    }

    /// One dead letter by its id in the dead-letter stream.
    pub fn show(&mut self, id: &str) -> Result<Option<DeadLetter>, Error> {
        show(&mut self.conn, &self.stream, id)
    }

    /// Puts the selected dead letters back on their stream (see the
    /// module's documentation); with `pg`, says which were already
    /// processed. `progress(done, total)` is called as it goes.
    pub fn replay(
        &mut self,
        pg: Option<&mut postgres::Client>,
        selection: &Selection,
        options: &ReplayOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<ReplayReport, Error> {
        replay(
            &mut self.conn,
            pg,
            &self.stream,
            selection,
            options,
            progress,
        )
    }

    /// Deletes the selected dead letters (with `dry_run`, only says which).
    pub fn purge(&mut self, selection: &Selection, dry_run: bool) -> Result<PurgeReport, Error> {
        purge(&mut self.conn, &self.stream, selection, dry_run)
    }

    /// Moves the dead letters that `filter` selects to `target`, `chunk`
    /// at a time (see the module's documentation).
    pub fn archive(
        &mut self,
        filter: &Filter,
        target: ArchiveTarget<'_>,
        chunk: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<ArchiveReport, Error> {
        archive(
            &mut self.conn,
            &self.stream,
            filter,
            target,
            chunk,
            progress,
        )
    }

    /// The current time, as the other calls see it (for callers that show
    /// ages next to what they read).
    pub fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}
