//! The filters of the dead-letter page, read from a query string or a form
//! with the same meaning as `taskhub dlq`'s flags: kinds, a reason
//! (substring, or a regular expression with `re=1`), a time window (`2h`
//! ago or RFC 3339), an original field `name=value`; and written back as
//! links and hidden form fields, so that every view and action keeps them.
//! A `group` narrows everything to one consumer group's letters (several
//! groups reading one stream share its dead-letter stream).

use std::fmt::Write as _;
use std::time::SystemTime;

use crate::dlq::{parse_time, Filter, Kind, ReasonMatch};
use crate::http::html::{escape, param};
use crate::net::percent_encode as encode;

/// The filter of one request, and the parameters it came from.
#[derive(Clone)]
pub(crate) struct PageFilter {
    pub filter: Filter,
    pub group: Option<String>,
    pub kinds: Vec<Kind>,
    pub reason: Option<String>,
    pub regex: bool,
    pub since: Option<String>,
    pub until: Option<String>,
    pub field: Option<String>,
}

impl PageFilter {
    /// Reads the filter parameters of `query` (the cursor aside). A bad
    /// value is an error naming it.
    pub fn read(query: &[(String, String)], now: SystemTime) -> Result<PageFilter, String> {
        let kinds: Vec<Kind> = query
            .iter()
            .filter(|(k, v)| k == "kind" && !v.is_empty())
            .map(|(_, v)| v.parse::<Kind>().map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let text = |name: &str| param(query, name).map(str::to_owned);
        let (group, reason, since, until, field) = (
            text("group"),
            text("reason"),
            text("since"),
            text("until"),
            text("field"),
        );
        let regex = param(query, "re") == Some("1");
        let mut filter = Filter {
            group: group.clone(),
            kinds: kinds.clone(),
            ..Filter::default()
        };
        if let Some(r) = &reason {
            filter.reason = Some(if regex {
                ReasonMatch::regex(r).map_err(|e| e.to_string())?
            } else {
                ReasonMatch::substring(r)
            });
        }
        let time = |t: &Option<String>| {
            t.as_deref()
                .map(|t| parse_time(t, now))
                .transpose()
                .map_err(|e| e.to_string())
        };
        filter.since = time(&since)?;
        filter.until = time(&until)?;
        if let Some(f) = &field {
            let (name, value) = f
                .split_once('=')
                .ok_or_else(|| format!("field {f:?}: expected NAME=VALUE"))?;
            filter.fields = vec![(name.to_owned(), value.to_owned())];
        }
        Ok(PageFilter {
            filter,
            group,
            kinds,
            reason,
            regex,
            since,
            until,
            field,
        })
    }

    /// The same filter with its time window written as the absolute times
    /// it was read as (`since=2h` becomes `since=2024-05-01T10:00:00.000Z`),
    /// so that a form carrying it means the same window when it comes back
    /// later. Exact to the millisecond, which is what the filter compares.
    pub fn with_times_fixed(&self) -> PageFilter {
        let fixed = |text: &Option<String>, time: Option<SystemTime>| match time {
            Some(t) => {
                let absolute = crate::dlq::format_time(crate::dlq::millis(t), true);
                // Past year 9999 there is no RFC 3339 form; such a time can
                // only have been given as an absolute time: keep that text.
                if absolute.ends_with(" ms") {
                    text.clone()
                } else {
                    Some(absolute)
                }
            }
            None => text.clone(),
        };
        PageFilter {
            since: fixed(&self.since, self.filter.since),
            until: fixed(&self.until, self.filter.until),
            ..self.clone()
        }
    }

    /// Whether any criterion is set.
    pub fn is_set(&self) -> bool {
        !self.filter.is_everything()
    }

    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut out: Vec<(&'static str, String)> = self
            .kinds
            .iter()
            .map(|k| ("kind", k.as_str().to_owned()))
            .collect();
        for (name, value) in [
            ("group", &self.group),
            ("reason", &self.reason),
            ("since", &self.since),
            ("until", &self.until),
            ("field", &self.field),
        ] {
            if let Some(v) = value {
                out.push((name, v.clone()));
            }
        }
        if self.regex {
            out.push(("re", "1".to_owned()));
        }
        out
    }

    /// The parameters for a URL (`&kind=...&reason=...`), percent-encoded
    /// (so the only `&` are the separators).
    pub fn query_params(&self) -> String {
        self.pairs()
            .iter()
            .map(|(k, v)| format!("&{k}={}", encode(v)))
            .collect()
    }

    /// The parameters for a link in HTML (`&amp;kind=...`).
    pub fn link_params(&self) -> String {
        self.query_params().replace('&', "&amp;")
    }

    /// The parameters as hidden form fields.
    pub fn hidden_fields(&self) -> String {
        let mut out = String::new();
        for (k, v) in self.pairs() {
            let _ = write!(
                out,
                "<input type=\"hidden\" name=\"{k}\" value=\"{}\">",
                escape(&v)
            );
        }
        out
    }

    /// The criteria in words, for a confirmation.
    pub fn describe(&self) -> String {
        if !self.is_set() {
            return "every dead letter".to_owned();
        }
        let parts: Vec<String> = self
            .pairs()
            .iter()
            .filter(|(k, _)| *k != "re")
            .map(|(k, v)| {
                format!(
                    "{k} {}",
                    if *k == "reason" && self.regex {
                        format!("matches /{v}/")
                    } else {
                        format!("{v:?}")
                    }
                )
            })
            .collect();
        format!("the dead letters with {}", parts.join(", "))
    }

    /// The filter form of the list page.
    pub fn form(&self, stream_input: &str) -> String {
        let mut out =
            format!("<form method=\"get\" action=\"/dlq\" id=\"filter\">{stream_input}Kind ");
        for k in Kind::ALL {
            let checked = if self.kinds.contains(&k) {
                " checked"
            } else {
                ""
            };
            let _ = write!(
                out,
                "<label><input type=\"checkbox\" name=\"kind\" value=\"{k}\"{checked}>{k}</label> "
            );
        }
        let value = |v: &Option<String>| escape(v.as_deref().unwrap_or(""));
        let _ = write!(
            out,
            "<br>Reason <input name=\"reason\" value=\"{}\"> \
             <label><input type=\"checkbox\" name=\"re\" value=\"1\"{}>regular expression</label> \
             Since <input name=\"since\" size=\"8\" placeholder=\"2h\" value=\"{}\"> \
             Until <input name=\"until\" size=\"8\" value=\"{}\"> \
             Field <input name=\"field\" size=\"14\" placeholder=\"tenant=acme\" value=\"{}\"> \
             Group <input name=\"group\" size=\"10\" value=\"{}\"> \
             <button type=\"submit\">Filter</button></form>",
            value(&self.reason),
            if self.regex { " checked" } else { "" },
            value(&self.since),
            value(&self.until),
            value(&self.field),
            value(&self.group),
        );
        out
    }
}
