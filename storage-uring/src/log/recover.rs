//! Recovery at open: finds the segments, discards an interrupted roll, finishes an
//! interrupted truncation or reset (step 6d of the module docs of [`crate::log`]), scans
//! and repairs the newest segment's torn tail, and loads or rebuilds the indexes. See
//! `docs/storage-format.md`, "Recovery".

use std::collections::VecDeque;
use std::rc::Rc;

use super::{LogConfig, RecoveryReport, TornTail, VerifyOnOpen, create_segment, cut};
use crate::error::{Corruption, CorruptionKind, StorageError};
use crate::format::{
    self, BATCH_HEADER_BYTES, HeaderRead, KindSet, LAST_ROUND_REACH_BYTES, SEGMENT_HEADER_BYTES,
    SegmentHeader,
};
use crate::index::SparseIndex;
use crate::io::{Backend, SegmentFile};
use crate::segment::{self, Segment, index_name, parse_segment_name, segment_name};

/// Recovery: see `docs/storage-format.md`, "Recovery".
pub(super) async fn recover<B: Backend>(
    backend: &B,
    config: &LogConfig,
) -> Result<(VecDeque<Segment<B::File>>, RecoveryReport), StorageError> {
    let mut report = RecoveryReport::default();
    let mut bases = Vec::new();
    let mut indexes = Vec::new();
    // Metadata files (step 7) and the intent file are not segments: they are skipped.
    for name in backend
        .list()
        .await
        .map_err(|e| StorageError::io("list", "log directory", e))?
    {
        match parse_segment_name(&name) {
            None => indexes.extend(segment::parse_index_name(&name)),
            Some(Ok(base)) => bases.push(base),
            Some(Err(reason)) => return Err(StorageError::ForeignFile { name, reason }),
        }
    }
    bases.sort_unstable();
    // A life under `none` or `periodic` that did not close cleanly may have left any
    // part of the newest segment unsynced (step 5); one under `on-commit`, one round.
    let unsynced_life = backend
        .read_small(super::UNSYNCED_LIFE)
        .await
        .map_err(|e| StorageError::io("read", super::UNSYNCED_LIFE, e))?
        .is_some();
    report.unsynced_life = unsynced_life;
    let intent = cut::read_intent(backend, config.read_only).await?;
    let mut fresh_base = 0;
    if let Some(intent) = intent {
        fresh_base = cut::remove_cut_segments(backend, &mut bases, intent).await?;
    }

    // An interrupted roll leaves a newest segment with no durable header: it never held
    // an acknowledged record, so it is discarded.
    while let Some(&base) = bases.last() {
        let name = segment_name(base);
        let file = backend
            .open(&name, false)
            .await
            .map_err(|e| StorageError::io("open", &name, e))?;
        let len = file
            .size()
            .await
            .map_err(|e| StorageError::io("stat", &name, e))?;
        let head = file
            .read_at(0, SEGMENT_HEADER_BYTES)
            .await
            .map_err(|e| StorageError::io("read header", &name, e))?;
        let blank = SegmentHeader::decode(&head).is_err()
            && segment::first_nonzero(&file, 0, len)
                .await
                .map_err(|e| StorageError::io("scan", &name, e))?
                .is_none();
        if !blank {
            break;
        }
        report.discarded_segments += 1;
        fresh_base = base;
        bases.pop();
        if config.read_only {
            continue;
        }
        backend
            .remove(&name)
            .await
            .map_err(|e| StorageError::io("remove blank segment", &name, e))?;
        let _ = backend.remove(&index_name(base)).await;
        backend
            .sync_dir()
            .await
            .map_err(|e| StorageError::io("sync_dir", "log directory", e))?;
    }

    let mut segments = VecDeque::new();
    let mut expected: Option<u64> = None;
    for (i, &base) in bases.iter().enumerate() {
        let newest = i + 1 == bases.len();
        let name = segment_name(base);
        let io = |op| move |e| StorageError::io(op, &segment_name(base), e);
        let file = backend.open(&name, false).await.map_err(io("open"))?;
        let len = file.size().await.map_err(io("stat"))?;
        let head = file
            .read_at(0, SEGMENT_HEADER_BYTES)
            .await
            .map_err(io("read header"))?;
        let corrupt = |position, kind| {
            StorageError::Corrupt(Corruption {
                segment: name.clone(),
                position,
                offset: expected,
                kind,
            })
        };
        let header = SegmentHeader::decode(&head).map_err(|e| corrupt(0, e.into()))?;
        if header.base_offset != base {
            return Err(corrupt(
                0,
                CorruptionKind::BaseMismatch {
                    name: base,
                    header: header.base_offset,
                },
            ));
        }
        if let Some(expected) = expected
            && expected != base
        {
            return Err(corrupt(
                0,
                CorruptionKind::OffsetGap {
                    expected,
                    found: base,
                },
            ));
        }
        let mut index = SparseIndex::default();
        let mut start = (SEGMENT_HEADER_BYTES as u64, base);
        let (loaded, loaded_kinds, loaded_newest) = if newest {
            (None, None, None)
        } else {
            load_index(backend, &file, base, len)
                .await
                .map_or((None, None, None), |(i, k, n)| (Some(i), k, n))
        };
        if let (Some(loaded), VerifyOnOpen::Tail) = (&loaded, config.verify_on_open) {
            let (o, p) = loaded.last().expect("decoded indexes are non-empty");
            start = (p, o);
            index = loaded.clone();
            // The scan below re-observes the entry it starts from.
            index.truncate_last();
        }
        // Under on-commit every round is synced before the next one is written, so damage
        // farther than a round from the end lies in synced data. After a life under
        // none or periodic (its mark still there: it did not close cleanly) any part of
        // the newest segment may be unsynced (only a roll, a close or the timer synced),
        // and a power cut can leave a lost sector anywhere in it. The mode of the life
        // that wrote, not of this open: a log written under on-commit keeps the strict
        // reach whatever it is opened under.
        let tail_reach = newest.then_some(if unsynced_life {
            u64::MAX
        } else {
            LAST_ROUND_REACH_BYTES
        });
        let end = segment::scan(
            &file,
            &name,
            len,
            start.0,
            start.1,
            tail_reach,
            &mut index,
            config.index_interval_bytes,
        )
        .await?;
        report.verified_bytes += end.data_len - start.0;
        if let Some(torn) = end.torn_at {
            let pos = torn.pos;
            if !config.read_only {
                file.truncate(pos).await.map_err(io("truncate torn tail"))?;
                file.sync_data().await.map_err(io("fsync repair"))?;
            }
            report.truncated_bytes += len - pos;
            report.torn_tail = Some(TornTail {
                segment: name.clone(),
                position: pos,
                bytes: len - pos,
                first_offset: end.end_offset,
                records: torn.records,
                data_after: torn.data_after,
                cause: torn.cause,
            });
        } else if newest && !config.read_only {
            // What the last life wrote and never synced (a kill between a round's write
            // and its fdatasync, or `fsync: none`) is read, shipped and counted durable
            // from the moment the log opens: make it so, or a power cut before this
            // life's first fdatasync takes records readers saw and copies counted.
            file.sync_data().await.map_err(io("fsync at open"))?;
        }
        // A scan from the last index entry saw only the segment's last batches: the
        // index file says what the rest holds, or nothing (then it may hold anything).
        let read_whole = start.0 == SEGMENT_HEADER_BYTES as u64;
        let kinds = if read_whole {
            end.kinds
        } else {
            loaded_kinds.map_or(KindSet::ALL, |k| k.union(end.kinds))
        };
        // Likewise its newest timestamp: from the last batches alone a segment whose
        // timestamps are not in order looked older than it is.
        let newest_micros = if read_whole {
            Some(end.max_timestamp_micros)
        } else {
            loaded_newest.map(|n| n.max(end.max_timestamp_micros))
        };
        let stale = loaded.as_ref() != Some(&index);
        // Read in full: an index file that says other kinds or another newest
        // timestamp (or none: written before the field) is written again, so a later
        // open from it knows them.
        let header_stale = read_whole
            && (loaded_kinds != Some(kinds)
                || loaded_newest
                    != newest_micros
                        .map(|n| n.div_ceil(1_000_000).min(u32::MAX.into()) * 1_000_000));
        if !newest && (stale || header_stale) {
            report.rebuilt_indexes += usize::from(stale);
            // (A read-only open reports it, and writes nothing: `felix-log verify` and a
            // refused repair change nothing, in a directory a broker may own.)
            let bytes = index.encode(base, kinds, newest_micros);
            // Past what a read takes back it is not written: rebuilt at each open.
            if !config.read_only && bytes.len() as u64 <= crate::io::SMALL_FILE_MAX_BYTES {
                let _ = backend.write_small(&index_name(base), &bytes).await;
            }
        }
        let tail_start = format::align_down(end.data_len);
        let tail_block = if newest {
            file.read_at(tail_start, (end.data_len - tail_start) as usize)
                .await
                .map_err(io("read tail block"))?
                .to_vec()
        } else {
            Vec::new()
        };
        expected = Some(end.end_offset);
        segments.push_back(Segment {
            name,
            base,
            end_offset: end.end_offset,
            data_len: end.data_len,
            file: Rc::new(file),
            index,
            // Unknown, the last batches' (as before 2026-12-08).
            max_timestamp_micros: newest_micros.unwrap_or(end.max_timestamp_micros),
            tail_block,
            last_batch: end.last_batch,
            kinds,
            zeroed_to: 0,
        });
    }
    if segments.is_empty() {
        if config.read_only {
            return Err(StorageError::Config(
                "read-only open of a directory that holds no log".into(),
            ));
        }
        let segment = create_segment(backend, config, fresh_base)
            .await
            .map_err(|(op, e)| StorageError::io(op, &segment_name(fresh_base), e))?;
        segments.push_back(segment);
    }
    if let Some(intent) = intent {
        cut::finish_at_open(backend, &mut segments, intent).await?;
        report.finished_intent = true;
    }
    // An index whose segment is gone (a crash between a removal's unlinks, or an index
    // unlink that failed) is never read, and nothing else removes it: removed here
    // (derived, so a failure is only left for the next open).
    if !config.read_only {
        for base in indexes {
            if !segments.iter().any(|s| s.base == base)
                && backend.remove(&index_name(base)).await.is_ok()
            {
                report.orphan_indexes_removed += 1;
            }
        }
    }
    Ok((segments, report))
}

/// Loads and spot-checks a sealed segment's index: its last entry must point at a batch
/// header that verifies and starts at that entry's offset. `None` means rebuild. With it,
/// the kinds of batch the file says the segment holds and its newest record's
/// timestamp, if it says.
async fn load_index<B: Backend>(
    backend: &B,
    file: &B::File,
    base: u64,
    len: u64,
) -> Option<(SparseIndex, Option<KindSet>, Option<u64>)> {
    let bytes = backend.read_small(&index_name(base)).await.ok()??;
    let index = SparseIndex::decode(&bytes, base, len)?;
    let (offset, pos) = index.last()?;
    let head = file.read_at(pos, BATCH_HEADER_BYTES).await.ok()?;
    match format::decode_batch_header(&head) {
        Ok(HeaderRead::Batch(h)) if h.base_offset == offset => Some((
            index,
            SparseIndex::decode_kinds(&bytes),
            SparseIndex::decode_newest(&bytes),
        )),
        _ => None,
    }
}
