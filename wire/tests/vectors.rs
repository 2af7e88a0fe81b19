//! Golden frames: every vector encodes to its `frame_hex` byte for byte and decodes back
//! to its fields.
//!
//! The vectors are read from `../shared/reference/wire-vectors/` beside the checkout when
//! it is there (and must then match the copy vendored in `tests/vectors/`, which keeps
//! the test runnable from any clone).

use std::path::{Path, PathBuf};

use bytes::{Bytes, BytesMut};
use felix_wire::frame::{Decoded, decode_frame};
use felix_wire::{
    AckMode, AckPrefix, Flags, Message, PublishAck, PublishAckStatus, PublishBatch,
    PublishBatchHeader, RequestId,
};
use serde_json::Value;

fn vendored_dir() -> PathBuf {
    manifest_dir().join("tests/vectors")
}

fn shared_dir() -> Option<PathBuf> {
    let dir = manifest_dir().join("../../shared/reference/wire-vectors");
    dir.is_dir().then_some(dir)
}

fn load(dir: &Path) -> Vec<(String, Value, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let desc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let hex_line = std::fs::read_to_string(path.with_extension("hex")).unwrap();
        let frame = hex::decode(hex_line.trim()).unwrap();
        assert_eq!(
            hex::decode(desc["frame_hex"].as_str().unwrap()).unwrap(),
            frame,
            "{}: .hex and frame_hex agree",
            path.display()
        );
        out.push((desc["name"].as_str().unwrap().to_owned(), desc, frame));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn frame_of(bytes: &[u8]) -> felix_wire::Frame {
    match decode_frame(&Bytes::copy_from_slice(bytes), u32::MAX).unwrap() {
        Decoded::Complete { value, consumed } => {
            assert_eq!(consumed, bytes.len());
            value
        }
        Decoded::NeedMore(n) => panic!("vector is short by {n}"),
    }
}

fn check_json(name: &str, desc: &Value, golden: &[u8]) {
    let payload = desc["payload_json"].as_str().unwrap();
    let message = Message::decode(payload.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(
        !matches!(message, Message::Unknown),
        "{name}: type is known"
    );
    let mut buf = BytesMut::new();
    message.encode_frame(&mut buf).unwrap();
    assert_eq!(
        hex::encode(&buf),
        hex::encode(golden),
        "{name}: re-encoding"
    );
    let frame = frame_of(golden);
    assert_eq!(frame.flags, Flags::JSON);
    assert_eq!(
        Message::decode(&frame.payload).unwrap(),
        message,
        "{name}: decoding"
    );
}

fn check_acked_publish(name: &str, desc: &Value, golden: &[u8]) {
    let ack_mode: AckMode = serde_json::from_value(desc["ack_mode"].clone()).unwrap();
    let payloads: Vec<&str> = desc["payloads_utf8"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    let header = PublishBatchHeader {
        tenant: desc["tenant_id"].as_str().unwrap(),
        namespace: desc["namespace"].as_str().unwrap(),
        stream: desc["stream"].as_str().unwrap(),
        ack: Some(AckPrefix {
            request_id: RequestId(desc["request_id"].as_u64().unwrap()),
            ack_mode,
        }),
        idempotent: None,
        key: desc["key_utf8"].as_str().map(str::as_bytes),
    };
    assert_eq!(
        header.flags().bits() as u64,
        desc["flags"].as_u64().unwrap()
    );
    let mut buf = BytesMut::new();
    header.encode_frame(&mut buf, &payloads).unwrap();
    assert_eq!(
        hex::encode(&buf),
        hex::encode(golden),
        "{name}: re-encoding"
    );

    let frame = frame_of(golden);
    let batch = PublishBatch::decode(frame.flags, &frame.payload).unwrap();
    assert_eq!(batch.tenant.as_str(), header.tenant);
    assert_eq!(batch.namespace.as_str(), header.namespace);
    assert_eq!(batch.stream.as_str(), header.stream);
    assert_eq!(batch.ack, header.ack);
    let decoded: Vec<&[u8]> = batch.payloads.iter().map(|p| &p[..]).collect();
    let expected: Vec<&[u8]> = payloads.iter().map(|p| p.as_bytes()).collect();
    assert_eq!(decoded, expected);
    assert_eq!(
        hex::encode(&frame.payload),
        desc["payload_hex"].as_str().unwrap()
    );
}

fn check_publish_ack(name: &str, desc: &Value, golden: &[u8]) {
    let request_id = RequestId(desc["request_id"].as_u64().unwrap());
    let ack = match desc["status"].as_str().unwrap() {
        "ok" => PublishAck::ok(request_id, None),
        "error" => PublishAck {
            status: PublishAckStatus::Error,
            request_id,
            message: desc["message"].as_str().unwrap().to_owned(),
            code: None,
            owner: None,
            first_offset: None,
        },
        other => panic!("{name}: status {other}"),
    };
    let peer = Flags(desc["flags"].as_u64().unwrap() as u16);
    let mut buf = BytesMut::new();
    ack.encode_frame(&mut buf, peer).unwrap();
    assert_eq!(
        hex::encode(&buf),
        hex::encode(golden),
        "{name}: re-encoding"
    );
    let frame = frame_of(golden);
    assert_eq!(
        PublishAck::decode(frame.flags, &frame.payload).unwrap(),
        ack
    );
}

#[test]
fn every_golden_vector_round_trips_byte_for_byte() {
    let vectors = load(&vendored_dir());
    assert!(
        vectors.len() >= 13,
        "at least 13 vectors, found {}",
        vectors.len()
    );
    for (name, desc, golden) in &vectors {
        match desc.get("kind").and_then(Value::as_str) {
            None | Some("json_message") => check_json(name, desc, golden),
            Some("binary_acked_publish_batch") | Some("binary_publish_batch") => {
                check_acked_publish(name, desc, golden)
            }
            Some("binary_publish_ack") => check_publish_ack(name, desc, golden),
            Some(other) => panic!("{name}: unknown vector kind {other}"),
        }
    }
}

#[test]
fn vendored_vectors_match_the_shared_reference() {
    let Some(shared) = shared_dir() else {
        eprintln!("../shared/reference/wire-vectors not present; vendored copy used alone");
        return;
    };
    let ours = load(&vendored_dir());
    let theirs = load(&shared);
    assert_eq!(
        ours.iter().map(|v| (&v.0, &v.2)).collect::<Vec<_>>(),
        theirs.iter().map(|v| (&v.0, &v.2)).collect::<Vec<_>>(),
        "tests/vectors is a faithful copy of the shared vectors"
    );
}

/// This package's directory: cargo's value at run time (a build reused from another
/// checkout must not read that checkout's files), the compile-time one otherwise.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    )
}
