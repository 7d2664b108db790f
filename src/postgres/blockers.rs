//! Who a session waits for: a watch over a step that may wait on another
//! session's lock for as long as that session holds it.
//!
//! The start-up check prepares the handler's statement, which takes a lock
//! on its tables: a migration, or a `LOCK TABLE` left in an open
//! transaction, holds it back with no timeout and no word. [`Watch`] says,
//! after a few seconds and then every half minute, which sessions hold it
//! (pid, role, state and for how long, never their SQL, which may hold
//! secrets), and cancels the step on a shutdown, so SIGTERM stops a worker
//! that waits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, RecvTimeoutError, Sender};

use crate::postgres::pool::PgPool;
use crate::shutdown::Shutdown;

/// How long a step runs before the first word of what it waits for.
const FIRST_WORD: Duration = Duration::from_secs(5);
/// Then how often.
const NEXT_WORD: Duration = Duration::from_secs(30);

/// The sessions that `pid` waits for, with who they are.
const BLOCKERS: &str = "SELECT a.wait_event_type, \
     (SELECT string_agg(format('pid %s (role %s, %s%s)', b.pid, coalesce(b.usename, '?'), \
         coalesce(b.state, '?'), \
         coalesce(', its transaction open for ' || date_trunc('second', now() - b.xact_start), '')), \
         '; ' ORDER BY b.pid) \
      FROM pg_stat_activity b WHERE b.pid = ANY (pg_blocking_pids(a.pid))) \
     FROM pg_stat_activity a WHERE a.pid = $1";

/// A running watch; [`Watch::end`] (or dropping it) stops it.
pub(crate) struct Watch {
    _done: Sender<()>,
    cancelled: Arc<AtomicBool>,
}

impl Watch {
    /// Watches the session `client` for the step `what` about to run on it,
    /// asking through `pool`.
    pub(crate) fn begin(
        client: &mut postgres::Client,
        pool: PgPool,
        shutdown: Shutdown,
        what: String,
    ) -> Watch {
        let (done, ended) = bounded::<()>(0);
        let cancelled = Arc::new(AtomicBool::new(false));
        let cancelling = cancelled.clone();
        let pid = client
            .query_one("SELECT pg_backend_pid()", &[])
            .map(|row| row.get::<_, i32>(0));
        if let Ok(pid) = pid {
            // Not joined: it ends within 100 ms of the step, or once the
            // one query it may be running returns.
            let _ = std::thread::Builder::new()
                .name("taskhub-start-watch".into())
                .spawn(move || {
                    let started = Instant::now();
                    let mut word_at = FIRST_WORD;
                    loop {
                        match ended.recv_timeout(Duration::from_millis(100)) {
                            Err(RecvTimeoutError::Timeout) => {}
                            _ => return,
                        }
                        if shutdown.is_shutdown() {
                            // Its session must not outlive the stop: again
                            // every 100 ms until the step ends (a cancel
                            // between two statements is lost).
                            cancelling.store(true, Ordering::SeqCst);
                            if let Ok(mut conn) = pool.get() {
                                let _ = conn.execute("SELECT pg_cancel_backend($1)", &[&pid]);
                            }
                            continue;
                        }
                        if started.elapsed() >= word_at {
                            word_at += NEXT_WORD;
                            log::warn!("{}", word(&pool, pid, &what, started.elapsed()));
                        }
                    }
                });
        }
        Watch {
            _done: done,
            cancelled,
        }
    }

    /// The step is over: whether the watch cancelled it for a shutdown
    /// (else its error, if any, is its own).
    pub(crate) fn end(self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }
}

/// What the session `pid` has been waiting for.
fn word(pool: &PgPool, pid: i32, what: &str, waited: Duration) -> String {
    let found = pool
        .get()
        .ok()
        .and_then(|mut conn| blockers(&mut conn, pid));
    let secs = waited.as_secs();
    match found {
        Some(Waits::Lock(blockers)) => locked(what, secs, &blockers, "SIGTERM stops"),
        _ => format!("postgres: {what} has run for {secs} s; still waiting (SIGTERM stops)"),
    }
}

/// What a session waits for, as far as [`blockers`] can tell.
enum Waits {
    /// A lock, held by these sessions (pid, role, state, how long).
    Lock(String),
    /// Anything else, or nothing.
    Other,
}

/// What the session `pid` waits for, asked on `asker`; `None` when the
/// question failed.
fn blockers(asker: &mut postgres::Client, pid: i32) -> Option<Waits> {
    let row = asker.query_opt(BLOCKERS, &[&pid]).ok()?;
    let (kind, blockers) = match &row {
        Some(row) => (
            row.get::<_, Option<String>>(0),
            row.get::<_, Option<String>>(1),
        ),
        None => (None, None),
    };
    Some(match (kind.as_deref(), blockers) {
        (Some("Lock"), Some(blockers)) => Waits::Lock(blockers),
        _ => Waits::Other,
    })
}

fn locked(what: &str, secs: u64, blockers: &str, stop: &str) -> String {
    format!(
        "postgres: {what} has waited {secs} s for a lock held by {blockers}; it goes on once that transaction ends ({stop})"
    )
}

/// How often a [`LockWatch`] asks.
const LOCK_LOOK: Duration = Duration::from_secs(5);

/// A watch over a command's own session for as long as the command runs
/// (`dlq replay`, `dlq archive --to postgres`, `prune`): while the session
/// waits for another session's lock (a migration, a `LOCK TABLE` left in
/// an open transaction), it says who holds it, after 5 s and then
/// every 30 s; otherwise it says nothing. Without it such a
/// command waited with no word (found by a hostile test). It asks on a
/// connection of its own, opened at the first look, so a command shorter
/// than 5 s costs nothing; dropping the watch stops it.
pub struct LockWatch {
    _done: Sender<()>,
}

impl LockWatch {
    /// Watches the session `client` of the command `what`, asking through
    /// a new connection to `url`.
    pub(crate) fn begin(client: &mut postgres::Client, url: &str, what: &str) -> LockWatch {
        let (done, ended) = bounded::<()>(0);
        let pid = client
            .query_one("SELECT pg_backend_pid()", &[])
            .map(|row| row.get::<_, i32>(0));
        let (url, what) = (url.to_owned(), what.to_owned());
        if let Ok(pid) = pid {
            // Not joined: it ends within LOCK_LOOK of the command, or once
            // the one question it may be asking returns.
            let _ = std::thread::Builder::new()
                .name("taskhub-lock-watch".into())
                .spawn(move || {
                    let mut asker: Option<postgres::Client> = None;
                    let mut waiting: Option<(Instant, Instant)> = None;
                    while let Err(RecvTimeoutError::Timeout) = ended.recv_timeout(LOCK_LOOK) {
                        if asker.is_none() {
                            asker = crate::postgres::connect::postgres(&url).ok();
                        }
                        let Some(conn) = asker.as_mut() else { return };
                        match blockers(conn, pid) {
                            Some(Waits::Lock(blockers)) => {
                                let now = Instant::now();
                                // Waiting since about one look ago.
                                let ago = |d| now.checked_sub(d).unwrap_or(now);
                                let (since, said) =
                                    waiting.get_or_insert((ago(LOCK_LOOK), ago(NEXT_WORD)));
                                if now.duration_since(*said) >= NEXT_WORD {
                                    *said = now;
                                    let secs = now.duration_since(*since).as_secs();
                                    log::warn!(
                                        "{}",
                                        locked(
                                            &what,
                                            secs,
                                            &blockers,
                                            "stopping the command stops the wait"
                                        )
                                    );
                                }
                            }
                            Some(Waits::Other) => waiting = None,
                            None => asker = None,
                        }
                    }
                });
        }
        LockWatch { _done: done }
    }
}
