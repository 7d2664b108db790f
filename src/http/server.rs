//! The operator's HTTP endpoint (`--http ADDR`, off by default): the routes,
//! served by our own small server (`http_wire.rs`) from the thread
//! `taskhub-http`, one `taskhub-http-conn` thread per connection.
//!
//! - `/metrics`: Prometheus text format;
//! - `/healthz`: the process is alive;
//! - `/readyz`: Redis and PostgreSQL answer and every thread runs;
//! - `/dlq`: the dead-letter page (see `dlq_page.rs`; who may see and change
//!   it: `http_access.rs`).
//!
//! A scrape costs a few Redis commands (pending count, lag and dead-letter
//! length per stream); nothing is added to the path of an event. No request
//! can stop the worker or delay its shutdown: `http_wire.rs` bounds every
//! connection in number, size and time.

use std::fmt::Write as _;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use crate::http::access::is_loopback;
use crate::http::page::Page;
use crate::http::wire::{self, Request, Response, Service, Settings};
use crate::worker::stats::DURATION_BUCKETS;
use crate::worker::Shared;

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

/// Serves `listener` (from `wire::bind`) until shutdown.
pub(crate) fn http_thread(shared: &Arc<Shared>, listener: &TcpListener) {
    let endpoint: Arc<dyn Service> = Arc::new(Endpoint {
        page: Page::new(&shared.config),
        shared: shared.clone(),
    });
    let settings = Settings {
        thread_name: "taskhub-http-conn",
        ..Settings::default()
    };
    wire::serve(listener, &settings, &endpoint, &|| {
        shared.shutdown.is_shutdown()
    });
}

/// The routes of the endpoint.
struct Endpoint {
    shared: Arc<Shared>,
    page: Page,
}

impl Service for Endpoint {
    fn body_limit(&self, head: &Request) -> usize {
        match head.method() {
            "POST" => self.page.form_limit(head.path()),
            _ => 0,
        }
    }

    fn respond(&self, request: &Request) -> Response {
        if !host_allowed(&self.shared, request) {
            return text(421, "text/plain", "unexpected Host header\n".into());
        }
        self.page
            .route(&self.shared, request)
            .unwrap_or_else(|| route(&self.shared, request))
    }
}

/// On a loopback address, only requests naming this server in their Host
/// header are served: a web page the operator visits cannot rebind its own
/// name to 127.0.0.1 and read the dead letters (DNS rebinding).
fn host_allowed(shared: &Shared, request: &Request) -> bool {
    let Some(addr) = &shared.config.http else {
        return true;
    };
    if !is_loopback(addr) {
        return true;
    }
    let port = addr.rsplit(':').next().unwrap_or("");
    let Some(host) = request.header("host").map(str::to_ascii_lowercase) else {
        return true; // HTTP/1.0 clients (curl -0, probes) send none
    };
    ["127.0.0.1", "localhost", "[::1]"]
        .iter()
        .any(|name| host == format!("{name}:{port}") || (port == "80" && host == *name))
}

pub(crate) fn text(status: u16, content_type: &str, body: String) -> Response {
    Response::new(status, content_type, body)
}

fn route(shared: &Shared, request: &Request) -> Response {
    match (request.method(), request.path()) {
        ("GET" | "HEAD", "/healthz") => text(200, "text/plain", "ok\n".into()),
        ("GET" | "HEAD", "/readyz") => {
            let problems = readiness(shared);
            if problems.is_empty() {
                text(200, "text/plain", "ready\n".into())
            } else {
                text(503, "text/plain", problems.join("\n") + "\n")
            }
        }
        ("GET" | "HEAD", "/metrics") => text(200, "text/plain; version=0.0.4", metrics(shared)),
        _ => text(404, "text/plain", "not found\n".into()),
    }
}

fn readiness(shared: &Shared) -> Vec<String> {
    let mut problems = Vec::new();
    let redis = shared
        .redis_conn()
        .and_then(|mut c| redis::cmd("PING").query::<()>(&mut *c));
    if let Err(e) = redis {
        problems.push(format!("redis: {e}"));
    }
    let pg = shared
        .pg
        .get_timeout(Duration::from_secs(2))
        .map_err(|e| e.to_string())
        .and_then(|mut c| {
            c.simple_query("SELECT 1")
                .map(drop)
                .map_err(|e| e.to_string())
        });
    if let Err(e) = pg {
        problems.push(format!("postgres: {e}"));
    }
    if shared.shutdown.is_shutdown() {
        problems.push("shutting down".into());
    }
    if let Some(dead) = shared.dead_thread() {
        problems.push(format!("thread {dead} stopped"));
    }
    problems
}

/// Per stream: pending in the group, lag, dead-letter length.
type Gauges = [u64; 3];

/// The gauges of one stream; `None` when Redis cannot say.
fn stream_gauges(shared: &Shared, stream: &str) -> Option<Gauges> {
    let mut conn = shared.redis_conn().ok()?;
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(&mut *conn)
        .ok()?;
    let group = groups.iter().find(|g| {
        matches!(g.get("name"), Some(redis::Value::BulkString(b)) if b == shared.config.group.as_bytes())
    })?;
    let int = |k: &str| match group.get(k) {
        Some(redis::Value::Int(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    };
    let dead: u64 = redis::cmd("XLEN")
        .arg(crate::dlq::dead_letter_stream(stream))
        .query(&mut *conn)
        .ok()?;
    Some([int("pending"), int("lag"), dead])
}

/// Escapes a Prometheus label value.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn metrics(shared: &Shared) -> String {
    let s = shared.stats.snapshot();
    let mut out = String::with_capacity(4096);
    let mut counter = |name: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
        );
    };
    counter(
        "taskhub_events_read_total",
        "Entries read from the streams, redeliveries included.",
        s.read,
    );
    counter(
        "taskhub_events_applied_total",
        "Events whose effect this worker committed.",
        s.applied,
    );
    counter(
        "taskhub_duplicates_total",
        "Deliveries skipped because the event was already applied.",
        s.duplicates,
    );
    counter(
        "taskhub_retries_total",
        "Retries scheduled after a retryable failure.",
        s.retries,
    );
    counter(
        "taskhub_reclaimed_total",
        "Entries taken over from other consumers.",
        s.reclaimed,
    );
    counter(
        "taskhub_handler_panics_total",
        "Handler panics caught.",
        s.panics,
    );
    let _ = writeln!(
        out,
        "# HELP taskhub_dead_lettered_total Events moved to the dead-letter stream.\n# TYPE taskhub_dead_lettered_total counter"
    );
    for (kind, n) in [
        ("permanent", s.dead_permanent),
        ("exhausted", s.dead_exhausted),
        ("crash_loop", s.dead_crash_loop),
        ("invalid", s.dead_invalid),
        ("trimmed", s.dead_trimmed),
    ] {
        let _ = writeln!(out, "taskhub_dead_lettered_total{{kind=\"{kind}\"}} {n}");
    }
    let (buckets, sum) = shared.stats.handler_seconds.read();
    let _ = writeln!(
        out,
        "# HELP taskhub_handler_duration_seconds Duration of handler calls (one call per event, or per batch).\n# TYPE taskhub_handler_duration_seconds histogram"
    );
    for (bound, count) in DURATION_BUCKETS.iter().zip(buckets) {
        let _ = writeln!(
            out,
            "taskhub_handler_duration_seconds_bucket{{le=\"{bound}\"}} {count}"
        );
    }
    let _ = writeln!(
        out,
        "taskhub_handler_duration_seconds_bucket{{le=\"+Inf\"}} {}",
        buckets[10]
    );
    let _ = writeln!(out, "taskhub_handler_duration_seconds_sum {sum}");
    let _ = writeln!(
        out,
        "taskhub_handler_duration_seconds_count {}",
        buckets[10]
    );
    let _ = writeln!(
        out,
        "# HELP taskhub_in_flight Entries read and not finished by this worker.\n# TYPE taskhub_in_flight gauge\ntaskhub_in_flight {}",
        shared.in_flight.len()
    );
    let gauges: Vec<(String, Option<Gauges>)> = shared
        .config
        .streams
        .iter()
        .map(|stream| (label(stream), stream_gauges(shared, stream)))
        .collect();
    for (name, help, pick) in [
        (
            "taskhub_pending",
            "Entries pending in the group (all consumers).",
            0,
        ),
        (
            "taskhub_stream_lag",
            "Entries in the stream not yet delivered to the group.",
            1,
        ),
        (
            "taskhub_dead_letters",
            "Length of the dead-letter stream.",
            2,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for (stream, values) in &gauges {
            if let Some(v) = values {
                let value = v[pick];
                let _ = writeln!(out, "{name}{{stream=\"{stream}\"}} {value}");
            }
        }
    }
    out
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
