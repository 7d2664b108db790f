//! `taskhub dlq`: look at, replay, purge and archive dead letters. Tables for
//! people, `--json` for tools; the work is done by `taskhub::dlq`.

use super::report;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};
use taskhub::RedisConn;

use clap::{Args, Subcommand};
use serde_json::{json, Value};
use taskhub::dead_letter_stream;
use taskhub::dlq::{self, Filter, ReasonMatch, Selection};
use taskhub::DeadLetter;

use super::{print, table};

/// The long help of `taskhub dlq`.
pub const LONG_ABOUT: &str = "\
Look at, replay, purge and archive the dead letters of a stream (kept in <stream>:dlq).

Times (--since, --until) are a duration ago (90s, 2h, 3d) or an RFC 3339 time
(2024-05-01T12:00:00Z, 2024-05-01T14:00:00+02:00, 2024-05-01). A dead letter's time is
when it was dead-lettered. Exit status: 0 done, 1 failure (or, for check, dead letters
present; for purge without --yes, nothing removed), 2 bad usage.";

/// `taskhub dlq`.
#[derive(Args, Debug)]
pub struct DlqArgs {
    /// The stream whose dead letters to work on (they are in <STREAM>:dlq).
    #[arg(long, default_value = "tasks:events", global = true)]
    stream: String,
    /// Print JSON instead of tables: one document, or one object per line for list.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: DlqCommand,
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
replayed_from (its dead-letter id), replayed_at (ms since the epoch) and replay_count; the
XADD and its removal from the dead-letter stream are one atomic step, and an entry already
gone (replayed or purged meanwhile) is not added twice. Events whose effect is already
committed are skipped by the worker's idempotency layer (as duplicates); the summary says
how many, looked up in PostgreSQL's processed_events (DATABASE_URL) under each dead letter's
group as scope (--scope to change); not checked when PostgreSQL is unreachable.")]
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
            kinds: self
                .kind
                .iter()
                .filter(|k| !k.trim().is_empty())
                .map(|k| dlq::parse_kind(k))
                .collect::<Result<_, _>>()
                .map_err(err)?,
            reason,
            since: self
                .since
                .as_deref()
                .map(|t| dlq::parse_time(t, now))
                .transpose()
                .map_err(err)?,
            until: self
                .until
                .as_deref()
                .map(|t| dlq::parse_time(t, now))
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
    /// With filter flags: only the newest N that match.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Replay every dead letter of the stream.
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
}

#[derive(Args, Debug)]
struct PurgeArgs {
    /// Dead-letter ids to delete (or use filter flags, or --all).
    ids: Vec<String>,
    #[command(flatten)]
    filter: FilterArgs,
    /// With filter flags: only the newest N that match.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Delete every dead letter of the stream.
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
    #[arg(long, value_name = "N", default_value_t = 500)]
    chunk: usize,
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
    let mut conn = dlq::connect_redis(redis_url, redis_tls).map_err(|e| report(&e))?;
    conn.check_stream(&args.stream).map_err(|e| report(&e))?;
    let ctx = Ctx {
        dlq: dead_letter_stream(&args.stream),
        stream: args.stream,
        json: args.json,
        now: SystemTime::now(),
    };
    let conn = &mut conn;
    match args.command {
        DlqCommand::Stats => ctx.stats(conn),
        DlqCommand::List(a) => ctx.list(conn, &a),
        DlqCommand::Show { id } => ctx.show(conn, &id),
        DlqCommand::Replay(a) => ctx.replay(conn, database_url, a),
        DlqCommand::Purge(a) => ctx.purge(conn, a),
        DlqCommand::Archive(a) => ctx.archive(conn, database_url, &a),
        DlqCommand::Check => ctx.check(conn),
    }
}

struct Ctx {
    stream: String,
    dlq: String,
    json: bool,
    now: SystemTime,
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

fn time(ms: u64) -> String {
    dlq::format_time(ms, false)
}

/// Ids, a filter or --all → a selection; anything else is a usage mistake.
fn selection(
    ids: Vec<String>,
    filter: &FilterArgs,
    limit: Option<usize>,
    all: bool,
) -> Result<Selection, String> {
    let filter = filter.build(limit)?;
    match (ids.is_empty(), filter.is_everything(), all) {
        (false, true, false) => Ok(Selection::Ids(ids)),
        (false, _, _) => Err("give dead-letter ids or filter flags (or --all), not both".into()),
        (true, false, false) | (true, true, true) => Ok(Selection::Filter(filter)),
        (true, false, true) => {
            Err("--all selects every dead letter: drop it or the filter flags".into())
        }
        (true, true, false) => Err(
            "say which dead letters: ids, filter flags (--kind, --reason, --since, ...), or --all"
                .into(),
        ),
    }
}

/// A progress line on stderr, when stderr is a terminal.
struct Progress {
    label: &'static str,
    on: bool,
    last: Option<Instant>,
}

impl Progress {
    fn new(label: &'static str) -> Progress {
        Progress {
            label,
            on: std::io::stderr().is_terminal(),
            last: None,
        }
    }

    fn update(&mut self, done: usize, total: usize) {
        if !self.on || total < 2 {
            return;
        }
        let finished = done >= total;
        if !finished
            && self
                .last
                .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.last = Some(Instant::now());
        let width = 30;
        let filled = width * done / total;
        let mut e = std::io::stderr().lock();
        let _ = write!(
            e,
            "\r{} [{}{}] {done}/{total}",
            self.label,
            "#".repeat(filled),
            "-".repeat(width - filled)
        );
        if finished {
            let _ = writeln!(e);
        }
        let _ = e.flush();
    }
}

impl Ctx {
    fn stats(&self, conn: &mut RedisConn) -> Result<ExitCode, String> {
        let s = dlq::stats(conn, &self.stream, &Filter::default()).map_err(err)?;
        let age = |t: Option<u64>| t.map(|t| dlq::age(t, self.now));
        let age_secs = |t: Option<u64>| t.map(|t| dlq::age_secs(t, self.now));
        if self.json {
            let by_kind: serde_json::Map<String, Value> = s
                .by_kind
                .iter()
                .map(|(k, n)| (k.as_str().to_owned(), json!(n)))
                .collect();
            let by_reason: Vec<Value> = s
                .by_reason
                .iter()
                .map(|r| json!({"fingerprint": r.fingerprint, "count": r.count, "example": r.example}))
                .collect();
            let doc = json!({
                "stream": self.stream,
                "dead_letter_stream": self.dlq,
                "count": s.count,
                "undecodable": s.undecodable,
                "by_kind": by_kind,
                "by_reason": by_reason,
                "oldest_dead_at": s.oldest_dead_at,
                "oldest_age_secs": age_secs(s.oldest_dead_at),
                "newest_dead_at": s.newest_dead_at,
                "newest_age_secs": age_secs(s.newest_dead_at),
                "latest_reason": s.latest_reason,
            });
            print(&format!("{doc}\n"))?;
            return ok();
        }
        let mut out = format!("{}: {}", self.dlq, plural(s.count as usize, "dead letter"));
        if let (Some(oldest), Some(newest)) = (age(s.oldest_dead_at), age(s.newest_dead_at)) {
            out.push_str(&format!(", oldest {oldest} ago, newest {newest} ago"));
        }
        if s.undecodable > 0 {
            out.push_str(&format!(", {} unreadable entries", s.undecodable));
        }
        out.push('\n');
        if s.count > 0 {
            let kinds: Vec<Vec<String>> = s
                .by_kind
                .iter()
                .map(|(k, n)| vec![n.to_string(), k.to_string()])
                .collect();
            out.push('\n');
            out.push_str(&table(&["COUNT", "KIND"], &kinds));
            let reasons: Vec<Vec<String>> = s
                .by_reason
                .iter()
                .map(|r| vec![r.count.to_string(), dlq::one_line(&r.fingerprint, 100)])
                .collect();
            out.push('\n');
            out.push_str(&table(
                &["COUNT", "REASON (numbers and ids masked)"],
                &reasons,
            ));
        }
        print(&out)?;
        ok()
    }

    fn list(&self, conn: &mut RedisConn, a: &ListArgs) -> Result<ExitCode, String> {
        // One more than shown, to know whether there are more.
        let limit = (a.limit > 0).then_some(a.limit + 1);
        let mut filter = a.filter.build(limit)?;
        let mut letters = Vec::new();
        // A listing stops after a budget of entries read; a command-line
        // user is happy to wait: go on from where it stopped.
        loop {
            let listing = dlq::list(conn, &self.stream, &filter).map_err(err)?;
            letters.extend(listing.letters);
            match listing.stopped_at {
                Some(at) if limit.is_none_or(|n| letters.len() < n) => {
                    filter.before = Some(at);
                    filter.limit = limit.map(|n| n - letters.len());
                }
                _ => break,
            }
        }
        let more = a.limit > 0 && letters.len() > a.limit;
        letters.truncate(if a.limit > 0 { a.limit } else { usize::MAX });
        if self.json {
            let mut out = String::new();
            for l in &letters {
                out.push_str(&dlq::letter_json(l).to_string());
                out.push('\n');
            }
            print(&out)?;
        } else {
            let rows: Vec<Vec<String>> = letters
                .iter()
                .map(|l| {
                    vec![
                        l.id.clone().unwrap_or_default(),
                        dlq::age(l.dead_at, self.now),
                        l.kind.to_string(),
                        l.attempts.to_string(),
                        dlq::one_line(l.event_id.as_deref().unwrap_or("-"), 40),
                        dlq::one_line(&l.reason, 70),
                    ]
                })
                .collect();
            print(&table(
                &["ID", "AGE", "KIND", "ATTEMPTS", "EVENT_ID", "REASON"],
                &rows,
            ))?;
        }
        if more {
            let last = letters
                .last()
                .and_then(|l| l.id.clone())
                .unwrap_or_default();
            eprintln!(
                "taskhub: more dead letters match; showing the newest {} (--limit 0 for all, --before {last} for the next page)",
                a.limit
            );
        }
        ok()
    }

    fn show(&self, conn: &mut RedisConn, id: &str) -> Result<ExitCode, String> {
        let Some(l) = dlq::show(conn, &self.stream, id).map_err(err)? else {
            return Err(format!("no dead letter {id} in {}", self.dlq));
        };
        if self.json {
            let mut doc = dlq::letter_json(&l);
            let payload = l
                .field("payload")
                .and_then(|p| serde_json::from_slice::<Value>(p).ok());
            doc["payload_json"] = payload.unwrap_or(Value::Null);
            print(&format!("{doc}\n"))?;
            return ok();
        }
        print(&self.describe(&l))?;
        ok()
    }

    fn describe(&self, l: &DeadLetter) -> String {
        let c = |s: &str| dlq::one_line(s, usize::MAX);
        let when = |ms: u64| format!("{} ({} ago)", time(ms), dlq::age(ms, self.now));
        let mut rows = vec![
            vec![
                "dead letter".into(),
                format!("{} in {}", c(l.id.as_deref().unwrap_or("")), self.dlq),
            ],
            vec!["kind".into(), l.kind.to_string()],
            vec!["reason".into(), c(&l.reason)],
            vec![
                "event_id".into(),
                c(l.event_id.as_deref().unwrap_or("(none)")),
            ],
            vec![
                "from".into(),
                format!("{} entry {}", c(&l.stream), c(&l.original_id)),
            ],
            vec![
                "given up by".into(),
                format!("group {}, consumer {}", c(&l.group), c(&l.consumer)),
            ],
            vec!["attempts".into(), l.attempts.to_string()],
            vec!["first failed".into(), when(l.first_failed_at)],
            vec!["dead at".into(), when(l.dead_at)],
        ];
        if let Some(n) = l.field("replay_count") {
            rows.push(vec![
                "replayed".into(),
                format!(
                    "{} time(s) before, last from {}",
                    c(&String::from_utf8_lossy(n)),
                    c(&String::from_utf8_lossy(
                        l.field("replayed_from").unwrap_or(b"?")
                    ))
                ),
            ]);
        }
        let mut out = String::new();
        for row in rows {
            out.push_str(&format!("{:<13} {}\n", row[0], row[1]));
        }
        out.push_str("\nattempt history\n");
        let history: Vec<Vec<String>> = l
            .history
            .iter()
            .map(|a| {
                vec![
                    format!("  {}", a.attempt),
                    a.at.map_or_else(|| "(never reported)".to_owned(), |t| time(dlq::millis(t))),
                    c(&a.error),
                ]
            })
            .collect();
        if history.is_empty() {
            out.push_str("  (none recorded)\n");
        } else {
            out.push_str(&table(&["  #", "AT", "ERROR"], &history));
        }
        out.push_str("\nfields\n");
        for (k, v) in &l.fields {
            let name = c(&String::from_utf8_lossy(k));
            let value = match std::str::from_utf8(v) {
                Err(_) => format!(
                    "({} bytes, not UTF-8) {}",
                    v.len(),
                    v.iter()
                        .take(64)
                        .map(|b| format!("{b:02x}"))
                        .collect::<String>()
                ),
                Ok(text) => match serde_json::from_str::<Value>(text) {
                    Ok(json @ (Value::Object(_) | Value::Array(_))) => {
                        let pretty = serde_json::to_string_pretty(&json).unwrap_or_default();
                        let body: Vec<String> = pretty
                            .lines()
                            .map(|line| format!("    {}", escape_controls(line)))
                            .collect();
                        format!("(JSON)\n{}", body.join("\n"))
                    }
                    _ => {
                        let lines: Vec<String> = text.lines().map(escape_controls).collect();
                        lines.join("\n    ")
                    }
                },
            };
            out.push_str(&format!("  {name}: {value}\n"));
        }
        out
    }

    fn replay(
        &self,
        conn: &mut RedisConn,
        database_url: &str,
        a: ReplayArgs,
    ) -> Result<ExitCode, String> {
        let explicit = !a.ids.is_empty();
        let selection = selection(a.ids, &a.filter, a.limit, a.all)?;
        let mut pg = match dlq::connect_postgres(database_url) {
            Ok(client) => Some(client),
            Err(e) => {
                eprintln!(
                    "taskhub: warning: {e}; \"already processed\" is not checked (the worker still skips what was applied)"
                );
                None
            }
        };
        let options = dlq::ReplayOptions {
            dry_run: a.dry_run,
            rate: a.rate,
            scope: a.scope,
        };
        let mut progress = Progress::new("replay");
        let report = dlq::replay(
            conn,
            pg.as_mut(),
            &self.stream,
            &selection,
            &options,
            &mut |done, total| progress.update(done, total),
        )
        .map_err(err)?;
        let failed = report.failed();
        let code = if failed > 0 || (explicit && !report.not_found.is_empty()) {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
        if self.json {
            let items: Vec<Value> = report
                .items
                .iter()
                .map(|i| {
                    json!({
                        "id": i.id,
                        "event_id": i.event_id,
                        "stream": i.stream,
                        "already_processed": i.already_processed,
                        "replayed_as": i.replayed_as,
                        "error": i.error,
                    })
                })
                .collect();
            let doc = json!({
                "dry_run": report.dry_run,
                "replayed": report.replayed(),
                "already_processed": report.already_processed(),
                "failed": failed,
                "not_found": report.not_found,
                "checked_with": report.checked_with.map(|c| c.as_str()),
                "items": items,
            });
            print(&format!("{doc}\n"))?;
            return Ok(code);
        }
        let mut out = String::new();
        if report.dry_run && !report.items.is_empty() {
            let rows: Vec<Vec<String>> = report
                .items
                .iter()
                .map(|i| {
                    vec![
                        i.id.clone(),
                        dlq::one_line(i.event_id.as_deref().unwrap_or("-"), 40),
                        dlq::one_line(&i.stream, 40),
                        match (&i.error, i.already_processed) {
                            (Some(e), _) => format!("cannot replay: {}", dlq::one_line(e, 60)),
                            (None, true) => "already processed: the worker will skip it".into(),
                            (None, false) => "would replay".into(),
                        },
                    ]
                })
                .collect();
            out.push_str(&table(&["ID", "EVENT_ID", "TO STREAM", "WHAT"], &rows));
        }
        for i in report
            .items
            .iter()
            .filter(|i| i.error.is_some() && !report.dry_run)
        {
            out.push_str(&format!(
                "{}: not replayed: {}\n",
                i.id,
                dlq::one_line(i.error.as_deref().unwrap_or_default(), 200)
            ));
        }
        let checked = match report.checked_with {
            Some(_) => "checked in processed_events in PostgreSQL",
            None => "not checked: PostgreSQL was not reachable",
        };
        let n = report.replayed();
        let processed = report.already_processed();
        if n == 0 {
            out.push_str(if report.dry_run {
                "dry run: nothing to replay"
            } else {
                "nothing replayed"
            });
        } else {
            out.push_str(&format!(
                "{} {} to {}: {processed} already processed (the worker will skip {} as duplicate{}; {checked}), {} to apply",
                if report.dry_run { "dry run: would replay" } else { "replayed" },
                plural(n, "dead letter"),
                if n == 1 { "its stream" } else { "their streams" },
                if processed == 1 { "it" } else { "them" },
                if processed == 1 { "" } else { "s" },
                n.saturating_sub(processed),
            ));
        }
        if failed > 0 {
            out.push_str(&format!(", {failed} failed (still dead letters)"));
        }
        if !report.not_found.is_empty() {
            out.push_str(&format!(
                ", {} not found ({})",
                report.not_found.len(),
                report.not_found.join(" ")
            ));
        }
        if report.dry_run {
            out.push_str("; nothing changed");
        }
        out.push('\n');
        print(&out)?;
        Ok(code)
    }

    fn purge(&self, conn: &mut RedisConn, a: PurgeArgs) -> Result<ExitCode, String> {
        let explicit = !a.ids.is_empty();
        let selection = selection(a.ids, &a.filter, a.limit, a.all)?;
        let report = dlq::purge(conn, &self.stream, &selection, !a.yes).map_err(err)?;
        if self.json {
            let doc = json!({
                "dry_run": report.dry_run,
                "removed": if report.dry_run { 0 } else { report.removed },
                "would_remove": if report.dry_run { report.removed } else { 0 },
                "not_found": report.not_found,
            });
            print(&format!("{doc}\n"))?;
        } else if report.dry_run {
            eprintln!(
                "taskhub: purge would remove {} from {}; nothing removed (add --yes to remove them)",
                plural(report.removed, "dead letter"),
                self.dlq
            );
        } else {
            let mut line = format!(
                "removed {} from {}",
                plural(report.removed, "dead letter"),
                self.dlq
            );
            if !report.not_found.is_empty() {
                line.push_str(&format!("; not found: {}", report.not_found.join(" ")));
            }
            print(&format!("{line}\n"))?;
        }
        if report.dry_run || (explicit && !report.not_found.is_empty()) {
            return Ok(ExitCode::FAILURE);
        }
        ok()
    }

    fn archive(
        &self,
        conn: &mut RedisConn,
        database_url: &str,
        a: &ArchiveArgs,
    ) -> Result<ExitCode, String> {
        let cutoff = self
            .now
            .checked_sub(a.older_than)
            .ok_or("--older-than reaches before 1970")?;
        let filter = Filter {
            until: Some(cutoff),
            ..Filter::default()
        };
        let mut pg;
        let path;
        let (target, place) = if a.to == "postgres" {
            pg = dlq::connect_postgres(database_url).map_err(err)?;
            (
                dlq::ArchiveTarget::Postgres(&mut pg),
                "PostgreSQL table dead_letters_archive".to_owned(),
            )
        } else {
            path = PathBuf::from(&a.to);
            (dlq::ArchiveTarget::File(&path), path.display().to_string())
        };
        let mut progress = Progress::new("archive");
        let report = dlq::archive(
            conn,
            &self.stream,
            &filter,
            target,
            a.chunk,
            &mut |done, total| progress.update(done, total),
        )
        .map_err(err)?;
        if self.json {
            let kept: Vec<Value> = report
                .kept
                .iter()
                .map(|(id, why)| json!({"id": id, "why": why}))
                .collect();
            let doc = json!({
                "to": a.to,
                "selected": report.selected,
                "archived": report.archived,
                "kept": kept,
            });
            print(&format!("{doc}\n"))?;
        } else {
            let mut out = format!(
                "archived {} older than {} to {place} (removed from {})\n",
                plural(report.archived, "dead letter"),
                humantime::format_duration(a.older_than),
                self.dlq
            );
            for (id, why) in &report.kept {
                out.push_str(&format!("{id}: kept in {}: {why}\n", self.dlq));
            }
            print(&out)?;
        }
        Ok(if report.kept.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }

    fn check(&self, conn: &mut RedisConn) -> Result<ExitCode, String> {
        let s = dlq::stats(conn, &self.stream, &Filter::default()).map_err(err)?;
        let total = s.count + s.undecodable;
        if self.json {
            let by_kind: serde_json::Map<String, Value> = s
                .by_kind
                .iter()
                .map(|(k, n)| (k.as_str().to_owned(), json!(n)))
                .collect();
            let doc = json!({
                "ok": total == 0,
                "stream": self.stream,
                "count": total,
                "by_kind": by_kind,
                "oldest_age_secs": s.oldest_dead_at.map(|t| dlq::age_secs(t, self.now)),
                "latest_reason": s.latest_reason,
            });
            print(&format!("{doc}\n"))?;
        } else if total == 0 {
            print(&format!("{}: no dead letters\n", self.dlq))?;
        } else {
            print(&format!(
                "{}\n",
                dlq::summary_line(&self.dlq, total, &s, self.now)
            ))?;
        }
        Ok(if total == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}

/// Control characters (terminal escapes in untrusted payloads) made visible.
fn escape_controls(line: &str) -> String {
    line.chars()
        .flat_map(|c| {
            let visible: Vec<char> = if c.is_control() && c != '\t' {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            visible
        })
        .collect()
}
