//! `/metrics` in the Prometheus text format: the worker's counters, its
//! handler durations, what it holds, and per stream the group's pending
//! count, its lag and the dead-letter length. A scrape costs a few Redis
//! commands; nothing is added to the path of an event.

use std::fmt::Write as _;

use crate::worker::monitor::Monitor;

/// Per stream: pending in the group, lag, dead-letter length.
type Gauges = [u64; 3];

/// The gauges of one stream; `None` when Redis cannot say.
fn stream_gauges(monitor: &Monitor, stream: &str) -> Option<Gauges> {
    let mut conn = monitor.redis_conn().ok()?;
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query(&mut *conn)
        .ok()?;
    let group = groups.iter().find(|g| {
        matches!(g.get("name"), Some(redis::Value::BulkString(b)) if b == monitor.group().as_bytes())
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

/// The text of one scrape.
pub(crate) fn metrics(monitor: &Monitor) -> String {
    let s = monitor.summary();
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
    let durations = monitor.handler_durations();
    let _ = writeln!(
        out,
        "# HELP taskhub_handler_duration_seconds Duration of handler calls (one call per event, or per batch).\n# TYPE taskhub_handler_duration_seconds histogram"
    );
    for (bound, count) in &durations.buckets {
        let _ = writeln!(
            out,
            "taskhub_handler_duration_seconds_bucket{{le=\"{bound}\"}} {count}"
        );
    }
    let _ = writeln!(
        out,
        "taskhub_handler_duration_seconds_bucket{{le=\"+Inf\"}} {}",
        durations.count
    );
    let _ = writeln!(
        out,
        "taskhub_handler_duration_seconds_sum {}",
        durations.sum_seconds
    );
    let _ = writeln!(
        out,
        "taskhub_handler_duration_seconds_count {}",
        durations.count
    );
    let _ = writeln!(
        out,
        "# HELP taskhub_in_flight Entries read and not finished by this worker.\n# TYPE taskhub_in_flight gauge\ntaskhub_in_flight {}",
        monitor.in_flight()
    );
    let gauges: Vec<(String, Option<Gauges>)> = monitor
        .streams()
        .iter()
        .map(|stream| (label(stream), stream_gauges(monitor, stream)))
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
