//! The replica machine of one stream shard, driven on the core that owns the shard, and
//! the per-core set of them ([`Replicas`]).
//!
//! The driver carries out the machine's outputs in order, awaiting storage where the
//! machine must wait for it (a ballot before answering a fence, a stored batch before
//! acknowledging it, a cut before storing over it); messages go out through the core's
//! [`Outbound`] without waiting. A leader's own client appends claim their offsets in
//! the log and tell the machine synchronously (`admit`), so appends and shipping agree on
//! every offset. Quorum acknowledgements wait for the commit mark; waiters are woken in
//! offset order, so the fanout that follows each of them happens in offset order too.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_core_runtime::{CoreId, clock, task};
use felix_storage_uring::{BatchKind as LogBatchKind, PendingAppend};
use felix_wire::internal::{self, InternalMessage, MAX_RECORDS_PER_MESSAGE, RefusalCode, ShardRef};
use felix_wire::{Generation, Offset, ShardId, message};

use super::machine::{
    Assignment, Batch, BatchKind, Meta, Msg, NodeId, Output, Refusal, Replica, generation_named,
};
use super::peer::Outbound;
use crate::catalog::Consistency;
use crate::cluster::{Cluster, FollowerReport, Route, ShardReport};
use crate::core::CoreMetrics;
use crate::error::BrokerError;
use crate::shard::{CacheShard, StreamShard};
use felix_storage_uring::{DmaBackend, SegmentLog};

/// The meta file holding a replica's ballot and commit mark.
pub const META_FILE: &str = "replica";
/// Generation starts whose records the log no longer holds (see
/// [`super::machine::Output::KeepEpochs`]): JSON `[[offset, generation], ..]`.
const EPOCHS_FILE: &str = "epochs";
/// Where the log's generation-start records are, written before each one is (JSON
/// `[[offset, generation], ..]`): a replica opens by checking each, instead of reading
/// its whole log to find them. An entry whose record never made it (a crash between) or
/// was cut is dropped at the check.
const STARTS_FILE: &str = "generation-starts";
/// How long an idle replica's driver sleeps between timer checks.
const TICK: Duration = Duration::from_millis(100);
/// How long a Quorum publish waits for a majority before its outcome is unknown.
pub const QUORUM_WAIT: Duration = Duration::from_secs(5);
/// Requests remembered for routing their answers back.
const PENDING_MAX: usize = 65_536;

/// Requests sent, by correlation id: the shard and the [`ReplicaShard::instance`] that
/// sent each (an answer reaches only the replica that asked), and their order (the
/// oldest are forgotten first).
type PendingRequests = (HashMap<u64, (Arc<ShardKey>, u64)>, VecDeque<u64>);

/// What a replica's log belongs to, for what each kind does on top of the log: a
/// stream's fanout frontier, a cache's key index.
#[derive(Debug, Clone)]
pub enum Held {
    /// A stream shard.
    Stream(Rc<StreamShard>),
    /// A cache shard.
    Cache(Rc<CacheShard>),
}

impl Held {
    fn log(&self) -> &SegmentLog<DmaBackend> {
        match self {
            Held::Stream(s) => &s.log,
            Held::Cache(c) => c.log(),
        }
    }

    /// After the log's suffix was cut or replaced: what was derived from it follows.
    async fn after_cut(&self, end: u64) {
        match self {
            Held::Stream(s) => s.reset_fanout(s.fanout_end().min(end)),
            Held::Cache(c) => {
                if let Err(e) = c.rebuild().await {
                    c.forget_cut_marker_from(end);
                    tracing::error!(shard = %c.key, error = %e, "rebuilding a cache index");
                }
            }
        }
    }
}

/// One replicated shard on its owning core.
pub struct ReplicaShard {
    /// Which shard.
    pub key: Arc<ShardKey>,
    /// The life of the stream or cache it is a copy of (the control plane's incarnation;
    /// empty when not known). Messages naming another life of the name are ignored: a
    /// copy of a deleted stream not yet removed here must not answer the fence of one
    /// created again under its name (it would hand the new one the deleted records).
    incarnation: RefCell<Rc<str>>,
    /// Unique among the replicas this core ever opened: answers to requests sent by an
    /// earlier replica of the same shard (removed since) do not reach this one.
    instance: u64,
    /// Its stream or cache is gone from the catalog (deleted; the cores remove the
    /// replica and its data at their next housekeeping round): it answers nothing.
    defunct: Cell<bool>,
    /// Its stream or cache state.
    pub held: Held,
    log: SegmentLog<DmaBackend>,
    /// Derived state (a cache's index) is rebuilt before a new leader takes requests.
    ready: Cell<bool>,
    machine: RefCell<Replica>,
    /// When writes are acknowledged.
    pub consistency: Cell<Consistency>,
    waker: RefCell<Option<Waker>>,
    kicked: Cell<bool>,
    /// Quorum acknowledgements waiting for the commit mark: end -> wakers.
    waiters: RefCell<BTreeMap<u64, Vec<Waker>>>,
    /// Bumped whenever this replica stops or starts serving: a waiter from another
    /// leadership term never succeeds.
    term: Cell<u64>,
    generation: Cell<u64>,
    /// A stream leader's log end when it began serving: records below it were written
    /// before this term and are fanned out by no append, so a marker does it as the
    /// commit mark passes them (see [`ReplicaShard::fanout_marker`]).
    unfanned_until: Cell<u64>,
    /// Follower stores claimed and not yet durable (or failed): a cut waits for them.
    stores_in_flight: Cell<usize>,
    /// Bumped by every cut or reset: a store claimed before one reports nothing when it
    /// completes (the machine's view of those offsets was cut, and what is stored there
    /// next is not this store's).
    store_era: Cell<u64>,
    /// What this leader claimed lately, as it is shipped (see [`ShipBuffer`]).
    shipping: RefCell<ShipBuffer>,
    /// Forgotten by [`Replicas::remove`]: its driver stops.
    stopped: Cell<bool>,
    /// Its driver has stopped: it carries out nothing more.
    driver_done: Cell<bool>,
    /// Since when the control plane's assignment has left this broker out of the set
    /// (see [`Replicas::sync`]).
    left_out_since: Cell<Option<std::time::Instant>>,
}

/// How often the same failure to open a replica is logged again.
const OPEN_FAILED_REPEAT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a replica whose set this broker left is kept before its data is removed:
/// the control plane's word is final (generations only grow), so this is a margin for
/// an operator's second thoughts, not for safety.
pub const LEFT_OUT_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// A copy is removed only on assignments read from the control plane this recently (the
/// feed resyncs every few seconds; a broker that cannot reach it removes nothing).
pub const VIEW_FRESH: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether `r` leaves broker `me` out of a set of more than one copy in a way that lets
/// a copy that accepted generation `accepted` go: at a newer generation, and not by an
/// operator's abandon that came after it (see `core/left.rs`).
fn left_out_of(me: &str, r: &Route, accepted: u64) -> bool {
    r.replicas.len() > 1
        && r.generation > accepted
        && r.abandoned.is_none_or(|g| accepted >= g)
        && !r
            .replicas
            .iter()
            .chain(r.learners.iter())
            .any(|n| **n == *me)
}

/// Bytes of recent claims a leader keeps to ship from memory.
const SHIP_BUFFER_BYTES: usize = 8 << 20;

/// A leader's latest claims, contiguous, as batches: followers are shipped them (once
/// durable here) without reading them back from the device. Older records are read
/// from the log. Cleared when the leader's claims and its machine disagree, and when
/// it stops or starts serving.
#[derive(Debug, Default)]
struct ShipBuffer {
    batches: VecDeque<Batch>,
    bytes: usize,
}

impl ShipBuffer {
    fn push(&mut self, batch: Batch) {
        if self.batches.back().is_some_and(|b| b.end() != batch.base) {
            self.clear();
        }
        self.bytes += batch.records.iter().map(Bytes::len).sum::<usize>();
        self.batches.push_back(batch);
        while self.bytes > SHIP_BUFFER_BYTES && self.batches.len() > 1 {
            self.pop();
        }
    }

    fn pop(&mut self) {
        if let Some(b) = self.batches.pop_front() {
            self.bytes -= b.records.iter().map(Bytes::len).sum::<usize>();
        }
    }

    fn clear(&mut self) {
        self.batches.clear();
        self.bytes = 0;
    }

    /// Drops what every follower holds.
    fn trim_below(&mut self, offset: u64) {
        while self.batches.front().is_some_and(|b| b.end() <= offset) {
            self.pop();
        }
    }

    /// Batches from the one holding `from`, about `max_bytes` of them, none reaching
    /// past `durable` (a record is shipped only once durable here: see
    /// `Replica::handle_appended`); `None` when `from` is not held here.
    fn read(&self, from: u64, max_bytes: usize, durable: u64) -> Option<Vec<Batch>> {
        let first = self.batches.front()?;
        if from < first.base || from >= self.batches.back()?.end() || from >= durable {
            return None;
        }
        let i = self.batches.partition_point(|b| b.end() <= from);
        let mut out = Vec::new();
        let (mut bytes, mut records) = (0, 0);
        for b in self.batches.range(i..) {
            let full = bytes >= max_bytes || records + b.records.len() > MAX_RECORDS_PER_MESSAGE;
            if b.end() > durable || (!out.is_empty() && full) {
                break;
            }
            bytes += b.records.iter().map(Bytes::len).sum::<usize>();
            records += b.records.len();
            out.push(b.clone());
        }
        Some(out)
    }
}

/// The batches from the front of `batches` one message carries: at most
/// [`MAX_RECORDS_PER_MESSAGE`] records in all (the first batch whatever its count; a
/// client's batch holds no more). Bounded by bytes alone, a backlog of small records
/// made messages the encoder refused, dropped every time: the follower never caught
/// up, and Quorum writes never committed.
fn within_one_message(mut batches: Vec<Batch>) -> Vec<Batch> {
    let mut records = 0;
    let keep = batches
        .iter()
        .take_while(|b| {
            records += b.records.len();
            records <= MAX_RECORDS_PER_MESSAGE
        })
        .count()
        .max(1);
    batches.truncate(keep);
    batches
}

impl std::fmt::Debug for ReplicaShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaShard")
            .field("key", &self.key)
            .finish()
    }
}

impl ReplicaShard {
    /// Waits until the follower stores in flight are durable (or failed): a cut must
    /// not race them.
    async fn after_stores(&self) {
        while self.stores_in_flight.get() > 0 {
            task::sleep(Duration::from_micros(200)).await;
        }
    }

    /// Awaits a follower store claimed by the driver and reports it to the machine.
    async fn finish_store(
        &self,
        batches: Vec<Batch>,
        pending: Vec<PendingAppend>,
        failed: Option<felix_storage_uring::StorageError>,
        metrics: &CoreMetrics,
        era: u64,
    ) {
        let log = &self.log;
        let now = || clock::now().instant;
        let mut failed = failed;
        let records: u64 = batches.iter().map(|b| b.records.len() as u64).sum();
        let mut end = None;
        for p in pending {
            match log.commit(p).await {
                Ok(a) => end = Some(a.end),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if self.store_era.get() != era {
            // Cut or reset since it was claimed: nothing to report.
            return;
        }
        match failed {
            None => {
                metrics.replicated.fetch_add(records, Ordering::Relaxed);
                if let Some(end) = end {
                    self.machine.borrow_mut().handle_durable(end, now());
                }
                if let Held::Stream(s) = &self.held
                    && batches
                        .iter()
                        .any(|b| b.kind == BatchKind::Data && b.producer.is_some())
                {
                    // Its producer table is saved now and then (housekeeping).
                    s.producer_batches_stored.set(true);
                }
                if let Held::Cache(c) = &self.held {
                    // A compaction's cut marker: the prefix goes once it commits.
                    c.note_stored(
                        batches
                            .iter()
                            .filter(|b| b.kind == BatchKind::Data)
                            .map(|b| (b.base, &b.records[..])),
                    );
                }
            }
            Some(e) => {
                tracing::warn!(shard = %self.key, error = %e, "storing replicated batches");
                self.storage_failed();
            }
        }
    }

    /// Storage failed to carry out a store, cut or reset: the machine takes the log's end
    /// from storage.
    fn storage_failed(&self) {
        self.machine.borrow_mut().handle_failed(
            self.log.next_offset(),
            self.log.committed_end(),
            clock::now().instant,
        );
    }

    fn kick(&self) {
        self.kicked.set(true);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Whether this replica leads and serves.
    pub fn serving(&self) -> bool {
        self.ready.get() && self.machine.borrow().serving()
    }

    /// Whether this replica was named leader and does not serve yet (fencing, catching
    /// up, writing its generation start, rebuilding what it serves from).
    pub fn taking_over(&self) -> bool {
        let m = self.machine.borrow();
        m.taking_over() || (m.serving() && !self.ready.get())
    }

    /// The log.
    pub fn log(&self) -> &SegmentLog<DmaBackend> {
        &self.log
    }

    /// The leadership term (changes whenever this replica starts or stops leading).
    pub fn term(&self) -> u64 {
        self.term.get()
    }

    /// The commit mark.
    pub fn commit(&self) -> u64 {
        self.machine.borrow().commit()
    }

    /// Before records below `upto` are removed: keeps what a restart needs to know of
    /// their generations.
    pub async fn keep_epochs(&self, upto: u64) -> Result<(), BrokerError> {
        let epochs = self.machine.borrow().epochs_through(upto);
        write_epochs(&self.log, &epochs).await
    }

    /// Storage removed records below the log's base: the machine follows.
    pub fn rebased(&self) {
        self.machine
            .borrow_mut()
            .handle_base(self.log.base_offset());
        self.kick();
    }

    /// The generation this replica accepted.
    pub fn generation(&self) -> u64 {
        self.machine.borrow().generation()
    }

    /// The newest generation this replica was handed or accepted.
    pub fn known_generation(&self) -> u64 {
        self.generation.get().max(self.generation())
    }

    /// Where fanout should move to now, if a serving stream leader's commit mark has
    /// passed records from before its term that no append fanned out. Subscribers (and
    /// new subscribers' history reads, which stop at the fanout frontier) see those
    /// records only once the frontier moves; with no new writes nothing else moves it.
    pub fn fanout_marker(&self) -> Option<u64> {
        let Held::Stream(s) = &self.held else {
            return None;
        };
        if !self.serving() {
            return None;
        }
        let to = self.visible_end().min(self.unfanned_until.get());
        (to > s.fanout_end()).then_some(to)
    }

    /// A write that reached the log and was answered without an ack (outcome unknown:
    /// no majority in time, or the lease or the term lost meanwhile) is fanned out by no
    /// append: the marker does it once it is visible (it may yet commit), as for records
    /// from before the term. Without this, on a stream quiet after it, subscribers and
    /// group polls (which stop at the fanout frontier) never saw it.
    pub fn fan_out_later(&self, end: u64) {
        self.unfanned_until.set(self.unfanned_until.get().max(end));
    }

    /// What readers may see: the commit mark on a Quorum shard, everything otherwise.
    pub fn visible_end(&self) -> u64 {
        match self.consistency.get() {
            Consistency::Quorum => self.machine.borrow().commit(),
            Consistency::Leader => u64::MAX,
        }
    }

    /// Claims `records` at the log's end for a client append on the serving leader.
    /// Returns the pending append and the leadership term it was admitted in.
    pub fn admit(
        &self,
        records: &[Bytes],
        now_micros: u64,
        tag: Option<(u64, u64)>,
    ) -> Result<(PendingAppend, u64), BrokerError> {
        let shipped = |base| Batch {
            base,
            kind: BatchKind::Data,
            timestamp_micros: now_micros,
            producer: tag,
            records: records.to_vec(),
        };
        let tag = tag.map(|(producer_id, sequence)| felix_storage_uring::ProducerTag {
            producer_id,
            sequence,
        });
        self.admit_with(|log| log.begin_append(records, now_micros, tag), shipped)
    }

    /// As [`ReplicaShard::admit`], for an atomic commit's one record (a `Commit` batch).
    pub fn admit_commit(
        &self,
        record: &Bytes,
        now_micros: u64,
    ) -> Result<(PendingAppend, u64), BrokerError> {
        let shipped = |base| Batch {
            base,
            kind: BatchKind::Commit,
            timestamp_micros: now_micros,
            producer: None,
            records: vec![record.clone()],
        };
        self.admit_with(|log| log.begin_commit(record, now_micros), shipped)
    }

    /// As [`ReplicaShard::admit`], for consumer-group events (a `Group` batch).
    pub fn admit_group(
        &self,
        records: &[Bytes],
        now_micros: u64,
    ) -> Result<(PendingAppend, u64), BrokerError> {
        let shipped = |base| Batch {
            base,
            kind: BatchKind::Group,
            timestamp_micros: now_micros,
            producer: None,
            records: records.to_vec(),
        };
        self.admit_with(|log| log.begin_group(records, now_micros), shipped)
    }

    /// As [`ReplicaShard::admit`], for copies of state entries (a `State` batch).
    pub fn admit_state(
        &self,
        records: &[Bytes],
        now_micros: u64,
    ) -> Result<(PendingAppend, u64), BrokerError> {
        let shipped = |base| Batch {
            base,
            kind: BatchKind::State,
            timestamp_micros: now_micros,
            producer: None,
            records: records.to_vec(),
        };
        self.admit_with(|log| log.begin_state(records, now_micros), shipped)
    }

    /// Claims with `claim` on the serving leader, tells the machine where the log now
    /// ends, and ships the batch (`shipped`, given its base) from memory: the one
    /// admission path every kind of write takes.
    fn admit_with(
        &self,
        claim: impl FnOnce(
            &SegmentLog<DmaBackend>,
        ) -> Result<PendingAppend, felix_storage_uring::StorageError>,
        shipped: impl FnOnce(u64) -> Batch,
    ) -> Result<(PendingAppend, u64), BrokerError> {
        let mut m = self.machine.borrow_mut();
        if !m.serving() || !self.ready.get() {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        self.forget_given_back(&mut m);
        let pending = claim(&self.log)?;
        self.shipping.borrow_mut().push(shipped(pending.first()));
        if !m.handle_appended(pending.first(), pending.end()) {
            self.shipping.borrow_mut().clear();
            return Err(BrokerError::Internal(format!(
                "{}: the log and the replica disagree on the end",
                self.key
            )));
        }
        Ok((pending, self.term.get()))
    }

    /// After a leader's append admitted in `term` failed: the log may have given
    /// offsets back. Nothing to do once this replica stopped leading that term (its
    /// machine then follows storage through its own stores and cuts).
    pub fn append_failed(&self, term: u64) {
        let mut m = self.machine.borrow_mut();
        if self.term.get() == term && m.serving() {
            self.forget_given_back(&mut m);
        }
    }

    /// A full disk makes the log give back the offsets of batches it had not written
    /// (storage step 5): it then ends below where the machine was told it ends, and
    /// every later claim would start below it. Those batches were never shipped
    /// (shipping waits for durability here) nor acknowledged, so the machine forgets
    /// them too.
    fn forget_given_back(&self, m: &mut super::machine::Replica) {
        let end = self.log.next_offset();
        let (told, durable) = m.log_end();
        if end < told {
            // Its own durable end: what storage made durable since reaches it through
            // `durable`, which does the follow-up work (commit, shipping).
            m.handle_failed(end, durable, clock::now().instant);
            self.shipping.borrow_mut().clear();
        }
    }

    /// Waits, up to [`QUORUM_WAIT`], until a serving Quorum leader may answer reads
    /// from what it rebuilt at takeover: its log holds the furthest copy's records,
    /// some maybe not committed, and they are once its generation start is (log
    /// matching). Until then a reader could see a write that a failover of this leader
    /// would cut. `not_ready` when it is not committed in time; at once on a Leader
    /// shard (which promises no more) and once per generation otherwise.
    pub async fn reads_settled(&self) -> Result<(), BrokerError> {
        if self.reads_ready() {
            return Ok(());
        }
        let Some(start) = self.machine.borrow().generation_start() else {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        };
        match task::timeout(QUORUM_WAIT, self.committed(start + 1, self.term())).await {
            Some(Ok(())) => Ok(()),
            Some(Err(_)) | None => Err(BrokerError::ShardUnavailable("not_ready".into())),
        }
    }

    /// Whether [`Self::reads_settled`] would answer at once.
    pub fn reads_ready(&self) -> bool {
        self.consistency.get() != Consistency::Quorum
            || self.machine.borrow().committed_in_generation()
    }

    /// The leader's own append is durable up to `end`.
    pub fn durable(&self, end: u64) {
        self.machine
            .borrow_mut()
            .handle_durable(end, clock::now().instant);
        self.kick();
    }

    /// Waits until a majority holds `[.., end)`, in the term `term`. Fails when
    /// leadership changed meanwhile (the outcome is then unknown).
    pub async fn committed(&self, end: u64, term: u64) -> Result<(), BrokerError> {
        poll_fn(|cx| {
            if self.term.get() != term {
                return Poll::Ready(Err(BrokerError::Unacknowledged(
                    "leadership changed before a majority held the write".into(),
                )));
            }
            if self.machine.borrow().commit() >= end {
                return Poll::Ready(Ok(()));
            }
            self.waiters
                .borrow_mut()
                .entry(end)
                .or_default()
                .push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    fn on_commit(&self, commit: u64) {
        let ready = {
            let mut w = self.waiters.borrow_mut();
            let later = w.split_off(&(commit + 1));
            std::mem::replace(&mut *w, later)
        };
        // In offset order: what each waiter does next (fanout) happens in that order.
        for (_, wakers) in ready {
            wakers.into_iter().for_each(Waker::wake);
        }
    }

    async fn on_serving(self: &Rc<Self>, serving: bool) {
        self.term.set(self.term.get() + 1);
        self.ready.set(false);
        self.shipping.borrow_mut().clear();
        let all = std::mem::take(&mut *self.waiters.borrow_mut());
        for (_, wakers) in all {
            wakers.into_iter().for_each(Waker::wake);
        }
        if serving {
            match &self.held {
                Held::Stream(s) => {
                    let end = self.log.committed_end();
                    s.reset_fanout(end.min(self.visible_end()));
                    self.unfanned_until.set(end);
                }
                Held::Cache(c) => {
                    if let Err(e) = c.rebuild().await {
                        tracing::error!(shard = %self.key, error = %e, "rebuilding a cache index");
                        // Tried again, on a task of its own (the driver goes on), while
                        // this term lasts: given up, the replica went on reporting itself
                        // leader and never served (`ready` never set).
                        let (this, c, term) = (self.clone(), c.clone(), self.term.get());
                        task::spawn(async move {
                            let mut wait = Duration::from_millis(50);
                            loop {
                                task::sleep(wait).await;
                                wait = (wait * 2).min(Duration::from_secs(2));
                                let current = || {
                                    this.term.get() == term
                                        && this.machine.borrow().serving()
                                        && !this.stopped.get()
                                };
                                if !current() {
                                    return;
                                }
                                match c.rebuild_if(current).await {
                                    Ok(true) => {
                                        this.ready.set(true);
                                        this.kick();
                                        return;
                                    }
                                    Ok(false) => return,
                                    Err(e) => tracing::error!(shard = %this.key, error = %e, "rebuilding a cache index"),
                                }
                            }
                        })
                        .detach();
                        return;
                    }
                }
            }
            self.ready.set(true);
        } else if let Held::Cache(c) = &self.held {
            // What it staged as leader is in its log or will be cut from it; the index is
            // rebuilt before it serves again. Their keys are let go now, and its watches
            // look again (and find it no longer serves).
            c.drop_staged();
            c.recheck_watches();
        }
    }

    /// The report a leader makes.
    fn report(&self) -> Option<ShardReport> {
        let m = self.machine.borrow();
        let cannot_lead = m.cannot_lead();
        if !m.is_leader() && !cannot_lead {
            return None;
        }
        let k = &self.key;
        Some(ShardReport {
            kind: match k.kind {
                ShardKind::Stream => "stream",
                ShardKind::Cache => "cache",
            },
            tenant_id: k.tenant.clone(),
            namespace: k.namespace.clone(),
            name: k.name.clone(),
            shard: k.shard,
            // (Not leading: the generation it was named leader at.)
            generation: if cannot_lead {
                self.generation.get()
            } else {
                m.generation()
            },
            log_end: m.log_end().1,
            commit: m.commit(),
            generation_committed: m.committed_in_generation(),
            cannot_lead,
            followers: m
                .followers()
                .into_iter()
                .map(|f| FollowerReport {
                    node_id: f.peer.to_string(),
                    durable_end: f.matched,
                    halted: f.halted,
                    staged: f.staged,
                    rebuilding: f.rebuilding,
                })
                .collect(),
        })
    }
}

/// Every replica this core drives, and the transport they share.
pub struct Replicas {
    me: NodeId,
    core: CoreId,
    cluster: Arc<Cluster>,
    out: Outbound,
    shards: RefCell<HashMap<Arc<ShardKey>, Rc<ReplicaShard>>>,
    next_correlation: Cell<u64>,
    next_instance: Cell<u64>,
    /// Replicas that failed to open, with the reason last logged and when.
    open_failed: RefCell<HashMap<ShardKey, (String, std::time::Instant)>>,
    /// Requests we sent, for routing answers: correlation id -> shard and instance.
    pending: RefCell<PendingRequests>,
    /// The last request each peer sent about each shard: its answers echo the id.
    last_in: RefCell<HashMap<(Arc<ShardKey>, NodeId), u64>>,
    metrics: Arc<CoreMetrics>,
}

impl std::fmt::Debug for Replicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicas")
            .field("core", &self.core)
            .field("shards", &self.shards.borrow().len())
            .finish()
    }
}

/// How `rs`'s messages name its shard, and the life of the name it copies.
fn shard_ref(rs: &ReplicaShard) -> ShardRef {
    let (key, life) = (&rs.key, rs.incarnation.borrow());
    ShardRef {
        kind: match key.kind {
            ShardKind::Stream => message::ShardKind::Stream,
            ShardKind::Cache => message::ShardKind::Cache,
        },
        tenant: key.tenant.as_str().into(),
        namespace: key.namespace.as_str().into(),
        name: key.name.as_str().into(),
        incarnation: (&**life).into(),
        shard: ShardId(key.shard),
    }
}

/// Whether a message naming incarnation `theirs` is about the life of the name a replica
/// of `ours` copies. Either side not knowing its incarnation (a catalog or a peer from
/// before incarnations) matches.
fn same_life(ours: &str, theirs: &str) -> bool {
    ours.is_empty() || theirs.is_empty() || ours == theirs
}

/// The shard a wire reference names.
pub fn shard_key(r: &ShardRef) -> ShardKey {
    ShardKey {
        kind: match r.kind {
            message::ShardKind::Stream => ShardKind::Stream,
            message::ShardKind::Cache => ShardKind::Cache,
        },
        tenant: r.tenant.as_str().to_owned(),
        namespace: r.namespace.as_str().to_owned(),
        name: r.name.as_str().to_owned(),
        shard: r.shard.0,
    }
}

/// Where an inbound frame goes: the shard it names (requests) or the core that sent the
/// request it answers (the top byte of its correlation id).
#[derive(Debug)]
pub enum Target {
    /// A request about a shard.
    Shard(ShardKey),
    /// An answer to a request sent by this core.
    Core(CoreId),
}

/// Where `m` goes, or `None` when it needs no routing.
pub fn target(m: &InternalMessage) -> Option<Target> {
    match m {
        InternalMessage::Fence(f) => Some(Target::Shard(shard_key(&f.shard))),
        InternalMessage::Fetch(f) => Some(Target::Shard(shard_key(&f.shard))),
        InternalMessage::Records(r) => Some(Target::Shard(shard_key(&r.shard))),
        InternalMessage::Bootstrap(b) => Some(Target::Shard(shard_key(&b.shard))),
        InternalMessage::FenceOk(_)
        | InternalMessage::ReplicateOk(_)
        | InternalMessage::ReplicateRefused(_) => {
            Some(Target::Core(CoreId((m.correlation_id() >> 56) as usize)))
        }
        _ => None,
    }
}

fn refusal_code(r: Refusal) -> RefusalCode {
    match r {
        Refusal::Gap => RefusalCode::Gap,
        Refusal::Mismatch => RefusalCode::Mismatch,
        Refusal::Fenced => RefusalCode::Fenced,
        Refusal::NotFenced => RefusalCode::NotFenced,
        Refusal::BelowCommit => RefusalCode::BelowCommit,
        Refusal::Bootstrap => RefusalCode::Bootstrap,
        Refusal::Unavailable => RefusalCode::Unavailable,
        Refusal::Rebuilding => RefusalCode::Rebuilding,
        Refusal::RebuildingNeedsGeneration => RefusalCode::RebuildingNeedsGeneration,
    }
}

fn refusal(c: RefusalCode) -> Refusal {
    match c {
        RefusalCode::Gap => Refusal::Gap,
        RefusalCode::Mismatch => Refusal::Mismatch,
        RefusalCode::Fenced => Refusal::Fenced,
        RefusalCode::NotFenced => Refusal::NotFenced,
        RefusalCode::BelowCommit => Refusal::BelowCommit,
        RefusalCode::Bootstrap => Refusal::Bootstrap,
        RefusalCode::Rebuilding => Refusal::Rebuilding,
        RefusalCode::RebuildingNeedsGeneration => Refusal::RebuildingNeedsGeneration,
        _ => Refusal::Unavailable,
    }
}

/// Machine batches on the wire and back.
fn ship_batch(b: Batch) -> internal::ShipBatch {
    internal::ShipBatch {
        base_offset: Offset(b.base),
        timestamp_micros: b.timestamp_micros,
        kind: match b.kind {
            BatchKind::Data => internal::BatchKind::Data,
            BatchKind::GenerationStart(_) => internal::BatchKind::GenerationStart,
            BatchKind::Commit => internal::BatchKind::Commit,
            BatchKind::Group => internal::BatchKind::Group,
            BatchKind::State => internal::BatchKind::State,
        },
        producer: b.producer,
        records: b.records,
    }
}

fn machine_batch(b: internal::ShipBatch) -> Batch {
    let kind = match b.kind {
        internal::BatchKind::Data => BatchKind::Data,
        internal::BatchKind::Commit => BatchKind::Commit,
        internal::BatchKind::Group => BatchKind::Group,
        internal::BatchKind::State => BatchKind::State,
        internal::BatchKind::GenerationStart => {
            BatchKind::GenerationStart(generation_named(&b.records).unwrap_or(0))
        }
    };
    Batch {
        base: b.base_offset.0,
        kind,
        timestamp_micros: b.timestamp_micros,
        producer: b.producer,
        records: b.records,
    }
}

impl Replicas {
    /// The replicas of core `core` of broker `me`, sending through `out`.
    pub fn new(
        me: NodeId,
        core: CoreId,
        cluster: Arc<Cluster>,
        out: Outbound,
        metrics: Arc<CoreMetrics>,
    ) -> Replicas {
        Replicas {
            me,
            core,
            cluster,
            out,
            shards: RefCell::default(),
            // A random start per process and core: a follower's late answer to a
            // request of this broker's previous life carries an id from that life, which
            // counted from 1 too, and could name another shard's request in this one.
            next_correlation: Cell::new(rand::random::<u64>() & ((1 << 56) - 1)),
            next_instance: Cell::new(1),
            open_failed: RefCell::default(),
            pending: RefCell::default(),
            last_in: RefCell::default(),
            metrics,
        }
    }

    /// The replica of `key`, if this core drives one.
    pub fn get(&self, key: &ShardKey) -> Option<Rc<ReplicaShard>> {
        self.shards.borrow().get(key).cloned()
    }

    /// Stops driving `key`'s replica and forgets it: its stream or cache was deleted, or
    /// this broker left its set. A write waiting for its commit fails (outcome unknown).
    /// The caller closes the shard; a later assignment naming this broker again opens a
    /// new replica.
    pub fn remove(&self, key: &ShardKey) -> Option<Rc<ReplicaShard>> {
        let rs = self.shards.borrow_mut().remove(key)?;
        self.last_in.borrow_mut().retain(|(k, _), _| **k != *key);
        rs.stopped.set(true);
        rs.ready.set(false);
        rs.term.set(rs.term.get() + 1);
        let waiting = std::mem::take(&mut *rs.waiters.borrow_mut());
        waiting.into_values().flatten().for_each(Waker::wake);
        rs.kick();
        if let Ok(mut all) = self.cluster.reports.lock() {
            all.remove(key);
        }
        Some(rs)
    }

    /// For a copy on disk that no replica on this core drives and whose replica had
    /// accepted generation `accepted`: whether the assignments, read from the control
    /// plane within [`VIEW_FRESH`], left this broker out of its set (see
    /// [`Replicas::sync`]).
    pub fn left_out(&self, key: &ShardKey, accepted: u64) -> bool {
        if !self.cluster.view_fresh(VIEW_FRESH) || self.shards.borrow().contains_key(key) {
            return false;
        }
        self.cluster
            .view()
            .routes
            .get(key)
            .is_some_and(|r| left_out_of(&self.me, r, accepted))
    }

    /// Waits until the driver of `rs` (removed by [`Replicas::remove`]) has stopped
    /// and no store of it is in flight; false if that takes longer than `within`.
    pub async fn wait_stopped(rs: &ReplicaShard, within: Duration) -> bool {
        let until = std::time::Instant::now() + within;
        while !rs.driver_done.get() || rs.stores_in_flight.get() > 0 {
            if std::time::Instant::now() >= until {
                return false;
            }
            task::sleep(Duration::from_millis(1)).await;
        }
        true
    }

    /// Every replica this core drives.
    pub fn all(&self) -> Vec<Rc<ReplicaShard>> {
        self.shards.borrow().values().cloned().collect()
    }

    fn correlation(&self, rs: &ReplicaShard) -> u64 {
        let n = self.next_correlation.get();
        self.next_correlation.set(n + 1);
        let id = ((self.core.index() as u64) << 56) | (n & ((1 << 56) - 1));
        let (map, order) = &mut *self.pending.borrow_mut();
        map.insert(id, (rs.key.clone(), rs.instance));
        order.push_back(id);
        while order.len() > PENDING_MAX {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
        id
    }

    /// Encodes and queues `msg` of `rs` for `to`.
    fn send(&self, rs: &ReplicaShard, to: &NodeId, msg: Msg) {
        let key = &rs.key;
        let Some(addr) = self.cluster.view().peers.get(&**to).copied() else {
            return;
        };
        let answer_id = || {
            self.last_in
                .borrow()
                .get(&(key.clone(), to.clone()))
                .copied()
                .unwrap_or(0)
        };
        let me = self.me.to_string();
        let wire = match msg {
            Msg::Fence { generation } => InternalMessage::Fence(internal::Fence {
                correlation_id: self.correlation(rs),
                shard: shard_ref(rs),
                generation: Generation(generation),
                leader: me,
            }),
            Msg::FenceOk {
                generation,
                base,
                end,
                commit,
                last_generation,
            } => InternalMessage::FenceOk(internal::FenceOk {
                correlation_id: answer_id(),
                generation: Generation(generation),
                log_base: Offset(base),
                log_end: Offset(end),
                commit: Offset(commit),
                last_generation: Generation(last_generation),
            }),
            Msg::Fetch { generation, from } => InternalMessage::Fetch(internal::Fetch {
                correlation_id: self.correlation(rs),
                shard: shard_ref(rs),
                generation: Generation(generation),
                leader: me,
                from_offset: Offset(from),
                max_bytes: super::machine::SHIP_BYTES as u32,
            }),
            Msg::Records {
                generation,
                from,
                prev_generation,
                commit,
                batches,
                fetched,
            } => {
                let records: u64 = batches.iter().map(|b| b.records.len() as u64).sum();
                self.metrics
                    .replication_shipped
                    .fetch_add(records, Ordering::Relaxed);
                // `leader` names the generation's leader: the requester for a fetch's
                // answer, ourselves for a ship. `prev_offset` carries `from - 1` (0/0
                // for a message at offset 0).
                let (prev_offset, prev_generation) = if from == 0 {
                    (0, 0)
                } else {
                    (from - 1, prev_generation)
                };
                InternalMessage::Records(internal::Records {
                    correlation_id: if fetched {
                        answer_id()
                    } else {
                        self.correlation(rs)
                    },
                    shard: shard_ref(rs),
                    generation: Generation(generation),
                    leader: if fetched { to.to_string() } else { me },
                    prev_offset: Offset(prev_offset),
                    prev_generation: Generation(prev_generation),
                    commit: Offset(commit),
                    batches: batches.into_iter().map(ship_batch).collect(),
                })
            }
            Msg::Ok { generation, end } => InternalMessage::ReplicateOk(internal::ReplicateOk {
                correlation_id: answer_id(),
                generation: Generation(generation),
                durable_end: Offset(end),
            }),
            Msg::Refused {
                generation,
                code,
                expected,
            } => InternalMessage::ReplicateRefused(internal::ReplicateRefused {
                correlation_id: answer_id(),
                generation: Generation(generation),
                code: refusal_code(code),
                expected_offset: Offset(expected),
                detail: String::new(),
            }),
            Msg::Bootstrap { generation, base } => {
                InternalMessage::Bootstrap(internal::Bootstrap {
                    correlation_id: self.correlation(rs),
                    shard: shard_ref(rs),
                    generation: Generation(generation),
                    leader: me,
                    base_offset: Offset(base),
                })
            }
        };
        let mut buf = BytesMut::new();
        match wire.encode(&mut buf) {
            Ok(()) => self.out.send(to, addr, buf.freeze()),
            Err(e) => tracing::error!(shard = %key, error = %e, "encoding a replication message"),
        }
    }

    /// A frame from peer `from`, routed to this core.
    pub fn deliver(&self, from: NodeId, m: InternalMessage) {
        let now = clock::now().instant;
        // Requests name the life of the stream they are about; answers reach only the
        // replica instance that asked. A request's correlation id is remembered for the
        // answers only once it passed both checks: an answer of another life's replica
        // must not carry it.
        let (mut life, mut asker, mut incoming) = (None, None, None);
        let (key, msg) = match m {
            InternalMessage::Fence(f) => {
                let key = Arc::new(shard_key(&f.shard));
                incoming = Some(f.correlation_id);
                life = Some(f.shard.incarnation);
                (
                    key,
                    Msg::Fence {
                        generation: f.generation.0,
                    },
                )
            }
            InternalMessage::Fetch(f) => {
                let key = Arc::new(shard_key(&f.shard));
                incoming = Some(f.correlation_id);
                life = Some(f.shard.incarnation);
                (
                    key,
                    Msg::Fetch {
                        generation: f.generation.0,
                        from: f.from_offset.0,
                    },
                )
            }
            InternalMessage::Bootstrap(b) => {
                let key = Arc::new(shard_key(&b.shard));
                incoming = Some(b.correlation_id);
                life = Some(b.shard.incarnation);
                (
                    key,
                    Msg::Bootstrap {
                        generation: b.generation.0,
                        base: b.base_offset.0,
                    },
                )
            }
            InternalMessage::Records(r) => {
                let fetched = r.leader == *self.me;
                // The answer to our fetch: only while the request is pending (instance
                // ids start at 1, so 0 matches no replica).
                if fetched {
                    asker = Some(self.answered(r.correlation_id).map_or(0, |(_, i)| i));
                } else {
                    incoming = Some(r.correlation_id);
                }
                let key = Arc::new(shard_key(&r.shard));
                life = Some(r.shard.incarnation);
                let from_offset = match r.batches.first() {
                    Some(b) => b.base_offset.0,
                    None if r.prev_offset.0 == 0 && r.prev_generation.0 == 0 => 0,
                    None => r.prev_offset.0.saturating_add(1),
                };
                (
                    key,
                    Msg::Records {
                        generation: r.generation.0,
                        from: from_offset,
                        prev_generation: r.prev_generation.0,
                        commit: r.commit.0,
                        batches: r.batches.into_iter().map(machine_batch).collect(),
                        fetched,
                    },
                )
            }
            InternalMessage::FenceOk(f) => {
                let Some((key, instance)) = self.answered(f.correlation_id) else {
                    return;
                };
                asker = Some(instance);
                (
                    key,
                    Msg::FenceOk {
                        generation: f.generation.0,
                        base: f.log_base.0,
                        end: f.log_end.0,
                        commit: f.commit.0,
                        last_generation: f.last_generation.0,
                    },
                )
            }
            InternalMessage::ReplicateOk(o) => {
                let Some((key, instance)) = self.answered(o.correlation_id) else {
                    return;
                };
                asker = Some(instance);
                (
                    key,
                    Msg::Ok {
                        generation: o.generation.0,
                        end: o.durable_end.0,
                    },
                )
            }
            InternalMessage::ReplicateRefused(r) => {
                let Some((key, instance)) = self.answered(r.correlation_id) else {
                    return;
                };
                asker = Some(instance);
                (
                    key,
                    Msg::Refused {
                        generation: r.generation.0,
                        code: refusal(r.code),
                        expected: r.expected_offset.0,
                    },
                )
            }
            _ => return,
        };
        let Some(rs) = self.get(&key) else {
            // Not (yet) a replica here: the sender asks again once we have caught up
            // with the control plane's assignment.
            return;
        };
        if asker.is_some_and(|i| i != rs.instance) {
            // An answer to a replica of this shard removed since.
            return;
        }
        if let Some(theirs) = life
            && !same_life(&rs.incarnation.borrow(), theirs.as_str())
        {
            // About another life of the name: ours was deleted (and is not removed
            // yet) or the sender's was. Ignored like a shard we do not hold; the
            // sender asks again once both sides follow the control plane.
            tracing::debug!(shard = %key, from = %from, theirs = %theirs.as_str(), "a message about another incarnation");
            return;
        }
        if rs.defunct.get() {
            // Its stream or cache is gone from the catalog: it answers nothing while its
            // deletion is under way.
            return;
        }
        if let Some(correlation_id) = incoming {
            self.last_in
                .borrow_mut()
                .insert((key, from.clone()), correlation_id);
        }
        rs.machine.borrow_mut().handle_message(from, msg, now);
        rs.kick();
    }

    fn answered(&self, correlation_id: u64) -> Option<(Arc<ShardKey>, u64)> {
        self.pending.borrow().0.get(&correlation_id).cloned()
    }

    /// Brings this core's replicas in line with the control plane's assignments:
    /// opens a replica for every replicated stream or cache shard this broker is in the
    /// set of and this core owns, and hands each its assignment. `replicated` answers a
    /// replicated shard's consistency and incarnation; `open` opens the shard.
    ///
    /// Answers the replicas whose set this broker left [`LEFT_OUT_GRACE`] ago or more,
    /// for the caller to remove with their data: the control plane wrote a newer
    /// generation without this broker, which it does only once the new set holds what
    /// was committed (a move's retirement waits for a commit in the new generation; a
    /// replaced or drained member was one copy of a majority that stays).
    pub async fn sync<F, Fut>(
        self: &Rc<Self>,
        owned: impl Fn(&ShardKey) -> bool,
        replicated: impl Fn(&ShardKey) -> Option<(Consistency, String)>,
        open: F,
    ) -> Vec<Arc<ShardKey>>
    where
        F: Fn(Arc<ShardKey>) -> Fut,
        Fut: std::future::Future<Output = Result<Held, BrokerError>>,
    {
        let view = self.cluster.view();
        let mine: Vec<(ShardKey, Route)> = view
            .routes
            .iter()
            .filter(|(k, r)| {
                r.replicas.len() > 1
                    && r.replicas
                        .iter()
                        .chain(r.learners.iter())
                        .any(|n| **n == *self.me)
                    && owned(k)
            })
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect();
        for (key, route) in mine {
            let Some((consistency, incarnation)) = replicated(&key) else {
                continue;
            };
            let existing = self.get(&key);
            let rs = match existing {
                Some(rs) if !same_life(&rs.incarnation.borrow(), &incarnation) => {
                    // A copy of a deleted life of the name: the deletion under way
                    // removes it, and the next sync opens the new one.
                    continue;
                }
                Some(rs) => {
                    if rs.incarnation.borrow().is_empty() && !incarnation.is_empty() {
                        *rs.incarnation.borrow_mut() = incarnation.into();
                    }
                    rs
                }
                None => match self
                    .open(Arc::new(key.clone()), consistency, &incarnation, &open)
                    .await
                {
                    Ok(_)
                        if replicated(&key)
                            .is_none_or(|(_, now)| !same_life(&incarnation, &now)) =>
                    {
                        // Deleted while it opened (its deletion may have closed the log
                        // already, and would not find this replica to remove it).
                        self.remove(&key);
                        continue;
                    }
                    Ok(rs) => {
                        self.open_failed.borrow_mut().remove(&key);
                        rs
                    }
                    Err(e) => {
                        // Tried again every sync (ten a second): said once a minute, or
                        // when the reason changes (a damaged copy would flood the log).
                        let now = std::time::Instant::now();
                        let reason = e.to_string();
                        let mut failed = self.open_failed.borrow_mut();
                        let said = failed.get(&key).is_some_and(|(r, at)| {
                            *r == reason && now.duration_since(*at) < OPEN_FAILED_REPEAT
                        });
                        if !said {
                            tracing::warn!(shard = %key, error = %reason, "opening a replica (tried again every sync; said again once a minute)");
                            failed.insert(key.clone(), (reason, now));
                        }
                        continue;
                    }
                },
            };
            rs.consistency.set(consistency);
            let learners_changed = *rs.machine.borrow().learners() != *route.learners;
            if rs.generation.get() != route.generation || learners_changed {
                rs.generation.set(route.generation);
                rs.machine.borrow_mut().handle_assignment(
                    Assignment {
                        generation: route.generation,
                        leader: route.leader.clone(),
                        replicas: route.replicas.to_vec(),
                        learners: route.learners.to_vec(),
                        handoff_from: route.handoff_from.clone(),
                    },
                    clock::now().instant,
                );
                rs.kick();
            }
        }
        for rs in self.all() {
            let gone = replicated(&rs.key)
                .is_none_or(|(_, now)| !same_life(&rs.incarnation.borrow(), &now));
            rs.defunct.set(gone);
        }
        let now = std::time::Instant::now();
        let mut left = Vec::new();
        let fresh = self.cluster.view_fresh(VIEW_FRESH);
        for rs in self.all() {
            // Above every generation this replica was handed or accepted: a view that
            // trails a re-add this replica already accepted never removes it.
            let accepted = rs.known_generation();
            let left_out = fresh
                && view
                    .routes
                    .get(&*rs.key)
                    .is_some_and(|r| left_out_of(&self.me, r, accepted));
            if !left_out {
                rs.left_out_since.set(None);
                continue;
            }
            let since = rs.left_out_since.get().unwrap_or(now);
            rs.left_out_since.set(Some(since));
            if now.duration_since(since) >= LEFT_OUT_GRACE && !rs.serving() {
                left.push(rs.key.clone());
            }
        }
        // Reports of the shards this core leads.
        let mut reports = Vec::new();
        let mut lag = 0u64;
        let mut halted = 0u64;
        let rebuilding = self
            .all()
            .iter()
            .filter(|rs| rs.machine.borrow().rebuilding())
            .count() as u64;
        self.metrics
            .replicas_rebuilding
            .store(rebuilding, Ordering::Relaxed);
        for rs in self.all() {
            if let Some(r) = rs.report() {
                if rs.consistency.get() == Consistency::Leader {
                    let slowest = r
                        .followers
                        .iter()
                        .filter(|f| !f.halted && !f.staged)
                        .map(|f| f.durable_end)
                        .min()
                        .unwrap_or(r.log_end);
                    lag += r.log_end.saturating_sub(slowest);
                }
                halted += r.followers.iter().filter(|f| f.halted && !f.staged).count() as u64;
                reports.push(((*rs.key).clone(), r));
            }
        }
        self.metrics
            .replication_lag_records
            .store(lag, Ordering::Relaxed);
        self.metrics
            .replication_halted
            .store(halted, Ordering::Relaxed);
        if let Ok(mut all) = self.cluster.reports.lock() {
            all.retain(|k, _| !self.shards.borrow().contains_key(k));
            all.extend(reports);
        }
        left
    }

    async fn open<F, Fut>(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        consistency: Consistency,
        incarnation: &str,
        open: &F,
    ) -> Result<Rc<ReplicaShard>, BrokerError>
    where
        F: Fn(Arc<ShardKey>) -> Fut,
        Fut: std::future::Future<Output = Result<Held, BrokerError>>,
    {
        let held = open(key.clone()).await?;
        let log = held.log().clone();
        let log = &log;
        let mut meta: Meta = match log.read_meta(META_FILE).await? {
            Some(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| BrokerError::Storage(format!("{key}: replica metadata: {e}")))?,
            None => Meta::default(),
        };
        if log.opened_after_unsynced_life() {
            if meta.generation > 0 && meta.no_lead_through < Some(meta.generation) {
                // Durably before the replica acts (first thing after reading the
                // ballot): the log's mark that told of the crash is gone after the next
                // clean close or `on-commit` open.
                meta.no_lead_through = Some(meta.generation);
                let bytes = serde_json::to_vec(&meta).expect("meta serializes");
                log.write_meta(META_FILE, &bytes).await?;
                tracing::warn!(shard = %key, generation = meta.generation, "a life of this copy under fsync none or periodic crashed: it leads no generation it accepted before (another member is promoted)");
            }
            log.unsynced_life_recorded();
        }
        // Where each generation begins: the generation-start records in the log.
        let (base, end) = (log.base_offset(), log.committed_end());
        let mut epochs = find_generation_starts(log).await?;
        if cfg!(debug_assertions) {
            // Debug builds (the test suites) read the whole log as well and insist the
            // two agree: a path that stored a generation start without listing it first
            // fails at the next open, wherever in the suite that is.
            let scanned = scan_generation_starts(log).await?;
            assert_eq!(
                epochs, scanned,
                "{key}: the generation-starts list misses a record"
            );
        }
        // The generation in force at the base, when the record that began it is gone.
        if let Some(bytes) = log.read_meta(EPOCHS_FILE).await? {
            let kept: Vec<(u64, u64)> = serde_json::from_slice(&bytes)
                .map_err(|e| BrokerError::Storage(format!("{key}: generation starts: {e}")))?;
            for (offset, generation) in kept {
                epochs.entry(offset).or_insert(generation);
            }
        }
        let mut machine = Replica::new(self.me.clone(), meta, base, end, epochs);
        if self.cluster.mutants.skip_fence {
            machine.break_fencing_for_mutant_runs();
        }
        let instance = self.next_instance.get();
        self.next_instance.set(instance + 1);
        let rs = Rc::new(ReplicaShard {
            key: key.clone(),
            incarnation: RefCell::new(incarnation.into()),
            instance,
            defunct: Cell::new(false),
            log: held.log().clone(),
            held,
            ready: Cell::new(false),
            machine: RefCell::new(machine),
            consistency: Cell::new(consistency),
            waker: RefCell::default(),
            kicked: Cell::new(false),
            waiters: RefCell::default(),
            term: Cell::new(0),
            generation: Cell::new(0),
            unfanned_until: Cell::new(0),
            stores_in_flight: Cell::new(0),
            store_era: Cell::new(0),
            shipping: RefCell::default(),
            stopped: Cell::new(false),
            driver_done: Cell::new(false),
            left_out_since: Cell::new(None),
        });
        self.shards.borrow_mut().insert(key, rs.clone());
        let (this, driven) = (self.clone(), rs.clone());
        task::spawn(async move { this.drive(driven).await }).detach();
        Ok(rs)
    }

    /// The driver of one replica: carries out its outputs in order, and its timers.
    async fn drive(self: Rc<Self>, rs: Rc<ReplicaShard>) {
        loop {
            loop {
                if rs.stopped.get() {
                    rs.driver_done.set(true);
                    return;
                }
                let next = rs.machine.borrow_mut().poll_output();
                let Some(out) = next else { break };
                self.carry_out(&rs, out).await;
            }
            let kicked = futures_lite::future::or(
                poll_fn(|cx| {
                    if rs.kicked.replace(false) {
                        return Poll::Ready(true);
                    }
                    *rs.waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                }),
                async {
                    task::sleep(TICK).await;
                    false
                },
            )
            .await;
            if !kicked {
                rs.machine.borrow_mut().handle_timeout(clock::now().instant);
            }
        }
    }

    async fn carry_out(&self, rs: &Rc<ReplicaShard>, out: Output) {
        let log = &rs.log;
        let now = || clock::now().instant;
        match out {
            Output::Send { to, msg } => self.send(rs, &to, msg),
            Output::Persist(meta) => {
                let bytes = serde_json::to_vec(&meta).expect("meta serializes");
                match log.write_meta(META_FILE, &bytes).await {
                    Ok(()) => rs
                        .machine
                        .borrow_mut()
                        .handle_persisted(meta.generation, now()),
                    Err(e) => {
                        tracing::error!(shard = %rs.key, error = %e, "persisting the replica ballot")
                    }
                }
            }
            Output::KeepEpochs(epochs) => {
                if let Err(e) = write_epochs(log, &epochs).await {
                    tracing::error!(shard = %rs.key, error = %e, "keeping generation starts");
                }
            }
            Output::Store(batches) => {
                if let Held::Stream(s) = &rs.held
                    && batches.iter().any(|b| b.kind == BatchKind::Group)
                {
                    s.group_batches_seen.set(true);
                }
                if batches
                    .iter()
                    .any(|b| matches!(b.kind, BatchKind::GenerationStart(_)))
                {
                    // Listed before stored (the machine already counts them). Never
                    // stored unlisted: a restart would not know where the generation
                    // began. The sender asks again.
                    let starts = rs.machine.borrow().epochs().clone();
                    if let Err(e) = list_generation_starts(log, &starts).await {
                        tracing::error!(shard = %rs.key, error = %e, "listing generation starts");
                        rs.storage_failed();
                        return;
                    }
                }
                // Claimed here, in order; awaited on a task of its own, so the driver
                // goes on and the next message's store is staged behind this one while
                // it is written: one fsync covers both.
                let mut pending = Vec::with_capacity(batches.len());
                let mut failed = None;
                for b in &batches {
                    let kind = match b.kind {
                        BatchKind::Data => LogBatchKind::Data,
                        BatchKind::GenerationStart(_) => LogBatchKind::GenerationStart,
                        BatchKind::Commit => LogBatchKind::Commit,
                        BatchKind::Group => LogBatchKind::Group,
                        BatchKind::State => LogBatchKind::State,
                    };
                    let tag = b.producer.map(|(producer_id, sequence)| {
                        felix_storage_uring::ProducerTag {
                            producer_id,
                            sequence,
                        }
                    });
                    match log.begin_append_at_tagged(
                        b.base,
                        &b.records,
                        b.timestamp_micros,
                        kind,
                        tag,
                    ) {
                        Ok(p) => pending.push(p),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                rs.stores_in_flight.set(rs.stores_in_flight.get() + 1);
                let (rs, metrics, era) = (rs.clone(), self.metrics.clone(), rs.store_era.get());
                task::spawn(async move {
                    rs.finish_store(batches, pending, failed, &metrics, era)
                        .await;
                    rs.stores_in_flight.set(rs.stores_in_flight.get() - 1);
                    rs.kick();
                })
                .detach();
            }
            Output::Truncate { from } => {
                rs.store_era.set(rs.store_era.get() + 1);
                rs.after_stores().await;
                match log.truncate_from(from).await {
                    Ok(()) => {
                        rs.held.after_cut(from).await;
                        rs.machine.borrow_mut().handle_truncated(now());
                    }
                    Err(e) => {
                        tracing::warn!(shard = %rs.key, error = %e, "cutting a replica's suffix");
                        rs.storage_failed();
                    }
                }
            }
            Output::ResetAt { base } => {
                rs.store_era.set(rs.store_era.get() + 1);
                let reset = async {
                    rs.after_stores().await;
                    start_over_at(log, base).await
                };
                match reset.await {
                    Ok(()) => {
                        rs.held.after_cut(base).await;
                        rs.machine.borrow_mut().handle_truncated(now());
                    }
                    Err(e) => {
                        tracing::warn!(shard = %rs.key, error = %e, "bootstrapping a replica");
                        rs.storage_failed();
                    }
                }
            }
            Output::Read { to, from, fetch } => {
                if !fetch {
                    let held = {
                        let mut shipping = rs.shipping.borrow_mut();
                        let (slowest, durable) = {
                            let m = rs.machine.borrow();
                            let slowest = m.followers().iter().map(|f| f.matched).min();
                            (slowest, m.log_end().1)
                        };
                        shipping.trim_below(slowest.unwrap_or(0));
                        shipping.read(from, super::machine::SHIP_BYTES, durable)
                    };
                    if let Some(batches) = held {
                        rs.machine
                            .borrow_mut()
                            .handle_read(to, from, batches, fetch, now());
                        return;
                    }
                }
                let batches = log
                    .read(from, super::machine::SHIP_BYTES)
                    .await
                    .unwrap_or_default()
                    .into_iter()
                    .map(|b| {
                        let kind = match b.kind {
                            LogBatchKind::GenerationStart => BatchKind::GenerationStart(
                                generation_named(&b.records).unwrap_or(0),
                            ),
                            LogBatchKind::Commit => BatchKind::Commit,
                            LogBatchKind::Group => BatchKind::Group,
                            LogBatchKind::State => BatchKind::State,
                            LogBatchKind::Data => BatchKind::Data,
                        };
                        Batch {
                            base: b.base_offset,
                            kind,
                            timestamp_micros: b.timestamp_micros,
                            producer: b.producer.map(|t| (t.producer_id, t.sequence)),
                            records: b.records,
                        }
                    })
                    .collect();
                let batches = within_one_message(batches);
                rs.machine
                    .borrow_mut()
                    .handle_read(to, from, batches, fetch, now());
            }
            Output::AppendGenerationStart { generation } => {
                let first = log.next_offset();
                let record = generation.to_be_bytes();
                let mut starts = rs.machine.borrow().epochs().clone();
                starts.insert(first, generation);
                if let Err(e) = list_generation_starts(log, &starts).await {
                    tracing::error!(shard = %rs.key, error = %e, "listing generation starts");
                    rs.machine.borrow_mut().handle_generation_start_failed();
                    return;
                }
                match log.begin_append_at(
                    first,
                    &[record],
                    clock::wall_micros(),
                    LogBatchKind::GenerationStart,
                ) {
                    Ok(p) => {
                        rs.machine.borrow_mut().handle_generation_start(first);
                        match log.commit(p).await {
                            Ok(a) => rs.machine.borrow_mut().handle_durable(a.end, now()),
                            Err(e) => {
                                // A full disk gives the offset back: the machine forgets
                                // the start it was told of and asks for it again.
                                tracing::error!(shard = %rs.key, error = %e, "writing a generation start");
                                rs.storage_failed();
                                rs.machine.borrow_mut().handle_generation_start_failed();
                            }
                        }
                    }
                    Err(e) => {
                        tracing::error!(shard = %rs.key, error = %e, "claiming a generation start");
                        rs.machine.borrow_mut().handle_generation_start_failed();
                    }
                }
            }
            Output::Commit(c) => rs.on_commit(c),
            Output::Serving(serving) => {
                tracing::info!(shard = %rs.key, serving, generation = rs.machine.borrow().generation(), "replica leadership");
                rs.on_serving(serving).await;
            }
            Output::AssignmentWanted => self.cluster.ask_sync(),
            Output::Halted { peer } => {
                tracing::error!(shard = %rs.key, peer = %peer, "a follower would have to cut committed records: halted");
            }
        }
    }
}

/// The generation-start records of `log`, `offset -> generation`: the entries of its
/// [`STARTS_FILE`] whose record is there (one small read each), or, for a log written
/// before that file existed, a scan of the whole log (and the file is written then).
pub async fn find_generation_starts<B: felix_storage_uring::io::Backend>(
    log: &SegmentLog<B>,
) -> Result<BTreeMap<u64, u64>, BrokerError> {
    let (base, end) = (log.base_offset(), log.committed_end());
    let Some(bytes) = log.read_meta(STARTS_FILE).await? else {
        let starts = scan_generation_starts(log).await?;
        list_generation_starts(log, &starts).await?;
        return Ok(starts);
    };
    let listed: Vec<(u64, u64)> = serde_json::from_slice(&bytes)
        .map_err(|e| BrokerError::Storage(format!("generation starts: {e}")))?;
    let mut starts = BTreeMap::new();
    for (offset, generation) in listed {
        if offset < base || offset >= end {
            continue;
        }
        let read = log.read_to(offset, offset + 1, 64).await?;
        let holds = read.first().is_some_and(|b| {
            b.base_offset == offset
                && b.kind == LogBatchKind::GenerationStart
                && generation_named(&b.records) == Some(generation)
        });
        if holds {
            starts.insert(offset, generation);
        }
    }
    Ok(starts)
}

/// Every generation-start record of `log`, by reading all of it.
async fn scan_generation_starts<B: felix_storage_uring::io::Backend>(
    log: &SegmentLog<B>,
) -> Result<BTreeMap<u64, u64>, BrokerError> {
    let (mut at, end) = (log.base_offset(), log.committed_end());
    let mut starts = BTreeMap::new();
    while at < end {
        let batches = log.read(at, 4 << 20).await?;
        let Some(last) = batches.last() else { break };
        at = last.end_offset();
        for b in batches {
            if b.kind == LogBatchKind::GenerationStart
                && let Some(g) = generation_named(&b.records)
            {
                starts.insert(b.base_offset, g);
            }
        }
    }
    Ok(starts)
}

/// Writes where `log`'s generation-start records are (see [`STARTS_FILE`]), durably:
/// done before a new one is appended or stored, so the list never misses one.
pub async fn list_generation_starts<B: felix_storage_uring::io::Backend>(
    log: &SegmentLog<B>,
    starts: &BTreeMap<u64, u64>,
) -> Result<(), BrokerError> {
    let pairs: Vec<(u64, u64)> = starts.iter().map(|(o, g)| (*o, *g)).collect();
    let bytes = serde_json::to_vec(&pairs).expect("pairs serialize");
    log.write_meta(STARTS_FILE, &bytes).await?;
    Ok(())
}

/// Empties `log` and starts it over at `base` (a bootstrap), with no generation starts
/// kept: those below the old base describe another life of the log, and kept, they
/// came back at the next open and hid the generation the leader names for the new
/// base (a follower then refused every message, or reported too low a generation in
/// an election). Cleared once the log is empty and before its base moves: a crash
/// between leaves an empty log claiming no generation, which wins no election.
async fn start_over_at<B: felix_storage_uring::io::Backend>(
    log: &SegmentLog<B>,
    base: u64,
) -> Result<(), BrokerError> {
    log.truncate_from(log.base_offset()).await?;
    write_epochs(log, &[]).await?;
    log.reset_empty_at(base).await?;
    Ok(())
}

async fn write_epochs<B: felix_storage_uring::io::Backend>(
    log: &SegmentLog<B>,
    epochs: &[(u64, u64)],
) -> Result<(), BrokerError> {
    let bytes = serde_json::to_vec(epochs).expect("pairs serialize");
    log.write_meta(EPOCHS_FILE, &bytes).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use felix_storage_uring::{BatchKind as LogBatchKind, LogConfig, MemBackend, SegmentLog};

    use super::{
        EPOCHS_FILE, find_generation_starts, left_out_of, list_generation_starts, start_over_at,
        write_epochs,
    };

    async fn append(log: &SegmentLog<MemBackend>, kind: LogBatchKind, record: &[u8]) {
        let p = log
            .begin_append_at(log.next_offset(), &[record], 0, kind)
            .unwrap();
        log.commit(p).await.unwrap();
    }

    /// A log of ~2 MB with generation starts at 0 and 1,001.
    async fn log_with_two_generations(mem: &MemBackend) -> SegmentLog<MemBackend> {
        let (log, _) = SegmentLog::open(mem.clone(), LogConfig::default())
            .await
            .unwrap();
        let data = vec![7u8; 1000];
        append(&log, LogBatchKind::GenerationStart, &1u64.to_be_bytes()).await;
        for _ in 0..1000 {
            append(&log, LogBatchKind::Data, &data).await;
        }
        append(&log, LogBatchKind::GenerationStart, &3u64.to_be_bytes()).await;
        for _ in 0..1000 {
            append(&log, LogBatchKind::Data, &data).await;
        }
        log
    }

    #[test]
    fn a_replica_finds_its_generation_starts_from_their_list_not_by_reading_its_log() {
        felix_core_runtime::task::block_on(async {
            let mem = MemBackend::new();
            let log = log_with_two_generations(&mem).await;
            let want = BTreeMap::from([(0, 1), (1001, 3)]);
            // Listed, with an entry whose record never made it (offset 1,500 holds data)
            // and one past the end (cut): both dropped at the check.
            let mut listed = want.clone();
            listed.insert(1500, 4);
            listed.insert(5000, 5);
            list_generation_starts(&log, &listed).await.unwrap();
            let before = mem.bytes_read();
            assert_eq!(find_generation_starts(&log).await.unwrap(), want);
            let read = mem.bytes_read() - before;
            assert!(read < 64 << 10, "checking 4 entries read {read} bytes");
        });
    }

    /// A bootstrap starts the log over with no generation starts kept from its old life
    /// (kept, they came back at the next open below the new base).
    #[test]
    fn a_log_started_over_keeps_no_generation_starts_of_its_old_life() {
        felix_core_runtime::task::block_on(async {
            let mem = MemBackend::new();
            let log = log_with_two_generations(&mem).await;
            write_epochs(&log, &[(50, 3)]).await.unwrap();
            start_over_at(&log, 5_000).await.unwrap();
            assert_eq!(log.base_offset(), 5_000);
            let kept: Vec<(u64, u64)> =
                serde_json::from_slice(&log.read_meta(EPOCHS_FILE).await.unwrap().unwrap())
                    .unwrap();
            assert_eq!(kept, vec![]);
            assert_eq!(find_generation_starts(&log).await.unwrap(), BTreeMap::new());
        });
    }

    #[test]
    fn a_log_without_the_list_is_scanned_once_and_listed() {
        felix_core_runtime::task::block_on(async {
            let mem = MemBackend::new();
            let log = log_with_two_generations(&mem).await;
            let want = BTreeMap::from([(0, 1), (1001, 3)]);
            let before = mem.bytes_read();
            assert_eq!(find_generation_starts(&log).await.unwrap(), want);
            assert!(
                mem.bytes_read() - before > 1 << 20,
                "the whole log was read"
            );
            let before = mem.bytes_read();
            assert_eq!(find_generation_starts(&log).await.unwrap(), want);
            assert!(
                mem.bytes_read() - before < 64 << 10,
                "then the list is used"
            );
        });
    }

    #[test]
    fn a_copy_goes_only_when_a_newer_set_of_several_copies_leaves_it_out_and_no_abandon_followed_it()
     {
        let route = |generation: u64, replicas: &[&str], learners: &[&str], abandoned| {
            crate::cluster::Route {
                leader: replicas[0].into(),
                addr: None,
                generation,
                replicas: replicas.iter().map(|r| Arc::from(*r)).collect(),
                learners: learners.iter().map(|r| Arc::from(*r)).collect(),
                handoff_from: None,
                abandoned,
            }
        };
        // Retired after a move: a newer generation without it.
        assert!(left_out_of("c", &route(5, &["a", "b"], &[], None), 4));
        // Named: a member, or a copy being staged again.
        assert!(!left_out_of("c", &route(5, &["a", "c"], &[], None), 4));
        assert!(!left_out_of("c", &route(5, &["a", "b"], &["c"], None), 4));
        // A view no newer than what the copy accepted (a re-add it took already).
        assert!(!left_out_of("c", &route(5, &["a", "b"], &[], None), 5));
        assert!(!left_out_of("c", &route(5, &["a", "b"], &[], None), 6));
        // One copy: what an abandon or a move of an unreplicated shard left stays.
        assert!(!left_out_of("c", &route(9, &["a"], &[], None), 4));
        // An abandon after the copy's generation: kept for manual recovery.
        assert!(!left_out_of("c", &route(5, &["a", "b"], &[], Some(5)), 4));
        assert!(!left_out_of("c", &route(8, &["a", "b"], &[], Some(5)), 4));
        // A copy that accepted the abandon's generation or later is a normal member.
        assert!(left_out_of("c", &route(8, &["a", "b"], &[], Some(5)), 6));
    }

    #[test]
    fn the_ship_buffer_never_ships_past_the_leaders_durable_end() {
        use super::super::machine::{Batch, BatchKind};
        let batch = |base: u64, n: u64| Batch {
            base,
            kind: BatchKind::Data,
            timestamp_micros: 0,
            producer: None,
            records: (0..n).map(|_| bytes::Bytes::from_static(b"r")).collect(),
        };
        let mut buffer = super::ShipBuffer::default();
        buffer.push(batch(0, 1));
        buffer.push(batch(1, 2));
        buffer.push(batch(3, 1));
        let ends = |b: Option<Vec<Batch>>| b.map(|b| b.iter().map(Batch::end).collect::<Vec<_>>());
        // Claimed up to 4, durable up to 3: the batch past 3 stays here.
        assert_eq!(ends(buffer.read(0, 1 << 20, 3)), Some(vec![1, 3]));
        assert_eq!(
            ends(buffer.read(3, 1 << 20, 3)),
            None,
            "nothing durable to ship"
        );
        assert_eq!(ends(buffer.read(3, 1 << 20, 4)), Some(vec![4]));
        // A claim that does not continue the buffer starts it over.
        buffer.push(batch(9, 1));
        assert_eq!(ends(buffer.read(0, 1 << 20, 10)), None);
        assert_eq!(ends(buffer.read(9, 1 << 20, 10)), Some(vec![10]));
    }

    /// A read to ship holds at most the records one message carries: bounded by bytes
    /// alone, a backlog of small records made messages the encoder refused, dropped
    /// every time, and the follower never caught up.
    #[test]
    fn a_ship_read_fits_one_message_in_records() {
        use super::super::machine::{Batch, BatchKind};
        use felix_wire::internal::MAX_RECORDS_PER_MESSAGE;
        let batch = |base: u64, n: usize| Batch {
            base,
            kind: BatchKind::Data,
            timestamp_micros: 0,
            producer: None,
            records: vec![bytes::Bytes::new(); n],
        };
        let half = MAX_RECORDS_PER_MESSAGE / 2;
        let mut buffer = super::ShipBuffer::default();
        for i in 0..3 {
            buffer.push(batch((i * half) as u64, half));
        }
        let end = 3 * half as u64;
        let read = buffer.read(0, 1 << 20, end).unwrap();
        assert_eq!(read.len(), 2, "two halves fit, the third waits");
        let read =
            super::within_one_message((0..3).map(|i| batch((i * half) as u64, half)).collect());
        assert_eq!(read.len(), 2);
        let one = super::within_one_message(vec![batch(0, MAX_RECORDS_PER_MESSAGE + 1)]);
        assert_eq!(one.len(), 1, "a first batch goes whatever its count");
    }
}
