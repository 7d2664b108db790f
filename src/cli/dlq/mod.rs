//! `taskhub dlq`: look at, replay, purge and archive dead letters. Tables for
//! people, `--json` for tools; the work is done by `taskhub::dlq`.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::{Args, Subcommand};
use taskhub::dlq::dead_letter_stream;
use taskhub::dlq::{DeadLetters, Filter, ReasonMatch, Selection};

use crate::cli::report;

mod change;
mod view;

/// The long help of `taskhub dlq`.
pub const LONG_ABOUT: &str = "\
Look at, replay, purge and archive the dead letters of a stream (kept in <stream>:dlq).

Several consumer groups reading one stream share its dead-letter stream: each letter names
its group, and --group GROUP makes every subcommand take only that group's letters (stats
counts them by group either way).

Times (--since, --until) are a duration ago (90s, 2h, 3d) or an RFC 3339 time
(2024-05-01T12:00:00Z, 2024-05-01T14:00:00+02:00, 2024-05-01). A dead letter's time is
when it was dead-lettered. Exit status: 0 done, 1 failure (or, for check, dead letters
present; for purge without --yes, nothing removed; for replay, a letter selected left
behind), 2 bad usage.";

/// `taskhub dlq`.
#[derive(Args, Debug)]
pub struct DlqArgs {
    /// The stream whose dead letters to work on (they are in <STREAM>:dlq).
    #[arg(
        long,
        default_value = "tasks:events",
        global = true,
        env = "TASKHUB_STREAM"
    )]
    stream: String,
    /// Only the dead letters of this consumer group [default: every
    /// group's; TASKHUB_GROUP is not read here: the group's letters are
    /// its stream's].
    #[arg(long, global = true, value_name = "GROUP", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    group: Option<String>,
    /// Print JSON instead of tables: one document, or one object per line for list.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: DlqCommand,
}

impl DlqArgs {
    /// Whether the command connects to PostgreSQL: replay (to check what
    /// was processed) and archive (`--to postgres`).
    pub fn uses_database(&self) -> bool {
        matches!(self.command, DlqCommand::Replay(_) | DlqCommand::Archive(_))
    }
}

#[derive(Subcommand, Debug)]
enum DlqCommand {
    /// Count dead letters by kind and by reason (numbers and ids masked), with the oldest and newest age.
    Stats,
    /// List dead letters, newest first.
    List(ListArgs),
    /// Show one dead letter in full: origin, reason, attempt history, every field (payload pretty-printed when it is JSON).
    Show {
        /// Its id in the dead-letter stream (see list).
        id: String,
    },
    /// Put dead letters back on their original stream.
    #[command(long_about = "\
Put dead letters back on their original stream, oldest first (ids: in the order given).

Each goes back with every original field, so the same event_id, plus the audit fields
replayed_from (its dead-letter id), replayed_at (ms since the epoch), replay_count, and,
while the letter's group reads the stream, replay_group and replay_stream (only that
group's workers apply it; the stream's other groups ack it as a duplicate); the
XADD and its removal from the dead-letter stream are one atomic step, and an entry already
gone (replayed or purged meanwhile) is not added twice. Events whose effect is already
committed are skipped by the worker's idempotency layer (as duplicates); the summary says
how many, looked up in PostgreSQL's processed_events (DATABASE_URL) under each dead letter's
group as scope (--scope to change); not checked when PostgreSQL is unreachable.

A dead letter that does not hold the whole event is not replayed (in --dry-run neither) and
stays: an `invalid` one of an entry over --max-entry-bytes (it keeps the first 256 bytes of
each field) and a `trimmed` one that kept only its event_id. Put back, the cut-down event
would be applied and recorded processed. Each is listed with the reason; produce the event
again in full, or purge the letter. Exit status 1 when any letter selected was not replayed
(failed, incomplete, or, for ids given, not found).")]
    Replay(ReplayArgs),
    /// Delete dead letters (needs --yes; without it, says how many would go).
    Purge(PurgeArgs),
    /// Move dead letters older than a given age to PostgreSQL or a JSONL file.
    #[command(long_about = "\
Move dead letters older than --older-than to the dead_letters_archive table (--to postgres,
the default; run `taskhub migrate` first) or to a JSONL file (--to FILE, appended to), in
chunks: copy (commit, or write + fsync), read the copy back and compare, then delete from
the dead-letter stream. Nothing is removed that was not safely copied; if interrupted, run it
again: each entry is in the stream, in the archive, or in both (a file may then hold an entry
twice; key on stream + dead_letter_id). A JSONL line: {\"stream\", \"dead_letter_id\",
\"event_id\", \"kind\", \"reason\", \"archived_at\", \"fields\": the whole dead-letter entry,
values as strings, or {\"hex\": ...} when not UTF-8}.")]
    Archive(ArchiveArgs),
    /// Exit 0 when there are no dead letters; else print a one-line summary and exit 1 (for cron and probes).
    Check,
}

#[derive(Args, Debug, Default)]
struct FilterArgs {
    /// Only this kind: permanent, exhausted, crash_loop, invalid (repeat or comma-separate for several).
    #[arg(long, value_name = "KIND", value_delimiter = ',')]
    kind: Vec<String>,
    /// Only reasons containing TEXT (case-sensitive).
    #[arg(long, value_name = "TEXT", conflicts_with = "reason_regex")]
    reason: Option<String>,
    /// Only reasons matching this regular expression (unanchored; (?i) ignores case).
    #[arg(long, value_name = "REGEX")]
    reason_regex: Option<String>,
    /// Only dead-lettered at or after TIME (2h = two hours ago, or RFC 3339).
    #[arg(long, value_name = "TIME")]
    since: Option<String>,
    /// Only dead-lettered at or before TIME (2h = two hours ago, or RFC 3339).
    #[arg(long, value_name = "TIME")]
    until: Option<String>,
    /// Only entries whose original field NAME equals VALUE (repeat: all must match).
    #[arg(long = "field", value_name = "NAME=VALUE")]
    fields: Vec<String>,
    /// Only entries older than this dead-letter id (the next page after it).
    #[arg(long, value_name = "ID")]
    before: Option<String>,
}

impl FilterArgs {
    fn build(&self, limit: Option<usize>) -> Result<Filter, String> {
        let now = SystemTime::now();
        let err = |e: taskhub::Error| report(&e);
        let reason = match (&self.reason, &self.reason_regex) {
            (Some(text), _) => Some(ReasonMatch::substring(text)),
            (None, Some(re)) => Some(ReasonMatch::regex(re).map_err(err)?),
            (None, None) => None,
        };
        Ok(Filter {
            group: None,
            kinds: self
                .kind
                .iter()
                .filter(|k| !k.trim().is_empty())
                .map(|k| k.parse::<taskhub::DeadLetterKind>())
                .collect::<Result<_, _>>()
                .map_err(err)?,
            reason,
            since: self
                .since
                .as_deref()
                .map(|t| taskhub::dlq::parse_time(t, now))
                .transpose()
                .map_err(err)?,
            until: self
                .until
                .as_deref()
                .map(|t| taskhub::dlq::parse_time(t, now))
                .transpose()
                .map_err(err)?,
            fields: self
                .fields
                .iter()
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .ok_or_else(|| format!("--field {kv:?}: expected NAME=VALUE"))
                })
                .collect::<Result<_, _>>()?,
            limit,
            before: self.before.clone(),
        })
    }
}

#[derive(Args, Debug)]
struct ListArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Show at most N (0: all).
    #[arg(long, default_value_t = 100, value_name = "N")]
    limit: usize,
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// Dead-letter ids to replay (or use filter flags, or --all).
    ids: Vec<String>,
    #[command(flatten)]
    filter: FilterArgs,
    /// With filter flags: only the newest N that match (leave it out for all).
    #[arg(long, value_name = "N", value_parser = nonzero_limit)]
    limit: Option<usize>,
    /// Replay every dead letter of the stream (of --group, if given).
    #[arg(long)]
    all: bool,
    /// Say what would be replayed (and how many are already processed); change nothing.
    #[arg(long)]
    dry_run: bool,
    /// At most N entries per second.
    #[arg(long, value_name = "N", value_parser = positive)]
    rate: Option<f64>,
    /// Idempotency scope to check for "already processed" [default: each dead letter's group].
    #[arg(long)]
    scope: Option<String>,
    /// The workers' --max-entry-bytes: a letter whose entry, put back with the replay's audit
    /// fields, would be larger is not replayed (the workers would cut it down). The workers
    /// running on the stream publish theirs, and the smallest of those and this is kept to.
    #[arg(long, value_name = "BYTES", default_value_t = 1024 * 1024, env = "TASKHUB_MAX_ENTRY_BYTES")]
    max_entry_bytes: usize,
}

#[derive(Args, Debug)]
struct PurgeArgs {
    /// Dead-letter ids to delete (or use filter flags, or --all).
    ids: Vec<String>,
    #[command(flatten)]
    filter: FilterArgs,
    /// With filter flags: only the newest N that match (leave it out for all).
    #[arg(long, value_name = "N", value_parser = nonzero_limit)]
    limit: Option<usize>,
    /// Delete every dead letter of the stream (of --group, if given).
    #[arg(long)]
    all: bool,
    /// Really delete (without it: say how many would be deleted, and exit 1).
    #[arg(long)]
    yes: bool,
}

#[derive(Args, Debug)]
struct ArchiveArgs {
    /// Archive dead letters older than this (dead-lettered more than D ago), e.g. 7d.
    #[arg(long, value_name = "D", value_parser = super::duration)]
    older_than: Duration,
    /// `postgres` (the dead_letters_archive table of DATABASE_URL) or a JSONL file path.
    #[arg(long, value_name = "postgres|FILE", default_value = "postgres")]
    to: String,
    /// Entries copied, verified and removed per step.
    #[arg(long, value_name = "N", default_value_t = 500, value_parser = crate::cli::per_step)]
    chunk: usize,
}

/// `--limit` of replay and purge. Leaving it out takes every match, so 0
/// would only select nothing (and `list --limit 0` means all): refused.
fn nonzero_limit(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err(
            "0 would select nothing; leave --limit out for every dead letter that matches \
             (on list, --limit 0 means all)"
                .into(),
        ),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(n) if n.is_finite() && n > 0.0 => Ok(n),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

/// Runs `taskhub dlq ...`. `Err` is a failure message (exit 1).
pub fn run(
    redis_url: &str,
    redis_tls: &taskhub::Tls,
    database_url: &str,
    args: DlqArgs,
) -> Result<ExitCode, String> {
    // Checked here, not by clap: a global flag's parser also meets the
    // environment's value where the flag was given on the other side of
    // the subcommand, so `--stream a` was refused for TASKHUB_STREAM=a,b.
    if let Err(message) = crate::cli::one_stream(&args.stream) {
        return Ok(usage(&message));
    }
    let mut dead =
        DeadLetters::connect(redis_url, redis_tls, &args.stream).map_err(|e| report(&e))?;
    // A stream that no group reads and that has no letter, or a group the
    // stream does not have: a misspelt --stream or --group would find no
    // letter, and `check` would say "none" for ever.
    // (A key of another type where the stream should be: the command
    // says what it finds there.)
    let groups = match dead.groups() {
        Err(e) if args.group.is_some() => return Err(report(&e)),
        groups => groups.ok(),
    };
    let unknown_stream = match &groups {
        Some(groups) => groups.is_empty() && dead.is_empty().map_err(|e| report(&e))?,
        None => false,
    };
    let unknown_group = !unknown_stream
        && args
            .group
            .as_ref()
            .is_some_and(|g| !groups.as_ref().is_some_and(|all| all.contains(g)));
    if unknown_stream {
        eprintln!(
            "taskhub: warning: no consumer group reads stream {} and it has no dead letters: is the name right (--stream, or TASKHUB_STREAM)?",
            args.stream
        );
    }
    if unknown_group {
        eprintln!(
            "taskhub: warning: stream {} has no consumer group {} (only letters it wrote before it went can match)",
            args.stream,
            args.group.as_deref().unwrap_or_default()
        );
    }
    let ctx = Ctx {
        dlq: dead_letter_stream(&args.stream),
        unknown_stream,
        unknown_group,
        group: args.group,
        stream: args.stream,
        json: args.json,
        now: SystemTime::now(),
    };
    let dead = &mut dead;
    match args.command {
        DlqCommand::Stats => ctx.stats(dead),
        DlqCommand::List(a) => ctx.list(dead, &a),
        DlqCommand::Show { id } => ctx.show(dead, &id),
        DlqCommand::Replay(a) => ctx.replay(dead, database_url, a),
        DlqCommand::Purge(a) => ctx.purge(dead, a),
        DlqCommand::Archive(a) => ctx.archive(dead, database_url, &a),
        DlqCommand::Check => ctx.check(dead),
    }
}

struct Ctx {
    stream: String,
    dlq: String,
    /// `--group`: only this group's letters.
    group: Option<String>,
    /// No consumer group reads the stream, and it has no dead letter.
    unknown_stream: bool,
    /// The stream has no consumer group of that name.
    unknown_group: bool,
    json: bool,
    now: SystemTime,
}

/// A usage mistake found once the flags are parsed (which letters to take):
/// said as an error, exit 2 as clap's own are.
fn usage(message: &str) -> ExitCode {
    eprintln!("taskhub: error: {message}");
    ExitCode::from(2)
}

fn ok() -> Result<ExitCode, String> {
    Ok(ExitCode::SUCCESS)
}

fn err(e: taskhub::Error) -> String {
    report(&e)
}

/// `n thing` or `n things`.
fn plural(n: usize, thing: &str) -> String {
    format!("{n} {thing}{}", if n == 1 { "" } else { "s" })
}

impl Ctx {
    /// ` of group G` with `--group`, for the summaries; empty without.
    fn of_group(&self) -> String {
        self.group.as_deref().map_or_else(String::new, |g| {
            format!(" of group {}", crate::cli::format::one_line(g, 100))
        })
    }

    /// The filter of `--group` (every letter without it).
    fn filter(&self) -> Filter {
        Filter {
            group: self.group.clone(),
            ..Filter::default()
        }
    }

    /// Ids, a filter, --group or --all → a selection; anything else is a
    /// usage mistake.
    fn selection(
        &self,
        ids: Vec<String>,
        filter: &FilterArgs,
        limit: Option<usize>,
        all: bool,
    ) -> Result<Selection, String> {
        let mut filter = filter.build(limit)?;
        let grouped = self.group.is_some();
        match (ids.is_empty(), filter.is_everything(), all) {
            (false, true, false) if grouped => Err(
                "dead-letter ids name the letters themselves: drop --group (or the ids)".into(),
            ),
            (false, true, false) => Ok(Selection::Ids(ids)),
            (false, _, _) => {
                Err("give dead-letter ids or filter flags (or --all), not both".into())
            }
            (true, false, true) => Err(format!(
                "--all selects every dead letter{}: drop it or the filter flags",
                if grouped { " of the group" } else { "" }
            )),
            // --group alone is not a selection: a script whose list of ids
            // came out empty must not take the whole group.
            (true, true, false) => Err(format!(
                "say which dead letters: ids, filter flags (--kind, --reason, --since, ...), or --all{}",
                if grouped { " (for every letter of the group)" } else { "" }
            )),
            (true, _, _) => {
                filter.group.clone_from(&self.group);
                Ok(Selection::Filter(filter))
            }
        }
    }
}
