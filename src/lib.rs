//! taskhub turns the at-least-once delivery of Redis Streams into exactly-once
//! effects in PostgreSQL, with plain threads: no async runtime.
//!
//! # The path of a message
//!
//! Read the files of `src/worker/` in this order:
//!
//! 1. `read.rs`: a **reader** thread per stream blocks in
//!    `XREADGROUP ... BLOCK` and sends batches over a bounded channel, once
//!    `flow.rs` gave it room: every entry read holds a **ticket** that gives
//!    its place back when dropped, so no path can forget to.
//! 2. `pool.rs`: a fixed pool of **worker** threads takes the batches;
//!    `process.rs` decides what happens to each entry: a Redis marker as the
//!    fast path, else `apply.rs` runs one PostgreSQL transaction that
//!    inserts `(scope, event_id)` into `processed_events` and runs your
//!    [`Handler`], then COMMIT; `ack.rs` sets the markers and XACKs.
//! 3. `fail.rs`: a retryable failure goes to the **retry** thread
//!    (`retry.rs`), which
//!    hands it back after an exponential backoff with jitter (`backoff.rs`)
//!    without blocking other events; a permanent one, or one out of
//!    attempts, goes to the **dead-letter** writer (`dead_letter.rs`), which
//!    moves it to `<stream>:dlq` and acks it in one atomic step.
//! 4. `reclaim.rs`: the **reclaimer** takes over entries left pending by
//!    consumers that died.
//!
//! `worker/mod.rs` is the main loop that starts, watches and joins them;
//! each stage gets only what it uses (`context.rs`). Beside the worker, not
//! inside it: [`HttpServer`] (`http/`) and [`Alerts`] watch it through its
//! [`Monitor`]; [`dlq`] operates the dead-letter streams; `redis/` and
//! `postgres/` hold the connections (one server or a Redis Cluster, found
//! out from the URL; TLS through rustls in `tls/`).
//!
//! # Embedding
//!
//! ```no_run
//! use taskhub::{handler_fn, Event, HandlerError, Tx, Worker};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! taskhub::migrate("postgres://postgres@127.0.0.1/taskhub")?;
//! let worker = Worker::builder()
//!     .redis_url("redis://127.0.0.1:6379")
//!     .database_url("postgres://postgres@127.0.0.1/taskhub")
//!     .stream("tasks:events")
//!     .group("workers")
//!     .build(handler_fn(|event: &Event, tx: &mut Tx<'_>| {
//!         tx.execute(
//!             "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)",
//!             &[&event.event_id(), &event.payload()],
//!         )?;
//!         Ok::<(), HandlerError>(())
//!     }))?;
//! let stop = worker.shutdown_handle(); // call stop.shutdown() from anywhere
//! # drop(stop);
//! let summary = worker.run()?; // blocks until stopped
//! println!("{summary}");
//! # Ok(())
//! # }
//! ```
//!
//! The library never installs a signal handler or a logger: it logs through
//! the `log` crate and stops when its [`Shutdown`] handle fires.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod alerts;
mod backoff;
mod config;
mod consumers;
pub mod dlq;
mod error;
mod event;
mod fault;
mod handler;
mod http;
mod net;
mod postgres;
mod produce;
mod redact;
mod redis;
mod runtime;
mod shutdown;
mod status;
mod tls;
mod worker;

pub use alerts::Alerts;
pub use config::{Builder, Config, Mode};
pub use consumers::{consumers, prune_consumers, remove_consumer, ConsumerInfo};
pub use dlq::{DeadLetter, Kind as DeadLetterKind};
pub use error::{
    classify_postgres, classify_sqlstate, Error, ErrorKind, FailureClass, HandlerError,
};
pub use event::{EntryFields, Event, Fields, FieldsIter, Invalid};
pub use handler::http::{HttpHandler, HTTP_BUDGET};
pub use handler::sql::{SqlHandler, DEFAULT_STATEMENT};
pub use handler::{handler_fn, FnHandler, Handler, RetryBudget, Tx};
pub use http::{HttpServer, Serving};
pub use postgres::migrate::migrate;
pub use postgres::prune::{prune, Pruned};
pub use produce::Producer;
pub use shutdown::Shutdown;
pub use status::{status, GroupStatus};
pub use tls::Tls;
pub use worker::monitor::{Durations, Monitor};
pub use worker::retry::Retrying;
pub use worker::stats::Summary;
pub use worker::Worker;

// The README's code blocks are compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
