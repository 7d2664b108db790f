//! The built-in HTTP handler of `taskhub run --http-url`: POSTs each event to
//! a downstream service with a synchronous client (ureq).
//!
//! The request carries the payload as its body, `Idempotency-Key: <event_id>`,
//! and the other fields in `X-Taskhub-Fields` (a JSON object, ASCII-escaped).
//! A 2xx commits the event's `processed_events` row; 408, 429, 5xx, timeouts
//! and connection errors are retryable and honour `Retry-After` (seconds or an
//! HTTP date); other statuses are permanent. An HTTP call cannot be rolled
//! back: if the process dies after the downstream accepted the event but before
//! the commit, the event is sent again with the same `Idempotency-Key`, which
//! the downstream must use to deduplicate.

use std::time::{Duration, SystemTime};

use crate::error::{Error, HandlerError};
use crate::event::Event;
use crate::handler::{Handler, Tx};
use crate::tls::Tls;

/// POSTs each event to one URL.
#[derive(Debug, Clone)]
pub struct HttpHandler {
    url: String,
    agent: ureq::Agent,
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
            url: url.to_owned(),
            agent: config.into(),
        })
    }
}

/// JSON with every non-ASCII character escaped, so it fits in a header.
fn ascii_json(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if c.is_ascii() {
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
        let mut others = serde_json::Map::new();
        for (k, v) in event.fields() {
            if k.as_slice() == b"payload" {
                continue;
            }
            let (Ok(k), Ok(v)) = (std::str::from_utf8(k), std::str::from_utf8(v)) else {
                return Err(HandlerError::invalid(
                    "a field other than payload is not UTF-8",
                ));
            };
            others.insert(k.to_owned(), v.into());
        }
        let fields = serde_json::Value::Object(others).to_string();
        let body = event.field("payload").unwrap_or_default();
        let sent = self
            .agent
            .post(&self.url)
            .header("Idempotency-Key", event.event_id())
            .header("X-Taskhub-Fields", ascii_json(&fields))
            .header("X-Taskhub-Stream", event.stream())
            .header("X-Taskhub-Entry-Id", event.entry_id())
            .content_type("application/octet-stream")
            .send(body);
        let response = match sent {
            Ok(r) => r,
            Err(e) => return Err(HandlerError::retryable(format!("POST {}: {e}", self.url))),
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
        let message = format!("POST {}: HTTP {status}", self.url);
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
    fn header_json_is_ascii() {
        assert_eq!(
            ascii_json(r#"{"a":"é😀"}"#),
            r#"{"a":"\u00e9\ud83d\ude00"}"#
        );
    }
}
