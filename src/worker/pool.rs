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

use crossbeam_channel::{Receiver, Select, Sender};

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
    let gathered = &stage.gathered;
    loop {
        // Gathered events that waited long enough go first, even while
        // jobs keep coming (see `gather.rs`).
        if gathered.due().is_some_and(|due| due <= Instant::now()) {
            // Busy for a while: the deadline of what else waits goes to a
            // thread that waits for a job.
            gathered.wake();
            apply_gathered(&mut processor, Some(Instant::now()));
        }
        let due = [processor.ack_due(), gathered.due()]
            .into_iter()
            .flatten()
            .min();
        // A job, or the word that events were gathered (then the wait
        // starts again, with their deadline), or the deadline.
        let mut select = Select::new();
        let for_job = select.recv(jobs);
        select.recv(gathered.woken());
        let ready = match due {
            None => Ok(select.select()),
            Some(due) => select.select_deadline(due),
        };
        let job = match ready {
            Ok(op) if op.index() == for_job => op.recv(jobs),
            Ok(op) => {
                let _ = op.recv(gathered.woken());
                continue;
            }
            Err(_) => {
                if processor.ack_due().is_some_and(|due| due <= Instant::now()) {
                    flush(&mut processor);
                }
                continue;
            }
        };
        let Ok(job) = job else { break }; // closed and drained
        if gathered.due().is_some() {
            // This thread may be busy for a while: the word goes on to
            // one that waits, for the deadline of what is gathered.
            gathered.wake();
        }
        let entries = job.len();
        run(&mut processor, |p| p.process(job)).unwrap_or_else(|()| {
            log::error!(
                "{}: processing a batch of {entries} entries panicked; those not finished stay pending and will be delivered again",
                thread_name(),
            )
        });
    }
    // What waits to be gathered (the jobs channel is closed: nothing more
    // joins it from this thread).
    apply_gathered(&mut processor, None);
    flush(&mut processor);
}

/// Applies the gathered events due by `now`, all with `None` (see
/// `gather.rs`), as [`run`] runs a job.
fn apply_gathered(processor: &mut Processor, now: Option<Instant>) {
    run(processor, |p| p.apply_gathered_due(now)).unwrap_or_else(|()| {
        log::error!(
            "{}: applying gathered events panicked; those not finished stay pending and will be delivered again",
            thread_name(),
        )
    });
}

/// Runs `step` on `processor`. After a panic (`Err`, for the caller to
/// log; the entries the step held and had not handed on stay pending),
/// what earlier steps finished is acked, and a new processor (a new
/// database session) goes on, so the pool stays at full size.
fn run(processor: &mut Processor, step: impl FnOnce(&mut Processor)) -> Result<(), ()> {
    if catch_unwind(AssertUnwindSafe(|| step(processor))).is_ok() {
        return Ok(());
    }
    flush(processor);
    *processor = Processor::new(
        processor.stage.clone(),
        processor.retry_sender(),
        processor.dead_sender(),
    );
    Err(())
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("worker").to_owned()
}

/// Acks what `processor` holds (see `process::ACK_HOLD`); a panic doing
/// so is logged, and the thread goes on.
fn flush(processor: &mut Processor) {
    if catch_unwind(AssertUnwindSafe(|| processor.flush_acks())).is_err() {
        log::error!(
            "{}: acking finished entries panicked; they stay pending and will be delivered again (as duplicates)",
            thread_name(),
        );
    }
}
