//! The operator's HTTP endpoint (`--http ADDR`, off by default): a small
//! synchronous server (tiny_http) on its own thread, `taskhub-http`.
//!
//! - `/metrics`: Prometheus text format;
//! - `/healthz`: the process is alive;
//! - `/readyz`: Redis and PostgreSQL answer and every thread runs;
//! - `/dlq`: the dead-letter page (see `dlq_page.rs`).
//!
//! A scrape costs a few Redis commands (pending count, lag and dead-letter
//! length per stream); nothing is added to the path of an event.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::run::Shared;
use crate::stats::DURATION_BUCKETS;

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

/// Requests answered at once, each on its own short-lived thread: a client
/// that sends its body slowly, or never reads the answer, holds one of these
/// and never the server (tiny_http sets no socket timeouts).
const MAX_CONCURRENT: usize = 8;

/// Serves until shutdown.
pub(crate) fn http_thread(shared: &Arc<Shared>, server: &tiny_http::Server) {
    let busy = Arc::new(AtomicUsize::new(0));
    while !shared.shutdown.is_shutdown() {
        let request = match server.recv_timeout(Duration::from_millis(100)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                log::error!("http: {e}");
                shared.shutdown.sleep(Duration::from_millis(100));
                continue;
            }
        };
        if busy.fetch_add(1, Ordering::SeqCst) >= MAX_CONCURRENT {
            busy.fetch_sub(1, Ordering::SeqCst);
            let _ = request.respond(text(503, "text/plain", "busy\n".into()));
            continue;
        }
        let (s, b) = (shared.clone(), busy.clone());
        let spawned = std::thread::Builder::new()
            .name("taskhub-http-request".into())
            .spawn(move || {
                answer(&s, request);
                b.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            busy.fetch_sub(1, Ordering::SeqCst);
            log::error!("http: cannot start a request thread: {e}");
        }
    }
}

/// Answers one request; a panic (a bug) costs that request only.
fn answer(shared: &Shared, mut request: tiny_http::Request) {
    if !host_allowed(shared, &request) {
        let _ = request.respond(text(421, "text/plain", "unexpected Host header\n".into()));
        return;
    }
    let routed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::dlq_page::route(shared, &mut request).unwrap_or_else(|| route(shared, &request))
    }));
    let response = routed.unwrap_or_else(|_| {
        log::error!("http: {} {} panicked", request.method(), request.url());
        text(500, "text/plain", "internal error\n".into())
    });
    if let Err(e) = request.respond(response) {
        log::debug!("http: cannot answer: {e}");
    }
}

/// On a loopback address, only requests naming this server in their Host
/// header are served: a web page the operator visits cannot rebind its own
/// name to 127.0.0.1 and read the dead letters (DNS rebinding).
fn host_allowed(shared: &Shared, request: &tiny_http::Request) -> bool {
    let Some(addr) = &shared.config.http else {
        return true;
    };
    let loopback =
        addr.starts_with("127.") || addr.starts_with("[::1]") || addr.starts_with("localhost");
    if !loopback {
        return true;
    }
    let port = addr.rsplit(':').next().unwrap_or("");
    let Some(host) = request
        .headers()
        .iter()
        .find(|h| h.field.equiv("Host"))
        .map(|h| h.value.as_str().to_ascii_lowercase())
    else {
        return true; // HTTP/1.0 clients (curl -0, probes) send none
    };
    ["127.0.0.1", "localhost", "[::1]"]
        .iter()
        .any(|name| host == format!("{name}:{port}") || (port == "80" && host == *name))
}

type Response = tiny_http::Response<std::io::Cursor<Vec<u8>>>;

pub(crate) fn text(status: u16, content_type: &str, body: String) -> Response {
    tiny_http::Response::from_data(body.into_bytes())
        .with_status_code(status)
        .with_header(
            tiny_http::Header::from_bytes("Content-Type", content_type).expect("valid header"),
        )
}

fn route(shared: &Shared, request: &tiny_http::Request) -> Response {
    let path = request.url().split('?').next().unwrap_or("");
    match (request.method(), path) {
        (tiny_http::Method::Get, "/healthz") => text(200, "text/plain", "ok\n".into()),
        (tiny_http::Method::Get, "/readyz") => {
            let problems = readiness(shared);
            if problems.is_empty() {
                text(200, "text/plain", "ready\n".into())
            } else {
                text(503, "text/plain", problems.join("\n") + "\n")
            }
        }
        (tiny_http::Method::Get, "/metrics") => {
            text(200, "text/plain; version=0.0.4", metrics(shared))
        }
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
        .arg(crate::dead_letter::dead_letter_stream(stream))
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
