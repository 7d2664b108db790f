//! The integration tests: one binary, one module per area, so the crate and
//! its dependencies are linked into a test program once, not once per file.
//!
//! Each module is an area seen from outside, against real Redis and
//! PostgreSQL servers; `tests/support/` (declared once here) holds what they
//! share, split by concern. Tests run in parallel threads of this one
//! process: each uses its own stream names and database, and passes its
//! settings to the processes it starts (`Command::env`), never through the
//! test process's own environment.
//!
//! Run one area with `cargo test --test it <module>::`, e.g.
//! `cargo test --test it chaos::`, or one test by (part of) its name.

#[path = "../support/mod.rs"]
mod support;

// The guarantees: exactly once, whatever fails or crashes.
mod bad_input;
mod chaos;
mod crash;
mod exactly_once;
mod failures;
mod network;
mod one_outcome;
mod properties;

// Where the events come from and how they are applied.
mod cluster;
mod embed;
mod http_handler;
mod round_trips;
mod tls;

// Operating it: the CLI, the dead letters, the HTTP endpoints and pages.
mod cli;
mod consumers;
mod dlq_cli;
mod dlq_page;
mod hostile;
mod housekeeping;
mod operate;
mod overview;
mod status;

// The programs around it and the test support itself.
mod bench_smoke;
mod examples;
mod harness;
mod proxy;
