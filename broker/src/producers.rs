//! Idempotent producers on one stream shard, sans-IO: what the leader remembers of each
//! producer's recent batches, and what it does with the next one.
//!
//! A producer numbers its batches per shard from 0. Each batch is stored with its
//! `(producer_id, sequence)` tag in the batch header, and shipped with it, so the table is
//! derived from the log on any replica: built on first use by reading the shard's log,
//! caught up before each decision, and told of this leader's own admissions (which are
//! past the log's durable end until they commit). A batch re-sent under a sequence the
//! table holds is answered from the log (its original offsets) and not appended again;
//! another batch under that sequence (other records: told apart by their count and a
//! digest of their bytes, [`Contents`]) is refused `sequence_reused`, as a re-send
//! answered from the log would lose it while acknowledging it.

use std::collections::{HashMap, VecDeque};

use felix_storage_uring::{BatchKind, ReadBatch};
use felix_wire::Sequence;
use felix_wire::message::PublishRefusalReason;

/// Batches remembered per producer and shard.
pub const WINDOW: usize = 64;
/// Producers remembered per shard; past it the one whose newest batch is oldest goes.
pub const PRODUCERS_MAX: usize = 4096;
/// Producers forgotten that way whose ids are kept, so that their next batch is
/// refused `unknown_producer` even at sequence 0 (taken for a new producer's first
/// batch, a forgotten one's re-send of its first batch was appended again).
pub const FORGOTTEN_MAX: usize = 4 * PRODUCERS_MAX;

/// What tells a re-sent batch from another one under the same sequence: its record
/// count, its bytes, and a CRC-32C over every record's length (u64, big-endian) and
/// bytes in turn. Computed from the records the client sent and, at a rebuild, from the
/// same records read back from the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contents {
    /// Records in the batch.
    pub records: u32,
    /// Their bytes, all together.
    pub bytes: u64,
    /// The CRC-32C of the lengths and bytes.
    pub crc: u32,
}

impl Contents {
    /// The contents of a batch of `records`.
    pub fn of(records: &[bytes::Bytes]) -> Contents {
        let mut crc = 0;
        let mut bytes = 0u64;
        for r in records {
            crc = crc32c::crc32c_append(crc, &(r.len() as u64).to_be_bytes());
            crc = crc32c::crc32c_append(crc, r);
            bytes += r.len() as u64;
        }
        Contents {
            records: records.len() as u32,
            bytes,
            crc,
        }
    }
}

/// One remembered batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    sequence: u64,
    first: u64,
    contents: Contents,
    /// Admitted by this leader, not yet durable.
    pending: bool,
}

/// What to do with an idempotent batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The next sequence: append it.
    Append,
    /// Already in the log at `first..end`: answer from there. `pending` while its
    /// original append has not finished (the re-send should come again shortly).
    Duplicate {
        /// First offset.
        first: u64,
        /// One past the last.
        end: u64,
        /// Still being written.
        pending: bool,
    },
    /// Refused; nothing is written.
    Refuse(PublishRefusalReason),
}

/// An idempotent batch's `(producer_id, sequence)` and contents.
pub type Tagged = ((u64, u64), Contents);

/// An idempotent publish waiting for its shard's producer table to be built.
pub struct Queued {
    /// The records.
    pub records: Vec<bytes::Bytes>,
    /// `(producer_id, sequence)`.
    pub tag: (u64, u64),
    /// Where its outcome goes.
    pub answer: futures_channel::oneshot::Sender<
        Result<felix_storage_uring::Appended, crate::error::BrokerError>,
    >,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued").field("tag", &self.tag).finish()
    }
}

impl Queued {
    /// Whether its client is gone: nobody waits for its answer, and no request budget
    /// counts its records any more.
    pub fn abandoned(&self) -> bool {
        self.answer.is_canceled()
    }
}

/// Bytes of publishes whose clients left that one core's queues keep: past them, at
/// the next sweep, every such publish is dropped. Under them they are kept and written
/// when their queue is served, as before there was a bound: a producer whose connection
/// died mid-pipeline while its next batch came on another (a forwarding broker's new
/// connection) needs the earlier batches written, or the next is refused
/// `sequence_gap`. Only a client stacking abandoned batches reaches the bound.
pub const ABANDONED_KEPT_BYTES: usize = 256 << 20;

/// What a queued publish is counted at: its records and the entry's own keep.
fn cost(q: &Queued) -> usize {
    128 + q.records.iter().map(|r| r.len() + 16).sum::<usize>()
}

/// Idempotent publishes waiting for their shard to open or its producer table to be
/// built, in arrival order. Kept until served (up to seconds), those whose clients
/// left (no request budget counting them any more) let a client leaving and coming
/// back stack batch after batch: the core's [`AbandonedBound`] drops them past their
/// bound. Only publishes whose connection is on the shard's own core can be abandoned
/// here: one from another core or held for a move keeps its answer's receiver on this
/// core until it is answered.
#[derive(Debug, Default)]
pub struct Waiting {
    queue: std::collections::VecDeque<Queued>,
}

impl Waiting {
    /// Queues `q` behind the rest; what it is counted at.
    pub fn push(&mut self, q: Queued) -> usize {
        let bytes = cost(&q);
        self.queue.push_back(q);
        bytes
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Queues all of `other` behind the rest, in its order.
    pub fn append(&mut self, mut other: Waiting) {
        self.queue.append(&mut other.queue);
    }

    /// Takes every publish, in arrival order, leaving none.
    pub fn take_to_serve(&mut self) -> std::collections::VecDeque<Queued> {
        std::mem::take(&mut self.queue)
    }

    /// What the abandoned publishes hold.
    fn abandoned_bytes(&self) -> usize {
        self.queue.iter().filter(|q| q.abandoned()).map(cost).sum()
    }

    /// Drops every abandoned publish, keeping the others in order.
    fn drop_abandoned(&mut self) {
        self.queue.retain(|q| !q.abandoned());
    }
}

/// One core's bound on the abandoned publishes of all its [`Waiting`] queues (a bound
/// per queue let shards opening at once hold it each). Each time
/// [`ABANDONED_KEPT_BYTES`] more have been queued on the core since the last sweep, the
/// core sweeps: the abandoned publishes of all its queues are counted, and all dropped
/// if they hold more than that. So they hold at most twice the bound plus what was
/// live at the last sweep (the connection budgets' share, which may all be abandoned
/// since), and a sweep reads the queues once per bound's worth queued.
#[derive(Debug, Default)]
pub struct AbandonedBound {
    /// Bytes queued since the last sweep.
    since_sweep: std::cell::Cell<usize>,
}

impl AbandonedBound {
    /// Notes `bytes` queued on the core: whether its queues are due a sweep now.
    pub fn queued(&self, bytes: usize) -> bool {
        let since = self.since_sweep.get() + bytes;
        self.since_sweep.set(since);
        since > ABANDONED_KEPT_BYTES
    }

    /// Sweeps every queue of the core: drops all their abandoned publishes if together
    /// they hold more than [`ABANDONED_KEPT_BYTES`]. Whether it dropped them.
    pub fn sweep(&self, queues: &mut [&mut Waiting]) -> bool {
        self.since_sweep.set(0);
        let abandoned: usize = queues.iter().map(|w| w.abandoned_bytes()).sum();
        if abandoned <= ABANDONED_KEPT_BYTES {
            return false;
        }
        for w in queues.iter_mut() {
            w.drop_abandoned();
        }
        true
    }
}

/// Which table, and how many cuts it has taken ([`ProducerTable::cut_to`]): a claim's
/// outcome is noted only in the table that admitted it, uncut since. Noted elsewhere it
/// could hit another claim of the same `(producer, sequence)`: a re-send appended at
/// the offsets a full disk gave back, or the same batch read from the log by a table
/// built since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    table: u64,
    cuts: u64,
}

/// Tables made so far (each gets its own [`Stamp`]).
static TABLES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The producers of one shard.
#[derive(Debug)]
pub struct ProducerTable {
    producers: HashMap<u64, VecDeque<Entry>>,
    /// Ids of producers forgotten for room, oldest first (at most [`FORGOTTEN_MAX`]).
    forgotten: VecDeque<u64>,
    forgotten_set: std::collections::HashSet<u64>,
    /// Every batch of the log below it has been read into the table.
    end: u64,
    stamp: Stamp,
}

impl ProducerTable {
    /// An empty table that starts reading the log at `base`.
    pub fn at(base: u64) -> ProducerTable {
        ProducerTable {
            producers: HashMap::new(),
            forgotten: VecDeque::new(),
            forgotten_set: std::collections::HashSet::new(),
            end: base,
            stamp: Stamp {
                table: TABLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                cuts: 0,
            },
        }
    }

    /// This table as it is now: pass it back with a claim's outcome.
    pub fn stamp(&self) -> Stamp {
        self.stamp
    }

    /// The log ends at `end`, before this table does (a full disk gave offsets back):
    /// the batches the table holds at or past it never reached the log, and are
    /// forgotten, so their re-sends append and later sequences are refused as gaps.
    /// (Kept, the table let a producer's next batch append ahead of the one lost.)
    pub fn cut_to(&mut self, end: u64) {
        if self.end <= end {
            return;
        }
        self.producers.retain(|_, batches| {
            batches.retain(|e| e.first < end);
            !batches.is_empty()
        });
        self.end = end;
        self.stamp.cuts += 1;
    }

    /// Retention removed the log below `base`: the batches there are forgotten, and a
    /// producer left with none is unknown (`unknown_producer` past sequence 0), as a
    /// table built from the log after a restart has it. Kept, a live broker answered
    /// such a producer's re-send and appended its next batch, and the same requests
    /// after a restart were refused, fatally.
    pub fn trim_below(&mut self, base: u64) {
        self.producers.retain(|_, batches| {
            batches.retain(|e| e.first >= base);
            !batches.is_empty()
        });
        self.skip_to(base);
    }

    /// Where reading the log resumes.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Retention removed the log below `base` before the table read it: reading resumes
    /// there.
    pub fn skip_to(&mut self, base: u64) {
        self.end = self.end.max(base);
    }

    /// Decides batch `sequence` of `producer`, holding `contents`. A sequence the table
    /// holds for other contents is refused `sequence_reused` (a client that does not
    /// read that reason is told `invalid_request`: the session words it).
    pub fn decide(&self, producer: u64, sequence: u64, contents: Contents) -> Decision {
        let Some(batches) = self.producers.get(&producer) else {
            return if sequence == 0 && !self.forgotten_set.contains(&producer) {
                Decision::Append
            } else {
                Decision::Refuse(PublishRefusalReason::UnknownProducer)
            };
        };
        let last = batches.back().map_or(0, |e| e.sequence);
        if sequence == last + 1 {
            return Decision::Append;
        }
        if sequence > last + 1 {
            return Decision::Refuse(PublishRefusalReason::SequenceGap {
                expected: Sequence(last + 1),
            });
        }
        match batches.iter().find(|e| e.sequence == sequence) {
            Some(e) if e.contents != contents => {
                Decision::Refuse(PublishRefusalReason::SequenceReused)
            }
            Some(e) => Decision::Duplicate {
                first: e.first,
                end: e.first + u64::from(e.contents.records),
                pending: e.pending,
            },
            None => Decision::Refuse(PublishRefusalReason::SequenceExpired),
        }
    }

    /// As [`Self::decide`], for a log whose committed end is `committed_end`: a re-send
    /// of a batch still marked pending whose offsets the log has committed is a
    /// duplicate of a written batch. Its write was answered where nobody looked (the
    /// bookkeeping runs where the original's answer is awaited, and a connection that
    /// closed before its answers were sent never awaited them), so without this every
    /// re-send would be told to wait, for good.
    pub fn decide_committed(
        &mut self,
        producer: u64,
        sequence: u64,
        contents: Contents,
        committed_end: u64,
    ) -> Decision {
        match self.decide(producer, sequence, contents) {
            Decision::Duplicate {
                pending: true,
                first,
                end,
            } if end <= committed_end => {
                self.written(self.stamp, producer, sequence);
                Decision::Duplicate {
                    first,
                    end,
                    pending: false,
                }
            }
            d => d,
        }
    }

    fn record(&mut self, producer: u64, e: Entry) {
        if !self.producers.contains_key(&producer) && self.producers.len() >= PRODUCERS_MAX {
            // Forget the producer whose newest batch is oldest.
            if let Some(oldest) = self
                .producers
                .iter()
                .min_by_key(|(_, b)| b.back().map_or(0, |e| e.first))
                .map(|(p, _)| *p)
            {
                self.producers.remove(&oldest);
                if self.forgotten_set.insert(oldest) {
                    self.forgotten.push_back(oldest);
                }
                while self.forgotten.len() > FORGOTTEN_MAX {
                    if let Some(id) = self.forgotten.pop_front() {
                        self.forgotten_set.remove(&id);
                    }
                }
            }
        }
        let batches = self.producers.entry(producer).or_default();
        if let Some(existing) = batches.iter_mut().find(|x| x.sequence == e.sequence) {
            *existing = Entry {
                pending: existing.pending && e.pending,
                ..e
            };
            return;
        }
        if batches.back().is_some_and(|b| b.sequence > e.sequence) {
            return; // older than what is known: nothing to learn
        }
        batches.push_back(e);
        while batches.len() > WINDOW {
            batches.pop_front();
        }
    }

    /// A claim of `first..end` was made on the leader (tagged with `(producer_id,
    /// sequence)` and the batch's contents when idempotent): the table covers it without
    /// reading it back. False when the claim is not where the table ends (the table
    /// missed something and must be rebuilt).
    pub fn claimed(&mut self, first: u64, end: u64, tag: Option<Tagged>) -> bool {
        if first != self.end {
            return false;
        }
        if let Some(((producer, sequence), contents)) = tag {
            self.admitted(producer, sequence, first, contents);
        }
        self.end = end;
        true
    }

    /// This leader admitted `sequence` at `first`: pending until [`Self::written`].
    pub fn admitted(&mut self, producer: u64, sequence: u64, first: u64, contents: Contents) {
        self.record(
            producer,
            Entry {
                sequence,
                first,
                contents,
                pending: true,
            },
        );
    }

    /// The batch is in the log (durable), whatever the fate of its acknowledgement.
    /// Noted only where `stamp` (taken when it was admitted) still holds.
    pub fn written(&mut self, stamp: Stamp, producer: u64, sequence: u64) {
        if stamp != self.stamp {
            return;
        }
        if let Some(e) = self
            .producers
            .get_mut(&producer)
            .and_then(|b| b.iter_mut().find(|e| e.sequence == sequence))
        {
            e.pending = false;
        }
    }

    /// The batch never reached the log: it and every later batch of the producer are
    /// forgotten (their appends fail too), so the re-send appends. Noted only where
    /// `stamp` (taken when it was admitted) still holds.
    pub fn failed(&mut self, stamp: Stamp, producer: u64, sequence: u64) {
        if stamp != self.stamp {
            return;
        }
        if let Some(b) = self.producers.get_mut(&producer) {
            b.retain(|e| e.sequence < sequence);
            if b.is_empty() {
                self.producers.remove(&producer);
            }
        }
    }

    /// Reads tagged batches from the log below `to`, skipping what was already read.
    pub fn apply_batches(&mut self, batches: &[ReadBatch], to: u64) {
        for b in batches {
            if b.base_offset < self.end || b.base_offset >= to {
                continue;
            }
            if let (BatchKind::Data, Some(tag)) = (b.kind, b.producer) {
                self.record(
                    tag.producer_id,
                    Entry {
                        sequence: tag.sequence,
                        first: b.base_offset,
                        contents: Contents::of(&b.records),
                        pending: false,
                    },
                );
            }
            self.end = b.end_offset();
        }
    }
}

/// Log bytes written between two saves of a shard's producer table, by default.
pub const SNAPSHOT_EVERY_BYTES: u64 = 64 << 20;
/// Version of [`ProducerTable::snapshot`]'s layout.
const SNAPSHOT_VERSION: u16 = 1;
/// Bytes of one batch in a snapshot: sequence, first offset, records, bytes, CRC.
const SNAPSHOT_ENTRY_BYTES: usize = 8 + 8 + 4 + 8 + 4;

impl ProducerTable {
    /// The table as of `as_of` (every batch it holds below `as_of`, which must be
    /// durable, and the producers it forgot), for [`ProducerTable::from_snapshot`]:
    /// `u16 version (1), u32 producers`, then per producer `u64 id, u16 batches` and per
    /// batch `u64 sequence, u64 first, u32 records, u64 bytes, u32 crc`, then `u32
    /// forgotten` and their ids, oldest first (all big-endian). Batches at or past
    /// `as_of` (claims not durable yet) are left out: a build from the snapshot reads
    /// them from the log.
    pub fn snapshot(&self, as_of: u64) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            10 + self.producers.len() * (10 + 4 * SNAPSHOT_ENTRY_BYTES) + self.forgotten.len() * 8,
        );
        b.extend_from_slice(&SNAPSHOT_VERSION.to_be_bytes());
        let count_at = b.len();
        b.extend_from_slice(&0u32.to_be_bytes());
        let mut producers = 0u32;
        for (id, batches) in &self.producers {
            let below = batches.iter().take_while(|e| e.first < as_of).count();
            if below == 0 {
                continue;
            }
            producers += 1;
            b.extend_from_slice(&id.to_be_bytes());
            b.extend_from_slice(&(below as u16).to_be_bytes());
            for e in batches.iter().take(below) {
                b.extend_from_slice(&e.sequence.to_be_bytes());
                b.extend_from_slice(&e.first.to_be_bytes());
                b.extend_from_slice(&e.contents.records.to_be_bytes());
                b.extend_from_slice(&e.contents.bytes.to_be_bytes());
                b.extend_from_slice(&e.contents.crc.to_be_bytes());
            }
        }
        b[count_at..count_at + 4].copy_from_slice(&producers.to_be_bytes());
        b.extend_from_slice(&(self.forgotten.len() as u32).to_be_bytes());
        for id in &self.forgotten {
            b.extend_from_slice(&id.to_be_bytes());
        }
        b
    }

    /// The table [`ProducerTable::snapshot`] described as of `as_of`, reading the log on
    /// from there; `None` for anything that is not such a description (a layout of
    /// another version, a count past the table's bounds, batches out of order or at
    /// `as_of` and past, bytes left over).
    pub fn from_snapshot(as_of: u64, bytes: &[u8]) -> Option<ProducerTable> {
        let mut r = Reader(bytes);
        if r.u16()? != SNAPSHOT_VERSION {
            return None;
        }
        let mut table = ProducerTable::at(as_of);
        let producers = r.u32()? as usize;
        if producers > PRODUCERS_MAX {
            return None;
        }
        for _ in 0..producers {
            let id = r.u64()?;
            let count = r.u16()? as usize;
            if count == 0 || count > WINDOW || table.producers.contains_key(&id) {
                return None;
            }
            let mut batches: VecDeque<Entry> = VecDeque::with_capacity(count);
            for _ in 0..count {
                let entry = Entry {
                    sequence: r.u64()?,
                    first: r.u64()?,
                    contents: Contents {
                        records: r.u32()?,
                        bytes: r.u64()?,
                        crc: r.u32()?,
                    },
                    pending: false,
                };
                let ordered = batches
                    .back()
                    .is_none_or(|b| b.sequence < entry.sequence && b.first < entry.first);
                if !ordered || entry.first >= as_of {
                    return None;
                }
                batches.push_back(entry);
            }
            table.producers.insert(id, batches);
        }
        let forgotten = r.u32()? as usize;
        if forgotten > FORGOTTEN_MAX {
            return None;
        }
        for _ in 0..forgotten {
            let id = r.u64()?;
            if !table.forgotten_set.insert(id) {
                return None;
            }
            table.forgotten.push_back(id);
        }
        r.0.is_empty().then_some(table)
    }
}

/// Big-endian integers off the front of a snapshot.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_be_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use felix_storage_uring::ProducerTag;

    /// `k` records of `r`, as [`tagged`] writes them.
    fn n(k: usize) -> Contents {
        Contents::of(&vec![Bytes::from_static(b"r"); k])
    }

    fn tagged(base: u64, producer: u64, sequence: u64, n: usize) -> ReadBatch {
        ReadBatch {
            base_offset: base,
            timestamp_micros: 0,
            kind: BatchKind::Data,
            producer: Some(ProducerTag {
                producer_id: producer,
                sequence,
            }),
            records: vec![Bytes::from_static(b"r"); n],
        }
    }

    /// Retention forgets what it removed: a producer whose every batch went is unknown,
    /// as after a restart; one with a batch left keeps its place.
    #[test]
    fn retention_forgets_the_producers_it_removed() {
        let mut t = ProducerTable::at(0);
        for (producer, first) in [(7, 0), (8, 5), (8, 20)] {
            let sequence = u64::from(first == 20);
            t.admitted(producer, sequence, first, n(1));
            t.written(t.stamp(), producer, sequence);
        }
        t.trim_below(10);
        assert_eq!(
            t.decide(7, 1, n(1)),
            Decision::Refuse(PublishRefusalReason::UnknownProducer)
        );
        assert_eq!(t.decide(8, 2, n(1)), Decision::Append);
        assert_eq!(t.end(), 10);
    }

    #[test]
    fn the_next_sequence_appends_a_resend_is_answered_from_the_log() {
        let mut t = ProducerTable::at(0);
        assert_eq!(t.decide(7, 0, n(2)), Decision::Append);
        t.admitted(7, 0, 10, n(2));
        assert_eq!(
            t.decide(7, 0, n(2)),
            Decision::Duplicate {
                first: 10,
                end: 12,
                pending: true
            }
        );
        t.written(t.stamp(), 7, 0);
        assert_eq!(
            t.decide(7, 0, n(2)),
            Decision::Duplicate {
                first: 10,
                end: 12,
                pending: false
            }
        );
        assert_eq!(t.decide(7, 1, n(1)), Decision::Append);
        assert_eq!(
            t.decide(7, 3, n(1)),
            Decision::Refuse(PublishRefusalReason::SequenceGap {
                expected: Sequence(1)
            })
        );
        assert_eq!(
            t.decide(8, 4, n(1)),
            Decision::Refuse(PublishRefusalReason::UnknownProducer)
        );
        assert_eq!(
            t.decide(7, 0, n(5)),
            Decision::Refuse(PublishRefusalReason::SequenceReused)
        );
    }

    #[test]
    fn a_pending_batch_the_log_committed_is_a_written_one() {
        let mut t = ProducerTable::at(0);
        t.admitted(3, 0, 0, n(2));
        // Not yet committed: a re-send waits.
        assert_eq!(
            t.decide_committed(3, 0, n(2), 1),
            Decision::Duplicate {
                first: 0,
                end: 2,
                pending: true
            }
        );
        // Committed, though nobody marked it written: answered from the log, and
        // marked so.
        assert_eq!(
            t.decide_committed(3, 0, n(2), 2),
            Decision::Duplicate {
                first: 0,
                end: 2,
                pending: false
            }
        );
        assert_eq!(
            t.decide(3, 0, n(2)),
            Decision::Duplicate {
                first: 0,
                end: 2,
                pending: false
            }
        );
    }

    #[test]
    fn a_failed_append_is_forgotten_with_everything_after_it() {
        let mut t = ProducerTable::at(0);
        t.admitted(1, 0, 0, n(1));
        t.written(t.stamp(), 1, 0);
        t.admitted(1, 1, 1, n(1));
        t.admitted(1, 2, 2, n(1));
        t.failed(t.stamp(), 1, 1);
        assert_eq!(t.decide(1, 1, n(1)), Decision::Append);
        t.failed(t.stamp(), 1, 0);
        assert_eq!(t.decide(1, 0, n(1)), Decision::Append);
    }

    #[test]
    fn the_table_is_derived_from_the_log_and_old_sequences_expire() {
        let mut t = ProducerTable::at(5);
        let batches: Vec<_> = (0..70u64).map(|s| tagged(5 + s, 9, s, 1)).collect();
        t.apply_batches(&batches, 5 + 70);
        assert_eq!(t.end(), 75);
        assert_eq!(t.decide(9, 70, n(1)), Decision::Append);
        assert_eq!(
            t.decide(9, 69, n(1)),
            Decision::Duplicate {
                first: 74,
                end: 75,
                pending: false
            }
        );
        assert_eq!(
            t.decide(9, 2, n(1)),
            Decision::Refuse(PublishRefusalReason::SequenceExpired),
            "only the last {WINDOW} batches are remembered"
        );
        // Reading the same batches again changes nothing; a pending admission that the
        // log then shows is no longer pending.
        t.admitted(9, 70, 75, n(1));
        t.apply_batches(&[tagged(75, 9, 70, 1)], 76);
        assert_eq!(
            t.decide(9, 70, n(1)),
            Decision::Duplicate {
                first: 75,
                end: 76,
                pending: false
            }
        );
    }

    #[test]
    fn another_batch_under_a_known_sequence_is_refused_not_answered_from_the_log() {
        let mut t = ProducerTable::at(0);
        let batch = |bodies: &[&'static [u8]]| -> Vec<Bytes> {
            bodies.iter().map(|b| Bytes::from_static(b)).collect()
        };
        let original = batch(&[b"ab", b"c"]);
        t.admitted(4, 0, 0, Contents::of(&original));
        let reused = Decision::Refuse(PublishRefusalReason::SequenceReused);
        // Same count and bytes, other contents; the same bytes split otherwise; one
        // record fewer.
        for other in [
            batch(&[b"ab", b"d"]),
            batch(&[b"a", b"bc"]),
            batch(&[b"ab"]),
        ] {
            assert_eq!(t.decide(4, 0, Contents::of(&other)), reused, "{other:?}");
        }
        // Read back from the log (a rebuild): the same batch is still a re-send, another
        // one still refused.
        let mut rebuilt = ProducerTable::at(0);
        let mut b = tagged(0, 4, 0, 0);
        b.records = original.clone();
        rebuilt.apply_batches(&[b], 2);
        assert_eq!(
            rebuilt.decide(4, 0, Contents::of(&original)),
            Decision::Duplicate {
                first: 0,
                end: 2,
                pending: false
            }
        );
        assert_eq!(
            rebuilt.decide(4, 0, Contents::of(&batch(&[b"ab", b"d"]))),
            reused
        );
    }

    /// A full disk gave offsets back: the table's batches at or past the log's new end
    /// never reached it. Cut there, a producer's next batch is refused as a gap (it was
    /// appended ahead of the one lost), the lost one's re-send appends, and the lost
    /// one's late outcome is not noted in the table cut since (it could hit the
    /// re-send's entry at the same offsets).
    #[test]
    fn a_table_cut_where_a_full_disk_gave_offsets_back_forgets_what_was_lost() {
        let mut t = ProducerTable::at(0);
        assert!(t.claimed(0, 1, Some(((5, 0), n(1)))));
        t.written(t.stamp(), 5, 0);
        assert!(t.claimed(1, 2, Some(((5, 1), n(1)))));
        let admitted = t.stamp();
        t.cut_to(1);
        assert_eq!(t.end(), 1);
        assert_eq!(
            t.decide(5, 2, n(1)),
            Decision::Refuse(PublishRefusalReason::SequenceGap {
                expected: Sequence(1)
            })
        );
        assert_eq!(t.decide(5, 1, n(1)), Decision::Append);
        // The re-send appended at the same offsets; the original's failure comes late.
        assert!(t.claimed(1, 2, Some(((5, 1), n(1)))));
        t.failed(admitted, 5, 1);
        assert_eq!(
            t.decide(5, 1, n(1)),
            Decision::Duplicate {
                first: 1,
                end: 2,
                pending: true
            },
            "the re-send's entry stands"
        );
        // Another table (built since) takes no outcome of this one's claims.
        let mut rebuilt = ProducerTable::at(0);
        rebuilt.apply_batches(&[tagged(0, 5, 0, 1), tagged(1, 5, 1, 1)], 2);
        rebuilt.failed(t.stamp(), 5, 1);
        assert_eq!(rebuilt.decide(5, 2, n(1)), Decision::Append);
    }

    /// A producer forgotten for room (4,096 others published since) is refused
    /// `unknown_producer` at sequence 0 too: its re-send of a first batch whose answer
    /// was lost was taken for a new producer's and appended again.
    /// A log of tagged batches from more producers than the table keeps, some past
    /// the window, of 1 to 3 records of varied bytes: `(batches, end)`.
    fn busy_log() -> (Vec<ReadBatch>, u64) {
        let (mut batches, mut next, mut at) = (Vec::new(), HashMap::new(), 0u64);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..12_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A few busy producers throughout, new ones arriving all along.
            let producer = if x.is_multiple_of(3) {
                x % 7
            } else {
                100 + i / 2
            };
            let sequence = next.entry(producer).or_insert(0u64);
            let records: Vec<Bytes> = (0..1 + x % 3)
                .map(|r| Bytes::from(vec![(x >> r) as u8; 1 + (x % 5) as usize]))
                .collect();
            let len = records.len() as u64;
            batches.push(ReadBatch {
                base_offset: at,
                timestamp_micros: 0,
                kind: BatchKind::Data,
                producer: Some(ProducerTag {
                    producer_id: producer,
                    sequence: *sequence,
                }),
                records,
            });
            *sequence += 1;
            at += len;
        }
        (batches, at)
    }

    /// A table saved as of a batch boundary and the log read on from there is the table
    /// the whole log builds: the same batches of the same producers, the same producers
    /// forgotten for room, in the same order.
    #[test]
    fn a_snapshot_and_the_log_after_it_build_the_table_the_whole_log_builds() {
        let (batches, end) = busy_log();
        let mut whole = ProducerTable::at(0);
        whole.apply_batches(&batches, end);
        assert!(
            !whole.forgotten.is_empty(),
            "producers were forgotten for room"
        );
        assert!(whole.producers.values().any(|b| b.len() == WINDOW));
        for split in [0, 1, 500, 4_000, 9_000, 11_999, 12_000] {
            let as_of = batches.get(split).map_or(end, |b| b.base_offset);
            let mut before = ProducerTable::at(0);
            before.apply_batches(&batches[..split], as_of);
            let saved = before.snapshot(as_of);
            let mut t = ProducerTable::from_snapshot(as_of, &saved).expect("readable");
            assert_eq!(t.end(), as_of);
            t.apply_batches(&batches[split..], end);
            assert_eq!(t.producers, whole.producers, "split at {split}");
            assert_eq!(t.forgotten, whole.forgotten, "split at {split}");
            assert_eq!(t.end(), whole.end());
            // A live table holds claims past the offset too: left out, for the build
            // to read from the log.
            let live = ProducerTable::from_snapshot(as_of, &whole.snapshot(as_of)).unwrap();
            assert!(live.producers.values().flatten().all(|e| e.first < as_of));
            if split > 0 {
                // Described as of an earlier offset, it holds a batch at it: refused.
                let earlier = batches[split - 1].base_offset;
                assert!(ProducerTable::from_snapshot(earlier, &saved).is_none());
            }
        }
    }

    #[test]
    fn a_snapshot_cut_short_or_run_long_is_not_read() {
        let (batches, end) = busy_log();
        let mut t = ProducerTable::at(0);
        t.apply_batches(&batches[..300], end);
        let saved = t.snapshot(end);
        assert!(ProducerTable::from_snapshot(end, &saved).is_some());
        for cut in 0..saved.len() {
            assert!(
                ProducerTable::from_snapshot(end, &saved[..cut]).is_none(),
                "{cut}"
            );
        }
        let mut longer = saved.clone();
        longer.push(0);
        assert!(ProducerTable::from_snapshot(end, &longer).is_none());
        let mut other = saved;
        other[1] = 2;
        assert!(
            ProducerTable::from_snapshot(end, &other).is_none(),
            "another version"
        );
    }

    #[test]
    fn a_producer_forgotten_for_room_is_unknown_even_at_sequence_zero() {
        let mut t = ProducerTable::at(0);
        assert!(t.claimed(0, 1, Some(((1, 0), n(1)))));
        t.written(t.stamp(), 1, 0);
        for i in 0..PRODUCERS_MAX as u64 {
            assert!(t.claimed(1 + i, 2 + i, Some(((1000 + i, 0), n(1)))));
        }
        assert_eq!(
            t.decide(1, 0, n(1)),
            Decision::Refuse(PublishRefusalReason::UnknownProducer)
        );
        assert_eq!(t.decide(99_999, 0, n(1)), Decision::Append, "a new one");
    }

    /// A queued publish of `bytes` and its answer's receiver (dropped: its client
    /// left).
    fn queued(
        producer: u64,
        sequence: u64,
        bytes: usize,
    ) -> (
        Queued,
        futures_channel::oneshot::Receiver<
            Result<felix_storage_uring::Appended, crate::error::BrokerError>,
        >,
    ) {
        let (answer, rx) = futures_channel::oneshot::channel();
        let q = Queued {
            records: vec![Bytes::from(vec![0u8; bytes])],
            tag: (producer, sequence),
            answer,
        };
        (q, rx)
    }

    /// What `waiting` holds.
    fn held(waiting: &Waiting) -> usize {
        waiting.queue.iter().map(cost).sum()
    }

    /// Pushes `q` onto `queues[at]` as the core does, sweeping all of them when due.
    fn push(bound: &AbandonedBound, queues: &mut [Waiting], at: usize, q: Queued) {
        if bound.queued(queues[at].push(q)) {
            bound.sweep(&mut queues.iter_mut().collect::<Vec<_>>());
        }
    }

    /// Publishes queued for tables' builds whose clients left are dropped once they
    /// hold more than their bound, counted over all the core's queues (a bound per
    /// queue let shards opening at once hold it each): a client leaving and coming back
    /// 10,000 times with a 256 KiB batch to one of eight shards in turn (2.4 GiB)
    /// leaves at most twice the bound (plus the live ones) queued on the core, and the
    /// live ones keep their order.
    #[test]
    fn queued_publishes_whose_clients_left_are_dropped_past_the_cores_bound() {
        let bound = AbandonedBound::default();
        let mut queues: Vec<Waiting> = (0..8).map(|_| Waiting::default()).collect();
        let mut live = Vec::new();
        let mut most = 0;
        let one = cost(&queued(0, 0, 256 << 10).0);
        for i in 0..10_000u64 {
            let (q, rx) = queued(i, 0, 256 << 10);
            push(&bound, &mut queues, i as usize % 8, q);
            most = most.max(queues.iter().map(held).sum::<usize>());
            if i % 1_000 == 0 {
                live.push((i, rx));
            }
        }
        assert!(
            most <= 2 * ABANDONED_KEPT_BYTES + 11 * one,
            "{most} bytes held at most"
        );
        let mut kept = Vec::new();
        let mut served = 0;
        for w in &mut queues {
            let queue = w.take_to_serve();
            served += queue.len();
            kept.extend(queue.iter().filter(|q| !q.abandoned()).map(|q| q.tag.0));
            assert!(w.is_empty());
        }
        assert!(served <= 2 * 1_025 + 10, "{served} served");
        kept.sort_unstable();
        let want: Vec<u64> = live.iter().map(|(i, _)| *i).collect();
        assert_eq!(kept, want);
    }

    /// Under their bound, publishes whose clients left are kept and served in order,
    /// through a sweep: a producer whose connection died mid-pipeline, its next batch
    /// come on another connection, would otherwise be refused a gap for that next
    /// batch.
    #[test]
    fn an_abandoned_publish_under_the_bound_is_served() {
        let bound = AbandonedBound::default();
        let mut queues = vec![Waiting::default()];
        let (five, gone) = queued(7, 5, 1024);
        drop(gone);
        let (six, _six) = queued(7, 6, 1024);
        push(&bound, &mut queues, 0, five);
        push(&bound, &mut queues, 0, six);
        let mut live = Vec::new();
        let mut swept = false;
        while !swept {
            let (q, rx) = queued(8, live.len() as u64, 1 << 20);
            swept = bound.queued(queues[0].push(q));
            if swept {
                assert!(!bound.sweep(&mut [&mut queues[0]]), "nothing dropped");
            }
            live.push(rx);
        }
        let served: Vec<(u64, u64)> = queues[0]
            .take_to_serve()
            .iter()
            .take(2)
            .map(|q| q.tag)
            .collect();
        assert_eq!(served, [(7, 5), (7, 6)]);
    }

    /// A sweep that finds the abandoned ones within their bound is not run again before
    /// the bound's worth more has come (a push costs O(1) amortised), and the next one
    /// drops them once they are past it.
    #[test]
    fn a_sweep_waits_for_the_bounds_worth_more_and_then_drops() {
        let bound = AbandonedBound::default();
        let mut waiting = Waiting::default();
        let mut live = Vec::new();
        let mib = 1 << 20;
        let mut pushed = 0;
        loop {
            let (q, rx) = queued(0, 0, mib);
            live.push(rx);
            let bytes = waiting.push(q);
            pushed += bytes;
            if bound.queued(bytes) {
                assert!(
                    !bound.sweep(&mut [&mut waiting]),
                    "all live: nothing dropped"
                );
                break;
            }
        }
        assert!(pushed > ABANDONED_KEPT_BYTES);
        let before = waiting.len();
        let (mut since, mut most, mut dropped) = (0, 0, false);
        // Three times the bound's worth: the drop comes well within it.
        for _ in 0..3 * ABANDONED_KEPT_BYTES / mib {
            let (q, _gone) = queued(0, 0, mib);
            let bytes = waiting.push(q);
            since += bytes;
            most = most.max(held(&waiting));
            if bound.queued(bytes) {
                // (One that keeps them: the one pushed with it still live, they were
                // just within the bound.)
                assert!(since > ABANDONED_KEPT_BYTES, "a sweep after {since} bytes");
                since = 0;
                if bound.sweep(&mut [&mut waiting]) {
                    dropped = true;
                    break;
                }
            }
        }
        assert!(dropped, "the abandoned ones were never dropped");
        assert!(
            most <= pushed + 2 * ABANDONED_KEPT_BYTES + 2 * mib,
            "{most} bytes held at most"
        );
        // The one pushed with the sweep was still live then.
        assert_eq!(waiting.len(), before + 1, "the abandoned ones went");
    }
}
