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
    /// committed (no failover takes it back) and on this disk. When none does, the core
    /// that writes the shard asks its groups for one (built for it if no group request
    /// built them); a follower waits for its leader's. Until 2026-12-08 retention took
    /// no notice: when less than a snapshot's worth of log was kept (a small size bound,
    /// an age bound on a slow stream), the next fold missed every group whose events all
    /// lay below the cut (an idle group vanished) and the seeks whose events went.
    pub(super) async fn group_floor(
        self: &Rc<Self>,
        shard: &Rc<StreamShard>,
        cut: u64,
    ) -> Result<u64, BrokerError> {
        let replica = self.replica_of(&shard.key)?;
        let writes = replica.as_ref().is_none_or(|rs| rs.serving());
        let committed = shard.log.committed_end();
        let visible = replica
            .as_ref()
            .map_or(committed, |rs| rs.commit().min(committed));
        let base = shard.log.base_offset();
        let mut scan = shard.group_snapshot_scan.get();
        if scan.newest.is_some_and(|n| n < base) || scan.scanned_to > visible {
            // The log was started over (a follower far behind): looked at from its base.
            scan = crate::groups::SnapshotScan::default();
        }
        let from = scan.scanned_to.max(base);
        if from < visible {
            if let Some(n) = crate::groups::newest_snapshot(shard, from, visible).await? {
                scan.newest = Some(n);
            }
            scan.scanned_to = visible;
        }
        shard.group_snapshot_scan.set(scan);
        if let Some(n) = scan.newest
            && n >= cut
        {
            if n >= shard.log.durable_end() {
                // The snapshots below go: this one is on this disk first.
                shard.log.sync().await?;
            }
            return Ok(cut);
        }
        if writes && visible >= scan.asked_at {
            scan.asked_at = shard.log.next_offset();
            shard.group_snapshot_scan.set(scan);
            self.snapshot_groups_for_retention(shard);
        }
        Ok(scan.newest.unwrap_or(base))
    }

    /// Asks `shard`'s groups for a snapshot now, building them first if no group
    /// request has (in the background: retention looks for it next round).
    fn snapshot_groups_for_retention(self: &Rc<Self>, shard: &Rc<StreamShard>) {
        let (core, stream) = (self.clone(), shard.clone());
        task::spawn(async move {
            let key = stream.key.clone();
            if stream.closing.get() || !core.serves(&key) || core.draining() {
                return;
            }
            let written = match core.group_shard(&key, &stream).await {
                Ok(groups) => {
                    let written = groups.snapshot_for_retention(
                        stream.log.written_bytes(),
                        stream.log.base_offset(),
                    );
                    core.metrics
                        .group_snapshots
                        .fetch_add(groups.take_snapshots(), Ordering::Relaxed);
                    written.then_some(()).ok_or_else(|| {
                        BrokerError::Storage(
                            "no snapshot can be written (a failed group write, or past the snapshot bound)"
                                .into(),
                        )
                    })
                }
                Err(e) => Err(e),
            };
            if let Err(e) = written {
                let mut scan = stream.group_snapshot_scan.get();
                if !std::mem::replace(&mut scan.warned, true) {
                    stream.group_snapshot_scan.set(scan);
                    tracing::warn!(shard = %key, error = %e, "retention holds the segments with the newest group snapshot until one can be written");
                }
            }
        })
        .detach();
    }
}
