//! Fuzzing entry point shared by the `cargo fuzz` target in `storage-uring/fuzz` and the
//! seeded twin in the test suite: arbitrary damage to a log directory must never panic
//! recovery and never make it serve a record that was not written at that offset.

use crate::format::{BatchKind, SegmentHeader, encode_batch};
use crate::io::memory::MemBackend;
use crate::log::{LogConfig, SegmentLog, VerifyOnOpen};

/// The record written at `offset` in fuzzed logs.
pub fn record(offset: u64) -> Vec<u8> {
    let mut v = offset.to_be_bytes().to_vec();
    v.resize(8 + (offset % 23) as usize, offset as u8);
    v
}

/// `data[0]` picks the shape: odd = the rest of `data` is a whole segment file as is;
/// even = a valid two-segment log of `data[1]` batches, then damaged by the rest of
/// `data` read as (u16 position, u8 value) triples, plus an optional cut.
pub fn recovery(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mem = MemBackend::new();
    if mode % 2 == 1 {
        mem.put_file("00000000000000000000.seg", rest);
    } else {
        let batches = u64::from(rest.first().copied().unwrap_or(0) % 40);
        let mut seg = SegmentHeader {
            base_offset: 0,
            created_at_micros: 0,
        }
        .encode();
        let mut offset = 0;
        let split = batches / 2;
        for b in 0..split {
            let n = 1 + b % 3;
            let recs: Vec<Vec<u8>> = (offset..offset + n).map(record).collect();
            encode_batch(&mut seg, offset, b, BatchKind::Data, None, &recs);
            offset += n;
        }
        mem.put_file("00000000000000000000.seg", &seg);
        let mut second = SegmentHeader {
            base_offset: offset,
            created_at_micros: 0,
        }
        .encode();
        for b in split..batches {
            let recs = [record(offset)];
            encode_batch(&mut second, offset, b, BatchKind::Data, None, &recs);
            offset += 1;
        }
        let second_name = format!(
            "{offset_base:020}.seg",
            offset_base = { u64::from_be_bytes(second[8..16].try_into().expect("8 bytes")) }
        );
        mem.put_file(&second_name, &second);
        let damage = rest.get(1..).unwrap_or(&[]);
        for t in damage.chunks_exact(3) {
            let pos = usize::from(u16::from_be_bytes([t[0], t[1]]));
            let name = if pos % 2 == 0 {
                "00000000000000000000.seg"
            } else {
                second_name.as_str()
            };
            mem.corrupt(name, pos % 12_000, &[t[2]]);
        }
        if damage.len() % 3 == 1 {
            let len = mem.contents(&second_name).map_or(0, |c| c.len());
            mem.set_len(&second_name, len.saturating_sub(usize::from(damage[0]) * 7));
        }
    }
    for verify_on_open in [VerifyOnOpen::All, VerifyOnOpen::Tail] {
        let config = LogConfig {
            read_only: true,
            verify_on_open,
            ..LogConfig::default()
        };
        // Read-only opens spawn nothing, and the memory backend never waits, so this
        // runs without an executor.
        let opened = futures_lite::future::block_on(SegmentLog::open(mem.clone(), config));
        let Ok((log, _report)) = opened else {
            continue;
        };
        let mut at = log.base_offset();
        loop {
            let Ok(batches) = futures_lite::future::block_on(log.read(at, 1 << 16)) else {
                break;
            };
            if batches.is_empty() {
                break;
            }
            for b in batches {
                assert_eq!(b.base_offset, at, "reads are contiguous");
                for (i, r) in b.records.iter().enumerate() {
                    let o = b.base_offset + i as u64;
                    if mode % 2 == 0 {
                        assert_eq!(r[..], record(o)[..], "record {o} was never written");
                    }
                }
                at = b.end_offset();
            }
        }
    }
}
