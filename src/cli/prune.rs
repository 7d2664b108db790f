//! `taskhub prune`: delete old `processed_events` rows in small transactions.

use std::time::Duration;

use clap::Args;

use super::report;
use super::servers::Servers;

#[derive(Args, Debug)]
pub struct PruneArgs {
    /// Delete rows of events handled more than D ago (e.g. 30d). A
    /// duplicate of such an event arriving later is applied again.
    #[arg(long, value_name = "D", value_parser = super::duration)]
    pub older_than: Duration,
    /// Only this idempotency scope [default: all].
    #[arg(long)]
    pub scope: Option<String>,
    /// The workers' --marker-ttl: --older-than may not be shorter.
    #[arg(long, default_value = "24h", value_parser = super::duration, env = "TASKHUB_MARKER_TTL")]
    pub marker_ttl: Duration,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 1000, value_parser = super::per_step)]
    pub batch: usize,
}

pub fn prune(servers: &Servers, args: PruneArgs) -> Result<(), String> {
    let pruned = taskhub::prune(
        &servers.database_url,
        args.scope.as_deref(),
        args.older_than,
        args.marker_ttl,
        args.batch,
    )
    .map_err(|e| report(&e))?;
    println!(
        "deleted {} processed_events rows older than {} in {} transactions",
        pruned.rows,
        humantime::format_duration(args.older_than),
        pruned.transactions
    );
    Ok(())
}
