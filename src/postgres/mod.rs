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

/// What [`processed_or_awaited`] found for an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Processed,
    NotProcessed,
    /// A transaction inserted its key and had not ended after 100 ms: ask
    /// again later.
    Held,
}

/// Whether each of `event_ids` is processed in `scope`, waiting (100 ms at
/// most) for a transaction that inserted its key and has not ended: each
/// key is inserted again and rolled back, so an insert not yet committed is
/// waited for rather than missed, as [`processed`] misses it. Asked before
/// a letter that says an event was not applied (a `trimmed` entry, a
/// session that keeps dying): its owner may be between its insert and its
/// COMMIT, delayed on the network, and then commit beside the letter (found
/// by a hostile test: an owner's COMMIT held 3 s, the entry deleted
/// meanwhile, and another consumer's `trimmed` letter of it beside the
/// effect). A key at a time, so a held key holds up only its own entry. An
/// insert that fails otherwise falls back to [`processed`] for its key; one
/// that lost the connection (the event's key may be what kills its
/// session: a trigger, an extension) is the error of the whole call, and
/// the caller asks [`processed`] on a new connection.
pub(crate) fn processed_or_awaited(
    client: &mut postgres::Client,
    scope: &str,
    event_ids: &[&str],
) -> Result<Vec<Answer>, postgres::Error> {
    let mut answers = Vec::with_capacity(event_ids.len());
    for id in event_ids {
        let mut probe = || -> Result<bool, postgres::Error> {
            let mut tx = client.build_transaction().read_only(false).start()?;
            tx.batch_execute("SET LOCAL lock_timeout = 100; SET LOCAL statement_timeout = 5000")?;
            let new = tx.query_opt(INSERT_AGAIN, &[&scope, id])?.is_some();
            tx.rollback()?;
            Ok(!new)
        };
        let answer = match probe() {
            Ok(true) => Answer::Processed,
            Ok(false) => Answer::NotProcessed,
            Err(e) if e.code() == Some(&postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                Answer::Held
            }
            Err(e) if client.is_closed() => return Err(e),
            Err(_) if processed(client, scope, &[id])?.contains(*id) => Answer::Processed,
            Err(_) => Answer::NotProcessed,
        };
        answers.push(answer);
    }
    Ok(answers)
}

const INSERT_AGAIN: &str = "INSERT INTO processed_events (scope, event_id) \
     VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1";

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
