//! A dead letter as JSON (`taskhub dlq list --json`, the archive file):
//! original fields as text where they are UTF-8, and times in RFC 3339 next
//! to the milliseconds.

use std::time::{Duration, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::dlq::letter::{millis, DeadLetter};
use crate::dlq::stats::fingerprint;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Raw fields as a JSON object: a UTF-8 value (without NUL, which
/// PostgreSQL's jsonb refuses) as a string, any other as `{"hex": "..."}`; a
/// name that is not UTF-8 as `hex:<hex>`. `None` when two fields share a name
/// (an object cannot keep both).
pub(crate) fn fields_json(fields: &[(Vec<u8>, Vec<u8>)]) -> Option<Map<String, Value>> {
    let mut map = Map::with_capacity(fields.len());
    for (k, v) in fields {
        let key = match std::str::from_utf8(k) {
            Ok(s) if !s.contains('\0') => s.to_owned(),
            _ => format!("hex:{}", hex(k)),
        };
        let value = match std::str::from_utf8(v) {
            Ok(s) if !s.contains('\0') => Value::String(s.to_owned()),
            _ => json!({ "hex": hex(v) }),
        };
        if map.insert(key, value).is_some() {
            return None;
        }
    }
    Some(map)
}

/// A time in ms since the epoch as RFC 3339 (with milliseconds when
/// `with_millis`), or `"<n> ms"` for a time humantime cannot format (year
/// 10000 and later): a corrupted field must not crash a command or a page.
pub(crate) fn format_time(ms: u64, with_millis: bool) -> String {
    const MAX_MS: u64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    if ms > MAX_MS {
        return format!("{ms} ms");
    }
    let t = UNIX_EPOCH + Duration::from_millis(ms);
    if with_millis {
        humantime::format_rfc3339_millis(t).to_string()
    } else {
        humantime::format_rfc3339_seconds(t).to_string()
    }
}

fn rfc3339(ms: u64) -> String {
    format_time(ms, true)
}

/// A dead letter as one JSON object, for tools (`taskhub dlq list --json`)
/// and pages: ids, kind, reason and its fingerprint, times in ms and RFC 3339,
/// the attempt history, the original fields (see [`fields_json`]), and
/// `incomplete`: why those are not the whole event, or null.
pub(crate) fn letter_json(letter: &DeadLetter) -> Value {
    let history: Vec<Value> = letter
        .history
        .iter()
        .map(|a| {
            let at = a.at.map(millis);
            json!({
                "attempt": a.attempt,
                "at": at,
                "at_rfc3339": at.map(rfc3339),
                "error": a.error,
            })
        })
        .collect();
    let fields = fields_json(&letter.fields).unwrap_or_else(|| {
        // Repeated names: keep them all, suffixed with their position.
        let mut map = Map::new();
        for (i, (k, v)) in letter.fields.iter().enumerate() {
            let one = fields_json(&[(k.clone(), v.clone())]).unwrap_or_default();
            for (name, value) in one {
                map.insert(format!("{name}#{i}"), value);
            }
        }
        map
    });
    json!({
        "id": letter.id,
        "original_id": letter.original_id,
        "stream": letter.stream,
        "group": letter.group,
        "consumer": letter.consumer,
        "event_id": letter.event_id,
        "kind": letter.kind.as_str(),
        "reason": letter.reason,
        "fingerprint": fingerprint(&letter.reason),
        "attempts": letter.attempts,
        "first_failed_at": letter.first_failed_at,
        "first_failed_at_rfc3339": rfc3339(letter.first_failed_at),
        "dead_at": letter.dead_at,
        "dead_at_rfc3339": rfc3339(letter.dead_at),
        "history": history,
        "fields": fields,
        "incomplete": letter.incomplete(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dlq::letter::tests::sample_letter;

    #[test]
    fn times_past_year_9999_are_shown_raw_not_a_crash() {
        assert_eq!(format_time(0, true), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_time(1_500, false), "1970-01-01T00:00:01Z");
        assert_eq!(format_time(u64::MAX, true), format!("{} ms", u64::MAX));
        let letter = DeadLetter {
            first_failed_at: u64::MAX,
            dead_at: 253_402_300_800_000,
            ..sample_letter(Vec::new())
        };
        let json = letter.to_json();
        assert_eq!(json["dead_at_rfc3339"], "253402300800000 ms");
    }

    #[test]
    fn fields_json_is_lossless_or_refuses() {
        let map = fields_json(&[
            (b"a".to_vec(), b"x".to_vec()),
            (b"b".to_vec(), vec![0, 255]),
            (b"c".to_vec(), b"nul\0".to_vec()),
        ])
        .unwrap();
        assert_eq!(map["a"], "x");
        assert_eq!(map["b"], json!({"hex": "00ff"}));
        assert_eq!(map["c"], json!({"hex": "6e756c00"}));
        assert!(fields_json(&[
            (b"a".to_vec(), b"1".to_vec()),
            (b"a".to_vec(), b"2".to_vec())
        ])
        .is_none());
    }
}
