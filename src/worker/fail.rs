//! When an attempt does not succeed: outages waited out (they are not the
//! event's fault and count no attempt), failures retried after a backoff
//! or, when permanent or out of attempts, dead-lettered; and entries that
//! are not ours any more, or were deleted from their stream.

use std::time::{Duration, Instant, SystemTime};

use crate::dlq::letter::{bounded_text, ATTEMPT_ERROR_MAX, REASON_MAX};
use crate::dlq::{millis, Attempt, DeadLetter, Kind};
use crate::error::{FailureClass, HandlerError};
use crate::event::Invalid;
use crate::redis::RedisConn;
use crate::worker::apply::Applied;
use crate::worker::context::outage_backoff;
use crate::worker::dead_letter;
use crate::worker::delivery::Delivery;
use crate::worker::process::{Flow, Processor};
use crate::worker::retry::Retry;
use crate::worker::stats::{Server, Stats};

impl Processor {
    /// An event rolled back because the entry is not ours any more (drop
    /// it: its new owner decides) or was deleted from the stream (dead-letter
    /// it as trimmed, with the fields we still hold).
    pub(crate) fn not_applied(&mut self, delivery: Delivery, why: Applied) {
        if let Applied::Trimmed = why {
            let reason = crate::worker::delivery::TRIMMED.to_owned();
            return self.dead_letter(delivery, Kind::Trimmed, reason);
        }
        let held = delivery.held_since.elapsed();
        let min_idle = self.stage.settings.reclaim_min_idle;
        if held >= min_idle {
            // Held past the min-idle: taken over while it ran here (a
            // handler slower than --reclaim-min-idle loses every entry of
            // its batch to the next consumer, for ever: found by a hostile
            // test). Said at warn level, with the fix.
            log::warn!(
                "{}/{}: taken over by another consumer after {} here, past --reclaim-min-idle {}; rolled back, left to it (a handler run longer than --reclaim-min-idle loses its entries again each time: raise --reclaim-min-idle above the longest run)",
                delivery.stream,
                delivery.entry_id,
                humantime::format_duration(Duration::from_millis(held.as_millis() as u64)),
                humantime::format_duration(min_idle),
            );
        } else {
            log::info!(
                "{}/{}: no longer pending for this consumer while it held it (claimed or finished by another consumer, the usual case; or removed from the pending list by XGROUP DELCONSUMER or a deleted stream, which Redis never delivers again); rolled back, left to whoever holds it",
                delivery.stream,
                delivery.entry_id
            );
        }
        Stats::add(&self.stage.common.stats.lost_ownership, 1);
    }

    /// Runs `apply` (one event or a batch), waiting out outages: they are
    /// not the events' fault, so they count no attempt. But a connection
    /// lost while this attempt ran, after the attempt had reached the
    /// database, is a strike against it when other transactions commit
    /// while this worker waits to try again (the database works: only this
    /// session died), or right after the previous attempt had lost its own
    /// the same way: at `max` strikes it is [`Flow::Struck`] (an event that
    /// kills its session would otherwise stall a worker for ever).
    pub(crate) fn through_outages<T>(
        &mut self,
        strikes: &mut u32,
        max: u32,
        mut apply: impl FnMut(&mut Processor) -> Result<T, HandlerError>,
    ) -> Flow<T> {
        let mut outages = 0u32;
        // Whether the previous attempt lost its session after reaching the
        // database.
        let mut lost_before = false;
        let commits = |p: &Processor| {
            p.stage
                .common
                .stats
                .commits
                .load(std::sync::atomic::Ordering::SeqCst)
        };
        loop {
            self.reached_database = false;
            match apply(self) {
                Err(e) if e.class() == FailureClass::Outage => {
                    let commits_at_loss = commits(self);
                    let server = server_of(&e);
                    let lost_on = self
                        .pg
                        .as_ref()
                        .and_then(|c| c.server_started().map(str::to_owned));
                    if server == Server::Postgres {
                        // A fresh connection for the next try: this one is
                        // closed, or its session is unusable (read-only).
                        if let Some(mut conn) = self.pg.take() {
                            conn.discard();
                        }
                    }
                    self.stage.common.health.down(server, &e);
                    // Only a lost database session is a strike: an event
                    // cannot kill the downstream's or Redis' connection.
                    let lost_session = server == Server::Postgres && self.reached_database;
                    let again = std::mem::replace(&mut lost_before, lost_session);
                    outages += 1;
                    // What earlier jobs finished does not wait out this
                    // outage for its ack (Redis's own outage it would).
                    if server != Server::Redis {
                        self.flush_acks();
                    }
                    if self.stage.common.shutdown.sleep(outage_backoff(outages)) {
                        return Flow::Stopped;
                    }
                    // The database worked if others committed while this
                    // worker waited, on the server the session was lost on.
                    // Commits during the attempt proved nothing: when the
                    // server stops, every session goes, and another
                    // worker's commit just before the stop made an innocent
                    // event a crash loop; and a loss noticed late (a slow
                    // call outside the database outlasted a restart) is
                    // followed by commits on the server started again.
                    // When everything else is a duplicate (settled by
                    // markers) or waits for this suspect, nothing commits:
                    // a session lost again right after the previous one is
                    // a strike too, or an event that kills its session
                    // would run, and stall, for ever.
                    if lost_session
                        && (again || commits(self) > commits_at_loss)
                        && !self.restarted_since(lost_on.as_deref())
                    {
                        *strikes += 1;
                        log::warn!("postgres: the connection was lost while this worker's transaction ran, while the database served others ({e}; strike {strikes} of {max})");
                        if *strikes >= max {
                            return Flow::Struck;
                        }
                    }
                }
                result => {
                    if result.is_ok() {
                        self.stage.common.health.up(Server::Postgres);
                        self.stage.common.health.up(Server::Downstream);
                    }
                    return Flow::Done(result);
                }
            }
        }
    }

    /// Whether the database now answering is not the one whose session
    /// started at `lost_on` (it started again since), or does not answer:
    /// either way the loss was the server's. Unknown start: not restarted.
    /// The connection it takes is the next attempt's.
    fn restarted_since(&mut self, lost_on: Option<&str>) -> bool {
        let Some(lost_on) = lost_on else {
            return false;
        };
        if self.connection().is_err() {
            return true;
        }
        self.pg.as_ref().and_then(|c| c.server_started()) != Some(lost_on)
    }

    /// Runs `f` with a pooled Redis connection, through outages (see
    /// [`Common::with_redis`]).
    pub(crate) fn with_redis<T>(
        &self,
        f: impl FnMut(&mut RedisConn) -> redis::RedisResult<T>,
    ) -> Option<T> {
        self.stage.common.with_redis(f)
    }

    /// A failed attempt: retry later or dead-letter.
    pub(crate) fn failed(&mut self, mut delivery: Delivery, error: HandlerError) {
        if error.is_held_elsewhere() {
            return self.held_elsewhere(delivery, &error);
        }
        let attempt = delivery.attempts() + 1;
        delivery.failures.push(Attempt {
            attempt,
            at: Some(SystemTime::now()),
            error: bounded_text(error.to_string(), ATTEMPT_ERROR_MAX),
        });
        let config = &self.stage.settings;
        let kind = match error.class() {
            FailureClass::Permanent => Some(Kind::Permanent),
            FailureClass::Invalid => Some(Kind::Invalid),
            _ if attempt >= config.max_attempts => Some(Kind::Exhausted),
            _ => None,
        };
        if let Some(kind) = kind {
            return self.dead_letter(delivery, kind, error.to_string());
        }
        let max = config.max_attempts;
        let (stream, entry) = (delivery.stream.clone(), delivery.entry_id.clone());
        let after = self.retry_later(delivery, attempt, error.retry_after());
        let shown = self.stage.common.stats.failures_shown.take(Instant::now());
        let level = shown.map_or(log::Level::Debug, |_| log::Level::Warn);
        let more = match shown {
            Some(hidden) if hidden > 0 => format!(
                " (and {hidden} other failed attempts since the last line like this, at debug level: RUST_LOG=taskhub=debug shows each)"
            ),
            _ => String::new(),
        };
        log::log!(
            level,
            "{stream}/{entry}: attempt {attempt} of {max} failed ({error}); retrying in {after}{more}"
        );
    }

    /// Hands `delivery` to the retry thread, due after the backoff of
    /// `attempt` (or a downstream's `retry_after`); returns that backoff, to
    /// the millisecond, for the log ("1s 250ms").
    fn retry_later(
        &mut self,
        delivery: Delivery,
        attempt: u32,
        retry_after: Option<std::time::Duration>,
    ) -> String {
        let backoff = &self.stage.settings.backoff;
        let delay = backoff.delay(attempt, retry_after);
        let earliest = backoff.earliest(attempt, delay, retry_after);
        Stats::add(&self.stage.common.stats.of(&delivery.stream).retries, 1);
        // On failure (the retry thread is gone at shutdown) the retry is
        // dropped, which leaves the entry pending.
        let now = Instant::now();
        let _ = self
            .retry
            .send(Retry::of(delivery, now + delay, now + earliest));
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        humantime::format_duration(std::time::Duration::from_millis(ms)).to_string()
    }

    /// An attempt that waited in vain for the event's dedup row, held by
    /// another transaction (see [`HandlerError::held_elsewhere`]): tried
    /// again after the backoff of its next attempt, counting none. It ends
    /// when the holder does: committed, the event is a duplicate here;
    /// rolled back, it is applied here. (A holder that never ends, its
    /// process stopped for good with the transaction open, holds the event
    /// until PostgreSQL ends that session: `idle_in_transaction_session_timeout`
    /// on the role bounds it.)
    fn held_elsewhere(&mut self, delivery: Delivery, error: &HandlerError) {
        self.not_counted(delivery, error);
    }

    /// Tries `delivery` again after the backoff of its next attempt,
    /// counting none (see [`Processor::held_elsewhere`]; also an outage met
    /// by the handler's `validate`).
    pub(crate) fn not_counted(&mut self, delivery: Delivery, error: &HandlerError) {
        let (stream, entry) = (delivery.stream.clone(), delivery.entry_id.clone());
        let next = delivery.attempts() + 1;
        let after = self.retry_later(delivery, next, None);
        log::warn!("{stream}/{entry}: {error}; not counted as an attempt, trying again in {after}");
    }

    pub(crate) fn dead_letter(&mut self, mut delivery: Delivery, kind: Kind, reason: String) {
        let config = &self.stage.settings;
        let now = SystemTime::now();
        let history = delivery.history();
        let first_failed = delivery.failures.first().and_then(|a| a.at).unwrap_or(now);
        let event_id = delivery.event_id().map(str::to_owned);
        let letter = DeadLetter {
            id: None,
            original_id: delivery.entry_id.clone(),
            stream: delivery.stream.to_string(),
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            event_id,
            kind,
            reason: bounded_text(reason, REASON_MAX),
            attempts: delivery.attempts(),
            history,
            first_failed_at: millis(first_failed),
            dead_at: millis(now),
            fields: match std::mem::replace(
                &mut delivery.body,
                Err((Vec::new(), Invalid(String::new()))),
            ) {
                Ok(event) => event.fields.to_vec(),
                Err((fields, _)) => fields,
            },
        };
        let job = dead_letter::Job {
            letter,
            token: delivery.fence(),
            holder: delivery.holder.take(),
            ticket: delivery.ticket.take(),
        };
        if self.dead.send(job).is_err() {
            log::error!("dead-letter writer is gone; the entry stays pending");
        }
    }
}

/// Which server an outage is about, from its cause.
fn server_of(e: &HandlerError) -> Server {
    match std::error::Error::source(e) {
        Some(cause) if cause.is::<redis::RedisError>() => Server::Redis,
        Some(cause) if cause.is::<crate::handler::http::Downstream>() => Server::Downstream,
        _ => Server::Postgres,
    }
}
