//! Truncation and reset (step 6 of the module docs of [`crate::log`]): the intent file
//! that makes them atomic across a crash, the cut of one segment file, and what recovery
//! does with an intent it finds.
//!
//! What must stay true: from the moment the intent may be durable until it is durably
//! removed, nothing is appended, and the log is either finished by this call or poisoned
//! so that only a restart (which finishes it) can append again.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io;
use std::rc::Rc;
use std::task::Poll;

use bytes::Bytes;

use super::{
    RollbackCause, SegmentLog, Sequencer, State, end_era, meta, poison_error, wake_acked, wake_all,
    written_last_batch,
};
use crate::error::{Corruption, CorruptionKind, StorageError};
use crate::format::{
    self, BATCH_HEADER_BYTES, BLOCK_BYTES, BatchKind, HeaderRead, SEGMENT_HEADER_BYTES,
};
use crate::io::{Backend, SegmentFile};
use crate::segment::{Segment, index_name, segment_name};

/// The intent file (step 6b). Upper case: no metadata name can be it.
pub const INTENT_FILE: &str = "LOG-INTENT";
/// `FXIT`.
const INTENT_MAGIC: u32 = 0x4658_4954;
const INTENT_VERSION: u16 = 1;
const INTENT_BYTES: usize = 20;
/// Highest base `reset_empty_at` accepts: offsets stay far from overflow.
pub const MAX_RESET_BASE: u64 = 1 << 62;
/// Bytes of batch headers fetched per read while looking for a cut.
const LOCATE_WINDOW_BYTES: usize = 64 * 1024;

/// A change to the whole log that recovery finishes if a crash interrupts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Intent {
    /// Remove every record at or after the offset.
    TruncateFrom(u64),
    /// Replace an empty log with an empty log starting at the offset.
    ResetEmptyAt(u64),
}

impl Intent {
    /// Magic u32, version u16, kind u8, reserved u8, offset u64, CRC32C u32 (BE).
    fn encode(self) -> Vec<u8> {
        let (kind, offset) = match self {
            Intent::TruncateFrom(o) => (1u8, o),
            Intent::ResetEmptyAt(b) => (2u8, b),
        };
        let mut b = Vec::with_capacity(INTENT_BYTES);
        b.extend_from_slice(&INTENT_MAGIC.to_be_bytes());
        b.extend_from_slice(&INTENT_VERSION.to_be_bytes());
        b.extend_from_slice(&[kind, 0]);
        b.extend_from_slice(&offset.to_be_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_be_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Intent, &'static str> {
        if b.len() != INTENT_BYTES {
            return Err("wrong length");
        }
        let crc = u32::from_be_bytes(b[16..20].try_into().expect("4 bytes"));
        if crc32c::crc32c(&b[..16]) != crc {
            return Err("checksum mismatch");
        }
        if b[0..4] != INTENT_MAGIC.to_be_bytes() || b[4..6] != INTENT_VERSION.to_be_bytes() {
            return Err("unknown magic or version");
        }
        let offset = u64::from_be_bytes(b[8..16].try_into().expect("8 bytes"));
        match b[6] {
            1 => Ok(Intent::TruncateFrom(offset)),
            2 => Ok(Intent::ResetEmptyAt(offset)),
            _ => Err("unknown kind"),
        }
    }
}

fn intent_error(reason: &'static str) -> StorageError {
    StorageError::Corrupt(Corruption {
        segment: INTENT_FILE.to_owned(),
        position: 0,
        offset: None,
        kind: CorruptionKind::Intent { reason },
    })
}

/// The intent an interrupted truncation or reset left, if any. A read-only open cannot
/// finish one, so it refuses.
pub(super) async fn read_intent<B: Backend>(
    backend: &B,
    read_only: bool,
) -> Result<Option<Intent>, StorageError> {
    let Some(bytes) = backend
        .read_small(INTENT_FILE)
        .await
        .map_err(|e| StorageError::io("read", INTENT_FILE, e))?
    else {
        return Ok(None);
    };
    let intent = Intent::decode(&bytes).map_err(intent_error)?;
    if read_only {
        return Err(StorageError::Config(format!(
            "an interrupted log change ({intent:?}) is pending: open read-write to finish it"
        )));
    }
    Ok(Some(intent))
}

/// Recovery, before the scan (step 6d): removes the segments the intent removes, newest
/// first, and returns the base an empty log gets.
pub(super) async fn remove_cut_segments<B: Backend>(
    backend: &B,
    bases: &mut Vec<u64>,
    intent: Intent,
) -> Result<u64, StorageError> {
    let (keep_below, fresh_base) = match intent {
        Intent::TruncateFrom(o) => (o.saturating_add(1), o),
        Intent::ResetEmptyAt(b) => (0, b),
    };
    let doomed = bases.split_off(bases.partition_point(|&b| b < keep_below));
    remove_segments(backend, &doomed)
        .await
        .map_err(|(op, e)| StorageError::io(op, "log directory", e))?;
    Ok(fresh_base)
}

/// Recovery, after the scan: cuts the newest segment if it still extends past the
/// truncation point, then removes the intent.
pub(super) async fn finish_at_open<B: Backend>(
    backend: &B,
    segments: &mut VecDeque<Segment<B::File>>,
    intent: Intent,
) -> Result<(), StorageError> {
    if let Intent::TruncateFrom(o) = intent {
        let seg = segments
            .back_mut()
            .expect("recovery leaves at least one segment");
        if o < seg.end_offset {
            if o < seg.base {
                return Err(intent_error("the cut lies before the newest segment"));
            }
            let start = seek_before(seg, o);
            let point = locate(&*seg.file, &seg.name, seg.base, seg.data_len, start, o).await?;
            // As at a live cut: its index (one `close` wrote) would be stale, and say
            // nothing of the batches written at the offsets cut.
            let _ = backend.remove(&index_name(seg.base)).await;
            cut_file(&*seg.file, &point)
                .await
                .map_err(|(op, e)| StorageError::io(op, &seg.name, e))?;
            apply_cut(seg, o, point);
        }
    }
    clear_intent(backend)
        .await
        .map_err(|(op, e)| StorageError::io(op, INTENT_FILE, e))
}

/// Where the batch starting at `offset` is, in the segment that holds it.
#[derive(Debug, Clone)]
pub(super) struct CutPoint {
    /// Its byte position: the segment's new data length.
    pos: u64,
    /// The batch before it in the same segment.
    prev: Option<(u64, BatchKind)>,
    /// The bytes of its block before it: the segment's new tail block.
    tail: Vec<u8>,
}

/// The index position to walk from to find `offset` and the batch before it.
fn seek_before<F>(seg: &Segment<F>, offset: u64) -> u64 {
    if offset > seg.base {
        seg.index.seek(offset - 1)
    } else {
        SEGMENT_HEADER_BYTES as u64
    }
}

/// Finds the batch starting at `offset` in a segment, walking batch headers from
/// `start` (a batch position at or before it). `NotBatchBoundary` if `offset` falls
/// inside a batch.
pub(super) async fn locate<F: SegmentFile>(
    file: &F,
    name: &str,
    base: u64,
    data_len: u64,
    start: u64,
    offset: u64,
) -> Result<CutPoint, StorageError> {
    let (pos, prev) = if offset > base {
        walk_to(file, name, data_len, start, offset).await?
    } else {
        (SEGMENT_HEADER_BYTES as u64, None)
    };
    let block = format::align_down(pos);
    let tail = file
        .read_at(block, (pos - block) as usize)
        .await
        .map_err(|e| StorageError::io("read for truncation", name, e))?
        .to_vec();
    Ok(CutPoint { pos, prev, tail })
}

/// The position of the batch starting at `offset`, and the batch before it.
async fn walk_to<F: SegmentFile>(
    file: &F,
    name: &str,
    data_len: u64,
    start: u64,
    offset: u64,
) -> Result<(u64, Option<(u64, BatchKind)>), StorageError> {
    let (mut pos, mut prev) = (start, None);
    let (mut window, mut window_pos) = (Bytes::new(), start);
    loop {
        if pos + BATCH_HEADER_BYTES as u64 > data_len {
            return Err(StorageError::NotBatchBoundary { offset });
        }
        if pos + BATCH_HEADER_BYTES as u64 > window_pos + window.len() as u64 {
            let len = ((data_len - pos) as usize).min(LOCATE_WINDOW_BYTES);
            window = file
                .read_at(pos, len)
                .await
                .map_err(|e| StorageError::io("read for truncation", name, e))?;
            window_pos = pos;
        }
        let h = match format::decode_batch_header(&window[(pos - window_pos) as usize..]) {
            Ok(HeaderRead::Batch(h)) => h,
            Ok(HeaderRead::Zero) => return Err(StorageError::NotBatchBoundary { offset }),
            Err(e) => {
                return Err(StorageError::Corrupt(Corruption {
                    segment: name.to_owned(),
                    position: pos,
                    offset: Some(offset),
                    kind: e.into(),
                }));
            }
        };
        if h.base_offset == offset {
            return Ok((pos, prev));
        }
        if h.end_offset() > offset {
            return Err(StorageError::NotBatchBoundary { offset });
        }
        prev = Some((h.base_offset, h.kind));
        pos += h.total_len() as u64;
    }
}

/// Step 6d for the segment holding the cut: the shorter size is made durable before the
/// rest of the last block is zeroed, so zeros never land in front of removed bytes.
async fn cut_file<F: SegmentFile>(
    file: &F,
    point: &CutPoint,
) -> Result<(), (&'static str, io::Error)> {
    file.truncate(point.pos)
        .await
        .map_err(|e| ("truncate segment", e))?;
    file.sync_data()
        .await
        .map_err(|e| ("fsync truncated segment", e))?;
    if point.tail.is_empty() {
        return Ok(());
    }
    let mut block = point.tail.clone();
    block.resize(BLOCK_BYTES, 0);
    file.write_at(&block, format::align_down(point.pos))
        .await
        .map_err(|e| ("zero truncated block", e))?;
    file.sync_data()
        .await
        .map_err(|e| ("fsync truncated segment", e))
}

/// The segment's in-memory state after the cut at `offset`. Its newest timestamp stays:
/// an over-estimate only keeps the segment from age retention a little longer.
fn apply_cut<F>(seg: &mut Segment<F>, offset: u64, point: CutPoint) {
    seg.end_offset = offset;
    seg.data_len = point.pos;
    seg.tail_block = point.tail;
    seg.zeroed_to = 0;
    seg.index.retain_below(offset);
    seg.last_batch = point.prev;
}

/// Removes segment files and their indexes, newest first, then fsyncs the directory.
async fn remove_segments<B: Backend>(
    backend: &B,
    bases: &[u64],
) -> Result<(), (&'static str, io::Error)> {
    for &base in bases.iter().rev() {
        match backend.remove(&segment_name(base)).await {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(("remove segment", e)),
            _ => {}
        }
        // Derived: a leftover index of a removed segment is never read.
        let _ = backend.remove(&index_name(base)).await;
    }
    if bases.is_empty() {
        return Ok(());
    }
    backend.sync_dir().await.map_err(|e| ("fsync directory", e))
}

/// Step 6e: the intent is durably gone.
async fn clear_intent<B: Backend>(backend: &B) -> Result<(), (&'static str, io::Error)> {
    match backend.remove(INTENT_FILE).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(("remove intent", e)),
        _ => {}
    }
    backend.sync_dir().await.map_err(|e| ("fsync directory", e))
}

/// What a truncation found in step 6a and changes in 6c and 6d.
struct Plan<F> {
    /// Position in `segments` of the segment holding the cut.
    index: usize,
    file: Rc<F>,
    base: u64,
    /// Bases of the segments after it.
    doomed: Vec<u64>,
    point: CutPoint,
}

/// The log held for a truncation or reset (step 6a). Dropping it lets appends in again;
/// dropped between the commit point and the end, it poisons the log (step 6b).
struct Hold<'a, B: Backend> {
    log: &'a SegmentLog<B>,
    committed: bool,
    done: bool,
}

impl<'a, B: Backend> Hold<'a, B> {
    async fn take(log: &'a SegmentLog<B>) -> Result<Self, StorageError> {
        // A retention pass takes its segments out of memory before it removes their
        // files: a cut planned meanwhile does not see them, and a crash (or a removal
        // that fails) before the pass ends left them on disk beside the cut's result,
        // an offset gap every later open refused. It waits for the pass, as a close
        // does (the pass's directory sync included).
        log.no_removals().await;
        let mut st = log.shared.state.borrow_mut();
        check_open(&st)?;
        if st.exclusive {
            return Err(StorageError::Busy);
        }
        st.exclusive = true;
        Ok(Hold {
            log,
            committed: false,
            done: false,
        })
    }

    /// Step 6b: the intent is durable, or the log is poisoned, or nothing happened.
    async fn commit(&mut self, intent: Intent) -> Result<(), StorageError> {
        let log = self.log;
        let backend = &log.shared.backend;
        meta::write_temp(backend, INTENT_FILE, &intent.encode())
            .await
            .map_err(|e| StorageError::io("write intent", INTENT_FILE, e))?;
        self.committed = true;
        meta::install(backend, INTENT_FILE)
            .await
            .map_err(|(op, e)| self.fail(op, e))
    }

    /// Poisons the log after the commit point: only recovery can finish the change.
    fn fail(&mut self, op: &'static str, e: io::Error) -> StorageError {
        self.done = true;
        let detail = format!("{op} during a truncation or reset: {e}");
        let mut st = self.log.shared.state.borrow_mut();
        st.poisoned.get_or_insert((op, detail));
        wake_all(&mut st);
        StorageError::io(op, "log directory", e)
    }

    /// Step 6e, after the disk work: removes the intent, or poisons on failure.
    async fn finish(
        mut self,
        disk: Result<(), (&'static str, io::Error)>,
    ) -> Result<(), StorageError> {
        let log = self.log;
        let backend = &log.shared.backend;
        if let Err((op, e)) = disk {
            return Err(self.fail(op, e));
        }
        if let Err((op, e)) = clear_intent(backend).await {
            return Err(self.fail(op, e));
        }
        self.done = true;
        let mut st = self.log.shared.state.borrow_mut();
        st.durable_end = st.written_end;
        wake_acked(&mut st, self.log.shared.config.fsync);
        Ok(())
    }
}

impl<B: Backend> Drop for Hold<'_, B> {
    fn drop(&mut self) {
        let mut st = self.log.shared.state.borrow_mut();
        st.exclusive = false;
        if self.committed && !self.done {
            let detail = "a truncation or reset was dropped after its commit point".to_owned();
            st.poisoned.get_or_insert(("cancelled truncation", detail));
        }
        // Waiters that saw the log held (a `sync` spanning the cut) look again.
        wake_all(&mut st);
        if let Some(w) = st.flusher.take() {
            w.wake();
        }
    }
}

pub(super) fn check_open<F>(st: &State<F>) -> Result<(), StorageError> {
    if let Some(e) = poison_error(st) {
        return Err(e);
    }
    if st.closing || st.closed {
        return Err(StorageError::Closed);
    }
    Ok(())
}

impl<B: Backend> SegmentLog<B> {
    /// Removes every record at or after `offset`, durably (step 6): the next append gets
    /// `offset`. `offset` must lie in `[base_offset(), next_offset()]` (`OutOfRange`) and
    /// start a batch (`NotBatchBoundary`); at `next_offset()` nothing happens.
    ///
    /// Appends staged before the call are written first and complete as usual (a
    /// `PendingAppend` for removed records then fails with `RemovedByTruncation`). While
    /// it runs, appends, retention and other truncations are refused with `Busy`. A
    /// failure, or dropping the call, after the intent may be durable poisons the log:
    /// a restart finishes the truncation.
    pub async fn truncate_from(&self, offset: u64) -> Result<(), StorageError> {
        let mut hold = Hold::take(self).await?;
        if self.cut_is_noop(offset)? {
            return Ok(());
        }
        self.wait_idle().await?;
        if self.cut_is_noop(offset)? {
            return Ok(());
        }
        let plan = self.plan_cut(offset).await?;
        hold.commit(Intent::TruncateFrom(offset)).await?;
        self.cut_memory(offset, &plan);
        let disk = match self.cut_disk(&plan).await {
            // Before appends resume: a snapshot past the cut describes records gone.
            Ok(()) => {
                self.remove_snapshots_outside(Some(self.base_offset()..=offset))
                    .await
            }
            failed => failed,
        };
        hold.finish(disk).await
    }

    /// Replaces a log that holds no record (`NotEmpty` otherwise) with an empty log whose
    /// first offset is `base`, durably (step 6): a follower that starts from a leader
    /// whose retention already removed the records below `base`.
    pub async fn reset_empty_at(&self, base: u64) -> Result<(), StorageError> {
        if base > MAX_RESET_BASE {
            return Err(StorageError::OutOfRange {
                offset: base,
                low: 0,
                high: MAX_RESET_BASE,
            });
        }
        let mut hold = Hold::take(self).await?;
        self.check_empty()?;
        self.wait_idle().await?;
        self.check_empty()?;
        if base == self.base_offset() {
            return Ok(());
        }
        hold.commit(Intent::ResetEmptyAt(base)).await?;
        let old: Vec<u64> = self
            .shared
            .state
            .borrow()
            .segments
            .iter()
            .map(|s| s.base)
            .collect();
        let backend = &self.shared.backend;
        let created = match remove_segments(backend, &old).await {
            Ok(()) => super::create_segment(backend, &self.shared.config, base).await,
            Err(e) => Err(e),
        };
        let disk = match created {
            Ok(segment) => {
                self.reset_memory(segment);
                // Whatever they describe is not this log's.
                self.remove_snapshots_outside(None).await
            }
            Err(e) => Err(e),
        };
        hold.finish(disk).await
    }

    /// Checks a truncation point; `Ok(true)` when it is the next offset (nothing to do).
    fn cut_is_noop(&self, offset: u64) -> Result<bool, StorageError> {
        let st = self.shared.state.borrow();
        check_open(&st)?;
        let base = st.segments.front().map_or(0, |s| s.base);
        if offset < base || offset > st.next_offset {
            return Err(StorageError::OutOfRange {
                offset,
                low: base,
                high: st.next_offset,
            });
        }
        Ok(offset == st.next_offset)
    }

    fn check_empty(&self) -> Result<(), StorageError> {
        let st = self.shared.state.borrow();
        check_open(&st)?;
        let base_offset = st.segments.front().map_or(0, |s| s.base);
        if st.next_offset != base_offset {
            return Err(StorageError::NotEmpty {
                base_offset,
                next_offset: st.next_offset,
            });
        }
        Ok(())
    }

    /// Step 6a: waits until what was staged is written and the flusher has parked.
    async fn wait_idle(&self) -> Result<(), StorageError> {
        poll_fn(|cx| {
            let mut st = self.shared.state.borrow_mut();
            if let Some(e) = poison_error(&st) {
                return Poll::Ready(Err(e));
            }
            if st.closed {
                return Poll::Ready(Err(StorageError::Closed));
            }
            if !st.flushing && st.staged.is_empty() {
                return Poll::Ready(Ok(()));
            }
            st.idle_waiter = Some(cx.waker().clone());
            if let Some(w) = st.flusher.take() {
                w.wake();
            }
            Poll::Pending
        })
        .await
    }

    /// Step 6a: finds the segment and byte position of the cut, reading only.
    async fn plan_cut(&self, offset: u64) -> Result<Plan<B::File>, StorageError> {
        let (index, file, name, base, data_len, start, doomed) = {
            let st = self.shared.state.borrow();
            let index = st.segments.partition_point(|s| s.base <= offset) - 1;
            let seg = &st.segments[index];
            let doomed = st.segments.iter().skip(index + 1).map(|s| s.base);
            (
                index,
                seg.file.clone(),
                seg.name.clone(),
                seg.base,
                seg.data_len,
                seek_before(seg, offset),
                doomed.collect(),
            )
        };
        let point = locate(&*file, &name, base, data_len, start, offset).await?;
        Ok(Plan {
            index,
            file,
            base,
            doomed,
            point,
        })
    }

    /// Step 6c: memory becomes the truncated log.
    fn cut_memory(&self, offset: u64, plan: &Plan<B::File>) {
        let mut st = self.shared.state.borrow_mut();
        let st = &mut *st;
        st.segments.truncate(plan.index + 1);
        let seg = &mut st.segments[plan.index];
        apply_cut(seg, offset, plan.point.clone());
        st.append_base = seg.base;
        st.append_pos = seg.data_len;
        st.append_last_indexed = seg.index.last().map(|(_, p)| p);
        st.next_offset = offset;
        st.written_end = offset;
        st.early_end = offset;
        st.durable_end = st.durable_end.min(offset);
        st.last_batch = written_last_batch(&st.segments);
        st.cuts += 1;
        st.stats.cuts += 1;
        end_era(st, offset, RollbackCause::Truncated);
    }

    /// Step 6d: later segments go, then the holding segment is cut.
    async fn cut_disk(&self, plan: &Plan<B::File>) -> Result<(), (&'static str, io::Error)> {
        let backend = &self.shared.backend;
        // The holding segment's index would be stale; it is rewritten when it is sealed.
        let _ = backend.remove(&index_name(plan.base)).await;
        remove_segments(backend, &plan.doomed).await?;
        cut_file(&*plan.file, &plan.point).await?;
        if self.shared.config.preallocate {
            // Best effort, as at creation: the cut gave the reservation back.
            let _ = plan
                .file
                .allocate(self.shared.config.segment_bytes_max)
                .await;
        }
        Ok(())
    }

    /// Step 6c for a reset, once the new segment exists.
    fn reset_memory(&self, segment: Segment<B::File>) {
        let mut st = self.shared.state.borrow_mut();
        let st = &mut *st;
        let base = segment.base;
        st.segments = VecDeque::from([segment]);
        st.append_base = base;
        st.append_pos = SEGMENT_HEADER_BYTES as u64;
        st.append_last_indexed = None;
        st.next_offset = base;
        st.written_end = base;
        st.early_end = base;
        st.durable_end = base;
        st.last_batch = None;
        let waiters = std::mem::take(&mut st.sequencer.waiters);
        st.sequencer = Sequencer {
            next: base,
            ..Sequencer::default()
        };
        st.sequencer.waiters = waiters;
        st.cuts += 1;
        st.stats.cuts += 1;
        wake_all(st);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intents_round_trip_and_damage_is_refused() {
        for intent in [Intent::TruncateFrom(17), Intent::ResetEmptyAt(1 << 40)] {
            let b = intent.encode();
            assert_eq!(b.len(), INTENT_BYTES);
            assert_eq!(Intent::decode(&b), Ok(intent));
            let mut flipped = b.clone();
            flipped[10] ^= 1;
            assert!(Intent::decode(&flipped).is_err());
            assert!(Intent::decode(&b[..19]).is_err());
        }
    }
}
