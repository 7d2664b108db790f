//! The operator's HTTP endpoint: a small hardened server (`wire.rs`), who
//! may read and change what (`access.rs`), the routes (`server.rs`) and the
//! dead-letter page (`page.rs`).

pub(crate) mod access;
pub(crate) mod page;
pub(crate) mod server;
pub(crate) mod wire;
