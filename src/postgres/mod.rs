//! PostgreSQL: connections, TLS, the worker pool and the migrations.

pub(crate) mod connect;
pub(crate) mod migrate;
pub(crate) mod pool;
pub(crate) mod prune;
