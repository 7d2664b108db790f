//! The worker pool: a fixed number of threads taking jobs from the bounded
//! channel and processing them (see `process.rs`).
//!
//! Handler panics are caught where the handler is called. Anything else that
//! panics while processing a job is caught here too: the thread logs it and
//! goes on, so the pool stays at full size. The job's entries that had not
//! been handed on yet are dropped by the unwinding, which releases their
//! in-flight tickets and leaves them pending (they will be delivered again);
//! those already handed to the retry thread or the dead-letter writer keep
//! their tickets there.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::worker::dead_letter;
use crate::worker::delivery::Job;
use crate::worker::process::Processor;
use crate::worker::process::Stage;
use crate::worker::retry::Retry;

/// One worker thread: runs until every sender of `jobs` is gone and the
/// channel is drained. Finished entries are acked with the next jobs'
/// (see `process::ACK_HOLD`): when they are due, the wait for a job ends
/// and they are acked; and before the thread ends. So are the handler's
/// events gathered from a backlog's reads (see `gather.rs`) applied when
/// they waited long enough, and before the thread ends.
pub(crate) fn worker_thread(
    stage: Arc<Stage>,
    jobs: &Receiver<Job>,
    retry: Sender<Retry>,
    dead: Sender<dead_letter::Job>,
) {
    let mut processor = Processor::new(stage.clone(), retry, dead);
    processor.warm_up();
    loop {
        // Gathered events that waited long enough go first, even while
        // jobs keep coming (see `gather.rs`).
        let gathered = stage.gathered.due();
        if gathered.is_some_and(|due| due <= Instant::now()) {
            apply_gathered(&mut processor, Some(Instant::now()));
        }
        let due = [processor.ack_due(), stage.gathered.due()]
            .into_iter()
            .flatten()
            .min();
        let job = match due {
            None => jobs.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(due) => jobs.recv_deadline(due),
        };
        let job = match job {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                // Held acks, or gathered events (at the top), are due.
                flush(&mut processor);
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let entries = job.len();
        if catch_unwind(AssertUnwindSafe(|| processor.process(job))).is_err() {
            log::error!(
                "{}: processing a batch of {entries} entries panicked; those not finished stay pending and will be delivered again",
                std::thread::current().name().unwrap_or("worker"),
            );
            // What earlier jobs finished is still owed its ack.
            flush(&mut processor);
            processor = Processor::new(
                stage.clone(),
                processor.retry_sender(),
                processor.dead_sender(),
            );
        }
    }
    // What waits to be gathered (the jobs channel is closed: nothing more
    // joins it from this thread).
    apply_gathered(&mut processor, None);
    flush(&mut processor);
}

/// Applies the gathered events due by `now`, all with `None` (see
/// `gather.rs`); a panic doing so is logged (the events it held stay
/// pending and will be delivered again), and the thread goes on.
fn apply_gathered(processor: &mut Processor, now: Option<Instant>) {
    if catch_unwind(AssertUnwindSafe(|| processor.apply_gathered_due(now))).is_err() {
        log::error!(
            "{}: applying gathered events panicked; those not finished stay pending and will be delivered again",
            std::thread::current().name().unwrap_or("worker"),
        );
        flush(processor);
    }
}

/// Acks what `processor` holds (see `process::ACK_HOLD`); a panic doing
/// so is logged, and the thread goes on.
fn flush(processor: &mut Processor) {
    if catch_unwind(AssertUnwindSafe(|| processor.flush_acks())).is_err() {
        log::error!(
            "{}: acking finished entries panicked; they stay pending and will be delivered again (as duplicates)",
            std::thread::current().name().unwrap_or("worker"),
        );
    }
}
