//! The library embedded in other programs: called from async code (the sync
//! PostgreSQL client runs a small tokio runtime of its own, and starting one
//! inside another panics), and watched through its Monitor.

use std::time::Duration;

use crate::support::*;
use taskhub::SqlHandler;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Called on the runtime's own thread (inside `block_on`), where the sync
/// PostgreSQL client would panic: both calls still work.
#[test]
fn on_an_async_thread_the_blocking_calls_work_instead_of_panicking() {
    let db = TestDb::new();
    let stream = unique("embed-inside");
    let mut conn = redis(&redis_url());
    for i in 0..10 {
        xadd(
            &mut conn,
            &stream,
            &[("event_id", &format!("e{i}")), ("payload", "p")],
        );
    }
    let worker = fast_builder(&redis_url(), &db.url, &stream, &stream)
        .until_idle(true)
        .build(SqlHandler::default())
        .unwrap();
    let (migrated, ran) = runtime().block_on(async { (taskhub::migrate(&db.url), worker.run()) });
    assert_eq!(migrated.unwrap(), 0, "already migrated");
    assert_eq!(ran.unwrap().applied, 10);
    assert_eq!(db.count("SELECT count(*) FROM notifications"), 10);
}

#[test]
fn the_spawn_blocking_recipe_runs_a_worker_from_async_code() {
    let db = TestDb::new();
    let stream = unique("embed-recipe");
    let mut conn = redis(&redis_url());
    for i in 0..20 {
        xadd(
            &mut conn,
            &stream,
            &[("event_id", &format!("e{i}")), ("payload", "p")],
        );
    }
    let worker = fast_builder(&redis_url(), &db.url, &stream, &stream)
        .until_idle(true)
        .build(SqlHandler::default())
        .unwrap();
    let url = db.url.clone();
    let summary = runtime()
        .block_on(async move {
            tokio::task::spawn_blocking(move || {
                taskhub::migrate(&url)?;
                worker.run()
            })
            .await
        })
        .expect("the blocking task did not panic")
        .expect("the worker ran");
    assert_eq!(summary.applied, 20);
    assert_eq!(db.count("SELECT count(*) FROM notifications"), 20);
}

#[test]
fn the_monitor_answers_before_during_and_after_run() {
    let db = TestDb::new();
    let stream = unique("embed-monitor");
    let mut conn = redis(&redis_url());
    for i in 0..5 {
        xadd(
            &mut conn,
            &stream,
            &[("event_id", &format!("e{i}")), ("payload", "p")],
        );
    }
    let worker = fast_builder(&redis_url(), &db.url, &stream, &stream)
        .build(SqlHandler::default())
        .unwrap();
    let monitor = worker.monitor();
    let before = monitor.ready().unwrap_err();
    assert!(
        before.iter().any(|p| p.starts_with("starting")),
        "{before:?}"
    );
    let stop = worker.shutdown_handle();
    let thread = std::thread::spawn(move || worker.run());
    assert!(
        wait_until(Duration::from_secs(20), || monitor.summary().applied == 5),
        "{}",
        monitor.summary()
    );
    assert_eq!(monitor.ready(), Ok(()));
    assert_eq!(monitor.streams(), std::slice::from_ref(&stream));
    let durations = monitor.handler_durations();
    assert!((1..=5).contains(&durations.count), "{durations:?}");
    assert_eq!(durations.buckets.last().unwrap().1, durations.count);
    stop.shutdown();
    thread.join().unwrap().unwrap();
    let after = monitor.ready().unwrap_err();
    assert!(after.iter().any(|p| p == "shutting down"), "{after:?}");
}

/// A handler whose `validate` panics on one event, or returns a retryable
/// error for another (regressions, found by a hostile test): the panic
/// took down the whole job it was in, which stayed pending, was read
/// again and panicked again, with no letter and no end to `until_idle`;
/// the retryable error was dead-lettered as `invalid` at once. Now each is
/// that event's failed attempt: retried, then an `exhausted` letter; the
/// other events are applied.
#[test]
fn a_validate_that_panics_or_asks_for_a_retry_costs_only_its_event() {
    struct Picky;
    impl taskhub::Handler for Picky {
        fn handle(
            &self,
            event: &taskhub::Event,
            tx: &mut taskhub::Tx<'_>,
        ) -> Result<(), taskhub::HandlerError> {
            tx.execute(
                "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)",
                &[&event.event_id(), &event.payload()],
            )?;
            Ok(())
        }

        fn validate(&self, event: &taskhub::Event) -> Result<(), taskhub::HandlerError> {
            match event.event_id() {
                "boom" => panic!("validate cannot cope with {}", event.event_id()),
                "later" => Err(taskhub::HandlerError::retryable("a cache is down")),
                _ => Ok(()),
            }
        }
    }
    let db = TestDb::new();
    let stream = unique("embed-validate");
    let mut conn = redis(&redis_url());
    let mut ids: Vec<String> = (0..20).map(|i| format!("e{i}")).collect();
    ids.insert(7, "boom".into());
    ids.insert(12, "later".into());
    for id in &ids {
        xadd(&mut conn, &stream, &[("event_id", id), ("payload", "p")]);
    }
    let worker = fast_builder(&redis_url(), &db.url, &stream, &stream)
        .max_attempts(3)
        .until_idle(true)
        .build(Picky)
        .unwrap();
    let stop = worker.shutdown_handle();
    let running = std::thread::spawn(move || worker.run());
    let ended = wait_until(Duration::from_secs(60), || running.is_finished());
    if !ended {
        stop.shutdown();
    }
    let summary = running.join().unwrap().unwrap();
    assert!(ended, "until_idle never ended: {summary:?}");
    assert_eq!(summary.applied, 20, "{summary:?}");
    assert_eq!(summary.panics, 3, "{summary:?}");
    let letters = dead_letters(&mut conn, &stream);
    let mut got: Vec<(String, String, u32)> = letters
        .iter()
        .map(|l| {
            (
                l.event_id.clone().unwrap_or_default(),
                l.kind.to_string(),
                l.attempts,
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("boom".to_owned(), "exhausted".to_owned(), 3),
            ("later".to_owned(), "exhausted".to_owned(), 3)
        ],
        "{letters:?}"
    );
    assert!(
        letters.iter().any(|l| l.reason.contains("panicked")),
        "{letters:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM notifications"), 20);
}

/// Regression (hostile test): a handler that ran `SET statement_timeout =
/// 0; SET default_transaction_read_only = off` (not `SET LOCAL`) changed
/// the pooled session for every later event: a later statement outlived
/// the handler timeout, and a later handler that ran COMMIT itself went on
/// writing outside the transaction, an effect beside its dead letter. Our
/// COMMIT now sets both guards again, and a transaction the handler ended
/// itself has its session set up anew.
#[test]
fn a_handler_s_session_settings_do_not_outlive_its_event() {
    let db = TestDb::new();
    let stream = unique("embed-session");
    let mut conn = redis(&redis_url());
    for id in [
        "loosen",
        "slow",
        "commit-then-write",
        "loosen-and-commit",
        "slow-2",
    ] {
        xadd(&mut conn, &stream, &[("event_id", id), ("payload", "p")]);
    }
    let handler = taskhub::handler_fn(|event: &taskhub::Event, tx: &mut taskhub::Tx<'_>| {
        let id = event.event_id();
        let insert = "INSERT INTO notifications (event_id, payload) VALUES ($1, 'p')";
        match id {
            "loosen" => {
                tx.batch_execute(
                    "SET statement_timeout = 0; SET default_transaction_read_only = off",
                )?;
                tx.execute(insert, &[&id])?;
            }
            "loosen-and-commit" => {
                tx.batch_execute(
                    "SET statement_timeout = 0; SET default_transaction_read_only = off; COMMIT",
                )?;
            }
            "slow" | "slow-2" => {
                tx.execute(insert, &[&id])?;
                tx.batch_execute("SELECT pg_sleep(4)")?;
            }
            "commit-then-write" => {
                tx.batch_execute("COMMIT")?;
                tx.execute(insert, &[&id])?;
            }
            _ => unreachable!(),
        }
        Ok::<(), taskhub::HandlerError>(())
    });
    let worker = fast_builder(&redis_url(), &db.url, &stream, &stream)
        .mode(taskhub::Mode::PerEvent)
        .workers(1)
        .max_attempts(1)
        .handler_timeout(Duration::from_secs(2))
        .until_idle(true)
        .build(handler)
        .unwrap();
    let summary = worker.run().unwrap();
    let effects = |id: &str| db.effects(id);
    let letters = dead_letters(&mut conn, &stream);
    let lettered = |id: &str| letters.iter().any(|l| l.event_id.as_deref() == Some(id));
    let outcome = |id: &str| (effects(id), lettered(id));
    assert_eq!(outcome("loosen"), (1, false), "{summary:?} {letters:?}");
    for id in ["slow", "slow-2"] {
        // The handler timeout cancels the sleep: no effect, a letter.
        assert_eq!(outcome(id), (0, true), "{id}: {summary:?} {letters:?}");
    }
    // Its COMMIT committed the dedup row: a letter; its write after it was
    // refused (read-only): no effect beside the letter.
    assert_eq!(outcome("commit-then-write"), (0, true), "{letters:?}");
}

/// Regression (hostile test): `Monitor::ready`, called on an async
/// runtime's thread (a health endpoint of an async web server), panicked
/// ("Cannot start a runtime from within a runtime"): its PostgreSQL
/// question now runs off that thread.
#[test]
fn the_monitor_s_readiness_is_asked_from_async_code() {
    let db = TestDb::new();
    let stream = unique("embed-ready");
    let worker = fast_builder(&redis_url(), &db.url, &stream, &stream)
        .build(SqlHandler::default())
        .unwrap();
    let monitor = worker.monitor();
    let stop = worker.shutdown_handle();
    let running = std::thread::spawn(move || worker.run());
    assert!(
        wait_until(Duration::from_secs(30), || monitor.ready().is_ok()),
        "{:?}",
        monitor.ready()
    );
    let asked = runtime().block_on(async { monitor.ready() });
    stop.shutdown();
    running.join().unwrap().unwrap();
    assert_eq!(asked, Ok(()));
}

/// A `validate` that meets an outage (a server it asks is down) counts no
/// attempt: the event is tried again after a backoff until the check
/// passes, here five outages against three attempts, and is applied, with
/// no letter (found in review: each outage counted, and an event whose
/// check met a short outage became an `exhausted` letter).
#[test]
fn an_outage_in_validate_counts_no_attempt() {
    struct Flaky(std::sync::atomic::AtomicU32);
    impl taskhub::Handler for Flaky {
        fn handle(
            &self,
            event: &taskhub::Event,
            tx: &mut taskhub::Tx<'_>,
        ) -> Result<(), taskhub::HandlerError> {
            tx.execute(
                "INSERT INTO notifications (event_id, payload) VALUES ($1, $2)",
                &[&event.event_id(), &event.payload()],
            )?;
            Ok(())
        }

        fn validate(&self, event: &taskhub::Event) -> Result<(), taskhub::HandlerError> {
            let calls = self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if event.event_id() == "checked" && calls < 5 {
                return Err(taskhub::HandlerError::outage("the cache is down"));
            }
            Ok(())
        }
    }
    let db = TestDb::new();
    let stream = unique("embed-validate-outage");
    let mut conn = redis(&redis_url());
    xadd(
        &mut conn,
        &stream,
        &[("event_id", "checked"), ("payload", "p")],
    );
    let worker = fast_builder(&redis_url(), &db.url, &stream, &stream)
        .max_attempts(3)
        .until_idle(true)
        .build(Flaky(std::sync::atomic::AtomicU32::new(0)))
        .unwrap();
    let stop = worker.shutdown_handle();
    let running = std::thread::spawn(move || worker.run());
    let ended = wait_until(Duration::from_secs(60), || running.is_finished());
    if !ended {
        stop.shutdown();
    }
    let summary = running.join().unwrap().unwrap();
    assert!(ended, "until_idle never ended: {summary:?}");
    assert_eq!(summary.applied, 1, "{summary:?}");
    assert!(dead_letters(&mut conn, &stream).is_empty());
    assert_eq!(db.effects("checked"), 1);
}
