//! What may be shown of a connection string or a URL: in errors, logs, dead
//! letters, the page, alerts and `Debug` output.
//!
//! Only `scheme://host:port/path` is ever shown: no user, no password, no
//! query string (an `api_key=` or `password=` there), no fragment. Every
//! element of a comma-separated list (the seed nodes of a Redis Cluster)
//! is shown that way. A PostgreSQL key-value string (`host=db password=x`),
//! parsed by libpq's rules (spaces around `=`, single-quoted values with
//! backslash escapes), shows only `host`, `hostaddr`, `port` and `dbname`.
//! Anything that does not parse is not shown at all: a password with an
//! unencoded `/`, `@` or `#` breaks a URL in ways a hand-written scanner
//! gets wrong, so the parser's verdict is trusted, never a guess.

/// `url` as it may be shown: `scheme://host:port/path` for each element of
/// a comma-separated list, the host, port and database of a PostgreSQL
/// key-value string, and a placeholder for anything that does not parse:
/// `postgres://app:s3cret@db:5432/orders?sslmode=require` is shown as
/// `postgres://db:5432/orders`, `host=db user=app password='a b'
/// dbname=orders` as `host=db dbname=orders`.
pub(crate) fn redact(url: &str) -> String {
    let url = url.trim();
    if !url.contains("://") && url.contains('=') {
        return key_value(url)
            .unwrap_or_else(|| "(a connection string that does not parse)".into());
    }
    url.split(',')
        .map(|one| shown(one.trim(), true))
        .collect::<Vec<_>>()
        .join(",")
}

/// A webhook URL as it may be shown: `scheme://host:port` only, since the
/// path of many webhooks (Slack's, for one) is the secret.
pub(crate) fn redact_webhook(url: &str) -> String {
    shown(url.trim(), false)
}

fn shown(one: &str, with_path: bool) -> String {
    let Ok(parsed) = url::Url::parse(one) else {
        let scheme = one
            .split_once("://")
            .map(|(s, _)| s)
            .filter(|s| {
                s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            })
            .unwrap_or("?");
        return format!("{scheme}://(a URL that does not parse)");
    };
    let mut out = format!("{}://", parsed.scheme());
    if let Some(host) = parsed.host_str() {
        out.push_str(host);
    }
    if let Some(port) = parsed.port() {
        out.push_str(&format!(":{port}"));
    }
    if with_path {
        out.push_str(parsed.path());
    }
    out
}

/// The shown part of a libpq key-value string, `None` if it does not parse.
fn key_value(text: &str) -> Option<String> {
    let mut shown = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| c.is_ascii_alphanumeric() || *c == '_') {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if key.is_empty() || chars.next() != Some('=') {
            return None;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next()? {
                    '\\' => value.push(chars.next()?),
                    '\'' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(chars.next()?);
                } else {
                    value.push(c);
                }
            }
        }
        if ["host", "hostaddr", "port", "dbname"].contains(&key.as_str()) {
            shown.push(format!("{key}={value}"));
        }
    }
    Some(shown.join(" "))
}

/// `text` (a client library's error message, say) with every secret part of
/// `url` replaced by `***`: the whole URL, its password, user and query
/// values. For messages that quote what they were given.
pub(crate) fn scrub(text: &str, url: &str) -> String {
    let mut secrets: Vec<String> = vec![url.to_owned()];
    if let Ok(parsed) = url::Url::parse(url.trim()) {
        secrets.extend(parsed.password().map(str::to_owned));
        if !parsed.username().is_empty() {
            secrets.push(parsed.username().to_owned());
        }
        secrets.extend(parsed.query().map(str::to_owned));
        secrets.extend(parsed.query_pairs().map(|(_, v)| v.into_owned()));
        secrets.extend(parsed.fragment().map(str::to_owned));
    }
    secrets.retain(|s| s.len() >= 3);
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_owned();
    for secret in secrets {
        out = out.replace(&secret, "***");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_examples() {
        assert_eq!(
            redact("postgres://app:s3cret@db:5432/orders?sslmode=require"),
            "postgres://db:5432/orders"
        );
        assert_eq!(
            redact("host=db user=app password='a b' dbname=orders"),
            "host=db dbname=orders"
        );
    }

    #[test]
    fn only_scheme_host_port_and_path_are_shown() {
        for (url, want) in [
            (
                "postgres://user:s3cret@db:5432/app",
                "postgres://db:5432/app",
            ),
            ("redis://:pw@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            (
                "postgres://db/app?password=x&sslmode=require",
                "postgres://db/app",
            ),
            (
                "https://svc:PASS@host/ingest?api_key=KEY#frag",
                "https://host/ingest",
            ),
            (
                "rediss://u:a@a:7000,rediss://u:b@b:7001",
                "rediss://a:7000,rediss://b:7001",
            ),
            (
                "postgres://u:pa/ss@db/app",
                "postgres://(a URL that does not parse)",
            ),
            (
                "redis://:pa#ss@h:6379",
                "redis://(a URL that does not parse)",
            ),
            ("rediss://h:6380/#insecure", "rediss://h:6380/"),
            ("postgres://[::1]:5432/x", "postgres://[::1]:5432/x"),
        ] {
            assert_eq!(redact(url), want, "{url}");
        }
    }

    #[test]
    fn key_value_strings_follow_libpq() {
        for (text, want) in [
            (
                "host=db user=me password=hunter2 dbname=x",
                "host=db dbname=x",
            ),
            ("host = db password = x port=5433", "host=db port=5433"),
            (
                "password='a b' host='/var/run/pg' dbname='x'",
                "host=/var/run/pg dbname=x",
            ),
            (r"password='a\' host=evil' dbname=real", "dbname=real"),
            // libpq escapes with backslashes, not doubled quotes.
            (
                "dbname='it''s' password=x",
                "(a connection string that does not parse)",
            ),
            (
                "host=db password='unterminated",
                "(a connection string that does not parse)",
            ),
        ] {
            assert_eq!(redact(text), want, "{text}");
        }
    }

    #[test]
    fn webhooks_show_no_path() {
        assert_eq!(
            redact_webhook("https://hooks.slack.com/services/T0/B0/XYZ"),
            "https://hooks.slack.com"
        );
    }

    #[test]
    fn messages_lose_every_secret_part() {
        let url = "https://svc:PASSWORD@host/ingest?api_key=KEY123";
        let text = format!("bad uri {url}; auth PASSWORD; key KEY123");
        let clean = scrub(&text, url);
        for secret in ["PASSWORD", "KEY123", "svc:"] {
            assert!(!clean.contains(secret), "{clean}");
        }
    }
}
