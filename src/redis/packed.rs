//! The entries of a read, packed by the read script with MessagePack.
//!
//! redis-rs parses a reply value by value, at a few hundred nanoseconds
//! each, and a stream entry is seven of them (the entry, its id, its fields,
//! two names, two values): for small events the parse cost more CPU than
//! the rest of the worker together. The read script packs its entries into
//! one string with Redis's own `cmsgpack` instead, and this module unpacks
//! it into the reply redis-rs would have given, which `event::parse_entries`
//! reads as before.
//!
//! Only what `cmsgpack.pack` makes of a script's entries is taken: arrays,
//! strings, integers, `false` (a deleted entry's missing fields) and nil.

use redis::Value;
use rmp::decode::{read_marker, Bytes, RmpRead};
use rmp::Marker;

/// Deeper than a read's entries go (entries, entry, fields or sizes).
const MOST_DEPTH: usize = 4;

/// The value `packed` holds, as redis-rs would have parsed it from a reply.
pub(crate) fn unpack(packed: &[u8]) -> Result<Value, String> {
    let mut rd = Bytes::new(packed);
    let value = read(&mut rd, 0)?;
    match rd.remaining_slice().len() {
        0 => Ok(value),
        n => Err(format!("packed entries: {n} bytes after the value")),
    }
}

fn read(rd: &mut Bytes<'_>, depth: usize) -> Result<Value, String> {
    if depth > MOST_DEPTH {
        return Err("packed entries: nested too deep".into());
    }
    let short = |_| "packed entries: cut short".to_owned();
    let marker = read_marker(rd).map_err(|_| "packed entries: cut short".to_owned())?;
    let int = |n: i64| Ok(Value::Int(n));
    match marker {
        Marker::Null | Marker::False => Ok(Value::Nil),
        Marker::FixPos(n) => int(n.into()),
        Marker::FixNeg(n) => int(n.into()),
        Marker::U8 => int(rd.read_data_u8().map_err(short)?.into()),
        Marker::U16 => int(rd.read_data_u16().map_err(short)?.into()),
        Marker::U32 => int(rd.read_data_u32().map_err(short)?.into()),
        Marker::U64 => i64::try_from(rd.read_data_u64().map_err(short)?)
            .map(Value::Int)
            .map_err(|_| "packed entries: an integer over 2^63".into()),
        Marker::I8 => int(rd.read_data_i8().map_err(short)?.into()),
        Marker::I16 => int(rd.read_data_i16().map_err(short)?.into()),
        Marker::I32 => int(rd.read_data_i32().map_err(short)?.into()),
        Marker::I64 => int(rd.read_data_i64().map_err(short)?),
        Marker::FixStr(n) => string(rd, n.into()),
        Marker::Str8 | Marker::Bin8 => {
            let n = rd.read_data_u8().map_err(short)?;
            string(rd, n.into())
        }
        Marker::Str16 | Marker::Bin16 => {
            let n = rd.read_data_u16().map_err(short)?;
            string(rd, n.into())
        }
        Marker::Str32 | Marker::Bin32 => {
            let n = rd.read_data_u32().map_err(short)?;
            string(rd, n as usize)
        }
        Marker::FixArray(n) => array(rd, n.into(), depth),
        Marker::Array16 => {
            let n = rd.read_data_u16().map_err(short)?;
            array(rd, n.into(), depth)
        }
        Marker::Array32 => {
            let n = rd.read_data_u32().map_err(short)?;
            array(rd, n as usize, depth)
        }
        // `cmsgpack` packs an empty table as an empty map in some versions.
        Marker::FixMap(0) => Ok(Value::Array(Vec::new())),
        other => Err(format!("packed entries: unexpected {other:?}")),
    }
}

fn string(rd: &mut Bytes<'_>, len: usize) -> Result<Value, String> {
    let rest = rd.remaining_slice();
    if rest.len() < len {
        return Err("packed entries: a string cut short".into());
    }
    let (value, rest) = rest.split_at(len);
    *rd = Bytes::new(rest);
    Ok(Value::BulkString(value.to_vec()))
}

fn array(rd: &mut Bytes<'_>, len: usize, depth: usize) -> Result<Value, String> {
    // Each item takes a byte at least: a length beyond what is left is a
    // broken string, not a reason to reserve memory.
    let mut items = Vec::with_capacity(len.min(rd.remaining_slice().len()));
    for _ in 0..len {
        items.push(read(rd, depth + 1)?);
    }
    Ok(Value::Array(items))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn unpacks_entries_as_a_reply() {
        // [["1-0", ["event_id", "e"]], ["2-0", false], ["3-0", [...], 300, 2, [200, 100]]]
        let mut packed = vec![0x93];
        packed.extend([0x92, 0xa3, b'1', b'-', b'0', 0x92]);
        packed.extend([0xa8]);
        packed.extend(b"event_id");
        packed.extend([0xa1, b'e']);
        packed.extend([0x92, 0xa3, b'2', b'-', b'0', 0xc2]);
        packed.extend([0x95, 0xa3, b'3', b'-', b'0', 0x90]);
        packed.extend([0xcd, 0x01, 0x2c, 0x02, 0x92, 0xcc, 200, 100]);
        let want = Value::Array(vec![
            Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![bulk("event_id"), bulk("e")]),
            ]),
            Value::Array(vec![bulk("2-0"), Value::Nil]),
            Value::Array(vec![
                bulk("3-0"),
                Value::Array(vec![]),
                Value::Int(300),
                Value::Int(2),
                Value::Array(vec![Value::Int(200), Value::Int(100)]),
            ]),
        ]);
        assert_eq!(unpack(&packed), Ok(want));
    }

    #[test]
    fn broken_input_is_an_error_not_a_panic() {
        for bad in [
            &[][..],
            &[0x92, 0xa3, b'1'],                         // a string cut short
            &[0xdd, 0xff, 0xff, 0xff, 0xff],             // a huge array of nothing
            &[0x91, 0x91, 0x91, 0x91, 0x91, 0x91, 0x90], // too deep
            &[0xa1, b'x', 0x00],                         // a byte too many
            &[0xc1],                                     // a reserved marker
        ] {
            assert!(unpack(bad).is_err(), "{bad:?}");
        }
    }
}
