//! The book's second demonstration (section 8.2.3): the dedup record and the
//! effect commit in one transaction, so a failed effect leaves no record and
//! the redelivery can succeed.
//!
//! 1. The effect fails: the transaction rolls back, `processed_events` and
//!    `notifications` both stay empty (with max_attempts 1 the event goes to
//!    the dead-letter stream, as an operator would then replay it).
//! 2. The event is delivered again and succeeds: one row in each table.
//! 3. A duplicate delivery adds nothing.
//!
//! Run: `cargo run --example txidem`.

use std::time::Duration;

use taskhub::{handler_fn, Event, Handler, HandlerError, Producer, SqlHandler, Tls, Tx, Worker};

fn counts(
    db: &mut postgres::Client,
    scope: &str,
    event_id: &str,
) -> Result<(i64, i64), postgres::Error> {
    let processed: i64 = db
        .query_one(
            "SELECT count(*) FROM processed_events WHERE scope = $1 AND event_id = $2",
            &[&scope, &event_id],
        )?
        .get(0);
    let notifications: i64 = db
        .query_one(
            "SELECT count(*) FROM notifications WHERE event_id = $1",
            &[&event_id],
        )?
        .get(0);
    Ok((processed, notifications))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:taskhub@127.0.0.1:5432/taskhub".into());
    taskhub::migrate(&database_url)?;
    let mut db = postgres::Client::connect(&database_url, postgres::NoTls)?;

    let run = uuid::Uuid::new_v4().simple().to_string();
    let stream = format!("demo:txidem:{run}");
    let group = format!("txidem-{run}");
    let event_id = format!("order-7-{run}");
    let mut producer = Producer::connect(&redis_url, &Tls::default(), &stream)?;
    let run_once = |handler: Box<dyn Handler>| {
        Worker::builder()
            .redis_url(&redis_url)
            .database_url(&database_url)
            .stream(&stream)
            .group(&group)
            .workers(1)
            .max_attempts(1)
            .block(Duration::from_millis(100))
            .until_idle(true)
            .build(handler)?
            .run()
    };

    // 1. The effect fails after the dedup insert: everything rolls back.
    producer.send_event(&event_id, Some("hello"))?;
    let failing = handler_fn(|event: &Event, tx: &mut Tx<'_>| {
        SqlHandler::default().handle(event, tx)?; // the effect runs...
        Err(HandlerError::retryable("副作用失败，整体回滚")) // ...then fails
    });
    run_once(Box::new(failing))?;
    let mut redis = redis::Client::open(redis_url.as_str())?.get_connection()?;
    let dead: Vec<(String, taskhub::Fields)> = redis::cmd("XRANGE")
        .arg(taskhub::dlq::dead_letter_stream(&stream))
        .arg("-")
        .arg("+")
        .query(&mut redis)?;
    for (id, fields) in &dead {
        let letter = taskhub::DeadLetter::from_fields(Some(id.clone()), fields)?;
        println!("副作用失败: err={}", letter.reason);
    }
    let (p, n) = counts(&mut db, &group, &event_id)?;
    println!("回滚后 processed_events={p} notifications={n}");

    // 2. Redelivered (the same event_id), the effect now succeeds.
    producer.send_event(&event_id, Some("hello"))?;
    let summary = run_once(Box::<SqlHandler>::default())?;
    println!(
        "重投成功: err={}",
        if summary.applied == 1 { "<nil>" } else { "?" }
    );
    let (p, n) = counts(&mut db, &group, &event_id)?;
    println!("提交后 processed_events={p} notifications={n}");

    // 3. A duplicate delivery changes nothing.
    producer.send_event(&event_id, Some("hello"))?;
    run_once(Box::<SqlHandler>::default())?;
    let (_, n) = counts(&mut db, &group, &event_id)?;
    println!("重复投递后 notifications={n}（未重复）");
    Ok(())
}
