//! Cutting the log for replication: `truncate_from` removes a suffix at a batch boundary,
//! `begin_append_at` stores a leader's batch at the leader's offset, `reset_empty_at`
//! moves an empty log, and `last_batch` reports the tail. Run on both backends; crashes
//! and faults at each step of a truncation need the memory backend. Every test ends by
//! checking what a reopen recovers: the old log or the new one, never a removed record.

mod common;

use std::time::Duration;

use common::{Disk, Fixture, Mem, run};
use felix_storage_uring::io::Backend;
use felix_storage_uring::{
    BatchKind, FaultTimes, FsyncMode, LogConfig, MemBackend, MemOp, SegmentLog, StorageError,
};

fn small_segments() -> LogConfig {
    LogConfig {
        segment_bytes_max: 64 * 1024,
        index_interval_bytes: 1024,
        ..LogConfig::default()
    }
}

/// The record at `offset`, written in round `round` (0: before any truncation).
fn rec(round: u8, offset: u64, len: usize) -> Vec<u8> {
    let mut v = offset.to_be_bytes().to_vec();
    v.push(round);
    v.resize(len.max(9), (offset % 251) as u8 ^ round);
    v
}

/// Appends `batches` batches of 1 to 3 records of round `round`, committing each;
/// returns the batch boundaries (first offsets).
async fn fill<B: Backend>(
    log: &SegmentLog<B>,
    model: &mut Vec<Vec<u8>>,
    round: u8,
    batches: u64,
    len: usize,
) -> Vec<u64> {
    let mut starts = Vec::new();
    for i in 0..batches {
        let first = log.next_offset();
        let recs: Vec<Vec<u8>> = (first..first + 1 + i % 3)
            .map(|o| rec(round, o, len))
            .collect();
        let p = log.begin_append(&recs, first, None).unwrap();
        assert_eq!(p.first(), first);
        log.commit(p).await.unwrap();
        model.truncate(first as usize);
        model.extend(recs);
        starts.push(first);
    }
    starts
}

/// Every record from the base on, with its offset.
async fn read_all<B: Backend>(log: &SegmentLog<B>) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = log.base_offset();
    loop {
        let batches = log.read(at, 1 << 20).await.unwrap();
        if batches.is_empty() {
            return out;
        }
        for b in batches {
            assert_eq!(b.base_offset, at, "contiguous");
            for (i, r) in b.records.iter().enumerate() {
                out.push((b.base_offset + i as u64, r.to_vec()));
            }
            at = b.end_offset();
        }
    }
}

/// The log holds exactly `model` (offset = index, from `base`).
async fn check<B: Backend>(log: &SegmentLog<B>, model: &[Vec<u8>], base: u64) {
    let got = read_all(log).await;
    assert_eq!(got.len(), model.len() - base as usize, "record count");
    for (offset, data) in got {
        assert_eq!(
            data, model[offset as usize],
            "record at offset {offset} is not the one the model holds"
        );
    }
    assert_eq!(log.next_offset(), model.len() as u64);
}

async fn truncate_then_append_reuses_offsets_and_reads_only_new_records<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let mut model = Vec::new();
    let starts = fill(&log, &mut model, 0, 30, 300).await;
    let cut = starts[17];
    log.truncate_from(cut).await.unwrap();
    model.truncate(cut as usize);
    assert_eq!(log.next_offset(), cut);
    assert_eq!(log.committed_end(), cut);
    assert_eq!(log.durable_end(), cut);
    assert_eq!(log.last_batch(), Some((starts[16], BatchKind::Data)));
    check(&log, &model, 0).await;
    assert!(log.read(cut, 1 << 20).await.unwrap().is_empty());
    // The next append takes the cut offset, and reads return the new records only.
    fill(&log, &mut model, 1, 5, 200).await;
    assert_eq!(
        log.read(cut, 1).await.unwrap()[0].records[0],
        rec(1, cut, 200)
    );
    check(&log, &model, 0).await;
    log.close().await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(report.truncated_bytes, 0, "{report:?}");
    assert!(!report.finished_intent);
    check(&log, &model, 0).await;
    log.close().await.unwrap();
}

async fn truncate_across_segments_removes_later_segments<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    let mut model = Vec::new();
    let starts = fill(&log, &mut model, 0, 150, 1000).await;
    let bases = |fx: &F| -> Vec<u64> {
        let mut v: Vec<u64> = fx
            .names()
            .iter()
            .filter(|n| n.ends_with(".seg"))
            .map(|n| n[..20].parse().unwrap())
            .collect();
        v.sort_unstable();
        v
    };
    let before = bases(&fx);
    assert!(before.len() >= 5, "{before:?}");
    assert_eq!(log.segment_count(), before.len());
    // A cut inside the second segment: every later segment goes, on disk too.
    let cut = *starts.iter().find(|&&s| s > before[1]).unwrap();
    log.truncate_from(cut).await.unwrap();
    model.truncate(cut as usize);
    assert_eq!(log.segment_count(), 2);
    assert_eq!(bases(&fx), before[..2], "{:?}", fx.names());
    check(&log, &model, 0).await;
    // Appending rolls into segment names the truncation freed.
    fill(&log, &mut model, 1, 100, 1000).await;
    assert!(log.segment_count() > 3);
    check(&log, &model, 0).await;
    // A cut at a segment's first offset keeps that segment, empty.
    let third_base = bases(&fx)[2];
    log.truncate_from(third_base).await.unwrap();
    model.truncate(third_base as usize);
    assert_eq!(log.segment_count(), 3);
    check(&log, &model, 0).await;
    fill(&log, &mut model, 2, 3, 1000).await;
    log.close().await.unwrap();
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    check(&log, &model, 0).await;
    // Down to nothing: the base stays, and the log is empty.
    log.truncate_from(0).await.unwrap();
    assert_eq!((log.base_offset(), log.next_offset()), (0, 0));
    assert_eq!(log.last_batch(), None);
    assert_eq!(bases(&fx), [0]);
    log.close().await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert_eq!(report.next_offset, 0);
    log.close().await.unwrap();
}

async fn truncation_is_refused_inside_a_batch_and_out_of_range<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let mut model = Vec::new();
    let starts = fill(&log, &mut model, 0, 10, 100).await;
    // Batch 2 holds three records: starts[2], +1, +2.
    assert_eq!(starts[3] - starts[2], 3);
    for inside in [starts[2] + 1, starts[2] + 2] {
        assert!(
            matches!(log.truncate_from(inside).await, Err(StorageError::NotBatchBoundary { offset }) if offset == inside)
        );
    }
    let next = log.next_offset();
    assert!(matches!(
        log.truncate_from(next + 1).await,
        Err(StorageError::OutOfRange { offset, low: 0, high }) if offset == next + 1 && high == next
    ));
    // At the next offset: nothing to do.
    log.truncate_from(next).await.unwrap();
    assert_eq!(log.stats().cuts, 0);
    check(&log, &model, 0).await;
    // Nothing changed, and the log still takes appends where it was.
    fill(&log, &mut model, 0, 2, 100).await;
    check(&log, &model, 0).await;
    log.close().await.unwrap();
    assert!(matches!(
        log.truncate_from(0).await,
        Err(StorageError::Closed)
    ));
}

async fn truncation_below_the_retained_base_is_refused<F: Fixture>(fx: F) {
    let cfg = LogConfig {
        retention_bytes: Some(100 * 1024),
        ..small_segments()
    };
    let (log, _) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
    let mut model = Vec::new();
    fill(&log, &mut model, 0, 200, 1000).await;
    assert!(log.enforce_retention(0).await.unwrap() > 0);
    let base = log.base_offset();
    assert!(matches!(
        log.truncate_from(base - 1).await,
        Err(StorageError::OutOfRange { low, .. }) if low == base
    ));
    log.truncate_from(base).await.unwrap();
    assert_eq!((log.base_offset(), log.next_offset()), (base, base));
    log.close().await.unwrap();
}

async fn begin_append_at_refuses_a_wrong_offset_and_changes_nothing<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let mut model = Vec::new();
    fill(&log, &mut model, 0, 3, 50).await;
    let next = log.next_offset();
    let stats = log.stats();
    for wrong in [0, next - 1, next + 1, u64::MAX] {
        let r = log.begin_append_at(wrong, &[b"x"], 0, BatchKind::Data);
        assert!(
            matches!(r, Err(StorageError::NotAtTail { expected, found }) if expected == next && found == wrong),
            "{r:?}"
        );
    }
    assert_eq!(log.next_offset(), next);
    assert_eq!(log.stats(), stats);
    let p = log
        .begin_append_at(next, &[rec(0, next, 50)], 9, BatchKind::Data)
        .unwrap();
    let a = log.commit(p).await.unwrap();
    assert_eq!((a.first, a.end), (next, next + 1));
    model.push(rec(0, next, 50));
    check(&log, &model, 0).await;
    log.close().await.unwrap();
}

async fn a_follower_stores_generation_start_batches_as_shipped<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(log.last_batch(), None);
    let gen7 = 7u64.to_be_bytes();
    log.commit(
        log.begin_append_at(0, &[gen7], 111, BatchKind::GenerationStart)
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(log.last_batch(), Some((0, BatchKind::GenerationStart)));
    log.commit(
        log.begin_append_at(1, &[b"a".as_slice(), b"b"], 112, BatchKind::Data)
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(log.last_batch(), Some((1, BatchKind::Data)));
    // A generation start is one 8-byte record.
    for bad in [vec![vec![0u8; 7]], vec![vec![0u8; 8], vec![0u8; 8]]] {
        assert!(matches!(
            log.begin_append_at(3, &bad, 0, BatchKind::GenerationStart),
            Err(StorageError::InvalidBatch(_))
        ));
    }
    let gen9 = 9u64.to_be_bytes();
    log.commit(
        log.begin_append_at(3, &[gen9], 113, BatchKind::GenerationStart)
            .unwrap(),
    )
    .await
    .unwrap();
    let batches = log.read(0, 1 << 20).await.unwrap();
    let kinds: Vec<_> = batches.iter().map(|b| (b.base_offset, b.kind)).collect();
    assert_eq!(
        kinds,
        [
            (0, BatchKind::GenerationStart),
            (1, BatchKind::Data),
            (3, BatchKind::GenerationStart)
        ]
    );
    assert_eq!(batches[0].records[0].as_ref(), gen7);
    assert_eq!(batches[2].timestamp_micros, 113);
    log.close().await.unwrap();
    // The tail is known again after a reopen, from recovery's scan.
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(log.last_batch(), Some((3, BatchKind::GenerationStart)));
    // A new leader's generation cuts the old one's uncommitted suffix.
    log.truncate_from(1).await.unwrap();
    assert_eq!(log.last_batch(), Some((0, BatchKind::GenerationStart)));
    log.close().await.unwrap();
}

async fn reset_empty_at_moves_an_empty_log_durably<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    let mut model = Vec::new();
    fill(&log, &mut model, 0, 3, 10).await;
    assert!(matches!(
        log.reset_empty_at(500).await,
        Err(StorageError::NotEmpty {
            base_offset: 0,
            next_offset: 6
        })
    ));
    log.truncate_from(0).await.unwrap();
    log.reset_empty_at(1000).await.unwrap();
    assert_eq!((log.base_offset(), log.next_offset()), (1000, 1000));
    assert_eq!(log.last_batch(), None);
    let names: Vec<String> = fx
        .names()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .collect();
    assert_eq!(names, ["00000000000000001000.seg"]);
    log.close().await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert_eq!((report.base_offset, report.next_offset), (1000, 1000));
    assert_eq!((log.base_offset(), log.next_offset()), (1000, 1000));
    assert!(matches!(
        log.read(999, 10).await,
        Err(StorageError::Trimmed { oldest: 1000, .. })
    ));
    // Downwards too, and the log then takes appends at its new base.
    log.reset_empty_at(40).await.unwrap();
    let a = log.append(&[b"first"], 0).await.unwrap();
    assert_eq!(a.first, 40);
    log.close().await.unwrap();
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert_eq!((log.base_offset(), log.next_offset()), (40, 41));
    assert_eq!(
        log.read(40, 10).await.unwrap()[0].records[0].as_ref(),
        b"first"
    );
    assert!(matches!(
        log.reset_empty_at(u64::MAX).await,
        Err(StorageError::OutOfRange { .. })
    ));
    log.close().await.unwrap();
}

/// A pending append for records a truncation removed fails; earlier ones succeed; the
/// commit order carries on at the cut.
async fn pending_appends_past_the_cut_fail_and_the_order_carries_on<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let kept = log.begin_append(&[b"kept"], 0, None).unwrap();
    let held = log.begin_append(&[b"held"], 0, None).unwrap();
    let cut = log.begin_append(&[b"cut"], 0, None).unwrap();
    log.truncate_from(2).await.unwrap();
    assert!(matches!(
        log.commit(cut).await,
        Err(StorageError::RemovedByTruncation { from: 2 })
    ));
    // A second cut, below a batch the first one kept, removes that batch too.
    log.truncate_from(1).await.unwrap();
    let held = futures_lite::future::or(log.commit(held), async {
        glommio::timer::sleep(Duration::from_secs(5)).await;
        Err(StorageError::Closed)
    });
    assert!(matches!(
        held.await,
        Err(StorageError::RemovedByTruncation { from: 1 })
    ));
    let next = log.begin_append(&[b"new"], 0, None).unwrap();
    assert_eq!(next.first(), 1);
    assert_eq!(log.commit(kept).await.unwrap().first, 0);
    assert_eq!(log.commit(next).await.unwrap().first, 1);
    let records: Vec<_> = read_all(&log).await.into_iter().map(|(_, r)| r).collect();
    assert_eq!(records, [b"kept".to_vec(), b"new".to_vec()]);
    log.close().await.unwrap();
}

/// While a truncation runs, appends, retention and another truncation are refused with
/// `Busy`; a `sync` begun before it returns; appends are taken again after it.
async fn a_truncation_holds_the_log_until_it_returns<F: Fixture>(fx: F) {
    let cfg = LogConfig {
        fsync: FsyncMode::None,
        ..LogConfig::default()
    };
    let (log, _) = SegmentLog::open(fx.backend().await, cfg).await.unwrap();
    let mut model = Vec::new();
    let starts = fill(&log, &mut model, 0, 20, 100).await;
    let syncing = {
        let log = log.clone();
        glommio::spawn_local(async move { log.sync().await })
    };
    let truncating = {
        let log = log.clone();
        let cut = starts[5];
        glommio::spawn_local(async move { log.truncate_from(cut).await })
    };
    let mut saw_busy = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !saw_busy && std::time::Instant::now() < deadline {
        futures_lite::future::yield_now().await;
        saw_busy = matches!(log.begin_append(&[b"x"], 0, None), Err(StorageError::Busy));
        if saw_busy {
            assert!(matches!(
                log.enforce_retention_with(0, Some(1), None).await,
                Err(StorageError::Busy)
            ));
            assert!(matches!(
                log.truncate_from(0).await,
                Err(StorageError::Busy)
            ));
        }
    }
    assert!(saw_busy, "the truncation never held the log");
    truncating.await.unwrap();
    model.truncate(starts[5] as usize);
    let synced = futures_lite::future::or(syncing, async {
        glommio::timer::sleep(Duration::from_secs(10)).await;
        Err(StorageError::Closed)
    })
    .await;
    synced.expect("a sync begun before a truncation returns after it");
    fill(&log, &mut model, 1, 2, 100).await;
    check(&log, &model, 0).await;
    log.close().await.unwrap();
}

/// The intent file a truncation or reset writes at its commit point (`log/cut.rs`):
/// `FXIT`, version 1, kind (1 truncate, 2 reset), a zero byte, the offset, CRC32C.
fn intent_bytes(kind: u8, offset: u64) -> Vec<u8> {
    let mut b = b"FXIT".to_vec();
    b.extend_from_slice(&1u16.to_be_bytes());
    b.extend_from_slice(&[kind, 0]);
    b.extend_from_slice(&offset.to_be_bytes());
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_be_bytes());
    b
}

/// A crash just after the commit point leaves the intent and the old files: the next
/// open finishes the change (and a read-only open refuses to guess).
async fn an_interrupted_truncation_or_reset_is_finished_at_open<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    let mut model = Vec::new();
    let starts = fill(&log, &mut model, 0, 150, 1000).await;
    log.close().await.unwrap();
    let segments = |fx: &F| fx.names().iter().filter(|n| n.ends_with(".seg")).count();
    let before = segments(&fx);
    let cut = starts[40];
    fx.write("LOG-INTENT", &intent_bytes(1, cut));
    let read_only = LogConfig {
        read_only: true,
        ..small_segments()
    };
    assert!(matches!(
        SegmentLog::open(fx.backend().await, read_only).await,
        Err(StorageError::Config(_))
    ));
    let (log, report) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert!(report.finished_intent, "{report:?}");
    model.truncate(cut as usize);
    check(&log, &model, 0).await;
    assert!(segments(&fx) < before);
    assert!(!fx.names().contains(&"LOG-INTENT".to_owned()));
    fill(&log, &mut model, 1, 10, 1000).await;
    log.truncate_from(0).await.unwrap();
    log.close().await.unwrap();
    // A reset, interrupted after the old segment went and before the new one existed.
    fx.remove("00000000000000000000.seg");
    fx.write("LOG-INTENT", &intent_bytes(2, 321));
    let (log, report) = SegmentLog::open(fx.backend().await, small_segments())
        .await
        .unwrap();
    assert!(report.finished_intent);
    assert_eq!((log.base_offset(), log.next_offset()), (321, 321));
    log.close().await.unwrap();
    // A damaged intent is refused, not guessed at.
    fx.write("LOG-INTENT", b"FXIT garbage");
    assert!(matches!(
        SegmentLog::open(fx.backend().await, small_segments()).await,
        Err(StorageError::Corrupt(_))
    ));
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
    truncate_then_append_reuses_offsets_and_reads_only_new_records,
    truncate_across_segments_removes_later_segments,
    truncation_is_refused_inside_a_batch_and_out_of_range,
    truncation_below_the_retained_base_is_refused,
    begin_append_at_refuses_a_wrong_offset_and_changes_nothing,
    a_follower_stores_generation_start_batches_as_shipped,
    reset_empty_at_moves_an_empty_log_durably,
    pending_appends_past_the_cut_fail_and_the_order_carries_on,
    a_truncation_holds_the_log_until_it_returns,
    an_interrupted_truncation_or_reset_is_finished_at_open,
);

// ---- Crashes: memory backend only ----

/// What a reopen after a crash holds, as records from offset 0.
async fn recovered(mem: &MemBackend, cfg: &LogConfig) -> Vec<Vec<u8>> {
    let (log, _) = SegmentLog::open(mem.crash(), cfg.clone())
        .await
        .expect("recovery succeeds after a crash");
    let records = read_all(&log).await.into_iter().map(|(_, r)| r).collect();
    log.close().await.unwrap();
    records
}

#[test]
fn a_crash_right_after_a_truncation_recovers_the_truncated_log() {
    run(|| async {
        let mem = MemBackend::new();
        let cfg = small_segments();
        let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
        let mut model = Vec::new();
        let starts = fill(&log, &mut model, 0, 150, 1000).await;
        log.truncate_from(starts[30]).await.unwrap();
        model.truncate(starts[30] as usize);
        assert_eq!(recovered(&mem, &cfg).await, model);
        log.close().await.unwrap();
    });
}

#[test]
fn a_crash_after_truncate_and_unsynced_appends_never_mixes_old_after_new() {
    run(|| async {
        for (seed, cut_batch) in [(0u8, 3usize), (1, 40), (2, 57), (3, 100)] {
            let mem = MemBackend::new();
            let cfg = LogConfig {
                fsync: FsyncMode::None,
                ..small_segments()
            };
            let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
            let mut model = Vec::new();
            let starts = fill(&log, &mut model, 0, 150, 1000).await;
            log.sync().await.unwrap();
            let old = model.clone();
            let cut = starts[cut_batch];
            log.truncate_from(cut).await.unwrap();
            model.truncate(cut as usize);
            // New records, shorter than the removed ones, never fsynced.
            fill(&log, &mut model, 1 + seed, 20, 300).await;
            let got = recovered(&mem, &cfg).await;
            assert!(
                got.len() >= cut as usize,
                "the cut is durable: {}",
                got.len()
            );
            for (o, r) in got.iter().enumerate() {
                let want = if o < cut as usize { &old[o] } else { &model[o] };
                assert_eq!(r, want, "cut {cut}: record at {o} is neither kept nor new");
            }
            log.close().await.unwrap();
        }
    });
}

/// A fault at each I/O step of a truncation, then a crash: the reopened log is the old
/// one or the truncated one, and the live log is poisoned or truncated.
#[test]
fn a_fault_and_crash_at_any_step_of_a_truncation_leaves_the_old_or_the_new_log() {
    run(|| async {
        let ops = [
            MemOp::Write,
            MemOp::Sync,
            MemOp::Truncate,
            MemOp::SyncDir,
            MemOp::Rename,
        ];
        let mut outcomes = [0usize; 2];
        for op in ops {
            for skip in 0..4 {
                let mem = MemBackend::new();
                let cfg = small_segments();
                let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
                let mut model = Vec::new();
                let starts = fill(&log, &mut model, 0, 150, 1000).await;
                let old = model.clone();
                let cut = starts[45];
                model.truncate(cut as usize);
                mem.fail_with(op, libc::EIO, skip, FaultTimes::Once);
                let result = log.truncate_from(cut).await;
                mem.clear_faults();
                let got = recovered(&mem, &cfg).await;
                let case = format!("{op:?} after {skip}: {result:?}");
                if result.is_ok() {
                    assert_eq!(got, model, "{case}");
                    continue;
                }
                assert!(got == old || got == model, "{case}: {} records", got.len());
                outcomes[usize::from(got == model)] += 1;
                if got == model {
                    // Past the commit point, the live log refuses everything.
                    assert!(log.poisoned().is_some(), "{case}");
                    assert!(log.begin_append(&[b"x"], 0, None).is_err());
                }
            }
        }
        assert!(
            outcomes[0] > 0 && outcomes[1] > 0,
            "faults landed both before and after the commit point: {outcomes:?}"
        );
    });
}

#[test]
fn a_crash_during_a_reset_leaves_the_old_or_the_new_base() {
    run(|| async {
        for op in [
            MemOp::Write,
            MemOp::Sync,
            MemOp::SyncDir,
            MemOp::Rename,
            MemOp::Truncate,
        ] {
            for skip in 0..4 {
                let mem = MemBackend::new();
                let cfg = LogConfig::default();
                let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
                log.reset_empty_at(10).await.unwrap();
                mem.fail_with(op, libc::EIO, skip, FaultTimes::Once);
                let result = log.reset_empty_at(77).await;
                mem.clear_faults();
                let (log2, _) = SegmentLog::open(mem.crash(), cfg.clone())
                    .await
                    .expect("recovery succeeds");
                let base = (log2.base_offset(), log2.next_offset());
                assert!(
                    base == (10, 10) || base == (77, 77),
                    "{op:?} after {skip}: {result:?} -> {base:?}"
                );
                if result.is_ok() {
                    assert_eq!(base, (77, 77));
                }
                log2.close().await.unwrap();
            }
        }
    });
}
