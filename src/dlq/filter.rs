//! Which dead letters an operation takes: a [`Filter`] (group, kind, reason
//! substring or regex, time window, original fields, a limit and a cursor),
//! or a [`Selection`] of ids or of a filter; and the parsing of kinds, times
//! and ids as people type them.

use std::time::{Duration, SystemTime};

use crate::dlq::bad_input;
use crate::dlq::letter::{millis, DeadLetter, Kind};
use crate::error::Error;

/// How a reason is matched: a substring, or a regular expression.
#[derive(Debug, Clone)]
pub struct ReasonMatch(ReasonInner);

#[derive(Debug, Clone)]
enum ReasonInner {
    Substring(String),
    Regex(regex::Regex),
}

impl ReasonMatch {
    /// Reasons containing `text` (case-sensitive).
    pub fn substring(text: &str) -> ReasonMatch {
        ReasonMatch(ReasonInner::Substring(text.to_owned()))
    }

    /// Reasons matching the regular expression `pattern` (Rust `regex`
    /// syntax, unanchored; `(?i)` makes it case-insensitive).
    pub fn regex(pattern: &str) -> Result<ReasonMatch, Error> {
        regex::Regex::new(pattern)
            .map(|r| ReasonMatch(ReasonInner::Regex(r)))
            .map_err(|e| bad_input(format!("bad reason regex {pattern:?}: {e}")))
    }

    /// Whether `reason` matches.
    pub fn matches(&self, reason: &str) -> bool {
        match &self.0 {
            ReasonInner::Substring(s) => reason.contains(s.as_str()),
            ReasonInner::Regex(r) => r.is_match(reason),
        }
    }
}

/// Which dead letters an operation applies to. Every criterion given must
/// match; the default matches everything.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only the letters of this consumer group (several groups reading one
    /// stream share its dead-letter stream; each letter names its group).
    pub group: Option<String>,
    /// Any of these kinds (empty: any kind).
    pub kinds: Vec<Kind>,
    /// The reason matches.
    pub reason: Option<ReasonMatch>,
    /// Dead-lettered at or after this time (`dead_at`).
    pub since: Option<SystemTime>,
    /// Dead-lettered at or before this time (`dead_at`).
    pub until: Option<SystemTime>,
    /// Original fields equal to these values (name, value).
    pub fields: Vec<(String, String)>,
    /// At most this many (the newest).
    pub limit: Option<usize>,
    /// Only entries with a dead-letter id lower than this one (older): the
    /// cursor of the next page is the id of the last entry of a page.
    pub before: Option<String>,
}

impl Filter {
    /// Whether `letter` passes every criterion (the limit and the cursor
    /// aside).
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        self.group.as_ref().is_none_or(|g| *g == letter.group)
            && (self.kinds.is_empty() || self.kinds.contains(&letter.kind))
            && self
                .reason
                .as_ref()
                .is_none_or(|r| r.matches(&letter.reason))
            && self.since.is_none_or(|t| letter.dead_at >= millis(t))
            && self.until.is_none_or(|t| letter.dead_at <= millis(t))
            && self
                .fields
                .iter()
                .all(|(k, v)| letter.field(k) == Some(v.as_bytes()))
    }

    /// Whether no criterion is set (the filter matches every entry).
    pub fn is_everything(&self) -> bool {
        self.group.is_none()
            && self.kinds.is_empty()
            && self.reason.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.fields.is_empty()
            && self.limit.is_none()
            && self.before.is_none()
    }
}

/// The dead letters an operation applies to: listed ids, or a filter.
#[derive(Debug, Clone)]
pub enum Selection {
    /// These dead-letter ids, in this order.
    Ids(Vec<String>),
    /// Every entry the filter matches.
    Filter(Filter),
}

/// Parses a point in time: a duration ago (`90s`, `2h`, `3d`) or an RFC 3339
/// time (`2024-05-01T12:00:00Z`, `2024-05-01T14:00:00+02:00`, or a date
/// `2024-05-01`, UTC midnight).
pub fn parse_time(text: &str, now: SystemTime) -> Result<SystemTime, Error> {
    let text = text.trim();
    if let Ok(ago) = humantime::parse_duration(text) {
        return now
            .checked_sub(ago)
            .ok_or_else(|| bad_input(format!("{text:?} ago is before the epoch")));
    }
    let bad = || {
        bad_input(format!(
            "bad time {text:?} (expected a duration ago such as 2h, or an RFC 3339 time such as 2024-05-01T12:00:00Z)"
        ))
    };
    let mut body = text.to_owned();
    if body.len() == 10 {
        body.push_str("T00:00:00Z");
    }
    // humantime reads UTC only: take a numeric offset off and apply it.
    let mut offset_secs: i64 = 0;
    if body.len() > 19 && !body.ends_with('Z') && !body.ends_with('z') {
        let cut = body.len() - 6;
        let tail = &body[cut..];
        let b = tail.as_bytes();
        if (b[0] == b'+' || b[0] == b'-') && b[3] == b':' {
            let h: i64 = tail[1..3].parse().map_err(|_| bad())?;
            let m: i64 = tail[4..6].parse().map_err(|_| bad())?;
            offset_secs = (h * 3600 + m * 60) * if b[0] == b'-' { -1 } else { 1 };
            body.truncate(cut);
        }
    }
    let local = humantime::parse_rfc3339_weak(&body).map_err(|_| bad())?;
    let shifted = if offset_secs >= 0 {
        local.checked_sub(Duration::from_secs(offset_secs.unsigned_abs()))
    } else {
        local.checked_add(Duration::from_secs(offset_secs.unsigned_abs()))
    };
    shifted.ok_or_else(bad)
}

/// Whether `id` is a whole stream entry id (`1700000000000-0`). A bare
/// `1700000000000` is not: `XRANGE` reads it as every id of that
/// millisecond and `XDEL` as its `-0`, so a replay of it put back the event
/// of `1700000000000-1` and deleted nothing, again at each replay (found by
/// a hostile tester).
pub(crate) fn valid_id(id: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    id.split_once('-')
        .is_some_and(|(ms, seq)| digits(ms) && digits(seq))
}

/// Whether `id` is a bare millisecond (`1700000000000`): no dead-letter id,
/// but a cursor (`--before`) may be one, an exclusive end as XREVRANGE
/// reads it.
pub(crate) fn is_millisecond(id: &str) -> bool {
    valid_id(&format!("{id}-0"))
}

pub(crate) fn check_ids(ids: &[String]) -> Result<(), Error> {
    match ids.iter().find(|id| !valid_id(id)) {
        Some(id) if is_millisecond(id) => Err(bad_input(format!(
            "{id:?} is not a whole dead-letter id: give its sequence number too, as `dlq list` \
             shows it (1700000000000-0)"
        ))),
        Some(id) => Err(bad_input(format!(
            "{id:?} is not a dead-letter id (they look like 1700000000000-0)"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn times_parse_as_ago_or_rfc3339() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            parse_time("2h", now).unwrap(),
            now - Duration::from_secs(7200)
        );
        let utc = parse_time("2024-05-01T12:00:00Z", now).unwrap();
        assert_eq!(parse_time("2024-05-01T14:00:00+02:00", now).unwrap(), utc);
        assert_eq!(parse_time("2024-05-01T10:30:00-01:30", now).unwrap(), utc);
        assert_eq!(
            parse_time("2024-05-01", now).unwrap(),
            utc - Duration::from_secs(12 * 3600)
        );
        assert!(parse_time("yesterday", now).is_err());
    }

    #[test]
    fn ids_are_checked() {
        assert!(valid_id("1700000000000-0"));
        assert!(
            !valid_id("1700000000000"),
            "a millisecond names several ids"
        );
        assert!(!valid_id("1-2-3"));
        assert!(!valid_id("abc"));
        assert!(!valid_id("1-"));
        assert!(!valid_id(""));
    }
}
