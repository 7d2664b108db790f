//! What one round trip costs this process in CPU: the unit of taskhub's
//! budget per event (see README, "Performance").
//!
//! ```text
//! DATABASE_URL=postgres://postgres@%2Fvar%2Frun%2Fpostgresql:5432/postgres \
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --release --example round_trip
//! ```
//!
//! Runs 50,000 `SELECT 1` through the `postgres` crate (a prepared statement,
//! then the simple protocol) and 50,000 `PING` through the `redis` crate, one
//! at a time, and prints the user + system CPU and the wall time of each.

use std::time::Instant;

/// User + system CPU seconds of this process, from /proc.
fn cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    (ticks(11).unwrap_or(0.0) + ticks(12).unwrap_or(0.0)) / 100.0
}

fn measure(what: &str, n: u32, mut round_trip: impl FnMut()) {
    let (cpu0, wall) = (cpu(), Instant::now());
    for _ in 0..n {
        round_trip();
    }
    let per = |s: f64| s * 1e6 / f64::from(n);
    println!(
        "{what}: {:.1} µs CPU, {:.1} µs wall per round trip",
        per(cpu() - cpu0),
        per(wall.elapsed().as_secs_f64())
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let n = 50_000;
    let mut pg = postgres::Client::connect(&database_url, postgres::NoTls)?;
    let select = pg.prepare("SELECT 1")?;
    measure("postgres, prepared SELECT 1", n, || {
        pg.query(&select, &[]).expect("SELECT 1");
    });
    measure("postgres, simple SELECT 1", n, || {
        pg.batch_execute("SELECT 1").expect("SELECT 1");
    });
    let mut redis = redis::Client::open(redis_url)?.get_connection()?;
    measure("redis, PING", n, || {
        let _: String = redis::cmd("PING").query(&mut redis).expect("PING");
    });
    Ok(())
}
