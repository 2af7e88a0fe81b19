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
