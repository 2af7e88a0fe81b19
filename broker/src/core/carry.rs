//! Carrying a stream shard's state past retention (the design is in `state.rs`): before
//! retention removes the segments below a cut, the core that writes the shard copies
//! the live entries whose newest record lies below it to the tail (a `State` batch,
//! written, replicated and fenced like any write), and every copy of the shard keeps
//! the segments that still hold a live entry's newest record.

use std::rc::Rc;
use std::sync::atomic::Ordering;

use felix_core_runtime::task;

use super::{CoreBroker, Special};
use crate::error::BrokerError;
use crate::replication::replica::{QUORUM_WAIT, ReplicaShard};
use crate::shard::StreamShard;

/// How long retention waits before asking again for a group snapshot that could not
/// be written (the writes in flight did not drain, the lease lapsed, the state is too
/// large): each ask may hold group writes back for up to 500 ms.
const ASK_AGAIN_AFTER_MS: u64 = 10_000;

/// The most copied in one round (the rest waits for the next round, and holds
/// retention back until then).
const COPY_ROUND_BYTES: usize = 4 << 20;

impl CoreBroker {
    /// The lowest offset retention may remove up to for `shard`'s state, when it would
    /// cut the log at `cut` (0: nothing this round). The writing core first copies the
    /// live entries below the cut, provided every commit it claimed is already in the
    /// index (no commit lies between what a copy reads and where it lands); otherwise,
    /// and on followers, the floor holds until the copies arrive.
    pub(super) async fn state_floor(
        self: &Rc<Self>,
        shard: &Rc<StreamShard>,
        cut: u64,
    ) -> Result<u64, BrokerError> {
        let replica = self.replica_of(&shard.key)?;
        let writes = replica.as_ref().is_none_or(|rs| rs.serving());
        let visible = || match &replica {
            None => shard.fanout_end(),
            Some(rs) if rs.serving() => rs.visible_end().min(rs.log().committed_end()),
            // A follower knows what is committed, and folds no further.
            Some(rs) => rs.commit(),
        };
        self.catch_up_state(shard, visible()).await?;
        if !self.index_committed(shard, replica.as_deref()).await {
            return Ok(0);
        }
        // The index knows nothing past what is visible (a commit still on its way to
        // the disk may sit in a segment a roll already sealed): keep that too.
        let floor = || {
            let f = shard.state.borrow().as_ref().map_or(0, |i| i.floor());
            f.min(visible())
        };
        if !writes {
            if floor() >= cut {
                // The copies that let the originals go are on this disk first.
                shard.log.sync().await?;
            }
            return Ok(floor());
        }
        if floor() >= cut {
            return Ok(floor());
        }
        let (entries, end) = match shard.state.borrow().as_ref() {
            Some(i) => (i.below(cut), i.end()),
            None => return Ok(0),
        };
        if end < shard.commits_claimed.get() || entries.is_empty() {
            // A commit is on its way to the log: copy next round. Or nothing below the
            // cut to copy, the floor held down by what is visible (a roll's new
            // segment before its records are): nothing to do this round (taking one
            // of none panicked the core).
            return Ok(floor());
        }
        let mut size = 0;
        let take = entries
            .iter()
            .take_while(|(k, v, _)| {
                size += 16 + k.len() + v.len();
                size <= COPY_ROUND_BYTES
            })
            .count()
            .max(1);
        let records = crate::state::encode_copies(&entries[..take]);
        // Claimed in this call, with no await since the check above.
        self.write_tagged(shard.key.clone(), records, Some(Special::State), None)
            .await?;
        // Acknowledged is not enough under `fsync: none` or `periodic`: the records they
        // replace are about to go, so the copies are on disk first.
        shard.log.sync().await?;
        self.metrics
            .state_copies
            .fetch_add(take as u64, Ordering::Relaxed);
        self.catch_up_state(shard, visible()).await?;
        // On a Leader stream the copy was acknowledged before a majority held it.
        if !self.index_committed(shard, replica.as_deref()).await {
            return Ok(0);
        }
        Ok(floor())
    }

    /// Whether every record `shard`'s state index holds is committed: the floor counts
    /// committed records only, since an entry whose newest record no majority holds yet
    /// (a Leader stream acknowledges before that) still needs the record before it,
    /// which the index no longer knows. A serving leader waits for its followers (at
    /// most [`QUORUM_WAIT`]); unreplicated shards always are.
    async fn index_committed(&self, shard: &StreamShard, replica: Option<&ReplicaShard>) -> bool {
        let Some(rs) = replica else {
            return true;
        };
        let end = || shard.state.borrow().as_ref().map(|i| i.end());
        let Some(at) = end() else {
            return false;
        };
        if rs.commit() < at {
            if !rs.serving() {
                return false;
            }
            if !matches!(
                task::timeout(QUORUM_WAIT, rs.committed(at, rs.term())).await,
                Some(Ok(()))
            ) {
                return false;
            }
        }
        // A read meanwhile may have taken the index further.
        end().is_some_and(|e| e <= rs.commit())
    }
}

impl CoreBroker {
    /// The lowest offset retention may remove up to for `shard`'s consumer groups, when
    /// it would cut the log at `cut` and the segments below hold `Group` batches. A fold
    /// of the groups starts from the newest group snapshot (`groups/mod.rs`), so the
    /// segments from the newest one on stay until a newer one lies at or past the cut,
    /// committed (no failover takes it back) and on this disk (no rollback does). When
    /// none does, the core that writes the shard asks its groups for one (built for it
    /// if no group request built them); a follower waits for its leader's. Until
    /// 2026-12-07 retention took no notice: when less than a snapshot's worth of log was
    /// kept (a small size bound, an age bound on a slow stream), the next fold missed
    /// every group whose events all lay below the cut (an idle group vanished) and the
    /// seeks whose events went.
    pub(super) async fn group_floor(
        self: &Rc<Self>,
        shard: &Rc<StreamShard>,
        cut: u64,
    ) -> Result<u64, BrokerError> {
        let base = shard.log.base_offset();
        let known = shard.group_snapshot_scan.get().newest;
        if known.is_some_and(|n| n >= cut && n >= base) {
            return Ok(cut);
        }
        // Only what is on this disk counts: under `fsync: none` or `periodic` a full
        // disk can take back records already acknowledged, a snapshot among them.
        shard.log.sync().await?;
        let replica = self.replica_of(&shard.key)?;
        let writes = replica.as_ref().is_none_or(|rs| rs.serving());
        let durable = shard.log.durable_end().min(shard.log.committed_end());
        let visible = replica
            .as_ref()
            .map_or(durable, |rs| rs.commit().min(durable));
        let base = shard.log.base_offset();
        // The log was started over (a follower far behind): looked at from its base.
        let stale = |s: &crate::groups::SnapshotScan| {
            s.newest.is_some_and(|n| n < base) || s.scanned_to > visible
        };
        let before = shard.group_snapshot_scan.get();
        let from = if stale(&before) {
            base
        } else {
            before.scanned_to.max(base)
        };
        let found = if from < visible {
            crate::groups::newest_snapshot(shard, from, visible).await?
        } else {
            None
        };
        // Read again after the wait: the asking task may have changed other fields.
        let mut scan = shard.group_snapshot_scan.get();
        if stale(&scan) {
            scan.newest = None;
        }
        scan.newest = found.or(scan.newest);
        scan.scanned_to = visible;
        let held = match scan.newest {
            Some(n) if n >= cut => None,
            other => Some(other.unwrap_or(base)),
        };
        let ask = held.is_some()
            && writes
            && !scan.asking
            && visible >= scan.asked_at
            && crate::groups::mono_ms() >= scan.not_before_ms;
        if ask {
            scan.asked_at = shard.log.next_offset();
            scan.asking = true;
        }
        // Set before the task is spawned: set after it, this was seen to overwrite the
        // task's end (`asking` stayed set, and no snapshot was asked for again).
        shard.group_snapshot_scan.set(scan);
        if ask {
            self.snapshot_groups_for_retention(shard);
        }
        Ok(held.unwrap_or(cut))
    }

    /// Asks `shard`'s groups for a snapshot now, building them first if no group
    /// request has (in the background: retention looks for it next round).
    fn snapshot_groups_for_retention(self: &Rc<Self>, shard: &Rc<StreamShard>) {
        use crate::groups::RetentionSnapshot as R;
        let (core, stream) = (self.clone(), shard.clone());
        task::spawn(async move {
            let key = stream.key.clone();
            // A lapsed lease or a lost leadership is looked at just before the write
            // (`GroupShard::snapshot_for_retention`).
            let outcome = if stream.closing.get() || !core.serves(&key) || core.draining() {
                Ok(R::Retired)
            } else {
                match core.group_shard(&key, &stream).await {
                    Ok(groups) => {
                        let outcome = groups
                            .snapshot_for_retention(
                                stream.log.written_bytes(),
                                stream.log.base_offset(),
                            )
                            .await;
                        core.metrics
                            .group_snapshots
                            .fetch_add(groups.take_snapshots(), Ordering::Relaxed);
                        Ok(outcome)
                    }
                    Err(e) => Err(e),
                }
            };
            let mut scan = stream.group_snapshot_scan.get();
            scan.asking = false;
            let now = crate::groups::mono_ms();
            match outcome {
                // Not asked again before it is committed.
                Ok(R::Written) => scan.asked_at = stream.log.next_offset(),
                Ok(R::Retired) => {}
                Ok(R::Busy) => scan.not_before_ms = now + ASK_AGAIN_AFTER_MS,
                Ok(R::Stopped) => {
                    // A failed group write stopped snapshots until the groups are built
                    // again, which nothing else may bring about: built at the next ask.
                    stream.forget_groups_until(stream.log.next_offset());
                    tracing::info!(shard = %key, "groups built again for the snapshot retention needs");
                }
                Ok(R::TooLarge) | Err(_) => {
                    scan.not_before_ms = now + ASK_AGAIN_AFTER_MS;
                    if !std::mem::replace(&mut scan.warned, true) {
                        tracing::warn!(shard = %key, outcome = ?outcome, "retention keeps the segments from the newest group snapshot on until a snapshot can be written");
                    }
                }
            }
            stream.group_snapshot_scan.set(scan);
        })
        .detach();
    }
}
