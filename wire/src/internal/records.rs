//! `Records` (kind 20): log shipping, and the answer to `Fetch`.
//!
//! Body after the correlation id: `shard`, `generation u64`, `leader`, `prev_offset u64`,
//! `prev_generation u64`, `commit u64`, `batches_crc32c u32`, then the batches section:
//! `batch_count u32` and per batch `base_offset u64`, `timestamp_micros u64`, `kind u8`,
//! `record_count u32`, and per record `len u32` + bytes. The section runs to the end of
//! the payload and its CRC-32C (Castagnoli) is checked before any of it is parsed, so a
//! flipped bit is a checksum mismatch, never a mis-read length.
//!
//! What must stay true of a decoded (or encoded) message: every batch has at least one
//! record; each batch starts where the previous one ended; at most
//! [`MAX_RECORDS_PER_MESSAGE`] records in all; and `prev_offset` is the offset just
//! before the first batch unless `prev_offset`/`prev_generation` are 0/0.

use bytes::{BufMut, Bytes, BytesMut};

use super::MAX_RECORDS_PER_MESSAGE;
use super::codec::{self, Cursor, LEADER};
use super::error::BodyError;
use super::message::{Body, ShardRef};
use crate::ids::{Generation, Offset};

/// Bytes of a batch with one empty record: the least a batch can take.
const MIN_BATCH_BYTES: usize = 8 + 8 + 1 + 4 + 4;

/// What a batch holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchKind {
    /// Records published by clients (byte 0).
    Data,
    /// The record a new leader appends at the start of its generation (byte 1); never
    /// delivered to readers.
    GenerationStart,
    /// An atomic commit: one record, an event and state changes (byte 2).
    Commit,
    /// Consumer-group events of the shard (byte 3).
    Group,
    /// Copies of state entries carried past retention (byte 4); never delivered to
    /// readers.
    State,
}

impl BatchKind {
    /// The wire byte.
    pub fn byte(self) -> u8 {
        match self {
            BatchKind::Data => 0,
            BatchKind::GenerationStart => 1,
            BatchKind::Commit => 2,
            BatchKind::Group => 3,
            BatchKind::State => 4,
        }
    }

    /// Reads a wire byte.
    pub fn from_byte(byte: u8) -> Result<BatchKind, BodyError> {
        match byte {
            0 => Ok(BatchKind::Data),
            1 => Ok(BatchKind::GenerationStart),
            2 => Ok(BatchKind::Commit),
            3 => Ok(BatchKind::Group),
            4 => Ok(BatchKind::State),
            byte => Err(BodyError::UnknownBatchKind { byte }),
        }
    }
}

/// Records appended together. Record `i` is at `base_offset + i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShipBatch {
    /// Offset of the first record.
    pub base_offset: Offset,
    /// Append time on the leader, microseconds since the Unix epoch.
    pub timestamp_micros: u64,
    /// Data or generation start.
    pub kind: BatchKind,
    /// An idempotent producer's `(producer_id, sequence)` on a data batch. On the wire
    /// the kind byte then has its high bit set and the two u64 follow it.
    pub producer: Option<(u64, u64)>,
    /// The records (at least one); zero-copy slices of the received frame.
    pub records: Vec<Bytes>,
}

/// The kind byte's flag for a producer tag.
const PRODUCER_TAGGED: u8 = 0x80;

/// Kind 20: records shipped by the leader (or returned for a `Fetch`). Answered
/// `ReplicateOk` or `ReplicateRefused`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Records {
    /// Echoed in the answer.
    pub correlation_id: u64,
    /// The shard.
    pub shard: ShardRef,
    /// The sender's generation.
    pub generation: Generation,
    /// The sender's node id (at most 512 bytes).
    pub leader: String,
    /// The offset of the record just before the first batch (0 with `prev_generation`
    /// 0 when the first batch starts at the log's base).
    pub prev_offset: Offset,
    /// The generation that wrote the record at `prev_offset`.
    pub prev_generation: Generation,
    /// The sender's commit offset: records below it are never rewritten.
    pub commit: Offset,
    /// Contiguous, non-empty batches; empty when there is nothing to ship.
    pub batches: Vec<ShipBatch>,
}

/// Running checks over the batches, shared by the encoder and the decoder so they refuse
/// the same messages. Called before a batch's records are allocated.
struct Tally {
    index: usize,
    records: usize,
    next: Option<Offset>,
}

impl Tally {
    fn new() -> Self {
        Self {
            index: 0,
            records: 0,
            next: None,
        }
    }

    fn batch(
        &mut self,
        base_offset: Offset,
        kind: BatchKind,
        record_count: usize,
    ) -> Result<(), BodyError> {
        let index = self.index;
        if record_count == 0 {
            return Err(BodyError::EmptyBatch { index });
        }
        if kind == BatchKind::Commit && record_count != 1 {
            return Err(BodyError::CommitNotOneRecord {
                index,
                count: record_count,
            });
        }
        self.records = self.records.saturating_add(record_count);
        if self.records > MAX_RECORDS_PER_MESSAGE {
            return Err(BodyError::TooManyRecords {
                count: self.records,
                max: MAX_RECORDS_PER_MESSAGE,
            });
        }
        if let Some(expected) = self.next
            && expected != base_offset
        {
            return Err(BodyError::NotContiguous {
                index,
                expected,
                found: base_offset,
            });
        }
        let end = base_offset
            .0
            .checked_add(record_count as u64)
            .ok_or(BodyError::OffsetOverflow { index })?;
        self.next = Some(Offset(end));
        self.index += 1;
        Ok(())
    }
}

impl Records {
    /// `prev_offset` names the record just before the first batch, unless 0/0.
    fn check_prev(&self) -> Result<(), BodyError> {
        let Some(first) = self.batches.first() else {
            return Ok(());
        };
        let at_base = self.prev_offset == Offset(0) && self.prev_generation == Generation(0);
        if !at_base && self.prev_offset.0.checked_add(1) != Some(first.base_offset.0) {
            return Err(BodyError::PrevMismatch {
                prev_offset: self.prev_offset,
                first_base: first.base_offset,
            });
        }
        Ok(())
    }

    fn check(&self) -> Result<(), BodyError> {
        let mut tally = Tally::new();
        for batch in &self.batches {
            tally.batch(batch.base_offset, batch.kind, batch.records.len())?;
        }
        self.check_prev()
    }

    fn get_batches(s: &mut Cursor<'_>) -> Result<Vec<ShipBatch>, BodyError> {
        let count = s.count(MIN_BATCH_BYTES, "batch count")?;
        if count > MAX_RECORDS_PER_MESSAGE {
            // Every batch holds a record: this many batches are too many records.
            return Err(BodyError::TooManyRecords {
                count,
                max: MAX_RECORDS_PER_MESSAGE,
            });
        }
        let mut tally = Tally::new();
        let mut batches = Vec::with_capacity(count);
        for _ in 0..count {
            let base_offset = Offset(s.u64("base_offset")?);
            let timestamp_micros = s.u64("timestamp_micros")?;
            let kind_byte = s.u8("batch kind")?;
            let kind = BatchKind::from_byte(kind_byte & !PRODUCER_TAGGED)?;
            let producer = if kind_byte & PRODUCER_TAGGED != 0 {
                if kind != BatchKind::Data {
                    return Err(BodyError::UnknownBatchKind { byte: kind_byte });
                }
                Some((s.u64("producer_id")?, s.u64("sequence")?))
            } else {
                None
            };
            let record_count = s.count(4, "record count")?;
            tally.batch(base_offset, kind, record_count)?;
            let mut records = Vec::with_capacity(record_count);
            for _ in 0..record_count {
                let len = s.u32("record length")? as usize;
                records.push(s.bytes(len, "record")?);
            }
            batches.push(ShipBatch {
                base_offset,
                timestamp_micros,
                kind,
                producer,
                records,
            });
        }
        Ok(batches)
    }
}

impl Body for Records {
    fn len_hint(&self) -> usize {
        let section: usize = self
            .batches
            .iter()
            .map(|b| {
                21 + 16 * usize::from(b.producer.is_some())
                    + b.records.iter().map(|r| 4 + r.len()).sum::<usize>()
            })
            .sum();
        self.shard.len() + 4 + self.leader.len() + 36 + 4 + section
    }

    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        self.check()?;
        self.shard.put(buf)?;
        buf.put_u64(self.generation.0);
        codec::put_str(buf, LEADER, &self.leader)?;
        buf.put_u64(self.prev_offset.0);
        buf.put_u64(self.prev_generation.0);
        buf.put_u64(self.commit.0);
        let crc_at = buf.len();
        buf.put_u32(0);
        let section_start = buf.len();
        // Counts are at most MAX_RECORDS_PER_MESSAGE (checked above). A record over
        // u32::MAX bytes makes the payload too long to frame, and the frame is refused.
        buf.put_u32(self.batches.len() as u32);
        for batch in &self.batches {
            buf.put_u64(batch.base_offset.0);
            buf.put_u64(batch.timestamp_micros);
            match batch.producer {
                Some((id, sequence)) if batch.kind == BatchKind::Data => {
                    buf.put_u8(batch.kind.byte() | PRODUCER_TAGGED);
                    buf.put_u64(id);
                    buf.put_u64(sequence);
                }
                _ => buf.put_u8(batch.kind.byte()),
            }
            buf.put_u32(batch.records.len() as u32);
            for record in &batch.records {
                buf.put_u32(record.len() as u32);
                buf.put_slice(record);
            }
        }
        let crc = crc32c::crc32c(&buf[section_start..]);
        buf[crc_at..section_start].copy_from_slice(&crc.to_be_bytes());
        Ok(())
    }

    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        let shard = ShardRef::get(r)?;
        let generation = Generation(r.u64("generation")?);
        let leader = r.string(LEADER)?;
        let prev_offset = Offset(r.u64("prev_offset")?);
        let prev_generation = Generation(r.u64("prev_generation")?);
        let commit = Offset(r.u64("commit")?);
        let carried = r.u32("batches_crc32c")?;
        let section = r.rest();
        let computed = crc32c::crc32c(&section);
        if carried != computed {
            return Err(BodyError::ChecksumMismatch { carried, computed });
        }
        let mut s = Cursor::new(&section);
        let batches = Records::get_batches(&mut s)?;
        s.finish()?;
        let records = Records {
            correlation_id,
            shard,
            generation,
            leader,
            prev_offset,
            prev_generation,
            commit,
            batches,
        };
        records.check_prev()?;
        Ok(records)
    }
}
