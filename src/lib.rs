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
mod tls;
mod worker;

pub use alerts::Alerts;
pub use backoff::Backoff;
pub use config::{default_consumer_name, Builder, Config, Mode};
pub use consumers::{consumers, remove_consumer, ConsumerInfo};
pub use dlq::{dead_letter_stream, Attempt, DeadLetter, Kind as DeadLetterKind};
pub use error::{
    classify_postgres, classify_sqlstate, Error, ErrorKind, FailureClass, HandlerError,
};
pub use event::{Event, Fields, Invalid};
pub use handler::http::HttpHandler;
pub use handler::sql::{SqlHandler, DEFAULT_STATEMENT};
pub use handler::{handler_fn, FnHandler, Handler, Tx};
pub use http::{HttpServer, Serving};
pub use postgres::migrate::migrate;
pub use produce::Producer;
pub use redact::redact;
pub use redis::{Pipe, RedisConn};
pub use shutdown::Shutdown;
pub use tls::Tls;
pub use worker::monitor::{Durations, Monitor};
pub use worker::stats::Summary;
pub use worker::Worker;

// The README's code blocks are compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
