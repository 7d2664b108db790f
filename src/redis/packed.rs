//! The entries of a read, packed by the read script with MessagePack.
//!
//! redis-rs parses a reply value by value, at a few hundred nanoseconds
//! each, and a stream entry is seven of them (the entry, its id, its fields,
//! two names, two values): for small events the parse cost more CPU than
//! the rest of the worker together. The read script packs its entries into
//! one string with Redis's own `cmsgpack` instead, and this module reads the
//! entries out of it.
//!
//! Only what `cmsgpack.pack` makes of a script's entries is taken: arrays,
//! strings, integers, `false` (a deleted entry's missing fields) and nil.
//!
//! The entries are read straight into [`RawEntry`]s: each entry's names and
//! values are copied once, into the one buffer the event keeps
//! ([`EntryFields`], sized first). (Unpacking into redis-rs's
//! reply first, and reading that as `event::parse_entries` reads a reply,
//! made two arrays per entry that were thrown away at once, and allocations
//! made by the reader thread and freed by the workers are where glibc's
//! allocator is slowest: the reader spent 39% of its instructions in it.)

use rmp::decode::{read_marker, Bytes, RmpRead};
use rmp::Marker;

use crate::event::{Cut, EntryFields, RawEntry};

/// The entries `packed` holds: `[[id, fields], ...]`, where `fields` is
/// `[name, value, ...]`, or `false` for an entry deleted while pending, and
/// an entry cut down in Redis has three more items: its size in bytes, its
/// number of fields, and the sizes of the values kept (see `streams.rs`).
pub(crate) fn entries(packed: &[u8]) -> Result<Vec<RawEntry>, String> {
    let mut rd = Bytes::new(packed);
    let n = array(&mut rd)?;
    // Each entry takes three bytes at least (an array, an id, `false`): a
    // length beyond that is a broken string, not a reason to reserve memory.
    let mut entries = Vec::with_capacity(n.min(rd.remaining_slice().len() / 3));
    for _ in 0..n {
        entries.push(entry(&mut rd)?);
    }
    match rd.remaining_slice().len() {
        0 => Ok(entries),
        n => Err(format!("packed entries: {n} bytes after the value")),
    }
}

fn entry(rd: &mut Bytes<'_>) -> Result<RawEntry, String> {
    let parts = array(rd)?;
    if !(parts == 2 || parts == 5) {
        return Err("packed entries: expected [id, fields]".into());
    }
    let id = String::from_utf8(string(rd)?.to_vec())
        .map_err(|_| "packed entries: an entry id that is not UTF-8".to_owned())?;
    let fields = match marker(rd)? {
        Marker::Null | Marker::False => None,
        m => {
            let items = array_of(rd, m)?;
            Some(fields(rd, items)?)
        }
    };
    let cut = match parts {
        5 => {
            let (bytes, count) = (int(rd)?, int(rd)?);
            let n = array(rd)?;
            let mut sizes = Vec::with_capacity(n.min(rd.remaining_slice().len()));
            for _ in 0..n {
                sizes.push(int(rd)?);
            }
            Some(Cut {
                bytes,
                fields: count,
                sizes,
            })
        }
        _ => None,
    };
    Ok(RawEntry {
        id,
        fields,
        cut,
        seen: None,
    })
}

/// `[name, value, ...]` of `items` items.
fn fields(rd: &mut Bytes<'_>, items: usize) -> Result<EntryFields, String> {
    if !items.is_multiple_of(2) {
        return Err("packed entries: an odd number of field items".into());
    }
    // Their size first, on a copy of the cursor, so that the buffer is
    // allocated once and at its size (what is left of the string is the
    // rest of the read: room for it all in every entry held 14,645 bytes
    // for an entry of 217 in a read of 64).
    let mut ahead = Bytes::new(rd.remaining_slice());
    let mut size = 0;
    for _ in 0..items {
        size += string(&mut ahead)?.len();
    }
    let mut fields = EntryFields::with_capacity(items / 2, size);
    for _ in 0..items / 2 {
        let name = string(rd)?;
        fields.push(name, string(rd)?);
    }
    Ok(fields)
}

fn cut_short<E>(_: E) -> String {
    "packed entries: cut short".to_owned()
}

fn marker(rd: &mut Bytes<'_>) -> Result<Marker, String> {
    read_marker(rd).map_err(cut_short)
}

/// The length of the array that comes next.
fn array(rd: &mut Bytes<'_>) -> Result<usize, String> {
    let m = marker(rd)?;
    array_of(rd, m)
}

fn array_of(rd: &mut Bytes<'_>, marker: Marker) -> Result<usize, String> {
    match marker {
        Marker::FixArray(n) => Ok(n.into()),
        Marker::Array16 => Ok(rd.read_data_u16().map_err(cut_short)?.into()),
        Marker::Array32 => Ok(rd.read_data_u32().map_err(cut_short)? as usize),
        // `cmsgpack` packs an empty table as an empty map in some versions.
        Marker::FixMap(0) => Ok(0),
        other => Err(format!("packed entries: expected an array, got {other:?}")),
    }
}

/// The string that comes next (a number, as redis-rs would have given
/// one, is not taken: the script sends none where a string goes).
fn string<'a>(rd: &mut Bytes<'a>) -> Result<&'a [u8], String> {
    let len = match marker(rd)? {
        Marker::FixStr(n) => n.into(),
        Marker::Str8 | Marker::Bin8 => rd.read_data_u8().map_err(cut_short)?.into(),
        Marker::Str16 | Marker::Bin16 => rd.read_data_u16().map_err(cut_short)?.into(),
        Marker::Str32 | Marker::Bin32 => rd.read_data_u32().map_err(cut_short)? as usize,
        other => return Err(format!("packed entries: expected a string, got {other:?}")),
    };
    let rest = rd.remaining_slice();
    if rest.len() < len {
        return Err("packed entries: a string cut short".into());
    }
    let (value, rest) = rest.split_at(len);
    *rd = Bytes::new(rest);
    Ok(value)
}

/// The integer that comes next, at least 0.
fn int(rd: &mut Bytes<'_>) -> Result<u64, String> {
    let n: i64 = match marker(rd)? {
        Marker::FixPos(n) => n.into(),
        Marker::U8 => rd.read_data_u8().map_err(cut_short)?.into(),
        Marker::U16 => rd.read_data_u16().map_err(cut_short)?.into(),
        Marker::U32 => rd.read_data_u32().map_err(cut_short)?.into(),
        Marker::U64 => return rd.read_data_u64().map_err(cut_short),
        Marker::I8 => rd.read_data_i8().map_err(cut_short)?.into(),
        Marker::I16 => rd.read_data_i16().map_err(cut_short)?.into(),
        Marker::I32 => rd.read_data_i32().map_err(cut_short)?.into(),
        Marker::I64 => rd.read_data_i64().map_err(cut_short)?,
        other => return Err(format!("packed entries: expected a number, got {other:?}")),
    };
    u64::try_from(n).map_err(|_| "packed entries: a negative size".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(fields: &[(&str, &str)]) -> EntryFields {
        fields.iter().copied().collect()
    }

    #[test]
    fn each_entry_holds_its_own_bytes_not_the_rest_of_the_read() {
        // 64 entries of ["event_id", "e<n>", "payload", 200 bytes].
        let mut packed = vec![0xdc, 0, 64];
        for n in 0..64u8 {
            packed.extend([0x92, 0xa4, b'1', b'-', b'0' + n / 10, b'0' + n % 10, 0x94]);
            packed.push(0xa8);
            packed.extend(b"event_id");
            packed.extend([0xa2, b'e', b'0' + n % 10]);
            packed.push(0xa7);
            packed.extend(b"payload");
            packed.extend([0xd9, 200]);
            packed.extend([b'x'; 200]);
        }
        let got = entries(&packed).unwrap();
        assert_eq!(got.len(), 64);
        for entry in &got {
            let fields = entry.fields.as_ref().unwrap();
            assert_eq!(fields.byte_len(), 8 + 2 + 7 + 200);
            assert_eq!(fields.allocated(), fields.byte_len(), "{}", entry.id);
        }
    }

    #[test]
    fn reads_whole_deleted_and_cut_entries() {
        // [["1-0", ["event_id", "e"]], ["2-0", false], ["3-0", {}, 300, 2, [200, 100]]]
        let mut packed = vec![0x93];
        packed.extend([0x92, 0xa3, b'1', b'-', b'0', 0x92]);
        packed.extend([0xa8]);
        packed.extend(b"event_id");
        packed.extend([0xa1, b'e']);
        packed.extend([0x92, 0xa3, b'2', b'-', b'0', 0xc2]);
        packed.extend([0x95, 0xa3, b'3', b'-', b'0', 0x80]);
        packed.extend([0xcd, 0x01, 0x2c, 0x02, 0x92, 0xcc, 200, 100]);
        let got = entries(&packed).unwrap();
        let got: Vec<_> = got
            .into_iter()
            .map(|e| (e.id, e.fields, e.cut, e.seen.is_none()))
            .collect();
        let cut = Cut {
            bytes: 300,
            fields: 2,
            sizes: vec![200, 100],
        };
        assert_eq!(
            got,
            [
                ("1-0".into(), Some(pairs(&[("event_id", "e")])), None, true),
                ("2-0".into(), None, None, true),
                ("3-0".into(), Some(EntryFields::default()), Some(cut), true),
            ]
        );
        // Nothing read: an empty array, or an empty table packed as a map.
        assert!(entries(&[0x90]).unwrap().is_empty());
        assert!(entries(&[0x80]).unwrap().is_empty());
    }

    #[test]
    fn broken_input_is_an_error_not_a_panic() {
        for bad in [
            &[][..],
            &[0x91, 0x92, 0xa3, b'1'],             // a string cut short
            &[0xdd, 0xff, 0xff, 0xff, 0xff],       // a huge array of nothing
            &[0x91, 0x93, 0xa1, b'1', 0x90, 0x90], // three parts
            &[0x91, 0x92, 0xa1, b'1', 0x91, 0xa1, b'k'], // a name without its value
            &[0x91, 0x92, 0x01, 0x90],             // an id that is a number
            &[0x91, 0x92, 0xa1, 0xff, 0x90],       // an id that is not UTF-8
            &[0x91, 0x95, 0xa1, b'1', 0x90, 0xff, 0x00, 0x90], // a negative size
            &[0x90, 0x00],                         // a byte too many
            &[0xc1],                               // a reserved marker
            &[0x91, 0x92, 0xa1, b'1', 0xdd, 0xff, 0xff, 0xff, 0xfe], // a huge field count
            &[
                0x91, 0x92, 0xa1, b'1', 0x92, 0xdb, 0xff, 0xff, 0xff, 0xff, 0xa0,
            ], // a 4 GiB name
        ] {
            assert!(entries(bad).is_err(), "{bad:?}");
        }
    }
}
