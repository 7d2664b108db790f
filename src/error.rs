//! Errors, in two families.
//!
//! [`Error`] is what the library's own operations return: a server that cannot
//! be reached at start-up, a bad configuration, a failed migration. It has a
//! [`kind()`](Error::kind) and keeps its cause in `source()`.
//!
//! [`HandlerError`] is what a [`Handler`](crate::Handler) returns for one
//! event. It says what should happen next: retry later (optionally not before a
//! downstream's `Retry-After`), give up at once (permanent), or treat the event
//! as undecodable (invalid). A `postgres::Error` converts into it with the
//! right class, so `?` in a handler does the right thing.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

type Cause = Box<dyn StdError + Send + Sync + 'static>;

/// An error from the library: configuration, connections, migrations.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<Cause>,
}

/// What went wrong, for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration was rejected by `build()`.
    Config,
    /// Redis could not be reached or answered with an error.
    Redis,
    /// PostgreSQL could not be reached or answered with an error.
    Postgres,
    /// A migration failed.
    Migration,
    /// Shutdown did not finish before its deadline. The threads still
    /// running are left detached: in a program that goes on after
    /// `Worker::run` returned, they may yet finish what they hold (commit
    /// and ack, a handler's effect included) or stop at their next step;
    /// end the process, or give them time, before dropping what they use.
    /// Ending the process loses nothing: what was not acked stays pending.
    ShutdownTimeout,
    /// A thread of the worker died in a way it could not recover from.
    Thread,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn with_source(
        kind: ErrorKind,
        message: impl Into<String>,
        source: impl Into<Cause>,
    ) -> Error {
        Error {
            kind,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    pub(crate) fn config(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Config, message)
    }

    /// What kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What failed and why, on one line: this error's message and each of
    /// its causes', once each (some causes repeat their own source's text),
    /// separated by `: `. What the binary prints.
    pub fn chain(&self) -> String {
        chain(self)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // What failed, once; why is in `source()` (printed by the binary as
        // "what: why: why", as anyhow's `{:#}` does).
        f.write_str(&self.message)
    }
}

/// `e` and its causes on one line (see [`Error::chain`]).
pub(crate) fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !more.is_empty() && !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_ref()
            .map(|e| e.as_ref() as &(dyn StdError + 'static))
    }
}

/// How a failed event should be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureClass {
    /// Try again after a backoff; counts as an attempt.
    Retryable,
    /// Retrying cannot change the outcome: dead-letter at once.
    Permanent,
    /// The event cannot be decoded: dead-letter at once as `invalid`.
    Invalid,
    /// A server we depend on is down. Not the event's fault: it is retried
    /// after the outage without counting an attempt.
    Outage,
}

/// The error a [`Handler`](crate::Handler) returns for one event.
#[derive(Debug)]
pub struct HandlerError {
    class: FailureClass,
    retry_after: Option<Duration>,
    event_index: Option<usize>,
    panicked: bool,
    /// Whether the transaction it happened in must not go on (see
    /// [`HandlerError::ends_transaction`]), where no source says so.
    ends_transaction: bool,
    /// The event's dedup row is held by another transaction (see
    /// [`HandlerError::held_elsewhere`]).
    held: bool,
    message: String,
    source: Option<Cause>,
}

impl HandlerError {
    pub(crate) fn new(class: FailureClass, message: String, source: Option<Cause>) -> HandlerError {
        HandlerError {
            class,
            retry_after: None,
            event_index: None,
            panicked: false,
            ends_transaction: false,
            held: false,
            message,
            source,
        }
    }

    /// A failure that may go away: the event is retried after a backoff.
    pub fn retryable(message: impl fmt::Display) -> HandlerError {
        HandlerError::new(FailureClass::Retryable, message.to_string(), None)
    }

    /// A failure that retrying cannot fix: the event is dead-lettered at once.
    pub fn permanent(message: impl fmt::Display) -> HandlerError {
        HandlerError::new(FailureClass::Permanent, message.to_string(), None)
    }

    /// The event cannot be decoded: it is dead-lettered at once as `invalid`.
    pub fn invalid(message: impl fmt::Display) -> HandlerError {
        HandlerError::new(FailureClass::Invalid, message.to_string(), None)
    }

    /// A dependency is down; the event is not at fault and no attempt is
    /// counted.
    pub fn outage(message: impl fmt::Display) -> HandlerError {
        HandlerError::new(FailureClass::Outage, message.to_string(), None)
    }

    /// Do not retry sooner than `after` (a downstream's `Retry-After`). Only
    /// meaningful for retryable failures; bounded by the worker's
    /// `max_retry_after`.
    pub fn with_retry_after(mut self, after: Duration) -> HandlerError {
        self.retry_after = Some(after);
        self
    }

    /// Keeps `source` as the cause of this error.
    pub fn with_source(mut self, source: impl Into<Cause>) -> HandlerError {
        self.source = Some(source.into());
        self
    }

    /// Says which event of a batch failed (its index in the slice given to
    /// [`Handler::handle_batch`](crate::Handler::handle_batch)). The batch is
    /// then retried without it, and only that event counts a failed attempt.
    pub fn for_event(mut self, index: usize) -> HandlerError {
        self.event_index = Some(index);
        self
    }

    pub(crate) fn from_panic(message: String) -> HandlerError {
        let mut e = HandlerError::new(FailureClass::Retryable, message, None);
        e.panicked = true;
        e
    }

    /// Marks the failure of an event's dedup insert that waited for the
    /// event's `processed_events` key, taken by another transaction (most
    /// likely the entry's owner before a claim, still to commit or roll
    /// back). Not the event's failure: tried again without counting an
    /// attempt (see `worker/fail.rs`), as a dead letter now could join the
    /// holder's commit as a second outcome.
    pub(crate) fn held_elsewhere(mut self) -> HandlerError {
        self.message = format!(
            "the event's processed_events row is held by another transaction (the entry's owner before a claim, still to commit or roll back?): {}",
            self.message
        );
        self.held = true;
        self
    }

    /// Whether the event's dedup row was held by another transaction (see
    /// [`HandlerError::held_elsewhere`]).
    pub(crate) fn is_held_elsewhere(&self) -> bool {
        self.held
    }

    /// Whether it is PostgreSQL refusing a statement because the
    /// transaction had already failed (25P02): the fault of whatever ran
    /// before, not of the statement.
    pub(crate) fn in_failed_transaction(&self) -> bool {
        self.postgres().and_then(postgres::Error::code)
            == Some(&postgres::error::SqlState::IN_FAILED_SQL_TRANSACTION)
    }

    /// The PostgreSQL error it came from, if it did.
    fn postgres(&self) -> Option<&postgres::Error> {
        self.source.as_deref()?.downcast_ref::<postgres::Error>()
    }

    /// For a statement PostgreSQL refused because the transaction had
    /// already failed (25P02): the error that aborted it, when known
    /// (`Tx::failed`), added to the message. Anything else as it is.
    pub(crate) fn aborted_by(mut self, cause: Option<&str>) -> HandlerError {
        if let Some(cause) = cause.filter(|_| self.in_failed_transaction()) {
            self.message = format!(
                "{} (the statement that aborted the transaction: {cause})",
                self.message
            );
        }
        self
    }

    /// Marks a failure whose SQLSTATE is of class 40 (see
    /// [`HandlerError::ends_transaction`]) that carries no PostgreSQL error.
    pub(crate) fn ending_transaction(mut self) -> HandlerError {
        self.ends_transaction = true;
        self
    }

    /// Whether the transaction it happened in must not go on, even back at
    /// a savepoint: a serialization failure or a deadlock (SQLSTATE class
    /// 40). Under REPEATABLE READ its snapshot is the one that failed, and
    /// under SERIALIZABLE it may be doomed: every later write in it fails
    /// the same way, whatever it touches. The other events of a batch go on
    /// in a new transaction, as a per-event attempt would.
    pub(crate) fn ends_transaction(&self) -> bool {
        self.ends_transaction
            || self
                .postgres()
                .and_then(postgres::Error::code)
                .is_some_and(|c| ends_transaction(c.code()))
    }

    /// Whether PostgreSQL itself refused a statement (its source is the
    /// server's error), which aborts the transaction it ran in.
    pub(crate) fn refused_by_server(&self) -> bool {
        self.postgres().is_some_and(|e| e.as_db_error().is_some())
    }

    pub(crate) fn is_panic(&self) -> bool {
        self.panicked
    }

    pub(crate) fn for_no_event(mut self) -> HandlerError {
        self.event_index = None;
        self
    }

    /// The index of the failing event in a batch, when known.
    pub fn event_index(&self) -> Option<usize> {
        self.event_index
    }

    /// The class that decides what happens next.
    pub fn class(&self) -> FailureClass {
        self.class
    }

    /// Whether the event will be tried again (retryable or outage).
    pub fn is_retryable(&self) -> bool {
        matches!(self.class, FailureClass::Retryable | FailureClass::Outage)
    }

    /// The earliest retry a downstream asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for HandlerError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_ref()
            .map(|e| e.as_ref() as &(dyn StdError + 'static))
    }
}

/// Whether a failure of SQLSTATE `code` ends its transaction: class 40,
/// a serialization failure or a deadlock (see
/// [`HandlerError::ends_transaction`]).
pub(crate) fn ends_transaction(code: &str) -> bool {
    code.starts_with("40")
}

/// Classifies a PostgreSQL SQLSTATE code (see the failure table in the README).
pub fn classify_sqlstate(code: &str) -> FailureClass {
    match code {
        // Connection exceptions, admin shutdown, crash shutdown, cannot connect
        // now, too many connections: the server is (momentarily) not there.
        // A read-only transaction (25006: a failover in progress, a replica
        // promoted late, default_transaction_read_only) cannot write whatever
        // the event: an outage too, and the session is replaced.
        c if c.starts_with("08") => FailureClass::Outage,
        "57P01" | "57P02" | "57P03" | "53300" | "25006" => FailureClass::Outage,
        // Serialization failure, deadlock, lock not available: trying again
        // can succeed.
        "40001" | "40P01" | "55P03" => FailureClass::Retryable,
        // Data exceptions, integrity constraint violations, syntax errors and
        // access rule violations: the same event fails the same way again.
        c if c.starts_with("22") || c.starts_with("23") || c.starts_with("42") => {
            FailureClass::Permanent
        }
        // Anything else (out of disk, internal errors, ...) might pass.
        _ => FailureClass::Retryable,
    }
}

/// Classifies any PostgreSQL client error: a closed connection or an I/O error
/// is an outage, a server error goes by its SQLSTATE.
pub fn classify_postgres(err: &postgres::Error) -> FailureClass {
    if err.is_closed() {
        return FailureClass::Outage;
    }
    if let Some(db) = err.as_db_error() {
        return classify_sqlstate(db.code().code());
    }
    if let Some(code) = err.code() {
        return classify_sqlstate(code.code());
    }
    // No SQLSTATE: a transport failure (I/O, a timeout) has an io::Error in
    // its chain; anything else is client-side (a conversion, a row count, a
    // parameter count) and could loop forever if it were called an outage.
    let mut cause: Option<&(dyn StdError + 'static)> = err.source();
    while let Some(c) = cause {
        if c.is::<std::io::Error>() {
            return FailureClass::Outage;
        }
        cause = c.source();
    }
    let text = err.to_string();
    if text.contains("timed out") || text.contains("timeout") {
        FailureClass::Outage
    } else if text.contains("error serializing") || text.contains("error deserializing") {
        FailureClass::Permanent
    } else {
        FailureClass::Retryable
    }
}

impl From<postgres::Error> for HandlerError {
    fn from(err: postgres::Error) -> HandlerError {
        let class = classify_postgres(&err);
        let message = postgres_message(&err);
        HandlerError::new(class, message, Some(Box::new(err)))
    }
}

/// What a PostgreSQL error says: its SQLSTATE and the server's message
/// (the error's own `Display` is only "db error" for the server's).
pub(crate) fn postgres_message(err: &postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => format!("postgres {}: {}", db.code().code(), db.message()),
        None => format!("postgres: {err}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_says_what_failed_once_and_source_says_why() {
        let why = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let e = Error::with_source(ErrorKind::Config, "cannot read /etc/x", why);
        assert_eq!(e.to_string(), "cannot read /etc/x");
        assert_eq!(e.source().unwrap().to_string(), "denied");
        assert_eq!(format!("{e:#}"), "cannot read /etc/x");
    }

    #[test]
    fn sqlstates_from_the_issue_are_classified() {
        for code in ["40001", "40P01", "55P03"] {
            assert_eq!(classify_sqlstate(code), FailureClass::Retryable, "{code}");
        }
        for code in [
            "57P01", "57P02", "57P03", "53300", "08000", "08006", "25006",
        ] {
            assert_eq!(classify_sqlstate(code), FailureClass::Outage, "{code}");
        }
        for code in ["22001", "22P02", "23505", "23503", "42601", "42P01"] {
            assert_eq!(classify_sqlstate(code), FailureClass::Permanent, "{code}");
        }
        assert_eq!(classify_sqlstate("53100"), FailureClass::Retryable);
    }

    #[test]
    fn handler_error_keeps_retry_after() {
        let e = HandlerError::retryable("429").with_retry_after(Duration::from_secs(2));
        assert!(e.is_retryable());
        assert_eq!(e.retry_after(), Some(Duration::from_secs(2)));
        assert!(!HandlerError::permanent("bad").is_retryable());
    }
}
