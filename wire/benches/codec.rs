//! Codec micro-benchmark: encode and decode a 64 x 1 KiB publish batch and event batch.
//!
//! Prints ns/record and GB/s (payload bytes) as the median of several timed rounds, so a
//! noisy neighbour on a shared machine moves one round, not the answer.
//! Run: `cargo bench -p felix-wire --bench codec`.

use std::hint::black_box;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use felix_wire::frame::{Decoded, decode_frame};
use felix_wire::{
    AckMode, AckPrefix, EventBatch, EventItem, Offset, PublishBatch, PublishBatchHeader, RequestId,
};

const RECORDS: usize = 64;
const RECORD_BYTES: usize = 1024;
const ITERS: usize = 20_000;
const ROUNDS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn report(name: &str, mut round: impl FnMut()) {
    for _ in 0..ITERS / 10 {
        round();
    }
    let mut ns_per_record = Vec::new();
    for _ in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..ITERS {
            round();
        }
        let ns = start.elapsed().as_nanos() as f64;
        ns_per_record.push(ns / (ITERS * RECORDS) as f64);
    }
    let ns = median(ns_per_record);
    let gbps = RECORD_BYTES as f64 / ns;
    println!("{name:<28} {ns:>8.2} ns/record {gbps:>7.2} GB/s");
}

fn main() {
    let payloads: Vec<Bytes> = (0..RECORDS)
        .map(|i| Bytes::from(vec![i as u8; RECORD_BYTES]))
        .collect();
    let header = PublishBatchHeader {
        tenant: "acme",
        namespace: "default",
        stream: "orders",
        ack: Some(AckPrefix {
            request_id: RequestId(1),
            ack_mode: AckMode::PerBatch,
        }),
        idempotent: None,
        key: None,
    };
    let mut buf = BytesMut::with_capacity(128 * 1024);
    report("publish batch encode", || {
        buf.clear();
        header.encode_frame(&mut buf, black_box(&payloads)).unwrap();
        black_box(&buf);
    });

    let mut framed = BytesMut::new();
    header.encode_frame(&mut framed, &payloads).unwrap();
    let framed = framed.freeze();
    report("publish batch decode", || {
        let Decoded::Complete { value, .. } = decode_frame(black_box(&framed), u32::MAX).unwrap()
        else {
            unreachable!()
        };
        let batch = PublishBatch::decode(value.flags, &value.payload).unwrap();
        black_box(batch);
    });

    let events = EventBatch {
        subscription_id: None,
        base_offset: Some(Offset(1000)),
        skipped_before: None,
        publisher: None,
        timestamps: true,
        events: payloads
            .iter()
            .map(|p| EventItem {
                timestamp_micros: Some(1_700_000_000_000_000),
                payload: p.clone(),
            })
            .collect(),
    };
    report("event batch encode", || {
        buf.clear();
        black_box(&events).encode_frame(&mut buf).unwrap();
        black_box(&buf);
    });

    let mut framed = BytesMut::new();
    events.encode_frame(&mut framed).unwrap();
    let framed = framed.freeze();
    report("event batch decode", || {
        let Decoded::Complete { value, .. } = decode_frame(black_box(&framed), u32::MAX).unwrap()
        else {
            unreachable!()
        };
        black_box(EventBatch::decode(value.flags, &value.payload).unwrap());
    });
}
