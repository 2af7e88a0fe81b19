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
    let max_records = max_records.unwrap_or(1000).clamp(1, READ_RECORDS_MAX) as usize;
    let max_bytes = max_bytes.unwrap_or(READ_BYTES_MAX).clamp(1, READ_BYTES_MAX) as usize;
    let end = end.unwrap_or(u64::MAX);
    let (mut out, mut bytes, mut next) = (Vec::new(), 0usize, from);
    while next < end && out.len() < max_records {
        let batches = core.read(key.clone(), next, max_bytes).await?;
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
/// (yet). A linear walk over the shard's batches, a read of a few MiB at a time.
pub async fn offset_for_time(
    core: &Rc<CoreBroker>,
    key: Arc<ShardKey>,
    at_micros: u64,
) -> Result<Option<u64>, BrokerError> {
    let mut next = 0u64;
    loop {
        let batches = match core.read(key.clone(), next, READ_BYTES_MAX as usize).await {
            Ok(b) => b,
            // The oldest records are gone: start at the oldest retained.
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
            matches!(b.kind, BatchKind::Data | BatchKind::Commit) && b.timestamp_micros >= at_micros
        }) {
            return Ok(Some(b.base_offset));
        }
        if last_end <= next {
            return Ok(None);
        }
        next = last_end;
    }
}
