//! The extension point: a [`Handler`] applies one event's effect inside the
//! transaction that also records the event as processed.
//!
//! Whatever the handler writes through the [`Tx`] commits together with the
//! `processed_events` row, or not at all. That is what makes the effect happen
//! exactly once: a redelivered event finds its row and is skipped, a failed one
//! leaves no row and can run again.

pub(crate) mod http;
pub(crate) mod sql;

use std::ops::{Deref, DerefMut};

use postgres::types::ToSql;
use postgres::{Error, Row, ToStatement};

use crate::error::HandlerError;
use crate::event::Event;

/// Applies events. Implement it for a struct, or wrap a closure with
/// [`handler_fn`].
///
/// A handler is shared by all worker threads, hence `Send + Sync`. It must do
/// its database work through `tx` (anything done elsewhere, such as an HTTP
/// call, is not undone by a rollback and must itself be idempotent, keyed by
/// [`Event::event_id`]).
pub trait Handler: Send + Sync + 'static {
    /// Applies the effect of `event` in `tx`. Returning an error rolls back
    /// the transaction; the error's class decides between retry, dead letter
    /// and waiting out an outage.
    fn handle(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError>;

    /// Applies several new events in one transaction (batch mode). The
    /// default calls [`handle`](Handler::handle) for each; override it with a
    /// set-based statement to save round trips. If an error names the
    /// failing event ([`HandlerError::for_event`], as the default does), that
    /// event takes the failure path and the others are handed to this method
    /// again: in the same transaction when the failed call sent no statement
    /// or a savepoint was taken before it, else in a new one; otherwise the
    /// events are applied one by one, each in its own transaction. Either
    /// way one bad event neither fails nor repeats the others' effects. (The
    /// default names no event when a statement fails because an earlier
    /// event's call left the transaction aborted and returned Ok.)
    fn handle_batch(&self, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        for (i, event) in events.iter().enumerate() {
            catch_panic(|| self.handle(event, tx)).map_err(|e| {
                if i > 0 && e.in_failed_transaction() {
                    // An earlier event's call failed a statement and
                    // returned Ok: this event is not to blame, and which
                    // one is shows only one by one.
                    e.for_no_event()
                } else {
                    e.for_event(i)
                }
            })?;
        }
        Ok(())
    }

    /// Checks an event before it is applied, before it joins a batch: an
    /// event this handler can never apply (a payload PostgreSQL cannot
    /// store, fields that cannot become an HTTP header) fails here, alone,
    /// instead of failing a batch and taking attempts. Return an
    /// [`HandlerError::invalid`] (or permanent) error to dead-letter it. A
    /// retryable error or a panic here is one failed attempt of this event
    /// alone, retried after its backoff like one of
    /// [`handle`](Handler::handle); an outage is tried again after a
    /// backoff, counting no attempt.
    /// Accepts every event by default.
    fn validate(&self, _event: &Event) -> Result<(), HandlerError> {
        Ok(())
    }

    /// Called once when the worker starts, with a database connection, to
    /// check the handler's configuration (for example, that its SQL
    /// prepares); again if the start is made again (after a stop and
    /// continue of the process interrupted it). An error stops the start-up:
    /// a statement that cannot work must not dead-letter every event. Does
    /// nothing by default.
    fn on_start(
        &self,
        _client: &mut postgres::Client,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(())
    }

    /// Whether batch mode may run several events in one transaction. Say no
    /// when the handler has effects a rollback cannot undo (an HTTP call): a
    /// failed batch is retried, which would repeat them. Defaults to true.
    fn supports_batches(&self) -> bool {
        true
    }

    /// The retries this handler's failures deserve, when they differ from
    /// the worker's (`max_attempts`, `backoff_base`, `backoff_cap`): an HTTP
    /// downstream recovers in seconds to minutes (a deploy, a rate limit),
    /// a database conflict in milliseconds. Defaults to `None`: the
    /// worker's settings.
    fn retry_budget(&self) -> Option<RetryBudget> {
        None
    }

    /// The built-in [`SqlHandler`](crate::SqlHandler) that would apply
    /// `event`, when this handler's whole effect for it is that handler's:
    /// taskhub may then skip [`handle`](Handler::handle) and fold the
    /// default statement into the dedup insert (one PostgreSQL round trip
    /// less per event in per-event mode); for any other statement, the
    /// worker readies the session so that the `SqlHandler`'s batch form runs
    /// it for a whole batch in one call. `SqlHandler` returns itself; a
    /// wrapper that adds nothing inside the transaction may return the one it
    /// wraps. Defaults to `None`: `handle` runs. It must not panic: it is
    /// asked in the middle of a batch's work, and a panic there leaves the
    /// whole read pending, to be read again (put a check that may fail in
    /// [`validate`](Handler::validate), where a panic costs its event one
    /// attempt).
    fn sql_effect(&self, _event: &Event) -> Option<&crate::SqlHandler> {
        None
    }

    /// Called after the event's transaction committed (a lifecycle hook for
    /// metrics and tests; it cannot fail the event). Does nothing by default.
    fn committed(&self, _event: &Event) {}

    /// A short name for logs. Defaults to `"handler"`.
    fn name(&self) -> &str {
        "handler"
    }
}

/// How many attempts an event gets and how long the waits between them are
/// (exponential from `base`, capped at `cap`, with jitter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryBudget {
    /// All attempts, the first included.
    pub max_attempts: u32,
    /// The first wait (before jitter).
    pub base: std::time::Duration,
    /// The longest wait (before jitter).
    pub cap: std::time::Duration,
}

impl RetryBudget {
    /// `max_attempts` attempts, waits from `base` doubling up to `cap`.
    pub fn new(
        max_attempts: u32,
        base: std::time::Duration,
        cap: std::time::Duration,
    ) -> RetryBudget {
        RetryBudget {
            max_attempts,
            base,
            cap,
        }
    }
}

/// The open PostgreSQL transaction of one event, with a per-connection cache
/// of prepared statements.
///
/// It dereferences to [`postgres::Transaction`], so everything a transaction
/// does works as usual. `execute`, `query`, `query_one`, `query_opt`,
/// `batch_execute`, `prepare` and [`prepare_cached`](Tx::prepare_cached) are
/// its own, with the same signatures: they also note the server's error of a
/// statement, so that a handler that ignores one and returns `Ok` (or
/// returns the next statement's "current transaction is aborted") has its
/// attempt fail with that error named. Statements sent another way (through
/// `&mut **tx` or a `GenericClient` helper, `query_raw`, `simple_query`,
/// `copy_in`) are not seen. `prepare_cached` saves the parse round trip on
/// every event after the first.
pub struct Tx<'a> {
    pub(crate) tx: postgres::Transaction<'a>,
    pub(crate) cache: &'a mut StatementCache,
    /// Whether anything was asked of the transaction through this handle
    /// since it was last cleared: a handler's failed call that sent nothing
    /// left the transaction as it found it (no return to a savepoint).
    pub(crate) touched: bool,
    /// The server's error of the last statement sent through this handle,
    /// unless PostgreSQL refused it because the transaction had already
    /// failed (25P02); cleared by a statement that succeeds. So, in an
    /// aborted transaction, the error that aborted it (every later
    /// statement is refused with 25P02, and none succeeds).
    pub(crate) failed: Option<String>,
    /// The errors the SQL handler returned through this handle, in order,
    /// until the worker sees the handler's result; the last one taken back
    /// by each [`Tx::recovered`]. A handler that wraps `SqlHandler` and
    /// returns `Ok` while one that left the transaction fit to commit is
    /// owed (one of its batch call, which undid the statements it ran; a
    /// parameter refused before anything was sent) dropped it: its batch is
    /// rolled back, as one that swallows a statement's error is.
    pub(crate) owed: Vec<Owed>,
}

/// An error the SQL handler returned (see `Tx::owed`).
pub(crate) struct Owed {
    pub cause: String,
    /// PostgreSQL refused a statement: the transaction is aborted, so a
    /// handler that dropped the error fails at COMMIT, and one that went
    /// back to a savepoint before it dealt with it. Only the others block
    /// an `Ok`.
    pub aborted: bool,
}

/// A statement's result, noted in `failed` (see [`Tx`]). Errors of the
/// client's own (`query_one` finding no row, a parameter of the wrong type)
/// do not abort the transaction: not noted.
fn noted<T>(
    failed: &mut Option<String>,
    result: Result<T, postgres::Error>,
) -> Result<T, postgres::Error> {
    match &result {
        Ok(_) => *failed = None,
        Err(e) if e.code() == Some(&postgres::error::SqlState::IN_FAILED_SQL_TRANSACTION) => {}
        Err(e) if e.as_db_error().is_some() => *failed = Some(crate::error::postgres_message(e)),
        Err(_) => {}
    }
    result
}

/// Prepared statements of one connection, by SQL text: looked up once per
/// event (the built-in statement's too), so hashed with `foldhash`, not
/// SipHash, which spent about 900 instructions per event on the built-in
/// statement's 300 bytes of text (callgrind, per-event mode).
pub(crate) type StatementCache = foldhash::HashMap<String, postgres::Statement>;

impl<'a> Tx<'a> {
    pub(crate) fn new(tx: postgres::Transaction<'a>, cache: &'a mut StatementCache) -> Tx<'a> {
        Tx {
            tx,
            cache,
            touched: false,
            failed: None,
            owed: Vec::new(),
        }
    }

    /// Prepares `sql` once per connection and returns the cached statement
    /// afterwards.
    pub fn prepare_cached(&mut self, sql: &str) -> Result<postgres::Statement, postgres::Error> {
        if let Some(statement) = self.cache.get(sql) {
            return Ok(statement.clone()); // nothing sent
        }
        // A failed PREPARE aborts the transaction.
        self.touched = true;
        noted(
            &mut self.failed,
            prepare_cached(&mut self.tx, self.cache, sql),
        )
    }

    /// [`postgres::Transaction::execute`].
    pub fn execute<T>(&mut self, query: &T, params: &[&(dyn ToSql + Sync)]) -> Result<u64, Error>
    where
        T: ?Sized + ToStatement,
    {
        self.touched = true;
        noted(&mut self.failed, self.tx.execute(query, params))
    }

    /// [`postgres::Transaction::query`].
    pub fn query<T>(&mut self, query: &T, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, Error>
    where
        T: ?Sized + ToStatement,
    {
        self.touched = true;
        noted(&mut self.failed, self.tx.query(query, params))
    }

    /// [`postgres::Transaction::query_one`].
    pub fn query_one<T>(&mut self, query: &T, params: &[&(dyn ToSql + Sync)]) -> Result<Row, Error>
    where
        T: ?Sized + ToStatement,
    {
        self.touched = true;
        noted(&mut self.failed, self.tx.query_one(query, params))
    }

    /// [`postgres::Transaction::query_opt`].
    pub fn query_opt<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, Error>
    where
        T: ?Sized + ToStatement,
    {
        self.touched = true;
        noted(&mut self.failed, self.tx.query_opt(query, params))
    }

    /// Says that the handler dealt with the last error
    /// [`SqlHandler`](crate::SqlHandler) returned through this `tx`, so
    /// that returning `Ok` commits what the handler did instead of that
    /// effect. It matters where that error left the transaction fit to
    /// commit: a payload the SQL handler refused before sending anything
    /// (not JSON for a `jsonb` parameter, say), or the failure of its call
    /// for a whole batch (which undid every statement of the call). Without
    /// it, a handler that returns `Ok` after such an error has its attempt
    /// fail ("the SQL handler failed ... but the handler returned Ok"), so
    /// that a wrapper that merely dropped the error never records an event
    /// as applied without its effect. A statement that failed on the
    /// server aborted the transaction, so a wrapper must go back to a
    /// savepoint taken before the call to go on, and needs no more than
    /// that (the call is harmless there). Call it once the handler did what
    /// it does instead.
    ///
    /// ```no_run
    /// # use taskhub::{Event, Handler, HandlerError, SqlHandler, Tx};
    /// struct OrPark(SqlHandler);
    /// impl Handler for OrPark {
    ///     fn handle(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError> {
    ///         tx.batch_execute("SAVEPOINT before_insert")?;
    ///         if self.0.handle(event, tx).is_err() {
    ///             // Refused (a constraint, a payload that is not JSON):
    ///             // parked for a person instead.
    ///             tx.batch_execute("ROLLBACK TO SAVEPOINT before_insert")?;
    ///             tx.execute("INSERT INTO parked (event_id) VALUES ($1)", &[&event.event_id()])?;
    ///             tx.recovered();
    ///         }
    ///         Ok(())
    ///     }
    /// }
    /// ```
    pub fn recovered(&mut self) {
        self.owed.pop();
    }

    /// [`postgres::Transaction::batch_execute`].
    pub fn batch_execute(&mut self, query: &str) -> Result<(), Error> {
        self.touched = true;
        noted(&mut self.failed, self.tx.batch_execute(query))
    }

    /// [`postgres::Transaction::prepare`].
    pub fn prepare(&mut self, query: &str) -> Result<postgres::Statement, Error> {
        self.touched = true;
        noted(&mut self.failed, self.tx.prepare(query))
    }
}

/// Runs a handler call, turning a panic into a retryable error (so a panic
/// is one failed attempt of one event, and the thread lives on).
pub(crate) fn catch_panic(
    f: impl FnOnce() -> Result<(), HandlerError>,
) -> Result<(), HandlerError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown payload".into());
        Err(HandlerError::from_panic(format!(
            "handler panicked: {what}"
        )))
    })
}

/// Prepares `sql` on `client` unless `cache` has it already.
pub(crate) fn prepare_cached(
    client: &mut impl postgres::GenericClient,
    cache: &mut StatementCache,
    sql: &str,
) -> Result<postgres::Statement, postgres::Error> {
    if let Some(statement) = cache.get(sql) {
        return Ok(statement.clone());
    }
    let statement = client.prepare(sql)?;
    cache.insert(sql.to_owned(), statement.clone());
    Ok(statement)
}

impl<'a> Deref for Tx<'a> {
    type Target = postgres::Transaction<'a>;

    fn deref(&self) -> &postgres::Transaction<'a> {
        &self.tx
    }
}

impl<'a> DerefMut for Tx<'a> {
    fn deref_mut(&mut self) -> &mut postgres::Transaction<'a> {
        // Every query method of a transaction takes it mutably.
        self.touched = true;
        &mut self.tx
    }
}

/// `Box<dyn Handler>` and `Arc<dyn Handler>` are handlers too (every method
/// forwarded, so overridden hooks are kept).
macro_rules! forward_handler {
    ($($pointer:ident)::+) => {
        impl<H: Handler + ?Sized> Handler for $($pointer)::+<H> {
            fn handle(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError> {
                (**self).handle(event, tx)
            }

            fn handle_batch(&self, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
                (**self).handle_batch(events, tx)
            }

            fn validate(&self, event: &Event) -> Result<(), HandlerError> {
                (**self).validate(event)
            }

            fn on_start(
                &self,
                client: &mut postgres::Client,
            ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
                (**self).on_start(client)
            }

            fn supports_batches(&self) -> bool {
                (**self).supports_batches()
            }

            fn sql_effect(&self, event: &Event) -> Option<&crate::SqlHandler> {
                (**self).sql_effect(event)
            }

            fn committed(&self, event: &Event) {
                (**self).committed(event)
            }

            fn retry_budget(&self) -> Option<RetryBudget> {
                (**self).retry_budget()
            }

            fn name(&self) -> &str {
                (**self).name()
            }
        }
    };
}

forward_handler!(Box);
forward_handler!(std::sync::Arc);

/// A [`Handler`] made from a closure.
pub struct FnHandler<F>(F);

/// Wraps a closure as a [`Handler`], so simple cases need no struct.
///
/// ```
/// use taskhub::{handler_fn, Event, HandlerError, Tx};
///
/// let handler = handler_fn(|event: &Event, tx: &mut Tx<'_>| {
///     tx.execute(
///         "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)",
///         &[&event.event_id(), &event.payload()],
///     )?;
///     Ok::<(), HandlerError>(())
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<F>(f: F) -> FnHandler<F>
where
    F: Fn(&Event, &mut Tx<'_>) -> Result<(), HandlerError> + Send + Sync + 'static,
{
    FnHandler(f)
}

impl<F> Handler for FnHandler<F>
where
    F: Fn(&Event, &mut Tx<'_>) -> Result<(), HandlerError> + Send + Sync + 'static,
{
    fn handle(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        (self.0)(event, tx)
    }
}
