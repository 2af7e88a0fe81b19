//! The sparse offset index: one entry for a segment's first batch and then one at least
//! every `interval` bytes, mapping an offset to the byte position of the batch that
//! holds it.
//!
//! The index is derived, never trusted: it is rebuilt from the segment whenever the file
//! is missing, short, garbled or stale, so it is never fsynced. File layout (BE):
//! `FXIX` u32, version u16, kinds u16, base_offset u64, count u32, newest u32, then
//! count x (offset u64, position u64).
//!
//! `kinds` says which kinds of batch the sealed segment holds (a superset: a cut may
//! have removed some since): bit 15 set when known, bits 0-7 the
//! [`KindSet`]. Files written before it hold 0 there: unknown, so a reader takes every
//! kind as possible, as it does for any segment it did not read in full. It spares the
//! broker a read of the whole log after a restart to learn, say, that a stream holds no
//! consumer-group batches.
//!
//! `newest` is the segment's newest record's timestamp in seconds, rounded up, when bit
//! 14 of the kinds field is set (files written before 2026-12-08 hold 0 there and leave
//! the bit clear). An open that scans a sealed segment only from its last entry
//! (`VerifyOnOpen::Tail`) ages it by this: from the last batches alone it took the
//! segment for older than it is whenever timestamps inside it were not in order (a
//! clock stepped back, batches of two leaders), and age retention removed it early.

use bytes::BufMut;

use crate::format::{KindSet, SEGMENT_HEADER_BYTES};

/// Bit 15 of the header's kinds field: the low byte is a [`KindSet`].
const KINDS_KNOWN: u16 = 0x8000;
/// Bit 14 of the header's kinds field: the newest field holds the newest record's
/// timestamp, in seconds rounded up.
const NEWEST_KNOWN: u16 = 0x4000;

const INDEX_MAGIC: u32 = 0x4658_4958;
const INDEX_VERSION: u16 = 1;
const INDEX_HEADER_BYTES: usize = 24;

/// In-memory sparse index of one segment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SparseIndex {
    entries: Vec<(u64, u64)>,
}

impl SparseIndex {
    /// Records a batch at `position` starting at `offset`, if it is the first batch or at
    /// least `interval` bytes past the previous entry.
    pub fn observe(&mut self, offset: u64, position: u64, interval: u64) {
        match self.entries.last() {
            Some(&(_, last)) if position < last + interval => {}
            _ => self.entries.push((offset, position)),
        }
    }

    /// Byte position of the batch to start scanning from for `offset`.
    pub fn seek(&self, offset: u64) -> u64 {
        match self.entries.partition_point(|&(o, _)| o <= offset) {
            0 => SEGMENT_HEADER_BYTES as u64,
            i => self.entries[i - 1].1,
        }
    }

    /// Byte position of the first indexed batch starting after `offset`: the batch that
    /// holds `offset` ends at or before it. `None` past the last entry.
    pub fn next_after(&self, offset: u64) -> Option<u64> {
        let i = self.entries.partition_point(|&(o, _)| o <= offset);
        self.entries.get(i).map(|&(_, p)| p)
    }

    /// The last entry.
    pub fn last(&self) -> Option<(u64, u64)> {
        self.entries.last().copied()
    }

    /// Drops the last entry (a scan starting there re-adds it).
    pub fn truncate_last(&mut self) {
        self.entries.pop();
    }

    /// Drops the entries of batches at or after `offset` (a truncation cut them).
    pub fn retain_below(&mut self, offset: u64) {
        self.entries.retain(|&(o, _)| o < offset);
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The index file's bytes, for a segment that holds at most `kinds` and whose
    /// newest record's timestamp is `newest_micros`, when known (a segment read only
    /// from its index's last entry, whose index did not say, knows only its last
    /// batches').
    pub fn encode(&self, base_offset: u64, kinds: KindSet, newest_micros: Option<u64>) -> Vec<u8> {
        let mut b = Vec::with_capacity(INDEX_HEADER_BYTES + self.entries.len() * 16);
        b.put_u32(INDEX_MAGIC);
        b.put_u16(INDEX_VERSION);
        let known = if newest_micros.is_some() {
            NEWEST_KNOWN
        } else {
            0
        };
        b.put_u16(KINDS_KNOWN | known | u16::from(kinds.bits()));
        b.put_u64(base_offset);
        b.put_u32(self.entries.len() as u32);
        b.put_u32(newest_micros.map_or(0, |n| {
            u32::try_from(n.div_ceil(1_000_000)).unwrap_or(u32::MAX)
        }));
        for &(o, p) in &self.entries {
            b.put_u64(o);
            b.put_u64(p);
        }
        b
    }

    /// The newest record's timestamp an index file says its segment holds, in micros,
    /// rounded up to a second (never below it); `None` when it does not say.
    pub fn decode_newest(bytes: &[u8]) -> Option<u64> {
        let field = u16::from_be_bytes([*bytes.get(6)?, *bytes.get(7)?]);
        let secs = bytes.get(20..24)?;
        (field & NEWEST_KNOWN != 0)
            .then(|| u64::from(u32::from_be_bytes(secs.try_into().expect("4 bytes"))) * 1_000_000)
    }

    /// The kinds of batch an index file says its segment holds; `None` when it does not
    /// say (written before it could) or is too short to.
    pub fn decode_kinds(bytes: &[u8]) -> Option<KindSet> {
        let field = u16::from_be_bytes([*bytes.get(6)?, *bytes.get(7)?]);
        (field & KINDS_KNOWN != 0).then(|| KindSet::from_bits(field as u8))
    }

    /// Reads an index file, checking everything that can be checked without the segment:
    /// magic, version, base, strictly ascending offsets and positions inside
    /// `[header, data_len)`. `None` means "rebuild".
    pub fn decode(bytes: &[u8], base_offset: u64, data_len: u64) -> Option<SparseIndex> {
        let header = bytes.get(..INDEX_HEADER_BYTES)?;
        let be32 = |b: &[u8]| u32::from_be_bytes(b.try_into().expect("4 bytes"));
        let be64 = |b: &[u8]| u64::from_be_bytes(b.try_into().expect("8 bytes"));
        if be32(&header[0..4]) != INDEX_MAGIC
            || u16::from_be_bytes([header[4], header[5]]) != INDEX_VERSION
            || be64(&header[8..16]) != base_offset
        {
            return None;
        }
        let count = be32(&header[16..20]) as usize;
        let body = &bytes[INDEX_HEADER_BYTES..];
        if body.len() != count.checked_mul(16)? || count == 0 {
            return None;
        }
        let mut entries = Vec::with_capacity(count);
        let mut prev: Option<(u64, u64)> = None;
        for e in body.chunks_exact(16) {
            let (o, p) = (be64(&e[..8]), be64(&e[8..]));
            let in_range = o >= base_offset && p >= SEGMENT_HEADER_BYTES as u64 && p < data_len;
            let ascending = prev.is_none_or(|(po, pp)| o > po && p > pp);
            if !in_range || !ascending {
                return None;
            }
            entries.push((o, p));
            prev = Some((o, p));
        }
        if entries[0] != (base_offset, SEGMENT_HEADER_BYTES as u64) {
            return None;
        }
        Some(SparseIndex { entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::BatchKind;

    #[test]
    fn seek_finds_the_greatest_entry_at_or_below() {
        let mut idx = SparseIndex::default();
        idx.observe(10, 4096, 100);
        idx.observe(11, 4150, 100);
        idx.observe(20, 4300, 100);
        idx.observe(30, 4500, 100);
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.seek(5), 4096);
        assert_eq!(idx.seek(15), 4096);
        assert_eq!(idx.seek(20), 4300);
        assert_eq!(idx.seek(99), 4500);
    }

    #[test]
    fn damaged_index_files_are_refused() {
        let mut idx = SparseIndex::default();
        idx.observe(10, 4096, 1);
        idx.observe(20, 5000, 1);
        let bytes = idx.encode(10, KindSet::default(), None);
        assert_eq!(SparseIndex::decode(&bytes, 10, 6000), Some(idx.clone()));
        assert_eq!(SparseIndex::decode(&bytes, 11, 6000), None, "wrong base");
        assert_eq!(
            SparseIndex::decode(&bytes, 10, 4500),
            None,
            "stale: past data end"
        );
        assert_eq!(
            SparseIndex::decode(&bytes[..bytes.len() - 3], 10, 6000),
            None,
            "short"
        );
        let mut swapped = bytes.clone();
        swapped[24 + 16..24 + 24].copy_from_slice(&5u64.to_be_bytes());
        assert_eq!(
            SparseIndex::decode(&swapped, 10, 6000),
            None,
            "not ascending"
        );
        assert_eq!(SparseIndex::decode(b"junk", 10, 6000), None);
    }

    #[test]
    fn an_index_says_which_kinds_its_segment_holds_and_an_old_one_says_nothing() {
        let mut idx = SparseIndex::default();
        idx.observe(10, 4096, 1);
        let mut kinds = KindSet::default();
        kinds.add(BatchKind::Data);
        kinds.add(BatchKind::Group);
        let bytes = idx.encode(10, kinds, None);
        assert_eq!(SparseIndex::decode(&bytes, 10, 6000), Some(idx.clone()));
        let read = SparseIndex::decode_kinds(&bytes).unwrap();
        assert!(read.has(BatchKind::Group) && read.has(BatchKind::Data));
        assert!(!read.has(BatchKind::State) && !read.has(BatchKind::Commit));
        // Nothing but data is not "unknown".
        let plain = SparseIndex::decode_kinds(&idx.encode(10, KindSet::default(), None)).unwrap();
        assert!(!plain.has(BatchKind::Data));
        // A file from before the field: still a valid index, its kinds unknown.
        let mut old = bytes.clone();
        old[6..8].copy_from_slice(&[0, 0]);
        assert_eq!(SparseIndex::decode(&old, 10, 6000), Some(idx));
        assert_eq!(SparseIndex::decode_kinds(&old), None);
        assert_eq!(SparseIndex::decode_kinds(&bytes[..7]), None);
    }

    /// An index says its segment's newest timestamp, rounded up to a second (never
    /// below it); one from before the field says nothing, and still reads.
    #[test]
    fn an_index_says_its_segments_newest_timestamp_rounded_up() {
        let mut idx = SparseIndex::default();
        idx.observe(10, 4096, 1);
        let bytes = idx.encode(10, KindSet::default(), Some(5_000_001));
        assert_eq!(SparseIndex::decode_newest(&bytes), Some(6_000_000));
        assert_eq!(
            SparseIndex::decode_newest(&idx.encode(10, KindSet::default(), Some(5_000_000))),
            Some(5_000_000)
        );
        assert_eq!(
            SparseIndex::decode_newest(&idx.encode(10, KindSet::default(), Some(u64::MAX))),
            Some(u64::from(u32::MAX) * 1_000_000)
        );
        let mut old = bytes.clone();
        old[6..8].copy_from_slice(&(0x8000u16).to_be_bytes());
        old[20..24].copy_from_slice(&[0; 4]);
        assert_eq!(SparseIndex::decode_newest(&old), None);
        assert_eq!(
            idx.encode(10, KindSet::default(), None),
            old,
            "not known: said as before the field"
        );
        assert_eq!(SparseIndex::decode(&old, 10, 6000), Some(idx));
    }
}
