//! taskhub turns the at-least-once delivery of Redis Streams into exactly-once
//! effects in PostgreSQL, with plain threads: no async runtime.
//!
//! # The path of a message
//!
//! 1. A **reader** thread per stream (`reader.rs`) blocks in
//!    `XREADGROUP ... BLOCK` and sends batches over a bounded channel.
//! 2. A fixed pool of **worker** threads (`pool.rs`) takes them and
//!    **processes** each event (`process.rs`): a Redis marker as fast path,
//!    then one PostgreSQL transaction that inserts `(scope, event_id)` into
//!    `processed_events` and runs your [`Handler`], then COMMIT, marker, XACK.
//! 3. A retryable failure goes to the **retry** thread (`retry.rs`), which
//!    hands it back after a [`Backoff`] without blocking other events; a
//!    permanent one, or one out of attempts, goes to the **dead-letter**
//!    writer (`dead_letter.rs`), which moves it to `<stream>:dlq` and acks it
//!    in one atomic step.
//! 4. The **reclaimer** (`reclaim.rs`) takes over entries left pending by
//!    consumers that died.
//!
//! Every thread talks to Redis through a [`RedisConn`] (`redis_conn.rs`):
//! one server, or a Redis Cluster, found out from the URL. On a cluster,
//! name streams with a hash tag (`{tasks}:events`) so each stream and its
//! dead-letter stream share a slot.
//!
//! Every TLS connection (PostgreSQL, Redis, the [`HttpHandler`], the alert
//! webhook) goes through rustls (`tls/`). PostgreSQL takes libpq's URL
//! parameters (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`); Redis and the
//! HTTP side take a [`Tls`] (a CA file, a client certificate) from
//! [`Builder::redis_tls`] and [`Builder::http_tls`]. Without a CA file, the
//! system's trust store is used.
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

mod ack;
mod alert;
mod apply;
mod backoff;
mod config;
mod connect;
mod consumers;
mod dead_letter;
mod delivery;
pub mod dlq;
mod dlq_page;
mod error;
mod event;
mod fault;
mod handler;
mod http_access;
mod http_handler;
mod http_server;
mod http_wire;
mod in_flight;
mod keys;
mod migrate;
mod pool;
mod process;
mod produce;
mod reader;
mod reclaim;
mod redis_conn;
mod retry;
mod run;
mod shutdown;
mod sql_handler;
mod stats;
mod streams;
mod tls;

pub use backoff::Backoff;
pub use config::{default_consumer_name, Builder, Config, Mode};
pub use connect::redact;
pub use consumers::{consumers, remove_consumer, ConsumerInfo};
pub use dead_letter::{dead_letter_stream, DeadLetter, Kind as DeadLetterKind};
pub use delivery::Attempt;
pub use error::{
    classify_postgres, classify_sqlstate, Error, ErrorKind, FailureClass, HandlerError,
};
pub use event::{Event, Fields, Invalid};
pub use handler::{handler_fn, FnHandler, Handler, Tx};
pub use http_handler::HttpHandler;
pub use migrate::migrate;
pub use produce::Producer;
pub use redis_conn::{Pipe, RedisConn};
pub use run::Worker;
pub use shutdown::Shutdown;
pub use sql_handler::{SqlHandler, DEFAULT_STATEMENT};
pub use stats::Summary;
pub use tls::Tls;

// The README's code blocks are compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
