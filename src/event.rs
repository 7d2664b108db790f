//! The message contract: what a stream entry must carry to be an [`Event`].
//!
//! An entry has an `event_id` (stable, producer-generated, required), an
//! optional `payload` and any other fields. Field names and values are kept as
//! raw bytes, so binary data is preserved exactly, including into the
//! dead-letter stream. An entry that breaks the contract does not become an
//! `Event`: it becomes an [`Invalid`] reason and goes to the dead-letter stream
//! at once, never acked silently and never crashing a thread.

use std::fmt;
use std::sync::Arc;

/// The raw fields of a stream entry, in the order Redis returned them.
pub type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// One event, read from a stream and ready for a [`Handler`](crate::Handler).
#[derive(Debug, Clone)]
pub struct Event {
    pub(crate) stream: Arc<str>,
    pub(crate) entry_id: String,
    pub(crate) event_id: String,
    pub(crate) fields: Fields,
    pub(crate) delivery_count: u64,
}

/// Why an entry is not a valid event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Limits an entry must respect to be processed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_event_id_bytes: usize,
    pub max_entry_bytes: usize,
}

/// Bytes of each name and value that an oversize entry's dead letter keeps.
pub(crate) const PREFIX: usize = 256;
/// Fields that an oversize entry's dead letter keeps.
pub(crate) const MOST_FIELDS: usize = 64;

/// What Redis did not send of an entry over the size limit: the reads cut
/// such entries down on the server (see `streams.rs`), so they never take
/// more memory here than their kept prefixes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cut {
    /// Size of the whole entry (names and values).
    pub bytes: u64,
    /// Number of its fields.
    pub fields: u64,
    /// Size of each kept field's value.
    pub sizes: Vec<u64>,
}

impl Cut {
    /// Cuts `fields` down in place, as the server-side reads do, and
    /// returns what was cut. For an entry that arrived whole.
    fn apply(fields: &mut Fields) -> Cut {
        let bytes = fields.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum();
        let count = fields.len() as u64;
        fields.truncate(MOST_FIELDS);
        let mut sizes = Vec::with_capacity(fields.len());
        for (k, v) in fields.iter_mut() {
            sizes.push(v.len() as u64);
            for part in [k, v] {
                part.truncate(PREFIX);
                part.shrink_to_fit();
            }
        }
        fields.shrink_to_fit();
        Cut {
            bytes,
            fields: count,
            sizes,
        }
    }

    /// Why the entry is invalid, with the sizes of its first fields.
    fn reason(&self, kept: &Fields, limit: usize) -> Invalid {
        let sizes: Vec<String> = kept
            .iter()
            .zip(&self.sizes)
            .take(16)
            .map(|((k, _), n)| format!("{} {n}", String::from_utf8_lossy(k)))
            .collect();
        Invalid(format!(
            "entry is {} bytes in {} fields, over the limit of {limit} bytes; the dead letter keeps the name and first {PREFIX} bytes of its first {MOST_FIELDS} fields (value sizes: {})",
            self.bytes,
            self.fields,
            sizes.join(", ")
        ))
    }
}

impl Event {
    /// Checks the contract and builds an event from a raw entry. `cut`
    /// says the server already cut the entry down for being over the size
    /// limit; an entry that arrived whole and is over it is cut down here,
    /// at once.
    pub(crate) fn parse(
        stream: Arc<str>,
        entry_id: String,
        mut fields: Fields,
        cut: Option<Cut>,
        delivery_count: u64,
        limits: Limits,
    ) -> Result<Event, (Fields, Invalid)> {
        let cut = cut.or_else(|| {
            let size: usize = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
            (size > limits.max_entry_bytes).then(|| Cut::apply(&mut fields))
        });
        if let Some(cut) = cut {
            let why = cut.reason(&fields, limits.max_entry_bytes);
            return Err((fields, why));
        }
        let event_id = match check_event_id(&fields, limits.max_event_id_bytes) {
            Ok(id) => id,
            Err(why) => return Err((fields, why)),
        };
        Ok(Event {
            stream,
            entry_id,
            event_id,
            fields,
            delivery_count,
        })
    }

    /// The stream the event was read from.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The stream entry id (`1700000000000-0`), which changes on a replay.
    pub fn entry_id(&self) -> &str {
        &self.entry_id
    }

    /// The producer's stable id: the idempotency key.
    pub fn event_id(&self) -> &str {
        &self.event_id
    }

    /// The `payload` field as text; `None` when absent or not UTF-8 (see
    /// [`field`](Event::field) for the raw bytes).
    pub fn payload(&self) -> Option<&str> {
        self.field_str("payload")
    }

    /// The raw value of a field.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(k, _)| k.as_slice() == name.as_bytes())
            .map(|(_, v)| v.as_slice())
    }

    /// The value of a field as text; `None` when absent or not UTF-8.
    pub fn field_str(&self, name: &str) -> Option<&str> {
        self.field(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// All fields, raw, in stream order (`event_id` and `payload` included).
    pub fn fields(&self) -> &[(Vec<u8>, Vec<u8>)] {
        &self.fields
    }

    /// How many times Redis has delivered this entry (1 the first time).
    pub fn delivery_count(&self) -> u64 {
        self.delivery_count
    }

    /// All fields as one JSON object of strings. Fails when a name or value is
    /// not UTF-8, since JSON cannot carry raw bytes.
    pub fn fields_json(&self) -> Result<String, Invalid> {
        let mut map = serde_json::Map::with_capacity(self.fields.len());
        for (k, v) in &self.fields {
            let (Ok(k), Ok(v)) = (std::str::from_utf8(k), std::str::from_utf8(v)) else {
                return Err(Invalid(format!(
                    "field {:?} is not UTF-8 and cannot be passed as JSON",
                    String::from_utf8_lossy(k)
                )));
            };
            map.insert(k.to_owned(), serde_json::Value::String(v.to_owned()));
        }
        Ok(serde_json::Value::Object(map).to_string())
    }
}

fn check_event_id(fields: &Fields, max: usize) -> Result<String, Invalid> {
    let raw = fields
        .iter()
        .find(|(k, _)| k.as_slice() == b"event_id")
        .map(|(_, v)| v.as_slice())
        .ok_or_else(|| Invalid("missing field event_id".into()))?;
    if raw.is_empty() {
        return Err(Invalid("empty event_id".into()));
    }
    if raw.len() > max {
        return Err(Invalid(format!(
            "event_id is {} bytes, over the limit of {max} bytes",
            raw.len()
        )));
    }
    let id = std::str::from_utf8(raw).map_err(|_| Invalid("event_id is not UTF-8".into()))?;
    // PostgreSQL text cannot hold NUL, and control characters in an id are a
    // producer bug far more often than a choice: refuse them all.
    // (ASCII's are below 0x20 and 0x7f; the rest, U+0080 to U+009F, only
    // in an id that is not ASCII: the byte test is a tenth of the cost of
    // decoding every character, for every event read.)
    let control = match id.is_ascii() {
        true => id.bytes().any(|b| b < 0x20 || b == 0x7f),
        false => id.chars().any(char::is_control),
    };
    if control {
        return Err(Invalid("event_id contains control characters".into()));
    }
    Ok(id.to_owned())
}

/// A stream entry as Redis returned it: id and fields. `fields` is `None` for
/// an entry deleted while it was pending (XREADGROUP history reads return it
/// with a nil body); `cut` is set for an entry over the size limit that the
/// server cut down.
#[derive(Debug)]
pub(crate) struct RawEntry {
    pub id: String,
    pub fields: Option<Fields>,
    pub cut: Option<Cut>,
    /// What the read script found for it, when it looked (see
    /// `streams::read_group_bounded`).
    pub seen: Option<crate::redis::streams::Seen>,
}

impl RawEntry {
    /// Bytes of the fields held.
    pub fn bytes(&self) -> usize {
        self.fields
            .as_ref()
            .map_or(0, |f| f.iter().map(|(k, v)| k.len() + v.len()).sum())
    }
}

/// Parses the `[[id, [k, v, ...]], ...]` part of XREADGROUP, XRANGE and
/// XAUTOCLAIM replies, keeping values as raw bytes.
pub(crate) fn parse_entries(value: redis::Value) -> Result<Vec<RawEntry>, String> {
    let redis::Value::Array(items) = value else {
        return match value {
            redis::Value::Nil => Ok(Vec::new()),
            other => Err(format!("expected an array of entries, got {other:?}")),
        };
    };
    let mut entries = Vec::with_capacity(items.len());
    for item in items {
        let redis::Value::Array(parts) = item else {
            return Err("expected [id, fields]".into());
        };
        if !(parts.len() == 2 || parts.len() == 5) {
            return Err("expected [id, fields]".into());
        }
        let mut parts = parts.into_iter();
        let id = bytes(parts.next().unwrap_or(redis::Value::Nil))
            .and_then(|b| String::from_utf8(b).ok())
            .ok_or("entry id is not a string")?;
        let fields = match parts.next().unwrap_or(redis::Value::Nil) {
            redis::Value::Nil => None,
            body => Some(parse_fields(body)?),
        };
        let cut = match (parts.next(), parts.next(), parts.next()) {
            (Some(bytes), Some(count), Some(redis::Value::Array(sizes))) => Some(Cut {
                bytes: int(bytes).ok_or("entry size is not a number")?,
                fields: int(count).ok_or("field count is not a number")?,
                sizes: sizes.into_iter().filter_map(int).collect(),
            }),
            _ => None,
        };
        entries.push(RawEntry {
            id,
            fields,
            cut,
            seen: None,
        });
    }
    Ok(entries)
}

/// Parses an entry's fields, `[k, v, ...]` (or a map), as raw bytes.
pub(crate) fn parse_fields(body: redis::Value) -> Result<Fields, String> {
    match body {
        redis::Value::Array(flat) => {
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut it = flat.into_iter();
            while let Some(k) = it.next() {
                let v = it.next().ok_or("odd number of field items")?;
                fields.push((
                    bytes(k).ok_or("field name is not a string")?,
                    bytes(v).ok_or("field value is not a string")?,
                ));
            }
            Ok(fields)
        }
        redis::Value::Map(map) => {
            let mut fields = Vec::with_capacity(map.len());
            for (k, v) in map {
                fields.push((
                    bytes(k).ok_or("field name is not a string")?,
                    bytes(v).ok_or("field value is not a string")?,
                ));
            }
            Ok(fields)
        }
        other => Err(format!("unexpected entry body {other:?}")),
    }
}

/// Parses an XREADGROUP reply into (stream, entries) pairs.
pub(crate) fn parse_read_reply(
    value: redis::Value,
) -> Result<Vec<(String, Vec<RawEntry>)>, String> {
    let streams = match value {
        redis::Value::Nil => return Ok(Vec::new()),
        redis::Value::Array(items) => items
            .into_iter()
            .map(|item| match item {
                redis::Value::Array(mut pair) if pair.len() == 2 => {
                    let entries = pair.pop().unwrap_or(redis::Value::Nil);
                    let name = pair.pop().unwrap_or(redis::Value::Nil);
                    Ok((name, entries))
                }
                _ => Err("expected [stream, entries]".to_string()),
            })
            .collect::<Result<Vec<_>, _>>()?,
        redis::Value::Map(map) => map,
        other => return Err(format!("unexpected XREADGROUP reply {other:?}")),
    };
    streams
        .into_iter()
        .map(|(name, entries)| {
            let name = bytes(name)
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or("stream name is not a string")?;
            Ok((name, parse_entries(entries)?))
        })
        .collect()
}

fn int(value: redis::Value) -> Option<u64> {
    match value {
        redis::Value::Int(n) => u64::try_from(n).ok(),
        _ => None,
    }
}

pub(crate) fn bytes(value: redis::Value) -> Option<Vec<u8>> {
    match value {
        redis::Value::BulkString(b) => Some(b),
        redis::Value::SimpleString(s) => Some(s.into_bytes()),
        redis::Value::Int(i) => Some(i.to_string().into_bytes()),
        redis::Value::Okay => Some(b"OK".to_vec()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_event_id_bytes: 32,
        max_entry_bytes: 64,
    };

    fn parse(fields: &[(&[u8], &[u8])]) -> Result<Event, Invalid> {
        let fields = fields
            .iter()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        Event::parse("s".into(), "1-0".into(), fields, None, 1, LIMITS).map_err(|(_, why)| why)
    }

    #[test]
    fn contract() {
        let e = parse(&[(b"event_id", b"e1"), (b"payload", b"hi"), (b"x", b"\xff")]).unwrap();
        assert_eq!(e.event_id(), "e1");
        assert_eq!(e.payload(), Some("hi"));
        assert_eq!(e.field("x"), Some(&b"\xff"[..]));
        assert!(e.fields_json().is_err());
        assert_eq!(
            parse(&[(b"payload", b"x")]).unwrap_err().0,
            "missing field event_id"
        );
        assert_eq!(
            parse(&[(b"event_id", b"")]).unwrap_err().0,
            "empty event_id"
        );
        assert!(parse(&[(b"event_id", b"\xff\xfe")])
            .unwrap_err()
            .0
            .contains("UTF-8"));
        // Every control character (C0, DEL, C1: all below U+0100), in an
        // ASCII id and in one that is not, and no other.
        for c in (0..0x100u32).filter_map(char::from_u32) {
            for id in [format!("a{c}b"), format!("é{c}")] {
                let parsed = parse(&[(b"event_id", id.as_bytes())]);
                match c.is_control() {
                    true => assert!(parsed.unwrap_err().0.contains("control"), "{id:?}"),
                    false => assert!(parsed.is_ok(), "{id:?}"),
                }
            }
        }
        assert!(parse(&[(b"event_id", "日本".as_bytes())]).is_ok());
        assert!(parse(&[(b"event_id", &[b'a'; 33])])
            .unwrap_err()
            .0
            .contains("limit"));
        assert!(parse(&[(b"event_id", b"e"), (b"payload", &[b'a'; 64])])
            .unwrap_err()
            .0
            .contains("entry is"));
        let e = parse(&[(b"event_id", b"'; DROP TABLE x;--<b>\"")]).unwrap();
        assert_eq!(
            e.fields_json().unwrap(),
            r#"{"event_id":"'; DROP TABLE x;--<b>\""}"#
        );
    }

    #[test]
    fn an_oversize_entry_is_cut_down_at_once() {
        let fields: Fields = vec![
            (b"event_id".to_vec(), b"e".to_vec()),
            (b"payload".to_vec(), vec![b'x'; 10_000]),
        ];
        let limits = Limits {
            max_event_id_bytes: 32,
            max_entry_bytes: 1_000,
        };
        let (kept, why) =
            Event::parse("s".into(), "1-0".into(), fields, None, 1, limits).unwrap_err();
        assert_eq!(kept[1].1.len(), PREFIX);
        assert!(kept[1].1.capacity() <= PREFIX, "memory given back");
        assert!(why.0.contains("10016 bytes in 2 fields"), "{why}");
        assert!(why.0.contains("payload 10000"), "{why}");
    }

    #[test]
    fn parses_entries_with_nil_bodies() {
        use redis::Value::*;
        let v = Array(vec![
            Array(vec![
                BulkString(b"1-0".to_vec()),
                Array(vec![
                    BulkString(b"event_id".to_vec()),
                    BulkString(b"a".to_vec()),
                ]),
            ]),
            Array(vec![BulkString(b"2-0".to_vec()), Nil]),
        ]);
        let entries = parse_entries(v).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].fields.as_ref().unwrap()[0].1, b"a");
        assert!(entries[1].fields.is_none());
    }
}
