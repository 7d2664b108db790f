//! The learners' examples reproduce the book's three demonstrations against
//! real servers; these tests run them and check what they print.

use std::path::PathBuf;
use std::process::Command;

use crate::support::*;

/// `cargo test` builds the examples next to the test binaries.
fn example(name: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let dir: PathBuf = exe.parent().unwrap().parent().unwrap().join("examples");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: cargo test builds examples",
        path.display()
    );
    Command::new(path)
}

fn run(name: &str) -> String {
    let db = TestDb::new();
    let out = example(name)
        .env("REDIS_URL", redis_url())
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn idem_three_deliveries_one_effect() {
    assert_eq!(
        run("idem"),
        "第 1 次: 首次处理，执行业务副作用\n\
         第 2 次: 已处理过，跳过（幂等）\n\
         第 3 次: 已处理过，跳过（幂等）\n\
         processed_events 行数 = 1\n"
    );
}

#[test]
fn txidem_failed_effect_rolls_back_the_dedup_record() {
    assert_eq!(
        run("txidem"),
        "副作用失败: err=副作用失败，整体回滚\n\
         回滚后 processed_events=0 notifications=0\n\
         重投成功: err=<nil>\n\
         提交后 processed_events=1 notifications=1\n\
         重复投递后 notifications=1（未重复）\n"
    );
}

#[test]
fn dlq_retries_with_backoff_then_dead_letters() {
    let out = run("dlq");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        &lines[..5],
        [
            "msg-2 第 1 次失败(downstream 500)，退避 20ms",
            "msg-2 第 2 次失败(downstream 500)，退避 40ms",
            "msg-2 第 3 次失败(downstream 500)，退避 80ms",
            "msg-2 超过重试上限 -> 进死信",
            "死信条数 = 1",
        ]
    );
    assert_eq!(lines.len(), 6, "{out}");
    assert!(lines[5].starts_with("  DLQ "), "{out}");
    assert!(
        lines[5].ends_with(" map[id:msg-2 reason:downstream 500]"),
        "{out}"
    );
}

/// `scripts/demo.sh` shows the point from a fresh stream: duplicates
/// skipped, flaky events retried, poison ones dead-lettered, fixed and
/// replayed, and ends with its verdict (here with the test build of the
/// binary and a smaller mix).
#[test]
fn the_demo_ends_with_an_ok_verdict() {
    let db = TestDb::new();
    let mut cmd = Command::new("bash");
    cmd.arg(repo_path("scripts/demo.sh"))
        .env("DEMO_BIN", env!("CARGO_BIN_EXE_taskhub"))
        .env("DEMO_COUNT", "200")
        .env("DEMO_PORT", free_port().to_string())
        .env("REDIS_URL", redis_url())
        .env("DATABASE_URL", &db.url);
    let out = output(cmd, None, std::time::Duration::from_secs(120));
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    let verdict = out.stdout.lines().last().unwrap_or_default();
    assert!(
        verdict.starts_with("VERDICT: OK — 235 events applied exactly once: 50 duplicates skipped, 50 retries, 10 dead letters replayed"),
        "{}",
        out.stdout
    );
}
