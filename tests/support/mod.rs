//! Shared test support, declared once by `tests/it/main.rs` and split by
//! concern: `databases` (a fresh database per test), `streams` (Redis as the
//! tests see it), `binary` (`taskhub` as a subprocess), `worker` (the library
//! in the test process), `servers` (private Redis and PostgreSQL),
//! `scenario` (arrange, run until idle, assert each event applied once), and
//! the specialised ones: `certs`, `cluster`, `downstream` (an HTTP server),
//! `browser` (headless Chromium) and `proxy` (fault injection; the chaos
//! driver includes that file by path too, so it stands alone). What every
//! test uses is re-exported here.
//!
//! Tests run in parallel threads of one process: each one uses its own
//! stream names and its own database, so they never see each other, and
//! gives the processes it starts their settings through `Command::env`,
//! never through the test process's environment. Tests that stop, restart
//! or kill a server start a private one on a free port and never touch the
//! shared ones.

mod binary;
mod databases;
mod scenario;
mod servers;
mod streams;
mod worker;

pub mod browser;
pub mod certs;
pub mod cluster;
pub mod downstream;
pub mod proxy;

pub use binary::*;
pub use databases::*;
pub use scenario::*;
pub use servers::*;
pub use streams::*;
pub use worker::*;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}_{}_{}_{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Polls `f` every 20 ms until it is true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Path of a file in the repository.
pub fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// A temporary directory removed at the end.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let dir = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
