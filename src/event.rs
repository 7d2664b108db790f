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

/// Fields as pairs of owned names and values: what a dead letter keeps (see
/// [`EntryFields`] for an event's).
pub type Fields = Vec<(Vec<u8>, Vec<u8>)>;

/// The value of the first field of `fields` named `name` (see
/// [`EntryFields::value_of`] for an event's).
pub(crate) fn value_in<'a>(fields: &'a [(Vec<u8>, Vec<u8>)], name: &[u8]) -> Option<&'a [u8]> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_slice())
}

/// The raw fields of a stream entry, in the order Redis returned them:
/// names and values side by side in one buffer.
///
/// Every entry read is one of these, made by the reader thread and dropped
/// by a worker thread, where glibc's allocator is slowest: a buffer and a
/// list of ends is two allocations per entry, where a `Vec` per name and
/// per value was five for an event of two fields (callgrind: see
/// docs/performance-log.md, "2026-12-07, the later morning").
///
/// ```
/// # use taskhub::EntryFields;
/// let mut fields = EntryFields::default();
/// fields.push(b"event_id", b"order-1");
/// fields.push(b"payload", b"{}");
/// for (name, value) in &fields {
///     println!("{} = {}", String::from_utf8_lossy(name), String::from_utf8_lossy(value));
/// }
/// assert_eq!(fields.get(1), Some((&b"payload"[..], &b"{}"[..])));
/// assert_eq!(fields.to_vec()[0].1, b"order-1");
/// let same: EntryFields = [("event_id", "order-1"), ("payload", "{}")].into_iter().collect();
/// assert_eq!(same, fields);
/// ```
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct EntryFields {
    /// Each name then its value, one after another.
    bytes: Vec<u8>,
    /// Where each name and each value ends in `bytes`, alternately.
    ends: Vec<usize>,
}

impl EntryFields {
    /// Room for `fields` fields of `bytes` bytes in all.
    pub fn with_capacity(fields: usize, bytes: usize) -> EntryFields {
        EntryFields {
            bytes: Vec::with_capacity(bytes),
            ends: Vec::with_capacity(fields * 2),
        }
    }

    /// Adds a field at the end.
    pub fn push(&mut self, name: &[u8], value: &[u8]) {
        self.bytes.extend_from_slice(name);
        self.ends.push(self.bytes.len());
        self.bytes.extend_from_slice(value);
        self.ends.push(self.bytes.len());
    }

    /// The number of fields.
    pub fn len(&self) -> usize {
        self.ends.len() / 2
    }

    /// Whether there are no fields.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The size of all names and values together.
    pub fn byte_len(&self) -> usize {
        self.bytes.len()
    }

    /// What holding the fields takes: their names and values, and
    /// [`FIELD_COST`] bytes for each field (where its name and value end).
    /// This is the size `--max-entry-bytes` limits, so that an entry of
    /// many empty fields is not free.
    pub(crate) fn size(&self) -> usize {
        size_of(self.byte_len(), self.len())
    }

    /// The `i`th field, (name, value).
    pub fn get(&self, i: usize) -> Option<(&[u8], &[u8])> {
        if i >= self.len() {
            return None;
        }
        let value_end = self.ends[2 * i + 1];
        let name_end = self.ends[2 * i];
        let start = match i {
            0 => 0,
            _ => self.ends[2 * i - 1],
        };
        Some((
            &self.bytes[start..name_end],
            &self.bytes[name_end..value_end],
        ))
    }

    /// The fields in order, (name, value).
    pub fn iter(&self) -> FieldsIter<'_> {
        FieldsIter {
            bytes: &self.bytes,
            ends: self.ends.chunks_exact(2),
            start: 0,
        }
    }

    /// The value of the first field named `name`.
    pub fn value_of(&self, name: &[u8]) -> Option<&[u8]> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| v)
    }

    /// The bytes its buffer holds room for.
    #[cfg(test)]
    pub(crate) fn allocated(&self) -> usize {
        self.bytes.capacity()
    }

    /// The fields as owned pairs.
    pub fn to_vec(&self) -> Fields {
        self.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    /// `pairs` in one buffer of their size; over `limit` bytes (names and
    /// values), only what an oversize entry's dead letter keeps (the first
    /// [`MOST_FIELDS`] fields, [`PREFIX`] bytes of each name and value), with
    /// what was cut, as the reads cut such entries down in Redis: an entry
    /// that arrived whole is then never held twice.
    pub(crate) fn from_pairs(pairs: &Fields, limit: usize) -> (EntryFields, Option<Cut>) {
        let bytes: usize = pairs.iter().map(|(k, v)| k.len() + v.len()).sum();
        if size_of(bytes, pairs.len()) <= limit {
            let mut fields = EntryFields::with_capacity(pairs.len(), bytes);
            for (k, v) in pairs {
                fields.push(k, v);
            }
            return (fields, None);
        }
        let (fields, cut) = Cut::of(pairs.iter().map(|(k, v)| (&k[..], &v[..])));
        (fields, Some(cut))
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> FromIterator<(K, V)> for EntryFields {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> EntryFields {
        let mut fields = EntryFields::default();
        for (k, v) in pairs {
            fields.push(k.as_ref(), v.as_ref());
        }
        fields
    }
}

/// Names and values as text, with the bytes that are not printable ASCII
/// escaped (`\xff`): exact, where a lossy conversion would hide binary data.
impl fmt::Debug for EntryFields {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Raw<'a>(&'a [u8]);
        impl fmt::Debug for Raw<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "\"{}\"", self.0.escape_ascii())
            }
        }
        f.debug_list()
            .entries(self.iter().map(|(k, v)| (Raw(k), Raw(v))))
            .finish()
    }
}

impl<'a> IntoIterator for &'a EntryFields {
    type Item = (&'a [u8], &'a [u8]);
    type IntoIter = FieldsIter<'a>;

    fn into_iter(self) -> FieldsIter<'a> {
        self.iter()
    }
}

/// The fields of an [`EntryFields`], in order.
#[derive(Clone, Debug)]
pub struct FieldsIter<'a> {
    bytes: &'a [u8],
    /// (name end, value end) of the fields left.
    ends: std::slice::ChunksExact<'a, usize>,
    /// Where the next name starts.
    start: usize,
}

impl<'a> Iterator for FieldsIter<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        let &[name_end, value_end] = self.ends.next()? else {
            return None; // chunks of two: never
        };
        let start = std::mem::replace(&mut self.start, value_end);
        Some((
            &self.bytes[start..name_end],
            &self.bytes[name_end..value_end],
        ))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.ends.size_hint()
    }
}

impl ExactSizeIterator for FieldsIter<'_> {}

impl std::iter::FusedIterator for FieldsIter<'_> {}

/// One event, read from a stream and ready for a [`Handler`](crate::Handler).
#[derive(Debug, Clone)]
pub struct Event {
    pub(crate) stream: Arc<str>,
    pub(crate) entry_id: String,
    pub(crate) event_id: String,
    pub(crate) fields: EntryFields,
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
/// What each field of an entry counts towards `--max-entry-bytes` beside
/// its name and value: the two ends [`EntryFields`] keeps of it. Without
/// it, an entry of a million empty fields counted 0 bytes and took 16 MB
/// to hold (the read script counts the same: `BOUND` in `streams.rs`).
pub(crate) const FIELD_COST: usize = 16;

/// The size an entry of `bytes` bytes of names and values in `fields`
/// fields counts towards `--max-entry-bytes`.
pub(crate) fn size_of(bytes: usize, fields: usize) -> usize {
    bytes.saturating_add(fields.saturating_mul(FIELD_COST))
}

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
    fn apply(fields: &mut EntryFields) -> Cut {
        let (kept, cut) = Cut::of(fields.iter());
        *fields = kept;
        cut
    }

    /// What an oversize entry of `fields` keeps (its first [`MOST_FIELDS`]
    /// fields, [`PREFIX`] bytes of each name and value, in a buffer of
    /// their size), and what was cut.
    fn of<'a>(fields: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone) -> (EntryFields, Cut) {
        let prefix = |part: &'a [u8]| &part[..part.len().min(PREFIX)];
        let kept = fields.clone().take(MOST_FIELDS);
        let n = kept.clone().count();
        let size = kept
            .clone()
            .map(|(k, v)| prefix(k).len() + prefix(v).len())
            .sum();
        let mut sizes = Vec::with_capacity(n);
        let mut fields_kept = EntryFields::with_capacity(n, size);
        for (k, v) in kept {
            sizes.push(v.len() as u64);
            fields_kept.push(prefix(k), prefix(v));
        }
        let (bytes, count) = fields.fold((0, 0), |(bytes, count), (k, v)| {
            (bytes + (k.len() + v.len()) as u64, count + 1)
        });
        let cut = Cut {
            bytes,
            fields: count,
            sizes,
        };
        (fields_kept, cut)
    }

    /// Why the entry is invalid, with the sizes of its first fields.
    fn reason(&self, kept: &EntryFields, limit: usize) -> Invalid {
        let sizes: Vec<String> = kept
            .iter()
            .zip(&self.sizes)
            .take(16)
            .map(|((k, _), n)| format!("{} {n}", String::from_utf8_lossy(k)))
            .collect();
        Invalid(format!(
            "entry is {} bytes in {} fields, over the limit of {limit} bytes (it counts {} with {FIELD_COST} bytes a field); the dead letter keeps the name and first {PREFIX} bytes of its first {MOST_FIELDS} fields (value sizes: {})",
            self.bytes,
            self.fields,
            self.bytes
                .saturating_add(self.fields.saturating_mul(FIELD_COST as u64)),
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
        mut fields: EntryFields,
        cut: Option<Cut>,
        delivery_count: u64,
        limits: Limits,
    ) -> Result<Event, (Fields, Invalid)> {
        let cut = cut
            .or_else(|| (fields.size() > limits.max_entry_bytes).then(|| Cut::apply(&mut fields)));
        if let Some(cut) = cut {
            let why = cut.reason(&fields, limits.max_entry_bytes);
            return Err((fields.to_vec(), why));
        }
        let event_id = match check_event_id(&fields, limits.max_event_id_bytes) {
            Ok(id) => id,
            Err(why) => return Err((fields.to_vec(), why)),
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
        self.fields.value_of(name.as_bytes())
    }

    /// The value of a field as text; `None` when absent or not UTF-8.
    pub fn field_str(&self, name: &str) -> Option<&str> {
        self.field(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// All fields, raw, in stream order (`event_id` and `payload` included):
    /// `for (name, value) in event.fields()` gives each as `&[u8]`.
    pub fn fields(&self) -> &EntryFields {
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

fn check_event_id(fields: &EntryFields, max: usize) -> Result<String, Invalid> {
    let raw = fields
        .value_of(b"event_id")
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
    pub fields: Option<EntryFields>,
    pub cut: Option<Cut>,
    /// What the read script found for it, when it looked (see
    /// `streams::read_group_bounded`).
    pub seen: Option<crate::redis::streams::Seen>,
}

impl RawEntry {
    /// Bytes of the fields held (see [`EntryFields::size`]).
    pub fn bytes(&self) -> usize {
        self.fields.as_ref().map_or(0, EntryFields::size)
    }
}

/// Parses the `[[id, [k, v, ...]], ...]` part of XREADGROUP, XRANGE and
/// XAUTOCLAIM replies, keeping values as raw bytes; an entry over
/// `max_entry_bytes` that came whole is cut down as it is read (see
/// [`EntryFields::from_pairs`]).
pub(crate) fn parse_entries(
    value: redis::Value,
    max_entry_bytes: usize,
) -> Result<Vec<RawEntry>, String> {
    entries_of(value, |id, pairs, cut| {
        let (fields, cut) = match pairs {
            Some(pairs) => {
                let (fields, cut_here) = EntryFields::from_pairs(&pairs, max_entry_bytes);
                (Some(fields), cut.or(cut_here))
            }
            None => (None, cut),
        };
        RawEntry {
            id,
            fields,
            cut,
            seen: None,
        }
    })
}

/// [`parse_entries`] for entries kept as pairs, whole (dead letters).
pub(crate) fn parse_entry_pairs(
    value: redis::Value,
) -> Result<Vec<(String, Option<Fields>)>, String> {
    entries_of(value, |id, pairs, _| (id, pairs))
}

/// Each entry of `value` as `make` makes it of its id, its fields and
/// what the server cut of it.
fn entries_of<T>(
    value: redis::Value,
    mut make: impl FnMut(String, Option<Fields>, Option<Cut>) -> T,
) -> Result<Vec<T>, String> {
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
        entries.push(make(id, fields, cut));
    }
    Ok(entries)
}

/// Parses an entry's fields, `[k, v, ...]` (or a map), as raw bytes.
pub(crate) fn parse_fields(body: redis::Value) -> Result<Fields, String> {
    let field = |k, v| -> Result<(Vec<u8>, Vec<u8>), String> {
        Ok((
            bytes(k).ok_or("field name is not a string")?,
            bytes(v).ok_or("field value is not a string")?,
        ))
    };
    match body {
        redis::Value::Array(flat) => {
            if !flat.len().is_multiple_of(2) {
                return Err("odd number of field items".into());
            }
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut it = flat.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                fields.push(field(k, v)?);
            }
            Ok(fields)
        }
        redis::Value::Map(map) => map.into_iter().map(|(k, v)| field(k, v)).collect(),
        other => Err(format!("unexpected entry body {other:?}")),
    }
}

/// Parses an XREADGROUP reply into (stream, entries) pairs.
pub(crate) fn parse_read_reply(
    value: redis::Value,
    max_entry_bytes: usize,
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
            Ok((name, parse_entries(entries, max_entry_bytes)?))
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
        max_entry_bytes: 128,
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
        // 128 bytes: 16 of names and values and 16 a field for the two.
        assert!(parse(&[(b"event_id", b"e"), (b"payload", &[b'a'; 80])]).is_ok());
        assert!(parse(&[(b"event_id", b"e"), (b"payload", &[b'a'; 81])])
            .unwrap_err()
            .0
            .starts_with("entry is 97 bytes in 2 fields, over the limit of 128 bytes (it counts 129 with 16 bytes a field)"));
        let e = parse(&[(b"event_id", b"'; DROP TABLE x;--<b>\"")]).unwrap();
        assert_eq!(
            e.fields_json().unwrap(),
            r#"{"event_id":"'; DROP TABLE x;--<b>\""}"#
        );
    }

    #[test]
    fn entry_fields_keep_each_name_and_value_apart_and_whole() {
        let pairs: [(&[u8], &[u8]); 4] = [
            (b"event_id", b"e1"),
            (b"", b"empty name"),
            (b"empty value", b""),
            (b"bin", b"\x00\xff\x00"),
        ];
        let fields: EntryFields = pairs.into_iter().collect();
        assert_eq!((fields.len(), fields.is_empty()), (4, false));
        assert_eq!(fields.byte_len(), 8 + 2 + 10 + 11 + 3 + 3);
        assert_eq!(fields.iter().collect::<Vec<_>>(), pairs);
        assert_eq!(fields.iter().len(), 4);
        assert_eq!(fields.get(1), Some((&b""[..], &b"empty name"[..])));
        assert_eq!(fields.get(4), None);
        assert_eq!(fields.value_of(b"empty value"), Some(&b""[..]));
        assert_eq!(fields.value_of(b"missing"), None);
        assert_eq!(
            fields.to_vec()[3],
            (b"bin".to_vec(), b"\x00\xff\x00".to_vec())
        );
        assert_eq!(
            format!("{fields:?}"),
            r#"[("event_id", "e1"), ("", "empty name"), ("empty value", ""), ("bin", "\x00\xff\x00")]"#
        );
        let none = EntryFields::default();
        assert_eq!((none.len(), none.is_empty(), none.byte_len()), (0, true, 0));
        assert_eq!(none.iter().next(), None);
        assert_eq!(none.get(0), None);
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
        let fields = fields.into_iter().collect();
        let (kept, why) =
            Event::parse("s".into(), "1-0".into(), fields, None, 1, limits).unwrap_err();
        assert_eq!(kept[1].1.len(), PREFIX);
        assert!(kept[1].1.capacity() <= PREFIX, "memory given back");
        assert!(why.0.contains("10016 bytes in 2 fields"), "{why}");
        assert!(why.0.contains("payload 10000"), "{why}");
    }

    #[test]
    fn fields_parsed_from_a_reply_hold_no_more_than_their_bytes() {
        use redis::Value::*;
        let body = Array(
            (0..10)
                .flat_map(|n| {
                    [
                        BulkString(format!("f{n}").into_bytes()),
                        BulkString(vec![b'v'; 100]),
                    ]
                })
                .collect(),
        );
        let entry = |body| Array(vec![Array(vec![BulkString(b"1-0".to_vec()), body])]);
        let mut read = parse_entries(entry(body.clone()), 1 << 20).unwrap();
        let fields = read.pop().unwrap().fields.unwrap();
        assert_eq!(fields.len(), 10);
        assert_eq!(fields.byte_len(), 10 * (2 + 100));
        assert_eq!(fields.allocated(), fields.byte_len());
        assert_eq!(fields.to_vec(), parse_fields(body).unwrap());
    }

    #[test]
    fn an_entry_over_the_limit_that_came_whole_is_cut_down_as_it_is_read() {
        use redis::Value::*;
        let mut items = vec![
            BulkString(b"event_id".to_vec()),
            BulkString(b"e".to_vec()),
            BulkString(b"payload".to_vec()),
            BulkString(vec![b'x'; 10_000]),
        ];
        for n in 0..70 {
            items.push(BulkString(format!("f{n}").into_bytes()));
            items.push(BulkString(b"v".to_vec()));
        }
        let reply = Array(vec![Array(vec![BulkString(b"1-0".to_vec()), Array(items)])]);
        let entry = parse_entries(reply.clone(), 1_000).unwrap().pop().unwrap();
        let fields = entry.fields.unwrap();
        assert_eq!(fields.len(), MOST_FIELDS);
        assert_eq!(fields.get(1).unwrap().1.len(), PREFIX);
        assert_eq!(
            fields.allocated(),
            fields.byte_len(),
            "only the prefixes held"
        );
        let cut = entry.cut.expect("cut down");
        assert_eq!((cut.fields, cut.sizes.len()), (72, MOST_FIELDS));
        assert_eq!(cut.bytes, 8 + 1 + 7 + 10_000 + 70 * 2 + 10 + 60 * 2);
        // The same as an entry cut down after it was read whole.
        let whole = parse_entries(reply, usize::MAX).unwrap().pop().unwrap();
        let mut cut_after = whole.fields.unwrap();
        assert_eq!(Cut::apply(&mut cut_after), cut);
        assert_eq!(cut_after, fields);
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
        let entries = parse_entries(v, 1 << 20).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].fields.as_ref().unwrap().get(0).unwrap().1, b"a");
        assert!(entries[1].fields.is_none());
    }
}
