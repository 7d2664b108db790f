//! Private servers for the tests that stop, restart or kill one: a
//! `redis-server` (AOF, so a restart keeps everything) and a PostgreSQL
//! (`initdb` + `pg_ctl`), each in a temporary directory on a free port. The
//! shared servers are never touched.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{wait_until, TempDir};

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

/// A private `redis-server` on a free port, with AOF (`appendfsync always`)
/// so a restart keeps everything.
pub struct PrivateRedis {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
    /// Settings of its own, after the others.
    extra: Vec<String>,
}

impl PrivateRedis {
    pub fn start() -> PrivateRedis {
        PrivateRedis::start_with(&[])
    }

    /// [`PrivateRedis::start`] with more settings (`["--name", "value"]`).
    pub fn start_with(extra: &[&str]) -> PrivateRedis {
        let mut r = PrivateRedis {
            port: free_port(),
            dir: TempDir::new("taskhub-redis"),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        r.start_again();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and directory.
    pub fn start_again(&mut self) {
        self.spawn();
        let url = self.url();
        assert!(
            wait_until(Duration::from_secs(10), || ping(&url).is_ok()),
            "private redis did not start"
        );
    }

    /// Starts the server again with `extra` settings added, returning as
    /// soon as it answers, before it has loaded its data (while it answers
    /// every command with `LOADING`).
    pub fn start_again_loading(&mut self, extra: &[&str]) {
        self.extra.extend(extra.iter().map(|s| s.to_string()));
        self.spawn();
        let url = self.url();
        assert!(
            wait_until(Duration::from_secs(10), || ping(&url).is_err_and(|e| e
                .kind()
                == redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading))),
            "private redis did not start loading"
        );
    }

    fn spawn(&mut self) {
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
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/test.sh installs it)");
        self.child = Some(child);
    }

    /// Stops the server (SIGKILL: like a crash; AOF always keeps the data).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn ping(url: &str) -> redis::RedisResult<String> {
    redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
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
