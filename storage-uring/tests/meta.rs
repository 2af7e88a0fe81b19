//! Small durable files beside the log (replication state): `write_meta` replaces one
//! atomically and durably, `read_meta` reads it, recovery ignores them and any leftover
//! temporary. Round trips run on both backends; crashes at each step need the memory
//! backend.

mod common;

use common::{Disk, Fixture, Mem, run};
use felix_storage_uring::{FaultTimes, LogConfig, MemBackend, MemOp, SegmentLog, StorageError};

async fn meta_round_trips_and_survives_reopen<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(log.read_meta("replication").await.unwrap(), None);
    log.write_meta("replication", b"generation 3, leader 7")
        .await
        .unwrap();
    log.write_meta("commit-mark", &42u64.to_be_bytes())
        .await
        .unwrap();
    // A shorter replacement leaves nothing of the longer one behind.
    log.write_meta("replication", b"gen 4").await.unwrap();
    assert_eq!(
        log.read_meta("replication").await.unwrap().as_deref(),
        Some(b"gen 4".as_slice())
    );
    log.write_meta("empty", b"").await.unwrap();
    log.append(&[b"a record"], 0).await.unwrap();
    log.close().await.unwrap();
    let (log, report) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(report.next_offset, 1);
    assert_eq!(
        log.read_meta("replication").await.unwrap().as_deref(),
        Some(b"gen 4".as_slice())
    );
    assert_eq!(
        log.read_meta("commit-mark").await.unwrap(),
        Some(42u64.to_be_bytes().to_vec())
    );
    assert_eq!(log.read_meta("empty").await.unwrap(), Some(Vec::new()));
    log.close().await.unwrap();
}

async fn recovery_ignores_meta_files_and_leftover_temporaries<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    log.append(&[b"one"], 0).await.unwrap();
    log.write_meta("vote", b"v1").await.unwrap();
    log.close().await.unwrap();
    // What a crash mid-write leaves: temporaries of a metadata file and of an intent.
    fx.write("vote.tmp", b"half-written garbage");
    fx.write("LOG-INTENT.tmp", b"also garbage");
    let (log, report) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(report.next_offset, 1);
    assert!(!report.finished_intent);
    assert_eq!(log.read_meta("vote").await.unwrap(), Some(b"v1".to_vec()));
    // The next write replaces the leftover temporary.
    log.write_meta("vote", b"v2").await.unwrap();
    assert_eq!(log.read_meta("vote").await.unwrap(), Some(b"v2".to_vec()));
    log.close().await.unwrap();
}

async fn bad_meta_names_are_refused<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    for bad in [
        "",
        "../escape",
        "a/b",
        "..",
        ".hidden",
        "Upper",
        "LOG-INTENT",
        "00000000000000000000.seg",
        "00000000000000000000.idx",
        "x.tmp",
    ] {
        assert!(
            matches!(
                log.write_meta(bad, b"x").await,
                Err(StorageError::BadMetaName { .. })
            ),
            "{bad:?} written"
        );
        assert!(matches!(
            log.read_meta(bad).await,
            Err(StorageError::BadMetaName { .. })
        ));
    }
    log.close().await.unwrap();
    // Nothing was written that a reopen would trip over.
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    log.close().await.unwrap();
}

/// A write in progress when the log starts closing lands before the close returns;
/// one after is refused. Before, a late write (a task of a shard's old owner, after
/// another core had opened the log) replaced what the new owner wrote, unseen by it.
async fn a_closing_log_finishes_a_meta_write_in_progress_and_refuses_later_ones<F: Fixture>(fx: F) {
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    let log = std::rc::Rc::new(log);
    let landed = std::rc::Rc::new(std::cell::Cell::new(false));
    let writing = {
        let (log, landed) = (log.clone(), landed.clone());
        glommio::spawn_local(async move {
            let r = log.write_meta("vote", b"in progress").await;
            landed.set(r.is_ok());
            r
        })
    };
    glommio::yield_if_needed().await;
    futures_lite::future::yield_now().await;
    log.close().await.unwrap();
    assert!(
        landed.get(),
        "the close returned before the write in progress landed"
    );
    writing.await.unwrap();
    assert!(matches!(
        log.write_meta("vote", b"late").await,
        Err(StorageError::Closed)
    ));
    drop(log);
    let (log, _) = SegmentLog::open(fx.backend().await, LogConfig::default())
        .await
        .unwrap();
    assert_eq!(
        log.read_meta("vote").await.unwrap().as_deref(),
        Some(b"in progress".as_slice())
    );
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
    meta_round_trips_and_survives_reopen,
    recovery_ignores_meta_files_and_leftover_temporaries,
    bad_meta_names_are_refused,
    a_closing_log_finishes_a_meta_write_in_progress_and_refuses_later_ones,
);

/// A fault at each step of a replacement, then a crash: the reopened file is the old or
/// the new contents, never a mix or nothing; after a success, the new.
#[test]
fn a_crash_during_write_meta_keeps_the_old_or_the_new_contents() {
    run(|| async {
        let old = b"generation 1; voted for 3".to_vec();
        let new = b"generation 2".to_vec();
        let mut outcomes = [0usize; 2];
        for op in [MemOp::Write, MemOp::Sync, MemOp::Rename, MemOp::SyncDir] {
            for fail in [false, true] {
                let mem = MemBackend::new();
                let (log, _) = SegmentLog::open(mem.clone(), LogConfig::default())
                    .await
                    .unwrap();
                log.write_meta("state", &old).await.unwrap();
                if fail {
                    mem.fail_with(op, libc::EIO, 0, FaultTimes::Once);
                }
                let result = log.write_meta("state", &new).await;
                assert_eq!(result.is_ok(), !fail, "{op:?}: {result:?}");
                mem.clear_faults();
                let (after, _) = SegmentLog::open(mem.crash(), LogConfig::default())
                    .await
                    .expect("recovery ignores metadata files");
                let got = after.read_meta("state").await.unwrap().expect("a file");
                assert!(got == old || got == new, "{op:?}: {got:?}");
                if result.is_ok() {
                    assert_eq!(got, new, "{op:?}");
                } else {
                    outcomes[usize::from(got == new)] += 1;
                }
                after.close().await.unwrap();
            }
        }
        assert!(outcomes[0] > 0, "{outcomes:?}");
    });
}

/// The memory backend models a rename as a directory change: a crash before the
/// directory is synced keeps the old name's file.
#[test]
fn a_rename_is_durable_only_after_a_directory_sync() {
    run(|| async {
        use felix_storage_uring::io::Backend;
        let mem = MemBackend::new();
        mem.write_synced("a", b"old").await.unwrap();
        mem.sync_dir().await.unwrap();
        mem.write_synced("a.tmp", b"new").await.unwrap();
        mem.rename("a.tmp", "a").await.unwrap();
        assert_eq!(mem.read_small("a").await.unwrap(), Some(b"new".to_vec()));
        assert_eq!(
            mem.crash().read_small("a").await.unwrap(),
            Some(b"old".to_vec())
        );
        mem.sync_dir().await.unwrap();
        let crashed = mem.crash();
        assert_eq!(
            crashed.read_small("a").await.unwrap(),
            Some(b"new".to_vec())
        );
        assert_eq!(crashed.read_small("a.tmp").await.unwrap(), None);
        // A removal, too, waits for the directory sync.
        mem.remove("a").await.unwrap();
        assert_eq!(
            mem.crash().read_small("a").await.unwrap(),
            Some(b"new".to_vec())
        );
        mem.sync_dir().await.unwrap();
        assert_eq!(mem.crash().read_small("a").await.unwrap(), None);
    });
}

/// Whether the log in `mem` holds an unsynced life's mark.
async fn marked(mem: &MemBackend) -> bool {
    use felix_storage_uring::io::Backend;
    mem.read_small("unsynced-life").await.unwrap().is_some()
}

/// A `none` or `periodic` life opens only once its mark (`unsynced-life`) is durable,
/// and an `on-commit` life only once a mark left by one is gone: without the mark, a
/// power cut of such a life was recovered with the strict reach (damage more than a
/// round from the end refused as interior, the shard out of service), and with a mark
/// left over, an `on-commit` life's recovery would cut what it should refuse. The open
/// made its mark best effort and went on.
#[test]
fn a_log_opens_only_once_its_life_is_marked_as_its_fsync_mode_needs() {
    run(|| async {
        use felix_storage_uring::FsyncMode;
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), LogConfig::default())
            .await
            .unwrap();
        log.close().await.unwrap();
        let unsynced = LogConfig {
            fsync: FsyncMode::None,
            ..LogConfig::default()
        };
        // A full device or quota: it opens unmarked rather than stay closed.
        mem.fail_with(MemOp::Write, libc::ENOSPC, 0, FaultTimes::Once);
        let (log, _) = SegmentLog::open(mem.clone(), unsynced.clone())
            .await
            .expect("opens on a full disk");
        assert!(!marked(&mem).await, "no room for the mark");
        log.close().await.unwrap();
        mem.clear_faults();
        for op in [MemOp::Write, MemOp::SyncDir] {
            mem.fail_with(op, libc::EMFILE, 0, FaultTimes::Once);
            let refused = SegmentLog::open(mem.clone(), unsynced.clone()).await;
            assert!(refused.is_err(), "{op:?}: opened unmarked");
            mem.clear_faults();
        }
        let (log, _) = SegmentLog::open(mem.clone(), unsynced).await.unwrap();
        // The power cut ends that life with its mark in place.
        let crashed = mem.crash();
        assert!(marked(&crashed).await, "marked durably");
        drop(log);
        crashed.fail_with(MemOp::Remove, libc::EMFILE, 0, FaultTimes::Once);
        let refused = SegmentLog::open(crashed.clone(), LogConfig::default()).await;
        assert!(
            refused.is_err(),
            "an on-commit life opened with the mark left"
        );
        crashed.clear_faults();
        let (log, _) = SegmentLog::open(crashed.clone(), LogConfig::default())
            .await
            .unwrap();
        assert!(!marked(&crashed.crash()).await, "the mark is gone durably");
        log.close().await.unwrap();
    });
}

/// An `on-commit` life whose open could not remove an unsynced life's mark (a full
/// device) removes it once retention frees space, or else at its close: it kept it for
/// its whole life (until 2026-12-08), so the open after a clean close read the log as
/// after an unsynced life (a replica then leads none of its old generations), and a
/// crash of the life was recovered leniently, cutting acknowledged records at damage
/// it should refuse.
#[test]
fn an_on_commit_life_removes_a_mark_its_full_disk_kept_once_it_can() {
    run(|| async {
        use felix_storage_uring::FsyncMode;
        let small = LogConfig {
            segment_bytes_max: 64 * 1024,
            index_interval_bytes: 1024,
            ..LogConfig::default()
        };
        let unsynced = LogConfig {
            fsync: FsyncMode::None,
            ..small.clone()
        };
        let retained = LogConfig {
            retention_bytes: Some(128 * 1024),
            ..small
        };
        for by_retention in [false, true] {
            let mem = MemBackend::new();
            let (log, _) = SegmentLog::open(mem.clone(), retained.clone())
                .await
                .unwrap();
            for _ in 0..400 {
                log.append(&[vec![7u8; 1000]], 0).await.unwrap();
            }
            log.close().await.unwrap();
            // An unsynced life that a power cut ends.
            let (log, _) = SegmentLog::open(mem.clone(), unsynced.clone())
                .await
                .unwrap();
            let crashed = mem.crash();
            drop(log);
            crashed.fail_with(MemOp::Remove, libc::ENOSPC, 0, FaultTimes::Once);
            let (log, report) = SegmentLog::open(crashed.clone(), retained.clone())
                .await
                .expect("opens on a full disk");
            assert!(report.unsynced_life);
            assert!(marked(&crashed).await, "no room to remove it");
            crashed.clear_faults();
            if by_retention {
                assert!(log.enforce_retention(u64::MAX / 2).await.unwrap() > 0);
                assert!(
                    !marked(&crashed.crash()).await,
                    "removed durably once retention freed space"
                );
            }
            log.close().await.unwrap();
            assert!(
                !marked(&crashed).await,
                "by_retention {by_retention}: left after the close"
            );
            let (log, report) = SegmentLog::open(crashed.clone(), retained.clone())
                .await
                .unwrap();
            assert!(!report.unsynced_life, "the last life closed on-commit");
            log.close().await.unwrap();
        }
    });
}

/// An open says whether the life before it ran under `none` or `periodic` and ended
/// without its close: a replica then may have lost records it acknowledged, and must
/// not lead its old generation again (`replication::machine`).
#[test]
fn an_open_says_whether_an_unsynced_life_ended_without_its_close() {
    run(|| async {
        use felix_storage_uring::FsyncMode;
        let unsynced = LogConfig {
            fsync: FsyncMode::None,
            ..LogConfig::default()
        };
        let mem = MemBackend::new();
        let (log, report) = SegmentLog::open(mem.clone(), unsynced.clone())
            .await
            .unwrap();
        assert!(!report.unsynced_life && !log.opened_after_unsynced_life());
        log.close().await.unwrap();
        let (log, report) = SegmentLog::open(mem.clone(), unsynced.clone())
            .await
            .unwrap();
        assert!(!report.unsynced_life, "the last life closed");
        let crashed = mem.crash();
        drop(log);
        let (log, report) = SegmentLog::open(crashed.clone(), LogConfig::default())
            .await
            .unwrap();
        assert!(report.unsynced_life && log.opened_after_unsynced_life());
        // Once its owner recorded it, an owner made again over the open log does not
        // take it for a crash of its own.
        log.unsynced_life_recorded();
        assert!(!log.opened_after_unsynced_life());
        // An on-commit life that ends the same way leaves nothing to say.
        let crashed = crashed.crash();
        drop(log);
        let (log, report) = SegmentLog::open(crashed, LogConfig::default())
            .await
            .unwrap();
        assert!(!report.unsynced_life && !log.opened_after_unsynced_life());
        log.close().await.unwrap();
    });
}
