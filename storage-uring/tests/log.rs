//! The log's behaviour, run on both backends: the io_uring O_DIRECT one on a real file
//! system and the in-memory one. Fault injection that only memory can do lives in
//! `faults.rs`.

mod common;

use std::time::Duration;

use common::{Disk, Fixture, Mem, payload, run};
use felix_storage_uring::{
    BatchKind, CorruptionKind, FaultTimes, FsyncMode, LogConfig, MemBackend, MemOp, ProducerTag,
    SegmentLog, StorageError, VerifyOnOpen,
};

fn small_segments() -> LogConfig {
    LogConfig {
        segment_bytes_max: 64 * 1024,
        index_interval_bytes: 1024,
        ..LogConfig::default()
    }
}

/// Appends `n` one-record batches of `len` bytes, committing each.
async fn fill<B: felix_storage_uring::io::Backend>(log: &SegmentLog<B>, n: u64, len: usize) {
    for _ in 0..n {
        let offset = log.next_offset();
        let p = log
            .begin_append(&[payload(offset, len)], offset, None)
            .unwrap();
        log.commit(p).await.unwrap();
    }
}

async fn read_all<B: felix_storage_uring::io::Backend>(log: &SegmentLog<B>) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = log.base_offset();
    loop {
        let batches = log.read(at, 1 << 20).await.unwrap();
        if batches.is_empty() {
            return out;
        }
        for b in batches {
            for (i, r) in b.records.iter().enumerate() {
                out.push((b.base_offset + i as u64, r.to_vec()));
            }
            at = b.end_offset();
        }
    }
}

fn check_contents(records: &[(u64, Vec<u8>)], from: u64, to: u64, len: usize) {
    assert_eq!(records.len() as u64, to - from, "record count");
    for (i, (offset, data)) in records.iter().enumerate() {
        assert_eq!(*offset, from + i as u64);
        assert_eq!(data, &payload(*offset, len), "payload of offset {offset}");
    }
}

async fn appends_read_back_across_segments_and_reopen<F: Fixture>(fx: F) {
    let (log, report) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert_eq!(report.next_offset, 0);
    fill(&log, 300, 1000).await;
    assert!(log.segment_count() > 3, "rolled: {}", log.segment_count());
    check_contents(&read_all(&log).await, 0, 300, 1000);
    // Reads from the middle start exactly there.
    let mid = log.read(137, 1).await.unwrap();
    assert_eq!(mid[0].base_offset, 137);
    assert_eq!(mid[0].records[0].to_vec(), payload(137, 1000));
    log.close().await.unwrap();
    assert!(matches!(
        log.begin_append(&[b"x"], 0, None),
        Err(StorageError::Closed)
    ));

    let (log, report) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert_eq!(report.next_offset, 300);
    assert_eq!(report.truncated_bytes, 0);
    check_contents(&read_all(&log).await, 0, 300, 1000);
    fill(&log, 10, 1000).await;
    check_contents(&read_all(&log).await, 0, 310, 1000);
    log.close().await.unwrap();
}

async fn a_sealed_log_reopens_from_its_index_without_scanning<F: Fixture>(fx: F) {
    let config = LogConfig {
        index_interval_bytes: 1024,
        verify_on_open: VerifyOnOpen::Tail,
        ..LogConfig::default()
    };
    let (log, _) = SegmentLog::open(fx.backend().await, config.clone())
        .await
        .unwrap();
    fill(&log, 200, 1000).await;
    log.close().await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, config.clone())
        .await
        .unwrap();
    // Unsealed: the newest segment is checksummed whole.
    assert!(report.verified_bytes >= 200 * 1000, "{report:?}");
    log.close().await.unwrap();
    // Below the size asked for: left as it is.
    log.seal_active(1 << 20).await.unwrap();
    log.seal_active(0).await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, config.clone())
        .await
        .unwrap();
    // Sealed: only the batches past its last index entry are.
    assert!(report.verified_bytes < 4 * 1024, "{report:?}");
    assert_eq!(report.next_offset, 200);
    assert_eq!(report.segments, 2);
    check_contents(&read_all(&log).await, 0, 200, 1000);
    fill(&log, 10, 1000).await;
    // An empty newest segment is not sealed again.
    log.close().await.unwrap();
    log.seal_active(0).await.unwrap();
    log.seal_active(0).await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, config).await.unwrap();
    assert_eq!(report.segments, 3);
    check_contents(&read_all(&log).await, 0, 210, 1000);
    log.close().await.unwrap();
}

/// A log reopened from its sealed segments' indexes knows which kinds of batch it holds
/// without reading them: a stream's log with no consumer-group batch says so (the broker
/// then reads nothing back looking for groups), one whose oldest segment holds one says
/// it may, and so does one whose indexes predate the kinds field.
async fn a_log_reopened_from_its_indexes_knows_which_kinds_it_holds<F: Fixture>(fx: F) {
    let config = LogConfig {
        verify_on_open: VerifyOnOpen::Tail,
        ..small_segments()
    };
    let (log, _) = SegmentLog::open(fx.backend().await, config.clone())
        .await
        .unwrap();
    fill(&log, 200, 1000).await;
    assert!(log.segment_count() >= 3);
    assert!(!log.may_hold(BatchKind::Group) && log.may_hold(BatchKind::Data));
    log.close().await.unwrap();
    log.seal_active(0).await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, config.clone())
        .await
        .unwrap();
    assert!(
        report.verified_bytes < 8 * 1024,
        "read from its indexes: {report:?}"
    );
    assert!(!log.may_hold(BatchKind::Group), "only data was written");
    assert!(!log.may_hold(BatchKind::State));
    assert!(log.may_hold(BatchKind::Data));
    // One group batch, then enough data that it ends up in a sealed segment far from
    // any index's last entry.
    let g = log.begin_group(&[b"event".as_slice()], 1).unwrap();
    log.commit(g).await.unwrap();
    fill(&log, 200, 1000).await;
    log.close().await.unwrap();
    log.seal_active(0).await.unwrap();
    let (log, _) = SegmentLog::open(fx.backend().await, config.clone())
        .await
        .unwrap();
    assert!(log.may_hold(BatchKind::Group));
    assert!(!log.may_hold(BatchKind::Commit));
    log.close().await.unwrap();
    // Indexes written before the field say nothing: every kind may be there.
    let indexes: Vec<String> = fx
        .names()
        .into_iter()
        .filter(|n| n.ends_with(".idx"))
        .collect();
    assert!(indexes.len() >= 3, "{indexes:?}");
    for name in indexes {
        fx.corrupt(&name, 6, &[0, 0]);
    }
    let (log, _) = SegmentLog::open(fx.backend().await, config.clone())
        .await
        .unwrap();
    assert!(
        log.may_hold(BatchKind::Commit),
        "an old index: unknown kinds"
    );
    check_contents(&read_all(&log).await[..200], 0, 200, 1000);
    log.close().await.unwrap();
    // An open that reads every segment in full writes the kinds into the old files.
    let all = LogConfig {
        verify_on_open: VerifyOnOpen::All,
        ..config.clone()
    };
    let (log, report) = SegmentLog::open(fx.backend().await, all).await.unwrap();
    assert_eq!(report.rebuilt_indexes, 0, "the entries were right");
    log.close().await.unwrap();
    let (log, _) = SegmentLog::open(fx.backend().await, config).await.unwrap();
    assert!(!log.may_hold(BatchKind::Commit), "upgraded in place");
    assert!(log.may_hold(BatchKind::Group));
    log.close().await.unwrap();
}

async fn batches_keep_kind_producer_and_timestamp<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let tag = ProducerTag {
        producer_id: 9,
        sequence: 4,
    };
    let p = log
        .begin_append(&[b"a".as_slice(), b"bb", b""], 1234, Some(tag))
        .unwrap();
    assert_eq!((p.first(), p.end()), (0, 3));
    log.commit(p).await.unwrap();
    let g = log.begin_generation_start(7, 5678).unwrap();
    log.commit(g).await.unwrap();
    let batches = log.read(0, 1 << 20).await.unwrap();
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[0].producer, Some(tag));
    assert_eq!(batches[0].timestamp_micros, 1234);
    assert_eq!(batches[0].records.len(), 3);
    assert_eq!(batches[1].kind, BatchKind::GenerationStart);
    assert_eq!(batches[1].base_offset, 3);
    assert_eq!(batches[1].records[0].as_ref(), 7u64.to_be_bytes());
    assert_eq!(
        batches[1].timestamp_micros, 5678,
        "the caller's clock, not the log's"
    );
    log.close().await.unwrap();
}

async fn concurrent_commits_resolve_in_offset_order<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let order = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        let log = log.clone();
        let order = order.clone();
        tasks.push(glommio::spawn_local(async move {
            let p = log.begin_append(&[payload(i, 100)], 0, None).unwrap();
            // Yield a varying number of times so commits are polled out of order.
            for _ in 0..(64 - i) % 7 {
                glommio::yield_if_needed().await;
                futures_lite::future::yield_now().await;
            }
            let a = log.commit(p).await.unwrap();
            order.borrow_mut().push(a.first);
        }));
    }
    for t in tasks {
        t.await;
    }
    let order = order.borrow().clone();
    assert_eq!(
        order,
        (0..64).collect::<Vec<_>>(),
        "commits complete in offset order"
    );
    let stats = log.stats();
    assert!(stats.syncs < 64, "group commit shares fsyncs: {stats:?}");
    log.close().await.unwrap();
}

async fn a_dropped_pending_append_does_not_stall_its_successors<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let first = log.begin_append(&[b"one"], 0, None).unwrap();
    let second = log.begin_append(&[b"two"], 0, None).unwrap();
    drop(first);
    let a = log.commit(second).await.unwrap();
    assert_eq!(a.first, 1);
    // The abandoned batch still owns offset 0 and is still written.
    let all = read_all(&log).await;
    assert_eq!(all[0], (0, b"one".to_vec()));
    log.close().await.unwrap();
}

async fn a_torn_tail_is_cut_to_the_last_whole_batch<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    fill(&log, 20, 300).await;
    log.close().await.unwrap();
    let seg = "00000000000000000000.seg";
    let data_end = 4096 + 20 * (56 + 4 + 300);
    // A batch that was being written: its header landed, its body did not.
    let mut torn = Vec::new();
    felix_storage_uring::format::encode_batch(
        &mut torn,
        20,
        0,
        BatchKind::Data,
        None,
        &[payload(20, 300)],
    );
    fx.corrupt(seg, data_end, &torn[..100]);
    let (log, report) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(report.next_offset, 20);
    assert!(report.truncated_bytes > 0, "{report:?}");
    check_contents(&read_all(&log).await, 0, 20, 300);
    // The log continues at the cut.
    fill(&log, 1, 300).await;
    check_contents(&read_all(&log).await, 0, 21, 300);
    log.close().await.unwrap();
}

async fn a_zeroed_or_garbled_header_at_the_tail_is_repaired<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    fill(&log, 5, 300).await;
    log.close().await.unwrap();
    let data_end = 4096 + 5 * (56 + 4 + 300);
    fx.corrupt(
        "00000000000000000000.seg",
        data_end,
        &[0xde, 0xad, 0xbe, 0xef, 1, 2, 3],
    );
    let (log, report) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(report.next_offset, 5);
    check_contents(&read_all(&log).await, 0, 5, 300);
    log.close().await.unwrap();
}

async fn interior_damage_refuses_to_open_naming_segment_and_offset<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    fill(&log, 200, 1000).await;
    log.close().await.unwrap();
    // One flipped bit in the body of an early batch of the newest segment...
    let names: Vec<String> = fx
        .names()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .collect();
    let newest = names.last().unwrap().clone();
    let pos = 4096 + 56 + 4 + 10;
    fx.corrupt(&newest, pos, &[0xff]);
    let err = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap_err();
    match err {
        StorageError::Corrupt(c) => {
            assert_eq!(c.segment, newest);
            assert_eq!(c.position, 4096);
            assert!(matches!(c.kind, CorruptionKind::Interior { .. }), "{c}");
            let base: u64 = newest[..20].parse().unwrap();
            assert_eq!(c.offset, Some(base));
        }
        other => panic!("expected corruption, got {other}"),
    }
    // ...and in a sealed segment.
    fx.corrupt(&newest, pos, &[0]);
    let first_pos = 4096 + 56 + 4 + 10;
    let orig = (0u64).to_be_bytes();
    let _ = orig;
    fx.corrupt(&names[0], first_pos, &[0xff]);
    let err = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StorageError::Corrupt(c) if c.segment == names[0]),
        "{err}"
    );
}

async fn deleted_truncated_or_stale_indexes_are_rebuilt<F: Fixture>(fx: F) {
    let cfg = LogConfig {
        verify_on_open: VerifyOnOpen::Tail,
        ..small_segments()
    };
    let (log, _) = SegmentLog::open(fx.backend().await, cfg.clone())
        .await
        .unwrap();
    fill(&log, 300, 1000).await;
    log.close().await.unwrap();
    let idx: Vec<String> = fx
        .names()
        .into_iter()
        .filter(|n| n.ends_with(".idx"))
        .collect();
    assert!(idx.len() >= 3, "{idx:?}");
    fx.remove(&idx[0]);
    fx.set_len(&idx[1], 30);
    // Stale: an index that points at the wrong place.
    let mut garbage = fx_read(&fx, &idx[2]);
    let n = garbage.len();
    garbage[n - 1] ^= 0x10;
    fx.write(&idx[2], &garbage);
    let (log, report) = SegmentLog::open(fx.backend().await, cfg.clone())
        .await
        .unwrap();
    assert_eq!(report.rebuilt_indexes, 3, "{report:?}");
    check_contents(&read_all(&log).await, 0, 300, 1000);
    for o in [0u64, 1, 57, 150, 299] {
        let b = log.read(o, 1).await.unwrap();
        assert_eq!(b[0].base_offset, o);
    }
    log.close().await.unwrap();
    let (_log, report) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
    assert_eq!(
        report.rebuilt_indexes, 0,
        "rebuilt indexes were written back"
    );
}

fn fx_read<F: Fixture>(fx: &F, name: &str) -> Vec<u8> {
    let _ = fx.len(name);
    // Both fixtures can hand back a file through their backend listing; read via std for
    // disk and via the memory backend otherwise.
    let any: &dyn std::any::Any = fx;
    if let Some(mem) = any.downcast_ref::<Mem>() {
        return mem.0.contents(name).unwrap();
    }
    let disk = any.downcast_ref::<Disk>().unwrap();
    std::fs::read(disk.0.join(name)).unwrap()
}

/// Reopens sealed segments from their indexes.
fn tail_config() -> LogConfig {
    LogConfig {
        index_interval_bytes: 1024,
        verify_on_open: VerifyOnOpen::Tail,
        ..LogConfig::default()
    }
}

/// Appends `n` records of `len` bytes to a log in `mem`, timestamped from `n` s down to
/// 1 s (a clock stepped back), and seals its segment.
async fn sealed_with_falling_timestamps(mem: &MemBackend, config: &LogConfig, n: u64, len: usize) {
    let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
    for i in 0..n {
        let p = log
            .begin_append(&[vec![1u8; len]], (n - i) * 1_000_000, None)
            .unwrap();
        log.commit(p).await.unwrap();
    }
    log.close().await.unwrap();
    log.seal_active(0).await.unwrap();
}

/// A sealed segment reopened from its index (`VerifyOnOpen::Tail`, a live re-pin's open)
/// is aged by its newest record, as one read in full is: from its last batches alone, a
/// segment whose timestamps fell (a clock stepped back, two leaders' batches) looked
/// older than it is, and age retention removed it early (until 2026-12-08).
#[test]
fn a_segment_reopened_from_its_index_is_aged_by_its_newest_record() {
    run(|| async {
        let (mem, config) = (MemBackend::new(), tail_config());
        sealed_with_falling_timestamps(&mem, &config, 200, 1000).await;
        // At 250 s its newest record is 50 s old; its last batches, 249 s.
        let (now, age) = (250_000_000, Some(Duration::from_secs(100)));
        for verify in [VerifyOnOpen::Tail, VerifyOnOpen::All] {
            let (log, report) = SegmentLog::open(
                mem.clone(),
                LogConfig {
                    verify_on_open: verify,
                    ..config.clone()
                },
            )
            .await
            .unwrap();
            assert_eq!(report.segments, 2);
            assert_eq!(
                log.retention_cut(now, None, age, u64::MAX).0,
                0,
                "{verify:?}: kept"
            );
            log.close().await.unwrap();
        }
    });
}

/// A `Tail` open that rebuilds the entries of an index from before the newest-timestamp
/// field writes it back without the field: it knows only the last batches' timestamps,
/// and saying them would age the segment by them at every later open.
#[test]
fn a_tail_open_writes_no_newest_timestamp_it_does_not_know() {
    run(|| async {
        let name = "00000000000000000000.idx";
        let (mem, config) = (MemBackend::new(), tail_config());
        sealed_with_falling_timestamps(&mem, &config, 2000, 100).await;
        let said = |bytes: &[u8]| u16::from_be_bytes([bytes[6], bytes[7]]) & 0x4000 != 0;
        let mut old = mem.contents(name).unwrap();
        assert!(said(&old));
        // As written before the field.
        old[6] &= !0x40;
        old[20..24].copy_from_slice(&[0; 4]);
        mem.put_file(name, &old);
        // A finer interval: entries past the last one are added, and the file rebuilt.
        let finer = LogConfig {
            index_interval_bytes: 256,
            ..config.clone()
        };
        let (log, report) = SegmentLog::open(mem.clone(), finer).await.unwrap();
        assert_eq!(report.rebuilt_indexes, 1, "{report:?}");
        log.close().await.unwrap();
        let rebuilt = mem.contents(name).unwrap();
        assert_ne!(rebuilt, old);
        assert!(!said(&rebuilt), "a newest timestamp it did not know");
        // Read in full, it is known, and said.
        let whole = LogConfig {
            verify_on_open: VerifyOnOpen::All,
            ..config
        };
        let (log, _) = SegmentLog::open(mem.clone(), whole).await.unwrap();
        log.close().await.unwrap();
        assert!(said(&mem.contents(name).unwrap()));
    });
}

/// A segment sealed before it filled gives back the rest of its reservation
/// (`preallocate`) whether or not the log writes zeros ahead: without zeros ahead its
/// file was no longer than its data, so the cut was skipped and the whole segment's
/// reservation stayed allocated until retention removed it (until 2026-12-08).
#[test]
fn a_segment_sealed_early_gives_back_its_reservation() {
    run(|| async {
        use std::os::unix::fs::MetadataExt as _;
        let disk = Disk::new();
        let config = LogConfig {
            segment_bytes_max: 64 << 20,
            zero_ahead_bytes: 0,
            preallocate: true,
            ..LogConfig::default()
        };
        let (log, _) = SegmentLog::open(disk.backend().await, config.clone())
            .await
            .unwrap();
        fill(&log, 256, 4000).await;
        log.roll_next();
        fill(&log, 1, 4000).await;
        assert_eq!(log.segment_count(), 2);
        log.close().await.unwrap();
        let meta = std::fs::metadata(disk.0.join("00000000000000000000.seg")).unwrap();
        assert!(
            meta.blocks() * 512 < 2 << 20,
            "{} bytes allocated for {} of data",
            meta.blocks() * 512,
            meta.len()
        );
    });
}

/// An index file far larger than any index (filesystem damage, a stray writer) is
/// rebuilt, not read: its size was allocated before reading, so a sparse terabyte
/// aborted the process at every open of its log (until 2026-12-08).
#[test]
fn an_index_larger_than_any_is_rebuilt_not_read() {
    run(|| async {
        let disk = Disk::new();
        let (log, _) = SegmentLog::open(disk.backend().await, small_segments())
            .await
            .unwrap();
        fill(&log, 200, 1000).await;
        assert!(log.segment_count() > 1);
        log.close().await.unwrap();
        disk.set_len("00000000000000000000.idx", 1 << 40);
        let (log, report) = SegmentLog::open(disk.backend().await, small_segments())
            .await
            .unwrap();
        assert!(report.rebuilt_indexes >= 1, "{report:?}");
        assert_eq!(read_all(&log).await.len(), 200);
        log.close().await.unwrap();
        assert!(
            disk.len("00000000000000000000.idx") < 1 << 20,
            "written back whole"
        );
    });
}

async fn retention_removes_whole_old_segments_only<F: Fixture>(fx: F) {
    let cfg = LogConfig {
        retention_bytes: Some(200 * 1024),
        ..small_segments()
    };
    let (log, _) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
    fill(&log, 400, 1000).await;
    let before = log.segment_count();
    let removed = log.enforce_retention(u64::MAX / 2).await.unwrap();
    assert!(removed > 0 && log.segment_count() == before - removed);
    assert!(log.size_bytes() <= 200 * 1024 + 64 * 1024);
    let base = log.base_offset();
    assert!(base > 0);
    assert!(matches!(
        log.read(base - 1, 10).await,
        Err(StorageError::Trimmed { oldest, .. }) if oldest == base
    ));
    check_contents(&read_all(&log).await, base, 400, 1000);
    log.close().await.unwrap();

    let aged = LogConfig {
        retention_age: Some(Duration::from_secs(10)),
        ..small_segments()
    };
    let (log, report) = SegmentLog::open(fx.backend().await, aged).await.unwrap();
    assert_eq!(report.base_offset, base, "retention survives reopen");
    // Records were stamped with their offset as the time: all are "old" at t = 10 s + 1e6 µs.
    let removed = log
        .enforce_retention(1_000 + 10_000_000 + 400)
        .await
        .unwrap();
    assert!(removed > 0);
    assert_eq!(log.segment_count(), 1, "only the active segment is left");
    log.close().await.unwrap();
}

async fn retention_bounds_can_be_passed_in<F: Fixture>(fx: F) {
    // Nothing configured: the caller's bounds are the only ones.
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    fill(&log, 400, 1000).await;
    let before = log.segment_count();
    let written = log.written_bytes();
    assert_eq!(written, log.size_bytes());
    assert_eq!(log.enforce_retention(u64::MAX / 2).await.unwrap(), 0);
    let removed = log
        .enforce_retention_with(0, Some(200 * 1024), None)
        .await
        .unwrap();
    assert!(removed > 0 && log.segment_count() == before - removed);
    assert!(log.size_bytes() <= 200 * 1024 + 64 * 1024);
    // What was written stays written: "written since" measures (snapshots due every
    // so many bytes) go on under retention.
    assert_eq!(log.written_bytes(), written);
    let base = log.base_offset();
    check_contents(&read_all(&log).await, base, 400, 1000);
    // An age too large to add to a timestamp keeps everything rather than overflowing.
    assert!(log.segment_count() > 1);
    assert_eq!(
        log.enforce_retention_with(u64::MAX, None, Some(Duration::MAX))
            .await
            .unwrap(),
        0
    );
    // Records are stamped with their offset as the time: all are old 10 s after 400.
    let removed = log
        .enforce_retention_with(400 + 10_000_000 + 1, None, Some(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(removed > 0);
    assert_eq!(log.segment_count(), 1, "only the active segment is left");
    log.close().await.unwrap();
    // A closed log's files may be another owner's (a re-pinned shard): hands off.
    assert!(matches!(
        log.enforce_retention_with(u64::MAX / 2, Some(0), None)
            .await,
        Err(felix_storage_uring::StorageError::Closed)
    ));
}

async fn tailing_wait_resolves_when_a_record_is_committed<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let waiter = {
        let log = log.clone();
        glommio::spawn_local(async move {
            log.wait_for(0).await.unwrap();
            log.read(0, 100).await.unwrap()
        })
    };
    glommio::timer::sleep(Duration::from_millis(5)).await;
    fill(&log, 1, 10).await;
    let got = waiter.await;
    assert_eq!(got[0].records[0].to_vec(), payload(0, 10));
    log.close().await.unwrap();
}

async fn every_fsync_mode_acknowledges_and_recovers<F: Fixture>(fx: F) {
    for (i, mode) in [
        FsyncMode::None,
        FsyncMode::Periodic(Duration::from_millis(5)),
        FsyncMode::OnCommit,
    ]
    .into_iter()
    .enumerate()
    {
        let cfg = LogConfig {
            fsync: mode,
            ..LogConfig::default()
        };
        let (log, _) = SegmentLog::open(fx.backend().await, cfg.clone())
            .await
            .unwrap();
        fill(&log, 10, 100).await;
        if mode == FsyncMode::OnCommit {
            assert_eq!(log.durable_end(), log.committed_end());
        }
        log.sync().await.unwrap();
        assert_eq!(log.durable_end(), 10 * (i as u64 + 1));
        log.close().await.unwrap();
        let (log, _) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
        check_contents(&read_all(&log).await, 0, 10 * (i as u64 + 1), 100);
        log.close().await.unwrap();
    }
}

/// With `dsync_writes`, every round after the first is one durable write, no
/// fdatasync follows it, and what it wrote reads back, across rolls and a reopen (on
/// the disk backend through the file's second, O_DSYNC, descriptor).
async fn durable_writes_read_back_across_rolls_and_reopen<F: Fixture>(fx: F) {
    let cfg = LogConfig {
        dsync_writes: true,
        zero_ahead_bytes: 8 * 1024,
        ..small_segments()
    };
    let (log, _) = SegmentLog::open(fx.backend().await, cfg.clone())
        .await
        .unwrap();
    fill(&log, 300, 1000).await;
    assert!(log.segment_count() > 3, "rolled: {}", log.segment_count());
    let stats = log.stats();
    assert!(
        stats.dsync_writes >= 290,
        "durable writes: {}",
        stats.dsync_writes
    );
    // The first round's fdatasync and the rolls' are all that remain.
    assert_eq!(
        stats.syncs - stats.dsync_writes,
        1 + stats.rolls,
        "fdatasyncs: {stats:?}"
    );
    assert_eq!(log.durable_end(), 300);
    check_contents(&read_all(&log).await, 0, 300, 1000);
    log.close().await.unwrap();
    let (log, _) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
    check_contents(&read_all(&log).await, 0, 300, 1000);
    log.close().await.unwrap();
}

async fn oversized_and_empty_batches_are_refused<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert!(matches!(
        log.begin_append::<&[u8]>(&[], 0, None),
        Err(StorageError::EmptyBatch)
    ));
    let huge = vec![0u8; 65 * 1024 * 1024];
    assert!(matches!(
        log.begin_append(&[huge], 0, None),
        Err(StorageError::BatchTooLarge { .. })
    ));
    // A batch larger than a segment gets a segment of its own.
    let big = vec![7u8; 100 * 1024];
    log.commit(log.begin_append(&[b"a".to_vec()], 0, None).unwrap())
        .await
        .unwrap();
    log.commit(
        log.begin_append(std::slice::from_ref(&big), 0, None)
            .unwrap(),
    )
    .await
    .unwrap();
    log.commit(log.begin_append(&[b"b".to_vec()], 0, None).unwrap())
        .await
        .unwrap();
    let all = read_all(&log).await;
    assert_eq!(all[1].1, big);
    assert_eq!(all.len(), 3);
    log.close().await.unwrap();
}

async fn a_foreign_file_is_refused_and_unrelated_files_ignored<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    fill(&log, 3, 10).await;
    log.close().await.unwrap();
    fx.write("notes.txt", b"hello");
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    log.close().await.unwrap();
    // An index whose segment is gone (a crash between a retention pass's unlinks) is
    // removed at the next open; the others stay.
    let orphan = "00000000000000000999.idx";
    fx.write(orphan, b"stale");
    let indexes = |fx: &F| {
        fx.names()
            .into_iter()
            .filter(|n| n.ends_with(".idx"))
            .count()
    };
    let before = indexes(&fx);
    let (log, report) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    log.close().await.unwrap();
    assert_eq!(report.orphan_indexes_removed, 1);
    assert!(!fx.names().iter().any(|n| n == orphan), "removed");
    assert_eq!(indexes(&fx), before - 1, "the others kept");
    fx.write("backup.seg", b"not ours");
    assert!(matches!(
        SegmentLog::open(fx.backend().await, LogConfig::default()).await,
        Err(StorageError::ForeignFile { .. })
    ));
    fx.remove("backup.seg");
    // A segment-named file with garbage instead of a header is interior damage.
    fx.write("00000000000000000001.seg", &[0x55; 5000]);
    assert!(matches!(
        SegmentLog::open(fx.backend().await, LogConfig::default()).await,
        Err(StorageError::Corrupt(_))
    ));
}

/// A batch larger than the read window (and than a read's byte budget) behind a small
/// one is read: the small one first, then the large one whole.
async fn a_batch_larger_than_the_read_window_is_read_whole<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    fill(&log, 1, 10).await;
    fill(&log, 1, 4 << 20).await;
    fill(&log, 1, 10).await;
    let read = |from: u64, budget: usize| {
        let log = &log;
        async move {
            glommio::timer::timeout(Duration::from_secs(10), async {
                Ok(log.read(from, budget).await)
            })
            .await
            .expect("the read answers")
            .unwrap()
        }
    };
    for budget in [1 << 20, 4 << 20, 16 << 20] {
        let first = read(0, budget).await;
        assert!(!first.is_empty());
        assert_eq!(first[0].records[0].len(), 10);
        let mut at = first.last().unwrap().end_offset();
        let mut lens: Vec<usize> = first.iter().map(|b| b.records[0].len()).collect();
        while at < 3 {
            let next = read(at, budget).await;
            assert!(
                !next.is_empty(),
                "a read from {at} with {budget} returned nothing"
            );
            lens.extend(next.iter().map(|b| b.records[0].len()));
            at = next.last().unwrap().end_offset();
        }
        assert_eq!(lens, [10, 4 << 20, 10], "budget {budget}");
    }
}

/// A close waits for a retention pass that is removing files, which stops at its next
/// segment: its removals yield (they run on the core's blocking thread), and a shard
/// moved to another core opens the same files once this log closed, so a segment still
/// being removed then was listed by the new owner and gone when it opened it. Disk
/// only: the memory backend's removals never yield.
#[test]
fn a_close_waits_for_a_retention_pass_removing_files() {
    run(|| async {
        let fx = Disk::new();
        let cfg = LogConfig {
            segment_bytes_max: 8 * 1024,
            index_interval_bytes: 1024,
            retention_bytes: Some(16 * 1024),
            ..LogConfig::default()
        };
        let (log, _) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
        fill(&log, 700, 1000).await;
        assert!(log.segment_count() > 80, "{} segments", log.segment_count());
        let log = std::rc::Rc::new(log);
        let done = std::rc::Rc::new(std::cell::Cell::new(false));
        let retention = glommio::spawn_local({
            let (log, done) = (log.clone(), done.clone());
            async move {
                let removed = log.enforce_retention(u64::MAX / 2).await;
                done.set(true);
                removed
            }
        });
        // The pass has chosen its segments and is inside its first removal.
        while log.base_offset() == 0 {
            futures_lite::future::yield_now().await;
        }
        log.close().await.unwrap();
        assert!(done.get(), "the close returned with the pass still going");
        let at_close = fx.names();
        let removed = retention.await.unwrap();
        assert!(
            (1..10).contains(&removed),
            "the pass stops at its next segment once the close began: removed {removed}"
        );
        assert_eq!(
            fx.names().len(),
            at_close.len(),
            "files were removed after the close returned"
        );
    });
}

/// A truncation and reset wait for a retention pass that is removing files. The pass
/// takes its segments out of memory before it removes them, so a reset planned
/// meanwhile (a follower starting over at its leader's base) knew nothing of them:
/// when it returned, dozens of the pass's files were still there, and a crash then
/// left them beside the new base, an offset gap every later open refused. Disk only:
/// the memory backend's removals never yield.
#[test]
fn a_reset_waits_for_a_retention_pass_removing_files() {
    run(|| async {
        let fx = Disk::new();
        let cfg = LogConfig {
            segment_bytes_max: 8 * 1024,
            index_interval_bytes: 1024,
            retention_bytes: Some(16 * 1024),
            ..LogConfig::default()
        };
        let (log, _) = SegmentLog::open(fx.backend().await, cfg.clone())
            .await
            .unwrap();
        fill(&log, 700, 1000).await;
        let end = log.next_offset();
        assert!(log.segment_count() > 80, "{} segments", log.segment_count());
        let log = std::rc::Rc::new(log);
        let retention = glommio::spawn_local({
            let log = log.clone();
            async move { log.enforce_retention(u64::MAX / 2).await }
        });
        // The pass has chosen its segments and is inside its first removal.
        while log.base_offset() == 0 {
            futures_lite::future::yield_now().await;
        }
        log.truncate_from(log.base_offset()).await.unwrap();
        log.reset_empty_at(end + 100).await.unwrap();
        let left: Vec<String> = fx
            .names()
            .into_iter()
            .filter(|n| {
                n.ends_with(".seg") && *n != felix_storage_uring::segment::segment_name(end + 100)
            })
            .collect();
        assert!(
            left.is_empty(),
            "the pass's files outlived the reset: {left:?}"
        );
        retention.await.unwrap();
        log.close().await.unwrap();
        let (log, _) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
        assert_eq!(log.base_offset(), end + 100);
        log.close().await.unwrap();
    });
}

/// A commit polled again and again while its flush has not run (a task woken by
/// something else meanwhile, a `zip` or `select` beside a busy branch) keeps one waker
/// for its task. Each poll kept another clone of it: past 32,767 glommio's count of
/// the task's wakers overflowed, and the core panicked.
async fn a_commit_polled_again_and_again_while_it_waits_keeps_one_waker<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let p = log.begin_append(&[payload(0, 100)], 0, None).unwrap();
    let commit = log.commit(p);
    let mut commit = std::pin::pin!(commit);
    // No yield between the polls: the flusher cannot run, so the commit waits.
    for _ in 0..40_000 {
        assert!(
            futures_lite::future::poll_once(&mut commit).await.is_none(),
            "committed before its flush ran"
        );
    }
    assert_eq!(commit.await.unwrap().first, 0);
    log.close().await.unwrap();
}

macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(#[test] fn $name() { run(|| super::$name(Mem(MemBackend::new()))); })*
        }
        mod disk {
            use super::*;
            $(#[test] fn $name() { run(|| super::$name(Disk::new())); })*
        }
    };
}

both_backends!(
    appends_read_back_across_segments_and_reopen,
    a_sealed_log_reopens_from_its_index_without_scanning,
    a_log_reopened_from_its_indexes_knows_which_kinds_it_holds,
    batches_keep_kind_producer_and_timestamp,
    concurrent_commits_resolve_in_offset_order,
    a_dropped_pending_append_does_not_stall_its_successors,
    a_torn_tail_is_cut_to_the_last_whole_batch,
    a_zeroed_or_garbled_header_at_the_tail_is_repaired,
    interior_damage_refuses_to_open_naming_segment_and_offset,
    deleted_truncated_or_stale_indexes_are_rebuilt,
    retention_removes_whole_old_segments_only,
    retention_bounds_can_be_passed_in,
    tailing_wait_resolves_when_a_record_is_committed,
    every_fsync_mode_acknowledges_and_recovers,
    durable_writes_read_back_across_rolls_and_reopen,
    oversized_and_empty_batches_are_refused,
    a_foreign_file_is_refused_and_unrelated_files_ignored,
    a_batch_larger_than_the_read_window_is_read_whole,
    a_commit_polled_again_and_again_while_it_waits_keeps_one_waker,
);

/// With an index sparser than the read window, a read far past the index entry steps
/// window by window to its batch, whatever the windows end in: inside a batch, or inside
/// its header (which once sent the read back to the index, to the same window, for
/// ever). On disk only: the in-memory backend's reads never yield, so a loop there would
/// hang the test instead of failing it.
#[test]
fn a_read_far_from_its_index_entry_steps_through_windows_to_its_batch() {
    run(|| async {
        let fx = Disk::new();
        let config = LogConfig {
            read_window_bytes: 4096,
            index_interval_bytes: 1 << 20,
            ..LogConfig::default()
        };
        let (log, _) = SegmentLog::open(fx.backend().await, config).await.unwrap();
        // Batches of odd sizes, so that windows end at every kind of place.
        for i in 0..200u64 {
            let offset = log.next_offset();
            let p = log
                .begin_append(
                    &[payload(offset, 700 + (i as usize * 37) % 900)],
                    offset,
                    None,
                )
                .unwrap();
            log.commit(p).await.unwrap();
        }
        for k in 0..200u64 {
            let got = glommio::timer::timeout(Duration::from_secs(10), async {
                Ok(log.read(k, 1).await)
            })
            .await
            .unwrap_or_else(|_| panic!("the read from {k} answers"))
            .unwrap();
            assert_eq!(got[0].base_offset, k);
            assert_eq!(got[0].records[0], payload(k, 700 + (k as usize * 37) % 900));
        }
    });
}

/// A reader that knows where it stops (a consumer group's claim) gets the batches below
/// that offset and reads from the device about what they hold, not a whole read window.
#[test]
fn a_bounded_read_stops_at_its_end_and_reads_only_what_it_needs() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), LogConfig::default())
            .await
            .unwrap();
        fill(&log, 2000, 1000).await;
        let before = mem.bytes_read();
        let batches = log.read_to(100, 164, 1 << 20).await.unwrap();
        let read = mem.bytes_read() - before;
        let offsets: Vec<u64> = batches.iter().map(|b| b.base_offset).collect();
        assert_eq!(offsets, (100..164).collect::<Vec<_>>());
        assert!(
            read < 64 * 1100 + 2 * 4096 + 8192,
            "64 records of 1000 bytes cost a {read}-byte device read"
        );
        // Unbounded, the same read takes a whole window.
        let before = mem.bytes_read();
        let all = log.read(100, 1 << 20).await.unwrap();
        assert!(all.len() > 900, "{}", all.len());
        assert!(mem.bytes_read() - before >= 1 << 20);
        // Past the acknowledged end and below the base it answers as `read` does.
        assert!(log.read_to(2000, 3000, 1 << 20).await.unwrap().is_empty());
        let tail = log.read_to(1990, 5000, 1 << 20).await.unwrap();
        assert_eq!(tail.len(), 10);
    });
}

#[test]
fn retention_never_removes_a_segment_past_the_floor() {
    run(|| async {
        let (log, _) = SegmentLog::open(MemBackend::new(), small_segments())
            .await
            .unwrap();
        fill(&log, 200, 2048).await;
        assert!(log.segment_count() > 3);
        // Everything is over the size bound, but nothing at or after offset 10 may go.
        let removed = log
            .enforce_retention_below(u64::MAX, Some(1), None, 10)
            .await
            .unwrap();
        assert_eq!(removed, 0, "the first segment holds the floor");
        let removed = log
            .enforce_retention_below(u64::MAX, Some(1), None, 150)
            .await
            .unwrap();
        assert!(removed > 0);
        assert!(
            log.base_offset() <= 150,
            "nothing at or after the floor went"
        );
    });
}

/// What retention would remove is told before it runs: the new base and the kinds of
/// batch the doomed segments may hold, known from the writes and from a full scan at
/// open; a segment opened from its index without a full scan may hold any kind.
#[test]
fn the_retention_cut_tells_the_kinds_the_doomed_segments_hold() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), small_segments())
            .await
            .unwrap();
        fill(&log, 40, 2048).await;
        let p = log.begin_commit(b"a commit", 0).unwrap();
        log.commit(p).await.unwrap();
        fill(&log, 160, 2048).await;
        let p = log.begin_state(&[b"a copy"], 0).unwrap();
        log.commit(p).await.unwrap();
        log.sync().await.unwrap();
        let only_data = |upto: u64| log.retention_cut(u64::MAX, Some(1), None, upto);
        // Below the commit: data only.
        let (cut, kinds) = only_data(40);
        assert!(cut <= 40 && cut > 0, "{cut}");
        assert!(kinds.has(BatchKind::Data));
        assert!(!kinds.has(BatchKind::Commit) && !kinds.has(BatchKind::State));
        // Past it: the commit is in a doomed segment; the copy is in the newest, kept.
        let (cut, kinds) = only_data(u64::MAX);
        assert!(cut > 41 && cut <= 201, "{cut}");
        assert!(kinds.has(BatchKind::Commit) && !kinds.has(BatchKind::State));
        assert_eq!(log.base_offset(), 0, "nothing removed by asking");
        log.close().await.unwrap();
        // Reopened, the segments below the commit are known to hold none: read in full
        // (All), or by their index files (Tail).
        for verify in [VerifyOnOpen::All, VerifyOnOpen::Tail] {
            let config = LogConfig {
                verify_on_open: verify,
                ..small_segments()
            };
            let (log, _) = SegmentLog::open(mem.clone(), config).await.unwrap();
            let (_, kinds) = log.retention_cut(u64::MAX, Some(1), None, 40);
            assert!(
                !kinds.has(BatchKind::Commit),
                "{verify:?}: a segment is known to hold no commit"
            );
            log.close().await.unwrap();
        }
    });
}

/// Recovery's torn-last-round rule relies on a flush round never taking more than
/// `ROUND_BYTES_MAX` of batches (unless one batch is larger): a backlog staged at once
/// is written in several rounds, each made durable before the next starts.
#[test]
fn a_backlog_is_flushed_in_bounded_rounds() {
    run(|| async {
        let (log, _) = SegmentLog::open(MemBackend::new(), LogConfig::default())
            .await
            .unwrap();
        let batch = vec![7u8; 1024 * 1024];
        let pending: Vec<_> = (0..20)
            .map(|o| log.begin_append(&[&batch[..]], o, None).unwrap())
            .collect();
        for p in pending {
            log.commit(p).await.unwrap();
        }
        let stats = log.stats();
        assert!(
            stats.largest_round_bytes <= format_round_max() as u64,
            "{stats:?}"
        );
        assert!(stats.flush_rounds >= 3, "{stats:?}");
        // One batch larger than the bound is a round of its own.
        let big = vec![8u8; format_round_max() + 1];
        log.append(&[&big[..]], 0).await.unwrap();
        assert!(log.stats().largest_round_bytes > format_round_max() as u64);
        log.close().await.unwrap();
    });
}

/// A round of several mebibytes, starting inside the block the last round ended in and
/// made of batches of uneven sizes, reads back byte for byte after a reopen.
#[test]
fn a_round_of_several_mebibytes_reads_back_after_reopen() {
    run(|| async {
        let fx = Disk::new();
        let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
            .await
            .unwrap();
        fill(&log, 1, 10).await;
        let lens: Vec<usize> = (0..40).map(|i| 70_000 + i * 9_973).collect();
        let pending: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let offset = 1 + i as u64;
                log.begin_append(&[payload(offset, len)], offset, None)
                    .unwrap()
            })
            .collect();
        for p in pending {
            log.commit(p).await.unwrap();
        }
        assert!(
            log.stats().largest_round_bytes > 2 << 20,
            "{:?}",
            log.stats()
        );
        log.close().await.unwrap();
        let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
            .await
            .unwrap();
        let records = read_all(&log).await;
        assert_eq!(records.len(), 41);
        for (offset, record) in &records[1..] {
            assert_eq!(record, &payload(*offset, lens[*offset as usize - 1]));
        }
        log.close().await.unwrap();
    });
}

/// A burst's buffers are not held for the log's life: after it, the emptied chunks kept
/// for reuse stay within one round's worth (four were kept whatever their size: 32 MiB
/// after a flood), and once the log has written nothing for a second it gives back the
/// spares and its write buffer; the next appends grow them again.
#[test]
fn a_burst_leaves_one_round_of_buffers_and_an_idle_log_gives_them_back() {
    run(|| async {
        let (log, _) = SegmentLog::open(MemBackend::new(), LogConfig::default())
            .await
            .unwrap();
        let round = format_round_max();
        assert_eq!(log.buffer_bytes(), 0);
        let batch = vec![7u8; 1024 * 1024];
        for burst in 0..3u64 {
            let pending: Vec<_> = (0..40)
                .map(|i| {
                    log.begin_append(&[&batch[..]], burst * 40 + i, None)
                        .unwrap()
                })
                .collect();
            assert!(log.buffer_bytes() >= 40 * batch.len(), "all of it staged");
            for p in pending {
                log.commit(p).await.unwrap();
            }
        }
        let after_burst = log.buffer_bytes();
        eprintln!("held after the bursts: {after_burst} bytes");
        // One round's worth of spare chunks, plus the write buffer (7 batches of a round,
        // its tail block and alignment): a full chunk is kept, and no more.
        assert!(
            after_burst > round && after_burst <= 2 * round + (64 << 10),
            "{after_burst} bytes held after the bursts: not one full spare and a write buffer"
        );
        glommio::timer::sleep(Duration::from_millis(1500)).await;
        assert_eq!(log.buffer_bytes(), 0, "an idle log gives its buffers back");
        let o = log.append(&[&batch[..]], 1000).await.unwrap().first;
        assert_eq!(o, 120);
        let records = read_all(&log).await;
        assert_eq!(records.len(), 121);
        assert!(records.iter().all(|(_, r)| r == &batch));
        log.close().await.unwrap();
    });
}

fn format_round_max() -> usize {
    felix_storage_uring::format::ROUND_BYTES_MAX
}

/// A compaction's cut: `roll_next` makes the next batch open a segment, so removing the
/// sealed segments below it leaves exactly the records from the cut on.
#[test]
fn roll_next_cuts_a_segment_and_removal_below_it_keeps_the_rest() {
    run(|| async {
        let (log, _) = SegmentLog::open(MemBackend::new(), LogConfig::default())
            .await
            .unwrap();
        fill(&log, 10, 100).await;
        assert_eq!(log.segment_count(), 1);
        log.roll_next();
        let cut = log.next_offset();
        fill(&log, 3, 100).await;
        assert_eq!(
            log.segment_count(),
            2,
            "the batch after the cut opened a segment"
        );
        let removed = log
            .enforce_retention_below(0, Some(0), None, cut)
            .await
            .unwrap();
        assert_eq!(removed, 1);
        assert_eq!(log.base_offset(), cut);
        check_contents(&read_all(&log).await, cut, cut + 3, 100);
        // Asking twice rolls once.
        log.roll_next();
        log.roll_next();
        fill(&log, 2, 100).await;
        assert_eq!(log.segment_count(), 2);
        log.close().await.unwrap();
    });
}

/// Under `fsync: none`, removing the segments below a compaction's cut syncs the log
/// first: a crash right after the removal keeps the records past the cut that replace
/// what went (without the sync, both were gone: the log reopened empty at the cut).
#[test]
fn removing_superseded_segments_makes_what_supersedes_them_durable_first() {
    run(|| async {
        let mem = MemBackend::new();
        let config = LogConfig {
            fsync: FsyncMode::None,
            ..LogConfig::default()
        };
        let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
        fill(&log, 10, 100).await;
        log.roll_next();
        let cut = log.next_offset();
        // The copies past the cut: answered at sequencing, then written, not synced.
        fill(&log, 3, 100).await;
        for _ in 0..1000 {
            if log.segment_count() == 2 {
                break;
            }
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(log.segment_count(), 2, "the copies were written");
        let removed = log
            .remove_superseded_below(0, Some(0), None, cut)
            .await
            .unwrap();
        assert_eq!(removed, 1);
        let (after, _) = SegmentLog::open(mem.crash(), config).await.unwrap();
        assert_eq!(after.base_offset(), cut);
        check_contents(&read_all(&after).await, cut, cut + 3, 100);
        after.close().await.unwrap();
        log.close().await.unwrap();
    });
}

/// A segment retention cannot remove stays the log's: memory keeps matching the files
/// (before, every doomed segment left memory first, so one failed unlink left the
/// rest on disk unknown to the log, and the base moved back at the next open).
#[test]
fn a_segment_retention_fails_to_remove_stays_in_the_log() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), small_segments())
            .await
            .unwrap();
        fill(&log, 400, 1000).await;
        let bases = log.segment_bases();
        assert!(bases.len() >= 4, "{bases:?}");
        // The first segment and its index go; the second segment's unlink fails.
        mem.fail_with(MemOp::Remove, libc::EIO, 2, FaultTimes::Once);
        assert!(
            log.enforce_retention_below(0, Some(0), None, u64::MAX)
                .await
                .is_err()
        );
        assert_eq!(log.segment_bases(), bases[1..].to_vec());
        assert_eq!(log.base_offset(), bases[1]);
        check_contents(&read_all(&log).await, bases[1], 400, 1000);
        // Retention goes on from there, and a reopen finds what memory knew.
        assert_eq!(
            log.enforce_retention_below(0, Some(0), None, bases[2])
                .await
                .unwrap(),
            1
        );
        assert_eq!(log.base_offset(), bases[2]);
        // A segment file gone already (removed behind the log's back) counts as
        // removed: put back, it would hold retention on this log for good.
        let gone = format!("{:020}.seg", bases[2]);
        felix_storage_uring::io::Backend::remove(&mem, &gone)
            .await
            .unwrap();
        assert_eq!(
            log.enforce_retention_below(0, Some(0), None, bases[3])
                .await
                .unwrap(),
            1
        );
        assert_eq!(log.base_offset(), bases[3]);
        log.close().await.unwrap();
        let (again, _) = SegmentLog::open(mem, small_segments()).await.unwrap();
        assert_eq!(again.segment_bases(), bases[3..].to_vec());
        check_contents(&read_all(&again).await, bases[3], 400, 1000);
        again.close().await.unwrap();
    });
}

/// Small segments with 16 KiB of zeros written ahead of the data.
fn zeros_ahead() -> LogConfig {
    LogConfig {
        zero_ahead_bytes: 16 * 1024,
        ..small_segments()
    }
}

/// The segment file `name` ends within a block of its last non-zero byte.
fn assert_ends_with_its_data(mem: &MemBackend, name: &str) {
    let file = mem.contents(name).unwrap();
    let last_nonzero = file.iter().rposition(|b| *b != 0).unwrap();
    assert!(
        file.len() - last_nonzero <= 4096,
        "a sealed segment ends within a block of its data: {} bytes, data to {last_nonzero}",
        file.len()
    );
}

/// Zeros written ahead of the data: the newest segment's file is longer than its data
/// (appends overwrite blocks it holds), a roll cuts the sealed segment back to its data,
/// and a reopen reads every record and nothing else.
#[test]
fn zeros_written_ahead_of_the_data_are_read_as_the_end_and_cut_from_sealed_segments() {
    run(|| async {
        let config = zeros_ahead();
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
        fill(&log, 10, 100).await;
        let stats = log.stats();
        assert!(stats.zero_ahead_bytes >= 8 * 1024, "{stats:?}");
        let newest = |mem: &MemBackend| {
            let name = format!("{:020}.seg", 0);
            mem.contents(&name).unwrap().len()
        };
        assert!(newest(&mem) >= 4096 + 8 * 1024, "{}", newest(&mem));
        // A roll long before the segment is full: it is sealed with its data only.
        log.roll_next();
        fill(&log, 700, 100).await;
        assert!(log.stats().rolls >= 2);
        assert_ends_with_its_data(&mem, &format!("{:020}.seg", 0));
        let before = read_all(&log).await;
        assert_eq!(before.len(), 710);
        log.close().await.unwrap();
        let (log, report) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
        assert_eq!(report.torn_tail, None, "zeros past the data are no damage");
        assert_eq!(read_all(&log).await, before);
        fill(&log, 5, 100).await;
        assert_eq!(read_all(&log).await.len(), 715);
        log.close().await.unwrap();
    });
}

/// A fresh log in memory with `config` whose writes fail with `errno` once `skip` more
/// have passed (`times`), and its backend.
async fn failing_writes(
    config: &LogConfig,
    errno: i32,
    skip: u64,
    times: FaultTimes,
) -> (SegmentLog<MemBackend>, MemBackend) {
    let mem = MemBackend::new();
    let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
    mem.fail_with(felix_storage_uring::MemOp::Write, errno, skip, times);
    (log, mem)
}

/// Lets the flusher finish what follows a round (zeros written after it).
async fn settle() {
    for _ in 0..20 {
        futures_lite::future::yield_now().await;
    }
}

/// After one write of zeros refused for space: every record is there, and no zeros
/// were written.
async fn assert_zeros_refused_once(log: &SegmentLog<MemBackend>, records: usize) {
    let stats = log.stats();
    assert_eq!(
        (stats.zero_ahead_failures, stats.zero_ahead_bytes),
        (1, 0),
        "{stats:?}"
    );
    assert_eq!(read_all(log).await.len(), records);
}

/// Zeros written ahead that find the disk full are no failure of the log: that
/// segment goes on growing as it is written (counted, no more zeros for it), and every
/// record stays. Any other failed write of zeros poisons, as a failed write of data
/// does: the device is failing, and an injected write fault must not be spent silently.
#[test]
fn a_zero_write_that_finds_the_disk_full_stops_zeros_and_any_other_failure_poisons() {
    run(|| async {
        let config = zeros_ahead();
        // Zeros behind a round's data (the first round grows the file): the data is
        // written again alone.
        let (log, _) = failing_writes(&config, libc::ENOSPC, 0, FaultTimes::Once).await;
        fill(&log, 3, 100).await;
        fill(&log, 3, 100).await;
        assert_zeros_refused_once(&log, 6).await;
        log.close().await.unwrap();

        // A longer write the full disk cut short (its data and some of its zeros landed),
        // then the data alone: every record is there after a reopen, no damage.
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
        mem.tear_next_write_with(4096 + 1024, libc::ENOSPC);
        fill(&log, 3, 100).await;
        assert_eq!(log.stats().zero_ahead_failures, 1);
        log.close().await.unwrap();
        let (log, report) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
        assert_eq!(report.torn_tail, None);
        assert_eq!(read_all(&log).await.len(), 3);
        log.close().await.unwrap();

        // A disk that stays full refuses the data too: the append is refused, and once
        // space is back the segment still gets no zeros (none tried and refused again
        // each round while the disk is full).
        let (log, mem) = failing_writes(&config, libc::ENOSPC, 0, FaultTimes::Always).await;
        let p = log.begin_append(&[b"x"], 0, None).unwrap();
        assert!(matches!(
            log.commit(p).await,
            Err(StorageError::NoSpace { .. })
        ));
        mem.clear_faults();
        fill(&log, 3, 100).await;
        assert_zeros_refused_once(&log, 3).await;
        log.close().await.unwrap();

        // Zeros written on their own after a round, once less than half is left: a run
        // without faults finds which write that is.
        let (records, skip) = {
            let mem = MemBackend::new();
            let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
            let (opened, _) = mem.op_counts();
            fill(&log, 1, 100).await;
            let behind_data = log.stats().zero_ahead_bytes;
            assert!(behind_data > 0, "the first round grows the file");
            let mut records = 1;
            loop {
                fill(&log, 1, 100).await;
                records += 1;
                // The zeros follow the round that acknowledged the record.
                settle().await;
                if log.stats().zero_ahead_bytes > behind_data {
                    break (records, mem.op_counts().0 - 1 - opened);
                }
                assert!(records < 1000, "no zeros written on their own");
            }
        };
        let (log, _) = failing_writes(&config, libc::ENOSPC, skip, FaultTimes::Once).await;
        fill(&log, records + 200, 100).await;
        let stats = log.stats();
        assert_eq!(stats.zero_ahead_failures, 1, "{stats:?}");
        assert_eq!(read_all(&log).await.len() as u64, records + 200);
        log.close().await.unwrap();

        let (log, _) = failing_writes(&config, libc::EIO, skip, FaultTimes::Once).await;
        fill(&log, records, 100).await;
        settle().await;
        let refused = match log.begin_append(&[b"x"], 0, None) {
            Err(e) => e,
            Ok(p) => log.commit(p).await.unwrap_err(),
        };
        assert!(
            matches!(
                refused,
                StorageError::Poisoned {
                    op: "write zeros ahead",
                    ..
                }
            ),
            "{refused:?}"
        );
    });
}

/// With durable writes, the retry of a growing round whose zeros found the disk full
/// (its data written again alone) is durable too: the record it acknowledges survives
/// a crash that keeps only what was synced.
#[test]
fn a_durable_round_written_again_without_its_zeros_is_still_durable() {
    run(|| async {
        let config = LogConfig {
            dsync_writes: true,
            ..zeros_ahead()
        };
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
        fill(&log, 1, 100).await;
        settle().await;
        // Past the zeros ahead: this round grows the file, with zeros behind it.
        mem.fail_next_write_with(libc::ENOSPC);
        fill(&log, 1, 20 * 1024).await;
        let stats = log.stats();
        assert_eq!(
            (stats.zero_ahead_failures, stats.dsync_writes),
            (1, 1),
            "{stats:?}"
        );
        drop(log);
        let (log, _) = SegmentLog::open(mem.crash(), config).await.unwrap();
        let records = read_all(&log).await;
        assert_eq!(records.len(), 2, "both acknowledged records");
        assert_eq!(records[1].1, payload(1, 20 * 1024));
    });
}

/// A round that grows the file carries the zeros ahead in its own write: under a load
/// that always has appends staged, the zeros written after a round never get a turn.
#[test]
fn a_round_that_grows_the_file_writes_zeros_behind_its_data() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), zeros_ahead()).await.unwrap();
        let (opened, _) = mem.op_counts();
        fill(&log, 1, 100).await;
        settle().await;
        let (writes, _) = mem.op_counts();
        assert_eq!(writes - opened, 1, "one write for the data and the zeros");
        let zeros = log.stats().zero_ahead_bytes;
        assert!(zeros >= 8 * 1024, "{zeros} bytes of zeros");
        log.close().await.unwrap();
        let (log, report) = SegmentLog::open(mem.clone(), zeros_ahead()).await.unwrap();
        assert_eq!(report.torn_tail, None, "zeros past the data are no damage");
        assert_eq!(read_all(&log).await.len(), 1);
    });
}

/// A segment sealed after a restart is cut back to its data too: the zeros the last
/// life wrote ahead are in the file, not in what this life knows.
#[test]
fn a_segment_sealed_after_a_restart_loses_the_zeros_the_last_life_wrote() {
    run(|| async {
        let config = zeros_ahead();
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), config.clone()).await.unwrap();
        fill(&log, 10, 100).await;
        log.close().await.unwrap();
        let first = format!("{:020}.seg", 0);
        let long = mem.contents(&first).unwrap().len();
        assert!(long >= 4096 + 8 * 1024, "{long}");
        let (log, _) = SegmentLog::open(mem.clone(), config).await.unwrap();
        log.roll_next();
        fill(&log, 1, 100).await;
        assert_ends_with_its_data(&mem, &first);
        assert_eq!(read_all(&log).await.len(), 11);
    });
}
