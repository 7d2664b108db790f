//! `taskhub produce`: JSON lines on stdin, or demo events, into a stream.

use super::report;
use std::io::{BufRead, Write};

use clap::Args;
use taskhub::Producer;

use super::servers::Servers;

#[derive(Args, Debug)]
pub struct ProduceArgs {
    /// Stream to add to.
    #[arg(long, default_value = "tasks:events", env = "TASKHUB_STREAM", value_parser = super::one_stream)]
    pub stream: String,
    /// Add this many demo events instead of reading stdin.
    #[arg(long)]
    pub count: Option<u64>,
    /// Approximate payload size of demo events, in bytes.
    #[arg(long, default_value_t = 200)]
    pub payload_bytes: usize,
    /// Do not print the entry ids.
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn produce(servers: &Servers, args: ProduceArgs) -> Result<(), String> {
    let mut producer = Producer::connect(&servers.redis_url, &servers.redis_tls(), &args.stream)
        .map_err(|e| report(&e))?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut flush = |batch: &mut Vec<Vec<(String, String)>>| -> Result<(), String> {
        if batch.is_empty() {
            return Ok(());
        }
        let ids = producer.send_batch(batch).map_err(|e| report(&e))?;
        batch.clear();
        if !args.quiet {
            for id in ids {
                writeln!(out, "{id}").map_err(|e| format!("cannot write to stdout: {e}"))?;
            }
        }
        Ok(())
    };
    let mut batch = Vec::with_capacity(1000);
    if let Some(count) = args.count {
        let filler = "x".repeat(args.payload_bytes.saturating_sub(90));
        for n in 0..count {
            let event_id = uuid::Uuid::new_v4().to_string();
            let payload = serde_json::json!({"n": n, "kind": "demo", "message": format!("demo event {n}"), "pad": filler}).to_string();
            batch.push(vec![
                ("event_id".into(), event_id),
                ("payload".into(), payload),
            ]);
            if batch.len() == 1000 {
                flush(&mut batch)?;
            }
        }
    } else {
        for (number, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.map_err(|e| format!("stdin: {e}"))?;
            if line.trim().is_empty() {
                continue;
            }
            batch.push(
                fields_from_json(&line).map_err(|e| format!("stdin line {}: {e}", number + 1))?,
            );
            if batch.len() == 1000 {
                flush(&mut batch)?;
            }
        }
    }
    flush(&mut batch)
}

/// One JSON object → stream fields. `event_id` defaults to a new UUID;
/// string values are kept as they are, other values as JSON text.
pub fn fields_from_json(line: &str) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(map) = value else {
        return Err(
            "expected a JSON object such as {\"event_id\":\"e1\",\"payload\":\"...\"}".into(),
        );
    };
    let mut fields = Vec::with_capacity(map.len() + 1);
    if !map.contains_key("event_id") {
        fields.push(("event_id".to_owned(), uuid::Uuid::new_v4().to_string()));
    }
    for (k, v) in map {
        let text = match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        fields.push((k, text));
    }
    Ok(fields)
}
