//! Snapshots of state a caller derives from the log (step 8 of the module docs of
//! [`crate::log`]): saved beside the log as of an offset, so that rebuilding the state
//! reads only the records from there on.
//!
//! What must stay true: a snapshot the log hands back describes the records below its
//! offset that the log holds now. Records below it are never replaced without the
//! snapshot going first: a truncation below it removes it before appends resume, a
//! reset removes every one, and an open removes, before the first append, one past the
//! end recovery found (a crash took the tail it described) or below the base (a reset
//! the crash interrupted and recovery finished: a snapshot of the old life). Only one
//! within `[base, next_offset]` is handed back; a damaged one never is; a missing one
//! means "read the log".

use std::io;
use std::ops::RangeInclusive;

use super::SegmentLog;
use super::meta::check_meta_name;
use crate::error::StorageError;
use crate::io::Backend;

/// What every snapshot file's name ends with (plain metadata names may not).
pub const SNAPSHOT_SUFFIX: &str = ".snap";
/// `FXSN`.
const MAGIC: u32 = 0x4658_534E;
const VERSION: u16 = 1;
/// Magic u32, version u16, reserved u16, as_of u64, body length u32, CRC-32C u32 over
/// the 20 bytes before it and the body (all big-endian).
const HEADER_BYTES: usize = 24;

fn file_name(name: &str) -> Result<String, StorageError> {
    check_meta_name(name)?;
    Ok(format!("{name}{SNAPSHOT_SUFFIX}"))
}

fn encode(as_of: u64, body: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_BYTES + body.len());
    b.extend_from_slice(&MAGIC.to_be_bytes());
    b.extend_from_slice(&VERSION.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&as_of.to_be_bytes());
    b.extend_from_slice(&(body.len() as u32).to_be_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&b), body);
    b.extend_from_slice(&crc.to_be_bytes());
    b.extend_from_slice(body);
    b
}

/// `(as_of, body)`, or `None` for anything that is not a whole snapshot of this version.
fn decode(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let header = bytes.get(..HEADER_BYTES)?;
    let u32_at = |at: usize| u32::from_be_bytes(header[at..at + 4].try_into().unwrap());
    let u16_at = |at: usize| u16::from_be_bytes(header[at..at + 2].try_into().unwrap());
    if u32_at(0) != MAGIC || u16_at(4) != VERSION {
        return None;
    }
    let as_of = u64::from_be_bytes(header[8..16].try_into().unwrap());
    let body = &bytes[HEADER_BYTES..];
    if body.len() != u32_at(16) as usize {
        return None;
    }
    let crc = crc32c::crc32c_append(crc32c::crc32c(&header[..20]), body);
    (crc == u32_at(20)).then_some((as_of, body))
}

impl<B: Backend> SegmentLog<B> {
    /// Saves `body`, state derived from the log's records below `as_of`, as snapshot
    /// `name` (a metadata name; the file is `name.snap`), replacing the one before, as
    /// [`SegmentLog::write_meta`] replaces a file. Call it right after deriving `body`,
    /// with no wait in between: a truncation or reset after that point makes it refuse
    /// (`Busy`; the state may describe records gone since). `as_of` must lie in
    /// `[base_offset(), committed_end()]` (`OutOfRange`).
    pub async fn save_snapshot(
        &self,
        name: &str,
        as_of: u64,
        body: &[u8],
    ) -> Result<(), StorageError> {
        let file = file_name(name)?;
        // Never more than a read takes back.
        if (HEADER_BYTES + body.len()) as u64 > crate::io::SMALL_FILE_MAX_BYTES {
            return Err(StorageError::Config(format!(
                "snapshot {name}: {} bytes",
                body.len()
            )));
        }
        let cuts = {
            let st = self.shared.state.borrow();
            super::cut::check_open(&st)?;
            st.cuts
        };
        let (low, high) = (self.base_offset(), self.committed_end());
        if !(low..=high).contains(&as_of) {
            return Err(StorageError::OutOfRange {
                offset: as_of,
                low,
                high,
            });
        }
        // A truncation removes the snapshots it makes stale under the metadata turn, so
        // it sees this one installed or never written.
        self.replace_small_file(&file, &encode(as_of, body), "write snapshot", || {
            if self.shared.state.borrow().cuts != cuts {
                return Err(StorageError::Busy);
            }
            Ok(())
        })
        .await
    }

    /// Snapshot `name` as `(as_of, body)`: `None` when there is none, it is damaged, a
    /// cut or reset came while it was read, or `as_of` lies outside
    /// `[base_offset(), next_offset()]` (below: retention removed
    /// what follows it, and the log holds nothing to read on from it; the records below
    /// `as_of` it describes may be gone too, which the caller must forget).
    pub async fn load_snapshot(&self, name: &str) -> Result<Option<(u64, Vec<u8>)>, StorageError> {
        let file = file_name(name)?;
        // The read waits on the ring: a cut meanwhile may have made it describe records
        // that are gone (and the range check below pass on offsets written since).
        let cuts = self.shared.state.borrow().cuts;
        let bytes = match self.shared.backend.read_small(&file).await {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(None),
            // Past the bound: damaged, as one whose checksum fails.
            Err(e) if e.kind() == io::ErrorKind::InvalidData => return Ok(None),
            Err(e) => return Err(StorageError::io("read snapshot", &file, e)),
        };
        if self.shared.state.borrow().cuts != cuts {
            return Ok(None);
        }
        let within = self.base_offset()..=self.next_offset();
        Ok(decode(&bytes)
            .filter(|(as_of, _)| within.contains(as_of))
            .map(|(as_of, body)| (as_of, body.to_vec())))
    }

    /// Removes every snapshot saved as of an offset outside `keep` (every one: `None`),
    /// and every damaged one, durably (the directory fsynced when one went), under the
    /// metadata turn.
    pub(super) async fn remove_snapshots_outside(
        &self,
        keep: Option<RangeInclusive<u64>>,
    ) -> Result<(), (&'static str, io::Error)> {
        let _turn = self.meta_turn().await;
        remove_outside(&self.shared.backend, keep).await
    }
}

/// [`SegmentLog::remove_snapshots_outside`], at open (before the log exists) as well.
pub(super) async fn remove_outside<B: Backend>(
    backend: &B,
    keep: Option<RangeInclusive<u64>>,
) -> Result<(), (&'static str, io::Error)> {
    let mut removed = false;
    for name in backend.list().await.map_err(|e| ("list", e))? {
        if !name.ends_with(SNAPSHOT_SUFFIX) {
            continue;
        }
        let stale = match backend.read_small(&name).await {
            Ok(Some(bytes)) => decode(&bytes)
                .is_none_or(|(as_of, _)| keep.as_ref().is_none_or(|k| !k.contains(&as_of))),
            Ok(None) => false,
            // Past the bound: damaged, removed as one whose checksum fails.
            Err(e) if e.kind() == io::ErrorKind::InvalidData => true,
            Err(e) => return Err(("read snapshot", e)),
        };
        if stale {
            match backend.remove(&name).await {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(("remove snapshot", e));
                }
                _ => removed = true,
            }
        }
    }
    if removed {
        backend
            .sync_dir()
            .await
            .map_err(|e| ("fsync directory", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_decodes_only_whole_and_unchanged() {
        let bytes = encode(42, b"state");
        assert_eq!(decode(&bytes), Some((42, &b"state"[..])));
        assert_eq!(decode(&encode(7, b"")), Some((7, &b""[..])));
        for cut in 0..bytes.len() {
            assert_eq!(decode(&bytes[..cut]), None, "cut at {cut}");
        }
        for at in 0..bytes.len() {
            let mut bent = bytes.clone();
            bent[at] ^= 0x10;
            assert_eq!(decode(&bent), None, "byte {at} changed");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), None);
    }
}
