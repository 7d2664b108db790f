//! What every instance of a group shares about alerts, in Redis, per stream
//! and group (groups reading one stream share its dead-letter stream, and
//! each alerts on its own letters, to its own webhook): who sends
//! them (a lease with a TTL, renewed each round by its holder and taken
//! over by another instance once it lapses), and what was already said
//! (the count last seen, whether the age alert fired, a change not posted
//! yet, when the webhook was last called), so that an instance taking over
//! neither repeats an alert nor misses a change.

use std::time::{Duration, SystemTime};

use crate::alerts::Look;
use crate::dlq::millis;
use crate::redis::RedisConn;

/// What changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    NonEmpty,
    Grew,
    Old,
}

impl Change {
    fn parse(text: &str) -> Option<Change> {
        [Change::NonEmpty, Change::Grew, Change::Old]
            .into_iter()
            .find(|c| c.as_str() == text)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Change::NonEmpty => "non_empty",
            Change::Grew => "grew",
            Change::Old => "old",
        }
    }
}

/// Alert state of one stream.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// Count at the last look (`None` before the first).
    pub count: Option<u64>,
    /// Whether the age alert fired for the current oldest entry.
    pub old_alerted: bool,
    /// When the webhook was last called (ms since the epoch).
    pub last_post: Option<u64>,
    /// A change not posted yet because of the rate limit, and the count
    /// before it.
    pub unsent: Option<(Change, u64)>,
}

/// Decides whether this look is an alert, and updates the state.
pub(crate) fn change(state: &mut State, look: &Look, age_limit: Duration) -> Option<Change> {
    let previous = state.count.replace(look.count);
    if look.oldest_age < age_limit {
        state.old_alerted = false;
    }
    if look.count == 0 {
        return None;
    }
    match previous {
        None | Some(0) => Some(Change::NonEmpty),
        Some(p) if look.count > p => Some(Change::Grew),
        _ if look.oldest_age >= age_limit && !state.old_alerted => {
            state.old_alerted = true;
            Some(Change::Old)
        }
        _ => None,
    }
}

/// Takes or renews the lease when free or already ours; deletes it (on
/// release, ARGV[2] = 0) only when ours.
const LEASE: &str = r"
local holder = redis.call('GET', KEYS[1])
if ARGV[2] == '0' then
  if holder == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return 0
end
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
";

/// The lease on alerting for the dead letters of `group` on `stream`.
pub(crate) fn lease_key(stream: &str, group: &str) -> String {
    format!("th:alert:lease:{}:{stream}:{group}", stream.len())
}

/// The shared alert state of `group` on `stream`.
pub(crate) fn state_key(stream: &str, group: &str) -> String {
    format!("th:alert:state:{}:{stream}:{group}", stream.len())
}

/// One instance's side of the lease.
pub(crate) struct Lease {
    /// Who holds it: the consumer name and a random part (two instances
    /// given one name by mistake still do not share it).
    pub holder: String,
    /// How long it lasts without renewal.
    pub ttl: Duration,
}

impl Lease {
    /// Whether this instance sends the alerts of `group` on `stream` this
    /// round (taking or renewing the lease).
    pub fn hold(
        &self,
        conn: &mut RedisConn,
        stream: &str,
        group: &str,
    ) -> redis::RedisResult<bool> {
        redis::cmd("EVAL")
            .arg(LEASE)
            .arg(1)
            .arg(lease_key(stream, group))
            .arg(&self.holder)
            .arg(self.ttl.as_millis().max(1) as u64)
            .query(conn)
    }

    /// Gives the lease of `group` on `stream` back, if this instance holds
    /// it.
    pub fn release(
        &self,
        conn: &mut RedisConn,
        stream: &str,
        group: &str,
    ) -> redis::RedisResult<()> {
        redis::cmd("EVAL")
            .arg(LEASE)
            .arg(1)
            .arg(lease_key(stream, group))
            .arg(&self.holder)
            .arg(0)
            .query(conn)
    }
}

impl State {
    /// The shared state of `group` on `stream` (empty before the first
    /// alert round).
    pub fn load(conn: &mut RedisConn, stream: &str, group: &str) -> redis::RedisResult<State> {
        let fields: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(state_key(stream, group))
            .query(conn)?;
        let num = |k: &str| fields.get(k).and_then(|v| v.parse::<u64>().ok());
        Ok(State {
            count: num("count"),
            old_alerted: num("old_alerted") == Some(1),
            last_post: num("last_post"),
            unsent: fields
                .get("unsent")
                .and_then(|c| Change::parse(c))
                .map(|c| (c, num("unsent_from").unwrap_or(0))),
        })
    }

    /// Writes the state of `group` on `stream` back.
    pub fn save(&self, conn: &mut RedisConn, stream: &str, group: &str) -> redis::RedisResult<()> {
        let key = state_key(stream, group);
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("DEL").arg(&key).ignore();
        let mut set = redis::cmd("HSET");
        set.arg(&key)
            .arg("old_alerted")
            .arg(u8::from(self.old_alerted));
        if let Some(count) = self.count {
            set.arg("count").arg(count);
        }
        if let Some(at) = self.last_post {
            set.arg("last_post").arg(at);
        }
        if let Some((change, from)) = self.unsent {
            set.arg("unsent")
                .arg(change.as_str())
                .arg("unsent_from")
                .arg(from);
        }
        pipe.add_command(set).ignore();
        pipe.query(conn)
    }

    /// Whether the webhook may be called again at `now`.
    pub fn may_post(&self, now: SystemTime, min_gap: Duration) -> bool {
        self.last_post
            .is_none_or(|at| millis(now).saturating_sub(at) >= min_gap.as_millis() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alerts::Look;

    fn look(count: u64, age_secs: u64) -> Look {
        Look {
            count,
            oldest_age: Duration::from_secs(age_secs),
            latest: None,
        }
    }

    #[test]
    fn fires_once_per_state_change() {
        let limit = Duration::from_secs(100);
        let mut s = State::default();
        assert_eq!(change(&mut s, &look(0, 0), limit), None);
        assert_eq!(change(&mut s, &look(2, 1), limit), Some(Change::NonEmpty));
        assert_eq!(change(&mut s, &look(2, 5), limit), None);
        assert_eq!(change(&mut s, &look(3, 6), limit), Some(Change::Grew));
        assert_eq!(change(&mut s, &look(3, 200), limit), Some(Change::Old));
        assert_eq!(change(&mut s, &look(3, 300), limit), None);
        assert_eq!(change(&mut s, &look(1, 10), limit), None); // archived some
        assert_eq!(change(&mut s, &look(0, 0), limit), None);
        assert_eq!(change(&mut s, &look(1, 0), limit), Some(Change::NonEmpty));
    }
}
