//! Small durable files beside the log (step 7 of the module docs of [`crate::log`]):
//! replication state such as the accepted generation and leader, or a commit mark.
//!
//! What must stay true: a reader sees a whole old or a whole new file, before and after a
//! crash; a name never collides with a segment, an index, a temporary or the intent
//! file, so recovery can ignore every one of them.

use std::future::poll_fn;
use std::io;
use std::task::Poll;

use crate::error::StorageError;
use crate::io::Backend;
use crate::log::SegmentLog;

/// Longest metadata file name.
pub const META_NAME_MAX_BYTES: usize = 64;

/// The suffix of the temporary a replacement is written to before its rename.
const TEMP_SUFFIX: &str = ".tmp";

/// Checks a metadata file name: 1 to [`META_NAME_MAX_BYTES`] of `[a-z0-9._-]`, not
/// hidden, no `..`, and not ending like a segment, index or temporary file.
pub fn check_meta_name(name: &str) -> Result<(), StorageError> {
    let refuse = |reason| {
        Err(StorageError::BadMetaName {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() || name.len() > META_NAME_MAX_BYTES {
        return refuse("a name is 1 to 64 bytes");
    }
    let allowed = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b);
    if !name.bytes().all(allowed) {
        return refuse("only a-z, 0-9, '.', '_' and '-' are allowed");
    }
    if name.starts_with('.') || name.contains("..") {
        return refuse("hidden names and '..' are not allowed");
    }
    if [".seg", ".idx"].iter().any(|s| name.ends_with(s)) {
        return refuse("collides with segment and index file names");
    }
    if name.ends_with(super::snapshot::SNAPSHOT_SUFFIX) {
        return refuse("collides with snapshot file names");
    }
    if name.ends_with(TEMP_SUFFIX) {
        return refuse("collides with temporary file names");
    }
    if name == super::UNSYNCED_LIFE {
        // The log's own mark: written by a caller, recovery would cut damage it must
        // refuse (it reads the mark as "more than a round may be unsynced").
        return refuse("the log's own recovery mark");
    }
    Ok(())
}

fn temp_name(name: &str) -> String {
    format!("{name}{TEMP_SUFFIX}")
}

/// Writes and fdatasyncs the temporary that will replace `name`. Nothing reads it: a
/// failure or a crash here leaves `name` as it was.
pub(super) async fn write_temp<B: Backend>(
    backend: &B,
    name: &str,
    bytes: &[u8],
) -> io::Result<()> {
    backend.write_synced(&temp_name(name), bytes).await
}

/// Renames the temporary over `name` and fsyncs the directory: from the rename on,
/// `name` may hold the new contents; after the fsync, it does.
pub(super) async fn install<B: Backend>(
    backend: &B,
    name: &str,
) -> Result<(), (&'static str, io::Error)> {
    backend
        .rename(&temp_name(name), name)
        .await
        .map_err(|e| ("rename", e))?;
    backend.sync_dir().await.map_err(|e| ("fsync directory", e))
}

/// One `write_meta` at a time: two would share a temporary.
pub(super) struct MetaTurn<'a, B: Backend>(&'a SegmentLog<B>);

impl<B: Backend> Drop for MetaTurn<'_, B> {
    fn drop(&mut self) {
        let mut st = self.0.shared.state.borrow_mut();
        st.meta_writing = false;
        for w in std::mem::take(&mut st.meta_waiters) {
            w.wake();
        }
    }
}

impl<B: Backend> SegmentLog<B> {
    /// Replaces the metadata file `name` with `bytes`, durably (step 7): after it
    /// returns, a reopen reads `bytes`; after a crash during it, the old contents or
    /// `bytes`, never a mix. Calls are served one at a time. Refused on a read-only log
    /// and on one closing or closed: [`SegmentLog::close`] waits for a write in
    /// progress, and one that comes later (a task of a shard's old owner, after another
    /// core opened the log) would replace what the new owner wrote, unseen by it.
    pub async fn write_meta(&self, name: &str, bytes: &[u8]) -> Result<(), StorageError> {
        check_meta_name(name)?;
        self.replace_small_file(name, bytes, "write metadata", || Ok(()))
            .await
    }

    /// Replaces the small file `file` with `bytes` under the metadata turn: refused on a
    /// read-only log, on one closing or closed, and when `still_valid`, checked once the
    /// turn is held, says no; written to a temporary, synced and renamed into place.
    pub(super) async fn replace_small_file(
        &self,
        file: &str,
        bytes: &[u8],
        what: &'static str,
        still_valid: impl FnOnce() -> Result<(), StorageError>,
    ) -> Result<(), StorageError> {
        if self.shared.config.read_only {
            return Err(StorageError::Closed);
        }
        // Never more than a read takes back.
        if bytes.len() as u64 > crate::io::SMALL_FILE_MAX_BYTES {
            return Err(StorageError::Config(format!(
                "{file}: {} bytes, more than a small file's {}",
                bytes.len(),
                crate::io::SMALL_FILE_MAX_BYTES
            )));
        }
        let _turn = self.meta_turn().await;
        {
            let st = self.shared.state.borrow();
            if st.closing || st.closed {
                return Err(StorageError::Closed);
            }
        }
        still_valid()?;
        let backend = &self.shared.backend;
        write_temp(backend, file, bytes)
            .await
            .map_err(|e| StorageError::io(what, file, e))?;
        install(backend, file)
            .await
            .map_err(|(op, e)| StorageError::io(op, file, e))
    }

    /// The contents of the metadata file `name`; `None` if it was never written.
    pub async fn read_meta(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
        check_meta_name(name)?;
        self.shared
            .backend
            .read_small(name)
            .await
            .map_err(|e| StorageError::io("read metadata", name, e))
    }

    /// Waits for the turn to write metadata (see [`SegmentLog::close`]).
    pub(super) async fn meta_turn(&self) -> MetaTurn<'_, B> {
        poll_fn(|cx| {
            let mut st = self.shared.state.borrow_mut();
            if st.meta_writing {
                st.meta_waiters.push(cx.waker().clone());
                return Poll::Pending;
            }
            st.meta_writing = true;
            Poll::Ready(())
        })
        .await;
        MetaTurn(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_names_never_collide_with_the_log_files() {
        for ok in ["replication", "commit-mark", "gen_2.v1", "a"] {
            assert!(check_meta_name(ok).is_ok(), "{ok}");
        }
        let long = "a".repeat(META_NAME_MAX_BYTES + 1);
        for bad in [
            "",
            long.as_str(),
            "a/b",
            "../x",
            "..",
            ".",
            ".hidden",
            "a..b",
            "Upper",
            "LOG-INTENT",
            "sp ace",
            "00000000000000000000.seg",
            "00000000000000000000.idx",
            "x.seg",
            "producers.snap",
            "state.tmp",
            "unsynced-life",
        ] {
            assert!(
                matches!(check_meta_name(bad), Err(StorageError::BadMetaName { .. })),
                "{bad:?} accepted"
            );
        }
    }
}
