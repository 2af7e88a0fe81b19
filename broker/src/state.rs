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

use std::collections::HashMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use felix_storage_uring::{BatchKind, ReadBatch};

use crate::error::BrokerError;

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
        let event = b
            .records
            .first()
            .and_then(decode)
            .map(|(e, _)| e)
            .unwrap_or_default();
        b.records = vec![event];
        b.kind = BatchKind::Data;
    }
    b
}

/// A shard's state: key → (value, version), covering the log below `end`.
#[derive(Debug, Default)]
pub struct StateIndex {
    values: HashMap<String, (Bytes, u64)>,
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

    /// Applies a commit at `offset`.
    fn apply(&mut self, offset: u64, changes: &[Change]) {
        for c in changes {
            match c {
                Change::Put(k, v) => {
                    self.values.insert(k.clone(), (v.clone(), offset));
                }
                Change::Delete(k) => {
                    self.values.remove(k);
                }
            }
        }
    }

    /// Applies the batches read from the log below `to`, skipping any already applied
    /// (two readers catching up at once read the same batches; the second applies
    /// nothing).
    pub fn apply_batches(&mut self, batches: &[ReadBatch], to: u64) -> Result<(), BrokerError> {
        for b in batches {
            if b.base_offset < self.end || b.base_offset >= to {
                continue;
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
            self.end = b.end_offset();
        }
        Ok(())
    }

    /// A key's value and version.
    pub fn get(&self, key: &str) -> Option<(Bytes, u64)> {
        self.values.get(key).cloned()
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
}
