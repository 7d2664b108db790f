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
    let secs = waited.as_secs();
    let row = pool
        .get()
        .ok()
        .and_then(|mut conn| conn.query_opt(BLOCKERS, &[&pid]).ok().flatten());
    let (kind, blockers) = match &row {
        Some(row) => (
            row.get::<_, Option<String>>(0),
            row.get::<_, Option<String>>(1),
        ),
        None => (None, None),
    };
    match (kind.as_deref(), blockers) {
        (Some("Lock"), Some(blockers)) => format!(
            "postgres: {what} has waited {secs} s for a lock held by {blockers}; it goes on once that transaction ends (SIGTERM stops)"
        ),
        _ => format!("postgres: {what} has run for {secs} s; still waiting (SIGTERM stops)"),
    }
}
