//! How long decoding the requests a broker serves most, and the answers clients read
//! most, takes: `Message::decode` (the fast path for them, `hot.rs`) against
//! serde_json's decoding of the tagged enum, in the same run.
//! `cargo run --release -p felix-wire --example decode_speed`

use std::hint::black_box;
use std::time::Instant;

use bytes::Bytes;
use felix_wire::message::GroupRecord;
use felix_wire::{Message, Offset, RequestId, ShardId};

fn main() {
    let ack = Message::GroupAck {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        stream: "q1764979200".into(),
        shard: ShardId(0),
        group: "workers".into(),
        offset: Offset(123_456),
        request_id: RequestId(1_000_000_123),
    };
    let put = Message::CachePut {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        cache: "bench".into(),
        key: "key-000123".into(),
        value: Bytes::from(vec![7u8; 1024]),
        request_id: Some(RequestId(9)),
        ttl_ms: None,
    };
    let get = Message::CacheGet {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        cache: "bench".into(),
        key: "key-000123".into(),
        request_id: Some(RequestId(10)),
    };
    let records = Message::GroupRecords {
        records: (0..64)
            .map(|i| GroupRecord {
                offset: Offset(1_000 + i),
                payload: Bytes::from(vec![i as u8; 1024]),
                attempts: 1,
                skipped_before: 0,
                publisher: None,
                timestamp_micros: None,
            })
            .collect(),
        request_id: RequestId(11),
    };
    let value = Message::CacheValue {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        cache: "bench".into(),
        key: "key-000123".into(),
        value: Some(Bytes::from(vec![7u8; 1024])),
        request_id: Some(RequestId(12)),
        version: Some(77),
    };
    let ok = Message::CacheOk {
        request_id: RequestId(13),
    };
    for (name, m, n, request) in [
        ("group_ack", &ack, 100_000, true),
        ("cache_put, 1 KiB", &put, 100_000, true),
        ("cache_get", &get, 100_000, true),
        (
            "group_records, 64 x 1 KiB (an answer)",
            &records,
            2_000,
            false,
        ),
        ("cache_value, 1 KiB (an answer)", &value, 100_000, false),
        ("cache_ok (an answer)", &ok, 100_000, false),
    ] {
        let payload = m.to_payload();
        assert_eq!(&Message::decode(&payload).unwrap(), m);
        let mut ratios = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..n {
                black_box(Message::decode(black_box(&payload)).unwrap());
            }
            let fast = t.elapsed().as_nanos() as f64 / n as f64;
            let t = Instant::now();
            for _ in 0..n {
                black_box(serde_json::from_slice::<Message>(black_box(&payload)).unwrap());
            }
            let serde = t.elapsed().as_nanos() as f64 / n as f64;
            if request {
                let t = Instant::now();
                for _ in 0..n {
                    black_box(Message::decode_request(black_box(&payload)).unwrap());
                }
                let request = t.elapsed().as_nanos() as f64 / n as f64;
                println!(
                    "{name}: decode {fast:.0} ns, serde_json's tagged enum {serde:.0} ns, \
                     decode_request (values counted first) {request:.0} ns"
                );
            } else {
                println!("{name}: decode {fast:.0} ns, serde_json's tagged enum {serde:.0} ns");
            }
            ratios.push(serde / fast);
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "{name}: serde_json / decode, median of 5: {:.2}x",
            ratios[2]
        );
    }
}
