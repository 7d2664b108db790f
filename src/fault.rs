//! Fault injection for the crash tests: stop the process at a named point.
//!
//! Set `TASKHUB_FAULT=<point>` (or `<point>@<event_id>` to stop only on one
//! event). When the point is reached, the process prints
//! `taskhub-fault: <point> <event_id>` to stderr and freezes the thread, so
//! the test can SIGKILL it at exactly that moment; with
//! `TASKHUB_FAULT_PAUSE_MS=<ms>` as well, the thread goes on after that
//! pause.
//!
//! Only with the `fault-injection` feature, which the tests turn on; in any
//! other build the checks are empty functions and the environment is never
//! read.

#[cfg(feature = "fault-injection")]
use std::io::Write;
#[cfg(feature = "fault-injection")]
use std::sync::OnceLock;

/// Named points in the path of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Point {
    /// Inside the handler call, before it runs.
    InHandler,
    /// After the handler, before COMMIT.
    BeforeCommit,
    /// After COMMIT, before the Redis marker.
    AfterCommit,
    /// A rejected batch's events about to be applied apart, one
    /// subtransaction each (`taskhub_apply_each`), before the last
    /// question whether they are still fresh.
    BeforeEach,
    /// After the Redis marker, before XACK.
    AfterMarker,
    /// A handler's event of a backlog's mixed read was put to wait for
    /// others (`worker/gather.rs`), not applied yet.
    Gathered,
    /// `taskhub dlq archive`: a chunk is copied and verified, not yet removed
    /// from the dead-letter stream (the id is the chunk's first dead-letter id).
    ArchiveAfterCopy,
}

#[cfg(feature = "fault-injection")]
impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::InHandler => "in-handler",
            Point::BeforeCommit => "before-commit",
            Point::AfterCommit => "after-commit",
            Point::BeforeEach => "before-each",
            Point::AfterMarker => "after-marker",
            Point::Gathered => "gathered",
            Point::ArchiveAfterCopy => "archive-after-copy",
        }
    }
}

#[cfg(feature = "fault-injection")]
fn armed() -> &'static Option<(String, Option<String>)> {
    static ARMED: OnceLock<Option<(String, Option<String>)>> = OnceLock::new();
    ARMED.get_or_init(|| {
        let spec = std::env::var("TASKHUB_FAULT").ok()?;
        Some(match spec.split_once('@') {
            Some((point, id)) => (point.to_owned(), Some(id.to_owned())),
            None => (spec, None),
        })
    })
}

/// Whether `point` is armed at all (for any event).
#[cfg(feature = "fault-injection")]
pub(crate) fn is_armed(point: Point) -> bool {
    matches!(armed(), Some((p, _)) if p == point.name())
}

/// Freezes here forever if `point` is armed for `event_id`.
#[cfg(feature = "fault-injection")]
pub(crate) fn hit(point: Point, event_id: &str) {
    let Some((p, only)) = armed() else { return };
    if p != point.name() || only.as_deref().is_some_and(|id| id != event_id) {
        return;
    }
    let _ = writeln!(
        std::io::stderr(),
        "taskhub-fault: {} {event_id}",
        point.name()
    );
    let _ = std::io::stderr().flush();
    // `TASKHUB_FAULT_PAUSE_MS=<ms>`: a pause (a stopped VM, a swap storm),
    // then the thread goes on.
    if let Some(ms) = std::env::var("TASKHUB_FAULT_PAUSE_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        return;
    }
    loop {
        std::thread::park();
    }
}

/// Never armed without the feature.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn is_armed(_point: Point) -> bool {
    false
}

/// A no-op without the feature.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn hit(_point: Point, _event_id: &str) {}
