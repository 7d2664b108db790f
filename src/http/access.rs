//! Who may read and who may change the dead-letter page of `--http`.
//!
//! - **Reading** (`GET /dlq`, `/dlq/show`) is open on a loopback address
//!   unless a read token is configured. On any other address a token is
//!   required: the read token (`--read-token`) or the admin token, given as
//!   `Authorization: Bearer <token>` or as the `token` cookie that
//!   `POST /dlq/login` sets (`HttpOnly; SameSite=Strict; Path=/`). With
//!   neither configured there, the page refuses and says how to set one:
//!   dead letters carry payloads, and a wide bind must not publish them.
//! - **Changing** (`POST /dlq/replay`, `/dlq/delete`) needs the admin token
//!   in the form.
//! - **Every POST** is refused when the browser says it comes from another
//!   site (`Origin`, `Sec-Fetch-Site`), so a page elsewhere cannot make the
//!   operator's browser log in or act.
//! - **Every wrong token** is answered after a delay that doubles with each
//!   failure in a row (see [`Throttle`]), so guessing is slow.
//!
//! `/metrics`, `/healthz` and `/readyz` need nothing: probes and scrapers
//! read them, and they carry counts, not payloads.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::http::wire::Request;
use crate::net::{percent_decode, percent_encode};
use crate::shutdown::Shutdown;

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Denied {
    /// The token this needs is not configured.
    NotConfigured,
    /// No token was given.
    Missing,
    /// A wrong token was given (answered after the throttle's delay).
    Wrong,
}

/// The tokens and the failure throttle of one server.
pub(crate) struct Access {
    /// Whether reading needs a token.
    require_read: bool,
    /// The tokens that allow reading: the read token and the admin token.
    read_tokens: Vec<String>,
    admin: Option<String>,
    throttle: Throttle,
}

impl Access {
    /// The rules of a server on loopback (or not) with these tokens.
    pub fn new(loopback: bool, admin: Option<String>, read: Option<String>) -> Access {
        Access {
            require_read: !loopback || read.is_some(),
            read_tokens: read.iter().chain(&admin).cloned().collect(),
            admin,
            throttle: Throttle::default(),
        }
    }

    /// Whether an admin token is configured (the page shows its buttons).
    pub fn can_change(&self) -> bool {
        self.admin.is_some()
    }

    /// Whether `request` may read the page. A wrong token costs a delay,
    /// cut short by `shutdown`.
    pub fn may_read(&self, request: &Request, shutdown: &Shutdown) -> Result<(), Denied> {
        if !self.require_read {
            return Ok(());
        }
        if self.read_tokens.is_empty() {
            return Err(Denied::NotConfigured);
        }
        let given = bearer(request).or_else(|| cookie(request));
        self.check(given.as_deref(), &self.read_tokens, shutdown)
    }

    /// `POST /dlq/login`: the `Set-Cookie` value that carries a good read
    /// token.
    pub fn login(&self, given: Option<&str>, shutdown: &Shutdown) -> Result<String, Denied> {
        if self.read_tokens.is_empty() {
            return Err(Denied::NotConfigured);
        }
        self.check(given, &self.read_tokens, shutdown)?;
        Ok(format!(
            "token={}; HttpOnly; SameSite=Strict; Path=/",
            percent_encode(given.unwrap_or_default())
        ))
    }

    /// Whether the admin token `given` (from a form) allows a change.
    pub fn may_change(&self, given: Option<&str>, shutdown: &Shutdown) -> Result<(), Denied> {
        match &self.admin {
            None => Err(Denied::NotConfigured),
            Some(admin) => self.check(given, std::slice::from_ref(admin), shutdown),
        }
    }

    fn check(
        &self,
        given: Option<&str>,
        accepted: &[String],
        shutdown: &Shutdown,
    ) -> Result<(), Denied> {
        let Some(given) = given.filter(|g| !g.is_empty()) else {
            return Err(Denied::Missing);
        };
        if accepted.iter().any(|t| same(given, t)) {
            return Ok(());
        }
        let delay = self.throttle.fail(Instant::now());
        log::warn!("http: wrong token; answering in {delay:?}");
        shutdown.sleep(delay);
        Err(Denied::Wrong)
    }
}

/// The token of `Authorization: Bearer <token>`.
fn bearer(request: &Request) -> Option<String> {
    let value = request.header("authorization")?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_owned())
}

/// The `token` cookie, decoded.
fn cookie(request: &Request) -> Option<String> {
    request
        .header("cookie")?
        .split(';')
        .filter_map(|c| c.trim().split_once('='))
        .find(|(name, _)| *name == "token")
        .map(|(_, value)| percent_decode(value))
}

/// Whether a POST comes from another site, by what the browser says:
/// `Sec-Fetch-Site` other than `same-origin` or `none` (typed by the user),
/// or an `Origin` that is not this server's (`http(s)://` + `Host`).
/// Clients that send neither (curl, scripts) are not browsers acting for
/// someone else, and pass.
pub(crate) fn cross_site(request: &Request) -> bool {
    if let Some(site) = request.header("sec-fetch-site") {
        if !["same-origin", "none"]
            .iter()
            .any(|s| site.eq_ignore_ascii_case(s))
        {
            return true;
        }
    }
    let Some(origin) = request.header("origin") else {
        return false;
    };
    let Some(host) = request.header("host") else {
        return true;
    };
    let origin = origin.to_ascii_lowercase();
    let host = host.to_ascii_lowercase();
    origin != format!("http://{host}") && origin != format!("https://{host}")
}

/// Compares without an early exit, so timing says nothing about the token.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// One counter of failed token checks for the whole server: the n-th failure
/// in a row (from 0) waits 200 ms·2^n, at most 5 s; a minute without a
/// failure starts the count over. Good tokens never wait.
#[derive(Default)]
pub(crate) struct Throttle {
    /// Failures in a row, and when the last one happened.
    state: Mutex<(u32, Option<Instant>)>,
}

const FIRST_DELAY: Duration = Duration::from_millis(200);
const LONGEST_DELAY: Duration = Duration::from_secs(5);
const FORGET_AFTER: Duration = Duration::from_secs(60);

impl Throttle {
    /// Records a failure at `now`; returns how long its answer waits.
    fn fail(&self, now: Instant) -> Duration {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (failures, last) = &mut *state;
        if last.is_some_and(|t| now.saturating_duration_since(t) >= FORGET_AFTER) {
            *failures = 0;
        }
        let delay = FIRST_DELAY
            .saturating_mul(1 << (*failures).min(5))
            .min(LONGEST_DELAY);
        *failures = failures.saturating_add(1);
        *last = Some(now);
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_double_the_delay_up_to_a_cap_and_are_forgotten() {
        let t = Throttle::default();
        let start = Instant::now();
        let delays: Vec<u128> = (0..7).map(|_| t.fail(start).as_millis()).collect();
        assert_eq!(delays, [200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(t.fail(start + Duration::from_secs(59)), LONGEST_DELAY);
        let later = start + Duration::from_secs(59) + FORGET_AFTER;
        assert_eq!(t.fail(later), FIRST_DELAY);
    }

    #[test]
    fn posts_from_other_sites_are_told_apart() {
        let post =
            |headers: &[(&str, &str)]| cross_site(&Request::made_up("POST", "/dlq/login", headers));
        assert!(!post(&[]), "curl sends neither header");
        assert!(!post(&[("Host", "h:9"), ("Origin", "http://h:9")]));
        assert!(!post(&[("Host", "h:9"), ("Origin", "https://H:9")]));
        assert!(!post(&[
            ("Sec-Fetch-Site", "same-origin"),
            ("Host", "h:9"),
            ("Origin", "http://h:9")
        ]));
        assert!(!post(&[("Sec-Fetch-Site", "none")]));
        assert!(post(&[("Host", "h:9"), ("Origin", "http://evil.example")]));
        assert!(post(&[("Host", "h:9"), ("Origin", "null")]));
        assert!(post(&[("Origin", "http://h:9")]), "no Host to compare with");
        assert!(post(&[("Sec-Fetch-Site", "cross-site")]));
        assert!(post(&[
            ("Sec-Fetch-Site", "same-site"),
            ("Host", "h:9"),
            ("Origin", "http://h:9")
        ]));
    }

    #[test]
    fn tokens_come_from_the_bearer_header_or_the_cookie() {
        let get = |headers: &[(&str, &str)]| Request::made_up("GET", "/dlq", headers);
        assert_eq!(
            bearer(&get(&[("Authorization", "Bearer abc def")])).as_deref(),
            Some("abc def")
        );
        assert_eq!(
            bearer(&get(&[("Authorization", "bearer  x")])).as_deref(),
            Some("x")
        );
        assert_eq!(bearer(&get(&[("Authorization", "Basic eDp5")])), None);
        let c = get(&[("Cookie", "a=1; token=t%3Bk%20n; b=2")]);
        assert_eq!(cookie(&c).as_deref(), Some("t;k n"));
        assert_eq!(cookie(&get(&[("Cookie", "xtoken=1")])), None);
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same("secret", "secret") && !same("secret", "secreT") && !same("s", "secret"));
    }
}
