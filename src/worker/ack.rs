//! Step 4 of a message's path: after the commits, one round trip sets the
//! duplicate markers of what committed (with a TTL) and XACKs everything
//! finished (what a worker's jobs finished within 50 ms goes together: see
//! `process::ACK_HOLD`); then the entries leave the in-flight set. On one server that
//! round trip is one script (one reply, where a pipeline has one per
//! marker); on a cluster, whose markers spread over the nodes, a pipeline.
//!
//! Markers go to the namespace of the database that committed (see
//! `keys.rs`). They are only a cache: if Redis refuses them (out of memory,
//! say) the entries are acked without them, and PostgreSQL still decides.

use crate::fault::{self, Point};
use crate::redis::RedisConn;
use crate::worker::process::{event, Finished, Processor};

impl Processor {
    /// Sets markers for `done.to_mark`, then XACKs all of `done`, in one
    /// round trip, through Redis outages.
    pub(crate) fn mark_and_ack(&mut self, stream: &str, mut done: Finished) {
        if done.deliveries.is_empty() {
            return;
        }
        let finished = &done.deliveries;
        let ttl = self.stage.settings.marker_ttl.as_secs();
        let group = self.stage.settings.group.clone();
        let ns = self.stage.namespace.get();
        let split = fault::is_armed(Point::AfterMarker);
        let scope = &self.stage.settings.scope;
        let marked = done.to_mark.iter().map(|&i| event(&finished[i]).event_id());
        let markers = crate::redis::keys::MarkerKeys::new(&ns, scope, marked);
        let keys = markers.keys();
        let ids: Vec<&str> = finished.iter().map(|d| d.entry_id.as_str()).collect();
        let in_flight = crate::redis::keys::in_flight_ids(stream, &group);
        let acked = self.with_redis(|conn| {
            let result = if split || conn.is_cluster() {
                let split = split.then(|| {
                    let marked = done.to_mark.iter();
                    marked.map(|&i| event(&finished[i]).event_id()).collect()
                });
                mark_then_ack(conn, &keys, ttl, (stream, &in_flight, &group), &ids, split)
            } else {
                crate::redis::markers::set_and_ack(
                    conn,
                    &keys,
                    ttl,
                    (stream, &in_flight, &group),
                    &ids,
                )
            };
            match result {
                Err(e) if !crate::redis::is_outage(&e) => {
                    log::warn!(
                        "{stream}: duplicate markers not written ({e}); acking without them"
                    );
                    crate::redis::streams::ack(conn, stream, &group, &ids)
                }
                result => result,
            }
        });
        if acked.is_none() {
            log::warn!(
                "{stream}: shutdown during a Redis outage; {} committed entries stay pending and will be skipped as duplicates",
                finished.len()
            );
        }
        // Given back as they are taken: no list of them to build.
        let tickets = done.deliveries.iter_mut().filter_map(|d| d.ticket.take());
        self.stage.flow.release_all(tickets);
    }
}

/// The markers `keys`, then XACK of `ids` and their removal from the
/// in-flight ids, as one pipeline (on a cluster it is cut by node). With
/// `split` (a crash test), the markers go in a round trip of their own,
/// then the process dies at `after-marker` of one of these events.
fn mark_then_ack(
    conn: &mut RedisConn,
    keys: &[&str],
    ttl: u64,
    (stream, in_flight, group): (&str, &str, &str),
    ids: &[&str],
    split: Option<Vec<&str>>,
) -> redis::RedisResult<()> {
    let mut pipe = conn.pipe();
    for key in keys {
        crate::redis::markers::set(&mut pipe, key, ttl);
    }
    if let Some(event_ids) = split {
        // Crash test: Redis applied the markers, then we died.
        pipe.query::<()>(conn)?;
        pipe = conn.pipe();
        for event_id in event_ids {
            fault::hit(Point::AfterMarker, event_id);
        }
    }
    pipe.cmd("XACK").arg(stream).arg(group).arg(ids).ignore();
    pipe.cmd("HDEL").arg(in_flight).arg(ids).ignore();
    pipe.query::<()>(conn)
}
