//! The routes of the endpoint: `/healthz` (the process is alive),
//! `/readyz` (the worker is connected, its servers answer and every thread
//! runs), `/metrics` (`metrics.rs`) and `/dlq` (`page.rs`), behind a Host
//! check against DNS rebinding. Served by `wire.rs`, which bounds every
//! connection in number, size and time: no request can stop the worker or
//! delay its shutdown.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use crate::http::metrics::metrics;
use crate::http::page::Page;
use crate::http::wire::{self, Request, Response, Service, Settings};
use crate::http::HttpServer;
use crate::worker::monitor::Monitor;

/// Turns `9090` or `:9090` into `127.0.0.1:9090`: loopback unless told
/// otherwise.
pub(crate) fn bind_address(addr: &str) -> String {
    let port_only = addr.strip_prefix(':').unwrap_or(addr);
    if !port_only.is_empty() && port_only.chars().all(|c| c.is_ascii_digit()) {
        format!("127.0.0.1:{port_only}")
    } else {
        addr.to_owned()
    }
}

/// The routes of one endpoint.
pub(crate) struct Endpoint {
    monitor: Monitor,
    page: Page,
    /// Where it listens.
    addr: SocketAddr,
}

impl Endpoint {
    pub fn new(monitor: Monitor, server: &HttpServer, addr: SocketAddr) -> Endpoint {
        Endpoint {
            page: Page::new(
                addr.ip().is_loopback(),
                server.admin_token.clone(),
                server.read_token.clone(),
            ),
            monitor,
            addr,
        }
    }

    /// Serves `listener` (from `wire::bind`) until the worker shuts down.
    pub fn serve(self, listener: &TcpListener) {
        let shutdown = self.monitor.shutdown_handle();
        let endpoint: Arc<dyn Service> = Arc::new(self);
        let settings = Settings {
            thread_name: "taskhub-http-conn",
            ..Settings::default()
        };
        wire::serve(listener, &settings, &endpoint, &|| shutdown.is_shutdown());
    }

    /// On a loopback address, only requests naming this server in their
    /// Host header are served: a web page the operator visits cannot rebind
    /// its own name to 127.0.0.1 and read the dead letters (DNS rebinding).
    fn host_allowed(&self, request: &Request) -> bool {
        if !self.addr.ip().is_loopback() {
            return true;
        }
        let port = self.addr.port().to_string();
        let Some(host) = request.header("host").map(str::to_ascii_lowercase) else {
            return true; // HTTP/1.0 clients (curl -0, probes) send none
        };
        ["127.0.0.1", "localhost", "[::1]"]
            .iter()
            .any(|name| host == format!("{name}:{port}") || (port == "80" && host == *name))
    }
}

impl Service for Endpoint {
    fn body_limit(&self, head: &Request) -> usize {
        match head.method() {
            "POST" => self.page.form_limit(head.path()),
            _ => 0,
        }
    }

    fn respond(&self, request: &Request) -> Response {
        if !self.host_allowed(request) {
            return text(421, "text/plain", "unexpected Host header\n".into());
        }
        self.page
            .route(&self.monitor, request)
            .unwrap_or_else(|| route(&self.monitor, request))
    }
}

pub(crate) fn text(status: u16, content_type: &str, body: String) -> Response {
    Response::new(status, content_type, body)
}

fn route(monitor: &Monitor, request: &Request) -> Response {
    match (request.method(), request.path()) {
        ("GET" | "HEAD", "/healthz") => text(200, "text/plain", "ok\n".into()),
        ("GET" | "HEAD", "/readyz") => match monitor.ready() {
            Ok(()) => text(200, "text/plain", "ready\n".into()),
            Err(problems) => text(503, "text/plain", problems.join("\n") + "\n"),
        },
        ("GET" | "HEAD", "/metrics") => text(200, "text/plain; version=0.0.4", metrics(monitor)),
        _ => text(404, "text/plain", "not found\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_unless_told_otherwise() {
        assert_eq!(bind_address("9090"), "127.0.0.1:9090");
        assert_eq!(bind_address(":9090"), "127.0.0.1:9090");
        assert_eq!(bind_address("0.0.0.0:9090"), "0.0.0.0:9090");
        assert_eq!(bind_address("[::1]:9090"), "[::1]:9090");
    }
}
