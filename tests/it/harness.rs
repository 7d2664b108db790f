//! Checks the test support itself: private servers start, stop and restart.

use crate::support::*;
use std::time::Duration;

#[test]
fn private_servers_start_stop_and_restart() {
    let mut r = PrivateRedis::start();
    let mut conn = redis(&r.url());
    xadd(&mut conn, "s", &[("event_id", "a")]);
    r.stop();
    r.start_again();
    let mut conn = redis(&r.url());
    assert_eq!(
        xlen(&mut conn, "s"),
        1,
        "AOF keeps the stream across a restart"
    );

    let mut pg = PrivatePostgres::start();
    let db = TestDb::on(&pg.url("postgres"));
    assert_eq!(db.count("SELECT count(*) FROM processed_events"), 0);
    pg.stop();
    assert!(postgres::Client::connect(&db.url, postgres::NoTls).is_err());
    pg.start_again();
    assert!(wait_until(Duration::from_secs(10), || {
        postgres::Client::connect(&db.url, postgres::NoTls).is_ok()
    }));
}
