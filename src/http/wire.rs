//! A small synchronous HTTP/1.1 server: the accept loop, one thread per
//! connection up to a cap, reading a request and writing its answer within
//! deadlines (the messages themselves are `message.rs`).
//! Nothing here knows about taskhub: `http_server.rs` hands it a [`Service`]
//! (the routes) and gets the same defences on every request:
//!
//! - at most `max_connections` connections at once; one more gets a canned
//!   `503` from the accept loop itself and is closed, no thread started;
//!   each connection's slot is a guard released in `Drop`, so neither a
//!   panic nor an early return can leak it;
//! - the head must arrive whole within `head_timeout` and `max_head_bytes`
//!   (read in 4 KiB chunks into one buffer that never grows past that:
//!   `431`), the body within `body_timeout`, and the client must take the
//!   answer within `write_timeout`;
//! - `Content-Length` is parsed strictly (digits only, one header, no
//!   overflow: `400`) and checked against the route's body limit before a
//!   byte of body is read or allocated (`413`); `Transfer-Encoding` is not
//!   supported (`501`);
//! - one request per connection, `Connection: close`; after an error the
//!   connection is closed, never read to the end of what the client claims
//!   to send;
//! - a panicking route answers `500` and costs that request only;
//! - the accept loop never waits on a client: it polls a non-blocking
//!   listener and checks its stop flag every 20 ms; once stopped it waits at
//!   most `shutdown_grace` for open connections, which end by their own
//!   timeouts anyway.
//!
//! Every response also carries `Cache-Control: no-store`,
//! `X-Content-Type-Options: nosniff` and `Referrer-Policy: no-referrer`.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::http::message::{answer, parse_head, reason, Failure};
pub(crate) use crate::http::message::{Request, Response};

/// The limits of one server.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Connections served at once; more are answered `503` and closed.
    pub max_connections: usize,
    /// The request line and headers must arrive within this time.
    pub head_timeout: Duration,
    /// The body must arrive within this time after the head.
    pub body_timeout: Duration,
    /// The client must take the whole answer within this time.
    pub write_timeout: Duration,
    /// Largest request head (request line and headers), in bytes.
    pub max_head_bytes: usize,
    /// How long a stopped server waits for connections still open.
    pub shutdown_grace: Duration,
    /// The name of every connection thread.
    pub thread_name: &'static str,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            max_connections: 16,
            head_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(20),
            max_head_bytes: 16 * 1024,
            shutdown_grace: Duration::from_secs(1),
            thread_name: "http-connection",
        }
    }
}

/// The routes: what the server asks of its user.
pub(crate) trait Service: Send + Sync + 'static {
    /// The largest body the request may carry, judged from its head (the
    /// body is not read yet); 0 for none. A longer `Content-Length` is
    /// answered `413` without reading the body; a request without one is
    /// answered `411` when this is not 0.
    fn body_limit(&self, head: &Request) -> usize;

    /// Answers a complete request, on its connection's thread.
    fn respond(&self, request: &Request) -> Response;
}

/// Headers every response carries.
const ALWAYS: &str = "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n\
                      Referrer-Policy: no-referrer\r\nConnection: close\r\n";

/// What the accept loop writes to a connection over the cap.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\
    Content-Length: 5\r\nRetry-After: 1\r\nCache-Control: no-store\r\n\
    X-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\n\
    Connection: close\r\n\r\nbusy\n";

/// How often the accept loop looks for new connections and the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// Bytes read per call, into a buffer on the stack.
const CHUNK: usize = 4096;

/// After the answer, at most this much of what the client still sends is
/// read (and thrown away), for at most [`LINGER_TIME`]: see [`linger`].
const LINGER_BYTES: usize = 64 * 1024;
const LINGER_TIME: Duration = Duration::from_millis(500);

/// Binds a listener for [`serve`]: non-blocking, so that accepting never
/// waits on a client and the stop flag is seen.
pub(crate) fn bind(addr: &str) -> io::Result<TcpListener> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Serves connections from `listener` (made by [`bind`]) until `stopped()`
/// says so, then waits at most `shutdown_grace` for those still open.
pub(crate) fn serve(
    listener: &TcpListener,
    settings: &Settings,
    service: &Arc<dyn Service>,
    stopped: &dyn Fn() -> bool,
) {
    let open = Arc::new(AtomicUsize::new(0));
    while !stopped() {
        match listener.accept() {
            Ok((stream, _)) => admit(stream, settings, &open, service),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                ) => {}
            Err(e) => {
                // Out of file descriptors, say: the connection waits in the
                // backlog; do not spin on it.
                log::warn!("http: cannot accept a connection: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    let deadline = Instant::now() + settings.shutdown_grace;
    while open.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One of the `max_connections` places; given back when dropped.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        open.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| Slot(open.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Starts a thread for `stream`, or answers `503` when every slot is taken.
fn admit(
    stream: TcpStream,
    settings: &Settings,
    open: &Arc<AtomicUsize>,
    service: &Arc<dyn Service>,
) {
    let Some(slot) = Slot::take(open, settings.max_connections) else {
        refuse(stream);
        return;
    };
    let (settings, service) = (settings.clone(), service.clone());
    let spawned = std::thread::Builder::new()
        .name(settings.thread_name.into())
        .spawn(move || {
            let _slot = slot;
            connection(stream, &settings, service.as_ref());
        });
    // On failure the closure, and with it the slot and the stream, is dropped.
    if let Err(e) = spawned {
        log::error!("http: cannot start a connection thread: {e}");
    }
}

/// The answer to a connection over the cap, from the accept loop: it must
/// not wait, so the socket is non-blocking; a fresh socket's send buffer
/// takes these few bytes at once. What the client already sent is read
/// first (one call), so that closing does not reset the connection.
fn refuse(mut stream: TcpStream) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let mut sink = [0u8; CHUNK];
    let _ = stream.read(&mut sink);
    let _ = stream.write(BUSY);
    let _ = stream.shutdown(Shutdown::Write);
}

/// Serves one connection: one request, one answer, close.
fn connection(mut stream: TcpStream, settings: &Settings, service: &dyn Service) {
    // Accepted sockets may inherit the listener's non-blocking mode.
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let _ = stream.set_nodelay(true);
    let (response, head_only) = match read_request(&mut stream, settings, service) {
        Ok(request) => {
            let response = catch_unwind(AssertUnwindSafe(|| service.respond(&request)))
                .unwrap_or_else(|_| {
                    log::error!("http: {} {} panicked", request.method(), request.path());
                    Response::plain(500, "internal error")
                });
            (response, request.method() == "HEAD")
        }
        Err(Failure::Answer(status, text)) => {
            log::debug!("http: request refused with {status}: {text}");
            (Response::plain(status, &text), false)
        }
        Err(Failure::Gone) => return,
    };
    let deadline = Instant::now() + settings.write_timeout;
    if let Err(e) = write_response(&mut stream, &response, head_only, deadline) {
        log::debug!("http: cannot answer: {e}");
        return;
    }
    linger(&mut stream);
}

/// Reads into `buf` what arrives before `deadline`.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<usize> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_read_timeout(Some(left))?;
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Reads and checks one request head, then its body if the service takes it.
fn read_request(
    stream: &mut TcpStream,
    settings: &Settings,
    service: &dyn Service,
) -> Result<Request, Failure> {
    let deadline = Instant::now() + settings.head_timeout;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; CHUNK];
    let (mut request, used, length) = loop {
        let n = match read_by(stream, &mut chunk, deadline) {
            // A connection that never sent a byte (a browser's
            // preconnect) is closed without an answer.
            Ok(0) => return Err(Failure::Gone),
            Err(e) if timed_out(&e) && !buf.is_empty() => {
                return Err(answer(408, "the request head took too long"))
            }
            Err(_) => return Err(Failure::Gone),
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        // A head ends with a line feed: parsing again only when one came
        // keeps a client that sends a byte at a time from costing a parse
        // of the whole buffer per byte.
        let parsed = if chunk[..n].contains(&b'\n') {
            parse_head(&buf)?
        } else {
            None
        };
        match parsed {
            Some((_, used, _)) if used > settings.max_head_bytes => break Err(()),
            Some(head) => break Ok(head),
            None if buf.len() >= settings.max_head_bytes => break Err(()),
            None => {}
        }
    }
    .map_err(|()| answer(431, "request head too large"))?;

    let limit = service.body_limit(&request);
    let length = match length {
        None if limit > 0 => return Err(answer(411, "a Content-Length is required")),
        None | Some(0) => return Ok(request),
        Some(n) if limit == 0 => {
            return Err(answer(
                413,
                format!("no body expected, {n} bytes announced"),
            ))
        }
        Some(n) if n > limit as u64 => return Err(answer(413, format!("body over {limit} bytes"))),
        // At most `limit`, so this fits and is small.
        Some(n) => n as usize,
    };
    if request
        .header("expect")
        .is_some_and(|e| e.eq_ignore_ascii_case("100-continue"))
    {
        let deadline = Instant::now() + settings.write_timeout;
        write_by(stream, b"HTTP/1.1 100 Continue\r\n\r\n", deadline).map_err(|_| Failure::Gone)?;
    }
    let mut body = Vec::with_capacity(length);
    let early = &buf[used..];
    body.extend_from_slice(&early[..early.len().min(length)]);
    let deadline = Instant::now() + settings.body_timeout;
    while body.len() < length {
        let want = (length - body.len()).min(CHUNK);
        match read_by(stream, &mut chunk[..want], deadline) {
            Ok(0) => return Err(Failure::Gone),
            Ok(n) => body.extend_from_slice(&chunk[..n]),
            Err(e) if timed_out(&e) => return Err(answer(408, "the body took too long")),
            Err(_) => return Err(Failure::Gone),
        }
    }
    request.body = body;
    Ok(request)
}

fn write_by(stream: &mut TcpStream, mut data: &[u8], deadline: Instant) -> io::Result<()> {
    while !data.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(&data[..data.len().min(64 * 1024)]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_response(
    stream: &mut TcpStream,
    response: &Response,
    head_only: bool,
    deadline: Instant,
) -> io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\n",
        response.status,
        reason(response.status)
    );
    for (name, value) in &response.headers {
        head.push_str(name);
        head.push_str(": ");
        head.push_str(value);
        head.push_str("\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n", response.body.len()));
    head.push_str(ALWAYS);
    head.push_str("\r\n");
    write_by(stream, head.as_bytes(), deadline)?;
    if !head_only {
        write_by(stream, &response.body, deadline)?;
    }
    Ok(())
}

/// After the answer: sends FIN, then reads and throws away what the client
/// still sends, at most [`LINGER_BYTES`] for at most [`LINGER_TIME`], into
/// a buffer on the stack. Closing a socket with unread input makes the
/// kernel reset the connection, and a reset can destroy the answer before
/// the client reads it; this short, bounded wait lets a client that sent
/// more than we read (a body we refused) see why. It is not a drain: past
/// either bound the connection is closed whatever the client still sends.
fn linger(stream: &mut TcpStream) {
    if stream.shutdown(Shutdown::Write).is_err() {
        return;
    }
    let deadline = Instant::now() + LINGER_TIME;
    let mut sink = [0u8; CHUNK];
    let mut left = LINGER_BYTES;
    while left > 0 {
        match read_by(stream, &mut sink, deadline) {
            Ok(n) if n > 0 => left = left.saturating_sub(n),
            _ => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_given_back_when_dropped() {
        let open = Arc::new(AtomicUsize::new(0));
        let a = Slot::take(&open, 2).unwrap();
        let b = Slot::take(&open, 2).unwrap();
        assert!(Slot::take(&open, 2).is_none());
        drop(a);
        let c = std::thread::spawn({
            let open = open.clone();
            move || {
                let _c = Slot::take(&open, 2).unwrap();
                panic!("a connection thread panics");
            }
        });
        assert!(c.join().is_err());
        assert_eq!(
            open.load(Ordering::SeqCst),
            1,
            "the panic gave its slot back"
        );
        drop(b);
        assert_eq!(open.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_panicking_route_costs_its_request_only() {
        struct Routes;
        impl Service for Routes {
            fn body_limit(&self, _: &Request) -> usize {
                0
            }
            fn respond(&self, request: &Request) -> Response {
                assert_ne!(request.path(), "/panic", "a bug in a route");
                Response::plain(200, "ok")
            }
        }
        let listener = bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let server = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let settings = Settings {
                    max_connections: 2,
                    ..Settings::default()
                };
                let routes: Arc<dyn Service> = Arc::new(Routes);
                serve(&listener, &settings, &routes, &|| {
                    stop.load(Ordering::SeqCst)
                });
            }
        });
        let ask = |path: &str| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\n\r\n").as_bytes())
                .unwrap();
            let mut reply = String::new();
            s.read_to_string(&mut reply).unwrap();
            reply
        };
        // More panics than slots: each one gave its slot back.
        for _ in 0..3 {
            assert!(ask("/panic").starts_with("HTTP/1.1 500 "));
        }
        let ok = ask("/ok");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("\r\nConnection: close\r\n") && ok.ends_with("\r\n\r\nok\n"),
            "{ok}"
        );
        stop.store(true, Ordering::SeqCst);
        server.join().unwrap();
    }
}
