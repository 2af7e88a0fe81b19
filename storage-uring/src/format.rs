//! The on-disk format, version 1: every byte layout and every corruption verdict.
//!
//! A segment file is a 4096-byte header block followed by batches packed back to back.
//! Each append is one batch; a batch is never split across segments. All integers are
//! big-endian; checksums are CRC32C. See `docs/storage-format.md` for the full layout.
//!
//! Invariants this module enforces:
//! - a batch header is trusted only after its own CRC verified, and a body only after the
//!   body CRC verified, so a torn or foreign file can never make us serve garbage;
//! - lengths are bounded before anything is allocated for them;
//! - an all-zero header is "no more data", distinct from a damaged header.

use bytes::{BufMut, Bytes};

/// Alignment of every write and of the header block (O_DIRECT).
pub const BLOCK_BYTES: usize = 4096;
/// The smallest unit a disk writes whole: after a power cut each sector of an unsynced
/// write holds either all of its new bytes or all of its old ones. Recovery reads a
/// sector whose share of a damaged batch is all zeros as one that kept its old content.
pub const SECTOR_BYTES: usize = 512;
/// The header block at the start of every segment.
pub const SEGMENT_HEADER_BYTES: usize = BLOCK_BYTES;
/// `FXSG`.
pub const SEGMENT_MAGIC: u32 = 0x4658_5347;
/// `FXB1`.
pub const BATCH_MAGIC: u32 = 0x4658_4231;
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Fixed size of a batch header.
pub const BATCH_HEADER_BYTES: usize = 56;
/// Per-record length prefix.
pub const RECORD_PREFIX_BYTES: usize = 4;
/// Largest batch body accepted, checked before any allocation.
pub const MAX_BATCH_BODY_BYTES: usize = 64 * 1024 * 1024;
/// Most bytes of staged batches one flush round writes before its fdatasync. A batch is
/// never split, so a round passes this only when it is one batch larger than it. The
/// bound limits how much of the newest segment a power cut can find unsynced, which is
/// what lets recovery tell a torn last round from damage to synced data
/// ([`LAST_ROUND_REACH_BYTES`]). 8 MiB: larger than a round under ordinary load, so group
/// commit is unchanged there, while a backlog costs one fdatasync per 8 MiB.
pub const ROUND_BYTES_MAX: usize = 8 * 1024 * 1024;
/// How far past its first byte the data of an unsynced flush round can reach: a round
/// (less than [`ROUND_BYTES_MAX`] plus one whole batch) and a block of margin. Recovery
/// cuts damage in the newest segment that has data after it only when the file's last
/// non-zero byte lies within this distance of the damage; farther, the damage is in
/// data that was synced, and the log refuses to open. Changing this changes which logs
/// recovery accepts: it belongs to the format.
pub const LAST_ROUND_REACH_BYTES: u64 =
    (ROUND_BYTES_MAX + BATCH_HEADER_BYTES + MAX_BATCH_BODY_BYTES + BLOCK_BYTES) as u64;

/// What a batch holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchKind {
    /// Records published by clients.
    Data,
    /// One record whose payload is a generation (u64): the first thing a leader writes
    /// at a new generation. It takes an offset but is never delivered to readers of the
    /// data.
    GenerationStart,
    /// One record holding an atomic commit: an event and state changes (the broker's
    /// encoding). Readers of the data see only its event.
    Commit,
    /// Consumer-group events of the shard (the broker's encoding): replicated with the
    /// shard, never delivered to readers of the data.
    Group,
    /// Copies of state entries carried past retention (the broker's encoding):
    /// replicated with the shard, never delivered to readers of the data.
    State,
}

impl BatchKind {
    fn byte(self) -> u8 {
        match self {
            BatchKind::Data => 0,
            BatchKind::GenerationStart => 1,
            BatchKind::Commit => 2,
            BatchKind::Group => 3,
            BatchKind::State => 4,
        }
    }
}

/// A set of batch kinds: which kinds a segment may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KindSet(u8);

impl KindSet {
    /// Every kind (what a segment not read in full may hold).
    pub const ALL: KindSet = KindSet(0x1f);

    /// Adds `kind`.
    pub fn add(&mut self, kind: BatchKind) {
        self.0 |= 1 << kind.byte();
    }

    /// Both sets.
    pub fn union(self, other: KindSet) -> KindSet {
        KindSet(self.0 | other.0)
    }

    /// Whether `kind` is in the set.
    pub fn has(self, kind: BatchKind) -> bool {
        self.0 & (1 << kind.byte()) != 0
    }

    /// The set as stored (an index file's header): one bit per kind.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// A stored set; bits of kinds this version does not know are kept (a newer
    /// writer's kinds stay "may hold").
    pub fn from_bits(bits: u8) -> KindSet {
        KindSet(bits)
    }
}

/// An idempotent producer's tag on a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProducerTag {
    /// Producer.
    pub producer_id: u64,
    /// Batch number.
    pub sequence: u64,
}

/// A decoded batch header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// Offset of the first record.
    pub base_offset: u64,
    /// Records in the batch (at least 1).
    pub record_count: u32,
    /// Bytes after the header.
    pub body_len: u32,
    /// Append time.
    pub timestamp_micros: u64,
    /// Data or generation start.
    pub kind: BatchKind,
    /// Producer tag, if any.
    pub producer: Option<ProducerTag>,
    /// CRC32C of the body.
    pub body_crc: u32,
}

impl BatchHeader {
    /// Offset one past the last record.
    pub fn end_offset(&self) -> u64 {
        self.base_offset + u64::from(self.record_count)
    }

    /// Header plus body.
    pub fn total_len(&self) -> usize {
        BATCH_HEADER_BYTES + self.body_len as usize
    }
}

/// Why bytes are not a valid segment header or batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Fewer bytes than the structure needs.
    #[error("truncated: needs {needed} bytes, {available} available")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes there.
        available: usize,
    },
    /// Not `FXSG`.
    #[error("segment magic {found:#010x} is not FXSG")]
    SegmentMagic {
        /// What was there.
        found: u32,
    },
    /// A format version this build cannot read.
    #[error("segment format version {found} is not readable (this build reads {FORMAT_VERSION})")]
    SegmentVersion {
        /// What was there.
        found: u16,
    },
    /// Segment header checksum mismatch.
    #[error("segment header checksum mismatch")]
    SegmentHeaderChecksum,
    /// Not `FXB1` (and not zeros).
    #[error("batch magic {found:#010x} is not FXB1")]
    BatchMagic {
        /// What was there.
        found: u32,
    },
    /// Batch header checksum mismatch.
    #[error("batch header checksum mismatch")]
    BatchHeaderChecksum,
    /// Header fields that cannot be right even though the checksum matched.
    #[error("batch header is inconsistent: {0}")]
    BatchHeaderInvalid(&'static str),
    /// Body checksum mismatch.
    #[error("batch body checksum mismatch")]
    BatchBodyChecksum,
    /// Record lengths do not add up to the body length.
    #[error("record lengths do not add up to the batch body")]
    RecordLengths,
}

/// The header block of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Offset of the segment's first record.
    pub base_offset: u64,
    /// When the segment was created.
    pub created_at_micros: u64,
}

impl SegmentHeader {
    /// The header block, padded with zeros to [`SEGMENT_HEADER_BYTES`].
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(SEGMENT_HEADER_BYTES);
        b.put_u32(SEGMENT_MAGIC);
        b.put_u16(FORMAT_VERSION);
        b.put_u16(0);
        b.put_u64(self.base_offset);
        b.put_u64(self.created_at_micros);
        b.put_u32(BLOCK_BYTES as u32);
        let crc = crc32c::crc32c(&b);
        b.put_u32(crc);
        b.resize(SEGMENT_HEADER_BYTES, 0);
        b
    }

    /// Reads a header block.
    pub fn decode(bytes: &[u8]) -> Result<SegmentHeader, FormatError> {
        if bytes.len() < 32 {
            return Err(FormatError::Truncated {
                needed: 32,
                available: bytes.len(),
            });
        }
        let magic = be32(&bytes[0..4]);
        if magic != SEGMENT_MAGIC {
            return Err(FormatError::SegmentMagic { found: magic });
        }
        let version = u16::from_be_bytes([bytes[4], bytes[5]]);
        if version != FORMAT_VERSION {
            return Err(FormatError::SegmentVersion { found: version });
        }
        if crc32c::crc32c(&bytes[0..28]) != be32(&bytes[28..32]) {
            return Err(FormatError::SegmentHeaderChecksum);
        }
        Ok(SegmentHeader {
            base_offset: be64(&bytes[8..16]),
            created_at_micros: be64(&bytes[16..24]),
        })
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Appends one encoded batch to `out`. `records` must not be empty; lengths are the
/// caller's to bound (see [`MAX_BATCH_BODY_BYTES`]).
pub fn encode_batch<R: AsRef<[u8]>>(
    out: &mut Vec<u8>,
    base_offset: u64,
    timestamp_micros: u64,
    kind: BatchKind,
    producer: Option<ProducerTag>,
    records: &[R],
) {
    let body_len: usize = records
        .iter()
        .map(|r| RECORD_PREFIX_BYTES + r.as_ref().len())
        .sum();
    let start = out.len();
    out.reserve(BATCH_HEADER_BYTES + body_len);
    out.resize(start + BATCH_HEADER_BYTES, 0);
    for r in records {
        let r = r.as_ref();
        out.put_u32(r.len() as u32);
        out.put_slice(r);
    }
    let body_crc = crc32c::crc32c(&out[start + BATCH_HEADER_BYTES..]);
    let h = &mut out[start..start + BATCH_HEADER_BYTES];
    h[0..4].copy_from_slice(&BATCH_MAGIC.to_be_bytes());
    h[8..16].copy_from_slice(&base_offset.to_be_bytes());
    h[16..20].copy_from_slice(&(records.len() as u32).to_be_bytes());
    h[20..24].copy_from_slice(&(body_len as u32).to_be_bytes());
    h[24..32].copy_from_slice(&timestamp_micros.to_be_bytes());
    h[32] = kind.byte();
    h[33] = u8::from(producer.is_some());
    let tag = producer.unwrap_or(ProducerTag {
        producer_id: 0,
        sequence: 0,
    });
    h[36..44].copy_from_slice(&tag.producer_id.to_be_bytes());
    h[44..52].copy_from_slice(&tag.sequence.to_be_bytes());
    h[52..56].copy_from_slice(&body_crc.to_be_bytes());
    let header_crc = crc32c::crc32c(&h[8..56]);
    h[4..8].copy_from_slice(&header_crc.to_be_bytes());
}

/// The encoded size of a batch with these record lengths.
pub fn batch_len<R: AsRef<[u8]>>(records: &[R]) -> usize {
    BATCH_HEADER_BYTES
        + records
            .iter()
            .map(|r| RECORD_PREFIX_BYTES + r.as_ref().len())
            .sum::<usize>()
}

/// What the bytes at a batch position hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderRead {
    /// A verified header.
    Batch(BatchHeader),
    /// All zeros: no batch was ever written here.
    Zero,
}

/// Reads and verifies a batch header. Nothing in it is trusted before its CRC matched.
pub fn decode_batch_header(bytes: &[u8]) -> Result<HeaderRead, FormatError> {
    if bytes.len() < BATCH_HEADER_BYTES {
        if bytes.iter().all(|b| *b == 0) {
            return Ok(HeaderRead::Zero);
        }
        return Err(FormatError::Truncated {
            needed: BATCH_HEADER_BYTES,
            available: bytes.len(),
        });
    }
    let h = &bytes[..BATCH_HEADER_BYTES];
    let magic = be32(&h[0..4]);
    if magic != BATCH_MAGIC {
        if h.iter().all(|b| *b == 0) {
            return Ok(HeaderRead::Zero);
        }
        return Err(FormatError::BatchMagic { found: magic });
    }
    if crc32c::crc32c(&h[8..56]) != be32(&h[4..8]) {
        return Err(FormatError::BatchHeaderChecksum);
    }
    let record_count = be32(&h[16..20]);
    let body_len = be32(&h[20..24]);
    let kind = match h[32] {
        0 => BatchKind::Data,
        1 => BatchKind::GenerationStart,
        2 => BatchKind::Commit,
        3 => BatchKind::Group,
        4 => BatchKind::State,
        _ => return Err(FormatError::BatchHeaderInvalid("unknown batch kind")),
    };
    if h[33] > 1 || h[34] != 0 || h[35] != 0 {
        return Err(FormatError::BatchHeaderInvalid("unknown flag bits"));
    }
    if record_count == 0 {
        return Err(FormatError::BatchHeaderInvalid("zero records"));
    }
    if (body_len as usize) < record_count as usize * RECORD_PREFIX_BYTES
        || body_len as usize > MAX_BATCH_BODY_BYTES
    {
        return Err(FormatError::BatchHeaderInvalid("body length out of range"));
    }
    let base_offset = be64(&h[8..16]);
    if base_offset.checked_add(u64::from(record_count)).is_none() {
        return Err(FormatError::BatchHeaderInvalid("offset overflow"));
    }
    Ok(HeaderRead::Batch(BatchHeader {
        base_offset,
        record_count,
        body_len,
        timestamp_micros: be64(&h[24..32]),
        kind,
        producer: (h[33] == 1).then(|| ProducerTag {
            producer_id: be64(&h[36..44]),
            sequence: be64(&h[44..52]),
        }),
        body_crc: be32(&h[52..56]),
    }))
}

/// Verifies a body against its header and splits it into records, zero-copy.
pub fn decode_batch_body(header: &BatchHeader, body: &Bytes) -> Result<Vec<Bytes>, FormatError> {
    if body.len() != header.body_len as usize {
        return Err(FormatError::Truncated {
            needed: header.body_len as usize,
            available: body.len(),
        });
    }
    if crc32c::crc32c(body) != header.body_crc {
        return Err(FormatError::BatchBodyChecksum);
    }
    let mut records = Vec::with_capacity(header.record_count as usize);
    let mut pos = 0usize;
    for _ in 0..header.record_count {
        let Some(prefix) = body.get(pos..pos + RECORD_PREFIX_BYTES) else {
            return Err(FormatError::RecordLengths);
        };
        let len = be32(prefix) as usize;
        pos += RECORD_PREFIX_BYTES;
        if len > body.len() - pos {
            return Err(FormatError::RecordLengths);
        }
        records.push(body.slice(pos..pos + len));
        pos += len;
    }
    if pos != body.len() {
        return Err(FormatError::RecordLengths);
    }
    Ok(records)
}

/// Verifies a body's checksum and record lengths without slicing it.
pub fn verify_batch_body(header: &BatchHeader, body: &[u8]) -> Result<(), FormatError> {
    if body.len() != header.body_len as usize {
        return Err(FormatError::Truncated {
            needed: header.body_len as usize,
            available: body.len(),
        });
    }
    if crc32c::crc32c(body) != header.body_crc {
        return Err(FormatError::BatchBodyChecksum);
    }
    let mut pos = 0usize;
    for _ in 0..header.record_count {
        let Some(prefix) = body.get(pos..pos + RECORD_PREFIX_BYTES) else {
            return Err(FormatError::RecordLengths);
        };
        pos += RECORD_PREFIX_BYTES + be32(prefix) as usize;
        if pos > body.len() {
            return Err(FormatError::RecordLengths);
        }
    }
    if pos != body.len() {
        return Err(FormatError::RecordLengths);
    }
    Ok(())
}

/// Rounds up to the block size.
pub const fn align_up(v: u64) -> u64 {
    (v + BLOCK_BYTES as u64 - 1) & !(BLOCK_BYTES as u64 - 1)
}

/// Rounds down to the block size.
pub const fn align_down(v: u64) -> u64 {
    v & !(BLOCK_BYTES as u64 - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_round_trips_and_every_truncation_is_detected() {
        let mut out = Vec::new();
        let tag = ProducerTag {
            producer_id: 7,
            sequence: 3,
        };
        encode_batch(
            &mut out,
            42,
            9,
            BatchKind::Data,
            Some(tag),
            &[b"hi".as_slice(), b""],
        );
        assert_eq!(out.len(), batch_len(&[b"hi".as_slice(), b""]));
        let HeaderRead::Batch(h) = decode_batch_header(&out).unwrap() else {
            panic!("batch")
        };
        assert_eq!(h.base_offset, 42);
        assert_eq!(h.end_offset(), 44);
        assert_eq!(h.producer, Some(tag));
        let body = Bytes::copy_from_slice(&out[BATCH_HEADER_BYTES..]);
        let recs = decode_batch_body(&h, &body).unwrap();
        assert_eq!(recs, vec![Bytes::from_static(b"hi"), Bytes::new()]);
        for i in 0..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 0x40;
            let verdict = match decode_batch_header(&bad) {
                Ok(HeaderRead::Batch(h)) => {
                    decode_batch_body(&h, &Bytes::copy_from_slice(&bad[BATCH_HEADER_BYTES..]))
                        .map(|_| ())
                }
                Ok(HeaderRead::Zero) => Ok(()),
                Err(e) => Err(e),
            };
            assert!(verdict.is_err(), "flipping byte {i} must be detected");
        }
    }

    #[test]
    fn zeros_are_not_a_damaged_header() {
        assert_eq!(decode_batch_header(&[0u8; 100]), Ok(HeaderRead::Zero));
        assert_eq!(decode_batch_header(&[0u8; 10]), Ok(HeaderRead::Zero));
        assert!(decode_batch_header(&[1u8; 10]).is_err());
    }

    #[test]
    fn segment_header_round_trips_and_rejects_damage() {
        let h = SegmentHeader {
            base_offset: 1,
            created_at_micros: 2,
        };
        let b = h.encode();
        assert_eq!(b.len(), SEGMENT_HEADER_BYTES);
        assert_eq!(SegmentHeader::decode(&b), Ok(h));
        let mut bad = b.clone();
        bad[12] ^= 1;
        assert_eq!(
            SegmentHeader::decode(&bad),
            Err(FormatError::SegmentHeaderChecksum)
        );
        bad = b.clone();
        bad[5] = 9;
        assert!(matches!(
            SegmentHeader::decode(&bad),
            Err(FormatError::SegmentVersion { found: 9 })
        ));
    }
}
