//! Copies of replicated shards this broker no longer holds a place for. The control
//! plane leaves a member out of a shard's set (a move's retirement, a replacement, a
//! drain) only once the set without it holds what was committed, and generations only
//! grow, so a copy left out at a newer generation than it accepted is removed after
//! [`LEFT_OUT_GRACE`]: a running replica by [`CoreBroker::leave_replica`], a copy left
//! out while this broker was down (no replica opens it) by
//! [`CoreBroker::remove_copies_left_while_down`]. A shard with one copy is never touched
//! (what an operator's `abandon` left behind stays for manual recovery). See
//! docs/replication.md, "A copy left behind is removed".

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use felix_core_runtime::placement::ShardKey;
use felix_core_runtime::task;

use super::{CoreBroker, shard_dir};
use crate::replication::machine::Meta;
use crate::replication::replica::{LEFT_OUT_GRACE, META_FILE};

/// Where a removed copy's directory is renamed before it is deleted, under the data
/// directory: the rename takes it out of every shard's path at once (a copy opened again
/// meanwhile starts from nothing), the deletion runs off the core. Emptied at start.
pub const TRASH_DIR: &str = "left-copies";

/// Copies found left out while this broker was down, since when, and when the last
/// look was.
#[derive(Debug, Default)]
pub struct LeftCopies {
    seen: HashMap<ShardKey, Instant>,
    last_look: Option<Instant>,
}

/// The generation a copy's replica accepted, from its metadata; `None` when the
/// directory holds no replica metadata (it never was a replica here).
fn accepted_generation(dir: &Path) -> Option<u64> {
    let bytes = std::fs::read(dir.join(META_FILE)).ok()?;
    serde_json::from_slice::<Meta>(&bytes)
        .ok()
        .map(|m| m.generation)
}

impl CoreBroker {
    /// Removes this broker's copy of a replicated shard whose set it left (see
    /// `Replicas::sync`): the replica stops, the shard closes, its directory goes.
    pub(super) async fn leave_replica(&self, key: &ShardKey) {
        let Some(replicas) = &self.replicas else {
            return;
        };
        if replicas.remove(key).is_none() {
            return;
        }
        self.close_shard(key, false).await;
        self.remove_copy(key).await;
    }

    /// Copies on disk of replicated shards whose set left this broker out while it was
    /// down: no replica opens them, so [`CoreBroker::leave_replica`] never sees them.
    /// Each is removed once the assignment has left this broker out for
    /// [`LEFT_OUT_GRACE`] at a generation above the one its replica accepted. Looks
    /// every 5 s (one metadata read per candidate).
    pub async fn remove_copies_left_while_down(&self) {
        let Some(replicas) = &self.replicas else {
            return;
        };
        let now = Instant::now();
        {
            let mut left = self.left_copies.borrow_mut();
            if left
                .last_look
                .is_some_and(|t| now.duration_since(t) < LEFT_OUT_GRACE)
            {
                return;
            }
            left.last_look = Some(now);
        }
        let root = self.shared.data_dir.clone();
        let candidates: Vec<(ShardKey, u64, PathBuf)> = replicas
            .not_driven_left_out(|k| self.owner(k) == self.core)
            .into_iter()
            .map(|(k, g)| {
                let dir = shard_dir(&root, &k);
                (k, g, dir)
            })
            .collect();
        if candidates.is_empty() {
            self.left_copies.borrow_mut().seen.clear();
            return;
        }
        let outdated: Vec<ShardKey> = task::spawn_blocking(move || {
            candidates
                .into_iter()
                .filter(|(_, generation, dir)| {
                    accepted_generation(dir).is_some_and(|accepted| accepted < *generation)
                })
                .map(|(k, _, _)| k)
                .collect()
        })
        .await;
        let due: Vec<ShardKey> = {
            let mut left = self.left_copies.borrow_mut();
            left.seen.retain(|k, _| outdated.contains(k));
            outdated
                .into_iter()
                .filter(|k| {
                    let since = *left.seen.entry(k.clone()).or_insert(now);
                    now.duration_since(since) >= LEFT_OUT_GRACE
                })
                .collect()
        };
        for key in due {
            // Looked at again with nothing awaited since: still left out, still not
            // driven or open here.
            let open =
                self.streams.borrow().contains_key(&key) || self.caches.borrow().contains_key(&key);
            if open || replicas.get(&key).is_some() || replicas.named(&key) {
                continue;
            }
            self.left_copies.borrow_mut().seen.remove(&key);
            self.remove_copy(&key).await;
        }
    }

    /// Renames `key`'s directory into the trash at once (on this core, so nothing opens
    /// it in between) and deletes it off the core.
    async fn remove_copy(&self, key: &ShardKey) {
        let root = &self.shared.data_dir;
        let dir = shard_dir(root, key);
        let trash = root.join(TRASH_DIR);
        let to = trash.join(format!(
            "{}-{}",
            self.core.index(),
            felix_core_runtime::clock::wall_micros()
        ));
        let moved = std::fs::create_dir_all(&trash).and_then(|()| std::fs::rename(&dir, &to));
        match moved {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(shard = %key, error = %e, "removing a left copy");
                return;
            }
        }
        let removed = task::spawn_blocking(move || std::fs::remove_dir_all(&to)).await;
        if let Err(e) = removed {
            tracing::warn!(shard = %key, error = %e, "deleting a left copy");
        }
        self.metrics.replicas_left.fetch_add(1, Ordering::Relaxed);
        tracing::info!(shard = %key, "removed the copy of a shard whose set this broker left");
    }
}

/// Empties the trash a crash may have left between a rename and its deletion.
pub fn empty_trash(root: &Path) {
    let trash = root.join(TRASH_DIR);
    if let Err(e) = std::fs::remove_dir_all(&trash)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %trash.display(), error = %e, "emptying the left copies' trash");
    }
}
