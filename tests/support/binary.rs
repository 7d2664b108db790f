//! The `taskhub` binary as a subprocess, the way a user runs it: a command
//! with the servers given, a running child whose output is collected
//! ([`Proc`]), a command run to the end ([`output`]), and the summary line
//! it prints.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{redis_url, wait_until};

/// The `taskhub` binary, with the servers given.
pub fn taskhub(redis_url: &str, database_url: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_taskhub"));
    cmd.env("REDIS_URL", redis_url)
        .env("DATABASE_URL", database_url)
        .env_remove("TASKHUB_FAULT")
        .env_remove("TASKHUB_FAULT_PAUSE_MS")
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
    /// The threads collecting them, joined once the child has exited.
    collectors: Vec<std::thread::JoinHandle<()>>,
}

fn collect(
    stream: impl Read + Send + 'static,
    into: Arc<Mutex<String>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let mut s = into.lock().unwrap();
            s.push_str(&String::from_utf8_lossy(&line));
            s.push('\n');
        }
    })
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("taskhub starts");
        let stderr = Arc::new(Mutex::new(String::new()));
        let stdout = Arc::new(Mutex::new(String::new()));
        let collectors = vec![
            collect(child.stderr.take().unwrap(), stderr.clone()),
            collect(child.stdout.take().unwrap(), stdout.clone()),
        ];
        Proc {
            child,
            stderr,
            stdout,
            collectors,
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

    pub fn pid(&self) -> u32 {
        self.child.id()
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
                // Its pipes are closed: the collectors end with its last
                // lines (a fixed pause let a starved one miss them). Bounded,
                // in case a process it started keeps a pipe open.
                let until = Instant::now() + Duration::from_secs(10);
                while self.collectors.iter().any(|c| !c.is_finished()) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
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

/// What a finished command left behind.
pub struct Out {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

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
