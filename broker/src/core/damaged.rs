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

use std::collections::HashSet;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_core_runtime::task;
use felix_storage_uring::{DmaBackend, SegmentLog};

use super::{CoreBroker, Shared};
use crate::error::BrokerError;
use crate::replication::machine::Meta;
use crate::replication::replica::META_FILE;

/// Where damaged copies are kept, under the data directory, for an operator to look
/// at (`felix-log`) or delete. Nothing reads them; beyond `damaged_copies_kept` the
/// oldest are deleted, at start-up and after each copy set aside ([`prune`]).
pub const DAMAGED_DIR: &str = "damaged-copies";

/// When the entry `name` was set aside (wall-clock microseconds), if it is one of ours:
/// `<micros>-<core>-<stream|cache>.<tenant>.<namespace>.<name>.<shard>`. Anything else
/// there is an operator's and is left alone.
fn set_aside_at(name: &str) -> Option<u64> {
    let (micros, rest) = name.split_once('-')?;
    let (core, rest) = rest.split_once('-')?;
    core.parse::<usize>().ok()?;
    (rest.starts_with("stream.") || rest.starts_with("cache.")).then_some(())?;
    micros.parse().ok()
}

/// Which of `names` (entries of [`DAMAGED_DIR`]) to delete so that `kept` of ours
/// remain: the oldest first, never one `protected` (an empty copy a core is still
/// building or exchanging, and the copy just set aside: they count as kept), and
/// nothing that is not ours.
pub fn to_prune(names: &[String], kept: usize, protected: &HashSet<String>) -> Vec<String> {
    let mut ours: Vec<(u64, &String)> = names
        .iter()
        .filter_map(|n| Some((set_aside_at(n)?, n)))
        .collect();
    ours.sort();
    let excess = ours.len().saturating_sub(kept);
    ours.into_iter()
        .filter(|(_, n)| !protected.contains(*n))
        .take(excess)
        .map(|(_, n)| n.clone())
        .collect()
}

/// Our entries in `root`, or none when it does not exist.
fn list(root: &Path) -> std::io::Result<Vec<String>> {
    match std::fs::read_dir(root) {
        Ok(d) => Ok(d
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Deletes the oldest of our entries in `root` beyond `kept` ([`to_prune`]; the
/// `protected` set, entries cores are building or exchanging and copies just set aside
/// whose prune this is, is read under its lock while choosing, so no core starts
/// building an entry chosen here: a new entry is named for its creation time and was
/// not listed). Returns what it deleted. Blocking: call it off the cores' executors. A
/// deletion that fails is logged and left for the next prune.
pub fn prune(
    root: &Path,
    kept: usize,
    protected: &Mutex<HashSet<String>>,
) -> std::io::Result<Vec<String>> {
    let chosen = {
        let names = list(root)?;
        let held = protected.lock().unwrap_or_else(|p| p.into_inner());
        to_prune(&names, kept, &held)
    };
    let mut deleted = Vec::new();
    for name in chosen {
        match std::fs::remove_dir_all(root.join(&name)) {
            Ok(()) => deleted.push(name),
            Err(e) => tracing::warn!(copy = %name, error = %e, "deleting an old damaged copy"),
        }
    }
    Ok(deleted)
}

/// The copies of ours in `root` and the bytes they take on disk (allocated blocks:
/// segments are preallocated). Blocking.
pub fn count(root: &Path) -> (u64, u64) {
    fn on_disk(p: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt as _;
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => std::fs::read_dir(p)
                .map(|es| es.flatten().map(|e| on_disk(&e.path())).sum())
                .unwrap_or(0),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        }
    }
    list(root)
        .unwrap_or_default()
        .into_iter()
        .filter(|n| set_aside_at(n).is_some())
        .fold((0, 0), |(n, b), name| {
            (n + 1, b + on_disk(&root.join(name)))
        })
}

/// Registers an entry of [`DAMAGED_DIR`] that a core is building or exchanging, or
/// that was just set aside and whose own prune has not run yet, so no prune deletes
/// it; deregisters it when dropped (also when the open that builds it is).
struct InFlight {
    shared: Arc<Shared>,
    name: String,
}

impl InFlight {
    fn new(shared: Arc<Shared>, name: String) -> InFlight {
        shared
            .damaged_in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.clone());
        InFlight { shared, name }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared
            .damaged_in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.name);
    }
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

/// Makes `dir`'s entries durable (a file or directory made or removed in it).
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
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
        let building = InFlight::new(self.shared.clone(), name);
        self.swap_in_empty_copy(dir, &root, &fresh, &meta).await?;
        tracing::error!(
            shard = %key,
            damaged = %fresh.display(),
            ballot = meta.generation,
            "the shard's copy is damaged: set aside, started over empty, rebuilding from the other copies (counted in no election until it holds what it may have acknowledged)"
        );
        // Not awaited: the shard reopens and starts its rebuild meanwhile. The copy just
        // set aside stays registered until its prune is done, so no other core's prune
        // (a clock stepped back could make it look oldest) takes it meanwhile.
        let shared = self.shared.clone();
        task::spawn(async move {
            let kept = shared.damaged_copies_kept;
            let pruned =
                task::spawn_blocking(move || prune(&root, kept, &shared.damaged_in_flight)).await;
            drop(building);
            match pruned {
                Ok(deleted) if !deleted.is_empty() => tracing::warn!(
                    ?deleted,
                    kept,
                    "deleted the oldest damaged copies (damaged_copies_kept)"
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "pruning damaged copies"),
            }
        })
        .detach();
        Ok(fresh)
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
            no_lead_through: None,
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
            "2026-12-02-notes",
            "100-x-stream.t.n.s.0",
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
        // when it is among the oldest (its name's time was taken before others'): the
        // next oldest go in its place.
        let building = std::collections::HashSet::from([names[1].clone()]);
        assert_eq!(
            to_prune(&names, 2, &building),
            [names[3].clone(), names[0].clone()]
        );
        assert_eq!(to_prune(&names, 1, &building).len(), 3);
    }

    #[test]
    fn a_prune_deletes_from_disk_counts_what_is_left_and_spares_the_operators_files() {
        let t = tempfile::tempdir().unwrap();
        for name in [
            "1000-0-stream.t.n.s.0",
            "2000-1-stream.t.n.s.1",
            "3000-0-cache.t.n.c.0",
            "4000-1-stream.t.n.s.2",
            "2026-12-02-notes",
        ] {
            std::fs::create_dir(t.path().join(name)).unwrap();
            std::fs::write(t.path().join(name).join("seg"), vec![7u8; 8192]).unwrap();
        }
        // The oldest is being built by another core; the newest was just set aside.
        let held = Mutex::new(HashSet::from([
            "1000-0-stream.t.n.s.0".to_owned(),
            "4000-1-stream.t.n.s.2".to_owned(),
        ]));
        let deleted = prune(t.path(), 2, &held).unwrap();
        assert_eq!(deleted, ["2000-1-stream.t.n.s.1", "3000-0-cache.t.n.c.0"]);
        let (copies, bytes) = count(t.path());
        assert_eq!(copies, 2, "the operator's directory is not counted");
        assert!(bytes >= 2 * 8192, "{bytes} bytes on disk");
        assert!(t.path().join("2026-12-02-notes/seg").exists());
        assert!(t.path().join("1000-0-stream.t.n.s.0").exists());
        // Nothing there yet: nothing to do, nothing counted.
        let missing = t.path().join("missing");
        assert!(prune(&missing, 2, &held).unwrap().is_empty());
        assert_eq!(count(&missing), (0, 0));
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
