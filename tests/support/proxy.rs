//! A TCP fault-injection proxy, for exercising read timeouts, reconnects and
//! half-open connections in the tests and in the chaos run. Put it between a
//! client (a Redis or PostgreSQL connection) and the real server, then switch
//! it at will between passing bytes, delaying them, freezing every connection
//! half-open, closing them with FIN or RST, and refusing new ones.
//!
//! The chaos driver includes this file with `#[path = ...] mod proxy;`, so it
//! stands alone: std and `socket2` (for `SO_LINGER`), nothing else.
//!
//! Threads: one `proxy-accept` thread polls a non-blocking listener; each
//! accepted connection gets two `proxy-pump` threads, client → server and
//! server → client. Every blocking call is bounded (50 ms socket timeouts,
//! 10 ms sleeps), so each thread re-checks the mode, its connection's fate and
//! the stop flag often; dropping the last [`Proxy`] handle joins them all.

#![allow(dead_code)] // each includer (a test file, the chaos driver) uses a different part

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use socket2::SockRef;

/// Read and write timeout of every proxied socket: how long a pump can go
/// without seeing a mode change, a close order or the stop flag.
const IO_TIMEOUT: Duration = Duration::from_millis(50);
/// Sleep between polls of the listener and while a chunk waits for its turn.
const TICK: Duration = Duration::from_millis(10);
/// Bound on connecting to the target, so a dead target cannot hold up `Drop`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const BUF_SIZE: usize = 16 * 1024;

/// A TCP proxy on `127.0.0.1` that forwards to one target and injects faults on
/// command. Cloning gives another handle to the same proxy; the proxy stops,
/// closing every connection and joining every thread, when the last handle is
/// dropped.
#[derive(Clone)]
pub struct Proxy {
    control: Arc<Control>,
}

/// What the last `Proxy` handle owns; the threads hold only `Shared`.
struct Control {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    target: SocketAddr,
    mode: Mutex<Mode>,
    refuse: AtomicBool,
    swallow: AtomicBool,
    /// Connections taken by `swallow`, held open until the proxy goes.
    swallowed: Mutex<Vec<TcpStream>>,
    stop: AtomicBool,
    accepted: AtomicU64,
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    /// Pump threads, joined by `Drop`; finished ones are pruned on each accept.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Pass,
    Delay(Duration),
    Frozen,
}

/// One proxied connection. Both pumps borrow its sockets, so each socket is
/// closed exactly once, when the last `Arc` goes: that close is what sends the
/// RST after `close_rst`.
struct Conn {
    id: u64,
    client: TcpStream,
    server: TcpStream,
    fate: AtomicU8,
    pumps_left: AtomicUsize,
}

const OPEN: u8 = 0;
const CLOSING_FIN: u8 = 1;
const CLOSING_RST: u8 = 2;

impl Proxy {
    /// Listens on `127.0.0.1` on a free port and forwards every connection to
    /// `target`, in pass mode.
    ///
    /// Panics if it cannot bind or spawn its accept thread (this is test support).
    pub fn start(target: SocketAddr) -> Proxy {
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("proxy: bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("proxy: make the listener non-blocking");
        let addr = listener.local_addr().expect("proxy: listener address");
        let shared = Arc::new(Shared {
            target,
            mode: Mutex::new(Mode::Pass),
            refuse: AtomicBool::new(false),
            swallow: AtomicBool::new(false),
            swallowed: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        let accept = thread::Builder::new()
            .name("proxy-accept".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || accept_loop(&shared, listener)
            })
            .expect("proxy: spawn the accept thread");
        Proxy {
            control: Arc::new(Control {
                shared,
                addr,
                accept: Some(accept),
            }),
        }
    }

    /// The port the proxy listens on.
    pub fn port(&self) -> u16 {
        self.control.addr.port()
    }

    /// The address the proxy listens on (`127.0.0.1:port()`): point clients here.
    pub fn addr(&self) -> SocketAddr {
        self.control.addr
    }

    /// Forwards bytes as soon as they are read, both ways (the default).
    /// Bytes held by `freeze` or `delay` go out at once.
    pub fn pass(&self) {
        self.control.shared.set_mode(Mode::Pass);
    }

    /// Forwards each chunk read, in both directions, only once `d` has passed
    /// since it was read; connections stay open. A round trip takes at least `2·d`.
    pub fn delay(&self, d: Duration) {
        self.control.shared.set_mode(Mode::Delay(d));
    }

    /// Half-opens every connection, existing and new: the pumps stop reading,
    /// so bytes wait in the kernel buffers (and a chunk already read waits in
    /// the pump), while every socket stays open: no FIN, no RST. A client with
    /// a read timeout times out; one without hangs. New connections are still
    /// accepted (and connected to the target) but nothing flows. `pass()` or
    /// `delay()` delivers what was held, in order.
    pub fn freeze(&self) {
        self.control.shared.set_mode(Mode::Frozen);
    }

    /// Closes every existing connection on both sides with a normal FIN
    /// (`shutdown(Both)`): the client and the target read EOF. (Bytes a peer
    /// still sends after that may draw an RST, as from any closed socket.)
    /// Keeps accepting; the mode is unchanged, so new connections pass unless
    /// it says otherwise.
    pub fn drop_all(&self) {
        for conn in self.control.shared.take_conns() {
            conn.close_fin();
        }
    }

    /// Closes every existing connection on both sides with an RST (`SO_LINGER`
    /// 0, then close): the client and the target see a connection reset. Keeps
    /// accepting; the mode is unchanged.
    pub fn reset_all(&self) {
        for conn in self.control.shared.take_conns() {
            conn.close_rst();
        }
    }

    /// While on, every new connection is closed with an RST right after accept
    /// (the client's connect succeeds, its first read or write fails) and the
    /// target never hears of it. Existing connections are untouched.
    pub fn refuse(&self, on: bool) {
        self.control.shared.refuse.store(on, SeqCst);
    }

    /// While on, every new connection is accepted and then held open with
    /// nothing forwarded, for as long as the proxy lives, whatever it is
    /// told later (a proxy whose backend hung): the client's connect
    /// succeeds, the kernel takes its bytes, and no answer ever comes. The
    /// target never hears of it. Existing connections are untouched.
    pub fn swallow(&self, on: bool) {
        self.control.shared.swallow.store(on, SeqCst);
    }

    /// How many connections `swallow` has taken.
    pub fn swallowed(&self) -> usize {
        lock(&self.control.shared.swallowed).len()
    }

    /// How many proxied connections are open now. A connection counts once it
    /// is connected to the target and stops counting when both directions have
    /// closed, or at once on `drop_all`/`reset_all`.
    pub fn connections(&self) -> usize {
        lock(&self.control.shared.conns).len()
    }

    /// How many connections the listener has accepted in total, refused ones included.
    pub fn accepted(&self) -> u64 {
        self.control.shared.accepted.load(SeqCst)
    }
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shared = &self.control.shared;
        f.debug_struct("Proxy")
            .field("addr", &self.control.addr)
            .field("target", &shared.target)
            .field("mode", &shared.mode())
            .field("refuse", &shared.refuse.load(SeqCst))
            .field("connections", &self.connections())
            .field("accepted", &self.accepted())
            .finish()
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        let shared = &self.shared;
        shared.stop.store(true, SeqCst);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        for conn in shared.take_conns() {
            conn.close_fin();
        }
        // A connecting pump may still push its partner's handle: pop until empty.
        loop {
            let next = lock(&shared.threads).pop();
            match next {
                Some(handle) => {
                    let _ = handle.join();
                }
                None => break,
            }
        }
    }
}

impl Shared {
    fn mode(&self) -> Mode {
        *lock(&self.mode)
    }

    fn set_mode(&self, mode: Mode) {
        *lock(&self.mode) = mode;
    }

    fn take_conns(&self) -> Vec<Arc<Conn>> {
        lock(&self.conns).drain().map(|(_, conn)| conn).collect()
    }

    /// Whether the pumps of `conn` should keep going.
    fn running(&self, conn: &Conn) -> bool {
        !self.stop.load(SeqCst) && conn.fate.load(SeqCst) == OPEN
    }

    fn pump_done(&self, conn: &Conn) {
        if conn.pumps_left.fetch_sub(1, SeqCst) == 1 {
            lock(&self.conns).remove(&conn.id);
        }
    }
}

impl Conn {
    fn close_fin(&self) {
        self.fate.store(CLOSING_FIN, SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.server.shutdown(Shutdown::Both);
    }

    fn close_rst(&self) {
        for socket in [&self.client, &self.server] {
            let _ = SockRef::from(socket).set_linger(Some(Duration::ZERO));
        }
        self.fate.store(CLOSING_RST, SeqCst);
        // Sends nothing; only wakes a pump blocked in read. The RST goes out
        // when the pumps drop their last reference and the sockets close.
        let _ = self.client.shutdown(Shutdown::Read);
        let _ = self.server.shutdown(Shutdown::Read);
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    while !shared.stop.load(SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                shared.accepted.fetch_add(1, SeqCst);
                // Accepted sockets inherit O_NONBLOCK on some systems (BSD, macOS).
                if shared.refuse.load(SeqCst) || client.set_nonblocking(false).is_err() {
                    reset(client);
                    continue;
                }
                if shared.swallow.load(SeqCst) {
                    lock(&shared.swallowed).push(client);
                    continue;
                }
                let spawned = thread::Builder::new().name("proxy-pump".into()).spawn({
                    let shared = Arc::clone(shared);
                    move || serve(&shared, client)
                });
                // On a failed spawn the client socket went down with the closure.
                if let Ok(handle) = spawned {
                    let mut threads = lock(&shared.threads);
                    threads.retain(|t| !t.is_finished());
                    threads.push(handle);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // WouldBlock: nothing pending. Anything else (EMFILE...): back off.
            Err(_) => thread::sleep(TICK),
        }
    }
}

/// Connects one accepted client to the target, then pumps client → server on
/// this thread and server → client on a second one.
fn serve(shared: &Arc<Shared>, client: TcpStream) {
    let server = match TcpStream::connect_timeout(&shared.target, CONNECT_TIMEOUT) {
        Ok(server) => server,
        Err(_) => return reset(client),
    };
    let configured = [&client, &server].iter().try_for_each(|s| {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))
    });
    if configured.is_err() {
        reset(server);
        return reset(client);
    }
    let conn = Arc::new(Conn {
        id: shared.next_id.fetch_add(1, SeqCst),
        client,
        server,
        fate: AtomicU8::new(OPEN),
        pumps_left: AtomicUsize::new(2),
    });
    lock(&shared.conns).insert(conn.id, Arc::clone(&conn));
    let back = thread::Builder::new().name("proxy-pump".into()).spawn({
        let (shared, conn) = (Arc::clone(shared), Arc::clone(&conn));
        move || {
            pump(&shared, &conn, &conn.server, &conn.client);
            shared.pump_done(&conn);
        }
    });
    match back {
        Ok(handle) => lock(&shared.threads).push(handle),
        Err(_) => {
            conn.close_rst();
            shared.pump_done(&conn);
        }
    }
    pump(shared, &conn, &conn.client, &conn.server);
    shared.pump_done(&conn);
}

/// Copies `from` → `to` until EOF, an error, a close order or the stop flag.
/// Reads nothing while frozen, so held bytes stay in the kernel buffers.
fn pump(shared: &Shared, conn: &Conn, mut from: &TcpStream, to: &TcpStream) {
    let mut buf = vec![0; BUF_SIZE];
    while shared.running(conn) {
        if shared.mode() == Mode::Frozen {
            thread::sleep(TICK);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => {
                // A half-close travels on; after a close order it is ours, not the peer's.
                if shared.running(conn) {
                    let _ = to.shutdown(Shutdown::Write);
                }
                return;
            }
            Ok(n) => {
                if !forward(shared, conn, to, &buf[..n], Instant::now()) {
                    return;
                }
            }
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            // A reset or any other failure on one side resets the other.
            Err(_) => return conn.close_rst(),
        }
    }
}

/// Writes one chunk once the mode lets it go. Returns false if the
/// connection is over.
fn forward(
    shared: &Shared,
    conn: &Conn,
    mut to: &TcpStream,
    chunk: &[u8],
    read_at: Instant,
) -> bool {
    let mut rest = chunk;
    while !rest.is_empty() {
        if !shared.running(conn) {
            return false;
        }
        let wait = match shared.mode() {
            Mode::Pass => Duration::ZERO,
            Mode::Frozen => TICK,
            Mode::Delay(d) => match read_at.checked_add(d) {
                Some(due) => due.saturating_duration_since(Instant::now()).min(TICK),
                None => TICK, // a delay past the end of time: hold forever
            },
        };
        if !wait.is_zero() {
            thread::sleep(wait);
            continue;
        }
        match to.write(rest) {
            Ok(0) => {
                conn.close_rst();
                return false;
            }
            Ok(n) => rest = &rest[n..],
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                conn.close_rst();
                return false;
            }
        }
    }
    true
}

/// Closes `stream` with an RST instead of a FIN.
fn reset(stream: TcpStream) {
    let _ = SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// A socket timeout: `WouldBlock` on Unix, `TimedOut` on Windows.
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Locks, ignoring poison: a panicking test thread must not wedge the proxy.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
