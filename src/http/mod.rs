//! The operator's HTTP endpoint, started beside a worker with
//! [`HttpServer`]: a small hardened server (`wire.rs`), who may read and
//! change what (`access.rs`), the routes (`server.rs`), the metrics
//! (`metrics.rs`) and the dead-letter page (`page.rs`). It only watches the
//! worker through its [`Monitor`]; the worker knows nothing of it.

use std::net::SocketAddr;
use std::thread::JoinHandle;

use crate::error::{Error, ErrorKind};
use crate::worker::monitor::Monitor;

pub(crate) mod access;
pub(crate) mod bulk;
pub(crate) mod filter;
pub(crate) mod html;
pub(crate) mod message;
pub(crate) mod metrics;
pub(crate) mod overview;
pub(crate) mod page;
pub(crate) mod server;
pub(crate) mod view;
pub(crate) mod wire;

/// `/metrics`, `/healthz`, `/readyz` and the `/dlq` page of one worker.
///
/// ```no_run
/// # fn main() -> Result<(), taskhub::Error> {
/// # let worker = taskhub::Worker::builder().build(taskhub::SqlHandler::default())?;
/// let http = taskhub::HttpServer::new("9090") // 127.0.0.1:9090
///     .admin_token("a long random admin token")
///     .start(&worker.monitor())?;
/// let summary = worker.run()?; // the endpoint stops with the worker
/// http.join();
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct HttpServer {
    addr: String,
    admin_token: Option<String>,
    read_token: Option<String>,
}

impl std::fmt::Debug for HttpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpServer")
            .field("addr", &self.addr)
            .field("admin_token", &self.admin_token.as_ref().map(|_| "***"))
            .field("read_token", &self.read_token.as_ref().map(|_| "***"))
            .finish()
    }
}

/// The shortest token accepted.
const MIN_TOKEN: usize = 12;

impl HttpServer {
    /// An endpoint on `addr`; a port alone (`9090`, `:9090`) means
    /// `127.0.0.1:PORT`. Without a token, the `/dlq` page is read-only and,
    /// off loopback, refuses to show anything.
    pub fn new(addr: &str) -> HttpServer {
        HttpServer {
            addr: server::bind_address(addr),
            admin_token: None,
            read_token: None,
        }
    }

    /// The token that enables the replay and delete buttons of `/dlq` (at
    /// least 12 characters; it also lets one read the page).
    pub fn admin_token(mut self, token: &str) -> HttpServer {
        self.admin_token = Some(token.to_owned());
        self
    }

    /// The token needed to read `/dlq` (`Authorization: Bearer`, or the
    /// page's login form). Required to see the page off loopback.
    pub fn read_token(mut self, token: &str) -> HttpServer {
        self.read_token = Some(token.to_owned());
        self
    }

    /// Binds the address and serves from the thread `taskhub-http` until
    /// the monitor's worker shuts down. Should that thread ever stop on its
    /// own, it shuts the worker down (an operator would otherwise watch a
    /// dead endpoint).
    pub fn start(self, monitor: &Monitor) -> Result<Serving, Error> {
        for (name, token) in [("admin", &self.admin_token), ("read", &self.read_token)] {
            if token.as_ref().is_some_and(|t| t.len() < MIN_TOKEN) {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("the {name} token must be at least {MIN_TOKEN} characters"),
                ));
            }
        }
        let fail = |e| {
            Error::with_source(
                ErrorKind::Config,
                format!("cannot serve HTTP on {}", self.addr),
                e,
            )
        };
        let listener = wire::bind(&self.addr).map_err(fail)?;
        let local = listener.local_addr().map_err(fail)?;
        let endpoint = server::Endpoint::new(monitor.clone(), &self, local);
        let shutdown = monitor.shutdown_handle();
        let thread = std::thread::Builder::new()
            .name("taskhub-http".into())
            .spawn(move || {
                let _stop = StopOnExit(shutdown);
                endpoint.serve(&listener);
            })
            .map_err(|e| {
                Error::with_source(ErrorKind::Thread, "cannot start thread taskhub-http", e)
            })?;
        log::info!("http: serving /metrics, /healthz, /readyz and /dlq on http://{local}");
        Ok(Serving {
            addr: local,
            thread,
        })
    }
}

/// Shuts the worker down when the HTTP thread ends for any reason, a panic
/// included; a no-op when the worker is already stopping.
struct StopOnExit(crate::Shutdown);

impl Drop for StopOnExit {
    fn drop(&mut self) {
        if !self.0.is_shutdown() {
            log::error!("taskhub-http: thread stopped unexpectedly; shutting down");
            self.0.shutdown();
        }
    }
}

/// A started [`HttpServer`].
#[derive(Debug)]
pub struct Serving {
    addr: SocketAddr,
    thread: JoinHandle<()>,
}

impl Serving {
    /// The address it listens on (with the port chosen, for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until it stopped (after the worker's shutdown, within a few
    /// seconds: open connections end by their own timeouts).
    pub fn join(self) {
        let _ = self.thread.join();
    }
}
