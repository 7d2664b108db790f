//! `taskhub dlq stats | list | show | check`: dead letters read and
//! printed, tables for people and JSON for tools.

use std::process::ExitCode;

use serde_json::{json, Value};
use taskhub::dlq::DeadLetters;
use taskhub::DeadLetter;

use super::{err, ok, plural, Ctx, ListArgs};
use crate::cli::format::{age, age_secs, one_line, summary_line, time, time_of};
use crate::cli::{print, table};

impl Ctx {
    pub(super) fn stats(&self, dead: &mut DeadLetters) -> Result<ExitCode, String> {
        let s = dead.stats(&self.filter()).map_err(err)?;
        let age = |t: Option<u64>| t.map(|t| age(t, self.now));
        let age_secs = |t: Option<u64>| t.map(|t| age_secs(t, self.now));
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
            let by_group: serde_json::Map<String, Value> = s
                .by_group
                .iter()
                .map(|(g, n)| (g.clone(), json!(n)))
                .collect();
            let doc = json!({
                "stream": self.stream,
                "dead_letter_stream": self.dlq,
                "group": self.group,
                "count": s.count,
                "undecodable": s.undecodable,
                "by_group": by_group,
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
        if let Some(group) = &self.group {
            out.push_str(&format!(" of group {}", one_line(group, 100)));
        }
        if let (Some(oldest), Some(newest)) = (age(s.oldest_dead_at), age(s.newest_dead_at)) {
            out.push_str(&format!(", oldest {oldest} ago, newest {newest} ago"));
        }
        if s.undecodable > 0 {
            out.push_str(&format!(", {} unreadable entries", s.undecodable));
        }
        out.push('\n');
        if s.by_group.len() > 1 {
            let groups: Vec<Vec<String>> = s
                .by_group
                .iter()
                .map(|(g, n)| vec![n.to_string(), one_line(g, 100)])
                .collect();
            out.push('\n');
            out.push_str(&table(&["COUNT", "GROUP"], &groups));
        }
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
                .map(|r| vec![r.count.to_string(), one_line(&r.fingerprint, 100)])
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

    pub(super) fn list(&self, dead: &mut DeadLetters, a: &ListArgs) -> Result<ExitCode, String> {
        // One more than shown, to know whether there are more.
        let limit = (a.limit > 0).then_some(a.limit + 1);
        let mut filter = a.filter.build(limit)?;
        filter.group.clone_from(&self.group);
        let mut letters = Vec::new();
        // A listing stops after a budget of entries read; a command-line
        // user is happy to wait: go on from where it stopped.
        loop {
            let listing = dead.list(&filter).map_err(err)?;
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
                out.push_str(&l.to_json().to_string());
                out.push('\n');
            }
            print(&out)?;
        } else {
            let rows: Vec<Vec<String>> = letters
                .iter()
                .map(|l| {
                    vec![
                        l.id.clone().unwrap_or_default(),
                        age(l.dead_at, self.now),
                        one_line(&l.group, 30),
                        l.kind.to_string(),
                        l.attempts.to_string(),
                        one_line(l.event_id.as_deref().unwrap_or("-"), 40),
                        one_line(&l.reason, 70),
                    ]
                })
                .collect();
            print(&table(
                &[
                    "ID", "AGE", "GROUP", "KIND", "ATTEMPTS", "EVENT_ID", "REASON",
                ],
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

    pub(super) fn show(&self, dead: &mut DeadLetters, id: &str) -> Result<ExitCode, String> {
        let Some(l) = dead.show(id).map_err(err)? else {
            return Err(format!("no dead letter {id} in {}", self.dlq));
        };
        if let Some(group) = self.group.as_ref().filter(|g| **g != l.group) {
            return Err(format!(
                "dead letter {id} in {} is group {}'s, not {}'s (leave --group out to see it)",
                self.dlq,
                one_line(&l.group, 100),
                one_line(group, 100)
            ));
        }
        if self.json {
            let mut doc = l.to_json();
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
        let c = |s: &str| one_line(s, usize::MAX);
        let when = |ms: u64| format!("{} ({} ago)", time(ms), age(ms, self.now));
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
        if let Some(why) = l.incomplete() {
            rows.push(vec![
                "incomplete".into(),
                format!("{}: replay refuses it", c(&why)),
            ]);
        }
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
        let mut history: Vec<Vec<String>> = Vec::new();
        for (gap, a) in taskhub::dlq::with_gaps(&l.history) {
            if let Some(gap) = gap {
                history.push(vec!["  …".into(), String::new(), gap]);
            }
            history.push(vec![
                format!("  {}", a.attempt),
                a.at.map_or_else(|| "(never reported)".to_owned(), time_of),
                c(&a.error),
            ]);
        }
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

    pub(super) fn check(&self, dead: &mut DeadLetters) -> Result<ExitCode, String> {
        let s = dead.stats(&self.filter()).map_err(err)?;
        // Entries that are not readable letters name no group: they count
        // for the stream, not for one group.
        let total = s.count
            + if self.group.is_none() {
                s.undecodable
            } else {
                0
            };
        if self.json {
            let by_kind: serde_json::Map<String, Value> = s
                .by_kind
                .iter()
                .map(|(k, n)| (k.as_str().to_owned(), json!(n)))
                .collect();
            let doc = json!({
                "ok": total == 0 && !self.unknown_group && !self.unknown_stream,
                "stream": self.stream,
                "group": self.group,
                "unknown_stream": self.unknown_stream,
                "unknown_group": self.unknown_group,
                "count": total,
                "by_kind": by_kind,
                "oldest_age_secs": s.oldest_dead_at.map(|t| age_secs(t, self.now)),
                "latest_reason": s.latest_reason,
            });
            print(&format!("{doc}\n"))?;
        } else {
            let label = match &self.group {
                Some(g) => format!("{} (group {})", self.dlq, one_line(g, 100)),
                None => self.dlq.clone(),
            };
            if total == 0 {
                print(&format!("{label}: no dead letters\n"))?;
            } else {
                print(&format!("{}\n", summary_line(&label, total, &s, self.now)))?;
            }
        }
        // No letter of a group the stream does not have: a misspelt
        // --group, or of a stream nothing reads (a misspelt --stream), is
        // not good news (the warning above says which).
        Ok(
            if total == 0 && !self.unknown_group && !self.unknown_stream {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            },
        )
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
