//! Fault injection on the in-memory backend: what the disk does wrong, and what the log
//! must do about it. Every test checks the one invariant that matters: after a crash and
//! recovery, every acknowledged record is present and intact, and nothing is invented.

mod common;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use common::{payload, run};
use felix_storage_uring::{
    FaultTimes, FsyncMode, LogConfig, MemBackend, MemOp, SegmentLog, StorageError,
};
use rand::{RngExt, SeedableRng};

fn cfg() -> LogConfig {
    LogConfig {
        segment_bytes_max: 32 * 1024,
        index_interval_bytes: 512,
        ..LogConfig::default()
    }
}

/// Reads everything and checks contiguity and that each record is the payload its
/// offset implies. Returns the end offset.
async fn verify_log(log: &SegmentLog<MemBackend>, len: usize) -> u64 {
    let mut at = log.base_offset();
    loop {
        let batches = log.read(at, 1 << 20).await.unwrap();
        if batches.is_empty() {
            return at;
        }
        for b in batches {
            assert_eq!(b.base_offset, at, "contiguous");
            for (i, r) in b.records.iter().enumerate() {
                let o = b.base_offset + i as u64;
                assert_eq!(
                    r.to_vec(),
                    payload(o, len),
                    "record {o} is what was appended there"
                );
            }
            at = b.end_offset();
        }
    }
}

#[test]
fn a_failed_fsync_poisons_the_log_until_restart() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        for o in 0..5 {
            log.append(&[payload(o, 50)], 0).await.unwrap();
        }
        mem.fail_next_sync();
        let err = log.append(&[payload(5, 50)], 0).await.unwrap_err();
        assert!(
            matches!(err, StorageError::Poisoned { op: "fsync", .. }),
            "{err}"
        );
        // Nothing is acknowledged after it: not even a write that would now succeed.
        assert!(matches!(
            log.begin_append(&[payload(6, 50)], 0, None),
            Err(StorageError::Poisoned { .. })
        ));
        assert_eq!(log.committed_end(), 5);
        assert!(log.poisoned().is_some());
        // Restart: recovery decides what reached the disk; acked records are all there.
        let after = mem.crash();
        let (log, report) = SegmentLog::open(after, cfg()).await.unwrap();
        assert_eq!(report.next_offset, 5);
        assert_eq!(verify_log(&log, 50).await, 5);
        log.append(&[payload(5, 50)], 0).await.unwrap();
    });
}

#[test]
fn a_failed_write_poisons_and_acknowledges_nothing_after_it() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        log.append(&[payload(0, 50)], 0).await.unwrap();
        mem.fail_next_write();
        let a = log.begin_append(&[payload(1, 50)], 0, None).unwrap();
        let b = log.begin_append(&[payload(2, 50)], 0, None).unwrap();
        assert!(matches!(
            log.commit(a).await,
            Err(StorageError::Poisoned { op: "write", .. })
        ));
        assert!(matches!(
            log.commit(b).await,
            Err(StorageError::Poisoned { .. })
        ));
        let (log, report) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(report.next_offset, 1);
        assert_eq!(verify_log(&log, 50).await, 1);
    });
}

#[test]
fn a_torn_write_is_repaired_on_restart() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        for o in 0..10 {
            log.append(&[payload(o, 200)], 0).await.unwrap();
        }
        // The block being rewritten holds the tail of offset 9 and the new batch; a
        // power cut lands only part of it. The old bytes in the block are rewritten
        // identically, so what was acknowledged survives any prefix.
        for keep in [0usize, 1, 100, 2000, 4095] {
            let mem2 = MemBackend::new();
            let (l, _) = SegmentLog::open(mem2.clone(), cfg()).await.unwrap();
            for o in 0..10 {
                l.append(&[payload(o, 200)], 0).await.unwrap();
            }
            mem2.tear_next_write(keep);
            assert!(l.append(&[payload(10, 200)], 0).await.is_err());
            let (l, report) = SegmentLog::open(mem2.crash(), cfg()).await.unwrap();
            // The unacknowledged batch survives only if all of it landed.
            assert!(
                (10..=11).contains(&report.next_offset),
                "keep {keep}: {report:?}"
            );
            assert_eq!(verify_log(&l, 200).await, report.next_offset);
            if keep < 11 * 260 {
                assert_eq!(
                    report.next_offset, 10,
                    "keep {keep}: a partial batch is cut"
                );
            }
        }
        drop(log);
    });
}

#[test]
fn a_crash_loses_only_what_was_not_fsynced() {
    run(|| async {
        // OnCommit: every acknowledged record survives.
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        for o in 0..50 {
            log.append(&[payload(o, 100)], 0).await.unwrap();
        }
        let (log2, _) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(verify_log(&log2, 100).await, 50);
        drop(log);

        // None: acks mean "written", and a crash may take them back.
        let mem = MemBackend::new();
        let none = LogConfig {
            fsync: FsyncMode::None,
            ..cfg()
        };
        let (log, _) = SegmentLog::open(mem.clone(), none.clone()).await.unwrap();
        for o in 0..5 {
            log.append(&[payload(o, 100)], 0).await.unwrap();
        }
        let (log2, report) = SegmentLog::open(mem.crash(), none).await.unwrap();
        assert!(
            report.next_offset < 5,
            "unsynced writes do not survive: {report:?}"
        );
        verify_log(&log2, 100).await;
        drop(log);
    });
}

/// Random appends from many tasks, random faults, random crashes: after every crash the
/// recovered log holds every acknowledged record and only records that were appended.
#[test]
fn random_faults_and_crashes_never_lose_an_acknowledged_record() {
    run(|| async {
        let seed = std::env::var("FELIX_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| rand::rng().random::<u64>());
        eprintln!("FELIX_FAULT_SEED={seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut mem = MemBackend::new();
        let mut acked_end = 0u64;
        for round in 0..40 {
            let (log, report) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
            assert!(
                report.next_offset >= acked_end,
                "round {round}: recovered end {} below acked {acked_end}",
                report.next_offset
            );
            let end = verify_log(&log, 64).await;
            assert!(end >= acked_end);
            let acked = Rc::new(RefCell::new(BTreeMap::new()));
            let mut tasks = Vec::new();
            for _ in 0..rng.random_range(1..16) {
                let log = log.clone();
                let acked = acked.clone();
                let n = rng.random_range(1..6u64);
                tasks.push(glommio::spawn_local(async move {
                    for _ in 0..n {
                        let o = log.next_offset();
                        let Ok(p) = log.begin_append(&[payload(o, 64)], 0, None) else {
                            return;
                        };
                        match log.commit(p).await {
                            Ok(a) => {
                                acked.borrow_mut().insert(a.first, a.end);
                            }
                            // Rolled back: the offsets are reused by the next append.
                            Err(StorageError::NoSpace { .. }) => {}
                            Err(_) => return,
                        }
                    }
                }));
            }
            match rng.random_range(0..7) {
                0 => mem.fail_next_sync(),
                1 => mem.fail_next_write(),
                2 => mem.tear_next_write(rng.random_range(0..8192)),
                3 => mem.fail_next_write_with(libc::ENOSPC),
                4 => mem.tear_next_write_with(rng.random_range(0..8192), libc::ENOSPC),
                5 => mem.fail_with(MemOp::Allocate, libc::EDQUOT, 0, FaultTimes::Once),
                _ => {}
            }
            for t in tasks {
                t.await;
            }
            acked_end = acked_end.max(acked.borrow().values().copied().max().unwrap_or(0));
            drop(log);
            mem = mem.crash();
        }
        let (log, _) = SegmentLog::open(mem, cfg()).await.unwrap();
        let end = verify_log(&log, 64).await;
        assert!(end >= acked_end);
        assert!(
            acked_end > 40,
            "the workload acknowledged records: {acked_end}"
        );
        eprintln!(
            "acked {acked_end}, recovered {end}, segments {}",
            log.segment_count()
        );
    });
}
