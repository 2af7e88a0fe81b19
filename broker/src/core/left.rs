//! Copies of replicated shards this broker no longer holds a place for. The control
//! plane leaves a member out of a shard's set (a move's retirement, a replacement, a
//! drain) only once the set without it holds what was committed, and generations only
//! grow, so a copy left out at a generation above the one it accepted is removed after
//! [`LEFT_OUT_GRACE`]: a running replica by [`CoreBroker::leave_replica`], a copy left
//! out while this broker was down (no replica opens it) by
//! [`CoreBroker::remove_copies_left_while_down`]. Never removed: copies of shards with
//! one copy, copies older than an operator's `abandon` (what a manual recovery would
//! start from), and anything while the assignments are stale (`Replicas::left_out`).
//! See docs/replication.md, "A copy left behind is removed".

use std::cell::Cell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_core_runtime::task;

use super::{CoreBroker, shard_dir};
use crate::replication::machine::Meta;
use crate::replication::replica::{LEFT_OUT_GRACE, META_FILE, ReplicaShard, Replicas};

/// Where a removed copy's directory is renamed before it is deleted, under the data
/// directory: the rename takes it out of its shard's path at once (a copy opened again
/// later starts from nothing), the deletion runs off the core. Emptied at start.
pub const TRASH_DIR: &str = "left-copies";

/// How long a removed replica's driver and stores get to stop before its copy goes.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Copies found left out while this broker was down, since when, and when the last
/// look was.
#[derive(Debug, Default)]
pub struct LeftCopies {
    seen: HashMap<ShardKey, Instant>,
    last_look: Option<Instant>,
    /// Names trash directories apart.
    removed: Cell<u64>,
}

/// The generation the replica of the copy in `dir` accepted, from its metadata; `None`
/// when it holds none (it never was a replica here).
fn accepted_generation(dir: &Path) -> Option<u64> {
    let bytes = std::fs::read(dir.join(META_FILE)).ok()?;
    serde_json::from_slice::<Meta>(&bytes)
        .ok()
        .map(|m| m.generation)
}

/// Every shard copy under `root` holding replica metadata, with the generation its
/// replica accepted (`streams|caches/<tenant>/<namespace>/<name>/<shard>/replica`).
fn replica_copies(root: &Path) -> Vec<(ShardKey, u64)> {
    fn dirs(p: &Path) -> impl Iterator<Item = (String, PathBuf)> {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
    }
    let mut found = Vec::new();
    for (kind, top) in [(ShardKind::Stream, "streams"), (ShardKind::Cache, "caches")] {
        for (tenant, t) in dirs(&root.join(top)) {
            for (namespace, n) in dirs(&t) {
                for (name, s) in dirs(&n) {
                    for (shard, d) in dirs(&s) {
                        let Ok(shard) = shard.parse::<u32>() else {
                            continue;
                        };
                        let Some(accepted) = accepted_generation(&d) else {
                            continue;
                        };
                        let key = ShardKey {
                            kind,
                            tenant: tenant.clone(),
                            namespace: namespace.clone(),
                            name: name.clone(),
                            shard,
                        };
                        found.push((key, accepted));
                    }
                }
            }
        }
    }
    found
}

impl CoreBroker {
    /// Removes this broker's copy of a replicated shard whose set it left (see
    /// `Replicas::sync`): the replica stops, its driver and stores finish, the shard
    /// closes, and its directory goes unless an assignment named this broker again
    /// meanwhile.
    pub(super) async fn leave_replica(self: &Rc<Self>, key: &ShardKey) {
        let Some(replicas) = &self.replicas else {
            return;
        };
        let Some(rs) = replicas.remove(key) else {
            return;
        };
        if !Replicas::wait_stopped(&rs, STOP_WAIT).await {
            // Finished once it stops, on a task of its own (the caller goes on to the
            // other replicas): left as it was, the shard stayed open and its copy on
            // disk until a restart, as the look for copies no replica drives passes
            // over open shards.
            tracing::warn!(shard = %key, "a left replica did not stop in time; its copy goes once it does");
            let (this, key) = (self.clone(), key.clone());
            task::spawn(async move {
                while !Replicas::wait_stopped(&rs, STOP_WAIT).await {}
                this.finish_leaving(&key, &rs).await;
            })
            .detach();
            return;
        }
        self.finish_leaving(key, &rs).await;
    }

    /// Closes the shard of the stopped replica `rs` and removes its copy, unless a
    /// replica for `key` was made again meanwhile (an assignment named this broker
    /// again: the shard is its).
    async fn finish_leaving(&self, key: &ShardKey, rs: &ReplicaShard) {
        let Some(replicas) = &self.replicas else {
            return;
        };
        if replicas.get(key).is_some() {
            return;
        }
        self.close_shard(key, false).await;
        if replicas.get(key).is_none() && replicas.left_out(key, rs.known_generation()) {
            self.remove_copy(key);
        }
    }

    /// Copies on disk of replicated shards whose set left this broker out while it was
    /// down: no replica opens them, so [`CoreBroker::leave_replica`] never sees them.
    /// Each is removed once the assignments have left this broker out for
    /// [`LEFT_OUT_GRACE`] (see `Replicas::left_out`). Looks every 5 s: one walk of the
    /// data directory, off the core.
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
        let copies = task::spawn_blocking(move || replica_copies(&root)).await;
        let mine: Vec<ShardKey> = copies
            .into_iter()
            .filter(|(k, accepted)| self.owner(k) == self.core && replicas.left_out(k, *accepted))
            .map(|(k, _)| k)
            .collect();
        let due: Vec<ShardKey> = {
            let mut left = self.left_copies.borrow_mut();
            left.seen.retain(|k, _| mine.contains(k));
            mine.into_iter()
                .filter(|k| {
                    let since = *left.seen.entry(k.clone()).or_insert(now);
                    now.duration_since(since) >= LEFT_OUT_GRACE
                })
                .collect()
        };
        for key in due {
            // Looked at again with nothing awaited before the rename: its metadata
            // (a replica could have opened it since the walk), not open here, still
            // left out.
            let dir = shard_dir(&self.shared.data_dir, &key);
            let accepted = accepted_generation(&dir);
            let open =
                self.streams.borrow().contains_key(&key) || self.caches.borrow().contains_key(&key);
            if !open && accepted.is_some_and(|g| replicas.left_out(&key, g)) {
                self.left_copies.borrow_mut().seen.remove(&key);
                self.remove_copy(&key);
            }
        }
    }

    /// Renames `key`'s directory into the trash at once (on this core, so nothing
    /// opens it in between) and deletes it off the core in the background.
    fn remove_copy(&self, key: &ShardKey) {
        let root = &self.shared.data_dir;
        let dir = shard_dir(root, key);
        let trash = root.join(TRASH_DIR);
        let n = {
            let left = self.left_copies.borrow();
            let n = left.removed.get();
            left.removed.set(n + 1);
            n
        };
        let to = trash.join(format!(
            "{}-{}-{n}",
            self.core.index(),
            felix_core_runtime::clock::wall_micros()
        ));
        match std::fs::create_dir_all(&trash).and_then(|()| std::fs::rename(&dir, &to)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(shard = %key, error = %e, "removing a left copy");
                return;
            }
        }
        self.metrics.replicas_left.fetch_add(1, Ordering::Relaxed);
        tracing::info!(shard = %key, "removed the copy of a shard whose set this broker left");
        let key = key.clone();
        task::spawn(async move {
            if let Err(e) = task::spawn_blocking(move || std::fs::remove_dir_all(&to)).await {
                tracing::warn!(shard = %key, error = %e, "deleting a left copy");
            }
        })
        .detach();
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
