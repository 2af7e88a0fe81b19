//! How long encoding the answers that carry payloads takes: in place (what
//! `Message::encode_frame` does for them) against serde_json, in the same run.
//! `cargo run --release -p felix-wire --example encode_speed`

use std::hint::black_box;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use felix_wire::message::GroupRecord;
use felix_wire::{Message, Offset, RequestId};

fn main() {
    let poll = Message::GroupRecords {
        records: (0..16)
            .map(|i| GroupRecord {
                offset: Offset(1000 + i),
                payload: Bytes::from(vec![7u8; 1024]),
                attempts: 1,
                skipped_before: 0,
                publisher: None,
                timestamp_micros: None,
            })
            .collect(),
        request_id: RequestId(77),
    };
    let get = Message::CacheValue {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        cache: "bench".into(),
        key: "key-123".into(),
        value: Some(Bytes::from(vec![7u8; 1024])),
        request_id: Some(RequestId(9)),
        version: Some(12),
    };
    for (name, m) in [
        ("group_records, 16 x 1 KiB", &poll),
        ("cache_value, 1 KiB", &get),
    ] {
        let mut ratios = Vec::new();
        for _ in 0..5 {
            let n = 20_000;
            let t = Instant::now();
            for _ in 0..n {
                let mut b = BytesMut::with_capacity(128);
                m.encode_frame(&mut b).unwrap();
                black_box(b);
            }
            let direct = t.elapsed().as_nanos() as f64 / n as f64;
            let t = Instant::now();
            for _ in 0..n {
                black_box(serde_json::to_vec(m).unwrap());
            }
            let serde = t.elapsed().as_nanos() as f64 / n as f64;
            println!("{name}: in place {direct:.0} ns, serde_json {serde:.0} ns");
            ratios.push(serde / direct);
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "{name}: serde_json / in place, median of 5: {:.2}x",
            ratios[2]
        );
    }
}
