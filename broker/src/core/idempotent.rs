//! Idempotent publishes on the core that owns the shard: the producer table decides each
//! batch against the shard's log (append, answer a re-send from the log, or refuse), in
//! the order the batches arrived.

use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use felix_core_runtime::placement::ShardKey;
use felix_core_runtime::task;
use felix_storage_uring::Appended;
use futures_channel::oneshot;

use super::{CoreBroker, Slot};
use crate::error::BrokerError;
use crate::producers::{Contents, Decision, ProducerTable, Queued};
use crate::shard::StreamShard;

type Outcome = Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>>;

/// How long a re-send of a batch still being written is told to wait.
const IN_FLIGHT_RETRY: &str = "in_flight";
/// The name of the snapshot of a stream shard's producer table beside its log.
const PRODUCERS_SNAPSHOT: &str = "producers";

impl CoreBroker {
    /// An idempotent publish of batch `tag = (producer_id, sequence)` on this (the
    /// owning) core. Decided and claimed at once when the shard's producer table is
    /// current; otherwise queued, in arrival order, while the table is built from the
    /// log.
    pub(super) fn append_idempotent(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        tag: (u64, u64),
    ) -> Outcome {
        if self.taking_over(&key) {
            // Held through a takeover's cut-over like any publish, in arrival order.
            let k = key.clone();
            return self.through_takeover(&k, move |c| c.append_idempotent(key, records, tag));
        }
        // Publishes that came while the shard was opening go first, whatever the
        // shard's state now: the table must see each producer's batches in the order
        // they arrived, or a pipelined producer's next batch is refused as a gap.
        let opening = {
            let waiting = self.idempotent_opening.borrow();
            !waiting.is_empty() && waiting.contains_key(&key)
        };
        let shard = match self.streams.borrow().get(&key) {
            Some(Slot::Ready(s)) if !opening => Some(s.clone()),
            _ => None,
        };
        if let Some(shard) = &shard {
            let current = shard
                .producers
                .borrow()
                .as_ref()
                .is_some_and(|t| t.end() == shard.log.next_offset());
            if current && shard.idempotent_queue.borrow().is_empty() {
                return self.decide_and_write(shard, key, records, tag);
            }
        }
        let (tx, rx) = oneshot::channel();
        let queued = Queued {
            records,
            tag,
            answer: tx,
        };
        match shard {
            Some(shard) => {
                let bytes = shard.idempotent_queue.borrow_mut().push(queued);
                self.idempotent_queued(bytes);
                self.build_producers(shard, key);
            }
            None => {
                let (first, bytes) = {
                    let mut opening = self.idempotent_opening.borrow_mut();
                    // By the entry, not its queue: a sweep may empty the queue while
                    // its opening task runs.
                    let first = !opening.contains_key(&key);
                    (first, opening.entry(key.clone()).or_default().push(queued))
                };
                self.idempotent_queued(bytes);
                if first {
                    let this = self.clone();
                    let awaiting = self.awaiting(&key);
                    task::spawn(async move {
                        let shard = this.stream_shard(&key).await;
                        drop(awaiting);
                        let waiting = this
                            .idempotent_opening
                            .borrow_mut()
                            .remove(&key)
                            .unwrap_or_default();
                        match shard {
                            Ok(shard) => {
                                shard.idempotent_queue.borrow_mut().append(waiting);
                                this.build_producers(shard, key);
                            }
                            Err(e) => {
                                let mut waiting = waiting;
                                for queued in waiting.take_to_serve() {
                                    let _ = queued.answer.send(Err(e.clone()));
                                }
                            }
                        }
                    })
                    .detach();
                }
            }
        }
        Box::pin(async move {
            rx.await.unwrap_or_else(|_| {
                Err(BrokerError::Internal(
                    "an idempotent publish was dropped unanswered".into(),
                ))
            })
        })
    }

    /// Notes `bytes` queued on this core's idempotent queues; each time the bound's
    /// worth has come since the last sweep, sweeps them all: past the bound, every
    /// publish whose client left is dropped, whichever shard's queue holds it
    /// ([`crate::producers::AbandonedBound`]).
    fn idempotent_queued(&self, bytes: usize) {
        if !self.idempotent_abandoned.queued(bytes) {
            return;
        }
        let shards = super::ready(&self.streams);
        let mut open: Vec<_> = shards
            .iter()
            .map(|s| s.idempotent_queue.borrow_mut())
            .collect();
        let mut opening = self.idempotent_opening.borrow_mut();
        let mut queues: Vec<&mut crate::producers::Waiting> = open
            .iter_mut()
            .map(|q| &mut **q)
            .chain(opening.values_mut())
            .collect();
        if self.idempotent_abandoned.sweep(&mut queues) {
            tracing::warn!(
                core = self.core.index(),
                "idempotent publishes whose clients left held past their bound: dropped"
            );
        }
    }

    /// Decides the batch against the current table and carries the decision out. The
    /// decision and the claim happen with no wait between them.
    fn decide_and_write(
        self: &Rc<Self>,
        shard: &Rc<StreamShard>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        (producer, sequence): (u64, u64),
    ) -> Outcome {
        let committed = shard.log.committed_end();
        let contents = Contents::of(&records);
        let (stamp, decision) = match shard.producers.borrow_mut().as_mut() {
            Some(t) => (
                t.stamp(),
                t.decide_committed(producer, sequence, contents, committed),
            ),
            None => {
                return Box::pin(std::future::ready(Err(BrokerError::ShardUnavailable(
                    "not_ready".into(),
                ))));
            }
        };
        match decision {
            Decision::Append => {
                let first = shard.log.next_offset();
                let tag = ((producer, sequence), contents);
                let written = self.write_tagged(key, records, None, Some(tag));
                let shard = shard.clone();
                Box::pin(async move {
                    let result = written.await;
                    let mut table = shard.producers.borrow_mut();
                    if let Some(t) = table.as_mut() {
                        // In the log (durable) whatever the fate of the ack: a re-send is
                        // answered from there. Otherwise it never got there: forgotten,
                        // so the re-send appends. Only in the table that admitted it,
                        // uncut since (see `Stamp`).
                        if result.is_ok() || shard.log.committed_end() > first {
                            t.written(stamp, producer, sequence);
                        } else {
                            t.failed(stamp, producer, sequence);
                        }
                    }
                    result
                })
            }
            Decision::Duplicate { pending: true, .. } => Box::pin(std::future::ready(Err(
                BrokerError::Overloaded(IN_FLIGHT_RETRY.into()),
            ))),
            Decision::Duplicate { first, end, .. } => {
                self.metrics
                    .idempotent_duplicates
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // A replicated shard whose replica is not attached yet: no answer
                // from a table its log may not have committed (a write fails too).
                let replica = match self.replica_of(&key) {
                    Ok(r) => r,
                    Err(e) => return Box::pin(std::future::ready(Err(e))),
                };
                // Answered only by a serving leader, in the term it was decided in, as a
                // write is (see `append_replicated`): a leader fenced by a successor (a
                // planned move names it at once, with no lease to wait out) answered a
                // re-send from its table though the successor, on a Leader shard, may
                // not hold the original; the producer's next batch then found a gap,
                // and the acknowledged batch was lost.
                let decided = match &replica {
                    Some(rs) if !rs.serving() => {
                        return Box::pin(std::future::ready(Err(BrokerError::ShardUnavailable(
                            "not_ready".into(),
                        ))));
                    }
                    Some(rs) => Some(rs.term()),
                    None => None,
                };
                let this = self.clone();
                Box::pin(async move {
                    // On a Quorum shard the original may not be committed yet (it came
                    // from a previous leader): answer once a majority holds it.
                    if let Some(rs) = &replica
                        && rs.consistency.get() == crate::catalog::Consistency::Quorum
                    {
                        let term = rs.term();
                        match task::timeout(
                            crate::replication::replica::QUORUM_WAIT,
                            rs.committed(end, term),
                        )
                        .await
                        {
                            Some(Ok(())) => {}
                            Some(Err(e)) => return Err(e),
                            None => {
                                return Err(BrokerError::Unacknowledged(
                                    "a majority did not confirm the original in time".into(),
                                ));
                            }
                        }
                    }
                    // An answer from the table is an acknowledgement like a write's: a
                    // leader past its lease (a successor may be taking writes, and on
                    // a `Leader` shard may not hold the original) must not give it.
                    if let Some(rs) = &replica
                        && (Some(rs.term()) != decided
                            || !rs.serving()
                            || !this.may_acknowledge(rs))
                    {
                        this.metrics
                            .lease_refusals
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        return Err(BrokerError::ShardUnavailable("stale".into()));
                    }
                    Ok(Appended { first, end })
                })
            }
            Decision::Refuse(reason) => {
                Box::pin(std::future::ready(Err(BrokerError::Refused(reason))))
            }
        }
    }

    /// Builds (or catches up) the shard's producer table from its log, once per shard at
    /// a time, then serves the queued publishes in arrival order.
    fn build_producers(self: &Rc<Self>, shard: Rc<StreamShard>, key: Arc<ShardKey>) {
        if shard.building_producers.replace(true) {
            return;
        }
        let this = self.clone();
        task::spawn(async move {
            let built = this.read_producers(&shard).await;
            shard.building_producers.set(false);
            // Those whose clients left are written too (a producer's later batch on
            // another connection may follow them), unless a sweep dropped them past
            // their bound (`producers::Waiting`).
            let queued = shard.idempotent_queue.borrow_mut().take_to_serve();
            for q in queued {
                let outcome = match &built {
                    Ok(()) => this.decide_and_write(&shard, key.clone(), q.records, q.tag),
                    Err(e) => Box::pin(std::future::ready(Err(e.clone()))) as Outcome,
                };
                task::spawn(async move {
                    let _ = q.answer.send(outcome.await);
                })
                .detach();
            }
        })
        .detach();
    }

    /// Reads the log into the producer table until the table covers every claim: the
    /// log's end, once the appends in flight are durable, or, once it has read up to
    /// them, the claims made while the shard had no table (they hold no producer's
    /// batch). Built again from the base should the shard's frontier be reset meanwhile
    /// (a cut: what was read may be gone), and cut back should a full disk give offsets
    /// back (the batches past the log's new end never reached it).
    async fn read_producers(&self, shard: &StreamShard) -> Result<(), BrokerError> {
        let fresh = || ProducerTable::at(shard.log.base_offset());
        let mut epoch = shard.producers_epoch.get();
        let taken = shard.producers.borrow_mut().take();
        let mut table = match taken {
            Some(t) => t,
            // A cut while it loads makes the loop below start from the base.
            None => {
                let (t, from_snapshot) = self.load_producers(shard).await;
                if from_snapshot {
                    self.metrics
                        .producer_tables_from_snapshot
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                t
            }
        };
        let mut read = 0u64;
        let mut idle = 0u32;
        loop {
            if shard.producers_epoch.get() != epoch {
                epoch = shard.producers_epoch.get();
                table = fresh();
            }
            let (durable, end) = (shard.log.committed_end(), shard.log.next_offset());
            table.cut_to(end);
            if shard.untagged_from.get().is_some_and(|from| from >= end) {
                // Those claims were given back.
                shard.untagged_from.set(None);
            }
            if shard
                .untagged_from
                .get()
                .is_some_and(|from| table.end() >= from)
            {
                table.skip_to(end);
            }
            if table.end() >= end {
                break;
            }
            if table.end() < durable {
                let batches = match shard.log.read(table.end(), 4 << 20).await {
                    Ok(b) => b,
                    Err(felix_storage_uring::StorageError::Trimmed { oldest, .. }) => {
                        // Retention removed segments while this read: what they held
                        // is forgotten, as retention forgets it anyway. (Failing here
                        // failed every publish queued behind the rebuild, fatally.)
                        table.skip_to(oldest);
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                read += record_bytes(&batches);
                if shard.producers_epoch.get() == epoch {
                    table.apply_batches(&batches, durable);
                }
                idle = 0;
                continue;
            }
            // Appends in flight: they are durable within a flush round.
            idle += 1;
            if idle > 5_000 {
                return Err(BrokerError::ShardUnavailable("not_ready".into()));
            }
            task::sleep(std::time::Duration::from_millis(1)).await;
        }
        // No wait since the checks above: the table covers every claim.
        *shard.producers.borrow_mut() = Some(table);
        shard.untagged_from.set(None);
        self.metrics
            .producer_table_read_bytes
            .fetch_add(read, std::sync::atomic::Ordering::Relaxed);
        // What this build read, the next one after a crash need not: due once it was
        // a snapshot's worth.
        let size = shard.log.written_bytes();
        shard
            .producers_snapshot_mark
            .set((shard.producers_snapshot_mark.get().min(size)).min(size.saturating_sub(read)));
        Ok(())
    }

    /// The table `shard`'s producer snapshot describes, trimmed to the log's base (the
    /// log is read on from the snapshot's offset), and true; an empty one at the base
    /// and false when there is none or it cannot be read.
    async fn load_producers(&self, shard: &StreamShard) -> (ProducerTable, bool) {
        let base = shard.log.base_offset();
        match shard.log.load_snapshot(PRODUCERS_SNAPSHOT).await {
            Ok(Some((as_of, body))) => match ProducerTable::from_snapshot(as_of, &body) {
                Some(mut t) => {
                    t.trim_below(shard.log.base_offset());
                    (t, true)
                }
                None => {
                    tracing::warn!(shard = %shard.key, as_of, "a producer snapshot it cannot read: reading the whole log");
                    (ProducerTable::at(base), false)
                }
            },
            Ok(None) => (ProducerTable::at(base), false),
            Err(e) => {
                tracing::warn!(shard = %shard.key, error = %e, "reading the producer snapshot: reading the whole log");
                (ProducerTable::at(base), false)
            }
        }
    }

    /// Saves the table of a shard this core keeps none of (a follower's copy that
    /// stored idempotent batches): read from its last snapshot and the log after it,
    /// saved, dropped. So a failover to this copy reads the log after that save only.
    fn save_stored_producers(self: &Rc<Self>, shard: Rc<StreamShard>) {
        if shard.saving_producers.replace(true) {
            return;
        }
        let this = self.clone();
        task::spawn(async move {
            this.read_and_save_producers(&shard).await;
            shard.saving_producers.set(false);
        })
        .detach();
    }

    async fn read_and_save_producers(&self, shard: &StreamShard) {
        // A cut while it reads (a follower's suffix replaced) leaves what was read
        // describing records gone: nothing is saved then.
        let (epoch, cuts) = (shard.producers_epoch.get(), shard.log.stats().cuts);
        let cut = || shard.producers_epoch.get() != epoch || shard.log.stats().cuts != cuts;
        let size = shard.log.written_bytes();
        // Whatever comes of it, the next try waits for the log to grow as much again.
        shard.producers_snapshot_mark.set(size);
        let (mut table, _) = self.load_producers(shard).await;
        let end = shard.log.committed_end();
        let mut read = 0u64;
        while table.end() < end && !cut() {
            match shard.log.read_to(table.end(), end, 4 << 20).await {
                Ok(batches) if batches.is_empty() => break,
                Ok(batches) => {
                    read += record_bytes(&batches);
                    table.apply_batches(&batches, end);
                }
                Err(felix_storage_uring::StorageError::Trimmed { oldest, .. }) => {
                    table.trim_below(oldest);
                }
                Err(e) => {
                    tracing::debug!(shard = %shard.key, error = %e, "reading the producer table");
                    return;
                }
            }
        }
        self.metrics
            .producer_table_read_bytes
            .fetch_add(read, std::sync::atomic::Ordering::Relaxed);
        // Leading since (its own table saves itself), or cut: nothing to save.
        if cut() || table.end() < end || shard.producers.borrow().is_some() {
            return;
        }
        let as_of = table.end().min(shard.log.committed_end());
        // No wait since the checks above.
        self.write_producers(shard, as_of, &table.snapshot(as_of), size)
            .await;
    }

    /// Saves the producer table of every shard whose log grew by
    /// `producer_snapshot_bytes` since its last save (a build after a crash reads about
    /// that much of the log, where it read the whole log before; a clean close, or a
    /// shard handed to another core, saves it too). A follower's copy that stored
    /// idempotent batches has its table read and saved in the background.
    pub(super) async fn snapshot_producers(self: &Rc<Self>) {
        let every = self.shared.producer_snapshot_bytes;
        let due: Vec<Rc<StreamShard>> = self
            .streams
            .borrow()
            .values()
            .filter_map(|slot| match slot {
                Slot::Ready(s) => {
                    let size = s.log.written_bytes();
                    let grown = size.saturating_sub(s.producers_snapshot_mark.get().min(size));
                    let kept = s.producers.borrow().is_some() || s.producer_batches_stored.get();
                    (grown >= every && kept).then(|| s.clone())
                }
                _ => None,
            })
            .collect();
        for s in due {
            if s.producers.borrow().is_some() {
                self.save_producers(&s).await;
            } else if !s.building_producers.get() {
                self.save_stored_producers(s);
            }
        }
    }

    /// Saves `shard`'s producer table (when it has one, and the log grew since the last
    /// save) as of the end of what its log acknowledged: a later build starts from it and
    /// reads only the log after it.
    pub(super) async fn save_producers(&self, shard: &StreamShard) {
        let size = shard.log.written_bytes();
        if shard.producers_snapshot_mark.get() == size {
            return;
        }
        let (as_of, body) = {
            let table = shard.producers.borrow();
            let Some(t) = table.as_ref() else { return };
            let as_of = shard.log.committed_end().min(t.end());
            (as_of, t.snapshot(as_of))
        };
        // No wait since the table was read.
        self.write_producers(shard, as_of, &body, size).await;
    }

    /// Saves `body`, `shard`'s table as of `as_of` (derived with no wait since: the log
    /// refuses a save across a cut), noting the log's `size` then: saved or not, the
    /// next try comes once the log grew by another `producer_snapshot_bytes` (a save
    /// failing for good, a full disk say, would otherwise read a follower's log back
    /// every round).
    async fn write_producers(&self, shard: &StreamShard, as_of: u64, body: &[u8], size: u64) {
        shard.producers_snapshot_mark.set(size);
        match shard
            .log
            .save_snapshot(PRODUCERS_SNAPSHOT, as_of, body)
            .await
        {
            Ok(()) => {
                self.metrics
                    .producer_snapshots_saved
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            // Closed meanwhile (moved, deleted), or cut.
            Err(
                felix_storage_uring::StorageError::Closed | felix_storage_uring::StorageError::Busy,
            ) => {}
            Err(e) => tracing::warn!(shard = %shard.key, error = %e, "saving the producer table"),
        }
    }
}

/// The bytes of the records in `batches` (what a table build read).
fn record_bytes(batches: &[felix_storage_uring::ReadBatch]) -> u64 {
    batches
        .iter()
        .flat_map(|b| &b.records)
        .map(|r| r.len() as u64)
        .sum()
}
