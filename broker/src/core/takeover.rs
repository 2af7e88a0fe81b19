//! Writes that reach a broker while it takes a replicated shard over (a planned move's
//! or a failover's cut-over: the assignments name it leader and its replica is still
//! fencing a majority, catching up or writing its generation start; or a new shard's
//! leader whose core has not attached the replica yet) are held here, in
//! arrival order, until the replica serves, and then appended in that order; past
//! [`HOLD_MAX`] they are refused `shard_unavailable` with reason `moving` (retryable).
//! The old leader forwards what reaches it to the new one once its view names it, so a
//! producer sees a short pause instead of a refusal. Without the hold every write in the
//! window was refused and each client retried on its own. Writes already admitted at the
//! old leader when it was fenced end outcome-unknown, as they must.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use felix_core_runtime::placement::ShardKey;
use felix_core_runtime::task;
use futures_channel::oneshot;

use super::CoreBroker;
use super::moves::{Answer, answer_when_done};
use crate::error::BrokerError;

/// The longest a write waits for its shard's new leader to serve.
pub const HOLD_MAX: Duration = Duration::from_secs(1);

/// How often a hold looks again (only while one is waiting).
const RECHECK: Duration = Duration::from_millis(2);

/// Publishes one shard holds at most; more are refused at once (their payloads wait in
/// memory while held).
const HELD_MAX: usize = 4096;

/// A held call: run it (`true`) or refuse it (`false`).
pub(super) type Held = Box<dyn FnOnce(bool)>;

impl CoreBroker {
    /// Whether writes to `key` wait here: its replica is taking the shard over, or writes
    /// that came earlier are still held (a later one must not pass them).
    pub(super) fn taking_over(&self, key: &ShardKey) -> bool {
        self.takeover_held.borrow().contains_key(key) || self.replica_taking_over(key)
    }

    /// Whether `key`'s replica here is becoming its serving leader: named leader and
    /// fencing, catching up or writing its generation start; or named leader at a newer
    /// generation by the assignments this broker read, which reach the replica on the
    /// core's next look (within milliseconds); or named leader while the core has not
    /// attached the replica yet.
    fn replica_taking_over(&self, key: &ShardKey) -> bool {
        let Some(rs) = self.replicas.as_ref().and_then(|r| r.get(key)) else {
            return self.replica_not_attached(key);
        };
        if rs.taking_over() {
            return true;
        }
        // (Serving or not: a new generation led by this broker again, as a staged move's
        // writes make, is a takeover too; until the replica has it, `may_acknowledge`
        // refuses writes as stale.)
        self.shared
            .cluster
            .as_ref()
            .is_some_and(|c| c.leads_newer(key, rs.generation()))
    }

    /// Whether the assignments name this broker leader of replicated `key` while this
    /// core has not attached its replica yet: the core's next look at the assignments
    /// opens it (within 10 ms, longer on a busy machine). Clients learn the leader from
    /// the control plane and may ask before that; refused `not_ready`, a new cache's
    /// first writes failed (up to 21 in one run of the planned-moves cache test). Held,
    /// they wait like a takeover's.
    fn replica_not_attached(&self, key: &ShardKey) -> bool {
        self.replicas.is_some()
            && self
                .shared
                .cluster
                .as_ref()
                .is_some_and(|c| c.leads_copies_of(key))
            && self.replicated(key)
    }

    /// Runs `call` now, or, while this broker's replica takes `key` over, once it
    /// serves (in arrival order): the one entry every kind of write and read on a
    /// replicated shard's owning core goes through.
    pub(super) fn through_takeover<T: 'static>(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        call: impl FnOnce(Rc<CoreBroker>) -> Answer<T> + 'static,
    ) -> Answer<T> {
        self.through_takeover_or_not(key, call, false)
    }

    /// [`CoreBroker::through_takeover`]; a `cancellable` call held for the takeover is
    /// dropped when its asker drops the answer (a waiting group poll), where the others
    /// run to completion.
    pub(super) fn through_takeover_or_not<T: 'static>(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        call: impl FnOnce(Rc<CoreBroker>) -> Answer<T> + 'static,
        cancellable: bool,
    ) -> Answer<T> {
        if self.taking_over(key) {
            self.after_takeover(key, call, cancellable)
        } else {
            call(self.clone())
        }
    }

    /// Runs `call` once `key`'s replica serves, after every call held before it; answers
    /// what it answers, or `moving` past [`HOLD_MAX`].
    fn after_takeover<T: 'static>(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        call: impl FnOnce(Rc<CoreBroker>) -> Answer<T> + 'static,
        cancellable: bool,
    ) -> Answer<T> {
        let (tx, rx) = oneshot::channel();
        let this = self.clone();
        let held: Held = Box::new(move |run| {
            if !run {
                let _ = tx.send(Err(moving()));
                return;
            }
            // Called in arrival order with no await between calls: offsets are claimed
            // in that order.
            answer_when_done(call(this), tx, cancellable);
        });
        let first = {
            let mut map = self.takeover_held.borrow_mut();
            let queue = map.entry(key.clone()).or_default();
            if queue.len() >= HELD_MAX {
                return Box::pin(std::future::ready(Err(moving())));
            }
            queue.push(held);
            queue.len() == 1
        };
        self.metrics.takeover_held.fetch_add(1, Ordering::Relaxed);
        if first {
            self.settle_takeover(key.clone());
        }
        Box::pin(async move { rx.await.unwrap_or_else(|_| Err(moving())) })
    }

    /// Waits until `key`'s replica serves (or stops taking over, or time runs out), then
    /// runs or refuses what was held.
    fn settle_takeover(self: &Rc<Self>, key: Arc<ShardKey>) {
        let this = Rc::downgrade(self);
        task::spawn(async move {
            let deadline = Instant::now() + HOLD_MAX;
            loop {
                task::sleep(RECHECK).await;
                let Some(core) = this.upgrade() else { return };
                let waiting = core.replica_taking_over(&key);
                if waiting && Instant::now() < deadline {
                    continue;
                }
                let held = core.takeover_held.borrow_mut().remove(&key);
                // Serving now (or no longer this broker's to take: each call then gets
                // the answer it would have had), or out of time.
                for f in held.unwrap_or_default() {
                    f(!waiting);
                }
                return;
            }
        })
        .detach();
    }
}

fn moving() -> BrokerError {
    BrokerError::ShardUnavailable("moving".into())
}
