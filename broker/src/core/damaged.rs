//! A replicated shard's copy found damaged at open is set aside and started over
//! empty, to be rebuilt from the other copies (docs/replication.md, "A damaged copy is
//! rebuilt"). The empty copy keeps the ballot the damaged one accepted and is marked
//! rebuilding (`Meta::rebuilding`): it may have acknowledged records it no longer
//! holds, so it counts toward no election until it holds them again. A shard with one
//! copy has nothing to rebuild from: it stays closed, as before.
//!
//! The swap is crash-safe: the empty copy, its metadata durable, is built beside the
//! damaged one and exchanged with it in one `renameat2(RENAME_EXCHANGE)`, so the
//! shard's directory holds either the damaged copy (found damaged again at the next
//! open) or the marked empty one, never an unmarked empty copy, which would answer
//! fences as a replica that never held anything.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_core_runtime::task;
use felix_storage_uring::{DmaBackend, SegmentLog};

use super::CoreBroker;
use crate::error::BrokerError;
use crate::replication::machine::Meta;
use crate::replication::replica::META_FILE;

/// Where damaged copies are kept, under the data directory, for an operator to look
/// at (`felix-log`) or delete. Nothing reads them; the oldest are deleted once more
/// than `damaged_copies_kept` are there ([`to_prune`]).
pub const DAMAGED_DIR: &str = "damaged-copies";

/// Which entries of [`DAMAGED_DIR`] to delete so that `kept` remain: the oldest first
/// (each name begins with the wall-clock microseconds it was set aside at), never one
/// `in_flight` (an empty copy another core is still building, about to be exchanged
/// with its damaged one: it counts as kept), and nothing whose name is not ours (an
/// operator's own files there stay).
pub fn to_prune(
    names: &[String],
    kept: usize,
    in_flight: &std::collections::HashSet<String>,
) -> Vec<String> {
    let mut ours: Vec<(u64, &String)> = names
        .iter()
        .filter_map(|n| Some((n.split_once('-')?.0.parse().ok()?, n)))
        .collect();
    ours.sort();
    let excess = ours.len().saturating_sub(kept);
    ours.into_iter()
        .take(excess)
        .filter(|(_, n)| !in_flight.contains(*n))
        .map(|(_, n)| n.clone())
        .collect()
}

/// The copies kept under [`DAMAGED_DIR`] in `data_dir`, and the bytes they hold.
pub fn kept_copies(data_dir: &Path) -> (u64, u64) {
    fn bytes(p: &Path) -> u64 {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => std::fs::read_dir(p)
                .map(|es| es.flatten().map(|e| bytes(&e.path())).sum())
                .unwrap_or(0),
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }
    let Ok(entries) = std::fs::read_dir(data_dir.join(DAMAGED_DIR)) else {
        return (0, 0);
    };
    entries
        .flatten()
        .fold((0, 0), |(n, b), e| (n + 1, b + bytes(&e.path())))
}

/// The metadata of a copy that starts over: the ballot kept, the commit mark
/// forgotten (the empty log holds nothing committed), marked rebuilding since the
/// newest generation it accepted.
fn starting_over(old: Meta) -> Meta {
    Meta {
        rebuilding: Some(old.generation),
        commit: 0,
        ..old
    }
}

fn storage(dir: &Path, what: &str, e: impl std::fmt::Display) -> BrokerError {
    BrokerError::Storage(format!("{}: {what}: {e}", dir.display()))
}

/// Exchanges two directories atomically.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    let a = CString::new(a.as_os_str().as_bytes())?;
    let b = CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both paths are NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

impl CoreBroker {
    /// Sets the damaged copy in `dir` aside (under [`DAMAGED_DIR`]) and leaves in its
    /// place an empty copy marked rebuilding. Returns where the damaged copy went.
    /// Refused (the copy stays, closed) when its ballot cannot be read: a copy that
    /// forgot the generations it accepted could accept older leaders again.
    pub(super) async fn set_damaged_copy_aside(
        &self,
        key: &ShardKey,
        dir: &Path,
    ) -> Result<PathBuf, BrokerError> {
        let meta_path = dir.join(META_FILE);
        let old = match task::spawn_blocking(move || std::fs::read(meta_path)).await {
            Ok(bytes) => serde_json::from_slice::<Meta>(&bytes)
                .map_err(|e| storage(dir, "the damaged copy's replica metadata", e))?,
            // Never a replica here: it accepted nothing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Meta::default(),
            Err(e) => return Err(storage(dir, "reading the damaged copy's metadata", e)),
        };
        let mut meta = starting_over(old);
        if self.shared.mutants.forget_rebuilding {
            // Deliberately broken (checker mutant runs only).
            meta.rebuilding = None;
        }
        // Named for the shard (the log line says the same), built beside the data,
        // on the same filesystem as the shard's directory (the exchange needs that).
        let root = self.shared.data_dir.join(DAMAGED_DIR);
        let fresh = root.join(format!(
            "{}-{}-{}.{}.{}.{}.{}",
            felix_core_runtime::clock::wall_micros(),
            self.core.index(),
            match key.kind {
                ShardKind::Stream => "stream",
                ShardKind::Cache => "cache",
            },
            key.tenant,
            key.namespace,
            key.name,
            key.shard
        ));
        let name = fresh
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        self.damaged_in_flight().insert(name.clone());
        let swapped = self.swap_in_empty_copy(dir, &root, &fresh, &meta).await;
        self.damaged_in_flight().remove(&name);
        swapped?;
        tracing::error!(
            shard = %key,
            damaged = %fresh.display(),
            ballot = meta.generation,
            "the shard's copy is damaged: set aside, started over empty, rebuilding from the other copies (counted in no election until it holds what it may have acknowledged)"
        );
        self.prune_damaged_copies(root).await;
        Ok(fresh)
    }

    fn damaged_in_flight(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.shared
            .damaged_in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Builds the marked empty copy at `fresh` and exchanges it with the damaged copy
    /// in `dir`.
    async fn swap_in_empty_copy(
        &self,
        dir: &Path,
        root: &Path,
        fresh: &Path,
        meta: &Meta,
    ) -> Result<(), BrokerError> {
        let (data_dir, r) = (self.shared.data_dir.clone(), root.to_path_buf());
        task::spawn_blocking(move || {
            std::fs::create_dir_all(&r)?;
            sync_dir(&data_dir)
        })
        .await
        .map_err(|e| storage(root, "creating", e))?;
        let built = self.empty_marked_copy(fresh, meta).await;
        let swapped = match built {
            Ok(()) => {
                let (a, b, r) = (fresh.to_path_buf(), dir.to_path_buf(), root.to_path_buf());
                task::spawn_blocking(move || {
                    // The new entry is durable in `damaged-copies/` before it moves.
                    sync_dir(&r).map_err(|e| (false, e))?;
                    exchange(&a, &b).map_err(|e| (false, e))?;
                    for d in [b.parent(), Some(r.as_path())].into_iter().flatten() {
                        sync_dir(d).map_err(|e| (true, e))?;
                    }
                    Ok(())
                })
                .await
                .map_err(|(exchanged, e)| (exchanged, storage(dir, "swapping in an empty copy", e)))
            }
            Err(e) => Err((false, e)),
        };
        if let Err((exchanged, e)) = swapped {
            if !exchanged {
                // The half-built empty copy would only take space (the open is tried
                // again after a restart). Once exchanged, `fresh` is the damaged copy.
                let f = fresh.to_path_buf();
                let _ = task::spawn_blocking(move || std::fs::remove_dir_all(f)).await;
            }
            return Err(e);
        }
        Ok(())
    }

    /// Deletes the oldest damaged copies beyond `damaged_copies_kept` ([`to_prune`]).
    /// A failure is logged and left for the next copy set aside.
    async fn prune_damaged_copies(&self, root: PathBuf) {
        let kept = self.shared.damaged_copies_kept;
        let listed = task::spawn_blocking({
            let root = root.clone();
            move || {
                std::fs::read_dir(root).map(|d| {
                    d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                        .collect::<Vec<String>>()
                })
            }
        })
        .await;
        // Chosen under the lock, so no core starts building an entry picked here: a
        // new entry is named for the time it is created, newer than every one listed.
        let chosen = listed.map(|names| to_prune(&names, kept, &self.damaged_in_flight()));
        let pruned = task::spawn_blocking(move || {
            let mut gone = Vec::new();
            for name in chosen? {
                match std::fs::remove_dir_all(root.join(&name)) {
                    Ok(()) => gone.push(name),
                    Err(e) => {
                        tracing::warn!(copy = %name, error = %e, "deleting an old damaged copy")
                    }
                }
            }
            std::io::Result::Ok(gone)
        })
        .await;
        match pruned {
            Ok(gone) if !gone.is_empty() => tracing::warn!(
                deleted = ?gone,
                kept,
                "deleted the oldest damaged copies (damaged_copies_kept)"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "listing damaged copies to prune"),
        }
    }

    /// An empty log in `dir` whose replica metadata is `meta`, durable.
    async fn empty_marked_copy(&self, dir: &Path, meta: &Meta) -> Result<(), BrokerError> {
        let backend = DmaBackend::open_dir_with_faults(dir, self.shared.faults.clone())
            .await
            .map_err(|e| storage(dir, "creating an empty copy", e))?;
        let (log, _) = SegmentLog::open(backend, self.shared.log_config.clone()).await?;
        let bytes = serde_json::to_vec(meta).expect("metadata serializes");
        let written = log.write_meta(META_FILE, &bytes).await;
        let _ = log.close().await;
        Ok(written?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_that_starts_over_keeps_its_ballot_and_forgets_its_commit_mark() {
        let old = Meta {
            generation: 7,
            leader: Some("b".into()),
            commit: 120,
            rebuilding: None,
        };
        let m = starting_over(old);
        assert_eq!((m.generation, m.leader.as_deref()), (7, Some("b")));
        assert_eq!(m.commit, 0);
        assert_eq!(m.rebuilding, Some(7));
        // Damaged again while rebuilding: still since the newest generation.
        assert_eq!(
            starting_over(Meta {
                rebuilding: Some(3),
                ..m
            })
            .rebuilding,
            Some(7)
        );
    }

    #[test]
    fn the_oldest_damaged_copies_beyond_the_bound_are_pruned_but_never_one_in_flight() {
        let names: Vec<String> = [
            "3000-0-stream.t.n.s.0",
            "1000-1-stream.t.n.s.1",
            "4000-0-cache.t.n.c.0",
            "2000-1-stream.t.n.s.2",
            "notes-by-the-operator",
        ]
        .map(String::from)
        .into();
        let none = std::collections::HashSet::new();
        // Four of ours, two kept: the two oldest go, oldest first.
        assert_eq!(
            to_prune(&names, 2, &none),
            [names[1].clone(), names[3].clone()]
        );
        // Three kept: only the oldest.
        assert_eq!(to_prune(&names, 3, &none), [names[1].clone()]);
        assert!(to_prune(&names, 4, &none).is_empty());
        // An entry another core is building counts as kept but is never deleted, even
        // when it is among the oldest (its name's time was taken before others').
        let building = std::collections::HashSet::from([names[1].clone()]);
        assert_eq!(to_prune(&names, 2, &building), [names[3].clone()]);
        assert_eq!(to_prune(&names, 1, &building).len(), 2);
    }

    #[test]
    fn exchanging_two_directories_swaps_their_contents() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("x"), "in a").unwrap();
        exchange(&a, &b).unwrap();
        assert!(b.join("x").exists() && !a.join("x").exists());
        assert!(exchange(&a, &t.path().join("missing")).is_err());
    }
}
