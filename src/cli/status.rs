//! `taskhub status`: where each stream and its group stand, as a table or
//! as one JSON object per stream and group.

use std::process::ExitCode;

use clap::Args;
use serde_json::json;
use taskhub::GroupStatus;

use super::format::one_line;
use super::servers::Servers;
use super::{print, report, table};

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Stream to look at (repeat for several).
    #[arg(
        long,
        default_value = "tasks:events",
        env = "TASKHUB_STREAM",
        value_delimiter = ','
    )]
    pub stream: Vec<String>,
    /// Consumer group.
    #[arg(long, default_value = "workers", env = "TASKHUB_GROUP")]
    pub group: String,
    /// One JSON object per stream and group per line, instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Prints each stream's status; exit 1 when one of them (or its group) is
/// missing, after printing the others.
pub fn status(servers: &Servers, args: StatusArgs) -> Result<ExitCode, String> {
    let mut code = ExitCode::SUCCESS;
    let mut out = String::new();
    for stream in &args.stream {
        let found = taskhub::status(
            &servers.redis_url,
            &servers.redis_tls(),
            std::slice::from_ref(stream),
            &args.group,
        );
        match found {
            Ok(list) => {
                for s in &list {
                    out.push_str(&if args.json { json_line(s) } else { text(s) });
                }
            }
            Err(e) if e.kind() == taskhub::ErrorKind::Config => {
                eprintln!("taskhub: {}", report(&e));
                code = ExitCode::FAILURE;
            }
            Err(e) => return Err(report(&e)),
        }
    }
    print(&out)?;
    Ok(code)
}

fn json_line(s: &GroupStatus) -> String {
    let consumers: Vec<serde_json::Value> = s
        .consumers
        .iter()
        .map(|c| json!({"name": c.name, "pending": c.pending, "idle_seconds": c.idle.as_secs()}))
        .collect();
    let doc = json!({
        "stream": s.stream,
        "group": s.group,
        "length": s.length,
        "last_id": s.last_id,
        "lag": s.lag,
        "pending": s.pending,
        "oldest_pending_seconds": s.oldest_pending.map(|d| d.as_secs()),
        "redelivered": s.redelivered,
        "dead_letters": s.dead_letters,
        "other_groups": s.other_groups,
        "consumers": consumers,
    });
    format!("{doc}\n")
}

/// `text` as one shell word: as it is when it is plain, else in single
/// quotes (control characters shown escaped).
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@{}+=,".contains(&b));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", one_line(text, 200).replace('\'', "'\\''"))
    }
}

fn secs(d: std::time::Duration) -> String {
    humantime::format_duration(std::time::Duration::from_secs(d.as_secs())).to_string()
}

fn text(s: &GroupStatus) -> String {
    let mut out = format!(
        "{} (group {})\n",
        one_line(&s.stream, 200),
        one_line(&s.group, 200)
    );
    let rows = vec![vec![
        s.length.to_string(),
        s.lag.map_or("?".into(), |n| n.to_string()),
        s.pending.to_string(),
        s.oldest_pending.map_or("-".into(), secs),
        s.redelivered.to_string(),
        s.dead_letters.to_string(),
        s.last_id.clone(),
    ]];
    out.push_str(&table(
        &[
            "LENGTH",
            "LAG",
            "PENDING",
            "OLDEST PENDING",
            "REDELIVERED",
            "DEAD LETTERS",
            "LAST ID",
        ],
        &rows,
    ));
    if !s.other_groups.is_empty() {
        // Group names are anyone's text: no terminal escapes through.
        let others: Vec<String> = s.other_groups.iter().map(|g| one_line(g, 100)).collect();
        out.push_str(&format!(
            "DEAD LETTERS are every group's: the stream is also read by {}; \
             `taskhub dlq --stream {} --group {} stats` counts this group's\n",
            others.join(", "),
            shell_word(&s.stream),
            shell_word(&s.group)
        ));
    }
    if !s.consumers.is_empty() {
        let rows: Vec<Vec<String>> = s
            .consumers
            .iter()
            .map(|c| vec![one_line(&c.name, 100), c.pending.to_string(), secs(c.idle)])
            .collect();
        out.push_str(&table(&["CONSUMER", "PENDING", "IDLE"], &rows));
    }
    out.push('\n');
    out
}
