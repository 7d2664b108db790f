//! Which dead letters an operation takes: a [`Filter`] (kind, reason
//! substring or regex, time window, original fields, a limit and a cursor),
//! or a [`Selection`] of ids or of a filter; and the parsing of kinds, times
//! and ids as people type them.

use std::time::SystemTime;

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
        (self.kinds.is_empty() || self.kinds.contains(&letter.kind))
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
        self.kinds.is_empty()
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

/// Whether `id` looks like a stream entry id (`1700000000000-0` or
/// `1700000000000`).
pub(crate) fn valid_id(id: &str) -> bool {
    let mut parts = id.splitn(2, '-');
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    parts.next().is_some_and(digits) && parts.next().is_none_or(digits)
}

pub(crate) fn check_ids(ids: &[String]) -> Result<(), Error> {
    match ids.iter().find(|id| !valid_id(id)) {
        Some(id) => Err(bad_input(format!(
            "{id:?} is not a dead-letter id (they look like 1700000000000-0)"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked() {
        assert!(valid_id("1700000000000-0"));
        assert!(valid_id("1700000000000"));
        assert!(!valid_id("abc"));
        assert!(!valid_id("1-"));
        assert!(!valid_id(""));
    }
}
