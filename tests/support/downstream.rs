//! A stand-in for the servers taskhub calls (a webhook receiver, an
//! `--http-url` target): a thread that accepts on a free loopback port, reads
//! each request (head with httparse, body by its Content-Length) on a thread
//! of its own, and answers what the test's closure says, then closes.
//! [`start_tls`] serves HTTPS (rustls) and requires a client certificate.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::certs::Certs;

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

    /// Every value of header `name` (any case), in the order sent.
    pub fn headers_named(&self, name: &str) -> Vec<String> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
            .collect()
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
    serve(TcpListener::bind("127.0.0.1:0").unwrap(), answer, None)
}

/// Starts the downstream on `addr` (a port the test chose, say one a
/// worker already tries to reach).
pub fn start_at(addr: &str, answer: impl Fn(Received) -> Answer + Send + Sync + 'static) {
    serve(TcpListener::bind(addr).unwrap(), answer, None);
}

/// Starts an HTTPS downstream with the server certificate of `certs`,
/// which accepts only clients with a certificate signed by the same CA
/// (mutual TLS); returns its `host:port`. A client that fails the handshake
/// never reaches `answer`.
pub fn start_tls(
    certs: &Certs,
    answer: impl Fn(Received) -> Answer + Send + Sync + 'static,
) -> String {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&certs.ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&certs.cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(&certs.key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(clients)
        .with_single_cert(chain, key)
        .unwrap();
    serve(
        TcpListener::bind("127.0.0.1:0").unwrap(),
        answer,
        Some(Arc::new(config)),
    )
}

fn serve(
    listener: TcpListener,
    answer: impl Fn(Received) -> Answer + Send + Sync + 'static,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> String {
    let addr = listener.local_addr().unwrap().to_string();
    let answer = Arc::new(answer);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let answer = answer.clone();
            let tls = tls.clone();
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
                match tls {
                    None => one(stream, answer.as_ref()),
                    Some(config) => {
                        let Ok(conn) = rustls::ServerConnection::new(config) else {
                            return;
                        };
                        one(rustls::StreamOwned::new(conn, stream), answer.as_ref());
                    }
                }
            });
        }
    });
    addr
}

fn one(mut stream: impl Read + Write, answer: &dyn Fn(Received) -> Answer) {
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
    let _ = stream.flush();
}
