//! The built-in HTTP handler of `taskhub run --http-url`: POSTs each event to
//! a downstream service with a synchronous client (ureq).
//!
//! The request carries the payload as its body, `Idempotency-Key: <event_id>`,
//! and the other fields in `X-Taskhub-Fields` (a JSON object, ASCII-escaped).
//! A 2xx commits the event's `processed_events` row; 408, 429, 5xx and
//! timeouts are retryable and honour `Retry-After` (seconds or an HTTP
//! date); other statuses are permanent. A downstream that cannot be reached
//! at all (connection refused, a name that does not resolve, a connection
//! reset while new ones are refused too) is an outage, like a database that is down: the worker pauses and tries again,
//! and no attempt is counted. Retries follow the handler's own budget,
//! [`HTTP_BUDGET`] unless told otherwise. An HTTP call cannot be rolled
//! back: if the process dies after the downstream accepted the event but before
//! the commit, the event is sent again with the same `Idempotency-Key`, which
//! the downstream must use to deduplicate.

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::error::{Error, HandlerError};
use crate::event::Event;
use crate::handler::{Handler, RetryBudget, Tx};
use crate::redact::{redact, scrub};
use crate::tls::Tls;

/// Largest `X-Taskhub-Fields` header, in bytes: an event whose other fields
/// take more is invalid for this handler (no downstream takes headers of
/// any size, and a request that can never be sent must not be retried).
const MAX_FIELDS_HEADER: usize = 8 * 1024;

/// Headers [`HttpHandler::header`] refuses (in any case): the ones the
/// handler writes itself (a second copy would be sent beside its own), and
/// the ones that frame the request or the connection, which the HTTP client
/// writes (`Content-Length` beside `Transfer-Encoding` is the shape of
/// request smuggling). `User-Agent`, `Accept` and `Accept-Encoding` may be
/// given: the client then leaves its own out.
const RESERVED_HEADERS: [&str; 14] = [
    "Idempotency-Key",
    "X-Taskhub-Fields",
    "X-Taskhub-Stream",
    "X-Taskhub-Entry-Id",
    "Host",
    "Content-Length",
    "Transfer-Encoding",
    "Connection",
    "Keep-Alive",
    "Proxy-Connection",
    "Upgrade",
    "TE",
    "Trailer",
    "Expect",
];

/// The retry budget of [`HttpHandler`] by default: 8 attempts, waits from
/// 1 s doubling up to 60 s (about 2 minutes in all before an event is
/// dead-lettered as exhausted), enough to ride out a deploy or a rate
/// limit of the downstream.
pub const HTTP_BUDGET: RetryBudget = RetryBudget {
    max_attempts: 8,
    base: Duration::from_secs(1),
    cap: Duration::from_secs(60),
};

/// POSTs each event to one URL.
#[derive(Clone)]
pub struct HttpHandler {
    url: String,
    budget: RetryBudget,
    /// `url` as it may be shown (see `redact.rs`).
    shown: String,
    /// Extra headers for every request (downstream authentication).
    headers: Vec<(String, String)>,
    agent: ureq::Agent,
}

impl fmt::Debug for HttpHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("HttpHandler")
            .field("url", &self.shown)
            .field("headers", &names)
            .finish()
    }
}

impl HttpHandler {
    /// A handler posting to `url`, failing a request after `timeout`. An
    /// `https://` URL is verified with `tls` (its CA file, else the system's
    /// trust store) and gets its client certificate, if it has one
    /// (`Tls::default()` for neither). Fails when a TLS file cannot be read.
    pub fn new(url: &str, timeout: Duration, tls: &Tls) -> Result<HttpHandler, Error> {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(timeout))
            .user_agent("taskhub")
            .tls_config(crate::tls::ureq_tls(url, tls)?)
            .build();
        Ok(HttpHandler {
            budget: HTTP_BUDGET,
            url: url.to_owned(),
            shown: redact(url),
            headers: Vec::new(),
            agent: config.into(),
        })
    }

    /// Retries with `budget` instead of [`HTTP_BUDGET`].
    pub fn retry_budget(mut self, budget: RetryBudget) -> HttpHandler {
        self.budget = budget;
        self
    }

    /// Adds a header to every request, such as `Authorization: Bearer ...`
    /// (its value is never logged). Fails for a name or value that cannot
    /// be an HTTP header.
    pub fn header(mut self, name: &str, value: &str) -> Result<HttpHandler, Error> {
        let name_ok = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !name_ok {
            return Err(Error::config(format!("bad HTTP header name {name:?}")));
        }
        if RESERVED_HEADERS
            .iter()
            .any(|r| r.eq_ignore_ascii_case(name))
        {
            return Err(Error::config(format!(
                "HTTP header {name} cannot be set: taskhub or its HTTP client writes it on every \
                 request, and a second one would make the request ambiguous"
            )));
        }
        if !value
            .bytes()
            .all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
        {
            return Err(Error::config(format!(
                "the value of HTTP header {name} has characters a header cannot carry"
            )));
        }
        self.headers
            .push((name.to_owned(), value.trim().to_owned()));
        Ok(self)
    }

    /// The other fields of `event` as the `X-Taskhub-Fields` header.
    fn fields_header(event: &Event) -> Result<String, HandlerError> {
        let mut others = serde_json::Map::new();
        for (k, v) in event.fields() {
            if k == b"payload" {
                continue;
            }
            let (Ok(k), Ok(v)) = (std::str::from_utf8(k), std::str::from_utf8(v)) else {
                return Err(HandlerError::invalid(
                    "a field other than payload is not UTF-8, so it cannot be sent as a header",
                ));
            };
            others.insert(k.to_owned(), v.into());
        }
        let header = ascii_json(&serde_json::Value::Object(others).to_string());
        if header.len() > MAX_FIELDS_HEADER {
            return Err(HandlerError::invalid(format!(
                "the fields other than payload take {} bytes as a header, over the limit of {MAX_FIELDS_HEADER}",
                header.len()
            )));
        }
        Ok(header)
    }
}

/// `text` with every byte a header value cannot carry percent-encoded.
fn header_safe(text: &str) -> std::borrow::Cow<'_, str> {
    if text.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b'%') {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for b in text.bytes() {
        if (0x21..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out.into()
}

/// JSON with every non-ASCII character (and DEL) escaped, so it fits in a
/// header (serde_json escapes the other control characters).
fn ascii_json(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if c.is_ascii() && c != '\u{7f}' {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// Whether `e` says the downstream could not be reached at all: nothing
/// was sent (its name does not resolve, it refuses connections), or the
/// connection broke before an answer and the downstream does not accept a
/// new one either. A downstream that accepts connections and then breaks
/// the request is reachable, and the event fails (its attempts count): a
/// TLS server refusing our certificate is seen, with TLS 1.3, only as a
/// broken pipe when the request is sent, and waiting for it would wait for
/// ever. Not a timeout: a request that timed out may have been processed
/// and counts as an attempt.
fn unreachable(e: &ureq::Error, url: &str) -> bool {
    use std::io::ErrorKind::{
        BrokenPipe, ConnectionAborted, ConnectionRefused, ConnectionReset, HostUnreachable,
        NetworkUnreachable, NotConnected, UnexpectedEof,
    };
    match e {
        ureq::Error::HostNotFound | ureq::Error::ConnectionFailed => true,
        ureq::Error::Io(io) => match io.kind() {
            ConnectionRefused | HostUnreachable | NetworkUnreachable => true,
            ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected | UnexpectedEof => {
                !accepts_connections(url)
            }
            // std's resolver errors have no kind of their own (getaddrinfo:
            // "Name or service not known", "Temporary failure in name
            // resolution").
            _ => io
                .to_string()
                .starts_with("failed to lookup address information"),
        },
        _ => false,
    }
}

/// Whether the host and port of `url` accept a TCP connection (within a
/// second).
fn accepts_connections(url: &str) -> bool {
    use std::net::{TcpStream, ToSocketAddrs};
    let Ok(uri) = url.parse::<ureq::http::Uri>() else {
        return false;
    };
    let Some(host) = uri.host() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let default_port = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    let port = uri.port_u16().unwrap_or(default_port);
    let Ok(addrs) = (host, port).to_socket_addrs() else {
        return false;
    };
    addrs
        .into_iter()
        .any(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok())
}

/// Marks an outage as the downstream's (not the database's or Redis'):
/// the worker says which server is down, and a lost connection to it is no
/// strike against the event.
#[derive(Debug)]
pub(crate) struct Downstream;

impl fmt::Display for Downstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the downstream HTTP service cannot be reached")
    }
}

impl std::error::Error for Downstream {}

/// Parses a `Retry-After` value: delay in seconds, or an HTTP date.
pub(crate) fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

impl Handler for HttpHandler {
    fn handle(&self, event: &Event, _tx: &mut Tx<'_>) -> Result<(), HandlerError> {
        let fields = HttpHandler::fields_header(event)?;
        let body = event.field("payload").unwrap_or_default();
        let mut request = self
            .agent
            .post(&self.url)
            .header("Idempotency-Key", header_safe(event.event_id()).as_ref())
            .header("X-Taskhub-Fields", fields)
            .header("X-Taskhub-Stream", header_safe(event.stream()).as_ref())
            .header("X-Taskhub-Entry-Id", event.entry_id());
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        // The payload's type, unless `--http-header` gave one: then that
        // one alone (both went, and the receiver took either).
        if !self
            .headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        {
            request = request.content_type("application/octet-stream");
        }
        let sent = request.send(body);
        let response = match sent {
            Ok(r) => r,
            Err(e) => {
                let why = scrub(&e.to_string(), &self.url);
                let message = format!("POST {}: {why}", self.shown);
                return Err(if unreachable(&e, &self.url) {
                    HandlerError::outage(message).with_source(Downstream)
                } else {
                    HandlerError::retryable(message)
                });
            }
        };
        let status = response.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(());
        }
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let message = format!("POST {}: HTTP {status}", self.shown);
        if status == 408 || status == 429 || status >= 500 {
            let error = HandlerError::retryable(message);
            Err(match retry_after {
                Some(after) => error.with_retry_after(after),
                None => error,
            })
        } else {
            Err(HandlerError::permanent(message))
        }
    }

    /// An event whose other fields cannot become a header is invalid here,
    /// before any request is made.
    fn validate(&self, event: &Event) -> Result<(), HandlerError> {
        HttpHandler::fields_header(event).map(|_| ())
    }

    fn retry_budget(&self) -> Option<RetryBudget> {
        Some(self.budget)
    }

    /// A POST cannot be rolled back: one event per transaction, so a
    /// failing event never makes its neighbours call the downstream again.
    fn supports_batches(&self) -> bool {
        false
    }

    fn name(&self) -> &str {
        "http"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(parse_retry_after("1", now), Some(Duration::from_secs(1)));
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:50:37 GMT", now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:48:37 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn header_values_are_made_safe() {
        assert_eq!(header_safe("order-42"), "order-42");
        assert_eq!(header_safe("é 1%"), "%C3%A9%201%25");
        assert_eq!(ascii_json("a\u{7f}"), "a\\u007f");
        assert!(
            HttpHandler::new("http://h/", Duration::from_secs(1), &Tls::default())
                .unwrap()
                .header("Authorization", "Bearer x")
                .is_ok()
        );
        assert!(
            HttpHandler::new("http://h/", Duration::from_secs(1), &Tls::default())
                .unwrap()
                .header("Bad Name", "x")
                .is_err()
        );
        assert!(
            HttpHandler::new("http://h/", Duration::from_secs(1), &Tls::default())
                .unwrap()
                .header("X-Key", "a\nb")
                .is_err()
        );
        for name in [
            "content-length",
            "Transfer-Encoding",
            "HOST",
            "idempotency-key",
        ] {
            let e = HttpHandler::new("http://h/", Duration::from_secs(1), &Tls::default())
                .unwrap()
                .header(name, "x")
                .unwrap_err();
            assert!(e.to_string().contains(name), "{e}");
        }
        let debug = format!(
            "{:?}",
            HttpHandler::new(
                "https://u:PASS@h/p?k=SECRET",
                Duration::from_secs(1),
                &Tls::default()
            )
            .unwrap()
            .header("Authorization", "Bearer TOKEN")
            .unwrap()
        );
        for secret in ["PASS", "SECRET", "TOKEN"] {
            assert!(!debug.contains(secret), "{debug}");
        }
    }

    #[test]
    fn header_json_is_ascii() {
        assert_eq!(
            ascii_json(r#"{"a":"é😀"}"#),
            r#"{"a":"\u00e9\ud83d\ude00"}"#
        );
    }
}
