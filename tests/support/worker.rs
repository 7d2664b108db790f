//! The library's `Worker` in the test process: a builder with fast timings,
//! the commit mode under test, and a worker running on its own thread that
//! is stopped when dropped.

use std::time::Duration;

use super::wait_until;

/// The commit mode under test: `TASKHUB_MODE` (`batch` or `per-event`),
/// batch by default. Binary runs inherit the variable; in-process workers
/// pass this to `Builder::mode`.
pub fn mode() -> taskhub::Mode {
    std::env::var("TASKHUB_MODE")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(taskhub::Mode::Batch)
}

/// A worker of `group` on `stream` with fast timings for tests: consumer
/// `c1`, 2 workers, 16-entry batches, 10–100 ms backoff, reclaim every
/// 500 ms of entries idle for 10 s; TASKHUB_MODE picks the mode.
pub fn fast_builder(redis_url: &str, db_url: &str, stream: &str, group: &str) -> taskhub::Builder {
    taskhub::Worker::builder()
        .mode(mode())
        .redis_url(redis_url)
        .database_url(db_url)
        .stream(stream)
        .group(group)
        .consumer("c1")
        .workers(2)
        .count(16)
        .block(Duration::from_millis(200))
        .backoff_base(Duration::from_millis(10))
        .backoff_cap(Duration::from_millis(100))
        .max_retry_after(Duration::from_secs(5))
        .reclaim_interval(Duration::from_millis(500))
        .reclaim_min_idle(Duration::from_secs(10))
        .shutdown_timeout(Duration::from_secs(15))
}

/// A library `Worker` running on its own thread, stopped (bounded) when
/// dropped so a failed assertion never leaves one running.
pub struct Running {
    stop: taskhub::Shutdown,
    handle: Option<std::thread::JoinHandle<Result<taskhub::Summary, taskhub::Error>>>,
}

impl Running {
    pub fn start(builder: taskhub::Builder, handler: impl taskhub::Handler) -> Running {
        Running::of(builder.build(handler).expect("valid configuration"))
    }

    /// Runs a worker the test built itself (to take its monitor first, say).
    pub fn of(worker: taskhub::Worker) -> Running {
        let stop = worker.shutdown_handle();
        let handle = std::thread::Builder::new()
            .name("test-worker-run".into())
            .spawn(move || worker.run())
            .unwrap();
        Running {
            stop,
            handle: Some(handle),
        }
    }

    /// Waits at most `timeout` for `run()` to return by itself (with
    /// `until_idle`); panics (after stopping it) on timeout or failure.
    pub fn join(mut self, timeout: Duration) -> taskhub::Summary {
        let handle = self.handle.take().unwrap();
        if !wait_until(timeout, || handle.is_finished()) {
            self.stop.shutdown();
            wait_until(Duration::from_secs(20), || handle.is_finished());
            panic!("run() did not finish by itself within {timeout:?}");
        }
        match handle.join() {
            Ok(Ok(summary)) => summary,
            Ok(Err(e)) => panic!("run() failed: {e}"),
            Err(_) => panic!("run() panicked"),
        }
    }

    /// Asks for a graceful stop and waits (bounded) for `run()` to return.
    pub fn stop(self) -> taskhub::Summary {
        self.stop.shutdown();
        self.join(Duration::from_secs(30))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.stop.shutdown();
            wait_until(Duration::from_secs(20), || h.is_finished());
        }
    }
}

/// Ends taskhub's transaction the way a handler calling
/// `batch_execute("COMMIT")` would, after writing its effect, by payload:
/// `commit` (then returns Ok), `commit-then-write` (then writes, which
/// fails outside taskhub's transaction, and returns that error),
/// `commit-begin` (then begins a transaction of its own, read-only, where
/// its write fails), `commit-begin-fail` (then begins one READ WRITE where
/// a statement fails), `rollback` (then returns Ok), `restart` (ROLLBACK, then writes in a
/// transaction of its own, and returns Ok).
pub struct EndsTransaction;

impl taskhub::Handler for EndsTransaction {
    fn handle(
        &self,
        event: &taskhub::Event,
        tx: &mut taskhub::Tx<'_>,
    ) -> Result<(), taskhub::HandlerError> {
        const INSERT: &str = "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)";
        tx.execute(INSERT, &[&event.event_id(), &event.payload()])?;
        match event.payload() {
            Some("commit") => tx.batch_execute("COMMIT")?,
            Some("commit-then-write") => {
                tx.batch_execute("COMMIT")?;
                tx.execute(INSERT, &[&"after-commit", &event.payload()])?;
            }
            Some("commit-begin") => {
                // Its own transaction is read-only: the write fails.
                tx.batch_execute("COMMIT; BEGIN")?;
                tx.execute(INSERT, &[&"after-commit", &event.payload()])?;
            }
            Some("commit-begin-fail") => {
                tx.batch_execute("COMMIT; BEGIN READ WRITE")?;
                tx.execute("SELECT 1 / 0", &[])?;
            }
            Some("rollback") => tx.batch_execute("ROLLBACK")?,
            Some("restart") => tx.batch_execute(
                "ROLLBACK; BEGIN READ WRITE; \
                 INSERT INTO notifications (event_id, payload) VALUES ('half', 'half')",
            )?,
            _ => {}
        }
        Ok(())
    }
}
