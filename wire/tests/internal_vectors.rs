//! Golden frames of the broker-to-broker protocol (`tests/internal-vectors/`): each
//! message below encodes to its `NAME.hex` byte for byte, the file decodes back to it,
//! and `NAME.json` describes the same fields and bytes. The files were written once by
//! the encoder; a change to the format must change them, in a reviewed diff.

use std::path::PathBuf;

use bytes::{Bytes, BytesMut};
use felix_wire::frame::Decoded;
use felix_wire::internal::{
    BatchKind, Fence, HEADER_LEN, Hello, InternalMessage, Records, RefusalCode, ReplicateRefused,
    ShardRef, ShipBatch, capabilities, decode_frame, kind,
};
use felix_wire::message::ShardKind;
use felix_wire::{Generation, Offset, ShardId, WireStr};
use serde_json::{Value, json};

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

fn vectors() -> Vec<(&'static str, InternalMessage)> {
    vec![
        (
            "hello",
            Hello {
                correlation_id: 1,
                node_id: "broker-1".into(),
                token: "t0k3n".into(),
                capabilities: capabilities::FENCE | capabilities::FETCH,
            }
            .into(),
        ),
        (
            "fence",
            Fence {
                correlation_id: 2,
                shard: shard(),
                generation: Generation(7),
                leader: "broker-1".into(),
            }
            .into(),
        ),
        (
            "fence_with_incarnation",
            Fence {
                correlation_id: 5,
                shard: ShardRef {
                    kind: ShardKind::Cache,
                    incarnation: WireStr::from("9c41d2e07b3a5f68"),
                    ..shard()
                },
                generation: Generation(1),
                leader: "broker-2".into(),
            }
            .into(),
        ),
        (
            "records_two_batches",
            Records {
                correlation_id: 3,
                shard: shard(),
                generation: Generation(7),
                leader: "broker-1".into(),
                prev_offset: Offset(41),
                prev_generation: Generation(6),
                commit: Offset(40),
                batches: vec![
                    ShipBatch {
                        producer: None,
                        base_offset: Offset(42),
                        timestamp_micros: 1_700_000_000_000_000,
                        kind: BatchKind::GenerationStart,
                        records: vec![Bytes::copy_from_slice(&7u64.to_be_bytes())],
                    },
                    ShipBatch {
                        producer: None,
                        base_offset: Offset(43),
                        timestamp_micros: 1_700_000_000_000_250,
                        kind: BatchKind::Data,
                        records: vec![Bytes::from_static(b"hello"), Bytes::from_static(b"world")],
                    },
                ],
            }
            .into(),
        ),
        (
            "replicate_refused",
            ReplicateRefused {
                correlation_id: 4,
                generation: Generation(7),
                code: RefusalCode::Gap,
                expected_offset: Offset(40),
                detail: "batch starts past the tail".into(),
            }
            .into(),
        ),
    ]
}

/// The fields a vector's JSON lists, as another implementation would read them.
fn describe(message: &InternalMessage) -> Value {
    let shard = |s: &ShardRef| {
        let mut v = json!({
            "kind": match s.kind { ShardKind::Stream => "stream", ShardKind::Cache => "cache" },
            "tenant": s.tenant.as_str(),
            "namespace": s.namespace.as_str(),
            "name": s.name.as_str(),
            "shard": s.shard.0,
        });
        if !s.incarnation.is_empty() {
            v["incarnation"] = json!(s.incarnation.as_str());
        }
        v
    };
    match message {
        InternalMessage::Hello(m) => json!({
            "correlation_id": m.correlation_id,
            "node_id": m.node_id,
            "token": m.token,
            "capabilities": m.capabilities,
        }),
        InternalMessage::Fence(m) => json!({
            "correlation_id": m.correlation_id,
            "shard": shard(&m.shard),
            "generation": m.generation.0,
            "leader": m.leader,
        }),
        InternalMessage::Records(m) => json!({
            "correlation_id": m.correlation_id,
            "shard": shard(&m.shard),
            "generation": m.generation.0,
            "leader": m.leader,
            "prev_offset": m.prev_offset.0,
            "prev_generation": m.prev_generation.0,
            "commit": m.commit.0,
            "batches": m.batches.iter().map(|b| json!({
                "base_offset": b.base_offset.0,
                "timestamp_micros": b.timestamp_micros,
                "kind": match b.kind {
                    BatchKind::Data => "data",
                    BatchKind::GenerationStart => "generation_start",
                    BatchKind::Commit => "commit",
                    BatchKind::Group => "group",
                    BatchKind::State => "state",
                },
                "records_hex": b.records.iter().map(hex::encode).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
        InternalMessage::ReplicateRefused(m) => json!({
            "correlation_id": m.correlation_id,
            "generation": m.generation.0,
            "code": m.code.number(),
            "expected_offset": m.expected_offset.0,
            "detail": m.detail,
        }),
        other => panic!("no description for {other:?}"),
    }
}

fn dir() -> PathBuf {
    // Cargo's value at run time (a build reused from another checkout must not read that
    // checkout's files), the compile-time one otherwise.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), PathBuf::from)
        .join("tests/internal-vectors")
}

#[test]
fn every_vector_encodes_byte_for_byte_and_decodes_to_its_fields() {
    for (name, message) in vectors() {
        let hex_path = dir().join(format!("{name}.hex"));
        let mut buf = BytesMut::new();
        message.encode(&mut buf).unwrap();
        let ours = hex::encode(&buf);
        let golden = std::fs::read_to_string(&hex_path)
            .unwrap_or_else(|e| panic!("{}: {e}; the encoder writes {ours}", hex_path.display()));
        let golden = golden.trim();
        assert_eq!(
            ours, golden,
            "{name}: the encoding drifted from the golden vector"
        );

        let bytes = Bytes::from(hex::decode(golden).unwrap());
        let Decoded::Complete { value, consumed } = decode_frame(&bytes, u32::MAX).unwrap() else {
            panic!("{name}: vector is short")
        };
        assert_eq!(consumed, bytes.len());
        assert_eq!(value, message, "{name}: decoding");

        let desc: Value = serde_json::from_str(
            &std::fs::read_to_string(dir().join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(desc["name"], name);
        assert_eq!(desc["kind"], message.kind());
        assert_eq!(
            desc["kind_name"],
            kind::name(message.kind()).unwrap(),
            "{name}"
        );
        assert_eq!(desc["fields"], describe(&message), "{name}: fields");
        assert_eq!(desc["frame_hex"], golden, "{name}: frame_hex");
        assert_eq!(
            desc["payload_hex"],
            golden[HEADER_LEN * 2..],
            "{name}: payload_hex"
        );
    }
}

#[test]
fn the_vector_directory_holds_exactly_these_vectors() {
    let mut expected: Vec<String> = vectors()
        .iter()
        .flat_map(|(name, _)| [format!("{name}.hex"), format!("{name}.json")])
        .chain(["README.md".to_owned()])
        .collect();
    expected.sort();
    let mut found: Vec<String> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    found.sort();
    assert_eq!(found, expected);
}
