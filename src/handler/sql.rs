//! The built-in handler of `taskhub run`: one parameterized SQL statement per
//! event, run in the event's transaction.
//!
//! Parameters: `$1` the event_id, `$2` the payload (NULL when absent), `$3`
//! all fields as a JSON object. A statement may use any prefix of them. When a
//! parameter is of type `json` or `jsonb`, the value is checked to be JSON
//! and bound as the text it came as (an event whose payload is not JSON is
//! dead-lettered as invalid); `jsonb` stores PostgreSQL's reading of it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use postgres::error::SqlState;
use postgres::types::{ToSql, Type};

use crate::error::HandlerError;
use crate::event::Event;
use crate::handler::{Handler, Owed, Tx};

/// The book's example effect: one row in `notifications` per event.
pub const DEFAULT_STATEMENT: &str = "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)";

/// The default statement in set-based form, for a whole batch, where both
/// columns take text (as the migration's table does).
const DEFAULT_BATCH_STATEMENT: &str =
    "INSERT INTO notifications (event_id, payload) SELECT * FROM unnest($1::text[], $2::text[])";
/// The same for a `json` payload column: the payloads cast from the text
/// they were sent as.
const JSON_BATCH_STATEMENT: &str = "INSERT INTO notifications (event_id, payload) \
     SELECT e, p::pg_catalog.json FROM unnest($1::text[], $2::text[]) AS u(e, p)";
/// The same for a `jsonb` payload column.
const JSONB_BATCH_STATEMENT: &str = "INSERT INTO notifications (event_id, payload) \
     SELECT e, p::pg_catalog.jsonb FROM unnest($1::text[], $2::text[]) AS u(e, p)";

/// The set-based form for the parameter types of [`DEFAULT_STATEMENT`] as
/// prepared on the connection; `None` for other types (the batch then runs
/// the statement per event). The text arrays used to go in as they were,
/// which a `jsonb` column refuses: every batch failed and went one by one
/// (4,130 events/s against 35,222/s for a text column).
pub(crate) fn batch_statement(types: &[Type]) -> Option<&'static str> {
    let text = [Type::TEXT, Type::VARCHAR, Type::BPCHAR, Type::NAME];
    match types {
        [id, payload] if text.contains(id) && text.contains(payload) => {
            Some(DEFAULT_BATCH_STATEMENT)
        }
        [id, payload] if text.contains(id) && *payload == Type::JSON => Some(JSON_BATCH_STATEMENT),
        [id, payload] if text.contains(id) && *payload == Type::JSONB => {
            Some(JSONB_BATCH_STATEMENT)
        }
        _ => None,
    }
}

/// The dedup insert of `processed_events` and [`DEFAULT_STATEMENT`] as one
/// statement (see `worker/apply.rs`): the effect inserts from the dedup
/// insert's `RETURNING`, so it inserts nothing for a duplicate. `$1` scope,
/// `$2` event_id, `$3` payload; one row (the transaction id) when the event
/// is new, none when it is a duplicate. One statement is one transaction
/// even without BEGIN: in a session that allows it, it commits alone, in one
/// round trip.
pub(crate) const DEDUP_AND_DEFAULT: &str = "WITH done AS (\
     INSERT INTO processed_events (scope, event_id) VALUES ($1, $2) \
     ON CONFLICT DO NOTHING RETURNING txid_current() AS xid), \
     effect AS (INSERT INTO notifications (event_id, payload) SELECT $2, $3::text FROM done) \
     SELECT xid FROM done";

/// [`DEDUP_AND_DEFAULT`] for a batch of distinct event ids, some of whose
/// effects may be the handler's (see `Processor::apply_batch`): `$1` scope,
/// `$2` event ids, `$3` payloads, `$4` whether the built-in statement is
/// the event's effect. Inserts the dedup rows of all, and the effects of
/// the new ones flagged in `$4` in the batch's order; returns the event ids
/// that were new, with the transaction id. Alone (every event flagged) it
/// is its own transaction; beside handler events it runs inside the
/// batch's: one COMMIT for both kinds.
pub(crate) const DEDUP_BATCH_AND_DEFAULT: &str = "WITH e AS (\
     SELECT * FROM unnest($2::text[], $3::text[], $4::bool[]) WITH ORDINALITY AS e(id, payload, fold, n)), \
     done AS (INSERT INTO processed_events (scope, event_id) SELECT $1, id FROM e \
     ON CONFLICT DO NOTHING RETURNING event_id, txid_current() AS xid), \
     effect AS (INSERT INTO notifications (event_id, payload) \
     SELECT e.id, e.payload FROM e JOIN done ON done.event_id = e.id WHERE e.fold ORDER BY e.n) \
     SELECT event_id, xid FROM done";

/// [`DEDUP_BATCH_AND_DEFAULT`] one event at a time, each in a subtransaction
/// of its own, for a batch that statement rejected (it does not say for
/// which event): the events that fail are reported (their position from 1,
/// SQLSTATE, message) and take nothing with them, the others are applied,
/// all in one statement. A function of the session (`pg_temp`), created
/// once per connection: no migration, nothing left behind. A read-only
/// transaction fails the whole call, as it fails every event; so does a
/// lock timeout (55P03), a wait that is no event's failure (on a key held
/// by another transaction, say: see `Processor::waited_for`), as a
/// statement timeout does, which PL/pgSQL never catches.
pub(crate) const APPLY_EACH_FUNCTION: &str = "CREATE OR REPLACE FUNCTION \
     pg_temp.taskhub_apply_each(p_scope text, p_ids text[], p_payloads text[]) \
     RETURNS TABLE (n int, code text, message text) LANGUAGE plpgsql AS $f$ \
     BEGIN \
       FOR i IN 1 .. coalesce(array_length(p_ids, 1), 0) LOOP \
         BEGIN \
           INSERT INTO processed_events (scope, event_id) VALUES (p_scope, p_ids[i]) \
             ON CONFLICT DO NOTHING; \
           IF FOUND THEN \
             INSERT INTO notifications (event_id, payload) VALUES (p_ids[i], p_payloads[i]); \
             n := i; code := NULL; message := NULL; RETURN NEXT; \
           END IF; \
         EXCEPTION \
           WHEN read_only_sql_transaction OR lock_not_available THEN RAISE; \
           WHEN OTHERS THEN n := i; code := SQLSTATE; message := SQLERRM; RETURN NEXT; \
         END; \
       END LOOP; \
     END $f$";
/// Calls [`APPLY_EACH_FUNCTION`]: a row per new event (`code` NULL) and per
/// failed one.
pub(crate) const APPLY_EACH: &str =
    "SELECT n, code, message FROM pg_temp.taskhub_apply_each($1, $2, $3)";

/// Runs a statement once per event of a batch, in one call: the handler's
/// statement as it is (`p_sql`), its `$1`, `$2`, `$3` bound to each event's
/// id, payload and fields (`EXECUTE ... USING`, so no event's data is ever
/// part of the SQL text). One round trip for the batch where a statement
/// per event cost one each (a custom `--sql` drained at 0.65x the built-in
/// statement's rate, 18 µs of our CPU per event against 6). The statements
/// run in one block: the first that fails undoes all the call did (its
/// events' effects) and is reported (its position from 1, SQLSTATE,
/// message), so the transaction is as it was before the call, and the
/// batch goes on without that event (see `SqlHandler::each`), as when
/// the event's own statement failed. A serialization failure or a deadlock
/// (SQLSTATE class 40) is the event's failure too, as it was, but the
/// others go on in a new transaction, as they did after such a statement:
/// under REPEATABLE READ the same snapshot would fail them again, and a
/// SERIALIZABLE transaction it doomed fails every later write
/// (`HandlerError::ends_transaction`). A cancel or a statement timeout is
/// not caught (PL/pgSQL never catches them): the call fails.
/// `p_payloads` and `p_fields` are arrays of text, `json` or `jsonb`, as
/// the statement's parameters are typed (see [`each_call`]). A function of the session
/// (`pg_temp`), created once per connection outside any transaction (a
/// batch rolled back would take it away with it): no migration, nothing
/// left behind. The session of the handler is read-only by default, hence
/// the transaction of its own.
pub(crate) const EACH_STATEMENT_FUNCTION: &str = "START TRANSACTION READ WRITE; \
     CREATE OR REPLACE FUNCTION pg_temp.taskhub_each_statement(\
       p_sql text, p_ids text[], p_payloads anyarray, p_fields anycompatiblearray) \
     RETURNS TABLE (n int, code text, message text) LANGUAGE plpgsql AS $f$ \
     DECLARE at int := 0; \
     BEGIN \
       BEGIN \
         FOR i IN 1 .. coalesce(array_length(p_ids, 1), 0) LOOP \
           at := i; \
           EXECUTE p_sql USING p_ids[i], p_payloads[i], p_fields[i]; \
         END LOOP; \
       EXCEPTION \
         WHEN OTHERS THEN n := at; code := SQLSTATE; message := SQLERRM; RETURN NEXT; \
       END; \
     END $f$; \
     COMMIT";

/// The call of [`EACH_STATEMENT_FUNCTION`] for a statement whose parameters
/// are of `types`, or `None` where it cannot take them (then the statement
/// runs event by event): `$1` text or varchar, `$2` and `$3` those, `json`
/// or `jsonb`.
pub(crate) fn each_call(types: &[Type]) -> Option<String> {
    // Not `char(n)` nor `name`: bound as text through `USING`, a value
    // would compare as text (`code::text = $1`: trailing blanks count, the
    // column's index unused), where a statement per event compared it as
    // the column's type.
    let text = [Type::TEXT, Type::VARCHAR];
    let array = |ty: Option<&Type>| match ty {
        None => Some("text"), // not used: an empty array
        Some(ty) if text.contains(ty) => Some("text"),
        Some(ty) if *ty == Type::JSON => Some("json"),
        Some(ty) if *ty == Type::JSONB => Some("jsonb"),
        Some(_) => None,
    };
    if types.len() > 3 || types.first().is_some_and(|ty| !text.contains(ty)) {
        return None;
    }
    Some(format!(
        "SELECT n, code, message FROM pg_temp.taskhub_each_statement($1, $2, $3::{}[], $4::{}[])",
        array(types.get(1))?,
        array(types.get(2))?
    ))
}

/// Whether [`DEFAULT_STATEMENT`], prepared on a connection, takes text for
/// both its parameters: the fused statements pass text, which a `jsonb` or
/// `uuid` column of `notifications` would refuse.
pub(crate) fn folds(default_statement: &postgres::Statement) -> bool {
    let text = [Type::TEXT, Type::VARCHAR, Type::BPCHAR, Type::NAME];
    let params = default_statement.params();
    params.len() == 2 && params.iter().all(|ty| text.contains(ty))
}

/// Runs one SQL statement per event. See the module docs for the parameters.
///
/// In batch mode the worker may have it run the statement for a whole batch
/// in one call (see `each`). A handler that wraps it must return the error
/// it gets from it (it may add to it): a handler that drops it and returns
/// `Ok` has its batch rolled back, since the effects it expected are not
/// there.
#[derive(Debug, Clone)]
pub struct SqlHandler {
    statement: String,
    /// How many more batches run the statement event by event: set when a
    /// batch's call was cancelled (see `each`).
    one_by_one: Arc<AtomicU32>,
}

impl SqlHandler {
    /// A handler that runs `statement` for each event.
    pub fn new(statement: impl Into<String>) -> SqlHandler {
        SqlHandler {
            statement: statement.into(),
            one_by_one: Arc::default(),
        }
    }

    /// The statement this handler runs.
    pub fn statement(&self) -> &str {
        &self.statement
    }

    /// Whether it runs [`DEFAULT_STATEMENT`], which taskhub can fold into
    /// the dedup insert ([`DEDUP_AND_DEFAULT`]).
    pub(crate) fn is_default(&self) -> bool {
        self.statement == DEFAULT_STATEMENT
    }
}

impl Default for SqlHandler {
    /// Inserts into `notifications (event_id, payload)`.
    fn default() -> SqlHandler {
        SqlHandler::new(DEFAULT_STATEMENT)
    }
}

/// The rest of `sql` after any whitespace, comments (`--` to the end of
/// the line, `/* */`, which nest) and, with `semicolons`, empty statements:
/// where PostgreSQL's parser would find the first word.
fn skip_blank(mut sql: &str, semicolons: bool) -> &str {
    loop {
        let rest = sql.trim_start_matches(|c: char| {
            c.is_ascii_whitespace() || c == '\x0b' || (semicolons && c == ';')
        });
        if let Some(comment) = rest.strip_prefix("--") {
            sql = comment.find(['\n', '\r']).map_or("", |end| &comment[end..]);
        } else if rest.starts_with("/*") {
            let mut depth = 0usize;
            let mut at = 0;
            let bytes = rest.as_bytes();
            while at < bytes.len() {
                if bytes[at..].starts_with(b"/*") {
                    depth += 1;
                    at += 2;
                } else if bytes[at..].starts_with(b"*/") {
                    depth -= 1;
                    at += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    at += 1;
                }
            }
            sql = rest.get(at..).unwrap_or("");
        } else {
            return rest;
        }
    }
}

/// The first word of `sql` (letters, digits and `_`), upper-cased, and
/// what follows it.
fn first_word(sql: &str) -> (String, &str) {
    let end = sql
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(sql.len());
    (sql[..end].to_ascii_uppercase(), &sql[end..])
}

/// Refuses, before any event, a statement that cannot be an event's
/// effect: an empty one (nothing but blanks, comments and `;`), which
/// would record every event as applied with no effect, and transaction
/// control, which would end the transaction that also records the event
/// (a COMMIT commits the `processed_events` row whatever the effect).
/// The statement prepared already: it is one command at most.
fn check_statement(statement: &str) -> Result<(), String> {
    let start = skip_blank(statement, true);
    if start.is_empty() {
        return Err(format!(
            "the SQL statement is empty ({statement:?}): every event would be recorded as applied with no effect; give the statement that applies one event"
        ));
    }
    let (word, rest) = first_word(start);
    let control = match word.as_str() {
        "BEGIN" | "COMMIT" | "END" | "ROLLBACK" | "ABORT" | "SAVEPOINT" | "RELEASE" => Some(word),
        "START" | "PREPARE" if first_word(skip_blank(rest, false)).0 == "TRANSACTION" => {
            Some(format!("{word} TRANSACTION"))
        }
        _ => None,
    };
    match control {
        Some(what) => Err(format!(
            "the SQL statement is transaction control ({what}), which taskhub does not allow: the statement runs inside taskhub's transaction, which also records the event as processed, and must not end it (a COMMIT there records the event as applied without its effect); give only the statement that applies one event: {:?}",
            statement.trim()
        )),
        None => Ok(()),
    }
}

fn invalid(why: impl std::fmt::Display) -> HandlerError {
    HandlerError::invalid(why)
}

/// The event's payload as text (`None` when it has none).
pub(crate) fn payload(event: &Event) -> Result<Option<&str>, HandlerError> {
    event
        .field("payload")
        .map(|raw| std::str::from_utf8(raw).map_err(|_| invalid("payload is not UTF-8")))
        .transpose()
}

fn is_json(ty: &Type) -> bool {
    *ty == Type::JSON || *ty == Type::JSONB
}

/// JSON text bound to a `json` or `jsonb` parameter as it is (checked
/// first): as a `serde_json::Value`, numbers beyond an f64 were rounded
/// (`12345678901234567890123.5` stored as `1.2345678901234568e+22`) and a
/// `json` column got its keys sorted and deduplicated, where a batch stores
/// the text as sent.
#[derive(Debug)]
struct RawJson<'a>(&'a str);

impl ToSql for RawJson<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            out.extend_from_slice(&[1]); // jsonb's binary format: version 1, then the text
        }
        out.extend_from_slice(self.0.as_bytes());
        Ok(postgres::types::IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        is_json(ty)
    }

    postgres::types::to_sql_checked!();
}

/// Refuses, as invalid, a payload bound to a `json` or `jsonb` parameter
/// that is not JSON, before anything is sent. One nested deeper than the
/// parser goes (128 levels, which keeps its stack bounded) is left to
/// PostgreSQL, which reads deeper: it was refused as "not JSON" although
/// it was.
fn check_json(text: &str) -> Result<(), HandlerError> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().starts_with("recursion limit exceeded") => Ok(()),
        Err(e) => Err(invalid(format!("payload is not JSON: {e}"))),
    }
}

/// The statement per event, naming the event that failed.
fn handle_each(sql: &SqlHandler, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
    for (i, event) in events.iter().enumerate() {
        // Owed once, by the caller (`handle_batch`), not once more here.
        sql.apply_one(event, tx).map_err(|e| e.for_event(i))?;
    }
    Ok(())
}

/// Why PostgreSQL's `text` cannot store `value`, if it cannot.
fn unstorable(value: &[u8]) -> Option<&'static str> {
    match std::str::from_utf8(value) {
        Err(_) => Some("is not UTF-8"),
        Ok(text) if text.contains('\0') => {
            Some("contains a NUL byte, which PostgreSQL text cannot store")
        }
        Ok(_) => None,
    }
}

/// How many batches run the statement event by event after a batch's call
/// was cancelled (see `SqlHandler::each`).
const ONE_BY_ONE_BATCHES: u32 = 64;

/// `handled`, its error noted in `Tx::owed` (until `Tx::recovered`): a
/// handler that wraps this one and drops an error that left the
/// transaction fit to commit has it rolled back, not committed without the
/// effects (the batch's call undid them all, and the parameters checked
/// first sent none).
fn owing(tx: &mut Tx<'_>, handled: Result<(), HandlerError>) -> Result<(), HandlerError> {
    if let Err(e) = &handled {
        tx.owed.push(Owed {
            cause: e.to_string(),
            aborted: e.refused_by_server(),
        });
    }
    handled
}

impl SqlHandler {
    /// The statement for each of `events` in one call of
    /// [`EACH_STATEMENT_FUNCTION`], prepared by the worker on this
    /// connection (`Processor::ready_each_statement`); without it (or for a
    /// single event, or for a while after a call was cancelled) one
    /// statement per event. Each event's parameters are checked first, as
    /// `handle` checks them, so an event that cannot go is named before
    /// anything is sent. The first event whose statement fails is named;
    /// the call undid everything it did, so the transaction is as it was
    /// before (`Tx::touched` as it was), and the handler's caller may go on
    /// without that event. Either error is owed ([`owing`]).
    ///
    /// The handler's timeout bounds a call, as it bounds any statement: a
    /// batch whose statements run longer than that together is cut short
    /// and fails as a whole (its events then go one by one), and the next
    /// [`ONE_BY_ONE_BATCHES`] batches run the statement event by event,
    /// each bounded on its own (a warning says so). Any cancel of a call
    /// does the same (an operator's, or one event's lock wait).
    fn each(&self, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        let one_by_one = self
            .one_by_one
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if events.len() < 2 || one_by_one {
            return handle_each(self, events, tx);
        }
        let touched = tx.touched;
        let statement = tx.prepare_cached(&self.statement)?;
        let types = statement.params();
        let Some(call) = each_call(types) else {
            return handle_each(self, events, tx);
        };
        let Some(each) = tx.cache.get(&call).cloned() else {
            return handle_each(self, events, tx);
        };
        let json = |at: usize| types.get(at).is_some_and(is_json);
        let mut ids = Vec::with_capacity(events.len());
        let mut payloads = Vec::new();
        let mut fields = Vec::new();
        for (i, event) in events.iter().enumerate() {
            ids.push(event.event_id());
            if types.len() > 1 {
                let text = payload(event).map_err(|e| e.for_event(i))?;
                if let Some(text) = text.filter(|_| json(1)) {
                    check_json(text).map_err(|e| e.for_event(i))?;
                }
                payloads.push(text);
            }
            if types.len() > 2 {
                let text = event.fields_json().map_err(|e| invalid(e).for_event(i))?;
                fields.push(text);
            }
        }
        // Bound as text, or as it is through `RawJson` for a JSON type.
        let payloads_json: Vec<Option<RawJson<'_>>>;
        let payloads: &(dyn ToSql + Sync) = if json(1) {
            payloads_json = payloads.iter().map(|p| p.map(RawJson)).collect();
            &payloads_json
        } else {
            &payloads
        };
        let fields_json: Vec<RawJson<'_>>;
        let fields: &(dyn ToSql + Sync) = if json(2) {
            fields_json = fields.iter().map(|f| RawJson(f)).collect();
            &fields_json
        } else {
            &fields
        };
        let rows = match tx.query(&each, &[&self.statement, &ids, payloads, fields]) {
            Ok(rows) => rows,
            Err(e) => return Err(self.call_failed(e, (&call, events.len()), tx)),
        };
        let Some(row) = rows.first() else {
            return Ok(());
        };
        let (at, code, message): (i32, &str, &str) = (row.get(0), row.get(1), row.get(2));
        tx.touched = touched;
        let message = format!("postgres {code}: {message}");
        let mut error = HandlerError::new(crate::error::classify_sqlstate(code), message, None);
        if crate::error::ends_transaction(code) {
            error = error.ending_transaction();
        }
        match usize::try_from(at - 1).ok().filter(|i| *i < events.len()) {
            Some(i) => Err(error.for_event(i)),
            None => Err(error),
        }
    }

    /// What a call of [`EACH_STATEMENT_FUNCTION`] that failed as a whole
    /// becomes. Cancelled (by the handler's timeout, most likely): the next
    /// batches run the statement event by event. The function gone from the
    /// session (a `DISCARD TEMP` in a statement): created again for the next
    /// batch, and this one tried again.
    fn call_failed(
        &self,
        e: postgres::Error,
        (call, events): (&str, usize),
        tx: &mut Tx<'_>,
    ) -> HandlerError {
        if e.code() == Some(&SqlState::QUERY_CANCELED)
            && self.one_by_one.swap(ONE_BY_ONE_BATCHES, Ordering::Relaxed) == 0
        {
            log::warn!(
                "postgres: the call that runs the SQL statement for a batch of {} events was cancelled ({}): --handler-timeout bounds the call, so statements that each fit in it may not fit together; the batch goes one by one, and the next {ONE_BY_ONE_BATCHES} batches run the statement event by event, each statement bounded on its own",
                events,
                crate::error::postgres_message(&e)
            );
        }
        if e.code() == Some(&SqlState::UNDEFINED_FUNCTION) {
            tx.cache.remove(call);
            return HandlerError::retryable(format!(
                "the session lost the function that runs the SQL statement for a batch ({}); it is created again",
                crate::error::postgres_message(&e)
            ));
        }
        e.into()
    }

    /// [`Handler::handle`], before the error is noted (see [`owing`]).
    fn apply_one(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        let statement = tx.prepare_cached(&self.statement)?;
        let types = statement.params();
        if types.len() > 3 {
            return Err(HandlerError::permanent(format!(
                "the SQL statement uses {} parameters; only $1 (event_id), $2 (payload) and $3 (fields) exist",
                types.len()
            )));
        }
        let event_id = event.event_id();
        let payload_text = payload(event)?;
        if let (Some(ty), Some(text)) = (types.get(1), payload_text) {
            if is_json(ty) {
                check_json(text)?;
            }
        }
        let payload_json = payload_text.map(RawJson);
        let fields_text: Option<String> = match types.get(2) {
            Some(_) => Some(event.fields_json().map_err(invalid)?),
            None => None,
        };
        let fields_json = fields_text.as_deref().map(RawJson);
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(types.len());
        for (i, ty) in types.iter().enumerate() {
            match i {
                0 => params.push(&event_id),
                1 if is_json(ty) => params.push(&payload_json),
                1 => params.push(&payload_text),
                _ if is_json(ty) => params.push(&fields_json),
                _ => params.push(&fields_text),
            }
        }
        tx.execute(&statement, &params)?;
        Ok(())
    }

    /// [`Handler::handle_batch`], before the error is noted (see [`owing`]).
    fn apply_batch(&self, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        if self.statement != DEFAULT_STATEMENT {
            return self.each(events, tx);
        }
        let default = tx.prepare_cached(DEFAULT_STATEMENT)?;
        let Some(batch) = batch_statement(default.params()) else {
            return self.each(events, tx);
        };
        let json = default.params().get(1).is_some_and(is_json);
        let mut ids = Vec::with_capacity(events.len());
        let mut payloads = Vec::with_capacity(events.len());
        for (i, event) in events.iter().enumerate() {
            ids.push(event.event_id());
            let text = payload(event).map_err(|e| e.for_event(i))?;
            if let Some(text) = text.filter(|_| json) {
                // As `handle` refuses it, naming the event.
                check_json(text).map_err(|e| e.for_event(i))?;
            }
            payloads.push(text);
        }
        let statement = tx.prepare_cached(batch)?;
        tx.execute(&statement, &[&ids, &payloads])?;
        Ok(())
    }
}

impl Handler for SqlHandler {
    /// Refuses, as invalid, a payload (or, when the statement takes `$3`,
    /// any field) that PostgreSQL text cannot store, before it can fail a
    /// batch.
    fn validate(&self, event: &Event) -> Result<(), HandlerError> {
        if let Some(why) = event.field("payload").and_then(unstorable) {
            return Err(invalid(format!("payload {why}")));
        }
        if self.statement.contains("$3") {
            for (k, v) in event.fields() {
                if let Some(why) = unstorable(k).or_else(|| unstorable(v)) {
                    return Err(invalid(format!(
                        "field {:?} {why}",
                        String::from_utf8_lossy(k)
                    )));
                }
            }
        }
        Ok(())
    }

    fn sql_effect(&self, _event: &Event) -> Option<&SqlHandler> {
        Some(self)
    }

    fn handle(&self, event: &Event, tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        let handled = self.apply_one(event, tx);
        owing(tx, handled)
    }

    /// The default statement inserts the whole batch with one statement;
    /// any other statement runs once per event, in the batch's transaction,
    /// all in one call where the worker readied the session for it (see
    /// `each`).
    fn handle_batch(&self, events: &[&Event], tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        let handled = self.apply_batch(events, tx);
        owing(tx, handled)
    }

    /// Prepares the statement once at start-up, so a typo or a missing
    /// table is a start-up error instead of a dead letter per event; an
    /// empty statement, or transaction control (COMMIT, ROLLBACK, ...),
    /// is refused too (see `check_statement`).
    fn on_start(
        &self,
        client: &mut postgres::Client,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let statement = client.prepare(&self.statement).map_err(|e| {
            let why = e.as_db_error().map_or_else(
                || e.to_string(),
                |db| format!("{} ({})", db.message(), db.code().code()),
            );
            // PostgreSQL cannot tell the type of a parameter the statement
            // does not use, and every one up to the highest is sent.
            let hint = if e.code() == Some(&SqlState::INDETERMINATE_DATATYPE) {
                "; a statement that uses $2 or $3 must use every parameter before it (give one its type where it has none, as in `$1::text`)"
            } else {
                ""
            };
            format!(
                "the SQL statement does not prepare: {why}{hint}: {}",
                self.statement
            )
        })?;
        check_statement(&self.statement)?;
        let params = statement.params();
        if params.len() > 3 {
            return Err(format!(
                "the SQL statement uses {} parameters; only $1 (event_id), $2 (payload) and $3 (fields) exist",
                params.len()
            )
            .into());
        }
        for (i, ty) in params.iter().enumerate() {
            let text_like = [
                Type::TEXT,
                Type::VARCHAR,
                Type::BPCHAR,
                Type::NAME,
                Type::UNKNOWN,
            ]
            .contains(ty);
            if !text_like && !is_json(ty) {
                return Err(format!(
                    "parameter ${} of the SQL statement is of type {ty}, but taskhub passes text or JSON: cast it in SQL, e.g. ${}::text::{ty}",
                    i + 1,
                    i + 1
                )
                .into());
            }
        }
        Ok(())
    }

    fn name(&self) -> &str {
        "sql"
    }
}

#[cfg(test)]
mod tests {
    use super::check_statement;

    #[test]
    fn empty_statements_and_transaction_control_are_refused() {
        for sql in [
            "",
            ";",
            " \n\t; ;",
            "-- x",
            "-- x\r\n;",
            "/* a /* b */ c */;",
        ] {
            let e = check_statement(sql).unwrap_err();
            assert!(e.contains("is empty"), "{sql:?}: {e}");
        }
        for sql in [
            "COMMIT",
            "commit and chain",
            "End;",
            "ABORT",
            "ROLLBACK TO SAVEPOINT batch",
            "rollback prepared 'x'",
            "Begin",
            "start transaction read write",
            "START/* c */TRANSACTION",
            "savepoint s",
            "RELEASE s",
            "PREPARE TRANSACTION 'x'",
            "prepare -- c\n transaction 'x'",
            "COMMIT PREPARED 'x'",
            " ;\n/* a /* nested */ b */ -- c\n  commit",
        ] {
            let e = check_statement(sql).unwrap_err();
            assert!(e.contains("transaction control"), "{sql:?}: {e}");
        }
        for sql in [
            super::DEFAULT_STATEMENT,
            "/* COMMIT */ SELECT $1::text",
            "SELECT 'COMMIT'",
            "PREPARE p AS SELECT 1",
            "starting",
            "ending",
            "committed",
            "WITH x AS (SELECT 1) SELECT * FROM x -- ROLLBACK",
        ] {
            assert_eq!(check_statement(sql), Ok(()), "{sql:?}");
        }
    }
}
