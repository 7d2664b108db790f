//! What both servers' connections share: how long to wait for them, the
//! settings of their pools, and percent-encoding for URLs and cookies.

use std::time::Duration;

/// How long to wait for a TCP connection or a pooled connection.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one ordinary Redis command may take before the connection is
/// considered lost.
pub(crate) const REDIS_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// The settings both pools share: no test on check-out (a broken connection
/// shows on its next command), a bounded wait, one named helper thread.
pub(crate) fn pool_builder<M: r2d2::ManageConnection>(
    size: u32,
    thread_name: &str,
) -> r2d2::Builder<M> {
    r2d2::Pool::builder()
        .max_size(size)
        .min_idle(Some(1))
        .test_on_check_out(false)
        .connection_timeout(CONNECT_TIMEOUT)
        .error_handler(Box::new(r2d2::NopErrorHandler))
        .thread_pool(std::sync::Arc::new(
            scheduled_thread_pool::ScheduledThreadPool::builder()
                .num_threads(1)
                .thread_name_pattern(thread_name)
                .build(),
        ))
}

/// Whether an error's text says a signal interrupted its call (EINTR).
/// From the text: redis-rs keeps its I/O errors to itself.
pub(crate) fn interrupted(text: &str) -> bool {
    text.contains(&std::io::Error::from_raw_os_error(libc::EINTR).to_string())
}

/// A Redis error's text with a read or write timeout said as one: the socket's
/// own words for it are "Resource temporarily unavailable (os error 11)"
/// (EAGAIN), which left an operator looking for a resource (found by a
/// hostile test, with a Redis stopped by SIGSTOP).
pub(crate) fn plain(text: &str) -> String {
    let eagain = std::io::Error::from_raw_os_error(libc::EAGAIN).to_string();
    text.replace(&eagain, "timed out: no answer in time")
}

/// `%XX` escapes decoded (for a path in a URL query).
pub(crate) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Some(b) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every byte but `A-Z a-z 0-9 - _ . ~` as `%XX` (for a URL query value or
/// a cookie value).
pub(crate) fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_is_said_as_one() {
        let eagain = std::io::Error::from_raw_os_error(libc::EAGAIN).to_string();
        assert_eq!(
            plain(&format!("redis: {eagain}")),
            "redis: timed out: no answer in time"
        );
        assert_eq!(plain("connection refused"), "connection refused");
    }
}
