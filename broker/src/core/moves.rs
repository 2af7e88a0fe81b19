//! Moving shards between cores on a running broker (a live re-pin).
//!
//! A new pin rule is applied by one core, the coordinator, in five steps over the mesh.
//! For every shard the rule moves from core A to core B:
//!
//! 1. **Arrive** (at B): requests for the shard that reach B are held, in arrival order.
//!    **Leave** (at A): A keeps serving the shard although the table will name B.
//! 2. The new table is swapped in: from now on every core sends the shard's requests
//!    to B, where they wait.
//! 3. **Flush** (at every core C): C sends a barrier to each A behind everything it sent
//!    A before (the mesh channel from C to A is FIFO) and waits for the answer. Once
//!    every core answered, A has been handed every request sent under the old table.
//! 4. **Release** (at A): A waits for those requests and its in-flight appends (commit
//!    and fanout) to finish, wakes long polls and watches so they answer now, closes the
//!    log, and hands over the cores with subscribers.
//! 5. **Take** (at B): B opens the log, registers those subscriber cores, and serves the
//!    held requests in the order they came.
//!
//! What this keeps true: one core writes a log at a time; a producer's requests reach
//! the log in the order it sent them (all older ones at A before any newer one at B);
//! an append acknowledged by A was committed before B opened the log; subscribers keep
//! their queues (A fans out its last batches, B the next ones; a subscriber that sees a
//! later batch first reads the gap from the log and drops the stale copy). A request
//! sent to A after it let go is passed on to B, not refused.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use felix_core_runtime::CoreId;
use felix_core_runtime::placement::{PinRule, ShardKey, ShardKind};
use felix_core_runtime::task;
use futures_channel::oneshot;
use futures_lite::StreamExt;

use super::{CoreBroker, CoreMsg, ReplyBody, Slot};
use crate::error::BrokerError;

/// How long A waits for the shard's in-flight work before it closes the log anyway.
const RELEASE_WAIT_MAX: Duration = Duration::from_secs(10);

/// A moving shard's newest segment is sealed (a new one started) when it holds at least
/// this much: scanning less at the new core costs less than creating a segment.
const SEAL_MIN_BYTES: u64 = 16 << 20;

/// A request held until its shard arrives: run once, in arrival order.
pub type Held = Box<dyn FnOnce()>;

/// A boxed answer.
pub type Answer<T> = Pin<Box<dyn std::future::Future<Output = Result<T, BrokerError>>>>;

/// One step of a live re-pin, sent by the coordinating core.
#[derive(Debug)]
pub enum MoveStep {
    /// Hold these shards' requests until they are taken.
    Arrive(Vec<Arc<ShardKey>>),
    /// Keep serving these shards while the table names another core.
    Leave(Vec<Arc<ShardKey>>),
    /// Send a barrier to each of these cores and wait for the answers.
    Flush(Vec<CoreId>),
    /// Answered at once: everything sent before it has been handled.
    Barrier,
    /// Finish these shards' work, close them, hand them over.
    Release(Vec<Arc<ShardKey>>),
    /// Open these shards and serve what was held.
    Take(Vec<Handover>),
}

/// A shard handed from one core to another.
#[derive(Debug, Clone)]
pub struct Handover {
    /// The shard.
    pub key: Arc<ShardKey>,
    /// Whether it was open on the old core (the new one opens it at once).
    pub open: bool,
    /// Cores with subscribers to it, and how many.
    pub interested: Vec<(CoreId, usize)>,
    /// Whether the old core closed and sealed its log cleanly (the new core then checks
    /// the sealed segments' tails, not every batch).
    pub sealed: bool,
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
            | CoreMsg::State { key, .. }
            | CoreMsg::Watch { key, .. }
            | CoreMsg::Cache { key, .. } => Some(key),
            CoreMsg::Deliver { .. }
            | CoreMsg::Peer { .. }
            | CoreMsg::Reply { .. }
            | CoreMsg::Move { .. } => None,
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

impl CoreBroker {
    /// Whether requests for `key` are held here (it is arriving).
    pub(super) fn held(&self, key: &ShardKey) -> bool {
        let a = self.arriving.borrow();
        !a.is_empty() && a.contains_key(key)
    }

    /// Whether this core still serves `key` although the table names another.
    pub(super) fn leaving(&self, key: &ShardKey) -> bool {
        let l = self.leaving.borrow();
        !l.is_empty() && l.contains_key(key)
    }

    /// Runs `call` once `key` has arrived here, in the order held calls came; answers
    /// what it answers.
    pub(super) fn after_arrival<T: 'static>(
        self: &Rc<Self>,
        key: &ShardKey,
        call: impl FnOnce(Rc<CoreBroker>) -> Answer<T> + 'static,
    ) -> Answer<T> {
        let (tx, rx) = oneshot::channel();
        let this = self.clone();
        self.hold(
            key,
            Box::new(move || {
                let fut = call(this);
                task::spawn(async move {
                    let _ = tx.send(fut.await);
                })
                .detach();
            }),
        );
        Box::pin(async move {
            rx.await
                .unwrap_or_else(|_| Err(BrokerError::ShardUnavailable("moving".into())))
        })
    }

    pub(super) fn hold(&self, key: &ShardKey, f: Held) {
        self.metrics.requests_held.fetch_add(1, Ordering::Relaxed);
        if let Some(q) = self.arriving.borrow_mut().get_mut(key) {
            q.push(f);
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
            let (this, key) = (self.clone(), key.clone());
            self.hold(&key, Box::new(move || this.handle(from, msg)));
            return (Admit::Done, None);
        }
        if let Some(n) = self.leaving.borrow().get(key) {
            n.set(n.get() + 1);
            return (Admit::Serve(Some(Pending(n.clone()))), Some(msg));
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
        let this = Rc::downgrade(self);
        task::spawn(async move {
            while let Some(job) = jobs.next().await {
                let Some(core) = this.upgrade() else { return };
                if core.draining() {
                    let _ = job.answer.send(Err(BrokerError::Draining));
                    continue;
                }
                let r = core.repin(job.rule).await;
                let _ = job.answer.send(r);
            }
        })
        .detach();
    }

    /// Applies `rule` to the running broker, moving every shard it re-homes.
    async fn repin(self: &Rc<Self>, rule: PinRule) -> Result<RepinReport, BrokerError> {
        let old = self.shared.placement.load();
        let new = old
            .with_rule(rule.clone())
            .map_err(|e| BrokerError::InvalidRequest(e.to_string()))?;
        let mut moves: Vec<(Arc<ShardKey>, CoreId, CoreId)> = Vec::new();
        for (stream, kind) in [(true, ShardKind::Stream), (false, ShardKind::Cache)] {
            for (name, spec) in self.shared.catalog.list(stream) {
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
        let group = |pick: fn(&(Arc<ShardKey>, CoreId, CoreId)) -> CoreId| {
            let mut m: BTreeMap<CoreId, Vec<Arc<ShardKey>>> = BTreeMap::new();
            for mv in &moves {
                m.entry(pick(mv)).or_default().push(mv.0.clone());
            }
            m
        };
        let (sources, targets) = (group(|m| m.1), group(|m| m.2));
        for (core, keys) in &targets {
            self.step(*core, MoveStep::Arrive(keys.clone())).await?;
        }
        for (core, keys) in &sources {
            self.step(*core, MoveStep::Leave(keys.clone())).await?;
        }
        let swapped = Instant::now();
        let version = new.version();
        self.shared.placement.replace(new);
        let from: Vec<CoreId> = sources.keys().copied().collect();
        if !from.is_empty() {
            for c in 0..self.shared.metrics.len() {
                self.step(CoreId(c), MoveStep::Flush(from.clone())).await?;
            }
        }
        let flushed = Instant::now();
        let mut handed: BTreeMap<CoreId, Vec<Handover>> = BTreeMap::new();
        for (core, keys) in sources {
            let MoveAnswer::Released(hs) = self.step(core, MoveStep::Release(keys)).await? else {
                return Err(BrokerError::Internal("release answered nothing".into()));
            };
            for h in hs {
                let to = moves
                    .iter()
                    .find(|m| m.0 == h.key)
                    .map(|m| m.2)
                    .expect("released shards were asked for");
                handed.entry(to).or_default().push(h);
            }
        }
        let released = Instant::now();
        for (core, hs) in handed {
            self.step(core, MoveStep::Take(hs)).await?;
        }
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let taken = Instant::now();
        let hold_ms = ms(swapped, taken);
        self.persist_pin(&rule).await?;
        tracing::info!(rule = %rule, shards = moves.len(), hold_ms, "re-pinned");
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
        let answer = self.ask(core, |reply| CoreMsg::Move { step, reply });
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
            MoveStep::Arrive(keys) => {
                let mut a = self.arriving.borrow_mut();
                for k in keys {
                    a.entry(k).or_default();
                }
            }
            MoveStep::Leave(keys) => {
                let mut l = self.leaving.borrow_mut();
                for k in keys {
                    l.entry(k).or_insert_with(|| Rc::new(Cell::new(0)));
                }
            }
            MoveStep::Flush(cores) => {
                for c in cores {
                    if c != self.core {
                        self.step(c, MoveStep::Barrier).await?;
                    }
                }
            }
            MoveStep::Barrier => {}
            MoveStep::Release(keys) => {
                let mut out = Vec::with_capacity(keys.len());
                for key in keys {
                    out.push(self.release(key).await);
                }
                return Ok(MoveAnswer::Released(out));
            }
            MoveStep::Take(handovers) => {
                for h in handovers {
                    self.take(h).await;
                }
            }
        }
        Ok(MoveAnswer::Done)
    }

    /// Lets go of `key`: waits for the requests it accepted and the shard's in-flight
    /// work, then closes the log.
    async fn release(self: &Rc<Self>, key: Arc<ShardKey>) -> Handover {
        let deadline = Instant::now() + RELEASE_WAIT_MAX;
        loop {
            let opening = matches!(self.streams.borrow().get(&key), Some(Slot::Opening(_)))
                || matches!(self.caches.borrow().get(&key), Some(Slot::Opening(_)));
            let stream = self.ready_stream(&key);
            let cache = match self.caches.borrow().get(&key) {
                Some(Slot::Ready(c)) => Some(c.clone()),
                _ => None,
            };
            if let Some(s) = &stream {
                // Long group polls answer now; their consumers ask again at the new core.
                s.closing.set(true);
                s.appended.wake_all();
            }
            if let Some(c) = &cache {
                c.changed.wake_all();
            }
            let pending = self.leaving.borrow().get(&key).map_or(0, |n| n.get());
            // Ours and the shard table's; any more is work still running on it.
            let busy = stream.as_ref().is_some_and(|s| Rc::strong_count(s) > 2)
                || cache.as_ref().is_some_and(|c| Rc::strong_count(c) > 2);
            if !opening && pending == 0 && !busy {
                let interested = stream.as_ref().map(|s| s.interest()).unwrap_or_default();
                let open = stream.is_some() || cache.is_some();
                drop((stream, cache));
                let sealed = self.close_for_move(&key).await;
                self.leaving.borrow_mut().remove(&key);
                return Handover {
                    key,
                    open,
                    interested,
                    sealed,
                };
            }
            if Instant::now() >= deadline {
                tracing::warn!(shard = %key, pending, "work still running on a moving shard; closing it anyway");
                let interested = stream.as_ref().map(|s| s.interest()).unwrap_or_default();
                drop((stream, cache));
                let sealed = self.close_for_move(&key).await;
                self.leaving.borrow_mut().remove(&key);
                return Handover {
                    key,
                    open: true,
                    interested,
                    sealed,
                };
            }
            task::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Closes `key`'s log here and seals its newest segment, so the core taking it over
    /// loads indexes instead of scanning. True when both went cleanly.
    async fn close_for_move(&self, key: &ShardKey) -> bool {
        let stream = self.streams.borrow_mut().remove(key);
        let cache = self.caches.borrow_mut().remove(key);
        let mut clean = true;
        if let Some(Slot::Ready(s)) = stream {
            clean &= self.seal(key, s.log.close().await, &s.log).await;
        }
        if let Some(Slot::Ready(c)) = cache {
            clean &= self.seal(key, c.log().close().await, c.log()).await;
        }
        clean
    }

    async fn seal(
        &self,
        key: &ShardKey,
        closed: Result<(), felix_storage_uring::StorageError>,
        log: &felix_storage_uring::SegmentLog<felix_storage_uring::DmaBackend>,
    ) -> bool {
        self.metrics.shards_open.fetch_sub(1, Ordering::Relaxed);
        let sealed = match closed {
            Ok(()) => log.seal_active(SEAL_MIN_BYTES).await,
            Err(e) => Err(e),
        };
        match sealed {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(shard = %key, error = %e, "closing a moving shard");
                false
            }
        }
    }

    /// Takes `h` over: opens the shard, registers its subscriber cores, then serves the
    /// requests held for it in the order they came.
    async fn take(self: &Rc<Self>, h: Handover) {
        if h.sealed {
            self.handed_over.borrow_mut().insert(h.key.clone());
        }
        if h.open || !h.interested.is_empty() {
            match h.key.kind {
                ShardKind::Stream => match self.stream_shard(&h.key).await {
                    Ok(s) => {
                        for (core, n) in &h.interested {
                            s.register_many(*core, *n);
                        }
                    }
                    Err(e) => tracing::warn!(shard = %h.key, error = %e, "opening a moved shard"),
                },
                ShardKind::Cache => {
                    if let Err(e) = self.cache_shard(&h.key).await {
                        tracing::warn!(shard = %h.key, error = %e, "opening a moved cache shard");
                    }
                }
            }
        }
        self.metrics.shards_moved_in.fetch_add(1, Ordering::Relaxed);
        let held = self
            .arriving
            .borrow_mut()
            .remove(&h.key)
            .unwrap_or_default();
        for f in held {
            f();
        }
    }
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
    rules
        .iter()
        .map(|r| r.parse().map_err(|e| format!("{}: {e}", path.display())))
        .collect()
}
