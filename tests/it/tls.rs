//! TLS to Redis (`rediss://`, with a Redis ACL user, a custom CA and a
//! client certificate), to PostgreSQL (libpq's `sslmode`s, `sslrootcert`,
//! `sslcert` + `sslkey`) and to the HTTPS servers of `--http-url` and
//! `--alert-webhook` (a custom CA and a client certificate), against private
//! servers started with certificates made here by the `openssl` command.
//! The PostgreSQL server rejects every connection over TCP that is not TLS,
//! so a passing run really was encrypted.

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::certs::{make_certs, Certs, Client};
use crate::support::downstream::{self, Answer};
use crate::support::*;

const ACL_USER: &str = "taskhub";
const ACL_PASSWORD: &str = "tls-test-pass-7f3a";

/// A private Redis that accepts TLS only, with ACL user `taskhub` and the
/// default user switched off; with `client`, it requires a client
/// certificate signed by its CA (`--tls-auth-clients yes`).
struct TlsRedis {
    port: u16,
    child: Child,
    _dir: TempDir,
}

impl TlsRedis {
    fn start(certs: &Certs) -> TlsRedis {
        TlsRedis::start_with(certs, None)
    }

    fn start_with(certs: &Certs, client: Option<&Client>) -> TlsRedis {
        let dir = TempDir::new("taskhub-tls-redis");
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", dir.0.to_str().unwrap()])
            .args(["--tls-cert-file", certs.cert.to_str().unwrap()])
            .args(["--tls-key-file", certs.key.to_str().unwrap()])
            .args(["--tls-ca-cert-file", certs.ca.to_str().unwrap()])
            .args([
                "--tls-auth-clients",
                if client.is_some() { "yes" } else { "no" },
            ])
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
                conn = tls_redis_as(&url, &certs.ca, client).ok();
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
    tls_redis_as(url, ca, None)
}

/// A connection of the test's own, with `client`'s certificate if given.
fn tls_redis_as(
    url: &str,
    ca: &Path,
    client: Option<&Client>,
) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: client.map(|c| redis::ClientTlsConfig {
                client_cert: std::fs::read(&c.cert).unwrap(),
                client_key: std::fs::read(&c.key).unwrap(),
            }),
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
    tls_postgres_with(certs, dir, "trust")
}

/// Like [`tls_postgres`], with `method` for TLS connections over TCP
/// (`cert`: a client certificate signed by the test CA, whose common name
/// is the user).
fn tls_postgres_with(certs: &Certs, dir: &Path, method: &str) -> PrivatePostgres {
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
    let ca = format!("ssl_ca_file={}", certs.ca.display());
    let hba = format!(
        "local all all trust\n\
         hostssl all all 127.0.0.1/32 {method}\n\
         hostnossl all all 127.0.0.1/32 reject\n"
    );
    PrivatePostgres::start_with(&["ssl=on", &cert, &key, &ca], Some(&hba))
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
            "cannot connect to PostgreSQL at postgres://127.0.0.1:{}/",
            pg.port
        );
        assert!(errors[0].contains(&expected), "{stderr}");
        assert!(errors[0].contains("invalid peer certificate"), "{stderr}");
        // Each cause once: Display states what failed, source() the why.
        assert_eq!(
            errors[0].matches("invalid peer certificate").count(),
            1,
            "{stderr}"
        );
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
        let expected = format!("Redis at rediss://127.0.0.1:{}", redis.port);
        assert!(errors[0].contains(&expected), "{stderr}");
        assert!(errors[0].contains("invalid peer certificate"), "{stderr}");
        assert_eq!(
            errors[0].matches("invalid peer certificate").count(),
            1,
            "{stderr}"
        );
        assert!(!stderr.contains(ACL_PASSWORD), "{stderr}");
    }

    // rediss://...#insecure encrypts without checking the certificate: the
    // system's store (which does not know the CA) is then no obstacle.
    let insecure = format!("{}/#insecure", redis.url());
    let mut cmd = taskhub_tls(&insecure, &good_pg, None);
    cmd.args([
        "produce",
        "--stream",
        &unique("tls_insecure"),
        "--count",
        "1",
    ]);
    let (code, stderr) = run(&mut cmd, None);
    assert_eq!(code, 0, "#insecure: {stderr}");

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

#[test]
fn postgres_client_certificates_for_a_server_that_requires_them() {
    let dir = TempDir::new("taskhub-tls-pg-cert");
    let certs = make_certs(&dir.0, "ca");
    let other = make_certs(&dir.0, "other");
    let pg = tls_postgres_with(&certs, &dir.0, "cert");
    let client = certs.client("postgres");
    let url = |extra: &str| {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}{extra}",
            pg.port,
            certs.ca.display()
        )
    };
    let with_cert = url(&format!(
        "&sslcert={}&sslkey={}",
        client.cert.display(),
        client.key.display()
    ));

    // Without a certificate, or with one of another CA: refused by the
    // server, one line naming it.
    let stranger = other.client("postgres");
    for attempt in [
        url(""),
        url(&format!(
            "&sslcert={}&sslkey={}",
            stranger.cert.display(),
            stranger.key.display()
        )),
    ] {
        let (code, stderr) = run(taskhub(&redis_url(), &attempt).arg("migrate"), None);
        assert_eq!(code, 1, "{stderr}");
        let errors = error_lines(&stderr);
        assert_eq!(errors.len(), 1, "{stderr}");
        let expected = format!(
            "cannot connect to PostgreSQL at postgres://127.0.0.1:{}/",
            pg.port
        );
        assert!(errors[0].contains(&expected), "{stderr}");
    }
    // A key that is not the certificate's: a start-up error naming both.
    let mismatched = url(&format!(
        "&sslcert={}&sslkey={}",
        client.cert.display(),
        stranger.key.display()
    ));
    let (code, stderr) = run(taskhub(&redis_url(), &mismatched).arg("migrate"), None);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("do not go together"), "{stderr}");

    // With it: migrations and a run, over verify-full with the client's
    // certificate (and over require with it, the key-value form too).
    let (code, stderr) = run(taskhub(&redis_url(), &with_cert).arg("migrate"), None);
    assert_eq!(code, 0, "migrate with a client certificate: {stderr}");
    let stream = unique("tls_pg_cert");
    let mut r = redis(&redis_url());
    for i in 0..20 {
        xadd(
            &mut r,
            &stream,
            &[("event_id", &format!("c-{i}")), ("payload", "p")],
        );
    }
    let mut cmd = taskhub(&redis_url(), &with_cert);
    cmd.args(["run", "--stream", &stream, "--until-idle"])
        .args(["--workers", "2", "--block-ms", "200"]);
    let (code, stderr) = run(&mut cmd, None);
    assert_eq!(code, 0, "run with a client certificate: {stderr}");
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM notifications WHERE event_id LIKE 'c-%'"
        ),
        20
    );
    let key_value = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=require \
         sslcert={} sslkey={}",
        pg.port,
        client.cert.display(),
        client.key.display()
    );
    let (code, stderr) = run(taskhub(&redis_url(), &key_value).arg("migrate"), None);
    assert_eq!(code, 0, "key-value form with require: {stderr}");
}

#[test]
fn redis_client_certificates_for_a_server_that_requires_them() {
    let dir = TempDir::new("taskhub-tls-redis-cert");
    let certs = make_certs(&dir.0, "ca");
    let other = make_certs(&dir.0, "other");
    let client = certs.client("taskhub");
    let redis = TlsRedis::start_with(&certs, Some(&client));
    let db = TestDb::new();
    let stream = unique("tls_redis_cert");
    // The flags, not the environment, this time.
    let with = |cert: &Client| {
        let mut cmd = taskhub_tls(&redis.url(), &db.url, None);
        cmd.arg("--redis-ca-file")
            .arg(&certs.ca)
            .arg("--redis-client-cert")
            .arg(&cert.cert)
            .arg("--redis-client-key")
            .arg(&cert.key);
        cmd
    };

    // No client certificate, or one of another CA: one line, no password.
    let stranger = other.client("taskhub");
    let mut without = taskhub_tls(&redis.url(), &db.url, Some(&certs.ca));
    for cmd in [&mut without, &mut with(&stranger)] {
        cmd.args(["produce", "--stream", &stream, "--count", "1"]);
        let (code, stderr) = run(cmd, None);
        assert_eq!(code, 1, "{stderr}");
        let errors = error_lines(&stderr);
        assert_eq!(errors.len(), 1, "{stderr}");
        let expected = format!("Redis at rediss://127.0.0.1:{}", redis.port);
        assert!(errors[0].contains(&expected), "{stderr}");
        assert!(!stderr.contains(ACL_PASSWORD), "{stderr}");
    }
    // A certificate without its key is refused by the flag parser.
    let mut half = taskhub_tls(&redis.url(), &db.url, Some(&certs.ca));
    half.arg("--redis-client-cert").arg(&client.cert);
    half.args(["produce", "--stream", &stream, "--count", "1"]);
    let (code, stderr) = run(&mut half, None);
    assert_eq!(code, 2, "{stderr}");

    let lines: String = (0..30)
        .map(|i| format!("{{\"event_id\":\"m-{i}\",\"payload\":\"p{i}\"}}\n"))
        .collect();
    let (code, stderr) = run(
        with(&client).args(["produce", "--stream", &stream]),
        Some(&lines),
    );
    assert_eq!(code, 0, "produce with a client certificate: {stderr}");
    let mut cmd = with(&client);
    cmd.args(["run", "--stream", &stream, "--until-idle"])
        .args(["--workers", "2", "--block-ms", "200"]);
    let (code, stderr) = run(&mut cmd, None);
    assert_eq!(code, 0, "run with a client certificate: {stderr}");
    assert_eq!(
        db.count("SELECT count(*) FROM notifications WHERE event_id LIKE 'm-%'"),
        30
    );
    let mut conn = tls_redis_as(&redis.url(), &certs.ca, Some(&client)).unwrap();
    assert_eq!(pending(&mut conn, &stream, "workers"), 0);
    let (code, stderr) = run(
        with(&client).args(["dlq", "stats", "--stream", &stream]),
        None,
    );
    assert_eq!(code, 0, "dlq over mutual TLS: {stderr}");
    let (code, stderr) = run(with(&client).args(["consumers", "--stream", &stream]), None);
    assert_eq!(code, 0, "consumers over mutual TLS: {stderr}");
}

/// What an HTTPS downstream received: event ids POSTed to `/events` and
/// alerts POSTed to `/alert`.
#[derive(Default)]
struct Seen {
    events: Vec<String>,
    alerts: Vec<serde_json::Value>,
}

#[test]
fn http_url_and_alert_webhook_over_mutual_tls() {
    let dir = TempDir::new("taskhub-tls-http");
    let certs = make_certs(&dir.0, "ca");
    let client = certs.client("taskhub");
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let addr = {
        let seen = seen.clone();
        downstream::start_tls(&certs, move |request| {
            let mut seen = seen.lock().unwrap();
            if request.path == "/alert" {
                seen.alerts
                    .push(serde_json::from_slice(&request.body).unwrap());
                return Answer::status(200);
            }
            let id = request.header("Idempotency-Key");
            seen.events.push(id.clone());
            // One event the downstream refuses: a dead letter, so an alert.
            Answer::status(if id == "h-bad" { 400 } else { 200 })
        })
    };
    let db = TestDb::new();
    let run_with = |stream: &str, tls: &[(&str, &Path)]| {
        let mut cmd = run_on(&db.url, stream);
        cmd.env_remove("SSL_CERT_FILE")
            .args(["--http-url", &format!("https://{addr}/events")])
            .args(["--alert-webhook", &format!("https://{addr}/alert")])
            .args(["--alert-interval", "100ms", "--max-attempts", "1"]);
        for (flag, path) in tls {
            cmd.arg(flag).arg(path);
        }
        cmd
    };
    let mut r = redis(&redis_url());

    // CA file and client certificate: every event delivered, the refused
    // one dead-lettered, and the alert about it delivered too.
    let stream = unique("tls_http");
    for id in ["h-1", "h-2", "h-bad", "h-3"] {
        xadd(&mut r, &stream, &[("event_id", id), ("payload", "{}")]);
    }
    let flags = [
        ("--http-ca-file", certs.ca.as_path()),
        ("--http-client-cert", client.cert.as_path()),
        ("--http-client-key", client.key.as_path()),
    ];
    let mut p = Proc::spawn(run_with(&stream, &flags));
    let arrived = wait_until(Duration::from_secs(20), || {
        let seen = seen.lock().unwrap();
        seen.events.len() >= 4 && !seen.alerts.is_empty()
    });
    p.signal("TERM");
    assert!(p.wait(Duration::from_secs(20)).success(), "{}", p.stderr());
    assert!(arrived, "{}", p.stderr());
    {
        let seen = seen.lock().unwrap();
        let mut events = seen.events.clone();
        events.sort();
        assert_eq!(events, ["h-1", "h-2", "h-3", "h-bad"]);
        assert_eq!(
            seen.alerts[0]["latest_event_id"], "h-bad",
            "{:?}",
            seen.alerts
        );
    }
    assert_eq!(dead_letters(&mut r, &stream).len(), 1);

    // The same through the environment, with the CA as the system's store
    // (SSL_CERT_FILE, as rustls-native-certs reads it).
    let stream = unique("tls_http_env");
    xadd(&mut r, &stream, &[("event_id", "h-env"), ("payload", "{}")]);
    let mut cmd = run_with(&stream, &[]);
    cmd.env("SSL_CERT_FILE", &certs.ca)
        .env("TASKHUB_HTTP_CLIENT_CERT", &client.cert)
        .env("TASKHUB_HTTP_CLIENT_KEY", &client.key)
        .arg("--until-idle");
    let out = output(cmd, None, Duration::from_secs(60));
    assert!(out.status.success(), "{}", out.stderr);
    assert!(seen.lock().unwrap().events.iter().any(|e| e == "h-env"));
    assert!(dead_letters(&mut r, &stream).is_empty());

    // Without the CA (the system's store does not know it): the event
    // fails, and the reason says why. Without a client certificate: the
    // server refuses the handshake (with TLS 1.3 the client learns it when
    // it sends the request, as a broken pipe or the server's alert). The
    // downstream sees neither.
    for (id, tls, reason) in [
        ("h-no-ca", &flags[1..], "UnknownIssuer"),
        ("h-no-cert", &flags[..1], "POST https://"),
    ] {
        let stream = unique("tls_http_refused");
        xadd(&mut r, &stream, &[("event_id", id), ("payload", "{}")]);
        let mut cmd = run_with(&stream, tls);
        cmd.arg("--until-idle");
        let out = output(cmd, None, Duration::from_secs(60));
        assert!(out.status.success(), "{}", out.stderr);
        let letters = dead_letters(&mut r, &stream);
        assert_eq!(letters.len(), 1, "{}", out.stderr);
        assert!(letters[0].reason.contains(reason), "{}", letters[0].reason);
        assert!(!seen.lock().unwrap().events.iter().any(|e| e == id));
    }
}

/// SCRAM over TLS is bound to the TLS channel (SCRAM-SHA-256-PLUS, the
/// server's certificate hashed into the exchange), as it was with OpenSSL:
/// `channel_binding=require` refuses to log in without it.
#[test]
fn scram_over_tls_is_bound_to_the_channel() {
    let dir = TempDir::new("taskhub-tls-scram");
    let certs = make_certs(&dir.0, "ca");
    let pg = tls_postgres_with(&certs, &dir.0, "scram-sha-256");
    socket_client(&pg)
        .batch_execute(
            "SET password_encryption = 'scram-sha-256'; \
             CREATE USER scrammer PASSWORD 'scram-pass-93'; \
             GRANT ALL ON SCHEMA public TO scrammer",
        )
        .unwrap();
    let url = |password: &str| {
        format!(
            "postgres://scrammer:{password}@127.0.0.1:{}/postgres?sslmode=require&channel_binding=require",
            pg.port
        )
    };
    let (code, stderr) = run(
        taskhub(&redis_url(), &url("scram-pass-93")).arg("migrate"),
        None,
    );
    assert_eq!(code, 0, "SCRAM with channel binding: {stderr}");
    let (code, stderr) = run(
        taskhub(&redis_url(), &url("wrong-pass-93")).arg("migrate"),
        None,
    );
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    assert!(!stderr.contains("wrong-pass-93"), "{stderr}");
}

/// `rediss://` aimed at a Redis without TLS: the server takes the
/// ClientHello for the start of a command and waits for its end, so the
/// handshake gets no answer. The start-up error says so, naming the server's
/// `host:port`, and suggests `redis://`, without the password; for one
/// server and for the seeds of a cluster alike.
#[test]
fn rediss_to_a_redis_without_tls_says_the_tls_handshake_got_no_answer() {
    let plain = PrivateRedis::start();
    let addr = format!("127.0.0.1:{}", plain.port);
    let password = "plain-port-pass-5c1e";
    let db = TestDb::new();
    let stream = unique("{tls_plain}");
    for url in [
        format!("rediss://{ACL_USER}:{password}@{addr}"),
        format!("rediss://{ACL_USER}:{password}@{addr},rediss://{ACL_USER}:{password}@{addr}"),
    ] {
        let mut cmd = taskhub_tls(&url, &db.url, None);
        cmd.args(["run", "--stream", &stream, "--until-idle"]);
        let out = output(cmd, None, Duration::from_secs(60));
        assert_eq!(out.code(), Some(1), "{url}: {}", out.stderr);
        let errors = error_lines(&out.stderr);
        assert_eq!(errors.len(), 1, "one error line: {}", out.stderr);
        let line = errors[0];
        for needle in [
            format!("TLS handshake with {addr}"),
            "no answer".to_owned(),
            "may not speak TLS".to_owned(),
            "redis://".to_owned(),
        ] {
            assert!(line.contains(&needle), "{needle:?} in {line}");
        }
        assert!(!line.contains("os error"), "{line}");
        assert!(!out.stderr.contains(password), "{}", out.stderr);
    }
}
