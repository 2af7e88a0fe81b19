//! Atomic commit and state: one event and a set of state changes written as one record
//! (a `Commit` batch) on a stream shard, so every reader sees all of it or none.
//!
//! Readers of the data (subscriptions, groups) see only the event, at the commit's
//! offset. The shard's *state* (key → value, version) is the fold of its commits' changes;
//! the version of every key a commit writes is the commit's offset. The index is built
//! from the log the first time a shard's state is asked for, then kept current by each
//! acknowledged commit; it is dropped whenever the shard's frontier is reset (a replica
//! that starts or stops leading, or whose suffix was cut) and built again on demand.
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

/// A shard's state: key → (value, version).
#[derive(Debug, Default)]
pub struct StateIndex {
    values: HashMap<String, (Bytes, u64)>,
}

impl StateIndex {
    /// Applies a commit at `offset`.
    pub fn apply(&mut self, offset: u64, changes: &[Change]) {
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

    /// Applies every commit in `batches`.
    pub fn apply_batches(&mut self, batches: &[ReadBatch]) -> Result<(), BrokerError> {
        for b in batches.iter().filter(|b| b.kind == BatchKind::Commit) {
            let (_, changes) = b.records.first().and_then(decode).ok_or_else(|| {
                BrokerError::Storage(format!(
                    "offset {}: a commit record that cannot be read",
                    b.base_offset
                ))
            })?;
            self.apply(b.base_offset, &changes);
        }
        Ok(())
    }

    /// A key's value and version.
    pub fn get(&self, key: &str) -> Option<(Bytes, u64)> {
        self.values.get(key).cloned()
    }
}

/// A stream shard's state index, built on demand.
#[derive(Debug, Default)]
pub enum StateSlot {
    /// Not built (or dropped).
    #[default]
    Unbuilt,
    /// Being built from the log; commits acknowledged meanwhile wait here, applied
    /// once the scan is done.
    Building(Vec<(u64, Vec<Change>)>),
    /// Current up to the shard's frontier.
    Built(StateIndex),
}

impl StateSlot {
    /// Applies an acknowledged commit: to the index, or queued while it is built.
    pub fn applied(&mut self, offset: u64, changes: Vec<Change>) {
        match self {
            StateSlot::Unbuilt => {}
            StateSlot::Building(q) => q.push((offset, changes)),
            StateSlot::Built(i) => i.apply(offset, &changes),
        }
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

    #[test]
    fn the_index_keeps_the_last_write_and_its_version() {
        let mut i = StateIndex::default();
        i.apply(3, &[Change::Put("a".into(), Bytes::from_static(b"1"))]);
        i.apply(
            7,
            &[
                Change::Put("a".into(), Bytes::from_static(b"2")),
                Change::Put("b".into(), Bytes::from_static(b"x")),
            ],
        );
        i.apply(9, &[Change::Delete("b".into())]);
        assert_eq!(i.get("a"), Some((Bytes::from_static(b"2"), 7)));
        assert_eq!(i.get("b"), None);
        let mut slot = StateSlot::Building(Vec::new());
        slot.applied(10, vec![Change::Delete("a".into())]);
        assert!(matches!(&slot, StateSlot::Building(q) if q.len() == 1));
    }
}
