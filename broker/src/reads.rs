//! Bounded reads of a stream shard by position: `stream_read` (a range of records, for
//! clients that want an end rather than a subscription) and `offset_for_time` (the first
//! record at or after an instant). Both read the shard's log through its owning core
//! ([`CoreBroker::read`]), so they see only what readers may see (on a Quorum shard, up
//! to the commit mark), and both show only data: an atomic commit reads as its event,
//! group events and generation markers are passed over.

use std::rc::Rc;
use std::sync::Arc;

use felix_core_runtime::placement::ShardKey;
use felix_storage_uring::BatchKind;
use felix_wire::Offset;
use felix_wire::message::StreamRecord;

use crate::core::CoreBroker;
use crate::error::BrokerError;

/// Most records one `stream_read` answers.
pub const READ_RECORDS_MAX: u32 = 10_000;
/// Most payload bytes one `stream_read` answers (it always carries one record).
pub const READ_BYTES_MAX: u32 = 4 << 20;

/// Bytes each read of a `stream_read` asks the log for at least, whatever the answer's
/// byte bound: a run of batches that hold no data (group events, one batch per ack on
/// a queue's shard) is passed over many batches a read. Reading at the answer's bound,
/// a `max_bytes` of 1 read one batch at a time through such a run, a round trip to the
/// shard's core each.
const SCAN_BYTES_MIN: usize = 256 << 10;

/// Records of `key` from `from` (inclusive) to `end` (exclusive, or as far as the log
/// goes), at most `max_records` and about `max_bytes`; and the offset the next read
/// starts at.
pub async fn stream_read(
    core: &Rc<CoreBroker>,
    key: Arc<ShardKey>,
    from: u64,
    end: Option<u64>,
    max_records: Option<u32>,
    max_bytes: Option<u32>,
) -> Result<(Vec<StreamRecord>, u64), BrokerError> {
    read_range(
        |from, max| core.read(key.clone(), from, max),
        from,
        end,
        max_records,
        max_bytes,
    )
    .await
}

/// [`stream_read`] over `read` (a shard's log read: the batches from the one holding
/// `from` on, about `max_bytes`; empty at the end).
async fn read_range<F, Fut>(
    mut read: F,
    from: u64,
    end: Option<u64>,
    max_records: Option<u32>,
    max_bytes: Option<u32>,
) -> Result<(Vec<StreamRecord>, u64), BrokerError>
where
    F: FnMut(u64, usize) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<felix_storage_uring::ReadBatch>, BrokerError>>,
{
    let max_records = max_records.unwrap_or(1000).clamp(1, READ_RECORDS_MAX) as usize;
    let max_bytes = max_bytes.unwrap_or(READ_BYTES_MAX).clamp(1, READ_BYTES_MAX) as usize;
    let end = end.unwrap_or(u64::MAX);
    let (mut out, mut bytes, mut next) = (Vec::new(), 0usize, from);
    while next < end && out.len() < max_records {
        let batches = read(next, max_bytes.max(SCAN_BYTES_MIN)).await?;
        if batches.is_empty() {
            break;
        }
        let before = next;
        for b in batches.into_iter().map(crate::state::readable) {
            for (i, payload) in b.records.iter().enumerate() {
                let offset = b.base_offset + i as u64;
                if offset < next {
                    continue;
                }
                if offset >= end || out.len() >= max_records {
                    return Ok((out, next));
                }
                if b.kind == BatchKind::Data {
                    if !out.is_empty() && bytes + payload.len() > max_bytes {
                        return Ok((out, next));
                    }
                    bytes += payload.len();
                    out.push(StreamRecord {
                        offset: Offset(offset),
                        payload: payload.clone(),
                        publisher: None,
                        timestamp_micros: b.timestamp_micros,
                    });
                }
                next = offset + 1;
            }
        }
        if next == before {
            break;
        }
    }
    Ok((out, next))
}

/// The first data record of `key` appended at or after `at_micros`; `None` when none is
/// (yet). See [`first_at_or_after`].
pub async fn offset_for_time(
    core: &Rc<CoreBroker>,
    key: Arc<ShardKey>,
    at_micros: u64,
) -> Result<Option<u64>, BrokerError> {
    first_at_or_after(
        |from, max_bytes| core.read(key.clone(), from, max_bytes),
        at_micros,
    )
    .await
}

/// Bytes one probe of the search reads: the batch holding the offset comes whole
/// whatever this says.
const PROBE_BYTES: usize = 4 << 10;
/// Offsets between the search's bounds below which it walks instead of halving.
const WALK_SPAN: u64 = 256;

/// The first data (or atomic-commit) batch at or after `at_micros`, over `read` (a
/// shard's log read: the batches from the one holding `from` on, about `max_bytes`;
/// empty at the end; `Cursor` below the oldest retained offset).
///
/// A log's append times rise with its offsets (each batch is stamped when its leader
/// appends it), so this halves the offsets between the oldest retained and the end
/// by probing the batch at the middle, then walks the last stretch: about two reads per
/// doubling of the log instead of reading all of it. Where a clock stepped back (a
/// leader's wall clock, or a new leader's behind the old one's) the times are not in
/// order, and the answer is then a batch at or after the instant that follows one
/// before it, not necessarily the first such batch in the log; and none when the
/// search passed over the only such batches (a stretch stamped ahead of the clock that
/// followed it, within that clock's step: finding it would take a walk of the whole
/// log for every instant past the end).
pub async fn first_at_or_after<F, Fut>(
    mut read: F,
    at_micros: u64,
) -> Result<Option<u64>, BrokerError>
where
    F: FnMut(u64, usize) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<felix_storage_uring::ReadBatch>, BrokerError>>,
{
    // `lo`: the walk may start here (everything before is before the instant or
    // trimmed). `hi`: a batch at `hi` or the end is at or after the instant. The
    // end is found by doubling a step from the oldest offset.
    let mut lo = 0u64;
    let mut hi: Option<u64> = None;
    let mut step = WALK_SPAN;
    loop {
        let probe = match hi {
            Some(h) if h.saturating_sub(lo) <= WALK_SPAN => break,
            Some(h) => lo + (h - lo) / 2,
            None if lo == 0 => 0,
            None => lo.saturating_add(step),
        };
        let batches = match read(probe, PROBE_BYTES).await {
            Ok(b) => b,
            // The oldest records are gone: the search starts at the oldest retained.
            Err(BrokerError::Cursor { available, .. }) if probe < available => {
                lo = lo.max(available);
                if hi.is_some_and(|h| h <= lo) {
                    hi = None;
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        let Some(first) = batches.first() else {
            // The end (or what readers may see of it) lies at or before the probe.
            hi = Some(probe.max(lo));
            if probe <= lo {
                break;
            }
            continue;
        };
        if first.timestamp_micros >= at_micros {
            hi = Some(probe.min(first.base_offset).max(lo));
            if probe <= lo {
                break;
            }
        } else {
            lo = lo.max(first.end_offset()).max(probe);
            if hi.is_none() {
                step = step.saturating_mul(2);
            }
        }
    }
    // Walk from `lo`: the first data batch at or after the instant, mostly within the
    // first read (the reads grow from 64 KiB).
    let mut next = lo;
    let mut window = 64 << 10;
    loop {
        let batches = match read(next, window).await {
            Ok(b) => b,
            Err(BrokerError::Cursor { available, .. }) if next < available => {
                next = available;
                continue;
            }
            Err(e) => return Err(e),
        };
        let Some(last) = batches.last() else {
            return Ok(None);
        };
        let last_end = last.end_offset();
        if let Some(b) = batches.iter().find(|b| {
            b.end_offset() > next
                && matches!(b.kind, BatchKind::Data | BatchKind::Commit)
                && b.timestamp_micros >= at_micros
        }) {
            return Ok(Some(b.base_offset));
        }
        if last_end <= next {
            return Ok(None);
        }
        next = last_end;
        window = (window * 2).min(READ_BYTES_MAX as usize);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use bytes::Bytes;
    use felix_storage_uring::ReadBatch;

    use super::*;

    /// A log in memory: `(base, records, timestamp, kind)` per batch, offsets below
    /// `oldest` trimmed (raised to `trim_to` at the `trim_at`th read, as retention
    /// does mid-search), each record 1 KiB for the read window. A read's first batch
    /// starts at `from`, as the log's does.
    struct FakeLog {
        batches: Vec<(u64, u64, u64, BatchKind)>,
        oldest: Cell<u64>,
        trim: Option<(usize, u64)>,
        reads: Cell<usize>,
    }

    impl FakeLog {
        fn read(&self, from: u64, max_bytes: usize) -> Result<Vec<ReadBatch>, BrokerError> {
            self.reads.set(self.reads.get() + 1);
            if let Some((at, to)) = self.trim
                && self.reads.get() == at
            {
                self.oldest.set(to);
            }
            if from < self.oldest.get() {
                return Err(BrokerError::Cursor {
                    reason: felix_wire::message::CursorErrorReason::TooOld,
                    requested: from,
                    available: self.oldest.get(),
                });
            }
            let i = self.batches.partition_point(|b| b.0 + b.1 <= from);
            let mut out = Vec::new();
            let mut bytes = 0usize;
            for &(base, n, ts, kind) in &self.batches[i..] {
                if !out.is_empty() && bytes >= max_bytes {
                    break;
                }
                let skip = from.saturating_sub(base);
                bytes += (n - skip) as usize * 1024;
                out.push(ReadBatch {
                    base_offset: base + skip,
                    timestamp_micros: ts,
                    kind,
                    producer: None,
                    records: vec![Bytes::new(); (n - skip) as usize],
                });
            }
            Ok(out)
        }

        /// The answer by a walk over every batch.
        fn reference(&self, at: u64) -> Option<u64> {
            self.batches
                .iter()
                .find(|b| {
                    b.0 + b.1 > self.oldest.get()
                        && matches!(b.3, BatchKind::Data | BatchKind::Commit)
                        && b.2 >= at
                })
                .map(|b| b.0.max(self.oldest.get()))
        }

        fn search(&self, at: u64) -> Option<u64> {
            felix_core_runtime::task::block_on(first_at_or_after(
                |from, max| std::future::ready(self.read(from, max)),
                at,
            ))
            .unwrap()
        }
    }

    /// `n` batches of 1-16 records, one in five a group event batch, times rising by
    /// 0-20 µs (ties too).
    fn log(n: usize, seed: u64) -> FakeLog {
        let mut x = seed;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut base, mut ts) = (0u64, 1_000u64);
        let batches = (0..n)
            .map(|_| {
                let len = 1 + next() % 16;
                ts += next() % 21;
                let kind = if next() % 5 == 0 {
                    BatchKind::Group
                } else {
                    BatchKind::Data
                };
                let b = (base, len, ts, kind);
                base += len;
                b
            })
            .collect();
        FakeLog {
            batches,
            oldest: Cell::new(0),
            trim: None,
            reads: Cell::new(0),
        }
    }

    /// The search finds what a walk over the whole log finds, in a few dozen reads of
    /// a log of 200,000 batches (the walk it replaced read all of it).
    #[test]
    fn the_search_finds_the_first_batch_at_or_after_the_instant_in_few_reads() {
        for (seed, oldest) in [(7u64, 0u64), (11, 0), (13, 400_000)] {
            let l = log(200_000, seed);
            l.oldest.set(oldest);
            let (first, last) = (l.batches[0].2, l.batches.last().unwrap().2);
            let mut most = 0;
            for k in 0..=40u64 {
                let at = first.saturating_sub(5) + (last + 10 - first) * k / 40;
                l.reads.set(0);
                assert_eq!(l.search(at), l.reference(at), "seed {seed} at {at}");
                most = most.max(l.reads.get());
            }
            assert!(most <= 64, "seed {seed}: {most} reads for one search");
        }
        // Empty, and an instant past every batch.
        let empty = FakeLog {
            batches: Vec::new(),
            oldest: Cell::new(0),
            trim: None,
            reads: Cell::new(0),
        };
        assert_eq!(empty.search(0), None);
        let l = log(1_000, 3);
        assert_eq!(l.search(u64::MAX), None);
        assert_eq!(l.search(0), l.reference(0));
        // Retention cuts the log under the search (at its 2nd to 12th read): the
        // answer is what the log holds once the search ends.
        for at_read in 2..=12 {
            let mut l = log(200_000, 17);
            let mid = l.batches[100_000].0 + 1;
            l.trim = Some((at_read, mid));
            let at = l.batches[50_000].2;
            let got = l.search(at);
            assert_eq!(got, l.reference(at), "trimmed at read {at_read}");
        }
    }

    /// Times out of order (a clock stepped back) still end the search with a data batch
    /// at or after the instant when there is one, right after one before it.
    #[test]
    fn times_out_of_order_still_answer_a_batch_at_or_after_the_instant() {
        let mut l = log(50_000, 5);
        for (i, b) in l.batches.iter_mut().enumerate() {
            if i % 1_000 < 50 {
                b.2 = b.2.saturating_sub(20_000);
            }
        }
        let last = l.batches.iter().map(|b| b.2).max().unwrap();
        for k in 0..=20u64 {
            let at = last * k / 20;
            match l.search(at) {
                Some(o) => {
                    let b = l.batches.iter().find(|b| b.0 == o).expect("a batch's base");
                    assert!(b.2 >= at && b.3 == BatchKind::Data);
                }
                None => assert_eq!(l.reference(at), None),
            }
        }
    }

    /// A read with a small byte bound over a long run of group events (a queue's
    /// shard: a batch per ack) passes over the run many batches a read.
    #[test]
    fn a_read_passes_over_a_run_of_group_events_in_few_reads() {
        let mut batches: Vec<_> = (0..10_000u64)
            .map(|o| (o, 1, 1_000, BatchKind::Group))
            .collect();
        batches.push((10_000, 3, 2_000, BatchKind::Data));
        let log = FakeLog {
            batches,
            oldest: Cell::new(0),
            trim: None,
            reads: Cell::new(0),
        };
        let (records, next) = felix_core_runtime::task::block_on(read_range(
            |from, max| std::future::ready(log.read(from, max)),
            0,
            None,
            None,
            Some(1),
        ))
        .unwrap();
        assert_eq!(
            records.iter().map(|r| r.offset.0).collect::<Vec<_>>(),
            vec![10_000, 10_001, 10_002]
        );
        assert_eq!(next, 10_003);
        assert!(
            log.reads.get() <= 50,
            "{} reads for 10,000 group events",
            log.reads.get()
        );
    }
}
