//! PostgreSQL: connections, TLS, the worker pool, the migrations, and who a
//! waiting session waits for.

pub(crate) mod blockers;
pub(crate) mod connect;
pub(crate) mod migrate;
pub(crate) mod pool;
pub(crate) mod prune;

/// Which of `event_ids` `processed_events` has in `scope` (applied once).
///
/// The scope is compared to a subquery, `scope = (SELECT $1::text)`, not
/// to `$1`: the planner then counts on as many rows as an average scope
/// has, and looks the ids up by the whole key. Given the value, it reads
/// the statistics, where a scope that began after the last ANALYZE (a new
/// group or service on a shared table) has no row: it then takes the index
/// on the scope alone and filters the ids, reading every row of that
/// scope, more at each call as the scope grows.
pub(crate) fn processed(
    client: &mut impl postgres::GenericClient,
    scope: &str,
    event_ids: &[&str],
) -> Result<std::collections::HashSet<String>, postgres::Error> {
    if event_ids.is_empty() {
        return Ok(Default::default());
    }
    let rows = client.query(PROCESSED, &[&scope, &event_ids])?;
    Ok(rows.into_iter().map(|row| row.get(0)).collect())
}

const PROCESSED: &str = "SELECT event_id FROM processed_events \
     WHERE scope = (SELECT $1::text) AND event_id = ANY($2)";

#[cfg(test)]
pub(crate) mod tests {
    /// `EXPLAIN` of `sql` (with `params`) on a temporary
    /// `processed_events` whose statistics know only the scope `old`, for
    /// the scope `new`: whether the event ids are part of the index
    /// lookup (not a filter over every row of the scope).
    pub(crate) fn ids_looked_up_by_the_whole_key(
        sql: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> (bool, String) {
        let url = crate::postgres::pool::test_url();
        let mut conn = postgres::Client::connect(&url, postgres::NoTls).expect("the test database");
        conn.batch_execute(
            "CREATE TEMP TABLE processed_events (scope text, event_id text, \
               PRIMARY KEY (scope, event_id)); \
             INSERT INTO processed_events \
               SELECT 'old', 'e' || g FROM generate_series(1, 20000) g; \
             ANALYZE processed_events",
        )
        .unwrap();
        let plan: Vec<String> = conn
            .query(&format!("EXPLAIN {sql}"), params)
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        let plan = plan.join("\n");
        let whole_key = plan
            .lines()
            .any(|l| l.contains("Index Cond") && l.contains("event_id"));
        let filtered = plan
            .lines()
            .any(|l| l.contains("Filter") && l.contains("event_id"));
        (whole_key && !filtered, plan)
    }

    #[test]
    fn the_applied_ids_of_a_scope_new_to_the_statistics_are_looked_up_by_key() {
        let ids = ["a", "b", "c"];
        let (by_key, plan) = ids_looked_up_by_the_whole_key(super::PROCESSED, &[&"new", &&ids[..]]);
        assert!(by_key, "{plan}");
    }
}
