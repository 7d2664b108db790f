//! `/metrics` in the Prometheus text format: this instance's counters per
//! stream, its handler durations and what it holds; the process's memory
//! and start time; and per stream the group-wide gauges (pending, lag,
//! oldest pending age), which every instance of a group reports alike
//! (aggregate them with `max`, not `sum`), and the dead-letter stream's
//! length, which every group reading the stream shares. Every series of a
//! stream carries the `group` label too: several groups can read one
//! stream, and their figures must not be taken for one another's. A
//! scrape costs three Redis commands per stream; nothing is added to the
//! path of an event.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::status::{gauges, Gauges};
use crate::worker::monitor::Monitor;
use crate::worker::stats::Summary;

/// Escapes a Prometheus label value.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// `# HELP` and `# TYPE` lines.
fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The counters that have a `stream` label, and how to read each one.
type PerStream = (&'static str, &'static str, fn(&Summary) -> u64);

const COUNTERS: [PerStream; 6] = [
    (
        "taskhub_events_read_total",
        "Entries read from the stream, redeliveries included.",
        |s| s.read,
    ),
    (
        "taskhub_events_applied_total",
        "Events whose effect this instance committed.",
        |s| s.applied,
    ),
    (
        "taskhub_duplicates_total",
        "Deliveries skipped because the event was already applied.",
        |s| s.duplicates,
    ),
    (
        "taskhub_retries_total",
        "Retries scheduled after a retryable failure.",
        |s| s.retries,
    ),
    (
        "taskhub_reclaimed_total",
        "Entries taken over from other consumers.",
        |s| s.reclaimed,
    ),
    (
        "taskhub_gathered_total",
        "The handler's own events of a backlog's mixed reads that waited to be applied with other reads' (batch mode).",
        |s| s.gathered,
    ),
];

/// The text of one scrape.
pub(crate) fn metrics(monitor: &Monitor) -> String {
    let mut out = String::with_capacity(8192);
    let group = label(monitor.group());
    let streams: Vec<(String, Summary)> = monitor
        .streams()
        .iter()
        .map(|s| (label(s), monitor.summary_of(s)))
        .collect();
    for (name, help, value) in COUNTERS {
        head(&mut out, name, "counter", help);
        for (stream, s) in &streams {
            let _ = writeln!(
                out,
                "{name}{{stream=\"{stream}\",group=\"{group}\"}} {}",
                value(s)
            );
        }
    }
    head(
        &mut out,
        "taskhub_dead_lettered_total",
        "counter",
        "Events moved to the dead-letter stream.",
    );
    for (stream, s) in &streams {
        for (kind, n) in [
            ("permanent", s.dead_permanent),
            ("exhausted", s.dead_exhausted),
            ("crash_loop", s.dead_crash_loop),
            ("invalid", s.dead_invalid),
            ("trimmed", s.dead_trimmed),
        ] {
            let _ = writeln!(
                out,
                "taskhub_dead_lettered_total{{stream=\"{stream}\",group=\"{group}\",kind=\"{kind}\"}} {n}"
            );
        }
    }
    head(
        &mut out,
        "taskhub_handler_panics_total",
        "counter",
        "Handler panics caught.",
    );
    let summary = monitor.summary();
    let _ = writeln!(out, "taskhub_handler_panics_total {}", summary.panics);
    head(
        &mut out,
        "taskhub_consumer_name_clashes_total",
        "counter",
        "Times another running instance was found using this instance's consumer name (each instance needs a name of its own).",
    );
    let _ = writeln!(
        out,
        "taskhub_consumer_name_clashes_total{{group=\"{group}\"}} {}",
        summary.name_clashes
    );
    durations(&mut out, monitor);
    head(
        &mut out,
        "taskhub_in_flight",
        "gauge",
        "Entries read and not finished by this instance.",
    );
    let _ = writeln!(out, "taskhub_in_flight {}", monitor.in_flight());
    head(
        &mut out,
        "taskhub_retries_waiting",
        "gauge",
        "Deliveries waiting in this instance for a retry (sum over instances for the group's).",
    );
    let _ = writeln!(
        out,
        "taskhub_retries_waiting{{group=\"{group}\"}} {}",
        monitor.retrying().0
    );
    group_gauges(&mut out, monitor, &group);
    process(&mut out, monitor);
    out
}

fn durations(out: &mut String, monitor: &Monitor) {
    let d = monitor.handler_durations();
    head(
        out,
        "taskhub_handler_duration_seconds",
        "histogram",
        "Duration of handler calls (one call per event, or per batch).",
    );
    for (bound, count) in &d.buckets {
        let _ = writeln!(
            out,
            "taskhub_handler_duration_seconds_bucket{{le=\"{bound}\"}} {count}"
        );
    }
    let _ = writeln!(
        out,
        "taskhub_handler_duration_seconds_bucket{{le=\"+Inf\"}} {}\n\
         taskhub_handler_duration_seconds_sum {}\n\
         taskhub_handler_duration_seconds_count {}",
        d.count, d.sum_seconds, d.count
    );
}

/// The group-wide gauges of every stream; a stream Redis cannot answer for
/// is left out of this scrape.
fn group_gauges(out: &mut String, monitor: &Monitor, group: &str) {
    let now = SystemTime::now();
    // A scrape waits a second at most for its place beside the page's
    // requests (Prometheus gives up on the whole scrape after ten).
    let mut conn = monitor
        .redis_conn_within(std::time::Duration::from_secs(1))
        .ok();
    let found: Vec<(String, Gauges)> = monitor
        .streams()
        .iter()
        .filter_map(|stream| {
            let g = gauges(conn.as_mut()?, stream, monitor.group(), now).ok()??;
            Some((label(stream), g))
        })
        .collect();
    type Pick = fn(&Gauges) -> Option<f64>;
    let all: [(&str, &str, Pick); 3] = [
        (
            "taskhub_pending",
            "Entries pending in the group (all consumers; the same from every instance).",
            |g| Some(g.pending as f64),
        ),
        (
            "taskhub_stream_lag",
            "Entries in the stream not yet delivered to the group.",
            |g| g.lag.map(|n| n as f64),
        ),
        (
            "taskhub_oldest_pending_seconds",
            "Age of the oldest pending entry of the group (0 when none).",
            |g| Some(g.oldest_pending.map_or(0.0, |d| d.as_secs_f64())),
        ),
    ];
    for (name, help, pick) in all {
        head(out, name, "gauge", help);
        for (stream, g) in &found {
            if let Some(value) = pick(g) {
                let _ = writeln!(
                    out,
                    "{name}{{stream=\"{stream}\",group=\"{group}\"}} {value}"
                );
            }
        }
    }
    // Every group's letters: groups reading one stream share it, so no
    // group label.
    head(
        out,
        "taskhub_dead_letters",
        "gauge",
        "Length of the dead-letter stream (every group's letters: groups reading one stream share it).",
    );
    for (stream, g) in &found {
        let _ = writeln!(
            out,
            "taskhub_dead_letters{{stream=\"{stream}\"}} {}",
            g.dead_letters
        );
    }
}

/// Build and process metrics.
fn process(out: &mut String, monitor: &Monitor) {
    head(
        out,
        "taskhub_build_info",
        "gauge",
        "The running version of taskhub (always 1).",
    );
    let _ = writeln!(
        out,
        "taskhub_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    if let Some(bytes) = resident_bytes() {
        head(
            out,
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
        );
        let _ = writeln!(out, "process_resident_memory_bytes {bytes}");
    }
    let started = monitor
        .started()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    head(
        out,
        "process_start_time_seconds",
        "gauge",
        "Start time of the worker since the Unix epoch, in seconds.",
    );
    let _ = writeln!(
        out,
        "process_start_time_seconds {:.3}",
        started.as_secs_f64()
    );
}

/// `VmRSS` of `/proc/self/status` (Linux), in bytes.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
