//! TLS to Redis (`rediss://`, with a Redis ACL user) and to PostgreSQL
//! (`sslmode=verify-full` with `sslrootcert`, `require`, the default
//! `prefer`), against private servers started with certificates made here by
//! the `openssl` command. The PostgreSQL server rejects every connection over
//! TCP that is not TLS, so a passing run really was encrypted.

mod support;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::certs::{make_certs, Certs};
use support::*;

const ACL_USER: &str = "taskhub";
const ACL_PASSWORD: &str = "tls-test-pass-7f3a";

/// A private Redis that accepts TLS only, with ACL user `taskhub` and the
/// default user switched off.
struct TlsRedis {
    port: u16,
    child: Child,
    _dir: TempDir,
}

impl TlsRedis {
    fn start(certs: &Certs) -> TlsRedis {
        let dir = TempDir::new("taskhub-tls-redis");
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", dir.0.to_str().unwrap()])
            .args(["--tls-cert-file", certs.cert.to_str().unwrap()])
            .args(["--tls-key-file", certs.key.to_str().unwrap()])
            .args(["--tls-ca-cert-file", certs.ca.to_str().unwrap()])
            .args(["--tls-auth-clients", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        let mut redis = TlsRedis {
            port,
            child,
            _dir: dir,
        };
        let url = format!("rediss://127.0.0.1:{port}");
        let mut conn = None;
        assert!(
            wait_until(Duration::from_secs(10), || {
                conn = tls_redis(&url, &certs.ca).ok();
                conn.is_some()
            }),
            "private TLS redis did not start (is redis-server built with TLS?)"
        );
        let mut conn = conn.unwrap();
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(ACL_USER)
            .arg("on")
            .arg(format!(">{ACL_PASSWORD}"))
            .arg("~*")
            .arg("&*")
            .arg("+@all")
            .query::<()>(&mut conn)
            .unwrap();
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg("off")
            .query::<()>(&mut conn)
            .unwrap();
        assert!(redis.child.try_wait().unwrap().is_none());
        redis.port = port;
        redis
    }

    /// With the ACL user and its password.
    fn url(&self) -> String {
        format!("rediss://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{}", self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tls_redis(url: &str, ca: &Path) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(std::fs::read(ca).unwrap()),
        },
    )?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(5))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    redis::cmd("PING").query::<()>(&mut conn)?;
    Ok(conn)
}

/// A private PostgreSQL with `ssl=on` whose pg_hba.conf accepts TCP
/// connections only over TLS (`hostnossl ... reject`); the Unix socket is
/// for the checks.
fn tls_postgres(certs: &Certs, dir: &Path) -> PrivatePostgres {
    // The server wants its key private to its own user.
    let key = dir.join("pg-server.key");
    std::fs::copy(&certs.key, &key).unwrap();
    if is_root() {
        let ok = Command::new("chown")
            .arg("postgres")
            .arg(&key)
            .status()
            .unwrap();
        assert!(ok.success());
    }
    let ok = Command::new("chmod")
        .arg("0600")
        .arg(&key)
        .status()
        .unwrap();
    assert!(ok.success());
    let cert = format!("ssl_cert_file={}", certs.cert.display());
    let key = format!("ssl_key_file={}", key.display());
    PrivatePostgres::start_with(
        &["ssl=on", &cert, &key],
        Some(
            "local all all trust\n\
             hostssl all all 127.0.0.1/32 trust\n\
             hostnossl all all 127.0.0.1/32 reject\n",
        ),
    )
}

/// A connection over the Unix socket (no TLS there), for the checks.
fn socket_client(pg: &PrivatePostgres) -> postgres::Client {
    postgres::Config::new()
        .host_path(pg.socket_dir())
        .port(pg.port)
        .user("postgres")
        .dbname("postgres")
        .connect(postgres::NoTls)
        .unwrap()
}

fn count(pg: &PrivatePostgres, sql: &str) -> i64 {
    socket_client(pg).query_one(sql, &[]).unwrap().get(0)
}

fn taskhub_tls(redis_url: &str, database_url: &str, redis_ca: Option<&Path>) -> Command {
    let mut cmd = taskhub(redis_url, database_url);
    match redis_ca {
        Some(ca) => cmd.env("TASKHUB_REDIS_CA_FILE", ca),
        None => cmd.env_remove("TASKHUB_REDIS_CA_FILE"),
    };
    cmd
}

/// Runs `cmd` to its end; returns (exit code, stderr).
fn run(cmd: &mut Command, stdin: Option<&str>) -> (i32, String) {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn error_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("taskhub: error:"))
        .collect()
}

#[test]
fn events_apply_exactly_once_over_verified_tls() {
    let dir = TempDir::new("taskhub-tls");
    let certs = make_certs(&dir.0, "ca");
    let redis = TlsRedis::start(&certs);
    let pg = tls_postgres(&certs, &dir.0);

    // Plain TCP is refused: whatever works below was TLS.
    let plain = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
        pg.port
    );
    let err = postgres::Client::connect(&plain, postgres::NoTls)
        .err()
        .expect("plain TCP is rejected");
    assert!(format!("{err:?}").contains("pg_hba.conf"), "{err:?}");
    // And Redis has no default user any more: the ACL user is needed.
    let anonymous = format!("rediss://127.0.0.1:{}", redis.port);
    assert!(tls_redis(&anonymous, &certs.ca)
        .and_then(|mut c| redis::cmd("XLEN").arg("x").query::<u64>(&mut c))
        .is_err());

    let pg_url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
        pg.port,
        certs.ca.display()
    );
    let ca = Some(certs.ca.as_path());
    let (code, stderr) = run(taskhub_tls(&redis.url(), &pg_url, ca).arg("migrate"), None);
    assert_eq!(code, 0, "migrate over verify-full: {stderr}");

    let stream = unique("tls_events");
    let lines: String = (0..50)
        .map(|i| format!("{{\"event_id\":\"tls-{i}\",\"payload\":\"p{i}\"}}\n"))
        .collect();
    // Every event twice: the second copy must be recognised as a duplicate.
    for _ in 0..2 {
        let mut cmd = taskhub_tls(&redis.url(), &pg_url, ca);
        cmd.args(["produce", "--stream", &stream]);
        let (code, stderr) = run(&mut cmd, Some(&lines));
        assert_eq!(code, 0, "produce over rediss: {stderr}");
    }
    let mut cmd = taskhub_tls(&redis.url(), &pg_url, ca);
    cmd.args([
        "run",
        "--stream",
        &stream,
        "--group",
        "workers",
        "--until-idle",
    ])
    .args(["--workers", "2", "--block-ms", "200"]);
    let (code, stderr) = run(&mut cmd, None);
    assert_eq!(code, 0, "run over TLS: {stderr}");

    assert_eq!(count(&pg, "SELECT count(*) FROM notifications"), 50);
    assert_eq!(
        count(&pg, "SELECT count(DISTINCT event_id) FROM notifications"),
        50
    );
    let mut conn = tls_redis(&redis.url(), &certs.ca).unwrap();
    assert_eq!(pending(&mut conn, &stream, "workers"), 0);
    assert!(dead_letters(&mut conn, &stream).is_empty());
    assert_eq!(xlen(&mut conn, &stream), 100);

    // sslmode=require without a CA file: encrypted, not verified (like
    // libpq); so is the default, prefer, against this TLS-only server.
    for query in ["?sslmode=require", ""] {
        let url = format!("postgres://postgres@127.0.0.1:{}/postgres{query}", pg.port);
        let (code, stderr) = run(taskhub_tls(&redis.url(), &url, ca).arg("migrate"), None);
        assert_eq!(code, 0, "migrate with {query:?}: {stderr}");
    }
    // verify-ca: the chain is checked, the host name is not.
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-ca&sslrootcert={}",
        pg.port,
        certs.ca.display()
    );
    let (code, stderr) = run(taskhub_tls(&redis.url(), &url, ca).arg("migrate"), None);
    assert_eq!(code, 0, "migrate with verify-ca: {stderr}");
}

#[test]
fn a_wrong_certificate_authority_is_a_one_line_startup_error() {
    let dir = TempDir::new("taskhub-tls-wrong");
    let certs = make_certs(&dir.0, "ca");
    let other = make_certs(&dir.0, "other");
    let redis = TlsRedis::start(&certs);
    let pg = tls_postgres(&certs, &dir.0);
    let good_pg = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
        pg.port,
        certs.ca.display()
    );

    // PostgreSQL, verify-full against another CA; against the system store
    // (no sslrootcert), which does not know the test CA either; and require
    // with another CA's sslrootcert, which checks the chain like libpq.
    for tls in [
        format!("verify-full&sslrootcert={}", other.ca.display()),
        "verify-full".to_owned(),
        format!("require&sslrootcert={}", other.ca.display()),
    ] {
        let url = format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode={tls}",
            pg.port
        );
        let cmd = taskhub_tls(&redis.url(), &url, Some(&certs.ca));
        let mut cmd = cmd;
        cmd.args(["run", "--stream", &unique("tls_wrong"), "--until-idle"]);
        let (code, stderr) = run(&mut cmd, None);
        assert_eq!(code, 1, "{stderr}");
        let errors = error_lines(&stderr);
        assert_eq!(errors.len(), 1, "{stderr}");
        let expected = format!(
            "cannot connect to PostgreSQL at postgres://postgres@127.0.0.1:{}/",
            pg.port
        );
        assert!(errors[0].contains(&expected), "{stderr}");
        assert!(errors[0].contains("invalid peer certificate"), "{stderr}");
    }

    // verify-full checks the host name, verify-ca does not: the server is
    // reached at 127.0.0.1 under a name its certificate does not carry.
    for (mode, code) in [("verify-full", 1), ("verify-ca", 0)] {
        let url = format!(
            "postgres://postgres@not-in-the-cert.invalid:{}/postgres?hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={}",
            pg.port,
            certs.ca.display()
        );
        let mut cmd = taskhub_tls(&redis.url(), &url, Some(&certs.ca));
        cmd.arg("migrate");
        let (got, stderr) = run(&mut cmd, None);
        assert_eq!(got, code, "{mode}: {stderr}");
        if code == 1 {
            assert!(stderr.contains("invalid peer certificate"), "{stderr}");
        }
    }

    // Redis, against another CA and against the system store.
    for ca in [Some(other.ca.as_path()), None] {
        let mut cmd = taskhub_tls(&redis.url(), &good_pg, ca);
        cmd.args(["produce", "--stream", &unique("tls_wrong"), "--count", "1"]);
        let (code, stderr) = run(&mut cmd, None);
        assert_eq!(code, 1, "{stderr}");
        let errors = error_lines(&stderr);
        assert_eq!(errors.len(), 1, "{stderr}");
        let expected = format!("Redis at rediss://{ACL_USER}:***@127.0.0.1:{}", redis.port);
        assert!(errors[0].contains(&expected), "{stderr}");
        assert!(errors[0].contains("invalid peer certificate"), "{stderr}");
        assert!(!stderr.contains(ACL_PASSWORD), "{stderr}");
    }

    // A wrong ACL password is refused, and not shown.
    let url = format!(
        "rediss://{ACL_USER}:wrong-password-123@127.0.0.1:{}",
        redis.port
    );
    let mut cmd = taskhub_tls(&url, &good_pg, Some(&certs.ca));
    cmd.args(["produce", "--stream", &unique("tls_wrong"), "--count", "1"]);
    let (code, stderr) = run(&mut cmd, None);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(error_lines(&stderr).len(), 1, "{stderr}");
    assert!(!stderr.contains("wrong-password-123"), "{stderr}");
}
