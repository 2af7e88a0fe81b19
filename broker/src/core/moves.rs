//! Moving shards between cores on a running broker (a live re-pin).
//!
//! A new pin rule is applied by one core, the coordinator, in steps over the mesh. Every
//! core learns the old and the new placement table (**Begin**), and from them which
//! shards move away from it and which move to it: decided per key by the two tables,
//! so a stream created or deleted while the re-pin runs is covered too. For every shard
//! moving from core A to core B:
//!
//! 1. **Begin**: B will hold the shard's requests, in arrival order, once the table names
//!    it; A keeps serving the shard although the table will name B.
//! 2. The new table is swapped in: from now on every core sends the shard's requests
//!    to B, where they wait.
//! 3. **Flush** (at every core): the core sends a barrier to every other core behind
//!    everything it sent before (a mesh channel is FIFO) and waits for the answers. Once
//!    every core answered, A has been handed every request sent under the old table.
//! 4. **Release** (at every core, as A): wait for those requests, the ones waiting for a
//!    shard's log to open, and the shards' in-flight appends (commit and fanout) to finish, answer long polls and watches now, stop
//!    serving the moving shards, close (and seal) their logs, hand over the cores with
//!    subscribers and the consumer groups' state (claims included).
//! 5. **Take** (at each B): open the logs, register those subscriber cores. A log that
//!    will not open for want of resources (descriptors, memory) keeps what it was handed
//!    (subscriber cores, groups) for its next open at B, or for the next re-pin to hand
//!    on.
//! 6. **End** (at every core): serve the held requests in the order they came; the
//!    re-pin is over. A re-pin that fails before the swap ends the same way.
//!
//! What this keeps true: one core writes a log at a time (A closes before B opens, and
//! nothing reopens it at A: a shard no longer served here is refused, and one opened
//! while the table changed is closed again); a producer's requests reach the log in the
//! order it sent them (all older ones at A before any newer one at B); an append
//! acknowledged by A was committed before B opened the log; subscribers keep their
//! queues (A fans out its last batches, B the next ones; a subscriber that sees a later
//! batch first reads the gap from the log and drops the stale copy). A request sent to A
//! after it let go is passed on to B, not refused. The steps are control messages outside
//! the cross-core request bound, so a shard under heavy load can still move.
//!
//! A stream shard's consumer groups move with it: the old core hands over their state
//! as it left them (cursors, dead letters, and the claims in flight with their attempt
//! counts and deadlines, on one process-wide monotonic clock), and the new core serves
//! from that instead of folding the log, so a record claimed before the move is not
//! handed to another consumer after it.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use felix_core_runtime::CoreId;
use felix_core_runtime::placement::{PinRule, PlacementTable, ShardKey, ShardKind};
use felix_core_runtime::task;
use felix_storage_uring::{DmaBackend, SegmentLog};
use futures_channel::oneshot;
use futures_lite::StreamExt;

use super::{CROSS_CORE_REQUESTS_MAX, CoreBroker, CoreMsg, ReplyBody, ReplyTo, Slot};
use crate::error::BrokerError;

/// How often a release still waiting for work on the shards says so.
const RELEASE_WARN_AFTER: Duration = Duration::from_secs(10);

/// A moving shard's newest segment is sealed (a new one started) when it holds at least
/// this much: scanning less at the new core costs less than creating a segment.
pub(super) const SEAL_MIN_BYTES: u64 = 16 << 20;

/// A request held until its shard arrives: run once, in arrival order.
pub type Held = Box<dyn FnOnce()>;

/// A boxed answer.
pub type Answer<T> = Pin<Box<dyn std::future::Future<Output = Result<T, BrokerError>>>>;

/// Runs a held call's answer to the end in a task of its own and sends it to `tx` (the
/// waiting request), so the next held call starts without waiting for this one.
pub(super) fn answer_when_done<T: 'static>(
    mut answer: Answer<T>,
    mut tx: oneshot::Sender<Result<T, BrokerError>>,
    cancellable: bool,
) {
    // Polled once here, before the caller's next held call: a call claims its place
    // (its offsets) on its first poll, so held calls claim in the order they came and
    // ahead of every request whose task was spawned meanwhile. Only spawned, each ran
    // behind those tasks, and a pipelined writer's later put landed before its earlier
    // one. (The task's first poll registers its own waker.)
    if cancellable && tx.is_canceled() {
        // Its asker left while it was held: not begun, it claims nothing.
        return;
    }
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if let std::task::Poll::Ready(answered) = answer.as_mut().poll(&mut cx) {
        let _ = tx.send(answered);
        return;
    }
    task::spawn(async move {
        if !cancellable {
            let _ = tx.send(answer.await);
            return;
        }
        // Dropped with its asker (a waiting poll whose client left), it hands back what
        // it claimed instead of waiting on for nobody. The asker's leaving is looked at
        // first: an answer and a cancellation that come at once drop the poll too.
        let answered = {
            let gone = tx.cancellation();
            futures_lite::future::or(
                async {
                    gone.await;
                    None
                },
                async { Some(answer.await) },
            )
            .await
        };
        if let Some(a) = answered {
            let _ = tx.send(a);
        }
    })
    .detach();
}

/// One step of a live re-pin, sent by the coordinating core.
#[derive(Debug)]
pub enum MoveStep {
    /// The tables before and after: each core works out what moves to and from it.
    Begin {
        /// Before.
        old: Arc<PlacementTable>,
        /// After.
        new: Arc<PlacementTable>,
    },
    /// Send a barrier to every other core and wait for the answers.
    Flush,
    /// Answered at once: everything sent before it has been handled.
    Barrier,
    /// Finish the shards moving away, close them, hand them over.
    Release,
    /// Open these shards (moving here) and register their subscribers.
    Take(Vec<Handover>),
    /// Serve what was held; the re-pin is over here.
    End,
}

/// A shard handed from one core to another.
#[derive(Debug, Clone)]
pub struct Handover {
    /// The shard.
    pub key: Arc<ShardKey>,
    /// Cores with subscribers to it, and how many.
    pub interested: Vec<(CoreId, usize)>,
    /// Whether the old core closed and sealed its log cleanly (the new core then checks
    /// the sealed segments' tails, not every batch).
    pub sealed: bool,
    /// The shard's consumer groups as the old core left them, claims in flight included
    /// (`None`: not built there; the new core folds them from the log on first use).
    pub groups: Option<crate::groups::GroupState>,
    /// What the old core knew of the groups while they were not built: whether its log
    /// may hold a `Group` batch, and the log's size at their last snapshot (`None`: the
    /// shard was not open there).
    pub group_batches: Option<(bool, u64)>,
    /// The shard could not be served on the old core and must not be here: its log was
    /// found damaged at open (`Slot::Failed`), or it was poisoned under a mode that
    /// acknowledges before writing (what it acknowledged unwritten is gone, and a reopen
    /// would give those offsets to other records).
    pub failed: Option<BrokerError>,
}

impl Handover {
    /// Drops one subscriber on `core` (it left while the handover waited for an open).
    pub fn unregister(&mut self, core: CoreId) {
        if let Some(i) = self.interested.iter().position(|(c, _)| *c == core) {
            self.interested[i].1 -= 1;
            if self.interested[i].1 == 0 {
                self.interested.swap_remove(i);
            }
        }
    }
}

/// The answer to a [`MoveStep`].
#[derive(Debug)]
pub enum MoveAnswer {
    /// Done.
    Done,
    /// What [`MoveStep::Release`] handed over.
    Released(Vec<Handover>),
}

/// An operator's request to pin shards to a core, sent from the HTTP thread to the
/// coordinating core.
#[derive(Debug)]
pub struct RepinJob {
    /// The rule (it wins over every rule before it).
    pub rule: PinRule,
    /// Made by load following (`core/follow.rs`), not by an operator: applied only
    /// while no operator rule matches its shard, and never saved.
    pub auto: bool,
    /// Where the outcome goes.
    pub answer: oneshot::Sender<Result<RepinReport, BrokerError>>,
}

/// What a re-pin did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RepinReport {
    /// The placement table's new version.
    pub version: u64,
    /// The rule applied, as written back.
    pub rule: String,
    /// Shards moved: `(shard, from core, to core)`.
    pub moved: Vec<(String, usize, usize)>,
    /// From the table swap to the last shard taken (requests waited at most this long).
    pub hold_ms: f64,
    /// Of which: every core's barrier answered.
    pub flush_ms: f64,
    /// Of which: the old cores finished in-flight work and closed the logs.
    pub release_ms: f64,
    /// Of which: the new cores opened (recovered) the logs and served what was held.
    pub take_ms: f64,
    /// Whether the pin was saved for the next start (`pins.json`).
    pub persisted: bool,
}

/// Pin rules a broker holds at most, operators' and automatic ones together.
pub const PIN_RULES_MAX: usize = 1024;

/// A re-pin in progress, as one core sees it.
pub(super) struct MoveState {
    old: Arc<PlacementTable>,
    new: Arc<PlacementTable>,
    /// Requests held for shards moving here, per shard in arrival order.
    held: HashMap<Arc<ShardKey>, Vec<Held>>,
    /// How many `held` holds, all keys together.
    held_count: usize,
    /// Of which: requests from each other core.
    held_from: HashMap<CoreId, usize>,
    /// Requests accepted for shards moving away and not finished.
    pending: Rc<Cell<usize>>,
    /// The shards moving away are closed: no longer served here.
    released: bool,
}

impl MoveState {
    fn arriving(&self, key: &ShardKey, me: CoreId) -> bool {
        self.new.core_for(key) == me && self.old.core_for(key) != me
    }

    fn leaving(&self, key: &ShardKey, me: CoreId) -> bool {
        !self.released && self.old.core_for(key) == me && self.new.core_for(key) != me
    }
}

/// Counts one request a leaving core accepted and has not finished.
pub(super) struct Pending(Rc<Cell<usize>>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

impl CoreMsg {
    /// The shard a request names; `None` for deliveries, answers and control.
    pub(super) fn request_key(&self) -> Option<&Arc<ShardKey>> {
        match self {
            CoreMsg::Append { key, .. }
            | CoreMsg::Subscribe { key, .. }
            | CoreMsg::Unsubscribe { key, .. }
            | CoreMsg::Read { key, .. }
            | CoreMsg::Group { key, .. }
            | CoreMsg::GroupCancel { key, .. }
            | CoreMsg::State { key, .. }
            | CoreMsg::Watch { key, .. }
            | CoreMsg::Cache { key, .. } => Some(key),
            CoreMsg::Deliver { .. }
            | CoreMsg::SubscribersEnd { .. }
            | CoreMsg::Peer { .. }
            | CoreMsg::Reply { .. }
            | CoreMsg::Move { .. } => None,
        }
    }
}

/// Counts one request accepted for a shard it does not hold yet (see
/// `CoreBroker::awaiting_shard`).
pub(super) struct Awaiting {
    counts: Rc<std::cell::RefCell<HashMap<Arc<ShardKey>, usize>>>,
    key: Arc<ShardKey>,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        let mut counts = self.counts.borrow_mut();
        if let Some(n) = counts.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// What [`CoreBroker::admit`] decided for a request from another core.
pub(super) enum Admit {
    /// Serve it here (with a guard while the shard is leaving this core).
    Serve(Option<Pending>),
    /// Held or passed on: nothing more to do.
    Done,
}

/// Requests one core holds at most for shards moving to it; past it a request that
/// has an answer is refused `overloaded` (retryable, nothing done) instead of held, and
/// a publish sent without an ack is dropped (counted, as refused). A
/// re-pin whose release waits on work that does not end (it warns every 10 s) held
/// every request for the moving shards, payloads included, for as long, and clients
/// retrying after their timeouts added more. (An unsubscribe, which has no answer, is
/// always held: dropped, its core's count at the owner would stay.)
pub const HELD_MAX: usize = 16_384;

fn held_full() -> BrokerError {
    BrokerError::Overloaded(format!(
        "moving: {HELD_MAX} requests held for shards moving between cores"
    ))
}

/// Requests from one other core held at most (within [`HELD_MAX`]): half of that core's
/// cross-core requests to this one ([`CROSS_CORE_REQUESTS_MAX`]). A held request keeps
/// its sender's slot until it is answered, so a re-pin whose release waits took every
/// slot of a core sending to the moving shard, and that core's requests for every other
/// shard here were refused `overloaded` with it. Past it, the sender's requests for the
/// moving shard are refused (retryable, nothing done) as past [`HELD_MAX`].
pub const HELD_PER_SENDER_MAX: usize = CROSS_CORE_REQUESTS_MAX / 2;

fn held_from_full(from: CoreId) -> BrokerError {
    BrokerError::Overloaded(format!(
        "moving: {HELD_PER_SENDER_MAX} requests from core {} held for shards moving between cores",
        from.0
    ))
}

/// Where a cross-core request is answered, and how it is refused.
type Refusal = (ReplyTo, fn(BrokerError) -> ReplyBody);

/// How to answer a cross-core request, if it has an answer.
fn msg_reply(msg: &CoreMsg) -> Option<Refusal> {
    Some(match msg {
        CoreMsg::Append { reply, .. } => (*reply, |e| ReplyBody::Append(Err(e))),
        CoreMsg::Subscribe { reply, .. } => (*reply, |e| ReplyBody::Subscribe(Err(e))),
        CoreMsg::Read { reply, .. } => (*reply, |e| ReplyBody::Read(Err(e))),
        CoreMsg::Group { reply, .. } => (*reply, |e| ReplyBody::Group(Err(e))),
        CoreMsg::State { reply, .. } => (*reply, |e| ReplyBody::State(Err(e))),
        CoreMsg::Watch { reply, .. } => (*reply, |e| ReplyBody::Watch(Err(e))),
        CoreMsg::Cache { reply, .. } => (*reply, |e| ReplyBody::Cache(Err(e))),
        // No answer to give: a re-pin's own steps (they name no shard, never held), and
        // messages nobody waits on (held, when they name a shard, but never refused).
        CoreMsg::Move { .. }
        | CoreMsg::Unsubscribe { .. }
        | CoreMsg::GroupCancel { .. }
        | CoreMsg::Deliver { .. }
        | CoreMsg::SubscribersEnd { .. }
        | CoreMsg::Peer { .. }
        | CoreMsg::Reply { .. } => return None,
    })
}

impl CoreBroker {
    /// Answers a held request `overloaded` instead of holding it; `false` when it has
    /// no answer (it is held then).
    fn refuse(self: &Rc<Self>, reply: Option<Refusal>, why: BrokerError) -> bool {
        let Some((to, body)) = reply else {
            return false;
        };
        self.metrics
            .requests_held_refused
            .fetch_add(1, Ordering::Relaxed);
        self.respond(to, body(why));
        true
    }

    /// The failure a shard's slot remembers (its log found damaged at open).
    fn failed_slot(&self, key: &ShardKey) -> Option<BrokerError> {
        if let Some(Slot::Failed(e)) = self.streams.borrow().get(key) {
            return Some(e.clone());
        }
        match self.caches.borrow().get(key) {
            Some(Slot::Failed(e)) => Some(e.clone()),
            _ => None,
        }
    }

    /// The shard's open log, if it is open here.
    fn log_held(&self, key: &ShardKey) -> Option<SegmentLog<DmaBackend>> {
        if let Some(Slot::Ready(s)) = self.streams.borrow().get(key) {
            return Some(s.log.clone());
        }
        match self.caches.borrow().get(key) {
            Some(Slot::Ready(c)) => Some(c.log().clone()),
            _ => None,
        }
    }

    /// Why the shard's log failed where acknowledgements come before writes (records
    /// acknowledged then may never have been written: a reopen would give their
    /// offsets to other records), if it did.
    fn failed_with_acks_unwritten(&self, log: &SegmentLog<DmaBackend>) -> Option<BrokerError> {
        let poisoned = log.poisoned()?;
        self.shared.log_config.fsync.acks_before_write().then(|| {
            BrokerError::Storage(format!(
                "the shard's log failed on the core it left ({poisoned}); closed until a \
                 restart"
            ))
        })
    }

    /// Counts a request accepted for `key` until the guard drops: one waiting for the
    /// shard's log to open holds no reference to the shard, yet a release must not close
    /// the shard (and refuse it) before it ran.
    pub(super) fn awaiting(&self, key: &Arc<ShardKey>) -> Awaiting {
        *self
            .awaiting_shard
            .borrow_mut()
            .entry(key.clone())
            .or_default() += 1;
        Awaiting {
            counts: self.awaiting_shard.clone(),
            key: key.clone(),
        }
    }

    /// Whether requests for `key` are held here (it is moving here and not yet served).
    pub(super) fn held(&self, key: &ShardKey) -> bool {
        self.moving
            .borrow()
            .as_ref()
            .is_some_and(|m| m.arriving(key, self.core))
    }

    /// Whether this core still serves `key` although the table names another.
    pub(super) fn leaving(&self, key: &ShardKey) -> bool {
        self.moving
            .borrow()
            .as_ref()
            .is_some_and(|m| m.leaving(key, self.core))
    }

    /// Runs `call` once `key` has arrived here, in the order held calls came; answers
    /// what it answers. Refused `overloaded` (nothing done) when this core holds
    /// [`HELD_MAX`] requests already.
    pub(super) fn after_arrival<T: 'static>(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        call: impl FnOnce(Rc<CoreBroker>) -> Answer<T> + 'static,
    ) -> Answer<T> {
        self.after_arrival_or_not(key, call, false)
    }

    /// [`CoreBroker::after_arrival`] for a call dropped when its asker drops the answer
    /// (a waiting group poll), where the others run to completion.
    pub(super) fn after_arrival_or_not<T: 'static>(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        call: impl FnOnce(Rc<CoreBroker>) -> Answer<T> + 'static,
        cancellable: bool,
    ) -> Answer<T> {
        if self.holding() >= HELD_MAX {
            self.metrics
                .requests_held_refused
                .fetch_add(1, Ordering::Relaxed);
            return Box::pin(async { Err(held_full()) });
        }
        let (tx, rx) = oneshot::channel();
        let this = self.clone();
        self.hold(
            key,
            Box::new(move || answer_when_done(call(this), tx, cancellable)),
        );
        Box::pin(async move {
            rx.await
                .unwrap_or_else(|_| Err(BrokerError::ShardUnavailable("moving".into())))
        })
    }

    /// Requests held here for shards moving to this core.
    fn holding(&self) -> usize {
        self.moving.borrow().as_ref().map_or(0, |m| m.held_count)
    }

    /// Of which: requests from core `from`.
    fn holding_from(&self, from: CoreId) -> usize {
        self.moving
            .borrow()
            .as_ref()
            .and_then(|m| m.held_from.get(&from).copied())
            .unwrap_or(0)
    }

    /// Holds `f` until `key` arrives (whatever [`HELD_MAX`] says: callers that may be
    /// refused check [`Self::holding`] first).
    pub(super) fn hold(&self, key: &Arc<ShardKey>, f: Held) {
        self.metrics.requests_held.fetch_add(1, Ordering::Relaxed);
        match self.moving.borrow_mut().as_mut() {
            Some(m) => {
                m.held.entry(key.clone()).or_default().push(f);
                m.held_count += 1;
            }
            // Only called while `held` says so, on this core's thread: unreachable.
            None => tracing::error!(shard = %key, "a request held with no re-pin running"),
        }
    }

    /// Decides where a request from another core goes: served here, held (its shard is
    /// arriving), or passed on to the core that owns the shard now (it was sent under
    /// an older table).
    pub(super) fn admit(self: &Rc<Self>, from: CoreId, msg: CoreMsg) -> (Admit, Option<CoreMsg>) {
        let Some(key) = msg.request_key() else {
            return (Admit::Serve(None), Some(msg));
        };
        if self.held(key) {
            let why = if self.holding() >= HELD_MAX {
                Some(held_full())
            } else if self.holding_from(from) >= HELD_PER_SENDER_MAX {
                Some(held_from_full(from))
            } else {
                None
            };
            if let Some(why) = why
                && self.refuse(msg_reply(&msg), why)
            {
                return (Admit::Done, None);
            }
            let (this, key) = (self.clone(), key.clone());
            self.hold(&key, Box::new(move || this.handle(from, msg)));
            if let Some(m) = self.moving.borrow_mut().as_mut() {
                *m.held_from.entry(from).or_default() += 1;
            }
            return (Admit::Done, None);
        }
        let pending = self
            .moving
            .borrow()
            .as_ref()
            .filter(|m| m.leaving(key, self.core))
            .map(|m| m.pending.clone());
        if let Some(n) = pending {
            n.set(n.get() + 1);
            return (Admit::Serve(Some(Pending(n))), Some(msg));
        }
        let owner = self.owner(key);
        if owner != self.core {
            self.metrics
                .requests_passed_on
                .fetch_add(1, Ordering::Relaxed);
            self.send_ordered(owner, msg, false);
            return (Admit::Done, None);
        }
        (Admit::Serve(None), Some(msg))
    }

    /// Starts the task that applies operators' re-pins, one at a time (on the core that
    /// takes the job queue: one per broker).
    pub fn start_repins(self: &Rc<Self>) {
        let Some(mut jobs) = self
            .shared
            .repin_jobs
            .lock()
            .expect("re-pin queue lock")
            .take()
        else {
            return;
        };
        self.start_follow_load();
        let this = Rc::downgrade(self);
        task::spawn(async move {
            while let Some(job) = jobs.next().await {
                let Some(core) = this.upgrade() else { return };
                if core.draining() {
                    let _ = job.answer.send(Err(BrokerError::Draining));
                    continue;
                }
                let (rule, auto) = (job.rule.to_string(), job.auto);
                let r = core.repin(job.rule, auto).await;
                // An operator's request answered 202 "still moving" already: a refusal
                // said nowhere was lost (until 2026-12-08). (Load following does not
                // wait for its answers.)
                if let Err(Err(e)) = job.answer.send(r)
                    && !auto
                {
                    tracing::warn!(%rule, error = %e, "a pin rule refused after its request stopped waiting");
                }
            }
        })
        .detach();
    }

    /// Applies `rule` to the running broker, moving every shard it re-homes. An
    /// automatic rule (`auto`) is dropped when an operator's rule matches its shard by
    /// now, and is not saved.
    async fn repin(self: &Rc<Self>, rule: PinRule, auto: bool) -> Result<RepinReport, BrokerError> {
        let old = self.shared.placement.load();
        if auto {
            let autos = self
                .shared
                .auto_pins
                .lock()
                .expect("auto pins lock")
                .clone();
            if super::follow::operator_pinned(&old, &autos, &rule) {
                return Err(BrokerError::InvalidRequest(format!(
                    "{rule}: an operator pinned these shards"
                )));
            }
        }
        let new = old
            .with_rule(rule.clone())
            .map_err(|e| BrokerError::InvalidRequest(e.to_string()))?;
        if new.rules().len() > PIN_RULES_MAX && new.rules().len() > old.rules().len() {
            // Every owner lookup checks every rule, once a request: rules kept coming
            // (one per new pattern, for good) and each made every request dearer.
            return Err(BrokerError::InvalidRequest(format!(
                "{rule}: a broker holds at most {PIN_RULES_MAX} pin rules (a rule for the \
                 same shards replaces the old one)"
            )));
        }
        let moves = self.shards_moving(&old, &new, false)?;
        let cores: Vec<CoreId> = (0..self.shared.metrics.len()).map(CoreId).collect();
        let new = Arc::new(new);
        for &c in &cores {
            let begin = MoveStep::Begin {
                old: old.clone(),
                new: new.clone(),
            };
            if let Err(e) = self.step(c, begin).await {
                // Nothing moved yet: every core forgets the re-pin.
                for &c in &cores {
                    let _ = self.step(c, MoveStep::End).await;
                }
                return Err(e);
            }
        }
        let swapped = Instant::now();
        let version = new.version();
        self.shared.placement.replace_arc(new.clone());
        {
            // With the table: which of its rules load following made.
            let mut autos = self.shared.auto_pins.lock().expect("auto pins lock");
            autos.retain(|a| !a.same_pattern(&rule));
            if auto {
                autos.insert(0, rule.clone());
            }
        }
        // From here on the steps are control messages (never refused for load): only a
        // core that stopped can fail one, and then the broker is stopping.
        for &c in &cores {
            self.step(c, MoveStep::Flush).await?;
        }
        let flushed = Instant::now();
        let mut handed: BTreeMap<CoreId, Vec<Handover>> = BTreeMap::new();
        for &c in &cores {
            let MoveAnswer::Released(hs) = self.step(c, MoveStep::Release).await? else {
                return Err(BrokerError::Internal("release answered nothing".into()));
            };
            for h in hs {
                handed.entry(new.core_for(&h.key)).or_default().push(h);
            }
        }
        let released = Instant::now();
        for (core, hs) in handed {
            self.step(core, MoveStep::Take(hs)).await?;
        }
        for &c in &cores {
            self.step(c, MoveStep::End).await?;
        }
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let taken = Instant::now();
        let hold_ms = ms(swapped, taken);
        // The move is done either way; a pin that could not be saved is said so.
        let persisted = !auto
            && match self.persist_pin(&rule).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::error!(rule = %rule, error = %e, "saving a live pin; it holds until restart");
                    false
                }
            };
        if auto {
            self.metrics.follow_moves.fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(rule = %rule, auto, shards = moves.len(), hold_ms, "re-pinned");
        Ok(RepinReport {
            version,
            rule: rule.to_string(),
            moved: moves
                .iter()
                .map(|(k, a, b)| (k.to_string(), a.index(), b.index()))
                .collect(),
            hold_ms,
            flush_ms: ms(swapped, flushed),
            release_ms: ms(flushed, released),
            take_ms: ms(released, taken),
            persisted,
        })
    }

    /// Adds `rule` to the pins kept in the data directory (read again at start).
    async fn persist_pin(&self, rule: &PinRule) -> Result<(), BrokerError> {
        let path = pins_file(&self.shared.data_dir);
        let rule = rule.clone();
        task::spawn_blocking(move || -> Result<(), BrokerError> {
            let mut pins = read_pins(&path).map_err(BrokerError::Internal)?;
            pins.retain(|p| !p.same_pattern(&rule));
            pins.insert(0, rule);
            let text: Vec<String> = pins.iter().map(ToString::to_string).collect();
            let body = serde_json::to_vec_pretty(&text).expect("strings serialize");
            let tmp = path.with_extension("json.tmp");
            let write = || -> std::io::Result<()> {
                use std::io::Write as _;
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&body)?;
                f.sync_all()?;
                std::fs::rename(&tmp, &path)?;
                if let Some(dir) = path.parent() {
                    std::fs::File::open(dir)?.sync_all()?;
                }
                Ok(())
            };
            write().map_err(|e| BrokerError::Storage(format!("{}: {e}", path.display())))
        })
        .await
    }

    /// Sends `step` to `core` (or runs it here) and waits for its answer.
    fn step(self: &Rc<Self>, core: CoreId, step: MoveStep) -> Answer<MoveAnswer> {
        if core == self.core {
            let this = self.clone();
            return Box::pin(async move { this.move_step(step).await });
        }
        let answer = self.ask_control(core, |reply| CoreMsg::Move { step, reply });
        Box::pin(async move {
            match answer.await? {
                ReplyBody::Move(r) => r,
                other => Err(BrokerError::Internal(format!(
                    "mismatched answer {other:?}"
                ))),
            }
        })
    }

    /// Runs one step of a re-pin on this core.
    pub(super) async fn move_step(
        self: &Rc<Self>,
        step: MoveStep,
    ) -> Result<MoveAnswer, BrokerError> {
        match step {
            MoveStep::Begin { old, new } => {
                self.shards_moving(&old, &new, true)?;
                self.moves_begun.set(self.moves_begun.get() + 1);
                self.reopen_deletions_moving_here(&old, &new);
                *self.moving.borrow_mut() = Some(MoveState {
                    old,
                    new,
                    held: HashMap::new(),
                    held_count: 0,
                    held_from: HashMap::new(),
                    pending: Rc::new(Cell::new(0)),
                    released: false,
                });
            }
            MoveStep::Flush => {
                for c in 0..self.shared.metrics.len() {
                    if c != self.core.index() {
                        self.step(CoreId(c), MoveStep::Barrier).await?;
                    }
                }
            }
            MoveStep::Barrier => {}
            MoveStep::Release => return Ok(MoveAnswer::Released(self.release().await)),
            MoveStep::Take(handovers) => {
                for h in handovers {
                    self.take(h).await;
                }
            }
            MoveStep::End => {
                let state = self.moving.borrow_mut().take();
                for (_, queue) in state.map(|m| m.held).unwrap_or_default() {
                    for f in queue {
                        f();
                    }
                }
            }
        }
        Ok(MoveAnswer::Done)
    }

    /// The shards of the catalog that `new` puts on another core than `old`, with their
    /// cores. Refused when one is replicated (in a cluster): its replica state machine
    /// lives on the owning core and moves with a restart, not live. Asked again at each
    /// core's `Begin`: a replicated stream made after the first look, its replica
    /// attached at the core it leaves, held the release for good (and the core it goes
    /// to opened the same log beside it); then only the replicated ones are looked at.
    fn shards_moving(
        &self,
        old: &PlacementTable,
        new: &PlacementTable,
        replicated_only: bool,
    ) -> Result<Vec<(Arc<ShardKey>, CoreId, CoreId)>, BrokerError> {
        let mut moves: Vec<(Arc<ShardKey>, CoreId, CoreId)> = Vec::new();
        for (stream, kind) in [(true, ShardKind::Stream), (false, ShardKind::Cache)] {
            for (name, spec) in self.shared.catalog.list(stream) {
                if replicated_only && !(self.shared.cluster.is_some() && spec.replicated()) {
                    continue;
                }
                let mut parts = name.splitn(3, '/');
                let (Some(t), Some(ns), Some(n)) = (parts.next(), parts.next(), parts.next())
                else {
                    continue;
                };
                for shard in 0..spec.shards {
                    let key = ShardKey {
                        kind,
                        tenant: t.to_owned(),
                        namespace: ns.to_owned(),
                        name: n.to_owned(),
                        shard,
                    };
                    let (from, to) = (old.core_for(&key), new.core_for(&key));
                    if from == to {
                        continue;
                    }
                    if self.shared.cluster.is_some() && spec.replicated() {
                        // Its replica state machine lives on the owning core; it moves
                        // with a restart (pins are read at start), not live.
                        return Err(BrokerError::InvalidRequest(format!(
                            "{key} is replicated: set the pin in the configuration and restart"
                        )));
                    }
                    moves.push((Arc::new(key), from, to));
                }
            }
        }
        Ok(moves)
    }

    /// A shard of a stream or cache being deleted that moves here from another core:
    /// this core's part of the deletion covers it now, done or not. Done already, the
    /// shard was the other core's when this one looked; the other, looking after the
    /// move, finds it this core's: neither removed it, the deletion finished, and a
    /// stream made again under the name opened the old shard's log, records and all.
    /// At the start, before the core it leaves can finish its own part.
    fn reopen_deletions_moving_here(&self, old: &PlacementTable, new: &PlacementTable) {
        let me = self.core;
        let catalog = &self.shared.catalog;
        for d in catalog.deletions_under_way() {
            let moves_here = (0..d.shards).any(|shard| {
                let key = d.shard_key(shard);
                old.core_for(&key) != me && new.core_for(&key) == me
            });
            if moves_here && catalog.deletion_reopened_for(&d, me.index()) {
                tracing::info!(tenant = %d.tenant, namespace = %d.namespace, name = %d.name, "a shard being deleted moves here: this core removes it");
            }
        }
    }

    /// The shards open (or opening) here that move away, and whether one is still
    /// opening or has requests accepted that wait for it.
    fn moving_away(&self) -> (Vec<Arc<ShardKey>>, bool) {
        let m = self.moving.borrow();
        let Some(m) = m.as_ref() else {
            return (Vec::new(), false);
        };
        let me = self.core;
        let leaving = |k: &ShardKey| m.old.core_for(k) == me && m.new.core_for(k) != me;
        let mut keys = Vec::new();
        let mut opening = self.awaiting_shard.borrow().keys().any(|k| leaving(k));
        for (k, slot) in self.streams.borrow().iter() {
            if leaving(k) {
                opening |= matches!(slot, Slot::Opening(_));
                keys.push(k.clone());
            }
        }
        for (k, slot) in self.caches.borrow().iter() {
            if leaving(k) {
                opening |= matches!(slot, Slot::Opening(_));
                keys.push(k.clone());
            }
        }
        // Taken by an earlier re-pin but never opened here: what it was handed goes on.
        for k in self.pending_takes.borrow().keys() {
            if leaving(k) && !self.streams.borrow().contains_key(k) {
                keys.push(k.clone());
            }
        }
        (keys, opening)
    }

    /// Lets go of every shard moving away: waits for the requests accepted for them and
    /// their in-flight work, stops serving them, closes their logs.
    async fn release(self: &Rc<Self>) -> Vec<Handover> {
        let started = Instant::now();
        let mut warned = 0;
        loop {
            let (keys, opening) = self.moving_away();
            let mut busy = opening;
            for key in &keys {
                if let Some(s) = self.ready_stream(key) {
                    // Long group polls answer now; consumers ask again at the new core.
                    s.closing.set(true);
                    s.appended.wake_all();
                    // Ours and the shard table's; any more is work still running on it.
                    busy |= Rc::strong_count(&s) > 2;
                }
                let cache = match self.caches.borrow().get(key) {
                    Some(Slot::Ready(c)) => Some(c.clone()),
                    _ => None,
                };
                if let Some(c) = cache {
                    c.changed.wake_all();
                    // Long watch polls answer now; watchers ask again at the new core.
                    c.release_watches();
                    busy |= Rc::strong_count(&c) > 2;
                }
            }
            let pending = self.moving.borrow().as_ref().map_or(0, |m| m.pending.get());
            if !busy && pending == 0 {
                // Stop serving them first: nothing may reopen a log while it closes.
                if let Some(m) = self.moving.borrow_mut().as_mut() {
                    m.released = true;
                }
                let mut out = Vec::with_capacity(keys.len());
                for key in keys {
                    if let Some(h) = self.pending_takes.borrow_mut().remove(&key) {
                        // Never opened here since it was handed over: hand it on as is.
                        self.handed_over.borrow_mut().remove(&key);
                        out.push(h);
                        continue;
                    }
                    let stream = self.ready_stream(&key);
                    let interested = stream.as_ref().map(|s| s.interest()).unwrap_or_default();
                    // Nothing runs on the shard now: its groups' state is complete.
                    let group_batches = stream
                        .as_ref()
                        .map(|s| (s.group_batches_seen.get(), s.groups_snapshot_mark.get()));
                    let (log, slot_failed) = (self.log_held(&key), self.failed_slot(&key));
                    let groups = stream.and_then(|s| {
                        let built = s.groups.borrow().as_ref().map(|g| g.state());
                        built.or_else(|| s.handed_groups.borrow_mut().take())
                    });
                    let closed = self.close_shard(&key, true).await;
                    // Looked at once the log is closed: the close writes what was staged
                    // (acknowledged already under `none` with a linger), and a failure
                    // there poisons it too. Judged before, such a failure went over as
                    // an unsealed log, and the new core gave the lost records' offsets
                    // to others.
                    let failed =
                        slot_failed.or_else(|| self.failed_with_acks_unwritten(log.as_ref()?));
                    let sealed = closed && failed.is_none();
                    out.push(Handover {
                        key,
                        interested,
                        sealed,
                        groups,
                        group_batches,
                        failed,
                    });
                }
                return out;
            }
            // Never close under running work (another core would open the log while
            // this one still writes it): wait, and say so.
            if started.elapsed() > RELEASE_WARN_AFTER * (warned + 1) {
                warned += 1;
                tracing::warn!(
                    pending,
                    ?keys,
                    "a re-pin waits for work on shards moving away"
                );
            }
            task::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Takes `h` over: opens the shard and registers its subscriber cores (the requests
    /// held for it are served at [`MoveStep::End`]).
    async fn take(self: &Rc<Self>, h: Handover) {
        if let Some(e) = h.failed {
            // Closed there, closed here: as the old core's slot said, until a restart.
            self.handed_over.borrow_mut().remove(&h.key);
            self.end_subscribers(&h.key, &h.interested);
            match h.key.kind {
                ShardKind::Stream => {
                    self.streams.borrow_mut().insert(h.key, Slot::Failed(e));
                }
                ShardKind::Cache => {
                    self.caches.borrow_mut().insert(h.key, Slot::Failed(e));
                }
            }
            return;
        }
        if h.sealed {
            self.handed_over.borrow_mut().insert(h.key.clone());
        } else {
            self.handed_over.borrow_mut().remove(&h.key);
        }
        // It was open on the old core: open it here at once, so its subscribers' cores
        // get the next batches.
        match h.key.kind {
            ShardKind::Stream => {
                // The open applies the handover (`CoreBroker::stream_shard`), so one
                // that fails for want of resources leaves it for the next open.
                let key = h.key.clone();
                self.pending_takes.borrow_mut().insert(key.clone(), h);
                match self.stream_shard(&key).await {
                    Ok(s) => {
                        // Already open here (not through that open): apply it now.
                        if let Some(h) = self.pending_takes.borrow_mut().remove(&key) {
                            adopt(&s, h);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(shard = %key, error = %e, "opening a moved shard");
                        if !matches!(e, BrokerError::Overloaded(_)) {
                            // Closed here until a restart (`Slot::Failed`), or deleted
                            // (`NotFound`, not kept in the slot): nothing to keep, and
                            // its subscribers end (the failed open above has usually told
                            // them already, taking the handover with it).
                            let h = self.pending_takes.borrow_mut().remove(&key);
                            if let Some(h) = h.filter(|_| !matches!(e, BrokerError::NotFound(_))) {
                                self.end_subscribers(&key, &h.interested);
                            }
                        }
                    }
                }
            }
            ShardKind::Cache => {
                if let Err(e) = self.cache_shard(&h.key).await {
                    tracing::warn!(shard = %h.key, error = %e, "opening a moved cache shard");
                }
            }
        }
        self.metrics.shards_moved_in.fetch_add(1, Ordering::Relaxed);
    }
}

/// Applies what the old core handed over to the shard `s` just opened here: its
/// subscribers' cores, what it knew of the groups' batches, and the groups' state (built
/// from that, not from the log, on first use: the claims in flight are only there).
pub(super) fn adopt(s: &crate::shard::StreamShard, h: Handover) {
    for (core, n) in &h.interested {
        s.register_many(*core, *n);
    }
    // The old core knew better than this open from the indexes (which may predate their
    // kinds field and then say "maybe").
    if let Some((seen, mark)) = h.group_batches {
        s.group_batches_seen.set(seen);
        if seen {
            s.groups_snapshot_mark.set(mark);
        }
    }
    // Nothing has built the groups: the shard was not served here before this open
    // (at a take, the requests held for it run at End, after this).
    *s.handed_groups.borrow_mut() = h.groups;
}

/// Where live pins are kept.
pub fn pins_file(data_dir: &std::path::Path) -> std::path::PathBuf {
    data_dir.join("pins.json")
}

/// The live pins kept in `path` (none when it does not exist).
pub fn read_pins(path: &std::path::Path) -> Result<Vec<PinRule>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let rules: Vec<String> =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    // A rule a broker before 2026-12-08 took and this one refuses (a name over 128
    // bytes, which matches nothing) is dropped with a warning, as a pin naming a core
    // the broker no longer runs is, rather than refusing to start.
    Ok(rules
        .iter()
        .filter_map(|r| match r.parse() {
            Ok(rule) => Some(rule),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "dropping a live pin this broker refuses");
                None
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A live pin an older broker took and this one refuses is dropped at start, not a
    /// reason to refuse to start.
    #[test]
    fn a_live_pin_this_broker_refuses_is_dropped_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pins.json");
        let long = "n".repeat(129);
        std::fs::write(
            &path,
            serde_json::to_string(&[format!("t/default/{long}=0"), "t/default/orders=1".into()])
                .unwrap(),
        )
        .unwrap();
        let rules = read_pins(&path).unwrap();
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].to_string(), "t/default/orders/*=1");
    }

    /// A subscriber that leaves while a handover waits for its shard's open is taken off
    /// it: its core stays registered only while it has subscribers left.
    #[test]
    fn a_waiting_handover_loses_the_subscribers_that_leave() {
        let key = Arc::new(ShardKey {
            kind: ShardKind::Stream,
            tenant: "dev".into(),
            namespace: "default".into(),
            name: "jobs".into(),
            shard: 0,
        });
        let mut h = Handover {
            key,
            interested: vec![(CoreId(0), 2), (CoreId(1), 1)],
            sealed: true,
            groups: None,
            group_batches: None,
            failed: None,
        };
        h.unregister(CoreId(1));
        assert_eq!(h.interested, vec![(CoreId(0), 2)], "core 1 had one");
        h.unregister(CoreId(0));
        assert_eq!(h.interested, vec![(CoreId(0), 1)]);
        h.unregister(CoreId(1));
        assert_eq!(h.interested, vec![(CoreId(0), 1)], "none left on core 1");
        h.unregister(CoreId(0));
        assert!(h.interested.is_empty());
    }
}
