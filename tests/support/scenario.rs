//! The skeleton most tests share: arrange (a database, a stream and a group
//! of the test's own, events on the stream), run (a worker in this process
//! or the binary, until idle), assert (each event applied once, nothing
//! left behind). A [`Scenario`] holds the arrangement; a test adds only what
//! makes it different.
//!
//! ```ignore
//! let mut s = Scenario::new("outage");
//! let events = s.produce(&event_ids("ev", 100));
//! let summary = s.run_until_idle(s.builder(), SqlHandler::default());
//! s.assert_applied_once(&events);
//! ```

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::Duration;

use super::{
    dead_letters, fast_builder, output, parse_summary, pending, redis, redis_url, taskhub, unique,
    xadd_events, Running, TestDb,
};

/// How long a run until idle may take.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// `n` event ids `<prefix>-00000`, `<prefix>-00001`, ...
pub fn event_ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:05}")).collect()
}

/// A test's own database, stream and group, on the servers it was given.
pub struct Scenario {
    pub db: TestDb,
    pub redis_url: String,
    pub stream: String,
    /// The group, which is also the marker and `processed_events` scope.
    pub group: String,
    /// A connection to the scenario's Redis, for the test's own looks.
    pub conn: redis::Connection,
}

impl Scenario {
    /// On the shared servers, with a stream named after `prefix` and a
    /// group of its own.
    pub fn new(prefix: &str) -> Scenario {
        Scenario::on(&redis_url(), TestDb::new(), prefix)
    }

    /// On the Redis at `redis_url` and the database `db` (of a private
    /// server, say).
    pub fn on(redis_url: &str, db: TestDb, prefix: &str) -> Scenario {
        Scenario {
            db,
            redis_url: redis_url.to_owned(),
            stream: unique(prefix),
            group: unique("g"),
            conn: redis(redis_url),
        }
    }

    /// Adds one event per id (payload `payload of <id>`), pipelined;
    /// returns the ids, for the assertions.
    pub fn produce(&mut self, event_ids: &[String]) -> Vec<String> {
        xadd_events(&mut self.conn, &self.stream, event_ids);
        event_ids.to_vec()
    }

    /// A worker of the scenario with fast timings ([`fast_builder`]).
    pub fn builder(&self) -> taskhub::Builder {
        fast_builder(&self.redis_url, &self.db.url, &self.stream, &self.group)
    }

    /// Runs `handler` with `builder` in this process until idle (bounded);
    /// returns the summary.
    pub fn run_until_idle(
        &self,
        builder: taskhub::Builder,
        handler: impl taskhub::Handler,
    ) -> taskhub::Summary {
        Running::start(builder.until_idle(true), handler).join(RUN_TIMEOUT)
    }

    /// `taskhub run` on the scenario: consumer `c1`, polling every 100 ms,
    /// backoff 10–100 ms; add the flags a test needs.
    pub fn command(&self) -> Command {
        let mut cmd = taskhub(&self.redis_url, &self.db.url);
        cmd.args(["run", "--stream", &self.stream, "--group", &self.group])
            .args(["--consumer", "c1", "--block-ms", "100"])
            .args(["--backoff-base", "10ms", "--backoff-cap", "100ms"]);
        cmd
    }

    /// The binary ([`Scenario::command`] with `extra`) until idle; asserts
    /// exit 0 and returns the counters of its summary line.
    pub fn run_binary_until_idle(&self, extra: &[&str]) -> BTreeMap<String, u64> {
        let mut cmd = self.command();
        cmd.args(extra).arg("--until-idle");
        let out = output(cmd, None, RUN_TIMEOUT);
        assert!(
            out.status.success(),
            "run failed: {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            out.stdout,
            out.stderr
        );
        parse_summary(&out.stdout)
    }

    /// Entries pending in the group (on a new connection: the test's own
    /// may have died with a server it restarted).
    pub fn pending(&self) -> u64 {
        pending(&mut redis(&self.redis_url), &self.stream, &self.group)
    }

    /// The dead letters of the stream (on a new connection).
    pub fn dead_letters(&self) -> Vec<taskhub::DeadLetter> {
        dead_letters(&mut redis(&self.redis_url), &self.stream)
    }

    /// The whole "exactly once" check: each of `expected` has one effect and
    /// one `processed_events` row in the group's scope, no other event has
    /// either, nothing is pending and nothing was dead-lettered.
    pub fn assert_applied_once(&self, expected: &[String]) {
        self.db.assert_effects_once(expected);
        let processed: HashMap<String, i64> = self
            .db
            .client()
            .query(
                "SELECT event_id, count(*) FROM processed_events WHERE scope = $1 GROUP BY event_id",
                &[&self.group],
            )
            .unwrap()
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let want: HashMap<String, i64> = expected.iter().map(|id| (id.clone(), 1)).collect();
        assert!(
            processed == want,
            "processed_events rows per event_id: {} rows for {} events, {} not exactly one",
            processed.len(),
            want.len(),
            processed.values().filter(|n| **n != 1).count()
        );
        assert_eq!(self.pending(), 0, "entries left pending");
        assert_eq!(self.dead_letters(), vec![], "dead letters");
    }
}
