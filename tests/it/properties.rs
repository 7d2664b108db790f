//! Property tests (proptest) of the pure parts the guarantees rest on (the
//! backoff's are unit tests in src/backoff.rs):
//!
//! - SQLSTATE classification is total: any string gets a class without a
//!   panic, and every code of the classes the README names gets that class;
//! - the dead-letter entry format round-trips through
//!   `DeadLetter::to_fields` / `DeadLetter::from_fields` for arbitrary field
//!   maps (binary names and values, any reason and history text), in memory
//!   and through a real Redis stream entry; and decoding arbitrary fields
//!   never panics.

use std::time::{Duration, UNIX_EPOCH};

use proptest::prelude::*;
use taskhub::dlq::Attempt;
use taskhub::{classify_sqlstate, DeadLetter, DeadLetterKind, FailureClass};

// ---------------------------------------------------------------------------
// SQLSTATE classification
// ---------------------------------------------------------------------------

/// What the README's failure table says about a 5-character SQLSTATE.
fn documented_class(code: &str) -> FailureClass {
    if code.starts_with("08") || ["57P01", "57P02", "57P03", "53300", "25006"].contains(&code) {
        FailureClass::Outage
    } else if ["40001", "40P01", "55P03"].contains(&code) {
        FailureClass::Retryable
    } else if code.starts_with("22") || code.starts_with("23") || code.starts_with("42") {
        FailureClass::Permanent
    } else {
        FailureClass::Retryable
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    #[test]
    fn classification_is_total_on_any_string(code in any::<String>()) {
        // Never panics, never calls a database error "invalid" (that class is
        // for undecodable events).
        let class = classify_sqlstate(&code);
        prop_assert!(class != FailureClass::Invalid, "{code:?} -> {class:?}");
    }

    #[test]
    fn every_five_character_code_gets_its_documented_class(code in "[0-9A-Z]{5}") {
        prop_assert_eq!(classify_sqlstate(&code), documented_class(&code), "{}", code);
    }

    #[test]
    fn classes_22_23_and_42_are_permanent(
        class in prop_oneof![Just("22"), Just("23"), Just("42")],
        rest in "[0-9A-Z]{3}",
    ) {
        let code = format!("{class}{rest}");
        prop_assert_eq!(classify_sqlstate(&code), FailureClass::Permanent, "{}", code);
    }

    #[test]
    fn class_08_is_an_outage(rest in "[0-9A-Z]{3}") {
        let code = format!("08{rest}");
        prop_assert_eq!(classify_sqlstate(&code), FailureClass::Outage, "{}", code);
    }
}

#[test]
fn named_sqlstates_from_the_postgres_crate_are_classified() {
    use postgres::error::SqlState;
    let cases = [
        (SqlState::UNIQUE_VIOLATION, FailureClass::Permanent),
        (SqlState::CHECK_VIOLATION, FailureClass::Permanent),
        (SqlState::NOT_NULL_VIOLATION, FailureClass::Permanent),
        (SqlState::FOREIGN_KEY_VIOLATION, FailureClass::Permanent),
        (SqlState::DIVISION_BY_ZERO, FailureClass::Permanent),
        (
            SqlState::INVALID_TEXT_REPRESENTATION,
            FailureClass::Permanent,
        ),
        (
            SqlState::STRING_DATA_RIGHT_TRUNCATION,
            FailureClass::Permanent,
        ),
        (SqlState::UNDEFINED_TABLE, FailureClass::Permanent),
        (SqlState::SYNTAX_ERROR, FailureClass::Permanent),
        (SqlState::INSUFFICIENT_PRIVILEGE, FailureClass::Permanent),
        (SqlState::T_R_SERIALIZATION_FAILURE, FailureClass::Retryable),
        (SqlState::T_R_DEADLOCK_DETECTED, FailureClass::Retryable),
        (SqlState::LOCK_NOT_AVAILABLE, FailureClass::Retryable),
        (SqlState::READ_ONLY_SQL_TRANSACTION, FailureClass::Outage),
        (SqlState::DISK_FULL, FailureClass::Retryable),
        (SqlState::CONNECTION_FAILURE, FailureClass::Outage),
        (SqlState::ADMIN_SHUTDOWN, FailureClass::Outage),
        (SqlState::CRASH_SHUTDOWN, FailureClass::Outage),
        (SqlState::CANNOT_CONNECT_NOW, FailureClass::Outage),
        (SqlState::TOO_MANY_CONNECTIONS, FailureClass::Outage),
    ];
    for (state, class) in cases {
        assert_eq!(classify_sqlstate(state.code()), class, "{}", state.code());
    }
}

// ---------------------------------------------------------------------------
// Dead-letter format
// ---------------------------------------------------------------------------

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..24),
        // Names that look like the letter's own fields, with or without the
        // prefix of original fields.
        prop_oneof![
            Just(b"event_id".to_vec()),
            Just(b"reason".to_vec()),
            Just(b"kind".to_vec()),
            Just(b"f:".to_vec()),
            Just(b"f:payload".to_vec()),
            Just(b"history".to_vec()),
            Just(Vec::new()),
        ],
        proptest::collection::vec(any::<u8>(), 0..2000),
    ]
}

fn kind() -> impl Strategy<Value = DeadLetterKind> {
    prop::sample::select(DeadLetterKind::ALL.to_vec())
}

/// An attempt as the worker records it: times have millisecond precision in
/// the stored format.
fn attempt() -> impl Strategy<Value = Attempt> {
    (
        any::<u32>(),
        proptest::option::of(0u64..(1u64 << 50)),
        any::<String>(),
    )
        .prop_map(|(attempt, at_ms, error)| {
            Attempt::new(
                attempt,
                at_ms.map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
                error,
            )
        })
}

prop_compose! {
    fn dead_letter()(
        id in proptest::option::of("[0-9]{1,13}-[0-9]{1,3}"),
        original_id in any::<String>(),
        stream in any::<String>(),
        group in any::<String>(),
        consumer in any::<String>(),
        event_id in proptest::option::of(any::<String>()),
        kind in kind(),
        reason in any::<String>(),
        attempts in any::<u32>(),
        history in proptest::collection::vec(attempt(), 0..6),
        first_failed_at in any::<u64>(),
        dead_at in any::<u64>(),
        fields in proptest::collection::vec((bytes(), bytes()), 0..12),
    ) -> DeadLetter {
        let mut letter = DeadLetter::new(&stream, &original_id, kind, reason, fields);
        letter.id = id;
        letter.group = group;
        letter.consumer = consumer;
        letter.event_id = event_id;
        letter.attempts = attempts;
        letter.history = history;
        letter.first_failed_at = first_failed_at;
        letter.dead_at = dead_at;
        letter
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn dead_letter_round_trips_in_memory(letter in dead_letter()) {
        let fields = letter.to_fields();
        let back = DeadLetter::from_fields(letter.id.clone(), &fields)
            .map_err(|e| TestCaseError::fail(format!("decode failed: {e}")))?;
        prop_assert_eq!(&back, &letter);
        // Every original field keeps its position, name and bytes.
        for (k, v) in &letter.fields {
            if let Ok(name) = std::str::from_utf8(k) {
                prop_assert!(back.field(name).is_some());
            }
            prop_assert!(back.fields.contains(&(k.clone(), v.clone())));
        }
    }

    /// Decoding arbitrary fields never panics, and whatever decodes encodes
    /// back to a letter that decodes to itself.
    #[test]
    fn decoding_arbitrary_fields_never_panics(
        raw in proptest::collection::vec((bytes(), bytes()), 0..16),
        letter in dead_letter(),
        mix in any::<bool>(),
    ) {
        let raw = if mix {
            // A real letter with arbitrary fields spliced in.
            let mut f = letter.to_fields();
            f.extend(raw);
            f
        } else {
            raw
        };
        if let Ok(decoded) = DeadLetter::from_fields(None, &raw) {
            let again = DeadLetter::from_fields(None, &decoded.to_fields())
                .map_err(|e| TestCaseError::fail(format!("re-decode failed: {e}")))?;
            prop_assert_eq!(again, decoded);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The same through a real stream entry: XADD of `to_fields`, XRANGE,
    /// `from_fields` (Redis keeps names and values binary-safe, in order).
    #[test]
    fn dead_letter_round_trips_through_a_redis_stream(letter in dead_letter()) {
        let mut conn = crate::support::redis(&crate::support::redis_url());
        let stream = crate::support::unique("props");
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&stream).arg("*");
        let fields = letter.to_fields();
        for (k, v) in &fields {
            xadd.arg(k).arg(v);
        }
        let id: String = xadd.query(&mut conn).unwrap();
        let rows: Vec<(String, taskhub::Fields)> =
            redis::cmd("XRANGE").arg(&stream).arg("-").arg("+").query(&mut conn).unwrap();
        let _: i64 = redis::cmd("DEL").arg(&stream).query(&mut conn).unwrap();
        prop_assert_eq!(rows.len(), 1);
        let (read_id, read_fields) = &rows[0];
        prop_assert_eq!(read_id, &id);
        prop_assert_eq!(read_fields, &fields);
        let back = DeadLetter::from_fields(Some(id.clone()), read_fields)
            .map_err(|e| TestCaseError::fail(format!("decode failed: {e}")))?;
        let mut want = letter.clone();
        want.id = Some(id);
        prop_assert_eq!(back, want);
    }
}
