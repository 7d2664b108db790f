//! Operating a dead-letter stream (`<stream>:dlq`): what `taskhub dlq` does,
//! as plain functions over a Redis connection (and a PostgreSQL client where
//! one is needed), so a program or a web page can do the same.
//!
//! Everything goes through a [`DeadLetters`] handle, one per stream:
//!
//! - [`list`](DeadLetters::list) reads dead letters newest first, through a
//!   [`Filter`] (kind, reason substring or regex, time window, original
//!   fields, limit, and a `before` cursor for pagination);
//!   [`show`](DeadLetters::show) reads one; [`stats`](DeadLetters::stats)
//!   counts them by kind and by reason [`fingerprint`].
//! - [`replay`](DeadLetters::replay) puts dead letters back on their original stream with every
//!   original field (so the same `event_id`) plus the audit fields
//!   `replayed_from`, `replayed_at` and `replay_count`. The XADD and the XDEL
//!   from the dead-letter stream happen in one server-side script: atomic
//!   like MULTI/EXEC, but conditional, which MULTI/EXEC cannot be: an entry
//!   that is already gone (replayed or purged by someone else meanwhile) is
//!   not added again, and an XADD that fails deletes nothing. Events whose
//!   effect was already committed are skipped by the normal idempotency layer
//!   when a worker reads them; the report says how many there are, checked in
//!   `processed_events` (the arbiter) when PostgreSQL is at hand (else not
//!   checked). A letter that does not hold the whole event (see
//!   [`DeadLetter::incomplete`]) is not replayed: it is reported, and stays.
//! - [`purge`](DeadLetters::purge) deletes dead letters.
//! - [`archive`](DeadLetters::archive) moves dead letters older than a cutoff to the
//!   `dead_letters_archive` table or to a JSONL file, in chunks: copy (commit,
//!   or write + fsync), read the copy back and compare, and only then XDEL
//!   what was verified. An interruption at any moment leaves every entry in
//!   the stream, in the archive, or in both; never in neither. Running the
//!   archive again finishes the job (the table ignores rows it already has;
//!   a file may then hold an entry twice: readers key on
//!   `(stream, dead_letter_id)`).

mod archive;
pub(crate) mod filter;
mod handle;
mod json;
pub(crate) mod letter;
mod purge;
mod read;
mod replay;
mod stats;

pub use archive::{ArchiveReport, ArchiveTarget};
pub use filter::{parse_time, Filter, ReasonMatch, Selection};
pub use handle::DeadLetters;
pub use letter::{dead_letter_stream, with_gaps, Attempt, DeadLetter, Kind, UNFINISHED_RUN};
pub use purge::PurgeReport;
pub use read::Listing;
pub use replay::{ProcessedCheck, ReplayItem, ReplayOptions, ReplayReport};
pub use stats::{fingerprint, ReasonCount, Stats};

pub use crate::postgres::blockers::LockWatch;

pub(crate) use json::format_time;
pub(crate) use letter::millis;
pub(crate) use purge::purge;
pub(crate) use read::{list, show};
pub(crate) use replay::{replay, MIN_RATE};
pub(crate) use stats::{stats, stats_within};

use crate::error::{Error, ErrorKind};
use crate::postgres::connect;

/// A PostgreSQL client with the library's connect timeout. Like every
/// sync `postgres::Client`, use it off async runtimes' threads
/// (`spawn_blocking`): it starts a runtime of its own for each call, which
/// panics inside another.
pub fn connect_postgres(database_url: &str) -> Result<postgres::Client, Error> {
    connect::postgres(database_url)
}

/// While `client`'s session waits for another session's lock (a migration,
/// a `LOCK TABLE` left in an open transaction), logs at warn level who
/// holds it, after 5 s and then every 30 s, naming the step `what`; says
/// nothing otherwise. It asks on a connection of its own to `database_url`,
/// opened only once the step has run 5 s. Keep the watch as long as the
/// step runs: dropping it stops it.
pub fn watch_locks(client: &mut postgres::Client, database_url: &str, what: &str) -> LockWatch {
    LockWatch::begin(client, database_url, what)
}

pub(crate) fn redis_error(what: &str) -> impl Fn(redis::RedisError) -> Error + '_ {
    move |e| Error::with_source(ErrorKind::Redis, format!("{what}: Redis command failed"), e)
}

pub(crate) fn pg_error(what: &str) -> impl Fn(postgres::Error) -> Error + '_ {
    move |e| Error::with_source(ErrorKind::Postgres, what.to_owned(), e)
}

pub(crate) fn bad_input(message: impl Into<String>) -> Error {
    Error::config(message)
}
