//! Schema migrations: the SQL files of `migrations/`, embedded in the binary
//! and applied once each, in order.
//!
//! Each migration runs in its own transaction together with its row in
//! `taskhub_migrations`, all under a session advisory lock, so two instances
//! starting at the same moment apply every migration exactly once (the second
//! waits for the lock, then sees the versions recorded).

use crate::error::{Error, ErrorKind};

/// The migrations, in order: (version, name, SQL).
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "processed_events",
        include_str!("../../migrations/0001_processed_events.sql"),
    ),
    (
        2,
        "dead_letters_archive",
        include_str!("../../migrations/0002_dead_letters_archive.sql"),
    ),
    (
        3,
        "processed_events_handled_at",
        include_str!("../../migrations/0003_processed_events_handled_at.sql"),
    ),
];

/// An arbitrary constant naming taskhub's advisory lock.
const LOCK_KEY: i64 = 0x0074_6173_6b68_7562;

/// Applies the migrations not applied yet to the database at `database_url`.
/// Returns how many were applied by this call.
pub fn migrate(database_url: &str) -> Result<usize, Error> {
    crate::runtime::off_async(|| {
        let mut client = crate::postgres::connect::postgres(database_url)?;
        migrate_client(&mut client)
    })
}

pub(crate) fn migrate_client(client: &mut postgres::Client) -> Result<usize, Error> {
    let fail = |what: &str, e: postgres::Error| {
        let why = match e.as_db_error() {
            Some(db) => format!("{} ({})", db.message(), db.code().code()),
            None => e.to_string(),
        };
        Error::new(ErrorKind::Migration, format!("migration: {what}: {why}"))
    };
    // One instance at a time, from the first statement on: concurrent
    // CREATE TABLE IF NOT EXISTS can still collide in the catalog.
    client
        .execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY])
        .map_err(|e| fail("cannot take the migration lock", e))?;
    let applied = apply_all(client, &fail);
    // The lock is also released when the session ends.
    let _ = client.execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY]);
    applied
}

fn apply_all(
    client: &mut postgres::Client,
    fail: &dyn Fn(&str, postgres::Error) -> Error,
) -> Result<usize, Error> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS taskhub_migrations (
                 version    integer     PRIMARY KEY,
                 name       text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             )",
        )
        .map_err(|e| fail("cannot create taskhub_migrations", e))?;
    let mut applied = 0;
    for &(version, name, sql) in MIGRATIONS {
        let mut tx = client.transaction().map_err(|e| fail("cannot begin", e))?;
        let done = tx
            .query_opt(
                "SELECT 1 FROM taskhub_migrations WHERE version = $1",
                &[&version],
            )
            .map_err(|e| fail("cannot read taskhub_migrations", e))?
            .is_some();
        if done {
            continue;
        }
        tx.batch_execute(sql)
            .map_err(|e| fail(&format!("{version:04}_{name} failed"), e))?;
        tx.execute(
            "INSERT INTO taskhub_migrations (version, name) VALUES ($1, $2)",
            &[&version, &name],
        )
        .map_err(|e| fail("cannot record the migration", e))?;
        tx.commit().map_err(|e| fail("cannot commit", e))?;
        log::info!("migration {version:04}_{name}: applied");
        applied += 1;
    }
    Ok(applied)
}
