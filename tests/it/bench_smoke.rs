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
    bench_on(&redis_url(), db, args)
}

fn bench_on(redis: &str, db: &TestDb, args: &[&str]) -> String {
    let mut cmd = bench_command();
    cmd.env("REDIS_URL", redis)
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
    // traced: a line per commit; the disk probed beside it.
    let dir = TempDir::new("bench-trace");
    let trace = dir.0.join("trace");
    let probed = TempDir::new("bench-probe");
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
            "--disk-probe",
            probed.0.to_str().unwrap(),
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
    let figure = |name: &str| figure_in(&stdout, name);
    let sustained = figure("sustained=");
    assert!(sustained > 0.0 && sustained <= 400.0, "{stdout}");
    // What the producer sent, per second, over its 2 s.
    let produced = figure("produced=");
    assert!(produced > 0.0 && produced <= 400.0, "{stdout}");
    // The host's steal, sampled through the run, and the latency of the
    // flights that met none of its bursts.
    for name in ["burst_s=", "steal_max_pct=", "calm_p99_ms="] {
        figure(name);
    }
    let calm_share = figure("calm_share=");
    assert!((0.0..=100.0).contains(&calm_share), "{stdout}");
    // The disk's stalls, in the RESULT line (bench.sh reads them there):
    // how many, how long in all, the longest; the probe left no file.
    let result = stdout
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line: {stdout}"));
    let in_result = |name: &str| figure_in(result, name);
    let stalls = in_result("stalls=");
    let (stall_s, stall_max_ms) = (in_result("stall_s="), in_result("stall_max_ms="));
    // (stall_s to the hundredth: within 5 ms.)
    assert!(stall_max_ms <= stall_s * 1000.0 + 5.0, "{result}");
    assert!(stalls == 0.0 || stall_max_ms >= 5.0, "{result}");
    assert_eq!(std::fs::read_dir(&probed.0).unwrap().count(), 0);
}

/// The figure `name` ("sustained=", ...) of the benchmark's `text`: its
/// first word that starts with the name.
fn figure_in(text: &str, name: &str) -> f64 {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(name))
        .unwrap_or_else(|| panic!("{name} missing: {text}"))
        .parse()
        .unwrap()
}

/// `--presize` (bench.sh's steady runs): Redis's tables of keys are sized
/// for the run's markers before the clock starts, so none of them grows
/// while the markers come (a growing table is slow for about a second at
/// each doubling), and its placeholders go with the run's other keys.
#[test]
fn a_presized_steady_run_adds_its_markers_without_growing_a_table_of_redis() {
    // A Redis of its own, with 3,500 keys of another user (no TTL: only in
    // the table of every key), and DEBUG HTSTATS to show its tables' sizes.
    // No rehashing on its timer: only commands move a table into a bigger
    // one, so a move the bench left unfinished is still under way when the
    // markers come.
    let redis =
        PrivateRedis::start_with(&["--enable-debug-command", "yes", "--activerehashing", "no"]);
    let db = TestDb::new();
    let mut watch = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let others = 3_500u64;
    redis::Script::new("for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'other:' .. i, 1) end")
        .arg(others)
        .invoke::<()>(&mut watch)
        .unwrap();
    // 500 events/s for 2 s: 1,000 markers, sized for 500 x 2 x 1.1 + 1,000.
    // The power of two above 3,500 + 2,100 is 8,192, and one more
    // placeholder makes both tables 16,384: room for the markers, which
    // 4,097 placeholders (the keys already there left out) would not leave.
    let fill = 8_193;
    let (stdout, samples) = std::thread::scope(|scope| {
        let (url, db) = (redis.url(), &db);
        let run = scope.spawn(move || {
            bench_on(
                &url,
                db,
                &["--rate", "500", "--duration", "2s", "--presize"],
            )
        });
        // (keys, the tables' sizes, whether one is being moved into a
        // bigger one), from the run's first key after the placeholders
        // (the bench finishes moving them into the bigger tables first).
        let mut samples = Vec::new();
        while !run.is_finished() {
            let keys: u64 = redis::cmd("DBSIZE").query(&mut watch).unwrap();
            let stats: String = redis::cmd("DEBUG")
                .arg("HTSTATS")
                .arg(0)
                .query(&mut watch)
                .unwrap();
            if keys > others + fill {
                let sizes: Vec<u64> = stats
                    .lines()
                    .filter_map(|l| l.trim().strip_prefix("table size: "))
                    .map(|n| n.parse().unwrap())
                    .collect();
                samples.push((keys, sizes, stats.contains("rehashing")));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        (run.join().unwrap(), samples)
    });
    assert!(
        stdout.contains(&format!("presized          {fill} placeholder keys")),
        "{stdout}"
    );
    assert!(stdout.contains("applied=1000"), "{stdout}");
    // Seen while the markers came (at least 500 of them), on tables of
    // 16,384 slots (every key, and those with a TTL) that neither grew nor
    // moved.
    let most = samples.iter().map(|s| s.0).max().unwrap_or(0);
    assert!(most > others + fill + 500, "{samples:?}");
    for (keys, sizes, moving) in &samples {
        assert_eq!(sizes, &[16_384, 16_384], "at {keys} keys: {samples:?}");
        assert!(!moving, "at {keys} keys: {samples:?}");
    }
    // Placeholders, stream and markers are gone with the run.
    let keys: u64 = redis::cmd("DBSIZE").query(&mut watch).unwrap();
    assert_eq!(keys, others);
}

/// The rule that `--calm-latency` (and each steady run) applies: a flight
/// that met a burst (a 100 ms sample with over 5% of the machine's CPU
/// time taken by the host) or a stall of the disk, even by its first or
/// last microsecond, is not calm; one that ended before it or began after
/// it is. `--watch-steal` writes samples (and `--disk-probe` stalls) in the
/// form it reads.
#[test]
fn the_benchmark_leaves_out_only_the_flights_that_met_a_burst_or_a_stall() {
    let dir = TempDir::new("bench-steal");
    let calm = |name: &str, samples: &str, flights: &[u8]| -> String {
        let path = dir.0.join(name);
        std::fs::write(&path, samples).unwrap();
        let mut cmd = bench_command();
        cmd.arg("--calm-latency").arg(&path);
        let out = output(cmd, Some(flights), Duration::from_secs(30));
        assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
        out.stdout
    };
    // Calm, a burst from 1,000,100 to 1,000,200 µs, calm again.
    let steal = "1000000 1000100 0.0\n1000100 1000200 25.0\n1000200 1000300 5.0\n";
    // (end, latency): before it, through it, ending at its start, starting
    // at its end, after it; the latencies say which is which.
    let flights = b"1000090 10\n1000250 200\n1000100 5\n1000300 100\n1000290 20\n";
    let stdout = calm("steal", steal, flights);
    // The calm flights are the 10 µs and 20 µs ones: 2 of 5.
    assert!(stdout.contains("calm_share=40 "), "{stdout}");
    assert!(stdout.contains("calm_max_ms=0.02 "), "{stdout}");
    assert!(stdout.contains("burst_s=0.0 steal_max_pct=25"), "{stdout}");
    // Not probed: no stall figures.
    assert!(!stdout.contains("stall"), "{stdout}");

    // The same, and two stalls of the disk (since the probe's last sync
    // before each): one the 10 µs flight met by its last microsecond, one
    // within the burst, which the 200 µs flight met already.
    let stalls = "probed\nstall 1000090 1000091 1000095\nstall 1000150 1000150 1000160\n";
    let stdout = calm("probed", &format!("{steal}{stalls}"), flights);
    // Only the 20 µs flight is calm: 1 of 5.
    assert!(stdout.contains("calm_share=20 "), "{stdout}");
    assert!(stdout.contains("calm_max_ms=0.02 "), "{stdout}");
    assert!(
        stdout.contains("stalls=2 stall_s=0.00 stall_max_ms=0.0"),
        "{stdout}"
    );
    // A stall within a burst is the burst's: a flight in the burst after
    // the stall is not calm either (the two are joined in time order).
    let within = format!("{steal}probed\nstall 1000150 1000150 1000160\n");
    let stdout = calm("within", &within, b"1000180 10\n1000290 20\n");
    assert!(stdout.contains("calm_share=50 "), "{stdout}");

    let mut cmd = bench_command();
    let watched = dir.0.join("watched");
    let probe_dir = TempDir::new("bench-watch-probe");
    cmd.arg("--watch-steal")
        .arg(&watched)
        .args(["--duration", "350ms", "--disk-probe"])
        .arg(&probe_dir.0);
    let out = output(cmd, None, Duration::from_secs(30));
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    let text = std::fs::read_to_string(&watched).unwrap();
    let (samples, probe): (Vec<&str>, Vec<&str>) = text
        .lines()
        .partition(|l| !l.starts_with("probed") && !l.starts_with("stall "));
    let lines: Vec<Vec<f64>> = samples
        .iter()
        .map(|l| l.split(' ').map(|v| v.parse().unwrap()).collect())
        .collect();
    assert!((2..=4).contains(&lines.len()), "{text}");
    assert!(lines.iter().all(|l| l.len() == 3 && l[0] < l[1]), "{text}");
    assert_eq!(probe.first(), Some(&"probed"), "{text}");
    assert_eq!(std::fs::read_dir(&probe_dir.0).unwrap().count(), 0);

    // A directory the probe cannot write in fails at once, saying so.
    let mut cmd = bench_command();
    cmd.arg("--watch-steal")
        .arg(dir.0.join("unused"))
        .args(["--duration", "10s", "--disk-probe"])
        .arg(dir.0.join("no such directory"));
    let out = output(cmd, None, Duration::from_secs(5));
    assert!(!out.status.success());
    assert!(out.stderr.contains("--disk-probe "), "{}", out.stderr);
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
        "--presize",
        "--disk-probe",
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

/// Redis gone in the middle of a steady run: the producer's next send
/// fails, and the benchmark says so and ends (it waited for ever for the
/// worker, which waits out the outage, and for its steal sampler and disk
/// probe, which run until the worker ends).
#[test]
fn a_steady_run_whose_redis_goes_away_ends_with_its_error() {
    let mut redis = PrivateRedis::start();
    let db = TestDb::new();
    let probed = TempDir::new("bench-lost-redis");
    let mut cmd = bench_command();
    cmd.env("REDIS_URL", redis.url())
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "error")
        .args(["--mode", "batch", "--rate", "200", "--duration", "60s"])
        .arg("--disk-probe")
        .arg(&probed.0);
    let mut bench = Proc::spawn(cmd);
    // Its first events committed: the steady load is under way. (A
    // marker, not the consumer's record `th:c:...` or the runs of a
    // redelivered entry `th:r:...`: the consumer's record is written before the worker is
    // ready, and Redis stopped then made this test wait for the producer,
    // which had not begun.)
    let mut check = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("th:*")
                .query(&mut check)
                .unwrap_or_default();
            keys.iter()
                .any(|k| !k.starts_with("th:c:") && !k.starts_with("th:r:"))
        }),
        "no marker written\n{}",
        bench.stderr()
    );
    redis.stop();
    let status = bench.wait(Duration::from_secs(60));
    assert!(!status.success(), "{}\n{}", bench.stdout(), bench.stderr());
    assert!(bench.stderr().contains("Error"), "{}", bench.stderr());
    assert_eq!(std::fs::read_dir(&probed.0).unwrap().count(), 0);
}

/// `scripts/instructions.sh` (the README's repeatable measure of our CPU
/// per event) counts a run's instructions with valgrind and prints them per
/// event, in both modes; a mode it does not know, or a run that did not
/// apply every event, is an error, not a figure. It takes nothing away
/// from the database it is given (it emptied its tables: run with the
/// `DATABASE_URL` of a deployment, it forgot which events were applied).
#[test]
fn the_instruction_count_runs_in_both_modes() {
    let db = TestDb::new();
    let bench = bench_command().get_program().to_owned();
    let run = |args: &[&str]| {
        let mut cmd = Command::new("bash");
        cmd.arg(repo_path("scripts/instructions.sh"))
            .args(args)
            .env("BENCH_BIN", &bench)
            .env("DATABASE_URL", &db.url)
            .env("REDIS_URL", redis_url());
        output(cmd, None, Duration::from_secs(300))
    };
    for mode in ["batch", "per-event"] {
        let out = run(&[mode, "300"]);
        assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
        let figure = out
            .stdout
            .strip_prefix("instructions per event: ")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok());
        // A run of the worker takes thousands of instructions per event;
        // a count of the main thread alone, or of nothing, would not.
        assert!(
            figure.is_some_and(|n| n > 1_000),
            "no count in: {}",
            out.stdout
        );
        assert!(out.stdout.contains(&format!("({mode}, 300 events")));
        // A deployment's record, there before the next run.
        db.client()
            .execute(
                "INSERT INTO processed_events (scope, event_id) VALUES ('deployed', $1)",
                &[&mode],
            )
            .unwrap();
    }
    let kept = "SELECT count(*) FROM processed_events WHERE scope = 'deployed'";
    // One row after each run: the per-event run left the first one.
    assert_eq!(
        db.count(kept),
        2,
        "the per-event run took the row before it"
    );
    let out = run(&["fast"]);
    assert_eq!(out.status.code(), Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("not 'fast'"), "{}", out.stderr);
}

/// `scripts/bench.sh` refuses a private PostgreSQL asked for on tmpfs,
/// where its commits would wait for no disk (the README, "Which database
/// it measures"): exit 2 with the reason, before anything is built or
/// measured, and no directory of it left behind.
#[test]
fn the_benchmark_refuses_a_private_postgresql_on_tmpfs() {
    let shm = std::path::Path::new("/dev/shm");
    let kind = Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(shm)
        .output();
    let on_tmpfs = kind.is_ok_and(|k| String::from_utf8_lossy(&k.stdout).trim() == "tmpfs");
    assert!(on_tmpfs, "this test needs /dev/shm on tmpfs, as on Linux");
    let dir = TempDir(shm.join(unique("bench-tmpfs")));
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg(repo_path("scripts/bench.sh"))
        .env("PG_PRIVATE", "max_wal_size=16GB")
        .env("TMPDIR", &dir.0);
    let out = output(cmd, None, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2), "{}\n{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("is on tmpfs"), "{}", out.stderr);
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 0);
}

/// `scripts/services.sh` with `TASKHUB_SERVICES=redis` (what bench.sh uses
/// beside a private PostgreSQL) sees to Redis alone and says nothing of
/// PostgreSQL; a value it does not know is refused with exit 2.
#[test]
fn the_services_script_sees_to_redis_alone_or_refuses_what_it_does_not_know() {
    let services = |which: &str| {
        let mut cmd = Command::new("bash");
        cmd.arg(repo_path("scripts/services.sh"))
            .env("TASKHUB_SERVICES", which);
        output(cmd, None, Duration::from_secs(60))
    };
    let redis = services("redis");
    assert_eq!(
        redis.status.code(),
        Some(0),
        "{}\n{}",
        redis.stdout,
        redis.stderr
    );
    assert!(redis.stdout.contains("redis:"), "{}", redis.stdout);
    assert!(!redis.stdout.contains("postgres:"), "{}", redis.stdout);
    let unknown = services("pg");
    assert_eq!(
        unknown.status.code(),
        Some(2),
        "{}\n{}",
        unknown.stdout,
        unknown.stderr
    );
    assert!(
        unknown.stderr.contains("must be 'redis' or 'both'"),
        "{}",
        unknown.stderr
    );
}
