//! Shared test support: unique names, a fresh database per test, private
//! Redis and PostgreSQL servers for tests that stop or kill them, and the
//! binary as a subprocess.
//!
//! Tests run in parallel: each one uses its own stream names and its own
//! database, so they never see each other. Tests that stop, restart or kill a
//! server start a private one on a free port and never touch the shared ones.

#![allow(dead_code)] // each test file uses a different part of this module

pub mod browser;
pub mod certs;
pub mod cluster;
pub mod downstream;
pub mod proxy;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The shared Redis of the machine (never stopped by tests).
pub fn redis_url() -> String {
    std::env::var("TASKHUB_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A URL of the shared PostgreSQL server, database `postgres`, for creating
/// test databases.
pub fn pg_admin_url() -> String {
    std::env::var("TASKHUB_TEST_PG_URL")
        // The password is the one scripts/services.sh sets on a fresh
        // install; servers with trust authentication ignore it.
        .unwrap_or_else(|_| "postgres://postgres:taskhub@127.0.0.1:5432/postgres".into())
}

/// The commit mode under test: `TASKHUB_MODE` (`batch` or `per-event`),
/// batch by default. Binary runs inherit the variable; in-process workers
/// pass this to `Builder::mode`.
pub fn mode() -> taskhub::Mode {
    std::env::var("TASKHUB_MODE")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(taskhub::Mode::Batch)
}

/// A worker of `group` on `stream` with fast timings for tests: consumer
/// `c1`, 2 workers, 16-entry batches, 10–100 ms backoff, reclaim every
/// 500 ms of entries idle for 10 s; TASKHUB_MODE picks the mode.
pub fn fast_builder(redis_url: &str, db_url: &str, stream: &str, group: &str) -> taskhub::Builder {
    taskhub::Worker::builder()
        .mode(mode())
        .redis_url(redis_url)
        .database_url(db_url)
        .stream(stream)
        .group(group)
        .consumer("c1")
        .workers(2)
        .count(16)
        .block(Duration::from_millis(200))
        .backoff_base(Duration::from_millis(10))
        .backoff_cap(Duration::from_millis(100))
        .max_retry_after(Duration::from_secs(5))
        .reclaim_interval(Duration::from_millis(500))
        .reclaim_min_idle(Duration::from_secs(10))
        .shutdown_timeout(Duration::from_secs(15))
}

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}_{}_{}_{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Polls `f` every 20 ms until it is true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh database with the migrations applied, dropped at the end.
pub struct TestDb {
    pub name: String,
    pub url: String,
    admin_url: String,
}

impl TestDb {
    /// On the shared server.
    pub fn new() -> TestDb {
        TestDb::on(&pg_admin_url())
    }

    /// On the server of `admin_url` (a URL whose database can be replaced).
    pub fn on(admin_url: &str) -> TestDb {
        let name = unique("taskhub_test").to_lowercase();
        let mut admin = postgres::Client::connect(admin_url, postgres::NoTls)
            .unwrap_or_else(|e| panic!("cannot connect to {admin_url}: {e}"));
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        let url = replace_db(admin_url, &name);
        taskhub::migrate(&url).expect("migrations apply");
        TestDb {
            name,
            url,
            admin_url: admin_url.to_owned(),
        }
    }

    /// Drops the database and creates it again under the same name, with the
    /// migrations applied: a staging reset.
    pub fn recreate(&self) {
        let mut admin = postgres::Client::connect(&self.admin_url, postgres::NoTls).unwrap();
        for sql in ["DROP DATABASE {} WITH (FORCE)", "CREATE DATABASE {}"] {
            admin.batch_execute(&sql.replace("{}", &self.name)).unwrap();
        }
        taskhub::migrate(&self.url).expect("migrations apply");
    }

    /// Runs `sql` on the admin connection (database `postgres`), where
    /// `ALTER DATABASE` and `pg_terminate_backend` of this database's
    /// sessions can be run.
    pub fn admin(&self, sql: &str) {
        let mut admin = postgres::Client::connect(&self.admin_url, postgres::NoTls).unwrap();
        admin.batch_execute(sql).unwrap();
    }

    /// Ends every session on this database except the admin's own, as a
    /// failover or a server restart would.
    pub fn terminate_sessions(&self) {
        self.admin(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = '{}' AND pid <> pg_backend_pid()",
            self.name
        ));
    }

    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url, postgres::NoTls).unwrap()
    }

    /// Runs a query returning one bigint.
    pub fn count(&self, sql: &str) -> i64 {
        self.client().query_one(sql, &[]).unwrap().get(0)
    }

    /// Effect rows per event_id, for all of `notifications`.
    pub fn effect_counts(&self) -> std::collections::HashMap<String, i64> {
        self.client()
            .query(
                "SELECT event_id, count(*) FROM notifications GROUP BY event_id",
                &[],
            )
            .unwrap()
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    /// Effect rows for `event_id` in `notifications`.
    pub fn effects(&self, event_id: &str) -> i64 {
        self.client()
            .query_one(
                "SELECT count(*) FROM notifications WHERE event_id = $1",
                &[&event_id],
            )
            .unwrap()
            .get(0)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Ok(mut admin) = postgres::Client::connect(&self.admin_url, postgres::NoTls) {
            let _ = admin.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

/// `url` with its database name replaced by `db`.
pub fn replace_db(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let cut = base.rfind('/').expect("URL has a path");
    format!("{}/{db}{query}", &base[..cut])
}

pub fn redis(url: &str) -> redis::Connection {
    let conn = redis::Client::open(url).unwrap().get_connection().unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn
}

/// XADD of string fields; returns the entry id.
pub fn xadd(conn: &mut dyn redis::ConnectionLike, stream: &str, fields: &[(&str, &str)]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query(conn).unwrap()
}

/// Entries pending in `group` (all consumers); 0 when the group is missing.
pub fn pending(conn: &mut dyn redis::ConnectionLike, stream: &str, group: &str) -> u64 {
    let reply: redis::RedisResult<Vec<redis::Value>> =
        redis::cmd("XPENDING").arg(stream).arg(group).query(conn);
    match reply.as_deref() {
        Ok([redis::Value::Int(n), ..]) => *n as u64,
        _ => 0,
    }
}

/// Pending entries of the group: (entry id, consumer, delivery count).
pub fn pending_entries(
    conn: &mut dyn redis::ConnectionLike,
    stream: &str,
    group: &str,
) -> Vec<(String, String, u64)> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(100_000)
        .query(conn)
        .unwrap();
    rows.into_iter()
        .map(|(id, consumer, _idle, count)| (id, consumer, count))
        .collect()
}

pub fn xlen(conn: &mut dyn redis::ConnectionLike, stream: &str) -> u64 {
    redis::cmd("XLEN").arg(stream).query(conn).unwrap()
}

/// The dead letters of `stream`, decoded.
pub fn dead_letters(
    conn: &mut dyn redis::ConnectionLike,
    stream: &str,
) -> Vec<taskhub::DeadLetter> {
    let rows: Vec<(String, taskhub::Fields)> = redis::cmd("XRANGE")
        .arg(taskhub::dlq::dead_letter_stream(stream))
        .arg("-")
        .arg("+")
        .query(conn)
        .unwrap();
    rows.into_iter()
        .map(|(id, fields)| taskhub::DeadLetter::from_fields(Some(id), &fields).unwrap())
        .collect()
}

/// A free TCP port on loopback, below the kernel's ephemeral range
/// (32768 and up): a private server restarted on the same port must not find
/// it taken by some client socket meanwhile.
pub fn free_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = u64::from(std::process::id()) * 7919 + NEXT.fetch_add(1, Ordering::SeqCst) * 104_729;
    for i in 0..1000u64 {
        let port = 20_000 + ((seed + i * 7_877) % 12_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `taskhub` binary, with the servers given.
pub fn taskhub(redis_url: &str, database_url: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_taskhub"));
    cmd.env("REDIS_URL", redis_url)
        .env("DATABASE_URL", database_url)
        .env_remove("TASKHUB_FAULT")
        .env(
            "RUST_LOG",
            std::env::var("TASKHUB_TEST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null());
    cmd
}

/// A running `taskhub` child whose stderr and stdout are collected.
pub struct Proc {
    pub child: Child,
    stderr: Arc<Mutex<String>>,
    stdout: Arc<Mutex<String>>,
}

fn collect(stream: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let mut s = into.lock().unwrap();
            s.push_str(&String::from_utf8_lossy(&line));
            s.push('\n');
        }
    });
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("taskhub starts");
        let stderr = Arc::new(Mutex::new(String::new()));
        let stdout = Arc::new(Mutex::new(String::new()));
        collect(child.stderr.take().unwrap(), stderr.clone());
        collect(child.stdout.take().unwrap(), stdout.clone());
        Proc {
            child,
            stderr,
            stdout,
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    /// Waits until stderr contains `needle`.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> bool {
        wait_until(timeout, || self.stderr().contains(needle))
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by name (TERM, INT) with the `kill` command.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the exit, at most `timeout`; kills on timeout and panics.
    pub fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the collector threads catch up with the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return status;
            }
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "taskhub did not exit within {timeout:?}\nstderr:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A temporary directory removed at the end.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let dir = std::env::temp_dir().join(unique(prefix));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A private `redis-server` on a free port, with AOF (`appendfsync always`)
/// so a restart keeps everything.
pub struct PrivateRedis {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl PrivateRedis {
    pub fn start() -> PrivateRedis {
        let mut r = PrivateRedis {
            port: free_port(),
            dir: TempDir::new("taskhub-redis"),
            child: None,
        };
        r.start_again();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and directory.
    pub fn start_again(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--dir", self.dir.0.to_str().unwrap()])
            .args([
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/test.sh installs it)");
        self.child = Some(child);
        let url = self.url();
        assert!(
            wait_until(Duration::from_secs(10), || redis::Client::open(
                url.as_str()
            )
            .and_then(|c| c.get_connection())
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()),
            "private redis did not start"
        );
    }

    /// Stops the server (SIGKILL: like a crash; AOF always keeps the data).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The directory with initdb and pg_ctl.
fn pg_bin() -> PathBuf {
    if let Ok(dir) = std::env::var("TASKHUB_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
        .pop()
        .filter(|p| p.join("initdb").exists())
        .unwrap_or_else(|| PathBuf::from("/usr/bin"))
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Runs a PostgreSQL tool, as user `postgres` when we are root (initdb and
/// pg_ctl refuse to run as root).
fn pg_tool(tool: &str, args: &[&str]) -> std::process::Output {
    let path = pg_bin().join(tool);
    let mut cmd = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&path);
        c
    } else {
        Command::new(&path)
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .output()
        .expect("PostgreSQL tools are installed")
}

/// A private PostgreSQL (initdb + pg_ctl in a temporary directory, free port,
/// trust auth).
pub struct PrivatePostgres {
    pub port: u16,
    dir: TempDir,
    running: bool,
    /// Extra `-c name=value` settings given to the server.
    extra: Vec<String>,
}

impl PrivatePostgres {
    pub fn start() -> PrivatePostgres {
        PrivatePostgres::start_with(&[], None)
    }

    /// With extra server settings (`name=value`, given as `-c name=value`;
    /// no spaces) and, when given, these lines as the whole `pg_hba.conf`.
    pub fn start_with(settings: &[&str], hba: Option<&str>) -> PrivatePostgres {
        let dir = TempDir::new("taskhub-pg");
        if is_root() {
            Command::new("chown")
                .args(["-R", "postgres", dir.0.to_str().unwrap()])
                .status()
                .unwrap();
        }
        let data = dir.0.join("data");
        let out = pg_tool(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if let Some(hba) = hba {
            // Rewriting the file keeps its owner (postgres when we are root).
            std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        }
        let mut pg = PrivatePostgres {
            port: free_port(),
            dir,
            running: false,
            extra: settings.iter().map(|s| format!(" -c {s}")).collect(),
        };
        pg.start_again();
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.0.join("data")
    }

    /// URL of database `db`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The directory of the server's Unix socket (a `host=` for libpq-style
    /// connection strings).
    pub fn socket_dir(&self) -> &Path {
        &self.dir.0
    }

    pub fn start_again(&mut self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100{}",
            self.port,
            self.dir.0.display(),
            self.extra.concat()
        );
        let log = self.dir.0.join("log");
        let out = pg_tool(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-o",
                &opts,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "30",
                "start",
            ],
        );
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.running = true;
    }

    /// Stops the server (immediate mode: like a crash).
    pub fn stop(&mut self) {
        if self.running {
            let _ = pg_tool(
                "pg_ctl",
                &[
                    "-D",
                    self.data().to_str().unwrap(),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
            );
            self.running = false;
        }
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Path of a file in the repository.
pub fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// What a finished command left behind.
pub struct Out {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// Runs `cmd` to the end with `stdin` as input, at most `timeout` (killed and
/// panics after that).
/// Runs `cmd` to the end with `stdin` as its input, at most `timeout`
/// (killed, and the test panics, after that).
pub fn output(mut cmd: Command, stdin: Option<&[u8]>, timeout: Duration) -> Out {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().expect("taskhub starts");
    let grab = |mut s: Box<dyn Read + Send>| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let b = buf.clone();
        let t = std::thread::spawn(move || {
            let mut all = Vec::new();
            let _ = s.read_to_end(&mut all);
            *b.lock().unwrap() = all;
        });
        (buf, t)
    };
    let (out, out_t) = grab(Box::new(child.stdout.take().unwrap()));
    let (err, err_t) = grab(Box::new(child.stderr.take().unwrap()));
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().unwrap();
        pipe.write_all(input).unwrap();
    }
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} did not exit within {timeout:?}; stderr:\n{}",
                String::from_utf8_lossy(&err.lock().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    out_t.join().unwrap();
    err_t.join().unwrap();
    let text = |b: &Arc<Mutex<Vec<u8>>>| String::from_utf8_lossy(&b.lock().unwrap()).into_owned();
    Out {
        status,
        stdout: text(&out),
        stderr: text(&err),
        took,
    }
}

impl Out {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// The stdout as one JSON document.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}):\n{}", self.stdout))
    }
}

/// A `--sql` statement that fails permanently (SQLSTATE 22P02) for a
/// payload that is not an integer: dead letters on demand.
pub const INT_SQL: &str =
    "INSERT INTO notifications (event_id, payload) VALUES ($1, $2::text::int::text)";

/// `taskhub run` on `stream` with a group (and so a marker scope) named
/// after it, polling every 100 ms; add the flags a test needs.
pub fn run_on(db_url: &str, stream: &str) -> Command {
    let mut cmd = taskhub(&redis_url(), db_url);
    cmd.args([
        "run",
        "--stream",
        stream,
        "--group",
        stream,
        "--block-ms",
        "100",
    ]);
    cmd
}

/// Parses the summary line `read=.. applied=.. duplicates=.. ... (permanent=..
/// ...) reclaimed=..` (the last such line of `stdout`).
pub fn parse_summary(stdout: &str) -> std::collections::BTreeMap<String, u64> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.contains("applied="))
        .unwrap_or_else(|| panic!("no summary line on stdout:\n{stdout}"));
    line.split_whitespace()
        .filter_map(|tok| {
            let tok = tok.trim_matches(|c| c == '(' || c == ')');
            let (k, v) = tok.split_once('=')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// A library `Worker` running on its own thread, stopped (bounded) when
/// dropped so a failed assertion never leaves one running.
pub struct Running {
    stop: taskhub::Shutdown,
    handle: Option<std::thread::JoinHandle<Result<taskhub::Summary, taskhub::Error>>>,
}

impl Running {
    pub fn start(builder: taskhub::Builder, handler: impl taskhub::Handler) -> Running {
        let worker = builder.build(handler).expect("valid configuration");
        let stop = worker.shutdown_handle();
        let handle = std::thread::Builder::new()
            .name("test-worker-run".into())
            .spawn(move || worker.run())
            .unwrap();
        Running {
            stop,
            handle: Some(handle),
        }
    }

    /// Waits at most `timeout` for `run()` to return by itself (with
    /// `until_idle`); panics (after stopping it) on timeout or failure.
    pub fn join(mut self, timeout: Duration) -> taskhub::Summary {
        let handle = self.handle.take().unwrap();
        if !wait_until(timeout, || handle.is_finished()) {
            self.stop.shutdown();
            wait_until(Duration::from_secs(20), || handle.is_finished());
            panic!("run() did not finish by itself within {timeout:?}");
        }
        match handle.join() {
            Ok(Ok(summary)) => summary,
            Ok(Err(e)) => panic!("run() failed: {e}"),
            Err(_) => panic!("run() panicked"),
        }
    }

    /// Asks for a graceful stop and waits (bounded) for `run()` to return.
    pub fn stop(self) -> taskhub::Summary {
        self.stop.shutdown();
        self.join(Duration::from_secs(30))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.stop.shutdown();
            wait_until(Duration::from_secs(20), || h.is_finished());
        }
    }
}

/// The Redis marker key of `event_id` in `scope` for the database at
/// `db_url`, computed here from the format the README documents:
/// `th:<ns>:<len(scope)>:<scope>:<event_id>`, where `<ns>` is the 64-bit
/// FNV-1a hash, in hex, of `<system_identifier>/<database oid>/<timeline,
/// 8 hex digits>/<processed_events file node>`.
pub fn marker_key(db_url: &str, scope: &str, event_id: &str) -> String {
    let mut client = postgres::Client::connect(db_url, postgres::NoTls).unwrap();
    let row = client
        .query_one(
            "SELECT (SELECT system_identifier FROM pg_control_system())::text, \
             (SELECT oid FROM pg_database WHERE datname = current_database())::text, \
             substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8), \
             coalesce(pg_relation_filenode(to_regclass('processed_events')), 0)::text",
            &[],
        )
        .unwrap();
    let parts: Vec<String> = (0..4).map(|i| row.get(i)).collect();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.join("/").bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("th:{hash:016x}:{}:{scope}:{event_id}", scope.len())
}
