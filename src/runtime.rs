//! The one place that knows the sync `postgres` client drives a small tokio
//! runtime of its own. Starting it on a thread that is already inside a
//! tokio runtime panics ("Cannot start a runtime from within a runtime"),
//! and tokio offers no way to ask whether this thread is inside one (as
//! opposed to merely knowing a runtime, as `spawn_blocking` threads do). So
//! the entry points that open PostgreSQL sessions run their work on a plain
//! thread of their own whenever a runtime is in sight.

/// Runs `f` on this thread, or, when this thread knows a tokio runtime, on
/// a scoped thread of its own (and waits for it). A panic in `f` goes on
/// in the caller.
pub(crate) fn off_async<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("taskhub-blocking".into())
            .spawn_scoped(scope, f)
            .expect("cannot start a thread")
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}
