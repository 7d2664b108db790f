//! PostgreSQL: connections, TLS, the worker pool, the migrations, and who a
//! waiting session waits for.

pub(crate) mod blockers;
pub(crate) mod connect;
pub(crate) mod migrate;
pub(crate) mod pool;
pub(crate) mod prune;

/// Which of `event_ids` `processed_events` has in `scope` (applied once).
pub(crate) fn processed(
    client: &mut impl postgres::GenericClient,
    scope: &str,
    event_ids: &[&str],
) -> Result<std::collections::HashSet<String>, postgres::Error> {
    if event_ids.is_empty() {
        return Ok(Default::default());
    }
    let rows = client.query(
        "SELECT event_id FROM processed_events WHERE scope = $1 AND event_id = ANY($2)",
        &[&scope, &event_ids],
    )?;
    Ok(rows.into_iter().map(|row| row.get(0)).collect())
}
