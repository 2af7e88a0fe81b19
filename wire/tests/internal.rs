//! The broker-to-broker protocol (`felix_wire::internal`): every message round trips,
//! a short stream is "need more bytes" at every cut, corruption and broken rules are
//! typed refusals that keep the stream aligned, and limits hold on both sides.

use bytes::{BufMut, Bytes, BytesMut};
use felix_wire::frame::Decoded;
use felix_wire::internal::{
    self, BatchKind, BodyError, Bootstrap, EncodeError, Fence, FenceOk, Fetch, HEADER_LEN, Hello,
    HelloOk, HelloRefused, InternalError, InternalMessage, InternalReader, MAX_RECORDS_PER_MESSAGE,
    Ping, Pong, Records, RefusalCode, ReplicateOk, ReplicateRefused, ShardRef, ShipBatch,
    UnsupportedKind, capabilities, decode_frame, kind,
};
use felix_wire::message::ShardKind;
use felix_wire::{Generation, Offset, ShardId, WireStr};
use proptest::prelude::*;

fn shard() -> ShardRef {
    ShardRef {
        kind: ShardKind::Stream,
        tenant: WireStr::from("acme"),
        namespace: WireStr::from("default"),
        name: WireStr::from("orders"),
        incarnation: WireStr::default(),
        shard: ShardId(3),
    }
}

fn records() -> Records {
    Records {
        correlation_id: 20,
        shard: shard(),
        generation: Generation(7),
        leader: "node-a".into(),
        prev_offset: Offset(99),
        prev_generation: Generation(6),
        commit: Offset(95),
        batches: vec![
            ShipBatch {
                producer: None,
                base_offset: Offset(100),
                timestamp_micros: 1_700_000_000_000_000,
                kind: BatchKind::GenerationStart,
                records: vec![Bytes::copy_from_slice(&7u64.to_be_bytes())],
            },
            ShipBatch {
                producer: None,
                base_offset: Offset(101),
                timestamp_micros: 1_700_000_000_000_123,
                kind: BatchKind::Data,
                records: vec![
                    Bytes::from_static(b"hello"),
                    Bytes::new(),
                    Bytes::from_static(b"world"),
                ],
            },
        ],
    }
}

/// One message of every kind, every field non-trivial.
fn samples() -> Vec<InternalMessage> {
    vec![
        Hello {
            correlation_id: 1,
            node_id: "node-a".into(),
            token: "secret-token".into(),
            capabilities: capabilities::FENCE | capabilities::FETCH | 1 << 40,
        }
        .into(),
        HelloOk {
            correlation_id: 1,
            node_id: "node-b".into(),
            capabilities: capabilities::KNOWN,
        }
        .into(),
        HelloRefused {
            correlation_id: 2,
            reason: "unknown node".into(),
        }
        .into(),
        Fence {
            correlation_id: 10,
            shard: shard(),
            generation: Generation(7),
            leader: "node-a".into(),
        }
        .into(),
        FenceOk {
            correlation_id: 10,
            generation: Generation(7),
            log_base: Offset(5),
            log_end: Offset(120),
            commit: Offset(95),
            last_generation: Generation(6),
        }
        .into(),
        Fetch {
            correlation_id: 12,
            shard: ShardRef {
                kind: ShardKind::Cache,
                ..shard()
            },
            generation: Generation(7),
            leader: "node-a".into(),
            from_offset: Offset(95),
            max_bytes: 4 << 20,
        }
        .into(),
        records().into(),
        ReplicateOk {
            correlation_id: 20,
            generation: Generation(7),
            durable_end: Offset(104),
        }
        .into(),
        ReplicateRefused {
            correlation_id: 21,
            generation: Generation(7),
            code: RefusalCode::Gap,
            expected_offset: Offset(90),
            detail: "batch starts past the tail".into(),
        }
        .into(),
        Bootstrap {
            correlation_id: 23,
            shard: shard(),
            generation: Generation(7),
            leader: "node-a".into(),
            base_offset: Offset(5),
        }
        .into(),
        Ping { correlation_id: 30 }.into(),
        Pong { correlation_id: 30 }.into(),
        UnsupportedKind {
            correlation_id: 77,
            kind: 99,
        }
        .into(),
    ]
}

fn encode(message: &InternalMessage) -> Vec<u8> {
    let mut buf = BytesMut::new();
    message.encode(&mut buf).unwrap();
    buf.to_vec()
}

/// A frame with any kind and payload, written by hand.
fn raw_frame(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&internal::MAGIC.to_be_bytes());
    out.extend_from_slice(&internal::VERSION.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn decode_one(bytes: &[u8]) -> Result<InternalMessage, InternalError> {
    match decode_frame(&Bytes::copy_from_slice(bytes), u32::MAX)? {
        Decoded::Complete { value, consumed } => {
            assert_eq!(consumed, bytes.len());
            Ok(value)
        }
        Decoded::NeedMore(n) => panic!("short by {n}"),
    }
}

fn malformed(result: Result<InternalMessage, InternalError>) -> (Option<u64>, BodyError) {
    match result {
        Err(e @ InternalError::Malformed { .. }) => {
            assert!(!e.is_fatal());
            let InternalError::Malformed {
                correlation_id,
                problem,
                ..
            } = e
            else {
                unreachable!()
            };
            (correlation_id, problem)
        }
        other => panic!("expected a malformed body, got {other:?}"),
    }
}

fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// A `Records` payload written by hand: the fields of [`records`] with `section` as the
/// batches section, under its correct CRC unless `crc` says otherwise.
fn raw_records(section: &[u8], crc: Option<u32>) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&20u64.to_be_bytes());
    p.push(1);
    put_str(&mut p, b"acme");
    put_str(&mut p, b"default");
    put_str(&mut p, b"orders");
    p.extend_from_slice(&3u32.to_be_bytes());
    p.extend_from_slice(&7u64.to_be_bytes());
    put_str(&mut p, b"node-a");
    p.extend_from_slice(&0u64.to_be_bytes());
    p.extend_from_slice(&0u64.to_be_bytes());
    p.extend_from_slice(&95u64.to_be_bytes());
    let crc = crc.unwrap_or_else(|| crc32c::crc32c(section));
    p.extend_from_slice(&crc.to_be_bytes());
    p.extend_from_slice(section);
    raw_frame(kind::RECORDS, &p)
}

/// A batches section: `(base_offset, kind byte, records)` per batch.
fn section(batches: &[(u64, u8, &[&[u8]])]) -> Vec<u8> {
    let mut s = Vec::new();
    s.extend_from_slice(&(batches.len() as u32).to_be_bytes());
    for (base, kind, records) in batches {
        s.extend_from_slice(&base.to_be_bytes());
        s.extend_from_slice(&1u64.to_be_bytes());
        s.push(*kind);
        s.extend_from_slice(&(records.len() as u32).to_be_bytes());
        for r in *records {
            put_str(&mut s, r);
        }
    }
    s
}

#[test]
fn samples_cover_every_kind_and_round_trip_canonically() {
    let all = samples();
    let kinds: Vec<u16> = all.iter().map(InternalMessage::kind).collect();
    let named: Vec<u16> = kind::NAMED.iter().map(|(k, _)| *k).collect();
    assert_eq!(kinds, named);
    for m in all {
        let bytes = encode(&m);
        assert_eq!(u16::from_be_bytes([bytes[6], bytes[7]]), m.kind());
        assert_eq!(
            u64::from_be_bytes(bytes[HEADER_LEN..HEADER_LEN + 8].try_into().unwrap()),
            m.correlation_id(),
            "every payload starts with the correlation id"
        );
        let back = decode_one(&bytes).unwrap();
        assert_eq!(back, m);
        assert_eq!(encode(&back), bytes);
    }
}

#[test]
fn the_hand_written_layout_matches_the_encoder() {
    let m = Records {
        prev_offset: Offset(0),
        prev_generation: Generation(0),
        ..records()
    };
    let hand = raw_records(
        &section(&[
            (100, 1, &[&7u64.to_be_bytes()]),
            (101, 0, &[b"hello", b"", b"world"]),
        ]),
        None,
    );
    // The hand-written section stamps every batch with timestamp 1.
    let mut m = m;
    for b in &mut m.batches {
        b.timestamp_micros = 1;
    }
    assert_eq!(hex::encode(encode(&m.clone().into())), hex::encode(&hand));
    assert_eq!(decode_one(&hand).unwrap(), m.into());
}

#[test]
fn truncation_at_every_byte_needs_more_until_the_frame_is_whole() {
    for m in samples() {
        let bytes = encode(&m);
        for cut in 0..bytes.len() {
            let prefix = Bytes::copy_from_slice(&bytes[..cut]);
            match decode_frame(&prefix, internal::DEFAULT_MAX_PAYLOAD_BYTES) {
                Ok(Decoded::NeedMore(n)) => {
                    assert!(n > 0, "{m:?} cut {cut}");
                    if cut >= HEADER_LEN {
                        assert_eq!(n, bytes.len() - cut, "{m:?} cut {cut}");
                    }
                }
                other => panic!("{m:?} cut {cut}: {other:?}"),
            }
            let mut reader = InternalReader::default();
            reader.push(prefix);
            assert_eq!(reader.next(), Ok(None), "{m:?} cut {cut}");
            assert!(reader.needed() > 0);
            reader.push(Bytes::copy_from_slice(&bytes[cut..]));
            assert_eq!(reader.next(), Ok(Some(m.clone())), "{m:?} cut {cut}");
            assert_eq!(reader.next(), Ok(None));
            assert_eq!(reader.buffered(), 0);
        }
    }
}

#[test]
fn the_reader_reassembles_a_stream_split_anywhere() {
    let all = samples();
    let stream: Vec<u8> = all.iter().flat_map(encode).collect();
    for split in [1, 2, 3, 7, 11, 12, 13, 64, 1000, stream.len()] {
        let mut reader = InternalReader::default();
        let mut got = Vec::new();
        for piece in stream.chunks(split) {
            reader.push(Bytes::copy_from_slice(piece));
            while let Some(m) = reader.next().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, all, "split {split}");
        assert_eq!(reader.buffered(), 0);
    }
}

#[test]
fn records_in_a_whole_chunk_are_not_copied() {
    let chunk = Bytes::from(encode(&records().into()));
    let range = chunk.as_ptr() as usize..chunk.as_ptr() as usize + chunk.len();
    let mut reader = InternalReader::default();
    reader.push(chunk.clone());
    let Some(InternalMessage::Records(r)) = reader.next().unwrap() else {
        panic!("records")
    };
    for record in r.batches.iter().flat_map(|b| &b.records) {
        if !record.is_empty() {
            assert!(range.contains(&(record.as_ptr() as usize)));
        }
    }
    assert!(range.contains(&(r.shard.tenant.as_bytes().as_ptr() as usize)));
}

#[test]
fn a_flipped_bit_in_the_batches_section_fails_the_checksum() {
    let m = records();
    let bytes = encode(&m.clone().into());
    let crc_at = crc_at(&m);
    let carried = u32::from_be_bytes(bytes[crc_at..crc_at + 4].try_into().unwrap());
    assert_eq!(carried, crc32c::crc32c(&bytes[crc_at + 4..]));
    for byte in crc_at..bytes.len() {
        for bit in 0..8 {
            let mut bad = bytes.clone();
            bad[byte] ^= 1 << bit;
            let (correlation_id, problem) = malformed(decode_one(&bad));
            assert_eq!(correlation_id, Some(20));
            assert!(
                matches!(problem, BodyError::ChecksumMismatch { .. }),
                "byte {byte} bit {bit}: {problem:?}"
            );
        }
    }
    // The corrupted frame was consumed: the next one is read.
    let mut bad = bytes.clone();
    *bad.last_mut().unwrap() ^= 0x80;
    bad.extend(encode(&Ping { correlation_id: 5 }.into()));
    let mut reader = InternalReader::default();
    reader.push(Bytes::from(bad));
    assert!(matches!(
        reader.next(),
        Err(InternalError::Malformed {
            kind: kind::RECORDS,
            problem: BodyError::ChecksumMismatch { .. },
            ..
        })
    ));
    assert_eq!(reader.next(), Ok(Some(Ping { correlation_id: 5 }.into())));
}

#[test]
fn non_contiguous_batches_are_refused_both_ways() {
    let mut m = records();
    m.batches[1].base_offset = Offset(102);
    let mut buf = BytesMut::from(&b"keep"[..]);
    assert_eq!(
        m.encode(&mut buf),
        Err(EncodeError::Invalid {
            kind: kind::RECORDS,
            problem: BodyError::NotContiguous {
                index: 1,
                expected: Offset(101),
                found: Offset(102),
            },
        })
    );
    assert_eq!(&buf[..], b"keep", "nothing is left behind");

    let gap = raw_records(&section(&[(100, 0, &[b"a"]), (102, 0, &[b"b"])]), None);
    let overlap = raw_records(
        &section(&[(100, 0, &[b"a", b"b"]), (101, 0, &[b"c"])]),
        None,
    );
    for bytes in [gap, overlap] {
        let (_, problem) = malformed(decode_one(&bytes));
        assert!(
            matches!(problem, BodyError::NotContiguous { index: 1, .. }),
            "{problem:?}"
        );
    }
    let fine = raw_records(&section(&[(100, 0, &[b"a"]), (101, 0, &[b"b"])]), None);
    decode_one(&fine).unwrap();
}

/// A commit is one record; a peer shipping a commit batch of more made a subscriber's
/// history read slice past the one event it shows (a core panic, again after every
/// restart: the batch was durable).
#[test]
fn a_commit_batch_of_other_than_one_record_is_refused_both_ways() {
    let mut m = records();
    m.batches.truncate(1);
    m.batches[0].kind = BatchKind::Commit;
    m.batches[0].records = vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")];
    assert!(matches!(
        m.encode(&mut BytesMut::new()),
        Err(EncodeError::Invalid {
            problem: BodyError::CommitNotOneRecord { index: 0, count: 2 },
            ..
        })
    ));
    let (_, problem) = malformed(decode_one(&raw_records(
        &section(&[(100, 0, &[b"a"]), (101, 2, &[b"b", b"c", b"d"])]),
        None,
    )));
    assert_eq!(
        problem,
        BodyError::CommitNotOneRecord { index: 1, count: 3 }
    );
    decode_one(&raw_records(&section(&[(100, 2, &[b"a"])]), None)).unwrap();
}

#[test]
fn empty_batches_overflowing_offsets_and_a_wrong_prev_are_refused() {
    let mut m = records();
    m.batches[0].records.clear();
    assert!(matches!(
        m.encode(&mut BytesMut::new()),
        Err(EncodeError::Invalid {
            problem: BodyError::EmptyBatch { index: 0 },
            ..
        })
    ));
    let (_, problem) = malformed(decode_one(&raw_records(
        &section(&[(100, 0, &[]), (100, 0, &[b"abcdef"])]),
        None,
    )));
    assert_eq!(problem, BodyError::EmptyBatch { index: 0 });

    let (_, problem) = malformed(decode_one(&raw_records(
        &section(&[(u64::MAX, 0, &[b"a"])]),
        None,
    )));
    assert_eq!(problem, BodyError::OffsetOverflow { index: 0 });

    let mut m = records();
    m.prev_offset = Offset(98);
    assert!(matches!(
        m.encode(&mut BytesMut::new()),
        Err(EncodeError::Invalid {
            problem: BodyError::PrevMismatch { .. },
            ..
        })
    ));
    // 0/0 means "from the log's base", wherever that is; no batches, no constraint.
    let mut m = records();
    (m.prev_offset, m.prev_generation) = (Offset(0), Generation(0));
    m.encode(&mut BytesMut::new()).unwrap();
    m.prev_offset = Offset(12345);
    m.batches.clear();
    m.encode(&mut BytesMut::new()).unwrap();
}

#[test]
fn a_shard_named_with_its_incarnation_travels_as_kind_3_or_4_and_never_with_an_empty_one() {
    let fence = |shard: ShardRef| -> InternalMessage {
        Fence {
            correlation_id: 8,
            shard,
            generation: Generation(1),
            leader: "node-a".into(),
        }
        .into()
    };
    for (kind, byte) in [(ShardKind::Stream, 3), (ShardKind::Cache, 4)] {
        let m = fence(ShardRef {
            kind,
            incarnation: WireStr::from("5f0c9a1e"),
            ..shard()
        });
        let mut buf = BytesMut::new();
        m.encode(&mut buf).unwrap();
        assert_eq!(buf[HEADER_LEN + 8], byte, "{kind:?}");
        assert_eq!(decode_one(&buf).unwrap(), m);
    }
    // Without one, the bytes are those of a build that knows no incarnations.
    let mut old = BytesMut::new();
    fence(shard()).encode(&mut old).unwrap();
    assert_eq!(old[HEADER_LEN + 8], 1);

    // Kind 3 with an empty incarnation would decode to what kind 1 encodes: refused.
    let mut p = 8u64.to_be_bytes().to_vec();
    p.push(3);
    for s in [&b"acme"[..], b"default", b"orders", b""] {
        put_str(&mut p, s);
    }
    p.extend_from_slice(&3u32.to_be_bytes());
    p.extend_from_slice(&1u64.to_be_bytes());
    put_str(&mut p, b"node-a");
    let (correlation_id, problem) = malformed(decode_one(&raw_frame(kind::FENCE, &p)));
    assert_eq!(correlation_id, Some(8));
    assert_eq!(problem, BodyError::EmptyIncarnation);
    // The same frame with an incarnation decodes.
    let at = 8 + 1 + (4 + 4) + (4 + 7) + (4 + 6);
    let mut named = p.clone();
    named.splice(at..at + 4, [0, 0, 0, 2, b'i', b'1']);
    let InternalMessage::Fence(f) = decode_one(&raw_frame(kind::FENCE, &named)).unwrap() else {
        panic!("not a fence")
    };
    assert_eq!(f.shard.incarnation.as_str(), "i1");
    assert_eq!(f.shard.name.as_str(), "orders");
}

#[test]
fn unknown_shard_and_batch_kinds_and_bad_utf8_are_refused() {
    let mut bytes = raw_records(&section(&[(100, 5, &[b"a"])]), None);
    let (_, problem) = malformed(decode_one(&bytes));
    assert_eq!(problem, BodyError::UnknownBatchKind { byte: 5 });
    bytes[HEADER_LEN + 8] = 5; // the shard kind byte
    let (_, problem) = malformed(decode_one(&bytes));
    assert_eq!(problem, BodyError::UnknownShardKind { byte: 5 });

    let mut p = 9u64.to_be_bytes().to_vec();
    put_str(&mut p, &[0xff, 0xfe]);
    let (correlation_id, problem) = malformed(decode_one(&raw_frame(kind::HELLO_REFUSED, &p)));
    assert_eq!(correlation_id, Some(9));
    assert_eq!(problem, BodyError::InvalidUtf8 { field: "reason" });
}

#[test]
fn every_string_field_has_its_own_limit() {
    let at = |n: usize| "x".repeat(n);
    let hello = |node_id: String, token: String| -> InternalMessage {
        Hello {
            correlation_id: 1,
            node_id,
            token,
            capabilities: 0,
        }
        .into()
    };
    let ok = [
        hello(at(internal::MAX_IDENT_BYTES), at(internal::MAX_TOKEN_BYTES)),
        HelloRefused {
            correlation_id: 1,
            reason: at(internal::MAX_TEXT_BYTES),
        }
        .into(),
        Fence {
            correlation_id: 1,
            shard: ShardRef {
                name: WireStr::from(at(internal::MAX_IDENT_BYTES)),
                ..shard()
            },
            generation: Generation(1),
            leader: at(internal::MAX_IDENT_BYTES),
        }
        .into(),
    ];
    for m in ok {
        assert_eq!(decode_one(&encode(&m)).unwrap(), m);
    }
    let too_long: [(InternalMessage, &str, usize); 5] = [
        (
            hello(at(internal::MAX_IDENT_BYTES + 1), String::new()),
            "node_id",
            512,
        ),
        (
            hello(String::new(), at(internal::MAX_TOKEN_BYTES + 1)),
            "token",
            16 * 1024,
        ),
        (
            ReplicateRefused {
                correlation_id: 1,
                generation: Generation(1),
                code: RefusalCode::Malformed,
                expected_offset: Offset(0),
                detail: at(internal::MAX_TEXT_BYTES + 1),
            }
            .into(),
            "detail",
            1024,
        ),
        (
            Bootstrap {
                correlation_id: 1,
                shard: ShardRef {
                    tenant: WireStr::from(at(513)),
                    ..shard()
                },
                generation: Generation(1),
                leader: String::new(),
                base_offset: Offset(0),
            }
            .into(),
            "tenant",
            512,
        ),
        (
            Fetch {
                correlation_id: 1,
                shard: shard(),
                generation: Generation(1),
                leader: at(513),
                from_offset: Offset(0),
                max_bytes: 0,
            }
            .into(),
            "leader",
            512,
        ),
    ];
    for (m, field, max) in too_long {
        let mut buf = BytesMut::new();
        match m.encode(&mut buf) {
            Err(EncodeError::Invalid {
                problem:
                    BodyError::StringTooLong {
                        field: got_field,
                        max: got_max,
                        ..
                    },
                ..
            }) => assert_eq!((got_field, got_max), (field, max)),
            other => panic!("{field}: {other:?}"),
        }
        assert!(buf.is_empty());
    }

    // On the wire the limit is checked on the length prefix, before the bytes.
    for (len, present) in [(513u32, 513usize), (u32::MAX, 0)] {
        let mut p = 1u64.to_be_bytes().to_vec();
        p.extend_from_slice(&len.to_be_bytes());
        p.extend(std::iter::repeat_n(b'x', present));
        let (_, problem) = malformed(decode_one(&raw_frame(kind::HELLO_OK, &p)));
        assert_eq!(
            problem,
            BodyError::StringTooLong {
                field: "node_id",
                len: len as usize,
                max: 512
            }
        );
    }
}

#[test]
fn lying_and_excessive_counts_are_refused() {
    // A record count larger than the bytes left.
    let mut s = section(&[(100, 0, &[b"a"])]);
    s[4 + 17..4 + 21].copy_from_slice(&u32::MAX.to_be_bytes());
    let (_, problem) = malformed(decode_one(&raw_records(&s, None)));
    assert!(
        matches!(
            problem,
            BodyError::CountTooLarge {
                field: "record count",
                ..
            }
        ),
        "{problem:?}"
    );
    // A batch count larger than the bytes left.
    let mut s = section(&[(100, 0, &[b"a"])]);
    s[..4].copy_from_slice(&1000u32.to_be_bytes());
    let (_, problem) = malformed(decode_one(&raw_records(&s, None)));
    assert!(
        matches!(
            problem,
            BodyError::CountTooLarge {
                field: "batch count",
                ..
            }
        ),
        "{problem:?}"
    );
    // A record longer than the bytes left.
    let mut s = section(&[(100, 0, &[b"a"])]);
    let at = s.len() - 5;
    s[at..at + 4].copy_from_slice(&2u32.to_be_bytes());
    let (_, problem) = malformed(decode_one(&raw_records(&s, None)));
    assert!(
        matches!(
            problem,
            BodyError::Truncated {
                field: "record",
                ..
            }
        ),
        "{problem:?}"
    );

    // 65,536 records fit in one message; one more does not, either way.
    // (The first batch holds one record.)
    let empties = vec![Bytes::new(); MAX_RECORDS_PER_MESSAGE - 1];
    let mut m = records();
    m.batches[1].records = empties;
    let bytes = encode(&m.clone().into());
    assert_eq!(decode_one(&bytes).unwrap(), m.clone().into());
    m.batches[1].records.push(Bytes::new());
    assert_eq!(
        m.encode(&mut BytesMut::new()),
        Err(EncodeError::Invalid {
            kind: kind::RECORDS,
            problem: BodyError::TooManyRecords {
                count: MAX_RECORDS_PER_MESSAGE + 1,
                max: MAX_RECORDS_PER_MESSAGE
            }
        })
    );
    let one_more = vec![&b""[..]; MAX_RECORDS_PER_MESSAGE];
    let (_, problem) = malformed(decode_one(&raw_records(
        &section(&[(0, 0, &[b"x"]), (1, 0, &one_more)]),
        None,
    )));
    assert_eq!(
        problem,
        BodyError::TooManyRecords {
            count: MAX_RECORDS_PER_MESSAGE + 1,
            max: MAX_RECORDS_PER_MESSAGE
        }
    );
}

#[test]
fn trailing_bytes_and_short_bodies_are_refused() {
    let mut p = 1u64.to_be_bytes().to_vec();
    p.extend_from_slice(&[0; 8 * 5]);
    decode_one(&raw_frame(kind::FENCE_OK, &p)).unwrap();
    p.push(0);
    let (_, problem) = malformed(decode_one(&raw_frame(kind::FENCE_OK, &p)));
    assert_eq!(problem, BodyError::TrailingBytes { count: 1 });
    // Inside the CRC-covered section too.
    let mut s = section(&[(100, 0, &[b"a"])]);
    s.push(0);
    let (_, problem) = malformed(decode_one(&raw_records(&s, None)));
    assert_eq!(problem, BodyError::TrailingBytes { count: 1 });
    // A payload too short for a correlation id, of a known or an unknown kind.
    for k in [kind::PING, 999] {
        let (correlation_id, problem) = malformed(decode_one(&raw_frame(k, &[1, 2, 3])));
        assert_eq!(correlation_id, None);
        assert!(matches!(problem, BodyError::Truncated { .. }));
    }
    let (correlation_id, problem) = malformed(decode_one(&raw_frame(kind::FENCE_OK, &[0; 12])));
    assert_eq!(correlation_id, Some(0));
    assert!(matches!(
        problem,
        BodyError::Truncated {
            field: "generation",
            ..
        }
    ));
}

#[test]
fn an_unknown_kind_decodes_and_the_stream_survives() {
    let mut body = 7u64.to_be_bytes().to_vec();
    body.extend_from_slice(b"a body from a newer peer");
    let mut stream = encode(&Ping { correlation_id: 1 }.into());
    stream.extend(raw_frame(999, &body));
    stream.extend(encode(&Pong { correlation_id: 2 }.into()));
    let mut reader = InternalReader::default();
    reader.push(Bytes::from(stream));
    assert_eq!(reader.next(), Ok(Some(Ping { correlation_id: 1 }.into())));
    let unknown = reader.next().unwrap().unwrap();
    assert_eq!(
        unknown,
        InternalMessage::Unknown {
            kind: 999,
            correlation_id: 7
        }
    );
    assert_eq!(reader.next(), Ok(Some(Pong { correlation_id: 2 }.into())));
    assert_eq!(reader.next(), Ok(None));

    // It is answered UnsupportedKind; an Unknown can be written for tests, never under a
    // known kind.
    let answer = UnsupportedKind {
        correlation_id: unknown.correlation_id(),
        kind: unknown.kind(),
    };
    assert_eq!(
        decode_one(&encode(&answer.clone().into())).unwrap(),
        answer.into()
    );
    assert_eq!(decode_one(&encode(&unknown)).unwrap(), unknown);
    assert_eq!(
        InternalMessage::Unknown {
            kind: kind::PING,
            correlation_id: 1
        }
        .encode(&mut BytesMut::new()),
        Err(EncodeError::KnownKind { kind: kind::PING })
    );
}

#[test]
fn bad_headers_are_fatal_and_the_limit_is_checked_on_the_header_alone() {
    let good = encode(&Ping { correlation_id: 1 }.into());
    let mut bad = good.clone();
    bad[3] = b'1';
    let mut reader = InternalReader::default();
    reader.push_slice(&bad);
    let err = reader.next().unwrap_err();
    assert!(err.is_fatal());
    assert_eq!(err, InternalError::BadMagic { found: 0x464C_5831 });
    assert_eq!(reader.next().unwrap_err(), err, "the error repeats");

    let mut bad = good.clone();
    bad[5] = 2;
    assert_eq!(
        decode_one(&bad),
        Err(InternalError::UnsupportedVersion { found: 2 })
    );

    let mut reader = InternalReader::new(1024);
    let header = internal::InternalHeader {
        kind: kind::RECORDS,
        length: 1025,
    };
    reader.push(Bytes::copy_from_slice(&header.to_bytes()));
    assert_eq!(
        reader.next(),
        Err(InternalError::TooLarge {
            length: 1025,
            max: 1024
        })
    );
    assert_eq!(
        decode_frame(&Bytes::copy_from_slice(&header.to_bytes()), 1024),
        Err(InternalError::TooLarge {
            length: 1025,
            max: 1024
        })
    );
    // A Hello with the largest token fits the pre-Hello limit.
    let big = Hello {
        correlation_id: 1,
        node_id: "n".repeat(internal::MAX_IDENT_BYTES),
        token: "t".repeat(internal::MAX_TOKEN_BYTES),
        capabilities: 0,
    };
    let mut reader = InternalReader::new(internal::PREHELLO_MAX_PAYLOAD_BYTES);
    reader.push(Bytes::from(encode(&big.clone().into())));
    assert_eq!(reader.next(), Ok(Some(big.into())));
}

#[test]
fn refusal_codes_keep_unknown_numbers() {
    let named = [
        (1, RefusalCode::Gap),
        (2, RefusalCode::Mismatch),
        (3, RefusalCode::Fenced),
        (4, RefusalCode::NotFenced),
        (5, RefusalCode::BelowCommit),
        (6, RefusalCode::Bootstrap),
        (7, RefusalCode::Unavailable),
        (8, RefusalCode::Malformed),
        (9, RefusalCode::Rebuilding),
        (10, RefusalCode::RebuildingNeedsGeneration),
    ];
    for (n, code) in named {
        assert_eq!(RefusalCode::from_number(n), code);
        assert_eq!(code.number(), n);
    }
    for n in [0, 11, 1000, u16::MAX] {
        assert_eq!(RefusalCode::from_number(n), RefusalCode::Unknown(n));
    }
    for n in 0..=u16::MAX {
        assert_eq!(RefusalCode::from_number(n).number(), n);
    }
}

#[test]
fn hello_debug_never_shows_the_token() {
    let hello = Hello {
        correlation_id: 1,
        node_id: "node-a".into(),
        token: "secret-token".into(),
        capabilities: 3,
    };
    let shown = format!("{hello:?}");
    assert!(!shown.contains("secret"), "{shown}");
    assert!(shown.contains("node-a"));
}

// ---- Properties ---------------------------------------------------------------------

fn ident() -> impl Strategy<Value = String> {
    ".{0,24}"
}

fn shard_ref() -> impl Strategy<Value = ShardRef> {
    (
        any::<bool>(),
        ident(),
        ident(),
        ident(),
        ident(),
        any::<u32>(),
    )
        .prop_map(
            |(stream, tenant, namespace, name, incarnation, shard)| ShardRef {
                kind: if stream {
                    ShardKind::Stream
                } else {
                    ShardKind::Cache
                },
                tenant: tenant.into(),
                namespace: namespace.into(),
                name: name.into(),
                incarnation: incarnation.into(),
                shard: ShardId(shard),
            },
        )
}

fn batches() -> impl Strategy<Value = (u64, Vec<ShipBatch>)> {
    let batch = (
        any::<u64>(),
        any::<bool>(),
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..5),
    );
    (0..u64::MAX / 2, proptest::collection::vec(batch, 0..5)).prop_map(|(base, raw)| {
        let mut next = base;
        let batches = raw
            .into_iter()
            .map(|(ts, start, records)| {
                let b = ShipBatch {
                    producer: (!start && ts % 2 == 0).then_some((ts, ts / 3)),
                    base_offset: Offset(next),
                    timestamp_micros: ts,
                    kind: if start {
                        BatchKind::GenerationStart
                    } else {
                        BatchKind::Data
                    },
                    records: records.into_iter().map(Bytes::from).collect(),
                };
                next += b.records.len() as u64;
                b
            })
            .collect();
        (base, batches)
    })
}

fn records_strategy() -> impl Strategy<Value = InternalMessage> {
    (
        any::<u64>(),
        shard_ref(),
        any::<u64>(),
        ident(),
        any::<Option<u64>>(),
        any::<u64>(),
        batches(),
    )
        .prop_map(
            |(cid, shard, generation, leader, prev_gen, commit, (base, batches))| {
                // From the base (0/0), or after a record (any generation but 0/0 at base 1).
                let (prev_offset, prev_generation) = match prev_gen {
                    Some(g) if base > 0 && !batches.is_empty() => (base - 1, g),
                    _ => (0, 0),
                };
                Records {
                    correlation_id: cid,
                    shard,
                    generation: Generation(generation),
                    leader,
                    prev_offset: Offset(prev_offset),
                    prev_generation: Generation(prev_generation),
                    commit: Offset(commit),
                    batches,
                }
                .into()
            },
        )
}

fn message() -> impl Strategy<Value = InternalMessage> {
    let id = any::<u64>;
    prop_oneof![
        (id(), ident(), ".{0,300}", id()).prop_map(|(c, n, t, caps)| Hello {
            correlation_id: c,
            node_id: n,
            token: t,
            capabilities: caps
        }
        .into()),
        (id(), ident(), id()).prop_map(|(c, n, caps)| HelloOk {
            correlation_id: c,
            node_id: n,
            capabilities: caps
        }
        .into()),
        (id(), ".{0,100}").prop_map(|(c, reason)| HelloRefused {
            correlation_id: c,
            reason
        }
        .into()),
        (id(), shard_ref(), id(), ident()).prop_map(|(c, shard, g, leader)| Fence {
            correlation_id: c,
            shard,
            generation: Generation(g),
            leader
        }
        .into()),
        (id(), id(), id(), id(), id(), id()).prop_map(|(c, g, base, end, commit, last)| {
            FenceOk {
                correlation_id: c,
                generation: Generation(g),
                log_base: Offset(base),
                log_end: Offset(end),
                commit: Offset(commit),
                last_generation: Generation(last),
            }
            .into()
        }),
        (id(), shard_ref(), id(), ident(), id(), any::<u32>()).prop_map(
            |(c, shard, g, leader, from, max)| Fetch {
                correlation_id: c,
                shard,
                generation: Generation(g),
                leader,
                from_offset: Offset(from),
                max_bytes: max,
            }
            .into()
        ),
        records_strategy(),
        (id(), id(), id()).prop_map(|(c, g, end)| ReplicateOk {
            correlation_id: c,
            generation: Generation(g),
            durable_end: Offset(end)
        }
        .into()),
        (id(), id(), any::<u16>(), id(), ".{0,100}").prop_map(|(c, g, code, at, detail)| {
            ReplicateRefused {
                correlation_id: c,
                generation: Generation(g),
                code: RefusalCode::from_number(code),
                expected_offset: Offset(at),
                detail,
            }
            .into()
        }),
        (id(), shard_ref(), id(), ident(), id()).prop_map(|(c, shard, g, leader, base)| {
            Bootstrap {
                correlation_id: c,
                shard,
                generation: Generation(g),
                leader,
                base_offset: Offset(base),
            }
            .into()
        }),
        id().prop_map(|c| Ping { correlation_id: c }.into()),
        id().prop_map(|c| Pong { correlation_id: c }.into()),
        (id(), any::<u16>()).prop_map(|(c, kind)| UnsupportedKind {
            correlation_id: c,
            kind
        }
        .into()),
        (id(), any::<u16>())
            .prop_filter("unknown kinds only", |(_, k)| !kind::is_known(*k))
            .prop_map(|(c, kind)| InternalMessage::Unknown {
                kind,
                correlation_id: c
            }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_message_round_trips(m in message(), split in any::<prop::sample::Index>()) {
        let bytes = encode(&m);
        let back = decode_one(&bytes).unwrap();
        prop_assert_eq!(&back, &m);
        prop_assert_eq!(encode(&back), bytes.clone(), "canonical");
        // And through the reader, in two pieces.
        let at = split.index(bytes.len() + 1);
        let mut reader = InternalReader::default();
        reader.push(Bytes::copy_from_slice(&bytes[..at]));
        let first = reader.next().unwrap();
        reader.push(Bytes::copy_from_slice(&bytes[at..]));
        let got = match first {
            Some(got) => got,
            None => reader.next().unwrap().expect("whole frame"),
        };
        prop_assert_eq!(got, m);
        prop_assert_eq!(reader.buffered(), 0);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_internal_decoder(
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
        kind in any::<u16>(),
    ) {
        felix_wire::fuzzing::internal(&bytes);
        felix_wire::fuzzing::internal(&raw_frame(kind, &bytes));
    }

    #[test]
    fn a_corrupted_byte_is_refused_or_reads_as_exactly_those_bytes(
        m in message(), at in any::<prop::sample::Index>(), byte in any::<u8>(),
    ) {
        let mut bytes = encode(&m);
        let i = at.index(bytes.len());
        bytes[i] = byte;
        // Past the checksum, re-seal it so the section's parser sees the corruption.
        if let InternalMessage::Records(r) = &m {
            let c = crc_at(r);
            if i >= c + 4 {
                let crc = crc32c::crc32c(&bytes[c + 4..]);
                bytes[c..c + 4].copy_from_slice(&crc.to_be_bytes());
            }
        }
        felix_wire::fuzzing::internal(&bytes);
    }
}

/// Where a `Records` frame's CRC field starts: it follows `commit`.
fn crc_at(r: &Records) -> usize {
    HEADER_LEN
        + 8
        + 1
        + 4
        + r.shard.tenant.len()
        + 4
        + r.shard.namespace.len()
        + 4
        + r.shard.name.len()
        + 4
        + 8
        + 4
        + r.leader.len()
        + 24
}

#[test]
fn fuzz_entry_point_accepts_every_sample_stream() {
    let stream: Vec<u8> = samples().iter().flat_map(encode).collect();
    felix_wire::fuzzing::internal(&stream);
    let mut buf = BytesMut::new();
    buf.put_slice(&stream);
    buf.put_slice(&raw_frame(999, &[0; 9]));
    buf.put_slice(&raw_frame(kind::RECORDS, &[0; 3]));
    felix_wire::fuzzing::internal(&buf);
}
