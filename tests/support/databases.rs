//! Databases for tests: a fresh PostgreSQL database per test on the shared
//! server (or on a private one), with the migrations applied, dropped at
//! the end; and the queries tests ask of it (effect rows per event).

use super::unique;

/// A URL of the shared PostgreSQL server, database `postgres`, for creating
/// test databases.
pub fn pg_admin_url() -> String {
    std::env::var("TASKHUB_TEST_PG_URL")
        // The password is the one scripts/services.sh sets on a fresh
        // install; servers with trust authentication ignore it.
        .unwrap_or_else(|_| "postgres://postgres:taskhub@127.0.0.1:5432/postgres".into())
}

/// A fresh database with the migrations applied, dropped at the end.
pub struct TestDb {
    pub name: String,
    pub url: String,
    admin_url: String,
}

impl TestDb {
    /// On the shared server.
    pub fn new() -> TestDb {
        TestDb::on(&pg_admin_url())
    }

    /// On the server of `admin_url` (a URL whose database can be replaced).
    pub fn on(admin_url: &str) -> TestDb {
        let name = unique("taskhub_test").to_lowercase();
        let mut admin = postgres::Client::connect(admin_url, postgres::NoTls)
            .unwrap_or_else(|e| panic!("cannot connect to {admin_url}: {e}"));
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        let url = replace_db(admin_url, &name);
        taskhub::migrate(&url).expect("migrations apply");
        TestDb {
            name,
            url,
            admin_url: admin_url.to_owned(),
        }
    }

    /// Drops the database and creates it again under the same name, with the
    /// migrations applied: a staging reset.
    pub fn recreate(&self) {
        let mut admin = postgres::Client::connect(&self.admin_url, postgres::NoTls).unwrap();
        for sql in ["DROP DATABASE {} WITH (FORCE)", "CREATE DATABASE {}"] {
            admin.batch_execute(&sql.replace("{}", &self.name)).unwrap();
        }
        taskhub::migrate(&self.url).expect("migrations apply");
    }

    /// Runs `sql` on the admin connection (database `postgres`), where
    /// `ALTER DATABASE` and `pg_terminate_backend` of this database's
    /// sessions can be run.
    pub fn admin(&self, sql: &str) {
        let mut admin = postgres::Client::connect(&self.admin_url, postgres::NoTls).unwrap();
        admin.batch_execute(sql).unwrap();
    }

    /// Ends every session on this database except the admin's own, as a
    /// failover or a server restart would.
    pub fn terminate_sessions(&self) {
        self.admin(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = '{}' AND pid <> pg_backend_pid()",
            self.name
        ));
    }

    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url, postgres::NoTls).unwrap()
    }

    /// Runs a query returning one bigint.
    pub fn count(&self, sql: &str) -> i64 {
        self.client().query_one(sql, &[]).unwrap().get(0)
    }

    /// Effect rows per event_id, for all of `notifications`.
    pub fn effect_counts(&self) -> std::collections::HashMap<String, i64> {
        self.client()
            .query(
                "SELECT event_id, count(*) FROM notifications GROUP BY event_id",
                &[],
            )
            .unwrap()
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    /// Asserts that each of `expected` has exactly one effect row in
    /// `notifications`, and no other event has any.
    pub fn assert_effects_once(&self, expected: &[String]) {
        let counts = self.effect_counts();
        let wrong: Vec<(&String, i64)> = expected
            .iter()
            .map(|id| (id, counts.get(id).copied().unwrap_or(0)))
            .filter(|(_, n)| *n != 1)
            .take(20)
            .collect();
        assert!(
            wrong.is_empty(),
            "events without exactly one effect (first 20): {wrong:?}"
        );
        assert_eq!(
            counts.len(),
            expected.len(),
            "effects for events that should have none"
        );
    }

    /// Effect rows for `event_id` in `notifications`.
    pub fn effects(&self, event_id: &str) -> i64 {
        self.client()
            .query_one(
                "SELECT count(*) FROM notifications WHERE event_id = $1",
                &[&event_id],
            )
            .unwrap()
            .get(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Ok(mut admin) = postgres::Client::connect(&self.admin_url, postgres::NoTls) {
            let _ = admin.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

/// `url` with its database name replaced by `db`.
pub fn replace_db(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let cut = base.rfind('/').expect("URL has a path");
    format!("{}/{db}{query}", &base[..cut])
}

/// A function whose failure is always retryable (serialization failure):
/// `--sql 'SELECT try_later($1)'` fails every attempt.
pub const ALWAYS_RETRY: &str = "
    CREATE FUNCTION try_later(id text) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'try % later', id USING ERRCODE = '40001';
    END $$;";
