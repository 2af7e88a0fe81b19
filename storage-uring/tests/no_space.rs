//! A full disk is not poison. ENOSPC or EDQUOT on a data write, or on any step of
//! creating a segment, fails exactly the batches not yet written with `NoSpace`, gives
//! their offsets back and leaves the log taking writes; a failed fdatasync still poisons.
//! (Under `None` and `Periodic`, which acknowledge at sequencing, the batches not yet
//! written were acknowledged, so there a full disk poisons: the last tests.)
//! The families that the fault seam of the io_uring backend can reach run on both
//! backends; aiming at one step of a roll, tearing and crashing need the memory backend.
//! Every test ends by checking what a reopen (and, on memory, a crash) recovers: the
//! acknowledged records, in order, and no record of a rolled-back batch.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Disk, payload, run};
use felix_storage_uring::io::Backend;
use felix_storage_uring::{
    DmaBackend, FaultTimes, FsyncMode, LogConfig, MemBackend, MemOp, PendingAppend, SegmentLog,
    StorageError, StorageFaults,
};

/// 64 KiB segments: 57 batches of one 1000-byte record fill one (4096-byte header,
/// 1060 bytes a batch), and the 58th rolls.
fn cfg() -> LogConfig {
    LogConfig {
        segment_bytes_max: 64 * 1024,
        index_interval_bytes: 1024,
        ..LogConfig::default()
    }
}

const FILL: u64 = 57;
const BIG: usize = 1000;

/// A backend and a way to make its next write or fdatasync fail with an errno.
#[allow(async_fn_in_trait)]
trait Rig: 'static {
    type B: Backend;
    async fn backend(&self) -> Self::B;
    /// The next data write fails (on disk: data write or fallocate, whichever is first).
    fn fail_next_write_with(&self, errno: i32);
    fn fail_next_sync_with(&self, errno: i32);
    /// Segment file names, sorted.
    fn segments(&self) -> Vec<String>;
}

struct MemRig(MemBackend);

impl Rig for MemRig {
    type B = MemBackend;
    async fn backend(&self) -> MemBackend {
        self.0.clone()
    }
    fn fail_next_write_with(&self, errno: i32) {
        self.0.fail_next_write_with(errno);
    }
    fn fail_next_sync_with(&self, errno: i32) {
        self.0.fail_with(MemOp::Sync, errno, 0, FaultTimes::Once);
    }
    fn segments(&self) -> Vec<String> {
        mem_segments(&self.0)
    }
}

fn mem_segments(mem: &MemBackend) -> Vec<String> {
    let mut names = futures_lite::future::block_on(mem.list()).unwrap();
    names.retain(|n| n.ends_with(".seg"));
    names.sort();
    names
}

struct DiskRig {
    disk: Disk,
    faults: Arc<StorageFaults>,
}

impl DiskRig {
    fn new() -> DiskRig {
        DiskRig {
            disk: Disk::new(),
            faults: StorageFaults::new(),
        }
    }
}

impl Rig for DiskRig {
    type B = DmaBackend;
    async fn backend(&self) -> DmaBackend {
        DmaBackend::open_dir_with_faults(&self.disk.0, Some(self.faults.clone()))
            .await
            .unwrap()
    }
    fn fail_next_write_with(&self, errno: i32) {
        self.faults.fail_writes(errno, FaultTimes::Once);
    }
    fn fail_next_sync_with(&self, errno: i32) {
        self.faults.fail_syncs(errno, FaultTimes::Once);
    }
    fn segments(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.disk.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".seg"))
            .collect();
        names.sort();
        names
    }
}

/// Appends one record per batch, `payload(offset, len)`, committing each, and notes it
/// in `acked`.
async fn append<B: Backend>(log: &SegmentLog<B>, acked: &mut Vec<usize>, len: usize) {
    let o = log.next_offset();
    assert_eq!(
        o,
        acked.len() as u64,
        "offsets follow the acknowledged ones"
    );
    let a = log.append(&[payload(o, len)], 0).await.unwrap();
    assert_eq!((a.first, a.end), (o, o + 1));
    acked.push(len);
}

/// The log holds exactly the acknowledged records: `acked[o]` is the length of the
/// payload at offset `o`.
async fn check<B: Backend>(log: &SegmentLog<B>, acked: &[usize]) {
    let mut at = 0u64;
    loop {
        let batches = log.read(at, 1 << 20).await.unwrap();
        if batches.is_empty() {
            break;
        }
        for b in batches {
            assert_eq!(b.base_offset, at, "contiguous");
            for r in &b.records {
                let len = *acked
                    .get(at as usize)
                    .unwrap_or_else(|| panic!("offset {at} was never acknowledged"));
                assert_eq!(
                    r.to_vec(),
                    payload(at, len),
                    "offset {at} is the acked record"
                );
                at += 1;
            }
        }
    }
    assert_eq!(at, acked.len() as u64, "every acknowledged record is there");
}

fn no_space(r: Result<impl std::fmt::Debug, StorageError>) -> &'static str {
    match r {
        Err(StorageError::NoSpace { op, .. }) => op,
        other => panic!("expected NoSpace, got {other:?}"),
    }
}

/// Polls `done` until it holds; fails after a deadline instead of hanging.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
}

async fn no_space_on_a_data_write_fails_the_unwritten_batches_and_the_log_goes_on<R: Rig>(rig: R) {
    let (log, _) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
    let mut acked = Vec::new();
    for _ in 0..5 {
        append(&log, &mut acked, 100).await;
    }
    rig.fail_next_write_with(libc::ENOSPC);
    let a = log.begin_append(&[payload(5, 300)], 0, None).unwrap();
    let b = log.begin_append(&[payload(6, 300)], 0, None).unwrap();
    assert_eq!(no_space(log.commit(a).await), "write");
    assert_eq!(no_space(log.commit(b).await), "write");
    assert!(log.poisoned().is_none(), "a full disk is not poison");
    assert_eq!(log.no_space_rollbacks(), 1);
    assert_eq!(log.stats().no_space_rollbacks, 1);
    assert_eq!(log.next_offset(), 5, "offsets given back");
    assert_eq!(log.committed_end(), 5);
    check(&log, &acked).await;
    // The next append reuses offset 5 and rewrites the partial block behind offset 4.
    for _ in 0..5 {
        append(&log, &mut acked, 77).await;
    }
    check(&log, &acked).await;
    log.close().await.unwrap();
    let (log, report) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
    assert_eq!(report.next_offset, 10);
    assert_eq!(report.truncated_bytes, 0);
    check(&log, &acked).await;
    log.close().await.unwrap();
}

async fn no_space_while_creating_a_segment_removes_it_and_a_later_roll_succeeds<R: Rig>(rig: R) {
    let (log, _) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
    let mut acked = Vec::new();
    for _ in 0..FILL {
        append(&log, &mut acked, BIG).await;
    }
    assert_eq!(log.segment_count(), 1);
    // The next big batch rolls: memory fails the header write, disk the fallocate.
    rig.fail_next_write_with(libc::ENOSPC);
    no_space(log.append(&[payload(FILL, BIG)], 0).await);
    assert!(log.poisoned().is_none());
    assert_eq!(log.segment_count(), 1);
    assert_eq!(
        rig.segments(),
        vec!["00000000000000000000.seg"],
        "the half-made segment is gone"
    );
    // A batch that fits goes to the old segment, at the reclaimed offset.
    append(&log, &mut acked, 10).await;
    assert_eq!(log.segment_count(), 1);
    // Space is back: the roll happens.
    append(&log, &mut acked, BIG).await;
    assert_eq!(log.segment_count(), 2);
    check(&log, &acked).await;
    log.close().await.unwrap();
    let (log, report) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
    assert_eq!(report.next_offset, FILL + 2);
    check(&log, &acked).await;
    log.close().await.unwrap();
}

async fn a_failed_fsync_still_poisons_whatever_the_errno<R: Rig>(rig: R) {
    let (log, _) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
    let mut acked = Vec::new();
    for _ in 0..3 {
        append(&log, &mut acked, 100).await;
    }
    rig.fail_next_sync_with(libc::EIO);
    let err = log.append(&[payload(3, 100)], 0).await.unwrap_err();
    assert!(
        matches!(err, StorageError::Poisoned { op: "fsync", .. }),
        "{err}"
    );
    assert!(log.poisoned().is_some());
    assert!(matches!(
        log.begin_append(&[payload(3, 100)], 0, None),
        Err(StorageError::Poisoned { .. })
    ));
    assert_eq!(log.no_space_rollbacks(), 0);
    drop(log);

    // ENOSPC from fdatasync too: the kernel may have dropped the dirty pages.
    let (log, _) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
    let next = log.next_offset();
    assert!(next >= 3);
    rig.fail_next_sync_with(libc::ENOSPC);
    let err = log.append(&[payload(next, 100)], 0).await.unwrap_err();
    assert!(
        matches!(err, StorageError::Poisoned { op: "fsync", .. }),
        "{err}"
    );
    assert_eq!(log.no_space_rollbacks(), 0);
}

/// With durable writes (`dsync_writes`) a round has no fdatasync: a fault aimed at
/// syncs fails the write itself, and poisons; a full disk still rolls back, and the log
/// goes on writing durably.
async fn with_durable_writes_a_failed_write_poisons_unless_the_disk_is_full<R: Rig>(rig: R) {
    let durable = LogConfig {
        dsync_writes: true,
        ..cfg()
    };
    let (log, _) = SegmentLog::open(rig.backend().await, durable.clone())
        .await
        .unwrap();
    let mut acked = Vec::new();
    for _ in 0..3 {
        append(&log, &mut acked, 100).await;
    }
    let before = log.stats().dsync_writes;
    assert!(before >= 2, "rounds after the first are durable writes");
    rig.fail_next_write_with(libc::ENOSPC);
    assert_eq!(no_space(log.append(&[payload(3, 300)], 0).await), "write");
    assert!(log.poisoned().is_none(), "a full disk is not poison");
    for _ in 0..3 {
        append(&log, &mut acked, 77).await;
    }
    assert!(log.stats().dsync_writes > before, "still durable writes");
    check(&log, &acked).await;
    rig.fail_next_sync_with(libc::EIO);
    let err = log.append(&[payload(6, 100)], 0).await.unwrap_err();
    assert!(
        matches!(
            err,
            StorageError::Poisoned {
                op: "durable write",
                ..
            }
        ),
        "{err}"
    );
    drop(log);
    let (log, _) = SegmentLog::open(rig.backend().await, durable)
        .await
        .unwrap();
    // The failed write may have landed without being made durable (memory), as a real
    // one may: a record never acknowledged can come back after a restart.
    if log.next_offset() > acked.len() as u64 {
        acked.push(100);
    }
    check(&log, &acked).await;
    log.close().await.unwrap();
}

macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(#[test] fn $name() { run(|| super::$name(MemRig(MemBackend::new()))); })*
        }
        mod disk {
            use super::*;
            $(#[test] fn $name() { run(|| super::$name(DiskRig::new())); })*
        }
    };
}

both_backends!(
    no_space_on_a_data_write_fails_the_unwritten_batches_and_the_log_goes_on,
    no_space_while_creating_a_segment_removes_it_and_a_later_roll_succeeds,
    a_failed_fsync_still_poisons_whatever_the_errno,
    with_durable_writes_a_failed_write_poisons_unless_the_disk_is_full,
);

#[test]
fn after_no_space_a_crash_recovers_only_acknowledged_records() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        for _ in 0..5 {
            append(&log, &mut acked, 100).await;
        }
        mem.fail_next_write_with(libc::EDQUOT);
        no_space(log.append(&[payload(5, 300)], 0).await);
        // Crash right after the rollback: nothing of the failed batch.
        let (after, report) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(report.next_offset, 5);
        check(&after, &acked).await;
        drop(after);
        // The reclaimed offset holds the new batch, durably.
        append(&log, &mut acked, 77).await;
        let (after, report) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(report.next_offset, 6);
        check(&after, &acked).await;
    });
}

#[test]
fn batches_written_earlier_in_the_round_are_acknowledged() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        for _ in 0..FILL {
            append(&log, &mut acked, BIG).await;
        }
        // One round of two chunks: x fits the old segment; y opens a new one, z follows.
        // The round writes x, rolls (header write), then fails writing y and z.
        mem.fail_with(MemOp::Write, libc::ENOSPC, 2, FaultTimes::Once);
        let x = log.begin_append(&[payload(FILL, 10)], 0, None).unwrap();
        let y = log
            .begin_append(&[payload(FILL + 1, BIG)], 0, None)
            .unwrap();
        let z = log
            .begin_append(&[payload(FILL + 2, BIG)], 0, None)
            .unwrap();
        assert_eq!(log.commit(x).await.unwrap().first, FILL);
        acked.push(10);
        no_space(log.commit(y).await);
        no_space(log.commit(z).await);
        assert_eq!(log.next_offset(), FILL + 1);
        assert_eq!(log.segment_count(), 2, "the new segment was made; it stays");
        append(&log, &mut acked, 33).await;
        check(&log, &acked).await;
        let (after, report) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(report.next_offset, FILL + 2);
        check(&after, &acked).await;
    });
}

/// Each step of creating a segment, failed in turn; `skip` passes the old segment's
/// fdatasync, which is a data fdatasync and poisons, and its cut back to its data
/// (best effort: a failure there leaves it longer, nothing more).
#[test]
fn no_space_at_any_step_of_creating_a_segment_is_rolled_back() {
    for (op, skip) in [
        (MemOp::Truncate, 1),
        (MemOp::Allocate, 0),
        (MemOp::Write, 0),
        (MemOp::Sync, 1),
        (MemOp::SyncDir, 0),
    ] {
        run(move || async move {
            let mem = MemBackend::new();
            let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
            let mut acked = Vec::new();
            for _ in 0..FILL {
                append(&log, &mut acked, BIG).await;
            }
            mem.fail_with(op, libc::ENOSPC, skip, FaultTimes::Once);
            let step = no_space(log.append(&[payload(FILL, BIG)], 0).await);
            assert!(log.poisoned().is_none(), "{op:?}");
            assert_eq!(mem_segments(&mem).len(), 1, "{op:?} ({step}): removed");
            // The old segment grows past the failed segment's base...
            append(&log, &mut acked, 10).await;
            append(&log, &mut acked, 10).await;
            log.close().await.unwrap();
            // ...so a leftover file there would break the offset chain on reopen.
            let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
            check(&log, &acked).await;
            append(&log, &mut acked, BIG).await;
            assert_eq!(log.segment_count(), 2, "{op:?}: rolls later");
            let (after, _) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
            check(&after, &acked).await;
        });
    }
}

#[test]
fn a_full_disk_fails_only_the_appends_that_need_a_new_segment_until_space_is_freed() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        for _ in 0..FILL {
            append(&log, &mut acked, BIG).await;
        }
        // No room for a new segment's reservation, for as long as it lasts.
        mem.fail_with(MemOp::Allocate, libc::ENOSPC, 0, FaultTimes::Always);
        for round in 1..=3 {
            assert_eq!(
                no_space(log.append(&[payload(FILL, BIG)], 0).await),
                "fallocate new segment"
            );
            assert_eq!(log.no_space_rollbacks(), round);
            // The old segment still takes what fits.
            append(&log, &mut acked, 10).await;
        }
        assert_eq!(log.segment_count(), 1);
        mem.clear_faults();
        append(&log, &mut acked, BIG).await;
        assert_eq!(log.segment_count(), 2);
        check(&log, &acked).await;
        let (after, _) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        check(&after, &acked).await;
    });
}

#[test]
fn a_partly_landed_no_space_write_is_cut_back_before_its_offsets_are_reused() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        for _ in 0..5 {
            append(&log, &mut acked, 100).await;
        }
        // A 20 KB batch whose first four blocks land before the device fills up.
        mem.tear_next_write_with(4 * 4096, libc::ENOSPC);
        no_space(log.append(&[payload(5, 20_000)], 0).await);
        // A shorter batch takes its offset; what the failed one left past it must go.
        append(&log, &mut acked, 100).await;
        let (after, report) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(report.next_offset, 6);
        check(&after, &acked).await;
        drop(after);
        log.close().await.unwrap();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        check(&log, &acked).await;
    });
}

/// A short write: the block holding the old valid end lands with whole batches of the
/// failing chunk in it, the rest of the write finds the disk full (ext4 does this: the
/// write returns what it wrote, our retry of the rest gets ENOSPC). Those batches were
/// refused, so a crash right after must not bring them back (found by the chaos
/// scenario `filesystem-full`: refused records present after a restart).
#[test]
fn whole_batches_of_a_refused_short_write_do_not_come_back_after_a_crash() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        for _ in 0..5 {
            append(&log, &mut acked, 100).await;
        }
        // One chunk of two batches: the small one ends inside the block holding the
        // valid end and lands whole; the big one runs past it and is cut off.
        mem.tear_next_write_with(4096, libc::ENOSPC);
        let small = log.begin_append(&[payload(5, 100)], 0, None).unwrap();
        let big = log.begin_append(&[payload(6, 20_000)], 0, None).unwrap();
        no_space(log.commit(small).await);
        no_space(log.commit(big).await);
        assert_eq!(log.next_offset(), 5, "both offsets given back");
        let (after, report) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(
            report.next_offset, 5,
            "a refused batch came back after a crash"
        );
        check(&after, &acked).await;
        drop(after);
        // The log goes on: the offsets are taken again, durably.
        append(&log, &mut acked, 77).await;
        let (after, report) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        assert_eq!(report.next_offset, 6);
        check(&after, &acked).await;
    });
}

#[test]
fn a_rolled_back_batch_never_reports_success_when_its_offsets_are_reused() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        append(&log, &mut acked, 100).await;
        mem.fail_next_write_with(libc::ENOSPC);
        let lost = log.begin_append(&[payload(1, 300)], 0, None).unwrap();
        until("the rollback", || log.no_space_rollbacks() == 1).await;
        // A new batch takes offset 1 and is acknowledged...
        append(&log, &mut acked, 100).await;
        assert_eq!(log.committed_end(), 2);
        // ...and the batch that had it before still learns it was not written.
        assert_eq!(lost.first(), 1);
        no_space(log.commit(lost).await);
        check(&log, &acked).await;
    });
}

/// Commits of the era after a rollback complete in offset order, however the batches
/// given back are released: dropped before the rollback (`early`) or after it.
async fn the_next_era_commits_in_order(early: bool) {
    let mem = MemBackend::new();
    let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
    let mut acked = Vec::new();
    append(&log, &mut acked, 100).await;
    mem.fail_next_write_with(libc::ENOSPC);
    let b = log.begin_append(&[payload(1, 300)], 0, None).unwrap();
    let c = log.begin_append(&[payload(2, 300)], 0, None).unwrap();
    drop(c);
    let mut b: Option<PendingAppend> = Some(b);
    if early {
        drop(b.take());
    }
    until("the rollback", || log.no_space_rollbacks() == 1).await;
    let d = log.begin_append(&[payload(1, 100)], 0, None).unwrap();
    let e = log.begin_append(&[payload(2, 100)], 0, None).unwrap();
    drop(b);
    let order = Rc::new(RefCell::new(Vec::new()));
    let te = glommio::spawn_local({
        let (log, order) = (log.clone(), order.clone());
        async move {
            let a = log.commit(e).await.unwrap();
            order.borrow_mut().push(a.first);
        }
    });
    let td = glommio::spawn_local({
        let (log, order) = (log.clone(), order.clone());
        async move {
            // Let e be acknowledged and wait for its turn first.
            glommio::timer::sleep(Duration::from_millis(20)).await;
            let a = log.commit(d).await.unwrap();
            order.borrow_mut().push(a.first);
        }
    });
    let both = async {
        td.await;
        te.await;
        true
    };
    let timeout = async {
        glommio::timer::sleep(Duration::from_secs(5)).await;
        false
    };
    assert!(
        futures_lite::future::or(both, timeout).await,
        "early {early}: a commit of the new era never got its turn: {:?}",
        order.borrow()
    );
    assert_eq!(*order.borrow(), vec![1, 2], "early {early}: offset order");
}

#[test]
fn releasing_rolled_back_batches_after_the_rollback_keeps_the_next_era_in_order() {
    run(|| the_next_era_commits_in_order(false));
}

#[test]
fn releasing_rolled_back_batches_before_the_rollback_keeps_the_next_era_in_order() {
    run(|| the_next_era_commits_in_order(true));
}

/// The fault seam is armed from another thread, as an admin endpoint would, while the
/// log runs on its executor.
#[test]
fn faults_armed_from_another_thread_reach_the_io_uring_backend() {
    fn shareable<T: Send + Sync>() {}
    shareable::<StorageFaults>();
    let rig = DiskRig::new();
    let faults = rig.faults.clone();
    run(move || async move {
        let (log, _) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
        let mut acked = Vec::new();
        append(&log, &mut acked, 100).await;
        let arming = faults.clone();
        std::thread::spawn(move || arming.fail_writes(libc::ENOSPC, FaultTimes::Once))
            .join()
            .unwrap();
        assert_eq!(no_space(log.append(&[payload(1, 100)], 0).await), "write");
        assert_eq!(faults.injected(), 1);
        append(&log, &mut acked, 100).await;
        faults.fail_writes(libc::ENOSPC, FaultTimes::Always);
        no_space(log.append(&[payload(2, 100)], 0).await);
        no_space(log.append(&[payload(2, 100)], 0).await);
        faults.clear();
        append(&log, &mut acked, 100).await;
        assert_eq!(faults.injected(), 3);
        assert!(log.poisoned().is_none());
        check(&log, &acked).await;
        log.close().await.unwrap();
        let (log, _) = SegmentLog::open(rig.backend().await, cfg()).await.unwrap();
        check(&log, &acked).await;
        log.close().await.unwrap();
    });
}

#[test]
fn batches_staged_while_the_failing_write_runs_fail_too() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        append(&log, &mut acked, 100).await;
        mem.fail_next_write_with(libc::ENOSPC);
        let rounds = log.stats().flush_rounds;
        let a = log.begin_append(&[payload(1, 300)], 0, None).unwrap();
        // Stage b while the flusher waits on the write that will fail.
        let late = glommio::spawn_local({
            let log = log.clone();
            async move {
                // Yield, not sleep: the flusher is one turn of the executor away.
                while log.stats().flush_rounds == rounds {
                    futures_lite::future::yield_now().await;
                }
                assert_eq!(log.no_space_rollbacks(), 0, "staged before the rollback");
                let b = log.begin_append(&[payload(2, 300)], 0, None).unwrap();
                assert_eq!(b.first(), 2);
                log.commit(b).await
            }
        });
        no_space(log.commit(a).await);
        no_space(late.await);
        assert_eq!(log.next_offset(), 1);
        for _ in 0..3 {
            append(&log, &mut acked, 50).await;
        }
        check(&log, &acked).await;
        let (after, _) = SegmentLog::open(mem.crash(), cfg()).await.unwrap();
        check(&after, &acked).await;
    });
}

#[test]
fn a_sync_does_not_wait_for_rolled_back_batches() {
    run(|| async {
        let mem = MemBackend::new();
        let (log, _) = SegmentLog::open(mem.clone(), cfg()).await.unwrap();
        let mut acked = Vec::new();
        append(&log, &mut acked, 100).await;
        mem.fail_next_write_with(libc::ENOSPC);
        let lost = log.begin_append(&[payload(1, 100)], 0, None).unwrap();
        // Asked while offset 1 is claimed; offset 1 is then given back.
        let synced = futures_lite::future::or(async { Some(log.sync().await) }, async {
            glommio::timer::sleep(Duration::from_secs(5)).await;
            None
        })
        .await;
        assert!(matches!(synced, Some(Ok(()))), "{synced:?}");
        assert_eq!(log.durable_end(), 1);
        no_space(log.commit(lost).await);
    });
}

/// A real file system that fills up: set `FELIX_SMALL_FS_DIR` to a directory on a small
/// file system that supports O_DIRECT (e.g. `mount -t tmpfs -o size=1m tmpfs DIR` on
/// Linux 6.6 or later). Appends until the device is full, then frees space through
/// retention and appends again, without reopening: with preallocation the roll's
/// fallocate finds the device full, without it a data or header write does. Skipped when
/// the variable is unset.
#[test]
fn a_real_full_file_system_is_survived_and_retention_frees_it() {
    let Ok(root) = std::env::var("FELIX_SMALL_FS_DIR") else {
        eprintln!("skipped: FELIX_SMALL_FS_DIR is not set");
        return;
    };
    for preallocate in [true, false] {
        let cfg = LogConfig {
            preallocate,
            ..cfg()
        };
        let root = root.clone();
        run(move || fill_a_real_file_system(root, cfg));
    }
}

async fn fill_a_real_file_system(root: String, cfg: LogConfig) {
    let tmp = tempfile::Builder::new()
        .prefix("felix-enospc")
        .tempdir_in(root)
        .unwrap();
    let dir = tmp.path().join("log");
    {
        let (log, _) = SegmentLog::open(DmaBackend::open_dir(&dir).await.unwrap(), cfg.clone())
            .await
            .unwrap();
        let mut acked = Vec::new();
        let mut full = None;
        for _ in 0..100_000 {
            let o = log.next_offset();
            match log.append(&[payload(o, BIG)], o).await {
                Ok(_) => acked.push(BIG),
                Err(e) => {
                    full = Some(e);
                    break;
                }
            }
        }
        let full = full.expect("the file system filled up");
        assert!(matches!(full, StorageError::NoSpace { .. }), "{full}");
        assert!(log.poisoned().is_none());
        eprintln!("full after {} records: {full}", acked.len());
        // Free space: keep only the newest two segments' worth.
        let removed = log
            .enforce_retention_with(0, Some(2 * 64 * 1024), None)
            .await
            .unwrap();
        assert!(removed > 0);
        let base = log.base_offset() as usize;
        for _ in 0..FILL * 2 {
            let o = log.next_offset();
            log.append(&[payload(o, BIG)], o).await.unwrap();
            acked.push(BIG);
        }
        assert!(log.no_space_rollbacks() >= 1);
        let mut at = base as u64;
        while let Some(b) = log.read(at, 1 << 20).await.unwrap().first().cloned() {
            assert_eq!(b.records[0].to_vec(), payload(at, acked[at as usize]));
            at = b.end_offset();
        }
        assert_eq!(at, acked.len() as u64);
        log.close().await.unwrap();
        let (log, report) = SegmentLog::open(DmaBackend::open_dir(&dir).await.unwrap(), cfg)
            .await
            .unwrap();
        assert_eq!(report.next_offset, acked.len() as u64);
        log.close().await.unwrap();
    }
}

/// Under `None` an append is acknowledged once sequenced: the ack comes before any write,
/// and a read of the record waits for the flusher's write instead of missing it.
#[test]
fn without_fsync_an_append_is_acknowledged_before_its_write_and_reads_wait_for_it() {
    run(|| async {
        let mem = MemBackend::new();
        let none = LogConfig {
            fsync: FsyncMode::None,
            ..cfg()
        };
        let (log, _) = SegmentLog::open(mem.clone(), none).await.unwrap();
        let written = log.stats().bytes_written;
        let p = log.begin_append(&[payload(0, 100)], 0, None).unwrap();
        let a = log.commit(p).await.unwrap();
        assert_eq!((a.first, a.end), (0, 1));
        assert_eq!(
            log.stats().bytes_written,
            written,
            "acknowledged before the flusher wrote anything"
        );
        assert_eq!(log.committed_end(), 1, "readers may ask for it at once");
        let got = log.read(0, 1 << 20).await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].records[0][..], &payload(0, 100)[..]);
        assert!(
            log.stats().bytes_written > written,
            "the read waited for the write"
        );
    });
}

/// Under `None`, a full disk cannot give offsets back: the batches staged were already
/// acknowledged (and readers may have seen them). The log is poisoned instead, and what
/// was acknowledged but not written is the documented loss; no offset is ever reused.
#[test]
fn without_fsync_running_out_of_space_poisons_instead_of_reusing_acknowledged_offsets() {
    run(|| async {
        let mem = MemBackend::new();
        let none = LogConfig {
            fsync: FsyncMode::None,
            ..cfg()
        };
        let (log, _) = SegmentLog::open(mem.clone(), none.clone()).await.unwrap();
        log.append(&[payload(0, 100)], 0).await.unwrap();
        log.sync().await.unwrap();
        mem.fail_next_write_with(libc::ENOSPC);
        let p = log.begin_append(&[payload(1, 100)], 0, None).unwrap();
        let a = log.commit(p).await.unwrap();
        assert_eq!(a.first, 1, "acknowledged at sequencing");
        assert!(matches!(
            log.sync().await,
            Err(StorageError::Poisoned { .. })
        ));
        assert!(matches!(
            log.begin_append(&[payload(1, 100)], 0, None),
            Err(StorageError::Poisoned { .. })
        ));
        drop(log);
        let (after, report) = SegmentLog::open(mem.clone(), none).await.unwrap();
        assert_eq!(
            report.next_offset, 1,
            "offset 1 was lost with the failed write"
        );
        check(&after, &[100]).await;
    });
}

/// Acknowledging at sequencing is bounded: past [`EARLY_ACK_STAGED_MAX`] staged bytes a
/// batch waits for its write, so a producer faster than the disk cannot grow memory (or
/// the loss window) without limit.
#[test]
fn without_fsync_early_acks_stop_at_the_staging_bound() {
    run(|| async {
        let mem = MemBackend::new();
        let none = LogConfig {
            fsync: FsyncMode::None,
            segment_bytes_max: 256 << 20,
            ..cfg()
        };
        let (log, _) = SegmentLog::open(mem.clone(), none).await.unwrap();
        let record = vec![7u8; 1 << 20];
        // Claimed back to back, with no await: the flusher has not run.
        let pending: Vec<PendingAppend> = (0..24)
            .map(|_| log.begin_append(&[&record[..]], 0, None).unwrap())
            .collect();
        let early = log.committed_end();
        assert!(
            early >= 8,
            "small stagings are acknowledged at once: {early}"
        );
        assert!(
            early as usize * (1 << 20) <= felix_storage_uring::EARLY_ACK_STAGED_MAX,
            "no more than the bound is acknowledged unwritten: {early}"
        );
        assert!(early < 24);
        // The rest are acknowledged as the flusher writes them.
        for p in pending {
            log.commit(p).await.unwrap();
        }
        assert_eq!(log.committed_end(), 24);
    });
}

/// A log in memory that acknowledges at sequencing (`fsync: none`) with `linger`.
async fn lingering_log(linger: Duration) -> SegmentLog<MemBackend> {
    let none = LogConfig {
        fsync: FsyncMode::None,
        write_linger: linger,
        ..cfg()
    };
    SegmentLog::open(MemBackend::new(), none).await.unwrap().0
}

/// With a write linger, acknowledged appends made one at a time share device writes.
#[test]
fn without_fsync_a_write_linger_gathers_one_at_a_time_appends_into_one_write() {
    run(|| async {
        for (linger, most_rounds) in [(Duration::ZERO, 10), (Duration::from_millis(20), 2)] {
            let log = lingering_log(linger).await;
            let rounds = log.stats().flush_rounds;
            for o in 0..10 {
                let started = Instant::now();
                log.append(&[payload(o, 100)], 0).await.unwrap();
                assert!(
                    started.elapsed() < Duration::from_millis(15),
                    "acks do not linger"
                );
                // One at a time: give the flusher its turn between appends.
                glommio::yield_if_needed().await;
                glommio::executor().yield_task_queue_now().await;
            }
            // A read returns what is written and waits only for its first record.
            let mut at = 0;
            while at < 10 {
                let read = log.read(at, 1 << 20).await.unwrap();
                assert!(!read.is_empty());
                at = read.last().unwrap().end_offset();
            }
            let took = log.stats().flush_rounds - rounds;
            assert!(
                took <= most_rounds,
                "linger {linger:?}: {took} write rounds for 10 appends"
            );
            if !linger.is_zero() {
                assert!(took >= 1);
            }
        }
    });
}

/// An append made after half the linger starts the write at once: a steady producer's
/// writes go from its own wake-ups, not from one more for the timer. The linger still
/// bounds how long the last append before a pause waits.
#[test]
fn without_fsync_an_append_after_half_the_linger_starts_the_write() {
    run(|| async {
        let log = lingering_log(Duration::from_millis(2000)).await;
        let start = Instant::now();
        log.append(&[payload(0, 100)], 0).await.unwrap();
        glommio::timer::sleep(Duration::from_millis(1200)).await;
        let rounds = log.stats().flush_rounds;
        log.append(&[payload(1, 100)], 0).await.unwrap();
        // Both written long before the linger's timer (2 s after the first). Watched
        // by the round count, not a read: a read would end the linger itself.
        while log.stats().flush_rounds == rounds {
            glommio::timer::sleep(Duration::from_millis(10)).await;
        }
        let waited = start.elapsed();
        assert!(
            waited < Duration::from_millis(1800),
            "written {waited:?} after the first append"
        );
        let read = log.read(0, 1 << 20).await.unwrap();
        assert_eq!(read.last().unwrap().end_offset(), 2);
        assert_eq!(
            log.stats().flush_rounds,
            rounds + 1,
            "one write carries both"
        );
        // The last append before a pause is written when the linger ends.
        let last = Instant::now();
        let rounds = log.stats().flush_rounds;
        log.append(&[payload(2, 100)], 0).await.unwrap();
        while log.stats().flush_rounds == rounds {
            glommio::timer::sleep(Duration::from_millis(10)).await;
        }
        let waited = last.elapsed();
        assert!(
            waited >= Duration::from_millis(1800) && waited < Duration::from_millis(6000),
            "the lone append waited {waited:?}"
        );
        // A read of a record not written yet ends the linger at once (the linger saves
        // device writes, it does not delay readers), and so does one that starts
        // waiting while the linger runs.
        for (offset, after, what) in [(3, 0, "before"), (4, 100, "during")] {
            log.append(&[payload(offset, 100)], 0).await.unwrap();
            if after > 0 {
                glommio::timer::sleep(Duration::from_millis(after)).await;
            }
            let reading = Instant::now();
            let read = log.read(offset, 1 << 20).await.unwrap();
            assert_eq!(read.last().unwrap().end_offset(), offset + 1);
            assert!(
                reading.elapsed() < Duration::from_millis(1000),
                "a read {what} the linger waited {:?}",
                reading.elapsed()
            );
        }
        // A sync ends a linger at once.
        log.append(&[payload(5, 100)], 0).await.unwrap();
        let syncing = Instant::now();
        log.sync().await.unwrap();
        assert!(
            syncing.elapsed() < Duration::from_millis(1000),
            "a sync waited {:?} for the linger",
            syncing.elapsed()
        );
    });
}
