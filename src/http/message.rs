//! HTTP/1.1 messages: a [`Request`] parsed strictly from its head
//! (httparse; one Host, one digits-only Content-Length, no
//! Transfer-Encoding), and a [`Response`] whose headers cannot be split.

/// Headers per request at most (more: `431`).
const MAX_HEADERS: usize = 64;

/// One request: head and (bounded) body.
#[derive(Debug)]
pub(crate) struct Request {
    method: String,
    target: String,
    /// Names in lower case, in the order received.
    headers: Vec<(String, String)>,
    pub(super) body: Vec<u8>,
}

impl Request {
    /// `GET`, `POST`, ...
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The path of the target, still percent-encoded.
    pub fn path(&self) -> &str {
        self.target.split_once('?').map_or(&self.target, |(p, _)| p)
    }

    /// The query string, without `?`; empty when none.
    pub fn query(&self) -> &str {
        self.target.split_once('?').map_or("", |(_, q)| q)
    }

    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body (empty when the route takes none).
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// A request made up by a unit test.
    #[cfg(test)]
    pub fn made_up(method: &str, target: &str, headers: &[(&str, &str)]) -> Request {
        Request {
            method: method.into(),
            target: target.into(),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_ascii_lowercase(), (*v).to_owned()))
                .collect(),
            body: Vec::new(),
        }
    }
}

/// An answer. Header values are the program's own text; one with a line
/// break panics (and so becomes a `500`) rather than split the response.
#[derive(Debug)]
pub(crate) struct Response {
    pub(super) status: u16,
    pub(super) headers: Vec<(&'static str, String)>,
    pub(super) body: Vec<u8>,
}

impl Response {
    /// A response with a `Content-Type` and a body.
    pub fn new(status: u16, content_type: &str, body: impl Into<Vec<u8>>) -> Response {
        Response {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
        .with_header("Content-Type", content_type)
    }

    /// Adds a header.
    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Response {
        let value = value.into();
        assert!(
            !value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0),
            "header {name} with a line break"
        );
        self.headers.push((name, value));
        self
    }

    pub(crate) fn plain(status: u16, text: &str) -> Response {
        Response::new(status, "text/plain; charset=utf-8", format!("{text}\n"))
    }
}

/// Why a request got no answer from the service.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Answer with this status and text, then close.
    Answer(u16, String),
    /// The client left, or sent nothing at all: close without a word.
    Gone,
}

pub(crate) fn answer(status: u16, text: impl Into<String>) -> Failure {
    Failure::Answer(status, text.into())
}

/// Parses a request head from `buf`: `None` while incomplete; else the
/// request (no body yet), the head's length and the announced body length.
pub(crate) fn parse_head(buf: &[u8]) -> Result<Option<(Request, usize, Option<u64>)>, Failure> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut headers);
    let used = match parsed.parse(buf) {
        Ok(httparse::Status::Partial) => return Ok(None),
        Ok(httparse::Status::Complete(used)) => used,
        Err(httparse::Error::TooManyHeaders) => return Err(answer(431, "too many header fields")),
        Err(e) => return Err(answer(400, format!("malformed request: {e}"))),
    };
    let (Some(method), Some(target)) = (parsed.method, parsed.path) else {
        return Err(answer(400, "malformed request line"));
    };
    if !target.starts_with('/') {
        return Err(answer(400, "the target must be a path"));
    }
    let headers: Vec<(String, String)> = parsed
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).trim().to_owned(),
            )
        })
        .collect();
    let all = |name: &'static str| {
        headers
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    if all("transfer-encoding").next().is_some() {
        return Err(answer(
            501,
            "Transfer-Encoding is not supported; send a Content-Length",
        ));
    }
    if all("host").count() > 1 {
        return Err(answer(400, "more than one Host header"));
    }
    let mut lengths = all("content-length");
    let length = match (lengths.next(), lengths.next()) {
        (None, _) => None,
        (Some(_), Some(_)) => return Err(answer(400, "more than one Content-Length header")),
        (Some(text), None) => {
            Some(content_length(text).ok_or_else(|| answer(400, "malformed Content-Length"))?)
        }
    };
    let request = Request {
        method: method.to_owned(),
        target: target.to_owned(),
        headers,
        body: Vec::new(),
    };
    Ok(Some((request, used, length)))
}

/// `Content-Length`: ASCII digits only (no sign, no spaces, no list), and
/// within `u64`.
fn content_length(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Writes all of `data` before `deadline`.
pub(crate) fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        303 => "See Other",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        421 => "Misdirected Request",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<(Request, usize, Option<u64>)>, Failure> {
        parse_head(text.as_bytes())
    }

    fn refused(text: &str) -> u16 {
        match head(text) {
            Err(Failure::Answer(status, _)) => status,
            other => panic!("{text:?} was not refused: {other:?}"),
        }
    }

    #[test]
    fn content_length_is_digits_within_u64() {
        assert_eq!(content_length("0"), Some(0));
        assert_eq!(content_length("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "-1",
            "+1",
            " 1",
            "1,1",
            "0x10",
            "18446744073709551616",
            "1e3",
        ] {
            assert_eq!(content_length(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn heads_are_parsed_and_checked() {
        assert!(head("GET /healthz HTTP/1.1\r\nHost: a").unwrap().is_none());
        let (r, used, length) = head("GET /dlq?stream=s HTTP/1.1\r\nHOST: a:1\r\n\r\nrest")
            .unwrap()
            .unwrap();
        assert_eq!(
            (r.method(), r.path(), r.query()),
            ("GET", "/dlq", "stream=s")
        );
        assert_eq!((r.header("host"), used, length), (Some("a:1"), 41, None));
        let (_, _, length) = head("POST / HTTP/1.1\r\nContent-Length: 12\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(length, Some(12));

        assert_eq!(refused("GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"), 400);
        assert_eq!(
            refused("GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n"),
            400
        );
        assert_eq!(refused("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"), 400);
        assert_eq!(
            refused("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            501
        );
        assert_eq!(refused("GET http://a/ HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(refused("GET / HTTP/2.0\r\n\r\n"), 400);
        let many: String = (0..=MAX_HEADERS).map(|i| format!("X-{i}: 1\r\n")).collect();
        assert_eq!(refused(&format!("GET / HTTP/1.1\r\n{many}\r\n")), 431);
    }

    #[test]
    #[should_panic(expected = "line break")]
    fn header_values_cannot_split_the_response() {
        let _ = Response::plain(303, "").with_header("Location", "/\r\nSet-Cookie: x=1");
    }
}
