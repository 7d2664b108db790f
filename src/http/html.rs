//! HTML for the dead-letter page: escaping (payloads are untrusted input:
//! every byte that reaches the page goes through [`escape`], and a strict
//! Content-Security-Policy forbids scripts altogether, so even a missed
//! escape could not run anything), form decoding, and the page frame.

use std::fmt::Write as _;

use crate::http::server::text;
use crate::http::wire::Response;

const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// HTML-escapes text for element content and quoted attributes.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// Decodes `application/x-www-form-urlencoded` text.
pub(crate) fn decode(text: &str) -> String {
    // `+` first: an encoded `%2B` must stay a plus sign.
    crate::net::percent_decode(&text.replace('+', " "))
}

pub(crate) fn params(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

pub(crate) fn param<'a>(params: &'a [(String, String)], name: &str) -> Option<&'a str> {
    params
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

pub(crate) fn html(status: u16, title: &str, body: &str) -> Response {
    page(status, title, body, "")
}

/// A page that reloads itself every `secs` seconds (no script needed).
pub(crate) fn refreshing(title: &str, body: &str, secs: u32) -> Response {
    page(
        200,
        title,
        body,
        &format!("<meta http-equiv=\"refresh\" content=\"{secs}\">"),
    )
}

fn page(status: u16, title: &str, body: &str, head: &str) -> Response {
    let page = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\">{head}<title>{}</title><style>\
         body{{font-family:sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;width:100%}}\
         td,th{{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top;font-size:14px}}\
         th{{background:#f4f4f4}}pre{{background:#f7f7f7;padding:8px;white-space:pre-wrap;word-break:break-all}}\
         .kind{{font-family:monospace}}.msg{{padding:6px;background:#eef}}form.inline{{display:inline}}\
         </style></head><body>{body}</body></html>",
        escape(title)
    );
    text(status, "text/html; charset=utf-8", page).with_header("Content-Security-Policy", CSP)
}

/// The first `max` characters of `text` (then `…`); `escape` shows what
/// control characters it holds.
pub(crate) fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

pub(crate) fn time(ms: u64) -> String {
    crate::dlq::format_time(ms, false)
}

pub(crate) fn field_text(value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => text.to_owned(),
        Err(_) => {
            let hex: String = value.iter().map(|b| format!("{b:02x}")).collect();
            format!("0x{hex} (binary)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::percent_encode as encode;

    #[test]
    fn escaping_and_form_decoding() {
        assert_eq!(
            escape(r#""><img src=x onerror=alert(1)><script>"#),
            "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;"
        );
        assert_eq!(escape("a\u{1b}[31m"), "a\\u{1b}[31m");
        assert_eq!(decode("a+b%20c%3D%26"), "a b c=&");
        assert_eq!(decode("100%"), "100%");
        assert_eq!(encode("a b/é"), "a%20b%2F%C3%A9");
        assert_eq!(decode("%e9%"), "\u{fffd}%");
    }
}
