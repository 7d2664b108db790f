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

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::worker::dead_letter;
use crate::worker::delivery::Job;
use crate::worker::process::Processor;
use crate::worker::process::Stage;
use crate::worker::retry::Retry;

/// One worker thread: runs until every sender of `jobs` is gone and the
/// channel is drained. Finished entries are acked with the next jobs'
/// (see `process::ACK_HOLD`): when they are due, the wait for a job ends
/// and they are acked; and before the thread ends.
pub(crate) fn worker_thread(
    stage: Arc<Stage>,
    jobs: &Receiver<Job>,
    retry: Sender<Retry>,
    dead: Sender<dead_letter::Job>,
) {
    let mut processor = Processor::new(stage.clone(), retry, dead);
    processor.warm_up();
    loop {
        let job = match processor.ack_due() {
            None => jobs.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(due) => jobs.recv_deadline(due),
        };
        let job = match job {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
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
    flush(&mut processor);
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
