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
