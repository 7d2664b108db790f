//! `taskhub consumers`: list a group's consumers, remove one that left.

use super::report;
use clap::Args;

use super::servers::Servers;

#[derive(Args, Debug)]
pub struct ConsumersArgs {
    /// The stream.
    #[arg(long, default_value = "tasks:events", env = "TASKHUB_STREAM", value_parser = super::one_stream)]
    pub stream: String,
    /// The consumer group.
    #[arg(long, default_value = "workers", env = "TASKHUB_GROUP")]
    pub group: String,
    /// Remove this consumer; refused while it has pending entries (they
    /// would become unclaimable).
    #[arg(long, value_name = "NAME", conflicts_with = "prune_idle")]
    pub remove: Option<String>,
    /// Remove every consumer with nothing pending that has been idle longer
    /// than D (e.g. 7d): instances or pods that are gone.
    #[arg(long, value_name = "D", value_parser = super::duration)]
    pub prune_idle: Option<std::time::Duration>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn consumers(servers: &Servers, args: ConsumersArgs) -> Result<(), String> {
    if let Some(name) = &args.remove {
        // XGROUP DELCONSUMER answers 0 for a consumer that does not exist
        // as for one without pending entries: look first, so a typo is not
        // reported as done.
        let known = taskhub::consumers(
            &servers.redis_url,
            &servers.redis_tls(),
            &args.stream,
            &args.group,
        )
        .map_err(|e| report(&e))?;
        if !known.iter().any(|c| &c.name == name) {
            return Err(format!(
                "no consumer {name} in group {} of stream {}",
                args.group, args.stream
            ));
        }
        taskhub::remove_consumer(
            &servers.redis_url,
            &servers.redis_tls(),
            &args.stream,
            &args.group,
            name,
        )
        .map_err(|e| report(&e))?;
        println!(
            "removed consumer {name} from {}/{}",
            args.stream, args.group
        );
        return Ok(());
    }
    if let Some(idle) = args.prune_idle {
        let removed = taskhub::prune_consumers(
            &servers.redis_url,
            &servers.redis_tls(),
            &args.stream,
            &args.group,
            idle,
        )
        .map_err(|e| report(&e))?;
        for name in &removed {
            // Consumer names are any client's text: no terminal escapes
            // through, no line that passes for another.
            println!(
                "removed consumer {} from {}/{}",
                shown(name),
                args.stream,
                args.group
            );
        }
        println!(
            "{} consumer{} removed (idle over {}, nothing pending)",
            removed.len(),
            if removed.len() == 1 { "" } else { "s" },
            humantime::format_duration(idle)
        );
        return Ok(());
    }
    let list = taskhub::consumers(
        &servers.redis_url,
        &servers.redis_tls(),
        &args.stream,
        &args.group,
    )
    .map_err(|e| report(&e))?;
    if args.json {
        let items: Vec<serde_json::Value> = list
            .iter()
            .map(|c| serde_json::json!({"name": c.name, "pending": c.pending, "idle_ms": c.idle.as_millis() as u64}))
            .collect();
        println!("{}", serde_json::Value::Array(items));
        return Ok(());
    }
    // As above: names shown on one line, control characters escaped.
    let names: Vec<String> = list.iter().map(|c| shown(&c.name)).collect();
    let width = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(4)
        .max(8);
    println!("{:<width$}  {:>8}  {:>12}", "consumer", "pending", "idle");
    for (c, name) in list.iter().zip(&names) {
        let idle = humantime::format_duration(std::time::Duration::from_secs(c.idle.as_secs()))
            .to_string();
        println!("{name:<width$}  {:>8}  {:>12}", c.pending, idle);
    }
    Ok(())
}

/// A consumer name on one line: control characters escaped (`\n`,
/// `\u{1b}`), nothing cut, so that two names never look alike.
fn shown(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}
