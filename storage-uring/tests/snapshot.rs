//! Snapshots of derived state beside the log (step 8): handed back as saved, and never
//! once the records below their offset may have been replaced: removed by a truncation
//! past them or a reset before appends resume, by an open when a crash took the tail
//! they describe, and by either after a crash in the middle.

mod common;

use common::run;
use felix_storage_uring::io::Backend;
use felix_storage_uring::{
    FaultTimes, FsyncMode, LogConfig, MemBackend, MemOp, SegmentLog, StorageError,
};

fn small_segments() -> LogConfig {
    LogConfig {
        segment_bytes_max: 64 * 1024,
        index_interval_bytes: 1024,
        ..LogConfig::default()
    }
}

/// Appends `batches` batches of two 500-byte records tagged `round`; returns each
/// batch's first offset.
async fn fill<B: Backend>(log: &SegmentLog<B>, round: u8, batches: usize) -> Vec<u64> {
    let mut starts = Vec::new();
    for _ in 0..batches {
        let recs = [vec![round; 500], vec![round; 500]];
        let p = log.begin_append(&recs, 0, None).unwrap();
        starts.push(p.first());
        log.commit(p).await.unwrap();
    }
    starts
}

async fn snapshot<B: Backend>(log: &SegmentLog<B>) -> Option<(u64, Vec<u8>)> {
    log.load_snapshot("state").await.unwrap()
}

#[test]
fn a_snapshot_is_handed_back_as_saved_across_a_reopen_and_only_within_the_log() {
    run(|| async {
        let mem = MemBackend::new();
        let cfg = small_segments();
        let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
        assert_eq!(snapshot(&log).await, None);
        fill(&log, 0, 100).await;
        let end = log.committed_end();
        log.save_snapshot("state", end - 2, b"first").await.unwrap();
        log.save_snapshot("state", end, b"second").await.unwrap();
        assert_eq!(snapshot(&log).await, Some((end, b"second".to_vec())));
        // Only state the log acknowledged, and not below its base.
        assert!(matches!(
            log.save_snapshot("state", end + 1, b"x").await,
            Err(StorageError::OutOfRange { .. })
        ));
        // Plain metadata may not take a snapshot's name.
        assert!(matches!(
            log.write_meta("state.snap", b"x").await,
            Err(StorageError::BadMetaName { .. })
        ));
        log.close().await.unwrap();
        let (log, _) = SegmentLog::open(mem.crash(), cfg).await.unwrap();
        assert_eq!(snapshot(&log).await, Some((end, b"second".to_vec())));
        log.close().await.unwrap();
    });
}

#[test]
fn a_snapshot_retention_left_below_the_base_is_not_handed_back() {
    run(|| async {
        let (log, _) = SegmentLog::open(MemBackend::new(), small_segments())
            .await
            .unwrap();
        let starts = fill(&log, 0, 40).await;
        log.save_snapshot("state", starts[20], b"early")
            .await
            .unwrap();
        fill(&log, 0, 160).await;
        let removed = log
            .enforce_retention_below(0, Some(100_000), None, u64::MAX)
            .await
            .unwrap();
        assert!(removed > 0 && log.base_offset() > starts[20], "{removed}");
        assert_eq!(snapshot(&log).await, None);
        log.close().await.unwrap();
    });
}

#[test]
fn a_truncation_below_a_snapshot_removes_it_durably_before_appends_resume() {
    run(|| async {
        let mem = MemBackend::new();
        let cfg = small_segments();
        let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
        let starts = fill(&log, 0, 100).await;
        let end = log.committed_end();
        log.save_snapshot("state", end, b"old").await.unwrap();
        // A cut at or past the snapshot's offset leaves it.
        log.truncate_from(end).await.unwrap();
        assert_eq!(snapshot(&log).await, Some((end, b"old".to_vec())));
        log.truncate_from(starts[60]).await.unwrap();
        assert_eq!(snapshot(&log).await, None, "stale after the cut");
        // Other records take the offsets it described, then a crash: the removal was
        // durable before they were written.
        fill(&log, 1, 60).await;
        assert!(log.committed_end() > end);
        let (log2, _) = SegmentLog::open(mem.crash(), cfg).await.unwrap();
        assert_eq!(snapshot(&log2).await, None, "came back after the crash");
        log2.close().await.unwrap();
    });
}

/// For each I/O step and each of the first `skips` calls of it: opens a fresh log,
/// runs `setup` on it, fails that call once during `act`, crashes, reopens and hands the
/// reopened log (and its backend) to `check`, which says whether `act` took effect.
/// Asserts the faults landed on both sides of `act`'s commit point.
async fn after_each_fault_and_crash<T>(
    cfg: LogConfig,
    skips: u64,
    setup: impl AsyncFn(&SegmentLog<MemBackend>) -> T,
    act: impl AsyncFn(&SegmentLog<MemBackend>, &T) -> Result<(), StorageError>,
    check: impl AsyncFn(MemBackend, SegmentLog<MemBackend>, &T, &str) -> bool,
) {
    let mut outcomes = [0usize; 2];
    for op in [
        MemOp::Write,
        MemOp::Sync,
        MemOp::Truncate,
        MemOp::SyncDir,
        MemOp::Rename,
    ] {
        for skip in 0..skips {
            let mem = MemBackend::new();
            let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
            let state = setup(&log).await;
            mem.fail_with(op, libc::EIO, skip, FaultTimes::Once);
            let result = act(&log, &state).await;
            mem.clear_faults();
            let case = format!("{op:?} after {skip}: {result:?}");
            let mem2 = mem.crash();
            let (log2, _) = SegmentLog::open(mem2.clone(), cfg.clone())
                .await
                .expect("recovery succeeds");
            let took_effect = check(mem2, log2, &state, &case).await;
            outcomes[usize::from(took_effect)] += 1;
        }
    }
    assert!(
        outcomes[0] > 0 && outcomes[1] > 0,
        "faults landed both before and after the commit point: {outcomes:?}"
    );
}

#[test]
fn a_fault_and_crash_in_a_truncation_never_leave_a_stale_snapshot() {
    run(|| async {
        let cfg = small_segments();
        after_each_fault_and_crash(
            cfg.clone(),
            5,
            async |log| {
                let starts = fill(log, 0, 100).await;
                let end = log.committed_end();
                log.save_snapshot("state", end, b"old").await.unwrap();
                (starts, end)
            },
            async |log, (starts, _)| log.truncate_from(starts[50]).await,
            async |mem, log, (starts, end), case| {
                if log.next_offset() != starts[50] {
                    assert_eq!(log.next_offset(), *end, "{case}");
                    assert_eq!(
                        snapshot(&log).await,
                        Some((*end, b"old".to_vec())),
                        "{case}"
                    );
                    log.close().await.unwrap();
                    return false;
                }
                // The cut log takes other records at the snapshot's offsets.
                fill(&log, 1, 60).await;
                let (log2, _) = SegmentLog::open(mem.crash(), cfg.clone()).await.unwrap();
                assert_eq!(snapshot(&log2).await, None, "{case}: stale snapshot kept");
                log2.close().await.unwrap();
                true
            },
        )
        .await;
    });
}

#[test]
fn an_open_removes_a_snapshot_of_a_tail_a_crash_took() {
    run(|| async {
        let mem = MemBackend::new();
        let cfg = LogConfig {
            fsync: FsyncMode::None,
            ..small_segments()
        };
        let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
        fill(&log, 0, 20).await;
        log.sync().await.unwrap();
        let synced = log.committed_end();
        fill(&log, 0, 20).await;
        // Acknowledged (no fsync asked), not on disk yet.
        let end = log.committed_end();
        log.save_snapshot("state", end, b"ahead").await.unwrap();
        let mem2 = mem.crash();
        let (log2, _) = SegmentLog::open(mem2.clone(), cfg.clone()).await.unwrap();
        assert!(log2.next_offset() < end, "the crash took the tail");
        assert!(log2.next_offset() >= synced);
        assert_eq!(snapshot(&log2).await, None);
        // Other records at its offsets, another crash: it does not come back.
        fill(&log2, 1, 40).await;
        log2.sync().await.unwrap();
        assert!(log2.committed_end() > end);
        let (log3, _) = SegmentLog::open(mem2.crash(), cfg).await.unwrap();
        assert_eq!(snapshot(&log3).await, None);
        log3.close().await.unwrap();
    });
}

#[test]
fn a_reset_removes_every_snapshot_and_an_open_a_damaged_one() {
    run(|| async {
        let mem = MemBackend::new();
        let cfg = LogConfig::default();
        let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
        log.reset_empty_at(10).await.unwrap();
        log.save_snapshot("state", 10, b"at ten").await.unwrap();
        assert_eq!(snapshot(&log).await, Some((10, b"at ten".to_vec())));
        log.reset_empty_at(77).await.unwrap();
        assert_eq!(snapshot(&log).await, None);
        log.close().await.unwrap();
        let mem = mem.crash();
        let (log, _) = SegmentLog::open(mem.clone(), cfg.clone()).await.unwrap();
        assert_eq!(snapshot(&log).await, None, "the removal was durable");
        log.save_snapshot("state", 77, b"whole").await.unwrap();
        log.close().await.unwrap();
        // A byte changed: not handed back, and gone at the next open.
        let mut bytes = mem.contents("state.snap").unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        mem.put_file("state.snap", &bytes);
        let (log, _) = SegmentLog::open(mem.clone(), cfg).await.unwrap();
        assert_eq!(snapshot(&log).await, None);
        assert_eq!(mem.contents("state.snap"), None);
        log.close().await.unwrap();
    });
}

#[test]
fn a_fault_and_crash_in_a_reset_never_leave_a_snapshot_of_the_old_life() {
    run(|| async {
        after_each_fault_and_crash(
            LogConfig::default(),
            4,
            async |log| {
                log.reset_empty_at(10).await.unwrap();
                log.save_snapshot("state", 10, b"old life").await.unwrap();
            },
            async |log, _| log.reset_empty_at(77).await,
            async |mem, log, _, case| {
                let reset = log.base_offset() == 77;
                // Not handed back, and not left on disk either.
                assert_eq!(mem.contents("state.snap").is_some(), !reset, "{case}");
                let want = (!reset).then(|| (10, b"old life".to_vec()));
                assert_eq!(snapshot(&log).await, want, "{case}");
                log.close().await.unwrap();
                reset
            },
        )
        .await;
    });
}

#[test]
fn a_save_racing_a_truncation_leaves_no_snapshot_past_the_cut() {
    run(|| async {
        for save_first in [true, false] {
            let mem = MemBackend::new();
            let (log, _) = SegmentLog::open(mem.clone(), small_segments())
                .await
                .unwrap();
            let starts = fill(&log, 0, 100).await;
            let end = log.committed_end();
            let save = log.save_snapshot("state", end, b"racing");
            let cut = log.truncate_from(starts[50]);
            let (saved, cut) = if save_first {
                futures_lite::future::zip(save, cut).await
            } else {
                let (c, s) = futures_lite::future::zip(cut, save).await;
                (s, c)
            };
            cut.unwrap();
            assert!(
                matches!(saved, Ok(()) | Err(StorageError::Busy)),
                "{saved:?}"
            );
            assert_eq!(snapshot(&log).await, None, "save first: {save_first}");
            log.close().await.unwrap();
        }
    });
}
