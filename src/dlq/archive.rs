//! Moving old dead letters out of Redis, to PostgreSQL or to a file, without
//! ever being in neither (see the module documentation of `dlq`).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::SystemTime;

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::dlq::filter::Filter;
use crate::dlq::json::fields_json;
use crate::dlq::letter::dead_letter_stream;
use crate::dlq::read::{fetch, matching_ids};
use crate::dlq::{pg_error, redis_error};
use crate::error::{Error, ErrorKind};
use crate::event::value_in;
use crate::fault::{self, Point};
use crate::redis::RedisConn;

/// Where [`DeadLetters::archive`](crate::dlq::DeadLetters::archive) copies
/// dead letters to.
pub enum ArchiveTarget<'a> {
    /// The `dead_letters_archive` table (see `migrations/`).
    Postgres(&'a mut postgres::Client),
    /// A JSONL file, appended to (created when missing).
    File(&'a Path),
}

/// What an archive did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArchiveReport {
    /// Entries selected (older than the cutoff and matching the filter).
    pub selected: usize,
    /// Entries copied, verified and removed from the dead-letter stream by
    /// this run: an entry that another run removed first (after both
    /// copied it) is counted by that run only.
    pub archived: usize,
    /// Entries left in the dead-letter stream, with why.
    pub kept: Vec<(String, String)>,
}

/// One archive record: the table's columns, and a JSONL line.
struct Record {
    id: String,
    event_id: Option<String>,
    kind: Option<String>,
    reason: Option<String>,
    /// The whole dead-letter entry, raw fields as a JSON object.
    fields: Value,
}

fn no_nul(s: &str) -> String {
    s.replace('\0', "\u{fffd}")
}

impl Record {
    fn line(&self, stream: &str, archived_at: &str) -> String {
        json!({
            "stream": stream,
            "dead_letter_id": self.id,
            "event_id": self.event_id,
            "kind": self.kind,
            "reason": self.reason,
            "archived_at": archived_at,
            "fields": self.fields,
        })
        .to_string()
    }
}

/// Moves the dead letters of `stream` that `filter` matches (typically
/// `until` = now − age) to `target`, oldest first, `chunk` at a time: copy,
/// verify the copy, and only then delete from the stream. Entries whose copy
/// cannot be verified stay in the stream and are listed in the report.
pub fn archive(
    conn: &mut RedisConn,
    stream: &str,
    filter: &Filter,
    mut target: ArchiveTarget<'_>,
    chunk: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ArchiveReport, Error> {
    let dlq = dead_letter_stream(stream);
    let mut ids = matching_ids(conn, stream, filter)?;
    ids.reverse();
    let total = ids.len();
    let mut report = ArchiveReport {
        selected: total,
        ..ArchiveReport::default()
    };
    let mut done = 0;
    for ids in ids.chunks(chunk.max(1)) {
        let mut records = Vec::with_capacity(ids.len());
        for (id, fields) in ids.iter().zip(fetch(conn, &dlq, ids)?) {
            let Some(fields) = fields else {
                continue; // removed meanwhile: nothing to archive
            };
            let Some(map) = fields_json(&fields) else {
                report.kept.push((
                    id.clone(),
                    "two fields share a name; JSON cannot keep both".into(),
                ));
                continue;
            };
            let text = |name: &str| {
                value_in(&fields, name.as_bytes()).map(|v| no_nul(&String::from_utf8_lossy(v)))
            };
            records.push(Record {
                id: id.clone(),
                event_id: text("event_id"),
                kind: text("kind"),
                reason: text("reason"),
                fields: Value::Object(map),
            });
        }
        let verified = match &mut target {
            ArchiveTarget::Postgres(pg) => copy_to_postgres(pg, stream, &records),
            ArchiveTarget::File(path) => copy_to_file(path, stream, &records),
        }
        .map_err(|e| {
            if report.archived == 0 {
                e
            } else {
                Error::with_source(
                    e.kind(),
                    format!(
                        "stopped after archiving {} of {total} dead letters",
                        report.archived
                    ),
                    e,
                )
            }
        })?;
        let mut to_delete = Vec::with_capacity(records.len());
        for (record, ok) in records.iter().zip(verified) {
            if ok {
                to_delete.push(record.id.clone());
            } else {
                report.kept.push((
                    record.id.clone(),
                    "the archive holds a different copy, or none; not removed".into(),
                ));
            }
        }
        if let Some(first) = to_delete.first() {
            fault::hit(Point::ArchiveAfterCopy, first);
            let deleted: u64 = redis::cmd("XDEL")
                .arg(&dlq)
                .arg(&to_delete)
                .query(conn)
                .map_err(redis_error(&dlq))?;
            // Another archive of this stream running at the same time may
            // have copied and removed some of these already: the letters
            // this run archived are the ones its XDEL removed, so that
            // concurrent runs' reports add up to the letters archived.
            log::debug!(
                "{dlq}: copied {}, removed {deleted} (the rest by another run)",
                to_delete.len()
            );
            report.archived += deleted as usize;
        }
        done += ids.len();
        progress(done, total);
    }
    Ok(report)
}

/// Inserts the records (existing rows are kept) and commits, then reads them
/// back: `true` for each record whose row holds exactly its fields.
fn copy_to_postgres(
    pg: &mut postgres::Client,
    stream: &str,
    records: &[Record],
) -> Result<Vec<bool>, Error> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    let event_ids: Vec<Option<&str>> = records.iter().map(|r| r.event_id.as_deref()).collect();
    let kinds: Vec<Option<&str>> = records.iter().map(|r| r.kind.as_deref()).collect();
    let reasons: Vec<Option<&str>> = records.iter().map(|r| r.reason.as_deref()).collect();
    let fields: Vec<&Value> = records.iter().map(|r| &r.fields).collect();
    let mut tx = pg
        .transaction()
        .map_err(pg_error("archive: cannot begin a transaction"))?;
    tx.execute(
        "INSERT INTO dead_letters_archive (stream, dead_letter_id, event_id, kind, reason, fields) \
         SELECT $1, t.id, t.event_id, t.kind, t.reason, t.fields \
         FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::jsonb[]) \
              AS t(id, event_id, kind, reason, fields) \
         ON CONFLICT (stream, dead_letter_id) DO NOTHING",
        &[&stream, &ids, &event_ids, &kinds, &reasons, &fields],
    )
    .map_err(pg_error(
        "archive: cannot insert into dead_letters_archive (did `taskhub migrate` run?)",
    ))?;
    tx.commit().map_err(pg_error("archive: cannot commit"))?;
    let rows = pg
        .query(
            "SELECT dead_letter_id, fields FROM dead_letters_archive \
             WHERE stream = $1 AND dead_letter_id = ANY($2)",
            &[&stream, &ids],
        )
        .map_err(pg_error("archive: cannot read dead_letters_archive back"))?;
    let stored: HashMap<String, Value> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    Ok(records
        .iter()
        .map(|r| stored.get(&r.id) == Some(&r.fields))
        .collect())
}

fn file_error<'a>(path: &'a Path, what: &str) -> impl Fn(std::io::Error) -> Error + 'a {
    let what = what.to_owned();
    move |e| {
        Error::with_source(
            ErrorKind::Config,
            format!("archive file {}: {what}", path.display()),
            e,
        )
    }
}

/// Opens the archive file, to append (created with mode 0600: dead letters
/// carry payloads) or to read back. A symbolic link at `path` is refused
/// (`O_NOFOLLOW`): whoever can write the directory must not be able to
/// point the archive at another file.
fn open_archive(path: &Path, append: bool) -> Result<File, Error> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut options = OpenOptions::new();
    options.read(true).custom_flags(libc::O_NOFOLLOW);
    if append {
        options.create(true).append(true).mode(0o600);
    }
    options.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            Error::with_source(
                ErrorKind::Config,
                format!(
                    "archive file {}: is a symbolic link; refusing to follow it (give the real path)",
                    path.display()
                ),
                e,
            )
        } else {
            file_error(path, if append { "cannot open" } else { "cannot reopen" })(e)
        }
    })
}

/// Appends the records as JSON lines, fsyncs, then reads what was appended
/// back: `true` for each record found with exactly its fields.
fn copy_to_file(path: &Path, stream: &str, records: &[Record]) -> Result<Vec<bool>, Error> {
    if records.is_empty() {
        return Ok(Vec::new());
    }
    let created = std::fs::symlink_metadata(path).is_err();
    let mut file = open_archive(path, true)?;
    let start = file
        .metadata()
        .map_err(file_error(path, "cannot stat"))?
        .len();
    let mut buf = String::new();
    if start > 0 {
        // A line cut short by an earlier interruption must not swallow ours.
        let mut last = [0u8; 1];
        file.seek(SeekFrom::Start(start - 1))
            .and_then(|_| file.read_exact(&mut last))
            .map_err(file_error(path, "cannot read"))?;
        if last[0] != b'\n' {
            buf.push('\n');
        }
    }
    let archived_at = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
    for r in records {
        buf.push_str(&r.line(stream, &archived_at));
        buf.push('\n');
    }
    file.write_all(buf.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(file_error(path, "cannot write"))?;
    if created {
        // Make the new directory entry durable too.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(file_error(path, "cannot sync its directory"))?;
        }
    }
    // Read back through a fresh handle, from where this write began.
    let mut back = String::new();
    let mut reader = open_archive(path, false)?;
    reader
        .seek(SeekFrom::Start(start))
        .and_then(|_| reader.read_to_string(&mut back))
        .map_err(file_error(path, "cannot read back"))?;
    let mut found: HashMap<String, Value> = HashMap::new();
    for line in back.lines() {
        let Ok(Value::Object(mut doc)) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if doc.get("stream").and_then(Value::as_str) != Some(stream) {
            continue;
        }
        if let (Some(Value::String(id)), Some(fields)) =
            (doc.remove("dead_letter_id"), doc.remove("fields"))
        {
            found.insert(id, fields);
        }
    }
    Ok(records
        .iter()
        .map(|r| found.get(&r.id) == Some(&r.fields))
        .collect())
}
