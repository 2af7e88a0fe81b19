//! One segment file's in-memory state, and the validating scan that recovery and the
//! `felix-log` tool use to walk it.

use std::rc::Rc;

use bytes::Bytes;

use crate::error::{Corruption, CorruptionKind, StorageError};
use crate::format::{
    self, BATCH_HEADER_BYTES, BATCH_MAGIC, BatchHeader, BatchKind, FormatError, HeaderRead,
    KindSet, MAX_BATCH_BODY_BYTES, RECORD_PREFIX_BYTES,
};
use crate::index::SparseIndex;
use crate::io::SegmentFile;

/// Size of the windows a scan reads.
const SCAN_WINDOW_BYTES: usize = 4 * 1024 * 1024;

/// The file name of the segment starting at `base`.
pub fn segment_name(base: u64) -> String {
    format!("{base:020}.seg")
}

/// The index file name of the segment starting at `base`.
pub fn index_name(base: u64) -> String {
    format!("{base:020}.idx")
}

/// Parses a segment file name; `None` when `name` is not a segment name at all,
/// `Some(Err)` when it claims to be one but is malformed.
pub fn parse_segment_name(name: &str) -> Option<Result<u64, &'static str>> {
    let stem = name.strip_suffix(".seg")?;
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Err("a .seg file whose name is not a 20-digit base offset"));
    }
    Some(stem.parse().map_err(|_| "base offset out of range"))
}

/// The base offset an index file's name (`{base:020}.idx`) gives, if it is one.
pub fn parse_index_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(".idx")?;
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    stem.parse().ok()
}

/// A segment that exists on disk.
#[derive(Debug)]
pub(crate) struct Segment<F> {
    pub name: String,
    pub base: u64,
    /// One past the last record written to the file.
    pub end_offset: u64,
    /// Bytes of valid data written (header block included).
    pub data_len: u64,
    pub file: Rc<F>,
    pub index: SparseIndex,
    pub max_timestamp_micros: u64,
    /// The bytes of the last partial block (`data_len % BLOCK` of them): the next write
    /// rewrites that block with them in front.
    pub tail_block: Vec<u8>,
    /// Base offset and kind of the last batch written to the file.
    pub last_batch: Option<(u64, BatchKind)>,
    /// The kinds of batch the file may hold (all of them when it was not read in full).
    pub kinds: KindSet,
    /// The file holds zeros written past its data up to here (0: nothing known past
    /// the block holding `data_len`). See [`crate::LogConfig::zero_ahead_bytes`].
    pub zeroed_to: u64,
}

/// How a scan ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScanEnd {
    pub data_len: u64,
    pub end_offset: u64,
    pub max_timestamp_micros: u64,
    pub batches: u64,
    /// Base offset and kind of the last whole batch.
    pub last_batch: Option<(u64, BatchKind)>,
    /// The kinds of the batches scanned.
    pub kinds: KindSet,
    /// Set when a torn tail was found (only when repair was allowed).
    pub torn_at: Option<Torn>,
}

/// A torn tail or torn last round a scan found: everything from `pos` on may be cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Torn {
    /// Where the damaged batch starts.
    pub pos: u64,
    /// What is wrong with it.
    pub cause: FormatError,
    /// Records from `pos` to the end of the data, when they can be counted
    /// ([`count_records`]).
    pub records: Option<u64>,
    /// Where non-zero bytes resume after the damaged batch: a torn last round.
    pub data_after: Option<u64>,
}

/// Reads a file through a moving window.
struct Window<'a, F> {
    file: &'a F,
    file_len: u64,
    buf: Bytes,
    buf_pos: u64,
}

impl<'a, F: SegmentFile> Window<'a, F> {
    fn new(file: &'a F, file_len: u64) -> Self {
        Self {
            file,
            file_len,
            buf: Bytes::new(),
            buf_pos: 0,
        }
    }

    /// Up to `len` bytes at `pos` (fewer only at end of file).
    async fn get(&mut self, pos: u64, len: usize) -> std::io::Result<Bytes> {
        let want_end = (pos + len as u64).min(self.file_len);
        let have_end = self.buf_pos + self.buf.len() as u64;
        if pos < self.buf_pos || want_end > have_end {
            let read_len = (want_end - pos).max(SCAN_WINDOW_BYTES as u64) as usize;
            let read_len = read_len.min((self.file_len - pos) as usize);
            self.buf = self.file.read_at(pos, read_len).await?;
            self.buf_pos = pos;
        }
        let start = (pos - self.buf_pos) as usize;
        let end = ((want_end - self.buf_pos) as usize).min(self.buf.len());
        Ok(self.buf.slice(start.min(end)..end))
    }
}

/// True when every byte of `file` from `pos` to `file_len` is zero. Returns the position
/// of the first non-zero byte otherwise.
pub(crate) async fn first_nonzero<F: SegmentFile>(
    file: &F,
    pos: u64,
    file_len: u64,
) -> std::io::Result<Option<u64>> {
    let mut at = pos;
    while at < file_len {
        let len = ((file_len - at) as usize).min(SCAN_WINDOW_BYTES);
        let chunk = file.read_at(at, len).await?;
        if chunk.is_empty() {
            break;
        }
        if let Some(i) = chunk.iter().position(|b| *b != 0) {
            return Ok(Some(at + i as u64));
        }
        at += chunk.len() as u64;
    }
    Ok(None)
}

/// One past the last non-zero byte of `file` in `[pos, file_len)`; `pos` when there is
/// none.
pub(crate) async fn data_end<F: SegmentFile>(
    file: &F,
    pos: u64,
    file_len: u64,
) -> std::io::Result<u64> {
    let mut end = file_len;
    while end > pos {
        let start = end.saturating_sub(SCAN_WINDOW_BYTES as u64).max(pos);
        let chunk = file.read_at(start, (end - start) as usize).await?;
        if let Some(i) = chunk.iter().rposition(|b| *b != 0) {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(pos)
}

/// Walks batches from `pos` (where `expected_offset` must begin) to the end of data,
/// verifying every header and body CRC and offset contiguity, and feeding the index.
///
/// The end of data is an all-zero header or end of file. Damage is repaired (reported in
/// `torn_at`) only with a `tail_reach` (the newest segment) and either every byte after
/// the damaged batch's extent is zero (a torn tail), or the last non-zero byte lies
/// within `tail_reach` of the damage and the batch shows a lost sector (a torn last
/// round: a power cut while the round's fdatasync ran kept only some of its sectors).
/// The reach is [`format::LAST_ROUND_REACH_BYTES`] for a log whose every round is synced before
/// the next (`on-commit`), and the whole segment under `none` and `periodic`, where
/// any part of the newest segment may be unsynced. Anything else is a [`Corruption`]:
/// damage farther back lies in data that was synced.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn scan<F: SegmentFile>(
    file: &F,
    name: &str,
    file_len: u64,
    mut pos: u64,
    mut expected_offset: u64,
    tail_reach: Option<u64>,
    index: &mut SparseIndex,
    index_interval: u64,
) -> Result<ScanEnd, StorageError> {
    let io = |e| StorageError::io("scan", name, e);
    let mut window = Window::new(file, file_len);
    let mut max_ts = 0u64;
    let mut batches = 0u64;
    let mut last_batch = None;
    let mut kinds = KindSet::default();
    let corrupt = |position: u64, offset: u64, kind: CorruptionKind| {
        StorageError::Corrupt(Corruption {
            segment: name.to_owned(),
            position,
            offset: Some(offset),
            kind,
        })
    };
    loop {
        let done = |pos, torn_at| ScanEnd {
            data_len: pos,
            end_offset: expected_offset,
            max_timestamp_micros: max_ts,
            batches,
            last_batch,
            kinds,
            torn_at,
        };
        if pos >= file_len {
            return Ok(done(pos, None));
        }
        let head = window.get(pos, BATCH_HEADER_BYTES).await.map_err(io)?;
        let (cause, extent_end) = match format::decode_batch_header(&head) {
            Ok(HeaderRead::Zero) => {
                // End of data, provided nothing follows the zeros.
                if first_nonzero(file, pos, file_len)
                    .await
                    .map_err(io)?
                    .is_none()
                {
                    return Ok(done(pos, None));
                }
                (
                    FormatError::BatchMagic { found: 0 },
                    pos + BATCH_HEADER_BYTES as u64,
                )
            }
            Ok(HeaderRead::Batch(h)) => match check_batch(&mut window, pos, file_len, &h).await {
                Ok(()) if h.base_offset != expected_offset => {
                    return Err(corrupt(
                        pos,
                        expected_offset,
                        CorruptionKind::OffsetGap {
                            expected: expected_offset,
                            found: h.base_offset,
                        },
                    ));
                }
                Ok(()) => {
                    index.observe(h.base_offset, pos, index_interval);
                    expected_offset = h.end_offset();
                    max_ts = max_ts.max(h.timestamp_micros);
                    batches += 1;
                    last_batch = Some((h.base_offset, h.kind));
                    kinds.add(h.kind);
                    pos += h.total_len() as u64;
                    continue;
                }
                Err(CheckError::Io(e)) => return Err(io(e)),
                Err(CheckError::Format(e)) => (e, pos + h.total_len() as u64),
            },
            Err(e) => (e, pos + BATCH_HEADER_BYTES as u64),
        };
        let after = first_nonzero(file, extent_end.min(file_len), file_len)
            .await
            .map_err(io)?;
        let refuse = |after: Option<u64>| {
            let kind = match after {
                None => CorruptionKind::Format(cause),
                Some(next_data) => CorruptionKind::Interior { next_data, cause },
            };
            Err(corrupt(pos, expected_offset, kind))
        };
        let Some(reach) = tail_reach else {
            return refuse(after);
        };
        let end = data_end(file, pos, file_len).await.map_err(io)?;
        if after.is_some()
            && (end - pos > reach
                || !lost_sector(&mut window, pos, extent_end)
                    .await
                    .map_err(io)?)
        {
            return refuse(after);
        }
        let records = count_records(&mut window, pos, end, expected_offset)
            .await
            .map_err(io)?;
        let torn = Torn {
            pos,
            cause,
            records,
            data_after: after,
        };
        return Ok(done(pos, Some(torn)));
    }
}

/// Whether the damaged batch at `[pos, extent_end)` shows what a power cut leaves: a
/// sector whose share of the batch is all zeros. Every byte of an unacknowledged batch
/// lies past what was synced before its round, so a sector that kept its old content
/// holds zeros where the batch should be (bytes past the end of the file count as
/// zeros). A flipped bit or a stray write leaves no such sector, and damage with data
/// after it is then refused even at the end of the newest segment. (A batch whose
/// payload is itself zeros can show such a sector without a power cut: within the last
/// round's reach such damage is cut, as a power cut would be.)
async fn lost_sector<F: SegmentFile>(
    window: &mut Window<'_, F>,
    pos: u64,
    extent_end: u64,
) -> std::io::Result<bool> {
    let sector = format::SECTOR_BYTES as u64;
    let mut start = pos;
    while start < extent_end {
        let end = ((start / sector + 1) * sector).min(extent_end);
        let share = window.get(start, (end - start) as usize).await?;
        if share.iter().all(|b| *b == 0) {
            return Ok(true);
        }
        start = end;
    }
    Ok(false)
}

/// Counts the records in the batches from `pos` (where `first_offset` begins) to
/// `data_end`, which a cut at `pos` loses; best effort, for the recovery report. Walks
/// the batch headers; at a damaged one, it resumes at the next header that verifies and
/// could continue the offsets (its base is past the walk's, by no more records than the
/// bytes skipped could hold), and the records in between are the gap up to that base.
/// `None` when no such header follows a damaged one (the last batch's header may be the
/// damaged one, and its record count is then unknown), or a whole header breaks the
/// offsets. Only headers are read: a batch whose body is damaged still counts.
async fn count_records<F: SegmentFile>(
    window: &mut Window<'_, F>,
    mut pos: u64,
    data_end: u64,
    first_offset: u64,
) -> std::io::Result<Option<u64>> {
    let mut end = first_offset;
    while pos < data_end {
        let head = window.get(pos, BATCH_HEADER_BYTES).await?;
        match format::decode_batch_header(&head) {
            Ok(HeaderRead::Batch(h)) if h.base_offset == end => {
                end = h.end_offset();
                pos += h.total_len() as u64;
            }
            Ok(HeaderRead::Batch(_)) => return Ok(None),
            Ok(HeaderRead::Zero) | Err(_) => match resume(window, pos, data_end, end).await? {
                Some((at, base)) => (pos, end) = (at, base),
                None => return Ok(None),
            },
        }
    }
    Ok(Some(end - first_offset))
}

/// The next header after the damaged batch at `pos` (expected at offset `expected`) that
/// verifies and could follow it: position and base offset.
async fn resume<F: SegmentFile>(
    window: &mut Window<'_, F>,
    pos: u64,
    data_end: u64,
    expected: u64,
) -> std::io::Result<Option<(u64, u64)>> {
    let magic = BATCH_MAGIC.to_be_bytes();
    let mut at = pos + 1;
    while at < data_end {
        // Overlapping windows, so a magic that straddles two is seen.
        let len = ((data_end - at) as usize).min(SCAN_WINDOW_BYTES) + magic.len() - 1;
        let bytes = window.get(at, len).await?;
        let Some(i) = bytes.windows(magic.len()).position(|w| w == magic) else {
            at += (bytes.len() + 1).saturating_sub(magic.len()).max(1) as u64;
            continue;
        };
        let candidate = at + i as u64;
        if candidate >= data_end {
            break;
        }
        let head = window.get(candidate, BATCH_HEADER_BYTES).await?;
        if let Ok(HeaderRead::Batch(h)) = format::decode_batch_header(&head) {
            let most = (candidate - pos) / RECORD_PREFIX_BYTES as u64;
            if h.base_offset > expected && h.base_offset - expected <= most {
                return Ok(Some((candidate, h.base_offset)));
            }
        }
        at = candidate + 1;
    }
    Ok(None)
}

enum CheckError {
    Io(std::io::Error),
    Format(FormatError),
}

async fn check_batch<F: SegmentFile>(
    window: &mut Window<'_, F>,
    pos: u64,
    file_len: u64,
    h: &BatchHeader,
) -> Result<(), CheckError> {
    let body_pos = pos + BATCH_HEADER_BYTES as u64;
    let available = file_len.saturating_sub(body_pos);
    if u64::from(h.body_len) > available {
        return Err(CheckError::Format(FormatError::Truncated {
            needed: h.body_len as usize,
            available: available as usize,
        }));
    }
    debug_assert!(h.body_len as usize <= MAX_BATCH_BODY_BYTES);
    let body = window
        .get(body_pos, h.body_len as usize)
        .await
        .map_err(CheckError::Io)?;
    format::verify_batch_body(h, &body).map_err(CheckError::Format)
}
