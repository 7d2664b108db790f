//! `taskhub dlq replay | purge | archive`: the commands that change the
//! dead-letter stream, with a progress line on a terminal.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use taskhub::dlq::{self, DeadLetters, Filter};

use super::{err, ok, plural, ArchiveArgs, Ctx, PurgeArgs, ReplayArgs};
use crate::cli::format::one_line;
use crate::cli::{print, table};

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
    pub(super) fn replay(
        &self,
        dead: &mut DeadLetters,
        database_url: &str,
        a: ReplayArgs,
    ) -> Result<ExitCode, String> {
        let explicit = !a.ids.is_empty();
        let selection = match self.selection(a.ids, &a.filter, a.limit, a.all) {
            Ok(selection) => selection,
            Err(message) => return Ok(super::usage(&message)),
        };
        let mut pg = match dlq::connect_postgres(database_url) {
            Ok(client) => Some(client),
            Err(e) => {
                eprintln!(
                    "taskhub: warning: {e}; \"already processed\" is not checked (the worker still skips what was applied)"
                );
                None
            }
        };
        let _watch = pg.as_mut().map(|client| {
            dlq::watch_locks(
                client,
                database_url,
                "dlq replay's look-up in processed_events",
            )
        });
        let options = dlq::ReplayOptions {
            dry_run: a.dry_run,
            rate: a.rate,
            scope: a.scope,
            max_entry_bytes: Some(a.max_entry_bytes),
        };
        let mut progress = Progress::new("replay");
        let report = dead
            .replay(pg.as_mut(), &selection, &options, &mut |done, total| {
                progress.update(done, total)
            })
            .map_err(err)?;
        // Exit 1 when a letter selected was left behind (failed, or not
        // replayed because it does not hold the whole event), as archive
        // does for what it keeps: a script must not take the stream for
        // drained. In a dry run too: the real run would leave it.
        let left = report.failed() + report.incomplete();
        let code = if left > 0 || (explicit && !report.not_found.is_empty()) {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
        let out = if self.json {
            format!("{}\n", replay_json(&report))
        } else {
            replay_text(&report)
        };
        print(&out)?;
        Ok(code)
    }

    pub(super) fn purge(&self, dead: &mut DeadLetters, a: PurgeArgs) -> Result<ExitCode, String> {
        let explicit = !a.ids.is_empty();
        let selection = match self.selection(a.ids, &a.filter, a.limit, a.all) {
            Ok(selection) => selection,
            Err(message) => return Ok(super::usage(&message)),
        };
        let report = dead.purge(&selection, !a.yes).map_err(err)?;
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
                "taskhub: purge would remove {}{} from {}; nothing removed (add --yes to remove them)",
                plural(report.removed, "dead letter"),
                self.of_group(),
                self.dlq
            );
        } else {
            let mut line = format!(
                "removed {}{} from {}",
                plural(report.removed, "dead letter"),
                self.of_group(),
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

    pub(super) fn archive(
        &self,
        dead: &mut DeadLetters,
        database_url: &str,
        a: &ArchiveArgs,
    ) -> Result<ExitCode, String> {
        let cutoff = self
            .now
            .checked_sub(a.older_than)
            .ok_or("--older-than reaches before 1970")?;
        let filter = Filter {
            until: Some(cutoff),
            ..self.filter()
        };
        let mut pg;
        let _watch;
        let path;
        let (target, place) = if a.to == "postgres" {
            pg = dlq::connect_postgres(database_url).map_err(err)?;
            _watch = dlq::watch_locks(&mut pg, database_url, "dlq archive's copy");
            (
                dlq::ArchiveTarget::Postgres(&mut pg),
                "PostgreSQL table dead_letters_archive".to_owned(),
            )
        } else {
            path = PathBuf::from(&a.to);
            (dlq::ArchiveTarget::File(&path), path.display().to_string())
        };
        let mut progress = Progress::new("archive");
        let report = dead
            .archive(&filter, target, a.chunk, &mut |done, total| {
                progress.update(done, total)
            })
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
                "archived {}{} older than {} to {place} (removed from {})\n",
                plural(report.archived, "dead letter"),
                self.of_group(),
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
}

/// `dlq replay --json`: one document.
fn replay_json(report: &dlq::ReplayReport) -> Value {
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
                "incomplete": i.incomplete,
            })
        })
        .collect();
    json!({
        "dry_run": report.dry_run,
        "replayed": report.replayed(),
        "already_processed": report.already_processed(),
        "failed": report.failed(),
        "incomplete": report.incomplete(),
        "not_found": report.not_found,
        "checked_with": report.checked_with.map(|c| c.as_str()),
        "items": items,
    })
}

/// `dlq replay` as text: a table for a dry run, a line per failure, and a
/// summary line.
fn replay_text(report: &dlq::ReplayReport) -> String {
    let mut out = String::new();
    if report.dry_run && !report.items.is_empty() {
        let rows: Vec<Vec<String>> = report
            .items
            .iter()
            .map(|i| {
                vec![
                    i.id.clone(),
                    one_line(i.event_id.as_deref().unwrap_or("-"), 40),
                    one_line(&i.stream, 40),
                    match (&i.error, &i.incomplete, i.already_processed) {
                        (Some(e), _, _) => format!("cannot replay: {}", one_line(e, 60)),
                        (None, Some(_), _) => "not replayed: incomplete event (see below)".into(),
                        (None, None, true) => "already processed: the worker will skip it".into(),
                        (None, None, false) => "would replay".into(),
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
            one_line(i.error.as_deref().unwrap_or_default(), 200)
        ));
    }
    for i in &report.items {
        let Some(why) = &i.incomplete else { continue };
        let event = i
            .event_id
            .as_deref()
            .map_or_else(|| "(no event_id)".to_owned(), |e| one_line(e, 80));
        out.push_str(&format!(
            "{} {event}: {}; not replayed: produce the event again in full, or purge the letter\n",
            i.id,
            one_line(why, 200)
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
    let failed = report.failed();
    if failed > 0 {
        out.push_str(&format!(", {failed} failed (still dead letters)"));
    }
    let incomplete = report.incomplete();
    if incomplete > 0 {
        out.push_str(&format!(
            ", {incomplete} not replayed: {} (still {})",
            if incomplete == 1 {
                "its letter does not hold the whole event"
            } else {
                "their letters do not hold the whole event"
            },
            if incomplete == 1 {
                "a dead letter"
            } else {
                "dead letters"
            }
        ));
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
    out
}
