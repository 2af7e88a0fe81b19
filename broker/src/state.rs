//! Atomic commit and state: one event and a set of state changes written as one record
//! (a `Commit` batch) on a stream shard, so every reader sees all of it or none.
//!
//! Readers of the data (subscriptions, groups) see only the event, at the commit's
//! offset. The shard's *state* (key → value, version) is the fold of its commits' changes;
//! the version of every key a commit writes is the commit's offset. The index is derived
//! by reading the log: built the first time a shard's state is asked for, and caught up
//! to the shard's visible frontier before every read, so it holds exactly the commits a
//! reader may see, however they got into the log (this leader's writes, or a previous
//! leader's, shipped here and made visible when the commit mark passed them). It is
//! dropped whenever the shard's frontier is reset (a replica that starts or stops
//! leading, or whose suffix was cut) and built again on demand.
//!
//! Commit record (big-endian): `u8 version (1)`, `u32 event_len`, event, `u32 op_count`,
//! then per op `u8 op (0 put, 1 delete)`, `u32 key_len`, key (UTF-8), and for a put
//! `u32 value_len`, value.
//!
//! **Carried past retention.** A stream's retention removes whole old segments; the
//! state must not go with them. Before it removes segments below a cut, the leader
//! writes a `State` batch at the tail holding a *copy* of every live entry whose
//! newest record lies below the cut (key, value, and its version, which stays the
//! offset of the commit that wrote it), and retention never removes a segment holding
//! the newest record of a live entry (the index's [`StateIndex::floor`]). A copy is
//! written only while every commit this leader claimed is already in the index (no
//! commit lies between what the copy read and where it lands), so a copy states the
//! exact value of its keys at its own offset, and a fold of the log applies it as it
//! applies a commit. Copy record: `u8 version (1)`, `u32 count`, then per entry
//! `u32 key_len`, key, `u32 value_len`, value, `u64 version`.

use std::collections::HashMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use felix_storage_uring::{BatchKind, ReadBatch};

use crate::error::BrokerError;
use crate::session::dispatch::VALUE_MAX_BYTES;

/// Longest state key.
pub const STATE_KEY_MAX_BYTES: usize = 4096;
/// Changes one commit may carry.
pub const CHANGES_MAX: usize = 1024;

/// One state change of a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Set a key.
    Put(String, Bytes),
    /// Remove a key.
    Delete(String),
}

impl Change {
    fn key(&self) -> &str {
        match self {
            Change::Put(k, _) | Change::Delete(k) => k,
        }
    }
}

/// Checks a commit before anything is written.
pub fn check(changes: &[Change]) -> Result<(), BrokerError> {
    if changes.len() > CHANGES_MAX {
        return Err(BrokerError::InvalidRequest(format!(
            "a commit carries at most {CHANGES_MAX} changes"
        )));
    }
    for c in changes {
        if c.key().is_empty() || c.key().len() > STATE_KEY_MAX_BYTES {
            return Err(BrokerError::InvalidRequest(format!(
                "state keys are 1 to {STATE_KEY_MAX_BYTES} bytes"
            )));
        }
        if let Change::Put(_, v) = c
            && v.len() > VALUE_MAX_BYTES
        {
            return Err(BrokerError::InvalidRequest(format!(
                "state values are at most {VALUE_MAX_BYTES} bytes (this one is {}), so \
                 that every answer carrying one fits a frame",
                v.len()
            )));
        }
    }
    Ok(())
}

/// Encodes a commit record.
pub fn encode(event: &[u8], changes: &[Change]) -> Bytes {
    let size: usize = changes
        .iter()
        .map(|c| match c {
            Change::Put(k, v) => 9 + k.len() + v.len(),
            Change::Delete(k) => 5 + k.len(),
        })
        .sum();
    let mut b = BytesMut::with_capacity(9 + event.len() + size);
    b.put_u8(1);
    b.put_u32(event.len() as u32);
    b.put_slice(event);
    b.put_u32(changes.len() as u32);
    for c in changes {
        match c {
            Change::Put(k, v) => {
                b.put_u8(0);
                b.put_u32(k.len() as u32);
                b.put_slice(k.as_bytes());
                b.put_u32(v.len() as u32);
                b.put_slice(v);
            }
            Change::Delete(k) => {
                b.put_u8(1);
                b.put_u32(k.len() as u32);
                b.put_slice(k.as_bytes());
            }
        }
    }
    b.freeze()
}

/// Decodes a commit record: its event (a slice of `r`) and changes. `None` when
/// malformed.
pub fn decode(r: &Bytes) -> Option<(Bytes, Vec<Change>)> {
    let mut b = r.clone();
    let take_len =
        |b: &mut Bytes| -> Option<usize> { (b.remaining() >= 4).then(|| b.get_u32() as usize) };
    if b.remaining() < 1 || b.get_u8() != 1 {
        return None;
    }
    let n = take_len(&mut b)?;
    if b.remaining() < n {
        return None;
    }
    let event = b.split_to(n);
    let ops = take_len(&mut b)?;
    let mut changes = Vec::with_capacity(ops.min(CHANGES_MAX));
    for _ in 0..ops {
        if b.remaining() < 1 {
            return None;
        }
        let op = b.get_u8();
        let n = take_len(&mut b)?;
        if b.remaining() < n {
            return None;
        }
        let key = String::from_utf8(b.split_to(n).to_vec()).ok()?;
        changes.push(match op {
            0 => {
                let n = take_len(&mut b)?;
                if b.remaining() < n {
                    return None;
                }
                Change::Put(key, b.split_to(n))
            }
            1 => Change::Delete(key),
            _ => return None,
        });
    }
    b.is_empty().then_some((event, changes))
}

/// A batch as readers of the data see it: a commit shows only its event, as a data
/// record at the commit's offset. Other batches are unchanged.
pub fn readable(mut b: ReadBatch) -> ReadBatch {
    if b.kind == BatchKind::Commit {
        // One record a commit; should a batch hold more, each keeps its offset (a
        // reader slices by offset).
        b.records = b
            .records
            .iter()
            .map(|r| decode(r).map(|(e, _)| e).unwrap_or_default())
            .collect();
        b.kind = BatchKind::Data;
    }
    b
}

/// Encodes copies of state entries `(key, value, version)` as `State` batch records,
/// a record holding up to [`COPY_RECORD_BYTES`] (and at least one entry).
pub fn encode_copies(entries: &[(String, Bytes, u64)]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < entries.len() {
        let mut size = 5;
        let mut n = 0;
        while at + n < entries.len() {
            let (k, v, _) = &entries[at + n];
            let entry = 16 + k.len() + v.len();
            if n > 0 && size + entry > COPY_RECORD_BYTES {
                break;
            }
            size += entry;
            n += 1;
        }
        let mut b = BytesMut::with_capacity(size);
        b.put_u8(1);
        b.put_u32(n as u32);
        for (k, v, version) in &entries[at..at + n] {
            b.put_u32(k.len() as u32);
            b.put_slice(k.as_bytes());
            b.put_u32(v.len() as u32);
            b.put_slice(v);
            b.put_u64(*version);
        }
        out.push(b.freeze());
        at += n;
    }
    out
}

/// Decodes a copy record; `None` when malformed.
pub fn decode_copies(r: &Bytes) -> Option<Vec<(String, Bytes, u64)>> {
    let mut b = r.clone();
    if b.remaining() < 5 || b.get_u8() != 1 {
        return None;
    }
    let n = b.get_u32() as usize;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        if b.remaining() < 4 {
            return None;
        }
        let len = b.get_u32() as usize;
        if b.remaining() < len {
            return None;
        }
        let key = String::from_utf8(b.split_to(len).to_vec()).ok()?;
        if b.remaining() < 4 {
            return None;
        }
        let len = b.get_u32() as usize;
        if b.remaining() < len + 8 {
            return None;
        }
        let value = b.split_to(len);
        out.push((key, value, b.get_u64()));
    }
    b.is_empty().then_some(out)
}

/// The most a copy record holds (one larger entry gets a record of its own).
pub const COPY_RECORD_BYTES: usize = 256 << 10;

/// A shard's state: key → (value, version, offset of the record holding it), covering
/// the log below `end`.
#[derive(Debug, Default)]
pub struct StateIndex {
    values: HashMap<String, (Bytes, u64, u64)>,
    end: u64,
}

impl StateIndex {
    /// An empty index starting at the log's base.
    pub fn at(base: u64) -> StateIndex {
        StateIndex {
            values: HashMap::new(),
            end: base,
        }
    }

    /// Everything below this offset is applied.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Moves the applied end up to `base`, the log's new first offset after retention
    /// removed segments holding no commit and no copy (nothing below it changes state).
    pub fn skip_to(&mut self, base: u64) {
        self.end = self.end.max(base);
    }

    /// Applies a commit at `offset`. Values are copied out of the batches read: each a
    /// slice of the read's whole buffer (4 MiB), a small value held it all for as long
    /// as its key lived.
    fn apply(&mut self, offset: u64, changes: &[Change]) {
        for c in changes {
            match c {
                Change::Put(k, v) => {
                    let v = Bytes::copy_from_slice(v);
                    self.values.insert(k.clone(), (v, offset, offset));
                }
                Change::Delete(k) => {
                    self.values.remove(k);
                }
            }
        }
    }

    /// Applies the batches read from the log below `to`, skipping any already applied
    /// (two readers catching up at once read the same batches; the second applies
    /// nothing), and stopping at a batch that does not begin where the index ends: a
    /// read made for an index since dropped and rebuilt from the base (a replica that
    /// began leading) would otherwise move this one past every commit in between.
    pub fn apply_batches(&mut self, batches: &[ReadBatch], to: u64) -> Result<(), BrokerError> {
        for b in batches {
            if b.base_offset < self.end {
                continue;
            }
            if b.base_offset > self.end || b.base_offset >= to {
                break;
            }
            if b.kind == BatchKind::Commit {
                let (_, changes) = b.records.first().and_then(decode).ok_or_else(|| {
                    BrokerError::Storage(format!(
                        "offset {}: a commit record that cannot be read",
                        b.base_offset
                    ))
                })?;
                self.apply(b.base_offset, &changes);
            }
            if b.kind == BatchKind::State {
                for (i, r) in b.records.iter().enumerate() {
                    let copies = decode_copies(r).ok_or_else(|| {
                        BrokerError::Storage(format!(
                            "offset {}: a state copy that cannot be read",
                            b.base_offset + i as u64
                        ))
                    })?;
                    for (k, v, version) in copies {
                        let v = Bytes::copy_from_slice(&v);
                        self.values
                            .insert(k, (v, version, b.base_offset + i as u64));
                    }
                }
            }
            self.end = b.end_offset();
        }
        Ok(())
    }

    /// A key's value and version.
    pub fn get(&self, key: &str) -> Option<(Bytes, u64)> {
        self.values
            .get(key)
            .map(|(v, version, _)| (v.clone(), *version))
    }

    /// The live entries whose newest record lies below `cut`, as `(key, value,
    /// version)`: what a copy must carry before retention removes the log below `cut`.
    pub fn below(&self, cut: u64) -> Vec<(String, Bytes, u64)> {
        let mut out: Vec<_> = self
            .values
            .iter()
            .filter(|(_, (_, _, at))| *at < cut)
            .map(|(k, (v, version, _))| (k.clone(), v.clone(), *version))
            .collect();
        out.sort_unstable_by_key(|(_, _, version)| *version);
        out
    }

    /// The lowest offset holding the newest record of a live entry (`u64::MAX` when
    /// there is none): retention keeps it and everything after.
    pub fn floor(&self) -> u64 {
        self.values
            .values()
            .map(|(_, _, at)| *at)
            .min()
            .unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_records_round_trip_and_garbage_is_refused() {
        let changes = vec![
            Change::Put("balance".into(), Bytes::from_static(b"100")),
            Change::Delete("hold".into()),
            Change::Put(String::new(), Bytes::new()),
        ];
        let r = encode(b"deposited", &changes);
        assert_eq!(
            decode(&r),
            Some((Bytes::from_static(b"deposited"), changes))
        );
        assert_eq!(decode(&encode(b"", &[])), Some((Bytes::new(), vec![])));
        for cut in 0..r.len() {
            assert_eq!(decode(&r.slice(..cut)), None, "cut at {cut}");
        }
        let mut trailing = r.to_vec();
        trailing.push(0);
        assert_eq!(decode(&Bytes::from(trailing)), None);
    }

    fn commit_batch(base: u64, changes: &[Change]) -> ReadBatch {
        ReadBatch {
            base_offset: base,
            timestamp_micros: 0,
            kind: BatchKind::Commit,
            producer: None,
            records: vec![encode(b"e", changes)],
        }
    }

    /// The index holds its values, not the read buffers they were read in: a value
    /// sliced from its read's 4 MiB buffer kept all of it alive for as long as its key.
    #[test]
    fn the_index_holds_no_slice_of_the_buffer_its_values_were_read_in() {
        let record = encode(
            b"e",
            &[Change::Put("a".into(), Bytes::from_static(b"small"))],
        );
        let mut buffer = record.to_vec();
        buffer.resize(4 << 20, 0);
        let buffer = Bytes::from(buffer);
        let mut batch = commit_batch(0, &[]);
        batch.records = vec![buffer.slice(..record.len())];
        let mut i = StateIndex::at(0);
        i.apply_batches(&[batch], 1).unwrap();
        let (v, _) = i.get("a").unwrap();
        assert_eq!(v, Bytes::from_static(b"small"));
        let held = buffer.as_ptr_range();
        assert!(!held.contains(&v.as_ptr()), "a slice of the read's buffer");
    }

    #[test]
    fn the_index_keeps_the_last_write_and_its_version_and_applies_each_batch_once() {
        let put = |k: &str, v: &'static [u8]| Change::Put(k.into(), Bytes::from_static(v));
        let batches = vec![
            commit_batch(3, &[put("a", b"1")]),
            ReadBatch {
                base_offset: 4,
                timestamp_micros: 0,
                kind: BatchKind::Data,
                producer: None,
                records: vec![Bytes::from_static(b"plain"); 3],
            },
            commit_batch(7, &[put("a", b"2"), put("b", b"x")]),
            commit_batch(8, &[Change::Delete("b".into())]),
            commit_batch(9, &[put("a", b"not yet visible")]),
        ];
        let mut i = StateIndex::at(3);
        i.apply_batches(&batches, 9).unwrap();
        assert_eq!(i.end(), 9);
        assert_eq!(i.get("a"), Some((Bytes::from_static(b"2"), 7)));
        assert_eq!(i.get("b"), None);
        // A late reader of the same batches changes nothing; the next one goes on.
        i.apply_batches(&batches[..3], 9).unwrap();
        assert_eq!(i.get("a"), Some((Bytes::from_static(b"2"), 7)));
        i.apply_batches(&batches, 10).unwrap();
        assert_eq!(
            i.get("a"),
            Some((Bytes::from_static(b"not yet visible"), 9))
        );
    }

    /// A catch-up read made for an index that was dropped meanwhile (the replica began
    /// leading) lands on the one rebuilt from the base: it applies nothing rather than
    /// move the new index past the commits below the read, which `state_get` then did
    /// not see and retention removed without copying.
    #[test]
    fn batches_past_the_index_end_are_not_applied() {
        let put = |k: &str, v: &'static [u8]| Change::Put(k.into(), Bytes::from_static(v));
        let mut rebuilt = StateIndex::at(0);
        rebuilt
            .apply_batches(&[commit_batch(10, &[put("late", b"1")])], 20)
            .unwrap();
        assert_eq!(rebuilt.end(), 0, "the index still lacks offsets 0..10");
        assert_eq!(rebuilt.get("late"), None);
        // Its own read from the base then applies everything in order.
        let mut from_base = vec![commit_batch(0, &[put("early", b"0")])];
        from_base.push(ReadBatch {
            base_offset: 1,
            timestamp_micros: 0,
            kind: BatchKind::Data,
            producer: None,
            records: vec![Bytes::from_static(b"plain"); 9],
        });
        from_base.push(commit_batch(10, &[put("late", b"1")]));
        rebuilt.apply_batches(&from_base, 20).unwrap();
        assert_eq!(rebuilt.end(), 11);
        assert_eq!(rebuilt.get("early"), Some((Bytes::from_static(b"0"), 0)));
    }

    #[test]
    fn copies_carry_values_with_their_versions_and_move_the_floor_past_the_cut() {
        let put = |k: &str, v: &'static [u8]| Change::Put(k.into(), Bytes::from_static(v));
        let mut i = StateIndex::at(0);
        i.apply_batches(
            &[
                commit_batch(0, &[put("a", b"1"), put("b", b"2")]),
                commit_batch(1, &[put("c", b"3")]),
                ReadBatch {
                    base_offset: 2,
                    timestamp_micros: 0,
                    kind: BatchKind::Data,
                    producer: None,
                    records: vec![Bytes::from_static(b"plain"); 3],
                },
                commit_batch(5, &[put("b", b"4"), Change::Delete("c".into())]),
            ],
            6,
        )
        .unwrap();
        assert_eq!(i.floor(), 0, "a's newest record is at 0");
        // Retention would cut at 4: only `a` (at 0) must be carried; `c` is deleted.
        let below = i.below(4);
        assert_eq!(below, vec![("a".to_owned(), Bytes::from_static(b"1"), 0)]);
        let records = encode_copies(&below);
        assert_eq!(decode_copies(&records[0]), Some(below.clone()));
        i.apply_batches(
            &[ReadBatch {
                base_offset: 6,
                timestamp_micros: 0,
                kind: BatchKind::State,
                producer: None,
                records,
            }],
            10,
        )
        .unwrap();
        assert_eq!(
            i.get("a"),
            Some((Bytes::from_static(b"1"), 0)),
            "same version"
        );
        assert_eq!(i.floor(), 5, "now b's commit at 5 is the oldest needed");
        assert!(i.below(5).is_empty());
        // A fold that starts past the cut (segments below 4 gone) sees the same state.
        let mut after = StateIndex::at(4);
        after
            .apply_batches(
                &[
                    ReadBatch {
                        base_offset: 4,
                        timestamp_micros: 0,
                        kind: BatchKind::Data,
                        producer: None,
                        records: vec![Bytes::from_static(b"plain")],
                    },
                    commit_batch(5, &[put("b", b"4"), Change::Delete("c".into())]),
                    ReadBatch {
                        base_offset: 6,
                        timestamp_micros: 0,
                        kind: BatchKind::State,
                        producer: None,
                        records: encode_copies(&below),
                    },
                ],
                10,
            )
            .unwrap();
        for k in ["a", "b", "c"] {
            assert_eq!(after.get(k), i.get(k), "{k}");
        }
    }

    #[test]
    fn copy_records_split_large_state_and_refuse_garbage() {
        let entries: Vec<(String, Bytes, u64)> = (0..10u64)
            .map(|n| (format!("k{n}"), Bytes::from(vec![n as u8; 100 << 10]), n))
            .collect();
        let records = encode_copies(&entries);
        assert!(records.len() >= 4, "{} records", records.len());
        assert!(
            records
                .iter()
                .all(|r| r.len() <= COPY_RECORD_BYTES + (100 << 10))
        );
        let back: Vec<_> = records
            .iter()
            .flat_map(|r| decode_copies(r).unwrap())
            .collect();
        assert_eq!(back, entries);
        let r = &records[0];
        for cut in [0, 4, 5, 9, r.len() - 1] {
            assert_eq!(decode_copies(&r.slice(..cut)), None, "cut at {cut}");
        }
    }
}
