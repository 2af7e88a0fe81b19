//! The session driver: the only file in `session/` that touches QUIC streams, tasks and
//! the clock. It moves bytes between the connection and the sans-IO pieces: frames into
//! [`handshake`](super::handshake) and [`dispatch`](super::dispatch), actions out to the
//! core, answers through the [`Outbox`], live batches through the subscription [`Pump`].
//!
//! Per connection ([`ConnScope`]): the authentication deadline, the publish bytes in
//! flight, the subscription count, and the end of the connection, which ends every
//! subscription made on it whether or not it was sending anything.
//! Per stream: one reader (this task) and one writer task; the reader stops reading
//! while the outbox is at its window or the connection's byte budget is spent.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use felix_core_runtime::clock;
use felix_core_runtime::placement::ShardKey;
use felix_core_runtime::quic::{ConnId, Connection, RecvStream, SendStream};
use felix_core_runtime::task;
use felix_wire::frame::FrameError;
use felix_wire::message::StartPosition;
use felix_wire::{
    ErrorCode, Features, Flags, Frame, FrameReader, Generation, Message, Offset, SubscriptionId,
};

use crate::cluster::Resolved;
use rustc_hash::FxHashMap;

use super::answer::{self, AnswerTo};
use super::dispatch::{self, Action, CacheReply, Forwarded, Request};
use super::handshake::{AuthDeadline, AuthTimer, HandshakeEnv, handshake};
use super::outbox::{Answer, ByteBudget, Flush, Outbox};
use super::subscription::{Live, Pump};
use super::{Limits, Session, served_features};
use crate::core::{CacheAnswer, CoreBroker, Ending, SubQueue};
use crate::error::BrokerError;
use crate::shard::EventFormat;

/// How long an idle subscriber's pump waits before checking for deliveries another
/// core dropped.
const GAP_CHECK: Duration = Duration::from_millis(100);
/// Queued batches a subscriber's pump writes in one go.
const LIVE_WRITE_BATCHES: usize = 64;
/// Reads of a subscription's history that a transient refusal (`overloaded`,
/// `shard_unavailable`) may fail in a row before the subscription ends with an error
/// (about 2 s of backoff).
const HISTORY_READ_RETRIES: u32 = 10;
/// Bytes of history read from the log per read.
const HISTORY_READ_BYTES: usize = 1 << 20;
/// Answers a stream's writer hands to QUIC in one write.
const WRITE_BATCH_FRAMES: usize = 64;
/// QUIC application close codes.
const CLOSE_SHUTDOWN: u32 = 0;
const CLOSE_AUTH_TIMEOUT: u32 = 1;
/// A token this connection authenticated with was revoked, or its key retired.
const CLOSE_REVOKED: u32 = 2;
/// The connection's streams held more bytes of unfinished frames than it (or, as the
/// largest, the core's connections) may (`unfinished`).
const CLOSE_UNFINISHED: u32 = 3;
/// The connection's streams left more bytes of answers unread than it (or, as the
/// largest, the core's connections) may (`held`).
const CLOSE_UNREAD: u32 = 4;
/// How often each core looks for a new key set (the bound on top of the control-plane
/// sync for closing a revoked connection).
const KEY_CHECK: Duration = Duration::from_millis(250);

/// What a connection's streams share.
#[derive(Debug)]
pub struct ConnScope {
    id: ConnId,
    limits: Limits,
    auth: RefCell<AuthDeadline>,
    budget: RefCell<ByteBudget>,
    budget_waiters: RefCell<Waiters>,
    subscriptions: Cell<usize>,
    /// Group polls of this connection waiting for records.
    waiting_polls: Rc<Cell<usize>>,
    /// Its requests in flight at each other core, by core index (see
    /// [`CROSS_CORE_PER_CONNECTION`]).
    cross_core: RefCell<Vec<usize>>,
    next_subscription: Cell<u64>,
    closed: Cell<bool>,
    /// One waker per live subscription, woken when the connection ends.
    on_close: RefCell<FxHashMap<u64, Waker>>,
    /// The grants its streams authenticated with (checked again when keys change).
    grants: RefCell<Vec<Rc<crate::auth::Grant>>>,
    /// A stream authenticated: the connection's receive window was opened.
    trusted: Cell<bool>,
    /// A broker's connection forwarding requests: how many times they were forwarded
    /// (see [`Session::forwarded`]).
    forwarded: u8,
}

/// A group poll's place among its connection's waiting polls, given back when the poll
/// ends or is cancelled with its connection.
struct PollWait(Rc<Cell<usize>>);

impl Drop for PollWait {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

impl ConnScope {
    fn new(id: ConnId, limits: Limits, accepted: std::time::Instant, forwarded: u8) -> ConnScope {
        ConnScope {
            id,
            limits,
            auth: RefCell::new(AuthDeadline::new(accepted, limits.auth_timeout)),
            budget: RefCell::new(ByteBudget::new(limits.inflight_publish_bytes)),
            budget_waiters: RefCell::default(),
            subscriptions: Cell::new(0),
            waiting_polls: Rc::default(),
            cross_core: RefCell::default(),
            next_subscription: Cell::new(1),
            closed: Cell::new(false),
            on_close: RefCell::default(),
            grants: RefCell::default(),
            trusted: Cell::new(false),
            forwarded,
        }
    }

    /// Admits a group poll's wait: within the connection's allowance the poll may wait
    /// (the returned guard holds its place until the poll ends); past it the wait is
    /// taken as 0, so the poll answers with what is there now.
    fn hold_poll_wait(&self, wait_ms: &mut u64) -> Option<PollWait> {
        if *wait_ms == 0 {
            return None;
        }
        if self.waiting_polls.get() >= self.limits.waiting_polls_per_connection {
            *wait_ms = 0;
            return None;
        }
        self.waiting_polls.set(self.waiting_polls.get() + 1);
        Some(PollWait(self.waiting_polls.clone()))
    }

    /// Marks the connection ended and wakes everything waiting on it.
    fn close(&self) {
        self.closed.set(true);
        let wakers: Vec<Waker> = self.on_close.borrow_mut().drain().map(|(_, w)| w).collect();
        wakers.into_iter().for_each(Waker::wake);
        self.wake_budget();
    }

    /// A number for a new waiter on the connection's end ([`ConnScope::closed`]).
    fn next_waiter(&self) -> u64 {
        let id = self.next_subscription.get();
        self.next_subscription.set(id + 1);
        id
    }

    /// Resolves once the connection has ended (`id`: the waiting subscription, or
    /// stream). A waiter that stops waiting first leaves its waker behind until
    /// [`ConnScope::stop_waiting`].
    async fn closed(&self, id: u64) {
        poll_fn(|cx| {
            if self.closed.get() {
                self.on_close.borrow_mut().remove(&id);
                return Poll::Ready(());
            }
            self.on_close.borrow_mut().insert(id, cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Forgets waiter `id`'s waker: it no longer waits for the connection's end.
    fn stop_waiting(&self, id: u64) {
        let mut on_close = self.on_close.borrow_mut();
        if !on_close.is_empty() {
            on_close.remove(&id);
        }
    }

    /// Takes `n` request bytes from the core's budget (all its connections' together),
    /// waiting in line behind every request that began waiting earlier. False when the
    /// connection ended first.
    async fn take_core_budget(&self, core: &CoreBroker, n: usize) -> bool {
        if core.request_bytes.borrow_mut().try_take(n) {
            core.note_request_bytes();
            return true;
        }
        let ticket = core.request_bytes.borrow_mut().queue(n);
        // Dropped (its connection gone) before its turn, it gives its place up.
        struct InLine<'a>(&'a CoreBroker, Option<u64>);
        impl Drop for InLine<'_> {
            fn drop(&mut self) {
                if let Some(t) = self.1 {
                    self.0.request_bytes.borrow_mut().leave(t);
                }
            }
        }
        let mut line = InLine(core, Some(ticket));
        let mut place = None;
        let taken = poll_fn(|cx| {
            if self.closed.get() {
                return Poll::Ready(false);
            }
            if core
                .request_bytes
                .borrow_mut()
                .poll_take(ticket, cx.waker())
            {
                return Poll::Ready(true);
            }
            // Woken by the connection's end too. Woken at every release the core's
            // line makes while it is first in it, it registers once.
            self.budget_waiters
                .borrow_mut()
                .register(&mut place, cx.waker());
            Poll::Pending
        })
        .await;
        if taken {
            line.1 = None;
            core.note_request_bytes();
        }
        taken
    }

    /// Waits until `n` publish bytes fit the connection's budget, then takes them.
    /// False when the connection ended first.
    async fn take_budget(&self, n: usize) -> bool {
        self.wait_for(|| self.budget.borrow_mut().try_take(n)).await
    }

    /// Waits until `take` succeeds, woken with the connection's budget waiters (every
    /// request's end wakes them). False when the connection ended first.
    async fn wait_for(&self, mut take: impl FnMut() -> bool) -> bool {
        let mut place = None;
        poll_fn(|cx| {
            if self.closed.get() {
                return Poll::Ready(false);
            }
            if take() {
                return Poll::Ready(true);
            }
            self.budget_waiters
                .borrow_mut()
                .register(&mut place, cx.waker());
            Poll::Pending
        })
        .await
    }

    /// Takes a place among the connection's requests in flight at core `at`, waiting
    /// while it has [`CROSS_CORE_PER_CONNECTION`] of them there. False when the
    /// connection ended first.
    async fn take_cross_core(&self, at: usize) -> bool {
        self.wait_for(|| {
            let mut counts = self.cross_core.borrow_mut();
            if counts.len() <= at {
                counts.resize(at + 1, 0);
            }
            let free = counts[at] < CROSS_CORE_PER_CONNECTION;
            if free {
                counts[at] += 1;
            }
            free
        })
        .await
    }

    fn release_budget(&self, n: usize) {
        if n > 0 {
            self.budget.borrow_mut().release(n);
            self.wake_budget();
        }
    }

    fn wake_budget(&self) {
        let waiters = self.budget_waiters.borrow_mut().take();
        waiters.into_iter().for_each(Waker::wake);
    }
}

/// A connection's requests waiting for its budgets, each in the list once however
/// often its task polls: a future woken by another source than the list's (the core's
/// line of requests waiting for its budget wakes the first in line at each release)
/// pushed a clone each time, and glommio's task panics at 32,767 clones of its waker
/// (as storage's commits did, f31631a). Each waiter keeps its place (the list's epoch
/// and its index), so registering costs the same with 16,384 requests waiting as with
/// one (a scan of the list made a wake of them all quadratic).
#[derive(Debug, Default)]
struct Waiters {
    list: Vec<Waker>,
    /// Bumped each time the list is emptied: a place from an older epoch is gone.
    epoch: u64,
}

impl Waiters {
    /// Puts `waker` in the list unless `place` says it is there already (replaced
    /// there if its task's waker changed).
    fn register(&mut self, place: &mut Option<(u64, usize)>, waker: &Waker) {
        match *place {
            Some((epoch, i)) if epoch == self.epoch => {
                if !self.list[i].will_wake(waker) {
                    self.list[i] = waker.clone();
                }
            }
            _ => {
                *place = Some((self.epoch, self.list.len()));
                self.list.push(waker.clone());
            }
        }
    }

    /// Empties the list, for its wakers to be woken.
    fn take(&mut self) -> Vec<Waker> {
        self.epoch += 1;
        std::mem::take(&mut self.list)
    }
}

/// A request's bytes held against its connection's budget and its core's until
/// dropped.
struct Held {
    scope: Rc<ConnScope>,
    core: Rc<CoreBroker>,
    bytes: usize,
    /// Still counted in the core's budget.
    in_core: bool,
    /// Holds one of the connection's places at the core of this index.
    cross_core: Option<usize>,
}

/// Requests one connection may have in flight at each other core of this broker: a
/// quarter of the slots a core has at each other core
/// ([`crate::core::CROSS_CORE_REQUESTS_MAX`]), so one connection's pipelined requests
/// to a shard there leave its core's other connections room. Past it, its next such
/// request waits for one of them to end (its stream is not read meanwhile: QUIC flow
/// control holds the client back). Before, a connection could hold all 8,192 (its
/// request budget allows 16,384), and every other request from its core to that core
/// was refused `overloaded` (`core_queue_full`) meanwhile.
pub const CROSS_CORE_PER_CONNECTION: usize = crate::core::CROSS_CORE_REQUESTS_MAX / 4;

/// Waits, when `key`'s shard is on another core, for a place among the connection's
/// requests in flight there, held by `held` until the request ends. False when the
/// connection ended first. A request held by nothing (a group poll that waits, bounded
/// by the waiting polls' own allowance) takes no place.
async fn place_across_cores(core: &CoreBroker, key: &ShardKey, held: &mut Option<Held>) -> bool {
    let Some(h) = held.as_mut() else {
        return true;
    };
    debug_assert!(h.cross_core.is_none(), "one place per request");
    let owner = core.owner(key);
    if owner == core.core {
        return true;
    }
    if !h.scope.take_cross_core(owner.index()).await {
        return false;
    }
    h.cross_core = Some(owner.index());
    true
}

impl Held {
    /// Gives the core's share back now: a request forwarded to another broker waits
    /// there, and that broker's core budget holds it. Kept here too, two brokers
    /// forwarding to each other could each fill its budget with requests waiting on
    /// the other's, whose forwards wait for room (the forwarder bounds what is sent).
    fn leave_core(&mut self) {
        if std::mem::take(&mut self.in_core) {
            self.core.release_request_bytes(self.bytes);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // (The budget's release just below wakes the waiters: every request is charged
        // at least `REQUEST_MIN_CHARGE`.)
        if let Some(at) = self.cross_core
            && let Some(n) = self.scope.cross_core.borrow_mut().get_mut(at)
        {
            *n = n.saturating_sub(1);
        }
        self.scope.release_budget(self.bytes);
        self.leave_core();
    }
}

/// Bytes of answers a stream may hold done ahead of their turn (behind a waiting poll,
/// or a client not reading) before it stops reading requests.
const STREAM_PLACED_BYTES_MAX: usize = 8 << 20;

/// Where a stream's answers done ahead of their turn are counted: the stream's own
/// total (past [`STREAM_PLACED_BYTES_MAX`] it stops reading) and its connection's
/// answers unwritten (past that bound the connection is closed). Done, such answers
/// were held outside every bound: a window of them per stream, each up to a frame.
#[derive(Clone)]
struct Places {
    core: Rc<CoreBroker>,
    conn: ConnId,
    placed: Rc<Cell<usize>>,
}

impl std::fmt::Debug for Places {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Places")
            .field("placed", &self.placed.get())
            .finish_non_exhaustive()
    }
}

impl Places {
    /// Whether an answer of about `bytes` still fits the connection's bound on unwritten
    /// answers: counted a moment first, so one past the bound closes the connection
    /// before it is encoded, not after. A cache value's answer is encoded (base64 of
    /// up to 16 MiB) in its own task once the value is read, and 256 gets of a large
    /// value pipelined on a stream each encoded theirs before the bound counted any:
    /// gigabytes for one stream, the bound's close coming after all of them.
    fn fits(&self, bytes: usize) -> bool {
        count_held(&self.core, Holding::Unwritten, self.conn, 0, bytes);
        let open = self.core.unwritten.borrow().is_open(self.conn);
        count_held(&self.core, Holding::Unwritten, self.conn, bytes, 0);
        open
    }

    /// Counts `frame` until the returned place is dropped (the writer took it).
    fn place(&self, frame: Bytes) -> (Bytes, Place) {
        let bytes = frame.len();
        self.placed.set(self.placed.get() + bytes);
        count_held(&self.core, Holding::Unwritten, self.conn, 0, bytes);
        let place = Place {
            places: self.clone(),
            bytes,
        };
        (frame, place)
    }
}

/// An answer's count in [`Places`], until dropped.
struct Place {
    places: Places,
    bytes: usize,
}

impl Drop for Place {
    fn drop(&mut self) {
        let p = &self.places;
        p.placed.set(p.placed.get() - self.bytes);
        count_held(&p.core, Holding::Unwritten, p.conn, self.bytes, 0);
    }
}

/// The frame of an answer worked out ahead (see [`Places`]), its place let go.
fn taken(
    session: &Session,
    started: Result<(Bytes, Place), futures_channel::oneshot::Canceled>,
) -> Bytes {
    match started {
        Ok((frame, _place)) => frame,
        Err(_) => answer::error(
            session,
            &BrokerError::Internal("the request's task ended unanswered".into()),
        ),
    }
}

/// Serves one accepted connection until it closes.
pub async fn serve_connection(core: Rc<CoreBroker>, conn: Connection) {
    core.metrics.connections.fetch_add(1, Ordering::Relaxed);
    let forwarded = match conn.alpn().as_deref() {
        Some(a) if a == felix_wire::internal::FORWARD_ALPN => 1,
        Some(a) if a == felix_wire::internal::FORWARD_AGAIN_ALPN => 2,
        _ => 0,
    };
    let scope = Rc::new(ConnScope::new(
        conn.id(),
        core.shared.limits,
        clock::now().instant,
        forwarded,
    ));
    core.unfinished.borrow_mut().open(conn.id(), conn.clone());
    core.unwritten.borrow_mut().open(conn.id(), conn.clone());
    let watchdog = task::spawn(auth_watchdog(conn.clone(), scope.clone()));
    let revocation = task::spawn(revocation_watch(core.clone(), conn.clone(), scope.clone()));
    loop {
        let next = futures_lite::future::or(
            async { conn.accept_bi().await.map(|(s, r)| (Some(s), r)) },
            async { conn.accept_uni().await.map(|r| (None, r)) },
        )
        .await;
        let Ok((send, recv)) = next else { break };
        let (core, scope, conn) = (core.clone(), scope.clone(), conn.clone());
        task::spawn(async move {
            serve_stream(core, scope, conn, send, recv).await;
        })
        .detach();
    }
    // The connection is gone, closed or silent past its idle timeout: every
    // subscription made on it ends now, whether or not it had anything to send.
    scope.close();
    core.unfinished.borrow_mut().forget(conn.id());
    core.unwritten.borrow_mut().forget(conn.id());
    drop(watchdog);
    drop(revocation);
    tracing::debug!(conn = ?scope.id, "connection ended");
    core.metrics.connections.fetch_sub(1, Ordering::Relaxed);
}

async fn auth_watchdog(conn: Connection, scope: Rc<ConnScope>) {
    loop {
        let now = clock::now().instant;
        let at = scope.auth.borrow().poll(now);
        match at {
            AuthTimer::Done => return,
            AuthTimer::Expired => {
                conn.close(CLOSE_AUTH_TIMEOUT, b"authentication timeout");
                return;
            }
            AuthTimer::WaitUntil(t) => task::sleep(t.saturating_duration_since(now)).await,
        }
    }
}

/// Distinct tokens (whole grants: see [`remember_grant`]) a connection keeps for revocation. A
/// grant is kept for the connection's life (dropping one whose streams ended closed no
/// idle connection a revocation should: a version holding weak references was tried),
/// so a client that authenticated each stream with a fresh token (a token provider
/// refreshing every few minutes) grew the list, and the check at every key change,
/// without bound. At this many, the grants no stream holds any more are dropped; past
/// it with every one held by a live stream, a stream with another token is refused
/// `limit_exceeded`.
pub const GRANTS_PER_CONNECTION: usize = 1024;

/// Keeps `grant` for [`revocation_watch`] unless the same grant is kept already (the
/// same token: tenant, signing key, token id, principal, expiry and permissions): an
/// SDK authenticates every stream it opens, so a list that kept each grew for the
/// connection's whole life. Answers the grant the stream is to hold (the kept one, so a
/// kept grant's count of holders tells whether a stream still uses it); `None` when the
/// list is full of grants streams hold.
///
/// Only an equal grant is shared. Until 2026-12-07 one a key set revokes alike (same
/// tenant, key and token id) was: two tokens without an id signed by one key matched,
/// and a stream authenticated with the second ran with the first's permissions and
/// expiry (wider, or narrower: a gateway multiplexing its users' tokens on one
/// connection, or a forwarding broker's one connection per token identity).
fn remember_grant(
    grants: &mut Vec<Rc<crate::auth::Grant>>,
    grant: &Rc<crate::auth::Grant>,
) -> Option<Rc<crate::auth::Grant>> {
    if let Some(kept) = grants.iter().find(|g| ***g == **grant) {
        return Some(kept.clone());
    }
    if grants.len() >= GRANTS_PER_CONNECTION {
        // Held by this list alone: no stream left to close for a revocation of it.
        grants.retain(|g| Rc::strong_count(g) > 1);
        if grants.len() >= GRANTS_PER_CONNECTION {
            return None;
        }
    }
    grants.push(grant.clone());
    Some(grant.clone())
}

/// Closes the connection once a key set arrives under which one of its grants no longer
/// holds (its signing key retired, its token revoked by id).
async fn revocation_watch(core: Rc<CoreBroker>, conn: Connection, scope: Rc<ConnScope>) {
    loop {
        core.keys_changed.changed().await;
        let keys = core.shared.keys.load();
        let why = scope.grants.borrow().iter().find_map(|g| keys.revoked(g));
        if let Some(why) = why {
            tracing::info!(conn = ?scope.id, reason = %why, "closing a connection whose token no longer holds");
            core.metrics
                .revoked_connections
                .fetch_add(1, Ordering::Relaxed);
            conn.close(CLOSE_REVOKED, format!("token revoked: {why}").as_bytes());
            return;
        }
    }
}

/// Watches this core's view of the verification keys and wakes the connections'
/// revocation checks when a new set is stored (only on a change: the sync stores one
/// only then).
pub async fn watch_keys(core: Rc<CoreBroker>) {
    let mut seen = Arc::as_ptr(&core.shared.keys.load_full());
    loop {
        task::sleep(KEY_CHECK).await;
        let now = Arc::as_ptr(&core.shared.keys.load_full());
        if now != seen {
            seen = now;
            core.keys_changed.wake_all();
        }
    }
}

/// Closes a connection because the broker is shutting down.
pub fn close_for_shutdown(conn: &Connection) {
    conn.close(CLOSE_SHUTDOWN, b"broker shutting down");
}

/// A stream's frame reader; what it holds of unfinished frames is counted in its core's
/// [`HeldBytes`](super::held::HeldBytes) until it is dropped.
struct StreamInput {
    reader: FrameReader,
    core: Rc<CoreBroker>,
    conn: ConnId,
    counted: usize,
    /// A request read whole and waiting for the connection's budget, by what the budget
    /// will charge it: held with the frames begun (it was held outside every bound).
    waiting: usize,
}

impl StreamInput {
    fn new(core: Rc<CoreBroker>, conn: ConnId) -> StreamInput {
        StreamInput {
            reader: FrameReader::preauth(),
            core,
            conn,
            counted: 0,
            waiting: 0,
        }
    }

    /// Counts `bytes` of a whole request waiting for the budget (0: no longer).
    fn hold_waiting(&mut self, bytes: usize) {
        self.waiting = bytes;
        self.count();
    }

    /// Reads the next whole frame. `Ok(None)` at a clean end of stream (or a lost one,
    /// or once the connection was closed for what its streams hold).
    async fn next_frame(&mut self, recv: &mut RecvStream) -> Result<Option<Frame>, FrameError> {
        loop {
            let next = self.reader.next_frame();
            self.count();
            if let Some(f) = next? {
                return Ok(Some(f));
            }
            match recv.read_chunk(256 * 1024).await {
                Ok(Some(chunk)) => self.reader.push(chunk),
                Ok(None) | Err(_) => return Ok(None),
            }
        }
    }

    /// Counts what the reader holds now; closes the connection a bound names.
    fn count(&mut self) {
        let now = self.reader.reserved() + self.waiting;
        if now != self.counted {
            count_held(
                &self.core,
                Holding::Unfinished,
                self.conn,
                self.counted,
                now,
            );
            self.counted = now;
        }
    }
}

impl Drop for StreamInput {
    fn drop(&mut self) {
        count_held(&self.core, Holding::Unfinished, self.conn, self.counted, 0);
    }
}

/// What a connection makes its core hold, bounded in [`HeldBytes`](super::held::HeldBytes).
#[derive(Clone, Copy)]
enum Holding {
    /// Frames its streams have begun and not finished.
    Unfinished,
    /// Answers QUIC has not taken yet.
    Unwritten,
}

/// One of `conn`'s streams holds `now` bytes of `what` where it held `before`; closes
/// the connection a bound names (after the table is released: closing may run code
/// that reports again).
fn count_held(core: &CoreBroker, what: Holding, conn: ConnId, before: usize, now: usize) {
    let table = match what {
        Holding::Unfinished => &core.unfinished,
        Holding::Unwritten => &core.unwritten,
    };
    let closed = table.borrow_mut().counted(conn, before, now);
    let Some((id, conn)) = closed else { return };
    let (code, reason, metric) = match what {
        Holding::Unfinished => (
            CLOSE_UNFINISHED,
            &b"overloaded: too many bytes of unfinished frames"[..],
            &core.metrics.unfinished_closed,
        ),
        Holding::Unwritten => (
            CLOSE_UNREAD,
            &b"overloaded: too many bytes of answers unread"[..],
            &core.metrics.unwritten_closed,
        ),
    };
    tracing::warn!(conn = ?id, reason = %String::from_utf8_lossy(reason), "closing a connection");
    metric.fetch_add(1, Ordering::Relaxed);
    // Closed from a task of its own a moment later, not at once from the stream task
    // that counted: quinn-proto 0.11.19 never sends CONNECTION_CLOSE if close() finds
    // the congestion window full with stream data queued (quinn-rs/quinn#2785, fixed
    // upstream by #2787, in no release here yet); the connection drains silently and the
    // client, seeing a stateless reset, loses the code. A writer whose answers are not
    // taken is that case; a moment later its queued data has usually gone out. Only
    // usually: under a saturated window the code can still be lost (the connection ends
    // either way). What the connection held is forgotten above at once.
    let reason = reason.to_vec();
    task::spawn(async move {
        task::sleep(Duration::from_millis(1)).await;
        conn.close(code, &reason);
    })
    .detach();
}

/// A stream's outbox and the two tasks that share it.
#[derive(Debug)]
struct Answers {
    outbox: RefCell<Outbox>,
    writer: RefCell<Option<Waker>>,
    reader: RefCell<Option<Waker>>,
    /// The writer could not write (the peer stopped reading or went away).
    failed: Cell<bool>,
    /// Answers done ahead of their turn.
    places: Places,
    /// Forwards, and appends behind them, pushed whose turn has not come (they start
    /// at it): an append read meanwhile waits its turn too.
    deferred: Rc<Cell<usize>>,
    /// A writer takes the answers (the stream is bidirectional): on a one-way stream
    /// nothing pushed is ever run.
    written: bool,
}

impl Answers {
    fn push(&self, answer: Answer) {
        self.outbox.borrow_mut().push(answer);
        if let Some(w) = self.writer.borrow_mut().take() {
            w.wake();
        }
    }

    fn close(&self) {
        self.outbox.borrow_mut().close();
        if let Some(w) = self.writer.borrow_mut().take() {
            w.wake();
        }
    }

    /// Waits until another request's answer fits (or the writer failed).
    async fn room(&self) {
        poll_fn(|cx| {
            if self.failed.get()
                || (self.outbox.borrow().has_room()
                    && self.places.placed.get() < STREAM_PLACED_BYTES_MAX)
            {
                Poll::Ready(())
            } else {
                *self.reader.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }

    fn wake_reader(&self) {
        if let Some(w) = self.reader.borrow_mut().take() {
            w.wake();
        }
    }
}

async fn write_answers(
    core: Rc<CoreBroker>,
    conn: ConnId,
    answers: Rc<Answers>,
    mut send: SendStream,
) {
    let mut batch = Vec::with_capacity(WRITE_BATCH_FRAMES);
    loop {
        let flush = poll_fn(|cx| {
            let f = answers
                .outbox
                .borrow_mut()
                .poll_flush(cx, &mut batch, WRITE_BATCH_FRAMES);
            if f == Flush::Wait {
                *answers.writer.borrow_mut() = Some(cx.waker().clone());
                return Poll::Pending;
            }
            Poll::Ready(f)
        })
        .await;
        match flush {
            Flush::Done => break,
            Flush::Wait => unreachable!("waits inside poll_fn"),
            Flush::Write => {
                answers.wake_reader();
                if !batch.is_empty() && write_counted(&core, conn, &mut send, &mut batch).await {
                    answers.failed.set(true);
                    answers.wake_reader();
                    return;
                }
                batch.clear();
            }
        }
    }
    let _ = send.finish();
}

/// How long QUIC may leave a batch of answers untaken before it counts as unread: a
/// client reading at its own pace (a full window, a busy peer) takes it well within
/// this; one that stopped reading does not.
const UNREAD_AFTER: Duration = Duration::from_secs(1);

/// Hands `batch` to QUIC; returns whether the stream failed. A batch QUIC has not taken
/// after [`UNREAD_AFTER`] counts against the connection's bound on unread answers until
/// it is taken.
async fn write_counted(
    core: &CoreBroker,
    conn: ConnId,
    send: &mut SendStream,
    batch: &mut [Bytes],
) -> bool {
    write_counted_behind(core, conn, send, batch, 0).await
}

/// [`write_counted`], with `behind` bytes held for the stream to send after `batch`
/// (the rest of a watch's snapshot) counted with it.
async fn write_counted_behind(
    core: &CoreBroker,
    conn: ConnId,
    send: &mut SendStream,
    batch: &mut [Bytes],
    behind: usize,
) -> bool {
    let bytes: usize = batch.iter().map(Bytes::len).sum::<usize>() + behind;
    let mut write = std::pin::pin!(send.write_chunks(batch));
    if let Some(written) = futures_lite::future::poll_once(write.as_mut()).await {
        return written.is_err();
    }
    if let Some(written) = task::timeout(UNREAD_AFTER, write.as_mut()).await {
        return written.is_err();
    }
    count_held(core, Holding::Unwritten, conn, 0, bytes);
    let written = write.await;
    count_held(core, Holding::Unwritten, conn, bytes, 0);
    written.is_err()
}

/// Serves one client-opened stream: handshake, then requests until it ends.
async fn serve_stream(
    core: Rc<CoreBroker>,
    scope: Rc<ConnScope>,
    conn: Connection,
    send: Option<SendStream>,
    mut recv: RecvStream,
) {
    let answered = send.is_some();
    let answers = Rc::new(Answers {
        outbox: RefCell::new(Outbox::new(core.shared.publish_window as usize)),
        writer: RefCell::default(),
        reader: RefCell::default(),
        failed: Cell::new(false),
        places: Places {
            core: core.clone(),
            conn: conn.id(),
            placed: Rc::default(),
        },
        deferred: Rc::default(),
        written: send.is_some(),
    });
    let writer =
        send.map(|s| task::spawn(write_answers(core.clone(), conn.id(), answers.clone(), s)));
    let mut input = StreamInput::new(core.clone(), conn.id());
    if let Some(session) =
        authenticate(&core, &scope, &answers, answered, &mut recv, &mut input).await
    {
        if !scope.trusted.replace(true) {
            // Trusted now: the receive window and streams it was held to open.
            conn.set_receive_window(core.shared.connection_window_bytes);
            conn.set_max_streams(core.shared.max_streams, core.shared.max_streams);
        }
        input
            .reader
            .set_max_payload_bytes(core.shared.max_frame_bytes);
        serve_requests(
            &core, &scope, &conn, &answers, &session, answered, &mut recv, &mut input,
        )
        .await;
    }
    drop(input);
    answers.close();
    if let Some(w) = writer {
        // The connection's end ends the answers still pending with it (dropped with the
        // writer and `answers`): a waiting group poll then hands back what it claimed,
        // uncounted, and one asked of another core is cancelled there. It waited on
        // for an answer nobody would read, claimed what came and counted an attempt.
        // Writes and settles run to completion whatever happens to their answers
        // (idempotent publishes still waiting for their producer table may be
        // dropped past a bound: `producers::Waiting`).
        let waiter = scope.next_waiter();
        futures_lite::future::or(w, scope.closed(waiter)).await;
        scope.stop_waiting(waiter);
    }
}

/// Reads and checks the first frame; queues its answer. `None`: the stream ends.
async fn authenticate(
    core: &CoreBroker,
    scope: &ConnScope,
    answers: &Answers,
    answered: bool,
    recv: &mut RecvStream,
    input: &mut StreamInput,
) -> Option<Session> {
    let frame = match input.next_frame(recv).await {
        Ok(Some(f)) => f,
        Ok(None) => return None,
        Err(e) => {
            if answered {
                let e = BrokerError::InvalidRequest(e.to_string());
                answers.push(Answer::Ready(Some(e.to_message(false).to_frame())));
            }
            return None;
        }
    };
    let keys = core.shared.keys.load();
    let env = HandshakeEnv {
        keys: &keys,
        served: served_features(core.shared.cluster.is_some()),
        draining: core.draining(),
        starting: !core.shared.ready.load(std::sync::atomic::Ordering::Relaxed),
        publish_window: core.shared.publish_window,
    };
    match handshake(&frame, &env, clock::now()) {
        Ok((mut session, reply)) => {
            let kept = remember_grant(&mut scope.grants.borrow_mut(), session.grant());
            let Some(kept) = kept else {
                tracing::debug!("stream refused at auth: too many tokens on one connection");
                if answered {
                    let e = BrokerError::LimitExceeded(format!(
                        "this connection's live streams authenticated with \
                         {GRANTS_PER_CONNECTION} distinct tokens: open a new connection \
                         for another"
                    ));
                    answers.push(Answer::Ready(Some(
                        e.to_message(session.coded()).to_frame(),
                    )));
                }
                return None;
            };
            session.hold_grant(kept);
            session.forwarded = scope.forwarded;
            scope.auth.borrow_mut().authenticated();
            core.unfinished.borrow_mut().trust(scope.id);
            core.unwritten.borrow_mut().trust(scope.id);
            if answered {
                answers.push(Answer::Ready(Some(reply)));
            }
            Some(session)
        }
        Err(refusal) => {
            tracing::debug!(error = %refusal.error, "stream refused at auth");
            if answered {
                answers.push(Answer::Ready(refusal.answer));
            }
            None
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_requests(
    core: &Rc<CoreBroker>,
    scope: &Rc<ConnScope>,
    conn: &Connection,
    answers: &Rc<Answers>,
    session: &Session,
    answered: bool,
    recv: &mut RecvStream,
    input: &mut StreamInput,
) {
    loop {
        answers.room().await;
        if answers.failed.get() || core.draining() || scope.closed.get() {
            return;
        }
        let (request, size) = match input.next_frame(recv).await {
            Ok(Some(frame)) => (dispatch::decode(&frame, answered), frame.payload.len()),
            Ok(None) => return,
            Err(e) => (dispatch::undecodable(&e), 0),
        };
        // Every request is held against the connection's budget while it is worked on:
        // a publish by its records, any other by its frame (cache puts and commits carry
        // values up to the frame limit, and pipelined on many streams they were held
        // without bound), and each at least by what its task takes.
        let bytes = match &request {
            Request::Publish(p) => p.bytes(),
            _ => size,
        }
        .max(dispatch::REQUEST_MIN_CHARGE);
        if !scope.budget.borrow_mut().try_take(bytes) {
            // Waiting, the request (decoded: a publish's records can be many times its
            // frame) counts against the bound on unfinished frames; a connection
            // waiting with more than that on its streams is closed.
            input.hold_waiting(bytes);
            let taken = scope.take_budget(bytes).await;
            input.hold_waiting(0);
            if !taken {
                return;
            }
        }
        // Then the core's: every connection's requests together.
        let in_core = core.request_bytes.borrow_mut().try_take(bytes);
        if in_core {
            core.note_request_bytes();
        } else {
            input.hold_waiting(bytes);
            let taken = scope.take_core_budget(core, bytes).await;
            input.hold_waiting(0);
            if !taken {
                scope.release_budget(bytes);
                return;
            }
        }
        let held = Some(Held {
            scope: scope.clone(),
            core: core.clone(),
            bytes,
            in_core: true,
            cross_core: None,
        });
        let action = dispatch::decide(session, core.as_ref(), request, answered, clock::now());
        let go_on = execute(core, scope, conn, answers, session, answered, action, held).await;
        if !go_on {
            return;
        }
    }
}

/// Carries out one action. Returns false to end the stream.
#[allow(clippy::too_many_arguments)]
async fn execute(
    core: &Rc<CoreBroker>,
    scope: &Rc<ConnScope>,
    conn: &Connection,
    answers: &Rc<Answers>,
    session: &Session,
    answered: bool,
    action: Action,
    mut held: Option<Held>,
) -> bool {
    match action {
        Action::Answer(frame) => {
            if answers.outbox.borrow().unanswered() == 0 {
                // Taken by the writer at once.
                answers.push(Answer::Ready(Some(frame)));
            } else {
                // Behind answers not yet taken (a waiting poll, a client not reading):
                // it is counted until it is (see `Places`).
                drop(held);
                let (frame, place) = answers.places.place(frame);
                answers.push(Answer::Pending(Box::pin(async move {
                    let _place = place;
                    Some(frame)
                })));
            }
            true
        }
        Action::Refused(e) => {
            tracing::trace!(error = %e, "unanswered publish refused");
            core.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
            true
        }
        Action::Close(frame) => {
            if answered {
                answers.push(Answer::Ready(frame));
            }
            false
        }
        Action::Append {
            key,
            records,
            answer,
            condition,
        } => {
            // Publishes to streams already on disk do not wait for (or fail with)
            // writing someone else's new stream.
            if let Err(e) = core.catalog_written_for(&key).await {
                reply_publish(answers, session, answer, Err(e));
                return true;
            }
            if !place_across_cores(core, &key, &mut held).await {
                return false;
            }
            let bytes: usize = records.iter().map(Bytes::len).sum();
            core.metrics
                .publish_bytes
                .fetch_add(bytes as u64, Ordering::Relaxed);
            let read_at = clock::now().instant;
            let defer = answers.deferred.get() > 0;
            let appended = if defer {
                // Behind a forward of this stream not yet sent (it goes when its turn
                // comes: a stream's forwards reach the leader in order), or an append
                // deferred so: this append waits its turn too, or it would land ahead
                // of a publish sent before it once the shard's leadership came here.
                let (core, deferred) = (core.clone(), answers.deferred.clone());
                deferred.set(deferred.get() + 1);
                Box::pin(async move {
                    deferred.set(deferred.get() - 1);
                    core.append(key, records, condition).await
                })
            } else {
                core.append(key, records, condition)
            };
            // A deferred append takes its turn in the answers even when none is owed.
            if answer.owed() || defer {
                let session = session.clone();
                // One clone of this core's handle (an Rc, core-local): no shared
                // reference count is touched per publish.
                let core = core.clone();
                answers.push(Answer::Pending(Box::pin(async move {
                    let outcome = acknowledged(&core, appended.await, read_at);
                    drop(held);
                    answer::publish(&session, answer, outcome, None)
                })));
            } else {
                task::spawn(async move {
                    let _ = appended.await;
                    drop(held);
                })
                .detach();
            }
            true
        }
        Action::Forward {
            route,
            frame,
            answer: forwarded,
        } => {
            if let Some(h) = held.as_mut() {
                h.leave_core();
            }
            let owed = match forwarded {
                Forwarded::Publish(a) => a.owed(),
                Forwarded::Json | Forwarded::JsonRead => true,
            };
            let call = core.forward(session, &route, frame, owed);
            if owed {
                let session = session.clone();
                let deferred = answers.deferred.clone();
                deferred.set(deferred.get() + 1);
                answers.push(Answer::Pending(Box::pin(async move {
                    // Sent now, at its turn.
                    deferred.set(deferred.get() - 1);
                    let reply = call.await;
                    drop(held);
                    match forwarded {
                        Forwarded::Publish(to) => answer::publish(
                            &session,
                            to,
                            answer::leader_publish_outcome(reply),
                            Some(&route),
                        ),
                        Forwarded::Json => Some(answer::relay_json(&session, reply)),
                        Forwarded::JsonRead => Some(answer::relay_json(
                            &session,
                            reply.map_err(answer::read_lost_is_retryable),
                        )),
                    }
                })));
            } else if answers.written {
                // Owed nothing, it still goes at its turn: spawned at once, a later
                // publish of this stream appended here (its shard's leadership came
                // here meanwhile) landed ahead of it, and two such forwards raced to
                // the leader. (On a one-way stream, nothing pushed runs: below.)
                let deferred = answers.deferred.clone();
                deferred.set(deferred.get() + 1);
                answers.push(Answer::Pending(Box::pin(async move {
                    deferred.set(deferred.get() - 1);
                    let _ = call.await;
                    drop(held);
                    None
                })));
            } else {
                task::spawn(async move {
                    let _ = call.await;
                    drop(held);
                })
                .detach();
            }
            true
        }
        Action::Cache { key, op, reply } => {
            // The catalog first, here, in arrival order, as a publish does: awaited in
            // each request's own task, the first writes to a cache made on first use
            // went on in whatever order their catalog writes finished, and writes of one
            // key took their places in the log out of the order sent.
            let written = core.catalog_written_for(&key).await;
            if !place_across_cores(core, &key, &mut held).await {
                return false;
            }
            let (core, session) = (core.clone(), session.clone());
            // Started now, not when its answer's turn comes: pipelined requests are in
            // flight together (and share a group commit).
            let (encoding, places) = (session.clone(), answers.places.clone());
            let started = run_to_completion(async move {
                let _held = held;
                let mut result = match written {
                    Ok(()) => core.cache(key, op).await,
                    Err(e) => Err(e),
                };
                if let Ok(CacheAnswer::Value(Some(v), _)) = &result
                    && !reply.put
                    && !places.fits(encoded_len(v.len()))
                {
                    // Its connection is closed for answers unread: nobody reads this.
                    result = Err(BrokerError::Overloaded("answers unread".into()));
                }
                places.place(cache_answer(&encoding, reply, result))
            });
            answers.push(Answer::Pending(Box::pin(async move {
                Some(taken(&session, started.await))
            })));
            true
        }
        Action::Query {
            key,
            query,
            request_id,
        } => {
            // It runs at its answer's turn, one at a time on its stream: it takes no
            // place at another core (a stream's queued reads would hold places while
            // waiting their turn), and holds no budget (`held` goes here).
            let (core, session) = (core.clone(), session.clone());
            answers.push(Answer::Pending(Box::pin(async move {
                let frame = match query {
                    dispatch::Query::Range(from, end, max_records, max_bytes) => {
                        match crate::reads::stream_read(
                            &core,
                            key,
                            from,
                            end,
                            max_records,
                            max_bytes,
                        )
                        .await
                        {
                            Ok((records, next)) => answer::fit(
                                &session,
                                Message::StreamRecords {
                                    records,
                                    next_offset: Offset(next),
                                    request_id,
                                }
                                .to_frame(),
                                || format!("records from offset {from}"),
                            ),
                            Err(e) => answer::error(&session, &e),
                        }
                    }
                    dispatch::Query::OffsetForTime(at) => {
                        match crate::reads::offset_for_time(&core, key, at).await {
                            Ok(offset) => Message::OffsetValue {
                                offset: offset.map(Offset),
                                request_id,
                            }
                            .to_frame(),
                            Err(e) => answer::error(&session, &e),
                        }
                    }
                };
                Some(frame)
            })));
            true
        }
        Action::CacheWatch {
            key,
            filter,
            from,
            retained,
        } => {
            if scope.subscriptions.get() >= scope.limits.subscriptions_per_connection {
                let e = BrokerError::LimitExceeded(format!(
                    "a connection may hold {} subscriptions and watches",
                    scope.limits.subscriptions_per_connection
                ));
                answers.push(Answer::Ready(Some(answer::error(session, &e))));
                return true;
            }
            scope.subscriptions.set(scope.subscriptions.get() + 1);
            let (tx, rx) = futures_channel::oneshot::channel::<Bytes>();
            answers.push(Answer::Pending(Box::pin(async move { rx.await.ok() })));
            let watch = CacheWatch {
                core: core.clone(),
                scope: scope.clone(),
                conn: conn.clone(),
                key,
                filter,
                id: scope.next_subscription.get(),
                shard_moved: session.features.contains(Features::SHARD_MOVED),
            };
            scope.next_subscription.set(watch.id + 1);
            let session = session.clone();
            task::spawn(watch.run(session, from, retained, tx)).detach();
            true
        }
        Action::State {
            key,
            op,
            request_id,
        } => {
            // The catalog first, in arrival order (see the cache's).
            let written = core.catalog_written_for(&key).await;
            if !place_across_cores(core, &key, &mut held).await {
                return false;
            }
            let (core, session) = (core.clone(), session.clone());
            let (encoding, places) = (session.clone(), answers.places.clone());
            let started = run_to_completion(async move {
                let _held = held;
                let mut result = match written {
                    Ok(()) => core.state(key, op).await,
                    Err(e) => Err(e),
                };
                // As a cache value's (see `Places::fits`).
                if let Ok(crate::core::StateAnswer::Value(Some((v, _)), _)) = &result
                    && !places.fits(encoded_len(v.len()))
                {
                    result = Err(BrokerError::Overloaded("answers unread".into()));
                }
                places.place(state_answer(&encoding, request_id, result))
            });
            answers.push(Answer::Pending(Box::pin(async move {
                Some(taken(&session, started.await))
            })));
            true
        }
        Action::Group {
            key,
            mut op,
            request_id,
        } => {
            let (core, session) = (core.clone(), session.clone());
            // A poll is cancelled with its connection (records claimed for a consumer
            // that went away would wait out their visibility); settles run to completion.
            if let crate::groups::GroupOp::Poll { wait_ms, .. } = &mut op {
                let asked = *wait_ms;
                let waiting = scope.hold_poll_wait(wait_ms);
                let cut = asked > 0 && *wait_ms == 0;
                if cut {
                    core.metrics.poll_waits_cut.fetch_add(1, Ordering::Relaxed);
                }
                // A poll that waits is bounded by the waiting polls' allowance; one that
                // does not (asked not to, or cut) is held like any request, and takes a
                // place at the shard's core when that is another.
                let mut held = held.filter(|_| waiting.is_none());
                if !place_across_cores(&core, &key, &mut held).await {
                    return false;
                }
                let (encoding, places) = (session.clone(), answers.places.clone());
                let started = task::spawn(async move {
                    let _waiting = waiting;
                    let answer = core.group(key, op).await;
                    drop(held);
                    if cut {
                        crate::core::pause_cut_poll(asked, &answer).await;
                    }
                    places.place(group_answer(&encoding, request_id, answer))
                });
                answers.push(Answer::Pending(Box::pin(async move {
                    let (frame, _place) = started.await;
                    Some(frame)
                })));
            } else {
                if !place_across_cores(&core, &key, &mut held).await {
                    return false;
                }
                let (encoding, places) = (session.clone(), answers.places.clone());
                let started = run_to_completion(async move {
                    let _held = held;
                    let answer = core.group(key, op).await;
                    places.place(group_answer(&encoding, request_id, answer))
                });
                answers.push(Answer::Pending(Box::pin(async move {
                    Some(taken(&session, started.await))
                })));
            }
            true
        }
        Action::Subscribe { key, start } => {
            if scope.subscriptions.get() >= scope.limits.subscriptions_per_connection {
                let e = BrokerError::LimitExceeded(format!(
                    "a connection may hold {} subscriptions",
                    scope.limits.subscriptions_per_connection
                ));
                answers.push(Answer::Ready(Some(answer::error(session, &e))));
                return true;
            }
            scope.subscriptions.set(scope.subscriptions.get() + 1);
            let (tx, rx) = futures_channel::oneshot::channel::<Bytes>();
            answers.push(Answer::Pending(Box::pin(async move { rx.await.ok() })));
            let sub = Subscription {
                core: core.clone(),
                scope: scope.clone(),
                conn: conn.clone(),
                key,
                format: EventFormat::for_flags(session.flags),
                skipped_before: session.flags.contains(Flags::EVENT_BATCH_SKIPPED),
                id: scope.next_subscription.get(),
                shard_moved: session.features.contains(Features::SHARD_MOVED),
                lagged_ends: session.features.contains(Features::SUBSCRIPTION_LAGGED),
            };
            scope.next_subscription.set(sub.id + 1);
            let session = session.clone();
            task::spawn(sub.run(session, start, tx)).detach();
            true
        }
    }
}

fn reply_publish(
    answers: &Answers,
    session: &Session,
    to: AnswerTo,
    outcome: Result<u64, BrokerError>,
) {
    if let Some(frame) = answer::publish(session, to, outcome, None) {
        answers.push(Answer::Ready(Some(frame)));
    }
}

/// A cache request's answer; one carrying a value too large for a frame (written
/// before values were bounded, or by an older broker) is refused `limit_exceeded`, as an
/// oversized read is, rather than sent for the reader to refuse at every retry.
fn cache_answer(
    session: &Session,
    reply: CacheReply,
    result: Result<CacheAnswer, BrokerError>,
) -> Bytes {
    let frame = match result {
        Err(e) => e.to_message(session.coded()),
        Ok(CacheAnswer::Condition(applied, version)) => Message::CacheConditionResult {
            applied,
            version,
            request_id: reply.request_id.unwrap_or_default(),
        },
        Ok(CacheAnswer::Counter(value)) => Message::CounterValue {
            value,
            request_id: reply.request_id.unwrap_or_default(),
        },
        Ok(CacheAnswer::Value(value, version)) if !reply.put => Message::CacheValue {
            tenant_id: reply.tenant,
            namespace: reply.namespace,
            cache: reply.cache,
            key: reply.key,
            // A delete of a value stored before values were bounded, too large to send
            // back: the delete happened, so it is answered as one, without the value
            // (refused `limit_exceeded` below, it would say the delete failed).
            value: match value {
                Some(v) if reply.delete && v.len() > crate::session::dispatch::VALUE_MAX_BYTES => {
                    None
                }
                v => v,
            },
            request_id: reply.request_id,
            // A get's version, for a read-modify-write with `cache_put_if` (the feature
            // says so); none to clients that did not ask for it.
            version: version.filter(|_| session.features.contains(Features::CACHE_CONDITIONAL)),
        },
        Ok(_) => Message::CacheOk {
            request_id: reply.request_id.unwrap_or_default(),
        },
    }
    .to_frame();
    answer::fit(session, frame, || "the cache value".into())
}

/// An append's outcome as its ack goes out. The lease is read once more: a broker
/// frozen between deciding an ack and sending it must not hand a client, seconds later,
/// an ack from a leadership it no longer holds.
fn acknowledged(
    core: &CoreBroker,
    appended: Result<felix_storage_uring::Appended, BrokerError>,
    read_at: std::time::Instant,
) -> Result<u64, BrokerError> {
    let outcome = appended.map(|a| a.first)?;
    if core
        .shared
        .cluster
        .as_ref()
        .is_some_and(|c| !c.lease_valid(clock::BootTime::now()))
    {
        return Err(BrokerError::Unacknowledged(
            "the lease lapsed before the acknowledgement was sent".into(),
        ));
    }
    core.metrics.publish_ack.observe(read_at.elapsed());
    Ok(outcome)
}

/// Starts `f` now as a task of its own that runs to completion even if the connection
/// goes away (a write once begun is finished, not abandoned half way), and returns the
/// wait for its outcome.
fn run_to_completion<T: 'static>(
    f: impl std::future::Future<Output = T> + 'static,
) -> futures_channel::oneshot::Receiver<T> {
    let (tx, rx) = futures_channel::oneshot::channel();
    task::spawn(async move {
        let _ = tx.send(f.await);
    })
    .detach();
    rx
}

/// About the bytes of an answer carrying a `len`-byte value (base64, and the rest of
/// the message).
fn encoded_len(len: usize) -> usize {
    len.div_ceil(3) * 4 + 512
}

fn state_answer(
    session: &Session,
    request_id: felix_wire::RequestId,
    result: Result<crate::core::StateAnswer, BrokerError>,
) -> Bytes {
    use crate::core::StateAnswer as A;
    use felix_wire::Offset;
    let frame = match result {
        Err(BrokerError::OffsetMismatch { tail }) => Message::PublishRefused {
            request_id,
            reason: felix_wire::message::PublishRefusalReason::OffsetMismatch {
                tail: Offset(tail),
            },
            message: format!("the shard's tail is {tail}"),
        },
        Err(e) => e.to_message(session.coded()),
        Ok(A::Committed(offset)) => Message::CommitOk {
            request_id,
            offset: Offset(offset),
        },
        Ok(A::Value(value, as_of)) => Message::StateValue {
            version: value.as_ref().map(|(_, v)| *v),
            value: value.map(|(v, _)| v),
            as_of: Some(Offset(as_of)),
            request_id,
        },
    }
    .to_frame();
    // As a cache answer (see `cache_answer`).
    answer::fit(session, frame, || "the state value".into())
}

fn group_answer(
    session: &Session,
    request_id: felix_wire::RequestId,
    result: Result<crate::groups::GroupAnswer, BrokerError>,
) -> Bytes {
    use crate::groups::GroupAnswer as A;
    use felix_wire::Offset;
    let first = match &result {
        Ok(A::Records(records)) => records.first().map(|r| r.offset.0),
        _ => None,
    };
    let frame = match result {
        Err(e) => e.to_message(session.coded()),
        Ok(A::Records(mut records)) => {
            // Counts of offsets without a record go only to clients that read them.
            if !session.features.contains(Features::GROUP_SKIPPED) {
                records.iter_mut().for_each(|r| r.skipped_before = 0);
            }
            Message::GroupRecords {
                records,
                request_id,
            }
        }
        Ok(A::Done) => Message::CacheOk { request_id },
        Ok(A::Extended(visible_ms)) => Message::GroupExtended {
            visible_ms,
            request_id,
        },
        Ok(A::DeadLetters(offsets)) => Message::GroupDeadLetterList {
            offsets: offsets.into_iter().map(Offset).collect(),
            request_id,
        },
        Ok(A::Position(offset, moved)) => Message::GroupPosition {
            offset: Offset(offset),
            moved,
            request_id,
        },
        Ok(A::Info {
            committed,
            tail,
            in_flight,
            owed,
            dead_letters,
        }) => Message::GroupInfo {
            committed: committed.map(Offset),
            tail: Offset(tail),
            in_flight,
            owed,
            dead_letters,
            request_id,
        },
        Ok(A::Deleted(existed)) => Message::GroupDeleted {
            existed,
            request_id,
        },
    }
    .to_frame();
    // Claimed and not delivered, the records come again once their visibility ends,
    // and a record that never fits is dead-lettered at the attempt limit.
    answer::fit(session, frame, || {
        format!("a group poll from offset {}", first.unwrap_or(0))
    })
}

/// One cache watch: its start asked of the shard's owner, then changes read from the
/// cache's log and sent on a broker-opened unidirectional stream until the connection
/// ends. A client that stops reading holds the pump back (QUIC flow control); nothing is
/// queued for it, so a watch never lags.
struct CacheWatch {
    core: Rc<CoreBroker>,
    scope: Rc<ConnScope>,
    conn: Connection,
    key: Arc<ShardKey>,
    filter: crate::shard::WatchFilter,
    id: u64,
    /// The client takes `shard_moved`.
    shard_moved: bool,
}

/// How long one read of a watch waits for a change before it asks again.
const WATCH_WAIT: Duration = Duration::from_secs(1);
/// How long a watch's start is asked again while the process's copies of current
/// values fill their bound, and the pauses between (doubling from the first).
const SNAPSHOT_WAIT: Duration = Duration::from_secs(3);
const SNAPSHOT_PAUSE_MIN: Duration = Duration::from_millis(10);
const SNAPSHOT_PAUSE_MAX: Duration = Duration::from_millis(250);

impl CacheWatch {
    async fn run(
        self,
        session: Session,
        from: Option<u64>,
        retained: bool,
        answer: futures_channel::oneshot::Sender<Bytes>,
    ) {
        use crate::core::{WatchAnswer, WatchReq};
        let sub_id = SubscriptionId(((self.core.core.index() as u64) << 48) | self.id);
        // While the copies other watches hold fill the process's bound, the start is
        // asked again for a while (they are given back as their watchers read), then
        // refused `overloaded`.
        let (mut pause, given_up) = (
            SNAPSHOT_PAUSE_MIN,
            std::time::Instant::now() + SNAPSHOT_WAIT,
        );
        let asked = async {
            loop {
                let start = self
                    .core
                    .watch(
                        self.key.clone(),
                        WatchReq::Start {
                            filter: self.filter.clone(),
                            from,
                            retained,
                        },
                    )
                    .await;
                match start {
                    Err(BrokerError::Overloaded(r))
                        if r == crate::shard::snapshots::SNAPSHOTS_FULL
                            && std::time::Instant::now() + pause < given_up =>
                    {
                        task::sleep(pause).await;
                        pause = (pause * 2).min(SNAPSHOT_PAUSE_MAX);
                    }
                    other => break Some(other),
                }
            }
        };
        // Its client gone meanwhile, it asks no more.
        let gone = async {
            self.scope.closed(self.id).await;
            None
        };
        let Some(start) = futures_lite::future::or(asked, gone).await else {
            self.scope.stop_waiting(self.id);
            self.scope
                .subscriptions
                .set(self.scope.subscriptions.get() - 1);
            return;
        };
        match start {
            Ok(WatchAnswer::Started {
                values,
                charge,
                resume,
                resnapshot,
                life,
            }) => {
                let _ = answer.send(
                    Message::CacheWatchStarted {
                        subscription_id: sub_id,
                        resume_offset: Offset(resume),
                        resnapshot,
                        retained_count: (retained || resnapshot).then_some(values.len() as u64),
                    }
                    .to_frame(),
                );
                futures_lite::future::or(
                    async {
                        let _ = self.pump(sub_id, values, charge, resume, life).await;
                    },
                    self.scope.closed(self.id),
                )
                .await;
            }
            Ok(other) => {
                let e = BrokerError::Internal(format!("mismatched watch answer {other:?}"));
                let _ = answer.send(answer::error(&session, &e));
            }
            Err(e) => {
                let _ = answer.send(answer::error(&session, &e));
            }
        }
        self.scope.stop_waiting(self.id);
        self.scope
            .subscriptions
            .set(self.scope.subscriptions.get() - 1);
    }

    async fn pump(
        &self,
        sub_id: SubscriptionId,
        first: Vec<crate::shard::WatchChange>,
        mut charge: crate::shard::snapshots::SnapshotCharge,
        mut from: u64,
        life: u64,
    ) -> Result<(), ()> {
        use crate::core::{WatchAnswer, WatchReq};
        let mut uni = self.conn.open_uni().await.map_err(|_| ())?;
        uni.write_chunk(
            Message::EventStreamHello {
                subscription_id: sub_id,
            }
            .to_frame(),
        )
        .await
        .map_err(|_| ())?;
        // A retained watch's snapshot may hold every value of the shard: encoded a page
        // at a time, each page written before the next is encoded, so a watcher that
        // does not read holds one page here, not the whole snapshot encoded. What the
        // snapshot still holds counts with the page against the bound on unread answers
        // (a watcher not reading kept it all, uncounted, for the watch's life). Its
        // charge against the process's bound on copies (`shard::snapshots`) is given
        // back as the keys are freed, page by page, and the rest once the copy's own
        // buffer is: at the end of this block, before the watch goes on live.
        {
            let mut left: usize = first.iter().map(watch_change_bytes).sum();
            let mut first = first.into_iter();
            loop {
                let (mut page, held, keys) = watch_page(&mut first, WATCH_PAGE_BYTES);
                if page.is_empty() {
                    break;
                }
                left -= held;
                charge.give_back(keys);
                if write_counted_behind(&self.core, self.scope.id, &mut uni, &mut page, left).await
                {
                    return Err(());
                }
            }
        }
        drop(charge);
        loop {
            let next = self
                .core
                .watch(
                    self.key.clone(),
                    WatchReq::Next {
                        filter: self.filter.clone(),
                        from,
                        wait: WATCH_WAIT,
                    },
                )
                .await;
            if uni.stopped().is_some() {
                // The client dropped the watch: with no change to write, nothing else
                // would notice.
                return Ok(());
            }
            match next {
                Ok(WatchAnswer::Changes(_, _, read_from)) if read_from != life => {
                    // Another life of the cache's log than the one the watch started on:
                    // deleted and made again under the name (reads go by name), its
                    // changes would have continued this watch as if they were the old
                    // cache's. Ended lagged: the client watches again from `from`.
                    return end_lagged(&mut uni, from).await;
                }
                Ok(WatchAnswer::Changes(changes, next, _)) => {
                    from = next;
                    let mut frames: Vec<Bytes> = changes.into_iter().map(watch_event).collect();
                    if write_counted(&self.core, self.scope.id, &mut uni, &mut frames).await {
                        return Err(());
                    }
                }
                Ok(_) => return Err(()),
                Err(e) => {
                    // Moved to another broker: a last `shard_moved` naming it and where
                    // to resume, as the protocol ends a watch of a shard that moved (the
                    // SDK follows it there; a `cache_watch_lagged` ended its watch). The
                    // cache's core may stop serving it (fenced by its successor: answered
                    // `not_ready`) a moment before this broker's view of the assignments
                    // names the successor: the view is given a while to, or the watch
                    // ended lagged in the middle of a planned move (seen once in a full
                    // test run; a drain hands shards on the same way). Other refusals (a
                    // cut past the watch, a lapsed lease, a deleted cache, overload) end
                    // it at once; a closed connection ends the pump.
                    let fenced = matches!(&e, BrokerError::ShardUnavailable(r) if r == "not_ready");
                    let deadline = clock::now().instant + MOVE_NOTICE_WAIT;
                    loop {
                        if let Resolved::Remote(route) = self.core.resolve(&self.key)
                            && self.shard_moved
                        {
                            self.core
                                .metrics
                                .subscriptions_moved
                                .fetch_add(1, Ordering::Relaxed);
                            let _ = uni.write_chunk(shard_moved(sub_id, from, &route)).await;
                            let _ = uni.finish();
                            return Ok(());
                        }
                        if !fenced
                            || !self.shard_moved
                            || clock::now().instant >= deadline
                            || uni.stopped().is_some()
                        {
                            break;
                        }
                        task::sleep(Duration::from_millis(20)).await;
                    }
                    // The shard cannot be read here now (this broker lost it, or is
                    // taking it over): the watch ends and the client re-watches from
                    // `from`.
                    return end_lagged(&mut uni, from).await;
                }
            }
        }
    }
}

/// Ends a subscription whose stream was deleted: `stream_deleted`, then the stream's
/// end.
async fn deleted(uni: &mut SendStream, sub_id: SubscriptionId) {
    let last = Message::StreamDeleted {
        subscription_id: sub_id,
    }
    .to_frame();
    let _ = uni.write_chunk(last).await;
    let _ = uni.finish();
}

/// How long a watch whose cache stopped serving here waits for this broker's view of
/// the assignments to name the broker it moved to, before it ends lagged.
const MOVE_NOTICE_WAIT: Duration = Duration::from_secs(2);

/// Ends a watch with `cache_watch_lagged`: the client watches again from `from`.
async fn end_lagged(uni: &mut SendStream, from: u64) -> Result<(), ()> {
    let lagged = Message::CacheWatchLagged {
        resume_from: Offset(from),
    }
    .to_frame();
    let _ = uni.write_chunk(lagged).await;
    let _ = uni.finish();
    Ok(())
}

/// The last frame of a subscription or watch whose shard moved to `route`: where it
/// went and the offset to resume from.
fn shard_moved(sub_id: SubscriptionId, resume_from: u64, route: &crate::cluster::Route) -> Bytes {
    Message::ShardMoved {
        subscription_id: sub_id,
        resume_from: Some(Offset(resume_from)),
        node_id: Some(route.leader.to_string()),
        addr: route.addr.map(|a| a.to_string()),
        generation: Generation(route.generation),
    }
    .to_frame()
}

/// About how many bytes of a watch's snapshot are encoded at once.
const WATCH_PAGE_BYTES: usize = 1 << 20;

/// The next events of `changes`, encoded, until about `max_bytes` (at least one); with
/// what the changes taken held ([`watch_change_bytes`]) and their keys' bytes.
fn watch_page(
    changes: &mut impl Iterator<Item = crate::shard::WatchChange>,
    max_bytes: usize,
) -> (Vec<Bytes>, usize, usize) {
    let mut page = Vec::new();
    let (mut bytes, mut held, mut keys) = (0, 0, 0);
    while bytes < max_bytes {
        let Some(c) = changes.next() else { break };
        held += watch_change_bytes(&c);
        keys += c.key.len();
        let frame = watch_event(c);
        bytes += frame.len();
        page.push(frame);
    }
    (page, held, keys)
}

/// What a change held in memory takes: its key, its value and itself.
fn watch_change_bytes(c: &crate::shard::WatchChange) -> usize {
    std::mem::size_of::<crate::shard::WatchChange>()
        + c.key.len()
        + c.value.as_ref().map_or(0, Bytes::len)
}

fn watch_event(c: crate::shard::WatchChange) -> Bytes {
    Message::CacheEvent {
        key: c.key,
        value: c.value,
        offset: Offset(c.offset),
        expires_at_millis: c.expires_at_ms,
    }
    .to_frame()
}

/// One subscription: registered with the shard's owner, pumped until the connection
/// ends, the client stops reading, or the broker stops.
struct Subscription {
    core: Rc<CoreBroker>,
    scope: Rc<ConnScope>,
    conn: Connection,
    key: Arc<ShardKey>,
    format: EventFormat,
    id: u64,
    /// The client takes `shard_moved`.
    shard_moved: bool,
    /// The client takes `subscription_lagged`: end at the first drop.
    lagged_ends: bool,
    /// The client reads `skipped_before` in event batches.
    skipped_before: bool,
}

impl Subscription {
    async fn run(
        self,
        session: Session,
        start: Option<StartPosition>,
        answer: futures_channel::oneshot::Sender<Bytes>,
    ) {
        let sub_id = SubscriptionId(((self.core.core.index() as u64) << 48) | self.id);
        // Deliveries another core dropped from here on may be this subscription's.
        let lost_before = self
            .core
            .metrics
            .deliveries_lost_inbound
            .load(Ordering::Relaxed);
        match self.core.subscribe(self.key.clone(), start).await {
            Ok((queue, start, live)) => {
                let _ = answer.send(
                    Message::Subscribed {
                        subscription_id: sub_id,
                        start_offset: Some(Offset(start)),
                        live_offset: Some(Offset(live)),
                        queue_capacity: None,
                    }
                    .to_frame(),
                );
                let mut pump = Pump::new(self.key.clone(), start, self.format);
                if self.lagged_ends {
                    pump = pump.ending_at_drop();
                }
                if self.skipped_before {
                    pump = pump.counting_skipped();
                }
                futures_lite::future::or(
                    async {
                        let _ = self.pump(&queue, pump, (live, lost_before), sub_id).await;
                    },
                    self.scope.closed(self.id),
                )
                .await;
                self.core.unsubscribe(self.key.clone(), &queue);
            }
            Err(BrokerError::Cursor {
                reason,
                requested,
                available,
            }) => {
                let _ = answer.send(
                    Message::SubscribeCursorError {
                        reason,
                        requested: Offset(requested),
                        available: Offset(available),
                    }
                    .to_frame(),
                );
            }
            Err(e) => {
                let _ = answer.send(answer::error(&session, &e));
            }
        }
        self.scope.stop_waiting(self.id);
        self.scope
            .subscriptions
            .set(self.scope.subscriptions.get() - 1);
    }

    /// The shard moved to `route`: a last `shard_moved` (to clients that take it) naming
    /// the successor and the offset to resume from, then the stream ends.
    async fn moved(
        &self,
        uni: &mut SendStream,
        sub_id: SubscriptionId,
        resume_from: u64,
        route: &crate::cluster::Route,
    ) {
        self.core
            .metrics
            .subscriptions_moved
            .fetch_add(1, Ordering::Relaxed);
        if self.shard_moved {
            let _ = uni
                .write_chunk(shard_moved(sub_id, resume_from, route))
                .await;
        }
        let _ = uni.finish();
    }

    /// The subscription could not send `resume_from` (the log no longer holds it): a
    /// last `subscription_lagged` naming it, then the stream ends.
    async fn lagged(
        &self,
        uni: &mut SendStream,
        sub_id: SubscriptionId,
        resume_from: u64,
    ) -> Result<(), ()> {
        self.core
            .metrics
            .subscriptions_lagged
            .fetch_add(1, Ordering::Relaxed);
        let last = Message::SubscriptionLagged {
            subscription_id: sub_id,
            resume_from: Offset(resume_from),
        }
        .to_frame();
        uni.write_chunk(last).await.map_err(|_| ())?;
        let _ = uni.finish();
        Ok(())
    }

    /// History from the log up to `live`, then live batches, on a broker-opened
    /// unidirectional stream. `lost_before` is the core's count of deliveries lost
    /// inbound from before the subscription registered. Err when the client went away.
    async fn pump(
        &self,
        queue: &Rc<SubQueue>,
        mut pump: Pump,
        (live, lost_before): (u64, u64),
        sub_id: SubscriptionId,
    ) -> Result<(), ()> {
        let mut uni = self.conn.open_uni().await.map_err(|_| ())?;
        uni.write_chunk(
            Message::EventStreamHello {
                subscription_id: sub_id,
            }
            .to_frame(),
        )
        .await
        .map_err(|_| ())?;
        // History: never dropped; a slow reader slows the replay.
        self.read_back(&mut uni, queue, &mut pump, live, sub_id)
            .await?;
        if let Some(at) = pump.lagged() {
            return self.lagged(&mut uni, sub_id, at).await;
        }
        let metrics = &self.core.metrics;
        let lost_inbound = || metrics.deliveries_lost_inbound.load(Ordering::Relaxed);
        // Counted from the queue's start: batches dropped while the history was sent
        // (nothing takes from the queue then) are read back like any later drop; the
        // stream may stay quiet after them, with no later batch to show the gap.
        let (mut dropped_seen, mut lost_seen) = (0, lost_before);
        let mut ready = Vec::with_capacity(LIVE_WRITE_BATCHES);
        let mut frames = Vec::with_capacity(LIVE_WRITE_BATCHES);
        loop {
            // Batches dropped at the tail leave no later batch to reveal the gap: after
            // any drop, by this queue or by another core's full outbound queue to this
            // core, read the log to its end before waiting again. The wait is bounded
            // so a drop by another core is noticed while idle.
            if queue.dropped.get() != dropped_seen || lost_inbound() != lost_seen {
                (dropped_seen, lost_seen) = (queue.dropped.get(), lost_inbound());
                metrics.subscriber_catchups.fetch_add(1, Ordering::Relaxed);
                self.read_back(&mut uni, queue, &mut pump, u64::MAX, sub_id)
                    .await?;
                if let Some(at) = pump.lagged() {
                    return self.lagged(&mut uni, sub_id, at).await;
                }
            }
            let env = match task::timeout(GAP_CHECK, queue.next()).await {
                Some(Some(env)) => env,
                Some(None) => match queue.ending() {
                    Some(Ending::Draining) => {
                        uni.reset(u32::from(ErrorCode::Draining.number().unwrap_or(0)));
                        return Ok(());
                    }
                    Some(Ending::Deleted) => {
                        deleted(&mut uni, sub_id).await;
                        return Ok(());
                    }
                    Some(Ending::Failed) => {
                        uni.reset(u32::from(ErrorCode::ShardUnavailable.number().unwrap_or(0)));
                        return Ok(());
                    }
                    Some(Ending::Unsubscribed) | None => break,
                },
                None => {
                    // Idle, a client that stopped reading the stream (dropped its
                    // subscription) is noticed by no write: the subscription ends here,
                    // or it stayed live on a quiet stream until the connection closed.
                    if uni.stopped().is_some() {
                        return Ok(());
                    }
                    // Idle: if the shard has moved to another broker, say where and end,
                    // rather than stall silently.
                    if let Resolved::Remote(route) = self.core.resolve(&self.key) {
                        self.moved(&mut uni, sub_id, pump.next(), &route).await;
                        return Ok(());
                    }
                    continue;
                }
            };
            ready.push(env);
            queue.take_ready(LIVE_WRITE_BATCHES - 1, &mut ready);
            for env in ready.drain(..) {
                loop {
                    match pump.on_live(&env) {
                        Live::Stale => break,
                        Live::Foreign => {
                            metrics.foreign_batches.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Live::Frame(f) => {
                            frames.push(f);
                            break;
                        }
                        Live::Gap { to } => {
                            self.write(&mut uni, &mut frames).await?;
                            frames.clear();
                            metrics.subscriber_catchups.fetch_add(1, Ordering::Relaxed);
                            self.read_back(&mut uni, queue, &mut pump, to, sub_id)
                                .await?;
                            if queue.ending() == Some(Ending::Deleted) {
                                // It stopped at the deletion: not lagged over what it
                                // did not read.
                                self.write(&mut uni, &mut frames).await?;
                                deleted(&mut uni, sub_id).await;
                                return Ok(());
                            }
                            // What the log no longer holds (retention) is skipped, or
                            // ends the subscription.
                            pump.skip_to(to);
                            if let Some(at) = pump.lagged() {
                                self.write(&mut uni, &mut frames).await?;
                                return self.lagged(&mut uni, sub_id, at).await;
                            }
                        }
                    }
                }
            }
            self.write(&mut uni, &mut frames).await?;
            frames.clear();
        }
        let _ = uni.finish();
        Ok(())
    }

    /// Hands `frames` to QUIC, counted against the connection's bound on unread
    /// answers while QUIC leaves them untaken (a subscriber that stopped reading).
    /// Err when the stream failed.
    async fn write(&self, uni: &mut SendStream, frames: &mut [Bytes]) -> Result<(), ()> {
        if write_counted(&self.core, self.scope.id, uni, frames).await {
            return Err(());
        }
        Ok(())
    }

    /// Writes the committed records `[pump.next(), to)` from the log. What the log no
    /// longer holds is skipped, or (for a client that takes `subscription_lagged`) ends
    /// the subscription: see [`Pump::lagged`].
    async fn read_back(
        &self,
        uni: &mut SendStream,
        queue: &SubQueue,
        pump: &mut Pump,
        to: u64,
        sub_id: SubscriptionId,
    ) -> Result<(), ()> {
        let mut frames = Vec::new();
        let mut retries = 0u32;
        while pump.next() < to && pump.lagged().is_none() {
            let batches = match self
                .core
                .read(self.key.clone(), pump.next(), HISTORY_READ_BYTES)
                .await
            {
                Ok(b) => b,
                Err(BrokerError::Cursor { available, .. }) => {
                    // Retention removed what this subscriber had not read yet.
                    pump.skip_to(available);
                    continue;
                }
                // (`Draining` from a log closed under the read: by the stream's deletion,
                // whose pass on this core then ends the queue `Deleted`, or the next
                // read finds no such stream; or by a move. Only a broker that drains
                // itself ends the subscription with it.)
                Err(
                    e @ (BrokerError::Overloaded(_)
                    | BrokerError::ShardUnavailable(_)
                    | BrokerError::Draining),
                ) if retries < HISTORY_READ_RETRIES
                    && queue.ending() != Some(Ending::Deleted)
                    && !(matches!(e, BrokerError::Draining) && self.core.draining()) =>
                {
                    if let Resolved::Remote(route) = self.core.resolve(&self.key) {
                        // Moved to another broker: say where, as an idle pump does.
                        self.moved(uni, sub_id, pump.next(), &route).await;
                        return Err(());
                    }
                    // A full cross-core queue, a shard between cores: it passes.
                    retries += 1;
                    task::sleep(Duration::from_millis(5 << retries.min(6))).await;
                    continue;
                }
                Err(e)
                    if queue.ending() == Some(Ending::Deleted)
                        || matches!(e, BrokerError::NotFound(_)) =>
                {
                    // The stream was deleted: its shard closed before this core's part
                    // of the deletion ended the queue (at another core, or in the same
                    // pass). Ended as that would end it, not with a reset the SDK takes
                    // for a lost shard to subscribe to again (under the name, perhaps
                    // in a stream made again). Ended Deleted, its end takes nothing
                    // from a stream made again under the name (`CoreBroker::unsubscribe`).
                    queue.close(Ending::Deleted);
                    deleted(uni, sub_id).await;
                    return Err(());
                }
                Err(e) => {
                    // Not the client's leaving: end the stream with an error, not
                    // finished, or the client takes the end for a normal one and
                    // never resumes what it missed.
                    tracing::warn!(shard = %self.key, error = %e, "a subscription's read failed: ended");
                    uni.reset(u32::from(e.code().number().unwrap_or(0)));
                    return Err(());
                }
            };
            retries = 0;
            if queue.ending() == Some(Ending::Deleted) {
                // The stream was deleted while this was read: reads go by name, and a
                // stream made again under it meanwhile would have answered with its
                // records. (Such records exist only once this core closed the queue:
                // the deletion ends here first.) `stream_deleted` follows.
                break;
            }
            let done = pump.on_history(&batches, to, &mut frames);
            self.write(uni, &mut frames).await?;
            frames.clear();
            if done {
                break;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::testing::{parse_frame, session, session_with};
    use felix_wire::message::GroupRecord;

    #[test]
    fn a_waiter_polled_again_and_again_keeps_one_waker_in_the_list() {
        let (a, b) = (crate::wakes::Wakes::new(), crate::wakes::Wakes::new());
        let mut waiters = Waiters::default();
        let (mut at_a, mut at_b) = (None, None);
        for _ in 0..40_000 {
            waiters.register(&mut at_a, a.waker());
            waiters.register(&mut at_b, b.waker());
        }
        assert_eq!(waiters.list.len(), 2, "one for each task waiting");
        waiters.take().into_iter().for_each(Waker::wake);
        assert_eq!((a.count(), b.count()), (1, 1));
        // Woken, each registers again in the emptied list, once.
        for _ in 0..3 {
            waiters.register(&mut at_b, b.waker());
        }
        waiters.register(&mut at_a, a.waker());
        assert_eq!(waiters.list.len(), 2);
        waiters.take().into_iter().for_each(Waker::wake);
        assert_eq!((a.count(), b.count()), (2, 2));
    }

    /// Registering finds a waiter's place without scanning the list: 16,384 requests
    /// of one connection, each polled once per wake of them all, made a wake quadratic.
    #[test]
    fn registering_does_not_scan_the_list() {
        let tasks: Vec<_> = (0..4).map(|_| crate::wakes::Wakes::new()).collect();
        let mut waiters = Waiters::default();
        let mut places = vec![None; 20_000];
        for (i, place) in places.iter_mut().enumerate() {
            waiters.register(place, tasks[i % 4].waker());
        }
        // Twenty thousand waiters of four tasks: each keeps its own place (a scan by
        // `will_wake` would have kept four).
        assert_eq!(waiters.list.len(), 20_000);
        for (i, place) in places.iter_mut().enumerate() {
            waiters.register(place, tasks[i % 4].waker());
        }
        assert_eq!(waiters.list.len(), 20_000, "each is there once");
    }

    #[test]
    fn a_connection_keeps_one_grant_per_token_however_many_streams_authenticate() {
        let mut grants = Vec::new();
        let one = Rc::new(crate::session::testing::grant(vec![]));
        for _ in 0..1000 {
            assert!(remember_grant(&mut grants, &Rc::new((*one).clone())).is_some());
        }
        assert_eq!(grants.len(), 1);
        let mut other = (*one).clone();
        other.jti = Some("t-2".into());
        assert!(remember_grant(&mut grants, &Rc::new(other)).is_some());
        assert_eq!(grants.len(), 2, "a token revoked apart is kept apart");
    }

    /// Past `GRANTS_PER_CONNECTION` distinct tokens a new one is refused (a client
    /// minting a token per stream grew the list for the connection's life); the ones
    /// kept still authenticate.
    #[test]
    fn a_connection_keeps_a_bounded_number_of_distinct_tokens() {
        let mut grants = Vec::new();
        let base = crate::session::testing::grant(vec![]);
        let with_jti = |i: usize| {
            let mut g = base.clone();
            g.jti = Some(format!("t-{i}"));
            Rc::new(g)
        };
        // Each held by a live stream.
        let live: Vec<_> = (0..GRANTS_PER_CONNECTION)
            .map(|i| remember_grant(&mut grants, &with_jti(i)).unwrap())
            .collect();
        assert!(remember_grant(&mut grants, &with_jti(GRANTS_PER_CONNECTION)).is_none());
        assert_eq!(grants.len(), GRANTS_PER_CONNECTION);
        let again = remember_grant(&mut grants, &with_jti(7)).expect("a kept token");
        assert!(
            Rc::ptr_eq(&again, &live[7]),
            "the stream holds the kept grant"
        );
        // Once the streams of some tokens ended, theirs make room (a token provider
        // refreshing every few minutes reached the bound in days).
        drop(again);
        drop(live);
        let fresh = remember_grant(&mut grants, &with_jti(GRANTS_PER_CONNECTION));
        assert!(fresh.is_some());
        assert_eq!(grants.len(), 1);
    }

    /// A stream keeps its own token's permissions and expiry though another token of
    /// the same tenant, key and (absent) id authenticated a stream of the connection
    /// first: it took the first's, wider or narrower.
    #[test]
    fn a_stream_holds_its_own_tokens_grant_not_an_alike_ones() {
        let mut grants = Vec::new();
        let reader = Rc::new(crate::session::testing::grant(vec![
            "stream.subscribe:stream:t1/*/*".into(),
        ]));
        let writer = Rc::new(crate::session::testing::grant(vec![
            "stream.publish:stream:t1/*/*".into(),
        ]));
        assert!(reader.revoked_with(&writer), "alike to a key set");
        let first = remember_grant(&mut grants, &reader).unwrap();
        let second = remember_grant(&mut grants, &writer).unwrap();
        assert!(Rc::ptr_eq(&first, &reader));
        assert!(
            Rc::ptr_eq(&second, &writer),
            "the second stream holds its own grant"
        );
        assert_eq!(grants.len(), 2);
        // The same token again shares the kept grant.
        let again = Rc::new(crate::session::testing::grant(vec![
            "stream.publish:stream:t1/*/*".into(),
        ]));
        assert!(Rc::ptr_eq(
            &remember_grant(&mut grants, &again).unwrap(),
            &writer
        ));
        assert_eq!(grants.len(), 2);
    }

    /// `skipped_before` goes only to clients that negotiated `GROUP_SKIPPED`; the others
    /// get records as before.
    #[test]
    fn group_records_count_skipped_offsets_only_for_clients_that_read_them() {
        let answer = || {
            Ok(crate::groups::GroupAnswer::Records(vec![GroupRecord {
                offset: Offset(9),
                payload: Bytes::from_static(b"r"),
                attempts: 1,
                skipped_before: 4,
                publisher: None,
                timestamp_micros: Some(1),
            }]))
        };
        let skipped = |s: &Session| match Message::decode(
            &parse_frame(&group_answer(s, felix_wire::RequestId(1), answer())).payload,
        )
        .unwrap()
        {
            Message::GroupRecords { records, .. } => records[0].skipped_before,
            other => panic!("{other:?}"),
        };
        let reads = session_with(
            crate::auth::all_data_perms(crate::session::testing::TENANT),
            Features::ERROR_CODES | Features::GROUP_SKIPPED,
        );
        assert_eq!(skipped(&reads), 4);
        assert_eq!(skipped(&session()), 0);
    }

    /// A poll answer whose record is too large for a client's 16 MiB frames, base64 in
    /// JSON, is answered `limit_exceeded`: sent, the client's decoder refused it and
    /// the connection was lost, each time the record came again.
    #[test]
    fn an_answer_too_large_for_a_frame_is_refused_by_name() {
        let record = |len: usize| {
            Ok(crate::groups::GroupAnswer::Records(vec![GroupRecord {
                offset: Offset(9),
                payload: Bytes::from(vec![7u8; len]),
                attempts: 1,
                skipped_before: 0,
                publisher: None,
                timestamp_micros: Some(1),
            }]))
        };
        let s = session_with(
            crate::auth::all_data_perms(crate::session::testing::TENANT),
            Features::ERROR_CODES,
        );
        let max = felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES as usize;
        let big = group_answer(&s, felix_wire::RequestId(1), record(13 << 20));
        assert!(big.len() <= max, "{} bytes sent", big.len());
        match Message::decode(&parse_frame(&big).payload).unwrap() {
            Message::Error { code, message, .. } => {
                assert_eq!(code, Some(felix_wire::ErrorCode::LimitExceeded));
                assert!(message.contains("offset 9"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        // Up to the frame's bound it goes as it is.
        let fits = group_answer(&s, felix_wire::RequestId(1), record(12 << 20 >> 1));
        assert!(matches!(
            Message::decode(&parse_frame(&fits).payload).unwrap(),
            Message::GroupRecords { .. }
        ));
    }

    /// A cache or state value too large for a frame (stored before values were
    /// bounded) is answered `limit_exceeded`, not sent for the reader to refuse.
    #[test]
    fn a_stored_value_too_large_for_a_frame_is_refused_not_sent() {
        let s = session_with(
            crate::auth::all_data_perms(crate::session::testing::TENANT),
            Features::ERROR_CODES,
        );
        let reply = || crate::session::dispatch::CacheReply {
            tenant: "t1".into(),
            namespace: "n".into(),
            cache: "c".into(),
            key: "k".into(),
            request_id: Some(felix_wire::RequestId(1)),
            put: false,
            delete: false,
        };
        let value = |len: usize| Bytes::from(vec![7u8; len]);
        let code = |frame: &Bytes| match Message::decode(&parse_frame(frame).payload).unwrap() {
            Message::Error { code, .. } => code,
            _ => None,
        };
        let big = cache_answer(
            &s,
            reply(),
            Ok(CacheAnswer::Value(Some(value(13 << 20)), None)),
        );
        assert_eq!(code(&big), Some(felix_wire::ErrorCode::LimitExceeded));
        let fits = cache_answer(
            &s,
            reply(),
            Ok(CacheAnswer::Value(Some(value(1 << 20)), None)),
        );
        assert_eq!(code(&fits), None);
        // A delete of such a value happened: answered as done, without the value.
        let deleted = cache_answer(
            &s,
            crate::session::dispatch::CacheReply {
                delete: true,
                ..reply()
            },
            Ok(CacheAnswer::Value(Some(value(13 << 20)), None)),
        );
        match Message::decode(&parse_frame(&deleted).payload).unwrap() {
            Message::CacheValue { value, .. } => assert_eq!(value, None),
            other => panic!("{other:?}"),
        }
        let state = |len: usize| {
            state_answer(
                &s,
                felix_wire::RequestId(1),
                Ok(crate::core::StateAnswer::Value(Some((value(len), 3)), 4)),
            )
        };
        assert_eq!(
            code(&state(13 << 20)),
            Some(felix_wire::ErrorCode::LimitExceeded)
        );
        assert_eq!(code(&state(1 << 20)), None);
    }

    /// A snapshot is encoded a page at a time: each page about the bound (over it by
    /// one event at most), every event once, in order.
    #[test]
    fn a_watch_snapshot_is_encoded_a_page_at_a_time() {
        let changes: Vec<crate::shard::WatchChange> = (0..1000u64)
            .map(|i| crate::shard::WatchChange {
                key: format!("k{i}"),
                value: Some(Bytes::from(vec![b'v'; 3000])),
                offset: i,
                expires_at_ms: 0,
            })
            .collect();
        let one = watch_event(changes[0].clone()).len();
        let mut it = changes.into_iter();
        let (mut pages, mut events) = (0, 0);
        loop {
            let (page, _, _) = watch_page(&mut it, 64 << 10);
            if page.is_empty() {
                break;
            }
            let bytes: usize = page.iter().map(Bytes::len).sum();
            assert!(bytes < (64 << 10) + 2 * one, "a page of {bytes} bytes");
            for f in &page {
                let Message::CacheEvent { offset, .. } =
                    Message::decode(&parse_frame(f).payload).unwrap()
                else {
                    panic!("a cache event");
                };
                assert_eq!(offset.0, events);
                events += 1;
            }
            pages += 1;
        }
        assert_eq!(events, 1000);
        assert!(pages > 40, "{pages} pages");
    }
}
