//! A stand-in for the servers taskhub calls (a webhook receiver, an
//! `--http-url` target): a thread that accepts on a free loopback port, reads
//! each request (head with httparse, body by its Content-Length) on a thread
//! of its own, and answers what the test's closure says, then closes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// One request as the downstream received it.
pub struct Received {
    pub path: String,
    headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Received {
    /// The value of header `name` (any case), or "".
    pub fn header(&self, name: &str) -> String {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }
}

/// What to answer: a status, extra headers, and how long to wait first.
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub delay: Duration,
}

impl Answer {
    pub fn status(status: u16) -> Answer {
        Answer {
            status,
            headers: Vec::new(),
            delay: Duration::ZERO,
        }
    }
}

/// Starts the downstream; returns its `host:port`.
pub fn start(answer: impl Fn(Received) -> Answer + Send + Sync + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let answer = Arc::new(answer);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let answer = answer.clone();
            std::thread::spawn(move || one(stream, answer.as_ref()));
        }
    });
    addr
}

fn one(mut stream: TcpStream, answer: &dyn Fn(Received) -> Answer) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let (received, length, used) = loop {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut request = httparse::Request::new(&mut headers);
        if let Ok(httparse::Status::Complete(used)) = request.parse(&buf) {
            let headers: Vec<(String, String)> = request
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_owned(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect();
            let length = headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            let received = Received {
                path: request.path.unwrap_or("").to_owned(),
                headers,
                body: Vec::new(),
            };
            break (received, length, used);
        }
    };
    let mut body = buf.split_off(used);
    while body.len() < length {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    body.truncate(length);
    let reply = answer(Received { body, ..received });
    std::thread::sleep(reply.delay);
    let mut head = format!(
        "HTTP/1.1 {} X\r\nContent-Length: 0\r\nConnection: close\r\n",
        reply.status
    );
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
}
