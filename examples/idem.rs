//! The book's first demonstration (section 8.2.3): the same event delivered
//! three times is applied once.
//!
//! Each delivery is a new stream entry carrying the same `event_id`. The first
//! inserts `(scope, event_id)` into `processed_events` and runs the effect in
//! the same transaction; the next two find the Redis marker (or, were it gone,
//! the `processed_events` row) and are only acknowledged.
//!
//! Run: `cargo run --example idem` (needs Redis and PostgreSQL, see
//! scripts/services.sh; REDIS_URL and DATABASE_URL are honoured).

use std::time::Duration;

use taskhub::{Producer, SqlHandler, Tls, Worker};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:taskhub@127.0.0.1:5432/taskhub".into());
    taskhub::migrate(&database_url)?;

    // A fresh stream and group per run, so the demo always starts clean.
    let run = uuid::Uuid::new_v4().simple().to_string();
    let stream = format!("demo:idem:{run}");
    let group = format!("idem-{run}");
    let event_id = format!("order-42-{run}");
    let mut producer = Producer::connect(&redis_url, &Tls::default(), &stream)?;

    for delivery in 1..=3 {
        producer.send_event(&event_id, Some("{\"order\":42}"))?;
        let summary = Worker::builder()
            .redis_url(&redis_url)
            .database_url(&database_url)
            .stream(&stream)
            .group(&group)
            .workers(1)
            .block(Duration::from_millis(100))
            .until_idle(true)
            .build(SqlHandler::default())?
            .run()?;
        if summary.applied == 1 {
            println!("第 {delivery} 次: 首次处理，执行业务副作用"); // first time: effect applied
        } else if summary.duplicates == 1 {
            println!("第 {delivery} 次: 已处理过，跳过（幂等）"); // seen before: skipped
        }
    }

    let mut db = postgres::Client::connect(&database_url, postgres::NoTls)?;
    let rows: i64 = db
        .query_one(
            "SELECT count(*) FROM processed_events WHERE scope = $1",
            &[&group],
        )?
        .get(0);
    println!("processed_events 行数 = {rows}");
    Ok(())
}
