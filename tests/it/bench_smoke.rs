//! A small smoke of the benchmark (examples/bench.rs, which scripts/bench.sh
//! runs at full size): it drains, verifies the effect count and prints its
//! RESULT line, in both modes, with scripted failures, with events the
//! database rejects, and under a steady load (with the rate it sustained).

use std::process::Command;
use std::time::Duration;

use crate::support::*;

fn bench_command() -> Command {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/bench");
    assert!(
        path.exists(),
        "{} is missing: cargo test builds examples",
        path.display()
    );
    Command::new(path)
}

fn bench(db: &TestDb, args: &[&str]) -> String {
    let mut cmd = bench_command();
    cmd.env("REDIS_URL", redis_url())
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "warn")
        .args(args);
    let out = output(cmd, None, Duration::from_secs(120));
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    out.stdout
}

#[test]
fn the_benchmark_drains_and_verifies_in_both_modes() {
    let db = TestDb::new();
    for mode in ["batch", "per-event"] {
        let stdout = bench(&db, &["--events", "1500", "--workers", "4", "--mode", mode]);
        let result = stdout
            .lines()
            .find(|l| l.starts_with("RESULT "))
            .expect("a RESULT line");
        assert!(result.contains("applied=1500"), "{result}");
        for key in [
            "rate=",
            "sustained=",
            "p50_ms=",
            "p99_ms=",
            "cpu_us=",
            "rss_kb=",
            "steal_pct=",
        ] {
            assert!(result.contains(key), "{key} missing: {result}");
        }
    }
    // Scripted failures: 10% fail twice, all end applied.
    let stdout = bench(
        &db,
        &[
            "--events",
            "300",
            "--fail-ratio",
            "0.1",
            "--fail-times",
            "2",
            "--backoff-base",
            "20ms",
        ],
    );
    assert!(stdout.contains("applied=300"), "{stdout}");
    assert!(stdout.contains("healthy rate"), "{stdout}");
    // The same events failing never (bench.sh's `nofail-batch`): nothing
    // retried.
    let stdout = bench(
        &db,
        &[
            "--events",
            "300",
            "--fail-ratio",
            "0.1",
            "--fail-times",
            "0",
        ],
    );
    assert!(stdout.contains("applied=300"), "{stdout}");
    assert!(stdout.contains(" retries=0 "), "{stdout}");
    // 1% the database rejects (bench.sh's `poison-batch`), once the
    // constraint that rejects them is there.
    let poison = ["--events", "500", "--poison-ratio", "0.01"];
    let mut cmd_db = db.client();
    cmd_db
        .batch_execute(
            "ALTER TABLE notifications ADD CONSTRAINT bench_poison \
             CHECK (payload NOT LIKE '%\"poison\":true%') NOT VALID",
        )
        .unwrap();
    let stdout = bench(&db, &poison);
    assert!(stdout.contains("applied=495"), "{stdout}");
    assert!(stdout.contains("(permanent=5 "), "{stdout}");
    cmd_db
        .batch_execute("ALTER TABLE notifications DROP CONSTRAINT bench_poison")
        .unwrap();
    // Steady load: 200 events/s for 2 s, each measured from its send, and
    // traced: a line per commit.
    let dir = TempDir::new("bench-trace");
    let trace = dir.0.join("trace");
    let stdout = bench(
        &db,
        &[
            "--mode",
            "per-event",
            "--rate",
            "200",
            "--duration",
            "2s",
            "--trace",
            trace.to_str().unwrap(),
        ],
    );
    assert!(stdout.contains("applied=400"), "{stdout}");
    let lines = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(lines.lines().count(), 400, "{lines}");
    assert!(lines.lines().all(|l| l.split(' ').count() == 2), "{lines}");
    assert!(stdout.contains("steady load of 200 events/s"), "{stdout}");
    assert!(stdout.contains("max_ms="), "{stdout}");
    // The rate sustained while the producer ran (bench.sh's capacity), in
    // events per second: the commits of the window (the last three
    // quarters of the producer's 2 s) are at most the 400 events, so at
    // most about 270/s; none at all would be a window that missed them.
    let figure = |name: &str| -> f64 {
        stdout
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .unwrap_or_else(|| panic!("{name} missing: {stdout}"))
            .parse()
            .unwrap()
    };
    let sustained = figure("sustained=");
    assert!(sustained > 0.0 && sustained <= 400.0, "{stdout}");
    // What the producer sent, per second, over its 2 s.
    let produced = figure("produced=");
    assert!(produced > 0.0 && produced <= 400.0, "{stdout}");
}

/// `--help` says how to run it (the README sends readers there) without
/// touching a server; an unknown flag points to it.
#[test]
fn the_benchmark_explains_its_flags() {
    let mut cmd = bench_command();
    // Nothing listens there: --help must not connect.
    cmd.env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .arg("--help");
    let out = output(cmd, None, Duration::from_secs(30));
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    // The flags scripts/bench.sh uses, each in the text.
    for flag in [
        "--events",
        "--workers",
        "--mode",
        "--sql",
        "--fail-ratio",
        "--fail-times",
        "--backoff-base",
        "--poison-ratio",
        "--rate",
        "--duration",
    ] {
        assert!(out.stdout.contains(flag), "{flag} missing:\n{}", out.stdout);
    }
    let mut cmd = bench_command();
    cmd.arg("--evnets");
    let out = output(cmd, None, Duration::from_secs(30));
    assert!(!out.status.success());
    assert!(
        out.stderr.contains("unknown flag --evnets (see --help)"),
        "{}",
        out.stderr
    );
}
