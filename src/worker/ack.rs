//! Step 4 of a message's path: after the commits, one pipelined round trip
//! sets the duplicate markers of what committed (with a TTL) and XACKs
//! everything finished; then the entries leave the in-flight set.
//!
//! Markers go to the namespace of the database that committed (see
//! `keys.rs`). They are only a cache: if Redis refuses them (out of memory,
//! say) the entries are acked without them, and PostgreSQL still decides.

use crate::fault::{self, Point};
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
        let acked = self.with_redis(|conn| {
            let mut pipe = conn.pipe();
            for &i in &done.to_mark {
                let key = crate::redis::keys::marker(&ns, scope, event(&finished[i]).event_id());
                crate::redis::markers::set(&mut pipe, &key, ttl);
            }
            if split {
                // Crash test: Redis applied the markers, then we died.
                pipe.query::<()>(conn)?;
                pipe = conn.pipe();
                for &i in &done.to_mark {
                    fault::hit(Point::AfterMarker, event(&finished[i]).event_id());
                }
            }
            let ids: Vec<&str> = finished.iter().map(|d| d.entry_id.as_str()).collect();
            pipe.cmd("XACK").arg(stream).arg(&group).arg(&ids).ignore();
            pipe.cmd("HDEL")
                .arg(crate::redis::keys::in_flight_ids(stream, &group))
                .arg(&ids)
                .ignore();
            match pipe.query::<()>(conn) {
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
        let tickets = done.deliveries.iter_mut().filter_map(|d| d.ticket.take());
        self.stage.flow.release_all(tickets.collect::<Vec<_>>());
    }
}
