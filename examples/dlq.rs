//! The book's third demonstration (sections 8.2.4 and 8.2.6): an event that
//! always fails is retried with exponential backoff (20, 40, 80 ms: the
//! book's values, with jitter in [d/2, d]), then moved to the dead-letter
//! stream with its reason and full payload, and acked on the main stream.
//!
//! Run: `cargo run --example dlq`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use taskhub::{handler_fn, DeadLetter, Event, HandlerError, Producer, Tls, Tx, Worker};

const MAX_ATTEMPTS: u32 = 4; // the first attempt and 3 retries

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:taskhub@127.0.0.1:5432/taskhub".into());
    taskhub::migrate(&database_url)?;

    let run = uuid::Uuid::new_v4().simple().to_string();
    let stream = format!("demo:dlq:{run}");
    // The book's backoff: 20 ms doubling per attempt, at most 1 s (the
    // worker draws each delay from [d/2, d]).
    let (base, cap) = (Duration::from_millis(20), Duration::from_secs(1));
    let ceiling = move |attempt: u32| (base * 2u32.pow(attempt - 1)).min(cap);
    Producer::connect(&redis_url, &Tls::default(), &stream)?
        .send_event("msg-2", Some("{\"to\":\"ops\"}"))?;

    let calls = AtomicU32::new(0);
    let handler = handler_fn(move |event: &Event, _tx: &mut Tx<'_>| {
        let attempt = calls.fetch_add(1, Ordering::SeqCst) + 1;
        if attempt < MAX_ATTEMPTS {
            println!(
                "{} 第 {attempt} 次失败(downstream 500)，退避 {}ms",
                event.event_id(),
                ceiling(attempt).as_millis()
            );
        } else {
            println!("{} 超过重试上限 -> 进死信", event.event_id());
        }
        Err(HandlerError::retryable("downstream 500"))
    });
    Worker::builder()
        .redis_url(&redis_url)
        .database_url(&database_url)
        .stream(&stream)
        .group(&format!("dlq-{run}"))
        .workers(1)
        .block(Duration::from_millis(100))
        .max_attempts(MAX_ATTEMPTS)
        .backoff_base(base)
        .backoff_cap(cap)
        .until_idle(true)
        .build(handler)?
        .run()?;

    let mut redis = redis::Client::open(redis_url.as_str())?.get_connection()?;
    let dead: Vec<(String, taskhub::Fields)> = redis::cmd("XRANGE")
        .arg(taskhub::dlq::dead_letter_stream(&stream))
        .arg("-")
        .arg("+")
        .query(&mut redis)?;
    println!("死信条数 = {}", dead.len());
    for (id, fields) in &dead {
        let letter = DeadLetter::from_fields(Some(id.clone()), fields)?;
        println!(
            "  DLQ {id} map[id:{} reason:{}]",
            letter.event_id.as_deref().unwrap_or(""),
            letter.reason
        );
    }
    Ok(())
}
