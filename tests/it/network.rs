//! Network faults between taskhub and PostgreSQL, injected by the proxy of
//! `tests/support/proxy.rs`: whatever the network does, every wait is
//! bounded and the worker recovers once the network is back.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::support::proxy::Proxy;
use crate::support::*;

/// A proxy in front of `db`'s server, and `db`'s URL through it.
fn proxied(db: &TestDb) -> (Proxy, String) {
    let config: postgres::Config = db.url.parse().expect("a PostgreSQL URL");
    let host = config
        .get_hosts()
        .iter()
        .find_map(|h| match h {
            postgres::config::Host::Tcp(h) => Some(h.clone()),
            _ => None,
        })
        .unwrap_or_else(|| "127.0.0.1".into());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let target: SocketAddr = (host.as_str(), port)
        .to_socket_addrs()
        .expect("the server's address")
        .next()
        .expect("an address");
    let proxy = Proxy::start(target);
    let user = config.get_user().unwrap_or("postgres");
    let password = config
        .get_password()
        .map(|p| format!(":{}", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    let url = format!(
        "postgres://{user}{password}@127.0.0.1:{}/{}?sslmode=disable",
        proxy.port(),
        db.name
    );
    (proxy, url)
}

/// Regression (hostile tester): every PostgreSQL connection reset, and the
/// connections of the next moments taken by a proxy that never answers
/// (its backend hung), then the network back. The pool made its
/// connections on one thread of its own with no bound on the handshake:
/// that thread waited for ever on a swallowed connection, and the worker
/// never reached PostgreSQL again, the server long back (`/readyz`: "no
/// connection"). Now each connect is bounded, and the worker goes on.
#[test]
fn a_connect_that_is_never_answered_does_not_cut_the_pool_off_for_good() {
    let db = TestDb::new();
    let (proxy, url) = proxied(&db);
    let stream = unique("net-pool");
    let mut conn = redis(&redis_url());
    let mut cmd = run_on(&url, &stream);
    cmd.args(["--workers", "1"]);
    let mut p = Proc::spawn(cmd);
    let first = unique("first");
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &first), ("payload", "p")],
    );
    let applied = wait_until(Duration::from_secs(20), || db.effects(&first) == 1);
    assert!(applied, "not applied through the proxy\n{}", p.stderr());

    proxy.swallow(true);
    proxy.reset_all();
    let during = unique("during");
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &during), ("payload", "p")],
    );
    let taken = wait_until(Duration::from_secs(20), || proxy.swallowed() > 0);
    assert!(taken, "no connect tried\n{}", p.stderr());
    std::thread::sleep(Duration::from_millis(500));
    proxy.swallow(false);
    let after = unique("after");
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &after), ("payload", "p")],
    );
    let back = wait_until(Duration::from_secs(60), || {
        db.effects(&during) == 1 && db.effects(&after) == 1
    });
    p.signal("TERM");
    let status = p.wait(Duration::from_secs(30));
    assert!(
        back,
        "the worker never reached PostgreSQL again ({} connections swallowed)\n{}",
        proxy.swallowed(),
        p.stderr()
    );
    assert!(status.success(), "{}", p.stderr());
    db.assert_effects_once(&[first, during, after]);
    let _: () = redis::cmd("DEL").arg(&stream).query(&mut conn).unwrap();
}

/// Regression (hostile tester: a connection reset at each reply that named
/// one event): an event's one statement committed and its reply was lost
/// (here held by the proxy, then every connection reset); each later try
/// lost its session too (here a BEFORE trigger kills the session of any
/// insert of the event's key once that key is committed, but for the
/// check below, which runs with a lock timeout of 100 ms). Each loss
/// counted as a strike before the statement could say the event was a
/// duplicate, and at `--max-attempts` the event was dead-lettered
/// `crash_loop` beside its effect. A session that keeps dying now asks
/// `processed_events` before that letter: applied, it is a duplicate.
#[test]
fn an_applied_event_whose_sessions_keep_dying_is_no_crash_loop() {
    let db = TestDb::new();
    let (proxy, url) = proxied(&db);
    let mut conn = redis(&redis_url());
    let (stream, group) = (unique("struck"), unique("g"));
    let victim = unique("victim");
    db.client()
        .batch_execute(&format!(
            "CREATE FUNCTION kill_again() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.event_id = '{victim}' AND current_setting('lock_timeout') <> '100ms'
                  AND EXISTS (SELECT 1 FROM processed_events
                              WHERE scope = NEW.scope AND event_id = NEW.event_id) THEN
                 PERFORM pg_terminate_backend(pg_backend_pid());
               END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER kill_again BEFORE INSERT ON processed_events
               FOR EACH ROW EXECUTE FUNCTION kill_again();"
        ))
        .unwrap();
    let mut cmd = taskhub(&redis_url(), &url);
    cmd.args(["run", "--stream", &stream, "--group", &group])
        .args(["--consumer", "c", "--workers", "1", "--block-ms", "100"])
        .args(["--mode", "per-event", "--max-attempts", "2"]);
    let mut p = Proc::spawn(cmd);
    let warm = unique("warm");
    xadd(&mut conn, &stream, &[("event_id", &warm), ("payload", "p")]);
    assert!(
        wait_until(Duration::from_secs(20), || db.effects(&warm) == 1),
        "{}",
        p.stderr()
    );
    // The statement reaches the server and commits; its reply is held,
    // then lost.
    proxy.delay(Duration::from_secs(3));
    xadd(
        &mut conn,
        &stream,
        &[("event_id", &victim), ("payload", "p")],
    );
    let committed = wait_until(Duration::from_secs(20), || db.effects(&victim) == 1);
    assert!(committed, "{}", p.stderr());
    proxy.reset_all();
    proxy.pass();
    let settled = wait_until(Duration::from_secs(60), || {
        pending(&mut conn, &stream, &group) == 0
    });
    p.signal("TERM");
    p.wait(Duration::from_secs(30));
    let stderr = p.stderr();
    assert!(settled, "still pending\n{stderr}");
    assert!(
        stderr.contains("strike 2 of 2"),
        "its sessions did not keep dying\n{stderr}"
    );
    let letters = dead_letters(&mut conn, &stream);
    assert!(
        letters.is_empty(),
        "applied and dead-lettered: {letters:?}\n{stderr}"
    );
    assert_eq!(db.effects(&victim), 1);
    let _: () = redis::cmd("DEL").arg(&stream).query(&mut conn).unwrap();
}
