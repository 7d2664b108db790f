//! The fault-injection proxy (`tests/support/proxy.rs`) against a tiny echo
//! server: each mode does to the sockets what its doc says, the counters count
//! right, and dropping the proxy ends its threads. Every wait is bounded.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::support::proxy::Proxy;

/// Bound on every wait that should succeed.
const PATIENCE: Duration = Duration::from_secs(2);

/// An echo server on 127.0.0.1 that counts its open connections, so a test can
/// see the proxy close the server side too. Stops and joins its threads on drop.
struct Echo {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Echo {
    fn start() -> Echo {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::Builder::new()
            .name("echo-accept".into())
            .spawn({
                let (open, stop) = (Arc::clone(&open), Arc::clone(&stop));
                move || {
                    let mut conns = Vec::new();
                    while !stop.load(SeqCst) {
                        let Ok((stream, _)) = listener.accept() else {
                            thread::sleep(Duration::from_millis(5));
                            continue;
                        };
                        open.fetch_add(1, SeqCst);
                        let (open, stop) = (Arc::clone(&open), Arc::clone(&stop));
                        conns.push(
                            thread::Builder::new()
                                .name("echo-conn".into())
                                .spawn(move || {
                                    echo(stream, &stop);
                                    open.fetch_sub(1, SeqCst);
                                })
                                .unwrap(),
                        );
                    }
                    for conn in conns {
                        conn.join().unwrap();
                    }
                }
            })
            .unwrap();
        Echo {
            addr,
            open,
            stop,
            thread: Some(thread),
        }
    }

    fn open(&self) -> usize {
        self.open.load(SeqCst)
    }
}

/// Echoes until EOF, an error or the stop flag.
fn echo(mut stream: TcpStream, stop: &AtomicBool) {
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    stream.set_write_timeout(Some(PATIENCE)).unwrap();
    let mut buf = [0; 4096];
    while !stop.load(SeqCst) {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if stream.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if is_timeout(&e) => {}
            Err(_) => return,
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// A client of the proxy whose reads and writes give up after `PATIENCE`.
fn client(proxy: &Proxy) -> TcpStream {
    let stream = TcpStream::connect_timeout(&proxy.addr(), PATIENCE).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    stream.set_write_timeout(Some(PATIENCE)).unwrap();
    stream
}

fn round_trip(stream: &mut TcpStream, msg: &[u8]) {
    stream.write_all(msg).unwrap();
    let mut back = vec![0; msg.len()];
    stream.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `stream` is dead: a write fails, or a read sees EOF or an error
/// other than a timeout.
fn is_dead(stream: &mut TcpStream) -> bool {
    if stream.write_all(b"x").is_err() {
        return true;
    }
    match stream.read(&mut [0; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !is_timeout(&e),
    }
}

#[test]
fn handles_are_send_sync_and_clone() {
    fn check<T: Send + Sync + Clone + 'static>() {}
    check::<Proxy>();
}

#[test]
fn pass_forwards_both_ways_and_counts_connections() {
    let echo = Echo::start();
    let proxy = Proxy::start(echo.addr);
    assert_eq!(
        proxy.addr(),
        SocketAddr::from(([127, 0, 0, 1], proxy.port()))
    );
    assert_eq!((proxy.connections(), proxy.accepted()), (0, 0));

    let mut a = client(&proxy);
    round_trip(&mut a, b"hello");
    let mut b = client(&proxy);
    // More than one chunk, written while the echo comes back.
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let mut writer = b.try_clone().unwrap();
    thread::scope(|s| {
        s.spawn(|| writer.write_all(&big).unwrap());
        let mut back = vec![0; big.len()];
        b.read_exact(&mut back).unwrap();
        assert!(back == big, "the echo came back altered");
    });
    drop(writer); // a second descriptor of `b`: it would keep `b` open
    wait_until("two connections", || proxy.connections() == 2);
    assert_eq!(proxy.accepted(), 2);

    // A client's close travels to the server, whose close travels back.
    drop(a);
    wait_until("one connection", || proxy.connections() == 1);
    drop(b);
    wait_until("no connection", || proxy.connections() == 0);
    wait_until("the server side closed", || echo.open() == 0);
    assert_eq!(proxy.accepted(), 2);
}

#[test]
fn delay_holds_each_chunk_in_both_directions() {
    let echo = Echo::start();
    let proxy = Proxy::start(echo.addr);
    let d = Duration::from_millis(200);
    proxy.delay(d);
    let mut c = client(&proxy);
    let started = Instant::now();
    round_trip(&mut c, b"slow");
    let took = started.elapsed();
    // One delay on the way in, one on the way out.
    assert!(took >= 2 * d, "a delayed round trip took only {took:?}");
    assert_eq!(proxy.connections(), 1);

    proxy.pass();
    round_trip(&mut c, b"fast again");
    assert_eq!(proxy.connections(), 1);
}

#[test]
fn freeze_holds_bytes_on_open_connections_until_pass() {
    let echo = Echo::start();
    let proxy = Proxy::start(echo.addr);
    let mut old = client(&proxy);
    round_trip(&mut old, b"before");

    proxy.freeze();
    old.write_all(b"held").unwrap();
    // New connections are accepted, but nothing flows on them either.
    let mut new = client(&proxy);
    new.write_all(b"new").unwrap();
    wait_until("the new connection", || proxy.accepted() == 2);
    for c in [&mut old, &mut new] {
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let e = c.read(&mut [0; 8]).unwrap_err();
        assert!(
            is_timeout(&e),
            "a frozen read ended with {e:?}, not a timeout"
        );
        c.set_read_timeout(Some(PATIENCE)).unwrap();
    }

    proxy.pass();
    let mut back = [0; 4];
    old.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"held");
    let mut back = [0; 3];
    new.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"new");
    round_trip(&mut old, b"after");
    assert_eq!(proxy.connections(), 2);
}

#[test]
fn drop_all_closes_both_sides_with_fin_and_keeps_accepting() {
    let echo = Echo::start();
    let proxy = Proxy::start(echo.addr);
    let mut old = client(&proxy);
    round_trip(&mut old, b"before");
    wait_until("the server side", || echo.open() == 1);

    proxy.drop_all();
    assert_eq!(proxy.connections(), 0);
    // EOF, not an error: a FIN.
    assert_eq!(old.read(&mut [0; 1]).unwrap(), 0);
    wait_until("the server side closed", || echo.open() == 0);

    let mut new = client(&proxy);
    round_trip(&mut new, b"after");
    assert_eq!(proxy.accepted(), 2);
    assert_eq!(proxy.connections(), 1);
}

#[test]
fn reset_all_resets_both_sides_and_keeps_accepting() {
    let echo = Echo::start();
    let proxy = Proxy::start(echo.addr);
    let mut old = client(&proxy);
    round_trip(&mut old, b"before");
    wait_until("the server side", || echo.open() == 1);

    proxy.reset_all();
    assert_eq!(proxy.connections(), 0);
    match old.read(&mut [0; 1]) {
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        // Linux always sends the RST on a close with SO_LINGER 0; elsewhere an
        // EOF is tolerated, as long as the connection is dead.
        Ok(0) if !cfg!(target_os = "linux") => {}
        other => panic!("expected a reset, the read gave {other:?}"),
    }
    wait_until("the server side closed", || echo.open() == 0);

    let mut new = client(&proxy);
    round_trip(&mut new, b"after");
    assert_eq!(proxy.accepted(), 2);
}

#[test]
fn refuse_resets_new_connections_only_while_on() {
    let echo = Echo::start();
    let proxy = Proxy::start(echo.addr);
    let mut old = client(&proxy);
    round_trip(&mut old, b"before");

    proxy.refuse(true);
    // The kernel completes the handshake before accept, so connect may
    // succeed; the first read or write must not.
    match TcpStream::connect_timeout(&proxy.addr(), PATIENCE) {
        Ok(mut refused) => {
            refused.set_read_timeout(Some(PATIENCE)).unwrap();
            assert!(is_dead(&mut refused), "a refused connection is alive");
        }
        Err(e) => assert_ne!(e.kind(), io::ErrorKind::TimedOut),
    }
    wait_until("the refused accept", || proxy.accepted() == 2);
    assert_eq!(echo.open(), 1, "a refused connection reached the target");
    round_trip(&mut old, b"untouched");

    proxy.refuse(false);
    let mut new = client(&proxy);
    round_trip(&mut new, b"after");
    assert_eq!(proxy.accepted(), 3);
    assert_eq!(proxy.connections(), 2);
}

#[test]
fn dropping_the_last_handle_stops_promptly_and_closes_connections() {
    let echo = Echo::start();
    let proxy = Proxy::start(echo.addr);
    let mut c = client(&proxy);
    round_trip(&mut c, b"before");

    // Dropping a clone stops nothing.
    drop(proxy.clone());
    round_trip(&mut c, b"still there");

    // Frozen pumps are idle, not reading: they must still see the stop.
    proxy.freeze();
    let (done, dropped) = mpsc::channel();
    thread::spawn(move || {
        drop(proxy);
        let _ = done.send(());
    });
    dropped
        .recv_timeout(PATIENCE)
        .expect("dropping the proxy did not join its threads in time");
    assert!(
        is_dead(&mut c),
        "the client's connection outlived the proxy"
    );
    wait_until("the server side closed", || echo.open() == 0);
}
